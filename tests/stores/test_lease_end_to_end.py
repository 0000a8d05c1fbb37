"""Leases end to end, on PostgreSQL and real time.

Only what needs two workers and a real clock is here: a stopped worker's run is taken
over and the revived worker writes nothing, a live worker keeps its run through a call
longer than its lease, and a stuck event loop loses its run. Every step of the lease
itself (renewals, failures, stalls, lapses, new owner ids) is tested on a fake clock in
``test_lease_keeper.py``. The stopped worker is a child process (``tests/kit/lease.py``) sent
``SIGSTOP`` inside its model call or its tool; every execution of the tool, whose replay
is never allowed, is counted in a file outside the store.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import lease as lease_kit
from kit import one_writer
from polyloop import (
    Replay,
    RunLocked,
    RunState,
    StopReason,
    recover,
    run,
    run_status,
)

# Slow: real leases lapsing in real time, with stopped child processes.
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

LEASE_S = 1.0


def _place(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A database and a schema of its own for the test."""
    return request.getfixturevalue("postgres_shared"), request.getfixturevalue("postgres_schemas")()


async def _wait_for(path: Path) -> None:
    """Until another process creates ``path`` (no event crosses processes: poll)."""
    with anyio.fail_after(15):
        while not await anyio.Path(path).exists():  # noqa: ASYNC110
            await anyio.sleep(0.02)


