"""Forks on every store, under asyncio and Trio (issue 32).

A crash after any write of a fork, then ``resume`` through a new store object on the same
data, ends where the uninterrupted fork ends and never runs an inherited effect again. A
fork stands alone: with its source pruned (or, on JSONL, its file removed) it still
reads, verifies, shows and resumes to its recorded result. Its start record, inherited
steps nested in it, is stored byte for byte as the codec writes it, a big one (200 steps
with long observations) included. Listing, status and ``recover`` treat a fork like any
run.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

from kit.agent import Ledger, answer, definition, five_step_script, make_tools, request, tool_call
from kit.fork import SCRIPT, without_run_id
from kit.store import STORE_KINDS, sampled
from kit.surrogate import HALF
from kit.sweep import every_point
from polyloop import (
    Budget,
    Replay,
    RunNotFound,
    RunStarted,
    RunState,
    StopReason,
    fork,
    recover,
    resume,
    run,
    run_status,
)
from polyloop.cli import main
from polyloop.serialization import dumps
from polyloop.session._forking import inherited_digest
from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash, without_timing

pytestmark = pytest.mark.anyio

FORK_WRITES = 10  # a fork at step 2 of SCRIPT: its start record, then two steps and its end
OWN_ACTIONS = {"f:2:action", "f:3:action"}  # the fork's own steps; 0 and 1 are inherited


@dataclasses.dataclass
class Place:
    """One store's data, and new store objects on it, as new processes would open them."""

    kind: str
    tmp_path: Path
    conninfo: str | None = None
    schema: str | None = None
    memory: MemoryStore = dataclasses.field(default_factory=MemoryStore)
    opened: list[Any] = dataclasses.field(default_factory=list)

    def open(self) -> Any:
        if self.kind == "memory":
            return self.memory  # its data lives in the one object
        store: Any
        if self.kind == "jsonl":
            store = JsonlStore(self.tmp_path / "runs")
        elif self.kind == "sqlite":
            store = SqliteStore(self.tmp_path / "runs.db")
        else:
            assert self.conninfo is not None and self.schema is not None
            store = PostgresStore(self.conninfo, schema=self.schema)
        self.opened.append(store)
        return store

    async def close(self, store: Any, run_id: str) -> None:
        """The end of a process: a durable store object closes, which gives its claims
        up; the memory store's one object lets the run go."""
        if self.kind == "memory":
            await store.release_run(run_id)
        else:
            await store.aclose()

    @property
    def cli(self) -> list[str] | None:
        """The STORE argument (and schema) of the command line; ``None`` for memory."""
        if self.kind == "jsonl":
            return [f"jsonl:{self.tmp_path / 'runs'}"]
        if self.kind == "sqlite":
            return [f"sqlite:{self.tmp_path / 'runs.db'}"]
        if self.kind == "postgresql":
            assert self.conninfo is not None and self.schema is not None
            return [self.conninfo, "--schema", self.schema]
        return None

    def stored_start(self, run_id: str) -> str | None:
        """The start record of ``run_id`` as the store holds it, read around the store;
        ``None`` for memory, which holds records as objects."""
        if self.kind == "jsonl":
            path = self.tmp_path / "runs" / f"{safe_name(run_id)}.jsonl"
            first = path.read_bytes().split(b"\n", 1)[0]
            return first.decode("utf-8")
        if self.kind == "sqlite":
            with sqlite3.connect(self.tmp_path / "runs.db") as conn:
                (body,) = conn.execute(
                    "SELECT body FROM records WHERE run_id = ? AND seq = 0", (run_id,)
                ).fetchone()
            return str(body)
        if self.kind == "postgresql":
            assert self.conninfo is not None and self.schema is not None
            query = sql.SQL("SELECT body FROM {} WHERE run_id = %s AND seq = 0").format(
                sql.Identifier(self.schema, "records")
            )
            with psycopg.connect(self.conninfo) as conn:
                row = conn.execute(query, (run_id,)).fetchone()
            assert row is not None
            return str(row[0])
        return None

    async def close_all(self) -> None:
        for store in self.opened:
            await store.aclose()


# How a fork crashes, resumes and stands alone is the kernel's part: quick on the memory
# store and SQLite. How its start record is stored is each store's own: every store, quick.
@pytest.fixture(params=sampled(STORE_KINDS))
async def place(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Place]:
    conninfo = schema = None
    if request.param == "postgresql":
        conninfo = request.getfixturevalue("postgres_shared")
        schema = request.getfixturevalue("postgres_schemas")()
    kit = Place(request.param, tmp_path, conninfo, schema)
    try:
        yield kit
    finally:
        await kit.close_all()


