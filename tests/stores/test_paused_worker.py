"""A worker paused between announcing an effect and starting it is taken over; continued,
it starts nothing and writes nothing, and says its lease was lost.

Worker A is a child process (``tests/kit/paused_worker_agent.py``) on PostgreSQL with a short
lease. It stops itself (``SIGSTOP``) right after the intent of a payment (a tool whose
replay is never allowed) or of a model call (``model_replay=NEVER``) is durable: the one
moment when the effect is announced and nothing of it has started, so whatever A does
once continued, it decides after the stop. Its lease runs out; worker B, a store object
in this process, resumes the run, which ends ``IN_DOUBT``. For the payment a person
settles it (it did not go through), and B pays and finishes the run. Then A is
continued: it must not pay, nor call its model, nor write, since another worker owns
the run now and may already have done the same; it stops with ``LeaseLost``. Every
payment and model call, by either worker, is noted in a file outside the store, which
is the proof of what ran.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL

import anyio
import anyio.abc
import pytest

from kit import child_agent
from kit import paused_worker_agent as agent
from polyloop import (
    ActionStatus,
    IntentKind,
    RunLog,
    RunState,
    StopReason,
    resume,
    run_status,
    settle,
)
from polyloop.cli import main as polyloop_command
from polyloop.stores import PostgresStore

# Slow: child processes stopped with SIGSTOP until their lease lapses.
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

RUN_ID = "r"
# Bounds for what must happen long before them; none is a pause the tests wait out.
STOP_TIMEOUT_S = 30.0  # the child starts, claims, writes and stops itself
LEASE_TIMEOUT_S = agent.LEASE_S * 10  # the stopped child's lease runs out
EXIT_TIMEOUT_S = 20.0  # the continued child reports and exits


@dataclass(frozen=True)
class PausedWorker:
    """Worker A, stopped by itself: its process, and the ledger as it left it."""

    process: anyio.abc.Process
    ledger_at_stop: list[str]


@dataclass(frozen=True)
class Continued:
    """What worker A did once continued: its exit status, what it said, and the effects
    it noted in the ledger after its stop."""

    status: int
    said: str
    effects: list[str]

    @property
    def error_class(self) -> str:
        return self.said.partition(": ")[0]


async def ledger_lines(ledger: Path) -> list[str]:
    """Every effect noted so far, in the order the workers noted them."""
    path = anyio.Path(ledger)
    return (await path.read_text()).splitlines() if await path.exists() else []


async def all_of(stream: anyio.abc.ByteReceiveStream | None) -> str:
    """What an ended child wrote to one of its pipes."""
    assert stream is not None
    return b"".join([chunk async for chunk in stream]).decode().strip()


async def _until_stopped(worker: anyio.abc.Process) -> None:
    """Until worker A has stopped itself; fail at once, with its stderr, if it ended."""
    with anyio.fail_after(STOP_TIMEOUT_S):
        # Nothing wakes a parent when its child stops, but the child's state: poll it.
        while (change := child_agent.stopped_or_ended(worker.pid)) is None:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    if change != "stopped":
        pytest.fail(f"worker A ended before it stopped itself: {await all_of(worker.stderr)}")


@asynccontextmanager
async def paused_worker_a(
    conninfo: str, tmp_path: Path, backend: str, stop_after: IntentKind
) -> AsyncIterator[PausedWorker]:
    """Worker A, started, then stopped by itself right after its first ``stop_after``
    intent; on the way out it is killed and reaped if it still runs, whatever happened."""
    ledger = tmp_path / "ledger"
    command = [sys.executable, agent.__file__, backend, conninfo, RUN_ID, stop_after, ledger]
    process = await anyio.open_process([str(part) for part in command], stdin=DEVNULL)
    try:
        await _until_stopped(process)
        yield PausedWorker(process, await ledger_lines(ledger))
    finally:
        if process.returncode is None:
            process.kill()  # a stopped process dies of SIGKILL too
        with anyio.move_on_after(EXIT_TIMEOUT_S, shield=True):
            await process.wait()
        await process.aclose()


async def continue_worker_a(worker: PausedWorker, ledger: Path) -> Continued:
    """Let worker A go on; wait for its exit; what it said and what it did since its stop."""
    os.kill(worker.process.pid, signal.SIGCONT)
    with anyio.fail_after(EXIT_TIMEOUT_S):
        status = await worker.process.wait()
    since_stop = (await ledger_lines(ledger))[len(worker.ledger_at_stop) :]
    said = await all_of(worker.process.stdout) or await all_of(worker.process.stderr)
    return Continued(
        status=status,
        said=said,
        effects=[line for line in since_stop if line.split()[1] == agent.WORKER],
    )


async def until_lease_ended(store: PostgresStore, worker: PausedWorker) -> None:
    """Until nobody holds the run: A's lease ran out while its process lives, stopped."""
    with anyio.fail_after(LEASE_TIMEOUT_S):
        # The database's clock, not this process, says when the lease ends: poll it.
        while (stored := await store.describe_run(RUN_ID)) is not None and stored.claimed:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert stored is not None, "worker A's run is not in the store"
    assert stored.owner is not None and f"pid {worker.process.pid}" in stored.owner
    assert worker.process.returncode is None  # alive: only the lease let the run go


