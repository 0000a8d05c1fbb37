"""Temporal workers that are killed, hung, stopped or restarted cost no run and repeat no effect.

Each test runs worker processes (``tests/kit/temporal_worker_agent.py``) on one task queue of
a real Temporal development server, all sharing one PostgreSQL database, and drives many
runs of an agent that pays once and answers. A worker is killed (``SIGKILL``) while
payments are in flight, stopped (``SIGSTOP``) past its lease and continued, shut down
gracefully (``SIGTERM``) mid-payment, or every worker is replaced while a run waits for
an approval. Every payment is a line of a ledger file outside the store, written before
the payment's answer comes back: the ledger, not the store, proves what ran, and it is
what a person settles a run in doubt with (the ``settle`` update). At the end every
workflow has completed, every run paid as its tool's replay policy allows, and
``polyloop verify`` finds every log clean.

Asyncio only (Temporal's SDK runs on nothing else); slow (child processes, heartbeat
timeouts and leases that must run out).
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import DEVNULL
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.service import RPCError

import polyloop
from kit import child_agent
from kit import temporal_worker_agent as agent
from kit.temporal import dev_server
from polyloop import RunEnded, StopReason
from polyloop.cli import main as polyloop_command
from polyloop.stores import PostgresStore
from polyloop.temporal import AgentRun, ApproveInput, RunInput, SettleInput, start_agent_run

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

RUNS = 40
# How long a silent worker keeps a segment before Temporal gives it to another.
HEARTBEAT_S = 2.0
# Bounds for what must happen long before them; none is a pause the tests wait out.
READY_TIMEOUT_S = 60.0
ALL_DONE_TIMEOUT_S = 180.0
EXIT_TIMEOUT_S = 60.0
SRC = str(Path(polyloop.__file__).resolve().parent.parent)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def temporal_address() -> Iterator[str]:
    with dev_server() as address:
        yield address


@pytest.fixture
async def client(temporal_address: str) -> Client:
    return await Client.connect(temporal_address)


@dataclass
class Fleet:
    """The worker processes of one test, on one task queue, noting effects in one ledger."""

    address: str
    conninfo: str
    tmp_path: Path
    queue: str = field(default_factory=lambda: f"fleet-{uuid.uuid4().hex[:8]}")
    processes: dict[str, anyio.abc.Process] = field(default_factory=dict)

    @property
    def ledger(self) -> str:
        return str(self.tmp_path / "ledger")

    async def lines(self) -> list[str]:
        return await anyio.to_thread.run_sync(agent.ledger_lines, self.ledger)

    async def until(self, line: str) -> None:
        """Until the ledger holds ``line``; fail, with the workers' stderr, if it never does."""
        with anyio.move_on_after(READY_TIMEOUT_S):
            # The ledger is written by other processes; nothing wakes this one: poll it.
            while line not in await self.lines():  # noqa: ASYNC110
                await anyio.sleep(0.02)
            return
        pytest.fail(f"no {line!r} in the ledger after {READY_TIMEOUT_S} s; {await self.stderr()}")

    async def first(self, prefix: str) -> str:
        """The first ledger line that starts with ``prefix``, once there is one."""
        with anyio.move_on_after(READY_TIMEOUT_S):
            while True:
                found = [line for line in await self.lines() if line.startswith(prefix)]
                if found:
                    return found[0]
                await anyio.sleep(0.02)  # the ledger is another process's: poll it
        pytest.fail(f"no {prefix!r} line in the ledger; {await self.stderr()}")

    async def start(self, name: str, mode: str, *, stop: bool = False) -> anyio.abc.Process:
        """Worker ``name``, polling its queue by the time this returns."""
        command = [sys.executable, agent.__file__, self.address, self.queue, self.conninfo]
        command += [self.ledger, name, mode, *(["stop"] if stop else [])]
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *sys.path])}
        stderr = await anyio.to_thread.run_sync(open, self.tmp_path / f"{name}.stderr", "ab")
        try:
            process = await anyio.open_process(
                command, stdin=DEVNULL, stdout=DEVNULL, stderr=stderr, env=environment
            )
        finally:
            stderr.close()  # the child holds its own copy
        self.processes[name] = process
        await self.until(f"ready {name} -")
        return process

    async def stop(self, name: str) -> int:
        """Shut worker ``name`` down gracefully (``SIGTERM``); its exit status."""
        process = self.processes[name]
        process.terminate()
        with anyio.fail_after(EXIT_TIMEOUT_S):
            return await process.wait()

    async def stderr(self) -> str:
        said = []
        for name in self.processes:
            text = await anyio.Path(self.tmp_path / f"{name}.stderr").read_text()
            said.append(f"worker {name}: {text[-3000:]}")
        return "\n".join(said)

    async def close(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                process.kill()  # a stopped process dies of SIGKILL too
            with anyio.move_on_after(EXIT_TIMEOUT_S, shield=True):
                await process.wait()
            await process.aclose()


@pytest.fixture
async def fleet(
    temporal_address: str, postgres_conninfo: str, tmp_path: Path
) -> AsyncIterator[Fleet]:
    workers = Fleet(temporal_address, postgres_conninfo, tmp_path)
    try:
        yield workers
    finally:
        await workers.close()


def payments(lines: list[str], run_id: str) -> list[str]:
    """The workers that paid for run ``run_id``, in ledger order."""
    return [
        line.split()[1]
        for line in lines
        if line.startswith("pay ") and line.split()[2].startswith(f"{run_id}:")
    ]


async def start_runs(client: Client, fleet: Fleet, count: int) -> list[WorkflowHandle[Any, Any]]:
    suffix = uuid.uuid4().hex[:8]
    return [
        await start_agent_run(
            client,
            RunInput(agent=agent.AGENT, run_id=f"pay-{i}-{suffix}", heartbeat_timeout=HEARTBEAT_S),
            task_queue=fleet.queue,
        )
        for i in range(count)
    ]


@dataclass
class Ending:
    """How the runs ended: each workflow's result, and each settlement sent (ran or not)."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    settled: dict[str, bool] = field(default_factory=dict)


async def drive_to_the_end(handles: list[WorkflowHandle[Any, Any]], fleet: Fleet) -> Ending:
    """Until every workflow completes, settling each run in doubt with the ledger's truth."""
    ending = Ending()
    pending = {handle.id: handle for handle in handles}
    with anyio.fail_after(ALL_DONE_TIMEOUT_S):
        while pending:
            for run_id, handle in list(pending.items()):
                try:
                    status = await handle.query(AgentRun.status)
                except RPCError:
                    # A query needs a worker; one that just died may hold the workflow's
                    # sticky task until Temporal gives it to another: ask again later.
                    continue
                if status["state"] == "finished":
                    ending.results[run_id] = await handle.result()
                    del pending[run_id]
                elif status["waiting_for"] == "settlement":
                    ran = bool(payments(await fleet.lines(), run_id))
                    ending.settled[run_id] = ran
                    try:
                        await handle.execute_update(
                            AgentRun.settle,
                            SettleInput(
                                by="ops",
                                ran=ran,
                                observation="paid 5" if ran else "no payment was made",
                                result_id=status["open_intent"]["result_id"],
                            ),
                        )
                    except (RPCError, WorkflowUpdateFailedError):
                        # The server, busy, may drop the call after applying it: the next
                        # round asks again if the run still waits (the same truth), and the
                        # ledger, checked afterwards, says whether anything ran twice.
                        continue
            # Workflows end in other processes; nothing wakes this one: poll them.
            await anyio.sleep(0.2)
    return ending


async def verified(conninfo: str, run_ids: list[str]) -> None:
    """``polyloop verify`` finds every log clean; each run has one final end record."""
    status = await anyio.to_thread.run_sync(polyloop_command, ["verify", conninfo])
    assert status == 0, "polyloop verify found a damaged log"
    async with PostgresStore(conninfo) as store:
        for run_id in run_ids:
            log = await store.read_log(run_id)
            ends = [record for record in log.records if isinstance(record, RunEnded)]
            assert ends and ends[-1] is log.records[-1], run_id
            assert ends[-1].stop_reason is StopReason.FINAL_ANSWER, run_id


async def kill_inside_a_payment(fleet: Fleet, name: str) -> str:
    """SIGKILL worker ``name`` right after it made its second payment, whose answer is
    still on the way; the run of that payment."""
    with anyio.fail_after(READY_TIMEOUT_S):
        while True:
            made = [line for line in await fleet.lines() if line.startswith(f"pay {name} ")]
            if len(made) >= 2:
                fleet.processes[name].kill()
                return made[-1].split()[2].partition(":")[0]
            await anyio.sleep(0.01)  # the ledger is another process's: poll it


async def test_a_worker_killed_while_never_payments_are_in_flight_costs_no_run_and_no_payment(
    client: Client, fleet: Fleet
) -> None:
    await fleet.start("A", "never")
    await fleet.start("B", "never")
    handles = await start_runs(client, fleet, RUNS)
    killed_inside = await kill_inside_a_payment(fleet, "A")

    ending = await drive_to_the_end(handles, fleet)

    lines = await fleet.lines()
    assert {result["stop_reason"] for result in ending.results.values()} == {"final_answer"}
    for handle in handles:
        assert len(payments(lines, handle.id)) == 1, (handle.id, payments(lines, handle.id))
    # The payment the kill landed in was made, its answer lost: in doubt, settled as made.
    assert ending.settled.get(killed_inside) is True, ending.settled
    # Only the dead worker's runs were ever in doubt; B paid for every one settled unpaid.
    for run_id, ran in ending.settled.items():
        assert payments(lines, run_id) == (["A"] if ran else ["B"]), run_id
    await verified(fleet.conninfo, [handle.id for handle in handles])


async def test_a_worker_killed_while_allowed_payments_are_in_flight_replays_them_and_loses_none(
    client: Client, fleet: Fleet
) -> None:
    await fleet.start("A", "allowed")
    await fleet.start("B", "allowed")
    handles = await start_runs(client, fleet, RUNS)
    killed_inside = await kill_inside_a_payment(fleet, "A")

    ending = await drive_to_the_end(handles, fleet)

    lines = await fleet.lines()
    assert ending.settled == {}  # a payment whose replay is allowed is never in doubt
    assert {result["stop_reason"] for result in ending.results.values()} == {"final_answer"}
    for handle in handles:
        paid_by = payments(lines, handle.id)
        # Never lost; made twice only where the dead worker's answer never came back.
        assert paid_by in (["A"], ["B"], ["A", "B"]), (handle.id, paid_by)
    assert payments(lines, killed_inside) == ["A", "B"]  # replayed by the survivor
    await verified(fleet.conninfo, [handle.id for handle in handles])


async def test_a_worker_stopped_past_its_lease_starts_nothing_once_continued(
    client: Client, fleet: Fleet
) -> None:
    worker_a = await fleet.start("A", "never", stop=True)
    await fleet.start("B", "never")
    handles = await start_runs(client, fleet, RUNS)
    # A stops itself right after its first payment intent is durable, before paying.
    stop = await fleet.first("stop A ")
    stopped_run = stop.split()[2].partition(":")[0]
    with anyio.fail_after(READY_TIMEOUT_S):
        while child_agent.stopped_or_ended(worker_a.pid) is None:  # noqa: ASYNC110 - nothing wakes us
            await anyio.sleep(0.02)
    assert child_agent.stopped_or_ended(worker_a.pid) == "stopped"

    # Its lease runs out while it is stopped; B drives every run to its end.
    ending = await drive_to_the_end(handles, fleet)
    os.kill(worker_a.pid, signal.SIGCONT)
    end = await fleet.first(f"end A {stopped_run} ")
    # Whichever reaches A first: the lease check before the payment (LeaseLost), or the
    # cancellation Temporal sends once A's heartbeat learns the segment went elsewhere,
    # whose CANCELLED end record the lease refuses (the log's last record is B's).
    assert end.split()[3] in ("LeaseLost", "Cancelled"), end
    assert await fleet.stop("A") == 0

    lines = await fleet.lines()
    assert {result["stop_reason"] for result in ending.results.values()} == {"final_answer"}
    assert not [line for line in lines if line.startswith("pay A ")], "A paid after its stop"
    for handle in handles:
        assert payments(lines, handle.id) == ["B"], handle.id
    assert ending.settled.get(stopped_run) is False  # announced, never made: B paid it
    await verified(fleet.conninfo, [handle.id for handle in handles])


async def test_an_approval_pending_while_every_worker_is_replaced_runs_the_tool_once(
    client: Client, fleet: Fleet
) -> None:
    await fleet.start("A", "approval")
    await fleet.start("B", "approval")
    (handle,) = await start_runs(client, fleet, 1)
    with anyio.fail_after(READY_TIMEOUT_S):
        while (await handle.query(AgentRun.status))["waiting_for"] != "approval":  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert (await fleet.stop("A"), await fleet.stop("B")) == (0, 0)
    await fleet.start("C", "approval")
    await fleet.start("D", "approval")

    verdict = await handle.execute_update(AgentRun.approve, ApproveInput(by="alice"))
    with anyio.fail_after(ALL_DONE_TIMEOUT_S):
        outcome = await handle.result()

    assert verdict["approved"] is True
    assert outcome["stop_reason"] == "final_answer"
    assert payments(await fleet.lines(), handle.id) in (["C"], ["D"])
    await verified(fleet.conninfo, [handle.id])


async def test_a_worker_shut_down_mid_payment_ends_the_segment_not_the_run(
    client: Client, fleet: Fleet
) -> None:
    await fleet.start("A", "allowed")
    (handle,) = await start_runs(client, fleet, 1)
    await fleet.until(f"pay A {handle.id}:0:action")
    # Graceful: the Worker context exits, cancelling the segment it runs.
    assert await fleet.stop("A") == 0
    await fleet.start("B", "allowed")

    with anyio.fail_after(ALL_DONE_TIMEOUT_S):
        outcome = await handle.result()

    lines = await fleet.lines()
    assert f"end A {handle.id} Cancelled" in lines
    assert outcome["stop_reason"] == "final_answer"
    assert payments(lines, handle.id) == ["A", "B"]  # replay allowed: B made it again
    async with PostgresStore(fleet.conninfo) as store:
        log = await store.read_log(handle.id)
    ends = [record.stop_reason for record in log.records if isinstance(record, RunEnded)]
    # A's kernel ended the run CANCELLED; B resumed it from the log to its end.
    assert ends == [StopReason.CANCELLED, StopReason.FINAL_ANSWER]
    await verified(fleet.conninfo, [handle.id])
