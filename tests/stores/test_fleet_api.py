"""``start_or_resume``, ``run_status`` and ``recover`` on every store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import one_writer
from kit.agent import Ledger, definition, make_tools, request, tool_call
from polyloop import (
    InvalidRequest,
    RecoveredRun,
    Replay,
    RunLocked,
    RunNotFound,
    RunState,
    StopReason,
    recover,
    resume,
    run,
    run_status,
    start_or_resume,
)
from polyloop.ports import ManagedStore
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio

KINDS = ["memory", "jsonl", "sqlite", "postgresql"]
SCRIPT = [tool_call("double", n=1), tool_call("submit", answer="2")]


class Opener:
    """New store objects over one set of data (the memory store: one shared object)."""

    def __init__(self, kind: str, location: str, schema: str) -> None:
        self.kind, self.location, self.schema = kind, location, schema
        self.memory = MemoryStore()

    def __call__(self) -> Any:
        if self.kind == "memory":
            return self.memory
        return one_writer.open_store(self.kind, self.location, self.schema)


@pytest.fixture(params=KINDS)
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    kind = request.param
    location, schema = str(tmp_path / ("runs.db" if kind == "sqlite" else "runs")), ""
    if kind == "postgresql":
        location = request.getfixturevalue("postgres_shared")
        schema = request.getfixturevalue("postgres_schemas")()
    return Opener(kind, location, schema)


async def _crash(
    store: Any, run_id: str, after: int, ledger: Ledger, replay: Replay = Replay.ALLOWED
) -> None:
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=after), script=SCRIPT),
            request(run_id, make_tools(ledger, replay=replay), model_replay=replay),
        )


async def test_start_or_resume_starts_then_continues_then_reads(opener: Opener) -> None:
    ledger = Ledger()
    async with opener() as store:
        tools = make_tools(ledger, replay=Replay.ALLOWED)
        await _crash(store, "r", 5, ledger)  # the start and the whole first step
        fresh = await start_or_resume(
            definition(store, script=SCRIPT), request("new", tools, model_replay=Replay.ALLOWED)
        )
        assert not fresh.resumed and fresh.stop_reason is StopReason.SUBMITTED
        continued = await start_or_resume(
            definition(store, script=SCRIPT), request("r", tools, model_replay=Replay.ALLOWED)
        )
        assert continued.resumed and continued.stop_reason is StopReason.SUBMITTED
        assert [step.step for step in continued.steps] == [0, 1]
        assert ledger.count("r:0:action") == 1  # the first step was read, not run again
        again = await start_or_resume(
            definition(store, script=SCRIPT), request("r", tools, model_replay=Replay.ALLOWED)
        )
        assert again.resumed and again.steps == continued.steps


async def test_run_status_tells_each_state(opener: Opener) -> None:
    ledger = Ledger()
    before = datetime.now(UTC) - timedelta(seconds=5)
    async with opener() as store:
        await run(definition(store, script=SCRIPT), request("done", make_tools(ledger)))
        await _crash(store, "resumable", 5, ledger)
        await _crash(store, "doubt", 4, ledger, replay=Replay.NEVER)  # after the action intent
        with pytest.raises(RunNotFound):
            await run_status(store, "nobody")

        done = await run_status(store, "done")
        assert (done.state, done.stop_reason, done.steps, done.valid_steps) == (
            RunState.FINISHED,
            StopReason.SUBMITTED,
            2,
            2,
        )
        assert done.open_intent is None
        assert done.last_record_at is not None and done.last_record_at >= before

        resumable = await run_status(store, "resumable")
        assert (resumable.state, resumable.steps, resumable.stop_reason) == (
            RunState.RESUMABLE,
            1,
            None,
        )

        doubt = await run_status(store, "doubt")
        assert doubt.state is RunState.IN_DOUBT
        assert doubt.open_intent is not None and doubt.open_intent.result_id == "doubt:0:action"
        # Once ended in doubt, it stays in doubt, with its stop reason.
        ended = await resume(
            definition(store, script=SCRIPT),
            request("doubt", make_tools(ledger, replay=Replay.NEVER)),
        )
        assert ended.stop_reason is StopReason.IN_DOUBT
        doubt = await run_status(store, "doubt")
        assert (doubt.state, doubt.stop_reason) == (RunState.IN_DOUBT, StopReason.IN_DOUBT)


async def test_run_status_says_running_while_a_writer_drives_the_run(opener: Opener) -> None:
    """An open ``NEVER`` intent of a live run is an effect in flight, not one in doubt."""
    gate = one_writer.Gate()
    note: list[str] = []
    registry = one_writer.tools(note.append, Replay.NEVER, gate)
    driver, watcher = opener(), opener()
    async with anyio.create_task_group() as group:
        group.start_soon(
            run,
            one_writer.definition(driver, note.append),
            one_writer.request("r", registry, Replay.NEVER),
        )
        await gate.entered.wait()
        status = await run_status(watcher, "r")
        assert status.state is RunState.RUNNING
        assert status.open_intent is not None and status.open_intent.result_id == "r:0:action"
        gate.go.set()
    assert (await run_status(watcher, "r")).state is RunState.FINISHED
    await driver.aclose()
    await watcher.aclose()


async def test_recover_resumes_every_unfinished_run_and_leaves_live_ones_alone(
    opener: Opener,
) -> None:
    ledger = Ledger()
    gate = one_writer.Gate()
    note: list[str] = []
    async with opener() as store:
        await run(definition(store, script=SCRIPT), request("done", make_tools(ledger)))
        for run_id in ("a", "b", "c"):
            await _crash(store, run_id, 5, ledger)
        await _crash(store, "doubt", 4, ledger, replay=Replay.NEVER)
        asked: list[str] = []

        async def request_for(run_id: str) -> Any:
            asked.append(run_id)
            if run_id == "c":
                raise LookupError("no such job any more")
            replay = Replay.NEVER if run_id == "doubt" else Replay.ALLOWED
            return request(run_id, make_tools(ledger, replay=replay), model_replay=replay)

        driver = opener()
        registry = one_writer.tools(note.append, Replay.NEVER, gate)
        async with anyio.create_task_group() as group:
            group.start_soon(
                run,
                one_writer.definition(driver, note.append),
                one_writer.request("live", registry, Replay.NEVER),
            )
            await gate.entered.wait()
            report = await recover(
                definition(store, script=SCRIPT), store, request_for, max_concurrent=2
            )
            gate.go.set()
        if driver is not store:
            await driver.aclose()

    by_id = {entry.run_id: entry for entry in report}
    assert sorted(by_id) == ["a", "b", "c", "doubt", "live"]  # never the finished one
    assert sorted(asked) == ["a", "b", "c", "doubt"]  # the live run was not touched
    for run_id in ("a", "b"):
        result = by_id[run_id].result
        assert result is not None and result.resumed
        assert result.stop_reason is StopReason.SUBMITTED
        assert ledger.count(f"{run_id}:0:action") == 1
    assert isinstance(by_id["c"].error, LookupError) and by_id["c"].result is None
    doubt = by_id["doubt"].result
    assert doubt is not None and doubt.stop_reason is StopReason.IN_DOUBT
    assert isinstance(by_id["live"].error, RunLocked) and by_id["live"].result is None
    assert note == ["model live:0:model", "tool live:0:action"]


async def test_two_recoveries_at_once_never_drive_one_run_twice(opener: Opener) -> None:
    ledger = Ledger()
    first, second = opener(), opener()
    run_ids = [f"r{i}" for i in range(12)]
    for run_id in run_ids:
        await _crash(first, run_id, 5, ledger)

    def request_for(run_id: str) -> Any:
        return request(
            run_id, make_tools(ledger, replay=Replay.ALLOWED), model_replay=Replay.ALLOWED
        )

    reports: list[tuple[RecoveredRun, ...]] = []

    async def sweep(store: Any) -> None:
        reports.append(
            await recover(definition(store, script=SCRIPT), store, request_for, max_concurrent=3)
        )

    async with anyio.create_task_group() as group:
        group.start_soon(sweep, first)
        group.start_soon(sweep, second)
    # A sweep that comes to a run the other one already finished only reads its result;
    # one that comes while the other drives it is refused before it reads anything.
    for report in reports:
        for entry in report:
            if entry.result is None:
                assert isinstance(entry.error, RunLocked), entry.error
            else:
                assert entry.result.stop_reason is StopReason.SUBMITTED
    resumed = {entry.run_id for report in reports for entry in report if entry.result is not None}
    assert resumed == set(run_ids)
    for run_id in run_ids:
        assert ledger.count(f"{run_id}:1:action") == 1
        assert (await run_status(first, run_id)).state is RunState.FINISHED
    await first.aclose()
    await second.aclose()


async def test_recover_checks_its_arguments(opener: Opener) -> None:
    async with opener() as store:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(InvalidRequest, match="max_concurrent"):
                await recover(
                    definition(store),
                    store,
                    lambda _: None,  # type: ignore[arg-type, return-value]
                    max_concurrent=bad,
                )  # type: ignore[arg-type]
        ledger = Ledger()
        await _crash(store, "r", 5, ledger)

        def wrong_request(run_id: str) -> Any:
            return request("other", make_tools(ledger))

        (entry,) = await recover(
            definition(store, script=SCRIPT), store, wrong_request, max_concurrent=1
        )
        assert isinstance(entry.error, InvalidRequest) and "other" in str(entry.error)
        assert (await run_status(store, "r")).state is RunState.RESUMABLE


def test_managed_store_is_what_every_shipped_store_is(tmp_path: Path) -> None:
    from polyloop.stores import JsonlStore, PostgresStore, SqliteStore

    stores = [
        MemoryStore(),
        JsonlStore(tmp_path / "j"),
        SqliteStore(tmp_path / "s.db"),
        PostgresStore("postgresql://nobody@127.0.0.1:1/none"),
    ]
    for store in stores:
        assert isinstance(store, ManagedStore)