def forked(run_id: str, ledger: Ledger) -> Any:
    """A fork's request whose effects may be repeated, so every crash point resumes."""
    tools = make_tools(ledger, replay=Replay.ALLOWED)
    return request(run_id, tools, model_replay=Replay.ALLOWED)


async def source_and_whole(store: Any, ledger: Ledger) -> Any:
    """``src`` recorded, and ``whole``, its uninterrupted fork at step 2."""
    await run(definition(store, script=SCRIPT), request("src", make_tools(ledger)))
    return await fork(
        definition(store, script=SCRIPT), forked("whole", ledger), source_run_id="src", at_step=2
    )


def actions(ledger: Ledger, prefix: str) -> list[str]:
    return [rid for _, rid in ledger.calls if rid.startswith(prefix)]


# -- a crash at every write of a fork ----------------------------------------------------------


async def test_an_uninterrupted_fork_makes_the_writes_the_sweep_counts(place: Place) -> None:
    store, ledger = place.open(), Ledger()
    await source_and_whole(store, ledger)
    counting = FaultyStore(store, fail_after_writes=10**6)
    await fork(
        definition(counting, script=SCRIPT), forked("f", ledger), source_run_id="src", at_step=2
    )
    assert counting.writes == FORK_WRITES


@pytest.mark.parametrize("writes", every_point(range(FORK_WRITES)))
async def test_a_fork_crashed_after_any_write_resumes_to_the_uninterrupted_fork(
    place: Place, writes: int
) -> None:
    store, ledger = place.open(), Ledger()
    whole = await source_and_whole(store, ledger)
    source_actions = actions(ledger, "src:")
    crashing = place.open()
    with pytest.raises(SimulatedCrash):
        await fork(
            definition(FaultyStore(crashing, fail_after_writes=writes), script=SCRIPT),
            forked("f", ledger),
            source_run_id="src",
            at_step=2,
        )
    await place.close(crashing, "f")
    restarted = place.open()
    again = definition(restarted, script=SCRIPT)
    if writes == 0:
        # Nothing landed, not even the start record: the fork never began; fork again.
        with pytest.raises(RunNotFound):
            await resume(again, forked("f", ledger))
        result = await fork(again, forked("f", ledger), source_run_id="src", at_step=2)
    else:
        result = await resume(again, forked("f", ledger))
    assert without_run_id(result.steps) == without_run_id(whole.steps)
    assert (result.stop_reason, result.final_answer) == (whole.stop_reason, whole.final_answer)
    # Only the fork's own steps ran (again, after a crash: their replay is allowed); the
    # inherited ones never, and the source's effects once, when it ran.
    assert set(actions(ledger, "f:")) == OWN_ACTIONS
    assert actions(ledger, "src:") == source_actions
    started = without_timing((await restarted.read_log("f")).records[0])
    whole_started = without_timing((await restarted.read_log("whole")).records[0])
    assert isinstance(started, RunStarted) and isinstance(whole_started, RunStarted)
    assert (started.forked_from, started.forked_at_step) == ("src", 2)
    assert started.inherited_sha256 == whole_started.inherited_sha256
    assert without_run_id(started.inherited_steps) == without_run_id(whole_started.inherited_steps)


# -- a step holding half an emoji --------------------------------------------------------------

# Step 1 is a model reply holding a lone surrogate (half an emoji, as a server can send it).
HALF_SCRIPT = [
    tool_call("double", n=1),
    f"half an emoji: {HALF}",
    tool_call("double", n=2),
    tool_call("submit", answer="4"),
]