@pytest.mark.parametrize("where", ["model", "tool"])
async def test_a_stopped_worker_is_taken_over_and_writes_nothing_once_revived(
    request: pytest.FixtureRequest, tmp_path: Path, where: str
) -> None:
    location, schema = _place(request)
    ledger, marker = tmp_path / "ledger", tmp_path / "marker"
    child = await anyio.open_process(
        [
            sys.executable,
            lease_kit.__file__,
            location,
            schema,
            "r",
            where,
            str(LEASE_S),
            str(ledger),
            str(marker),
        ]
    )
    store = lease_kit.open_store(location, schema, LEASE_S)
    note = one_writer.file_note(str(ledger))
    definition = lease_kit.definition(store, note, one_writer.Model(note))

    def request_for(run_id: str) -> Any:
        return one_writer.request(run_id, lease_kit.held_tools(note, None), Replay.ALLOWED)

    try:
        await _wait_for(marker)
        os.kill(child.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # While the child's lease holds, the run is its own; then anyone may take it.
        with anyio.fail_after(15):
            # The database, not this process, decides when the lease ends: poll.
            while (status := await run_status(store, "r")).state is RunState.RUNNING:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert time.monotonic() - stopped_at > LEASE_S / 3
        assert status.owner is not None and f"pid {child.pid}" in status.owner
        assert status.lease_expires_at is not None
        assert status.lease_expires_at <= datetime.now(UTC)
        (recovered,) = await recover(definition, store, request_for, max_concurrent=1)
        assert recovered.error is None, recovered.error
        taken_over = (await store.read_log("r")).records
    finally:
        os.kill(child.pid, signal.SIGCONT)
    with anyio.fail_after(20):
        await child.wait()
    assert child.stdout is not None
    out = (await child.stdout.receive()).decode().strip()
    await child.aclose()
    await store.aclose()  # type: ignore[attr-defined]

    assert out.startswith("refused LeaseLost"), out
    reader = lease_kit.open_store(location, schema, LEASE_S)
    assert (await reader.read_log("r")).records == taken_over
    final = await run_status(reader, "r")  # type: ignore[arg-type]  # the log reads back valid
    assert final.state in (RunState.FINISHED, RunState.IN_DOUBT)
    result = recovered.result
    assert result is not None
    if where == "model":
        # The model call may be repeated, the tool had not been announced: the run ends.
        assert result.stop_reason is StopReason.SUBMITTED
    else:
        # The tool may not be repeated: whatever the child did inside it is in doubt.
        assert result.stop_reason is StopReason.IN_DOUBT
    executions = ledger.read_text().splitlines()
    assert executions.count("tool r:0:action") == 1  # never twice, whoever ran it
    await reader.aclose()  # type: ignore[attr-defined]


async def test_a_live_worker_keeps_its_run_through_a_call_longer_than_its_lease(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    location, schema = _place(request)
    # Long enough that a busy machine's late renewal does not end it, short enough
    # that the held call outlasts it several times.
    lease_s = 1.0
    driver = lease_kit.open_store(location, schema, lease_s)
    other = lease_kit.open_store(location, schema, lease_s)
    notes: list[str] = []
    marker = tmp_path / "marker"
    model = lease_kit.HeldModel(notes.append, marker)  # waits HOLD_S in its first call
    outcome: dict[str, Any] = {}

    async def drive() -> None:
        outcome["result"] = await run(
            lease_kit.definition(driver, notes.append, model),
            one_writer.request("r", lease_kit.held_tools(notes.append, None), Replay.ALLOWED),
        )

    refusals = 0
    taken_while: RunState | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(drive)
        await _wait_for(marker)
        while "result" not in outcome:
            try:
                await other.claim_run("r")
            except RunLocked:
                # The driver holds the run until it gives it up, just after its end record.
                state = (await run_status(other, "r")).state  # type: ignore[arg-type]
                assert state in (RunState.RUNNING, RunState.FINISHED), state
                refusals += state is RunState.RUNNING
                await anyio.sleep(0.1)
            else:
                # Only a run its driver has ended may be claimed: between the driver
                # giving the run up and ``run`` returning, the claim is free.
                taken_while = (await run_status(other, "r")).state  # type: ignore[arg-type]
                await other.release_run("r")
                break
    assert taken_while in (None, RunState.FINISHED), taken_while
    assert outcome["result"].stop_reason is StopReason.SUBMITTED
    assert refusals > lease_kit.HOLD_S / lease_s  # the call outlasted several leases
    await driver.aclose()  # type: ignore[attr-defined]
    await other.aclose()  # type: ignore[attr-defined]


async def test_a_worker_whose_event_loop_was_stuck_past_its_lease_stops_writing(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A loop blocked by a synchronous call cannot renew; the run stops at its next
    write (no effect starts once the loss is known), and another worker takes it over."""
    location, schema = _place(request)
    lease_s = 0.4
    store = lease_kit.open_store(location, schema, lease_s)
    notes: list[str] = []

    class BlockingModel(one_writer.Model):
        async def call(self, call: Any) -> Any:
            time.sleep(lease_s * 4)  # noqa: ASYNC251 - the point: the loop is stuck
            return await super().call(call)

    # The message says what happened: the loop, not the database, held the renewal up.
    with pytest.raises(RunLocked, match=r"lease ended .* event loop once took \d"):
        await run(
            lease_kit.definition(store, notes.append, BlockingModel(notes.append)),
            one_writer.request("r", lease_kit.held_tools(notes.append, None), Replay.ALLOWED),
        )
    assert notes == ["model r:0:model"]  # the tool never started
    other = lease_kit.open_store(location, schema, lease_s)
    result = await run_status(other, "r")  # type: ignore[arg-type]
    assert result.state is RunState.RESUMABLE
    finished = await recover(
        lease_kit.definition(other, notes.append, one_writer.Model(notes.append)),
        other,  # type: ignore[arg-type]
        lambda run_id: one_writer.request(
            run_id, lease_kit.held_tools(notes.append, None), Replay.ALLOWED
        ),
        max_concurrent=1,
    )
    assert [entry.result.stop_reason for entry in finished if entry.result] == [
        StopReason.SUBMITTED
    ]
    assert notes.count("tool r:0:action") == 1
    await store.aclose()  # type: ignore[attr-defined]
    await other.aclose()  # type: ignore[attr-defined]