async def log_left_by_a(conninfo: str) -> tuple[RunLog, RunState]:
    """The run's log and state read through a new store object once A has exited, after
    ``polyloop verify`` found the log clean."""
    verified = await anyio.to_thread.run_sync(polyloop_command, ["verify", conninfo, RUN_ID])
    assert verified == 0, "polyloop verify found the log damaged"
    async with PostgresStore(conninfo) as reader:
        return await reader.read_log(RUN_ID), (await run_status(reader, RUN_ID)).state


async def test_a_worker_paused_after_announcing_a_payment_pays_nothing_once_continued(
    postgres_conninfo: str, tmp_path: Path, anyio_backend: str
) -> None:
    ledger = tmp_path / "ledger"
    async with paused_worker_a(
        postgres_conninfo, tmp_path, anyio_backend, IntentKind.ACTION
    ) as worker_a:
        # A asked its model, then announced the payment and stopped before paying.
        assert worker_a.ledger_at_stop == ["model A r:0:model", "stop A r:0:action"]
        async with PostgresStore(postgres_conninfo) as store:
            await until_lease_ended(store, worker_a)
            definition, request = agent.build(store, RUN_ID, str(ledger), "B")
            in_doubt = await resume(definition, request)
            assert in_doubt.stop_reason is StopReason.IN_DOUBT
            assert (in_doubt.detail or "").startswith("action intent 'r:0:action'")
            assert await ledger_lines(ledger) == worker_a.ledger_at_stop  # B ran nothing
            await settle(
                store,
                RUN_ID,
                by="alice",
                ran=False,
                observation="the payment did not go through",
            )
            finished = await resume(definition, request)
            left_by_b = await store.read_log(RUN_ID)
        assert finished.stop_reason is StopReason.FINAL_ANSWER
        settled, paid, answered = finished.steps
        assert settled.action_status is ActionStatus.NOT_EXECUTED
        assert settled.settled_by == "alice"
        assert paid.action_status is ActionStatus.EXECUTED
        assert answered.final_answer == "paid once"
        assert (await ledger_lines(ledger))[len(worker_a.ledger_at_stop) :] == [
            "model B r:1:model",
            "pay B r:1:action",
            "model B r:2:model",
        ]
        continued = await continue_worker_a(worker_a, ledger)

    assert continued.effects == [], f"A, continued, ran {continued.effects}: {continued.said}"
    payments = [line for line in await ledger_lines(ledger) if line.startswith("pay ")]
    assert payments == ["pay B r:1:action"]  # exactly one payment, B's
    assert (continued.error_class, continued.status) == ("LeaseLost", agent.EXIT_REFUSED), (
        continued.said
    )
    log, state = await log_left_by_a(postgres_conninfo)
    assert log == left_by_b  # A wrote nothing: every record is B's, and only B's
    assert state is RunState.FINISHED


async def test_a_worker_paused_after_announcing_a_model_call_calls_nothing_once_continued(
    postgres_conninfo: str, tmp_path: Path, anyio_backend: str
) -> None:
    ledger = tmp_path / "ledger"
    async with paused_worker_a(
        postgres_conninfo, tmp_path, anyio_backend, IntentKind.MODEL_CALL
    ) as worker_a:
        # A announced its first model call and stopped before making it.
        assert worker_a.ledger_at_stop == ["stop A r:0:model"]
        async with PostgresStore(postgres_conninfo) as store:
            await until_lease_ended(store, worker_a)
            in_doubt = await resume(*agent.build(store, RUN_ID, str(ledger), "B"))
            left_by_b = await store.read_log(RUN_ID)
        # The call may have reached the provider and may not be made again: in doubt.
        assert in_doubt.stop_reason is StopReason.IN_DOUBT
        assert (in_doubt.detail or "").startswith("model_call intent 'r:0:model'")
        continued = await continue_worker_a(worker_a, ledger)

    assert continued.effects == [], f"A, continued, ran {continued.effects}: {continued.said}"
    assert await ledger_lines(ledger) == ["stop A r:0:model"]  # no model was called, by anyone
    assert (continued.error_class, continued.status) == ("LeaseLost", agent.EXIT_REFUSED), (
        continued.said
    )
    log, state = await log_left_by_a(postgres_conninfo)
    assert log == left_by_b  # A wrote nothing: every record is B's, and only B's
    assert state is RunState.IN_DOUBT