async def test_a_fork_at_a_step_holding_a_lone_surrogate_verifies_and_resumes(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    store, ledger = place.open(), Ledger()
    source = await run(definition(store, script=HALF_SCRIPT), request("src", make_tools(ledger)))
    assert source.steps[1].model_output == f"half an emoji: {HALF}"
    crashing = place.open()
    with pytest.raises(SimulatedCrash):  # after the start record, holding the copies
        await fork(
            definition(FaultyStore(crashing, fail_after_writes=1), script=HALF_SCRIPT),
            forked("f", ledger),
            source_run_id="src",
            at_step=2,
        )
    await place.close(crashing, "f")
    restarted = place.open()
    result = await resume(definition(restarted, script=HALF_SCRIPT), forked("f", ledger))
    assert result.stop_reason is StopReason.SUBMITTED
    assert (result.final_answer, len(result.steps)) == (source.final_answer, 4)
    assert without_run_id(result.steps) == without_run_id(source.steps)
    started = await _stored_as_written(place, restarted, "f")
    assert started.inherited_steps[1].model_output == f"half an emoji: {HALF}"
    assert started.inherited_sha256 == inherited_digest(source.steps[:2])
    if place.cli is None:
        return
    await place.close(restarted, "f")
    capsys.readouterr()
    assert await _cli(place, "verify") == 0
    assert "2 runs checked: 2 clean, 0 with warnings, 0 with errors" in capsys.readouterr().out


# -- the fork stands alone ---------------------------------------------------------------------


async def _source_then_fork(store: Any, ledger: Ledger) -> tuple[Any, datetime]:
    """``src``, then ``f`` forked from it at step 2; and a time between the two."""
    await run(definition(store, script=SCRIPT), request("src", make_tools(ledger)))
    await anyio.sleep(0.02)
    between = datetime.now(UTC)
    await anyio.sleep(0.02)
    result = await fork(
        definition(store, script=SCRIPT),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=2,
    )
    return result, between


async def _cli(place: Place, *arguments: str) -> int:
    assert place.cli is not None
    command, store, *schema = [arguments[0], *place.cli]
    argv = [command, store, *arguments[1:], *schema]
    status: int = await anyio.to_thread.run_sync(main, argv)
    return status


async def _alone(
    place: Place, store: Any, ledger: Ledger, result: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fork reads, resumes to its recorded result, verifies and shows, alone."""
    assert (await store.read_log("src")).records == ()
    status = await run_status(store, "f")
    assert (status.state, status.steps) == (RunState.FINISHED, 4)
    before = list(ledger.calls)
    again = await resume(definition(store, script=SCRIPT), request("f", make_tools(ledger)))
    assert again.resumed and ledger.calls == before
    assert [without_timing(step) for step in again.steps] == [
        without_timing(step) for step in result.steps
    ]
    assert (again.stop_reason, again.final_answer) == (result.stop_reason, result.final_answer)
    if place.cli is None:
        return
    await place.close(store, "f")
    capsys.readouterr()
    assert await _cli(place, "verify", "f") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "note f: forked from run 'src' at step 2; that run is not in this store" in out
    assert "1 run checked: 1 clean" in out
    assert await _cli(place, "show", "f") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "forked from run 'src' at step 2 (steps 0 to 1 inherited" in out
    assert "step 1 · action · executed · inherited" in out
    assert "step 3 · action · executed ─" in out


async def test_a_fork_stands_alone_once_its_source_is_pruned(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    store, ledger = place.open(), Ledger()
    result, between = await _source_then_fork(store, ledger)
    assert await store.prune(finished_before=between) == ("src",)
    await _alone(place, store, ledger, result, capsys)


@pytest.mark.parametrize("place", ["jsonl"], indirect=True)
async def test_a_jsonl_fork_stands_alone_once_its_source_s_file_is_removed(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    store, ledger = place.open(), Ledger()
    result, _ = await _source_then_fork(store, ledger)
    await store.aclose()
    (place.tmp_path / "runs" / f"{safe_name('src')}.jsonl").unlink()
    await _alone(place, place.open(), ledger, result, capsys)


# -- the start record, byte for byte -----------------------------------------------------------


async def _stored_as_written(place: Place, store: Any, run_id: str) -> RunStarted:
    """The start record read back, checked equal to the bytes the codec writes for it."""
    started = (await store.read_log(run_id)).records[0]
    assert isinstance(started, RunStarted)
    stored = place.stored_start(run_id)
    if stored is not None:
        assert stored == dumps(started)
    return started


@pytest.mark.parametrize("place", STORE_KINDS, indirect=True)
async def test_a_fork_s_start_record_is_stored_as_the_codec_writes_it(place: Place) -> None:
    store, ledger = place.open(), Ledger()
    script = five_step_script()
    await run(definition(store, script=script), request("src", make_tools(ledger)))
    source = (await store.read_log("src")).records
    await fork(
        definition(store, script=script),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=4,
    )
    started = await _stored_as_written(place, store, "f")
    # Refused, unparsable and executed steps, each copied whole.
    copied = [dataclasses.replace(step, run_id="src") for step in started.inherited_steps]
    assert copied == [record for record in source if type(record).__name__ == "StepRecord"][:4]
    assert started.inherited_sha256 == inherited_digest(tuple(copied))
    assert len({step.action_status for step in copied}) >= 2


BIG_STEPS = 200
BIG_OBSERVATION = 'Ünïcödé ✓ and a \\ and a " and\nlines. ' * 110  # about 4,000 characters
BIG_SCRIPT = ["{}"] * BIG_STEPS + [tool_call("submit", answer="all of it")]
BIG_BUDGET = Budget(max_steps=300, max_valid_steps=300, max_context_chars=10_000_000)


async def _big_fork_start(store: Any, ledger: Ledger) -> RunStarted:
    """A fork's start record holding 200 inherited steps with long observations.

    Its snapshot is a real one (the big script's): a fork at step 0 is crashed once its
    start record landed, and that record is given 200 steps of a source that is gone.
    """
    await run(
        definition(store, script=[tool_call("double", n=1), answer("2")]),
        request("src", make_tools(ledger)),
    )
    template = next(r for r in (await store.read_log("src")).records if hasattr(r, "decision"))
    with pytest.raises(SimulatedCrash):
        await fork(
            definition(FaultyStore(store, fail_after_writes=1), script=BIG_SCRIPT),
            request("seed", make_tools(ledger), budget=BIG_BUDGET),
            source_run_id="src",
            at_step=0,
        )
    seed = (await store.read_log("seed")).records[0]
    assert isinstance(seed, RunStarted)
    steps = tuple(
        dataclasses.replace(template, run_id="gone", step=n, observation=f"{n}: {BIG_OBSERVATION}")
        for n in range(BIG_STEPS)
    )
    return dataclasses.replace(
        seed,
        run_id="big",
        forked_from="gone",
        forked_at_step=BIG_STEPS,
        inherited_sha256=inherited_digest(steps),
        inherited=tuple(dataclasses.replace(step, run_id="big") for step in steps),
    )


@pytest.mark.parametrize("place", STORE_KINDS, indirect=True)
async def test_a_big_fork_start_record_is_stored_whole_and_the_fork_goes_on(
    place: Place, capsys: pytest.CaptureFixture[str]
) -> None:
    store, ledger = place.open(), Ledger()
    big = await _big_fork_start(store, ledger)
    assert len(dumps(big)) > BIG_STEPS * 4_000
    await store.claim_run("big")
    await store.start_run(big)
    await place.close(store, "big")
    store = place.open()
    assert await _stored_as_written(place, store, "big") == big
    assert (await run_status(store, "big")).steps == BIG_STEPS
    result = await resume(
        definition(store, script=BIG_SCRIPT),
        request("big", make_tools(ledger), budget=BIG_BUDGET),
    )
    assert result.stop_reason is StopReason.SUBMITTED and result.step_count == BIG_STEPS + 1
    assert actions(ledger, "big:") == [f"big:{BIG_STEPS}:action"]
    if place.cli is not None:
        await place.close(store, "big")
        capsys.readouterr()
        assert await _cli(place, "verify", "big") == 0
        assert "ok big (" in " ".join(capsys.readouterr().out.split())


# -- listed, described and recovered like any run ----------------------------------------------


async def test_a_crashed_fork_is_listed_unfinished_and_recover_finishes_it(place: Place) -> None:
    store, ledger = place.open(), Ledger()
    whole = await source_and_whole(store, ledger)
    crashing = place.open()
    with pytest.raises(SimulatedCrash):  # after the start record and step 2's model call
        await fork(
            definition(FaultyStore(crashing, fail_after_writes=3), script=SCRIPT),
            forked("f", ledger),
            source_run_id="src",
            at_step=2,
        )
    await place.close(crashing, "f")
    worker = place.open()
    listed = {stored.run_id: stored.finished for stored in await worker.list_runs()}
    assert listed == {"src": True, "whole": True, "f": False}
    status = await run_status(worker, "f")
    assert (status.state, status.steps, status.valid_steps) == (RunState.RESUMABLE, 2, 2)
    recovered = await recover(
        definition(worker, script=SCRIPT),
        worker,
        lambda run_id: forked(run_id, ledger),
        max_concurrent=2,
    )
    assert [each.run_id for each in recovered] == ["f"]
    (only,) = recovered
    assert only.error is None and only.result is not None
    assert only.result.resumed
    assert without_run_id(only.result.steps) == without_run_id(whole.steps)
    assert set(actions(ledger, "f:")) == OWN_ACTIONS
    assert (await run_status(worker, "f")).state is RunState.FINISHED
    assert all(stored.finished for stored in await worker.list_runs())
