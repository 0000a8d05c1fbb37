"""Pruning while workers run, and ``polyloop prune``.

Finished runs older than the cutoff go (archived first, when asked); runs that are
unfinished, in doubt or driven by a live worker stay, whatever their age; the archive
reads back with ``polyloop show``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

import one_writer_kit as kit
from agent_kit import Ledger, definition, make_tools, request, tool_call
from polyloop import Replay, RunState, StopReason, run, run_status
from polyloop.cli import main
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash

SCRIPT = [tool_call("double", n=1), tool_call("submit", answer="2")]


def _opener(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    kind = request.param
    if kind == "sqlite":
        return lambda: SqliteStore(tmp_path / "runs.db")
    if kind == "jsonl":
        return lambda: JsonlStore(tmp_path / "runs")
    from polyloop.stores import PostgresStore

    conninfo = request.getfixturevalue("postgres_shared")
    schema = request.getfixturevalue("postgres_schemas")()
    return lambda: PostgresStore(conninfo, schema=schema)


@pytest.fixture(params=["jsonl", "sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    return _opener(request, tmp_path)


@pytest.mark.anyio
async def test_prune_while_workers_run(opener: Any, tmp_path: Path) -> None:
    ledger = Ledger()
    async with opener() as store:
        for n in range(8):
            await run(definition(store, script=SCRIPT), request(f"done-{n}", make_tools(ledger)))
        for n in range(3):
            with pytest.raises(SimulatedCrash):
                await run(
                    definition(FaultyStore(store, fail_after_writes=5), script=SCRIPT),
                    request(f"crashed-{n}", make_tools(ledger)),
                )
        with pytest.raises(SimulatedCrash):  # after the action intent: in doubt
            await run(
                definition(FaultyStore(store, fail_after_writes=4), script=SCRIPT),
                request("doubt", make_tools(ledger)),
            )
    cutoff = datetime.now(UTC)
    archive = tmp_path / "archive"
    gate = kit.Gate()
    notes: list[str] = []
    worker, pruner = opener(), opener()
    async with anyio.create_task_group() as group:
        # A live worker, in the middle of its tool, on a run that started before the cutoff.
        group.start_soon(
            run,
            kit.definition(worker, notes.append),
            kit.request("live", kit.tools(notes.append, Replay.NEVER, gate), Replay.NEVER),
        )
        await gate.entered.wait()
        before = {run.run_id for run in await pruner.list_runs()}
        pruned = await pruner.prune(finished_before=datetime.now(UTC), archive=archive)
        after = {run.run_id for run in await pruner.list_runs()}
        gate.go.set()
    assert sorted(pruned) == [f"done-{n}" for n in range(8)]
    assert after == before - set(pruned)
    assert after == {"crashed-0", "crashed-1", "crashed-2", "doubt", "live"}
    assert (await run_status(pruner, "doubt")).state is RunState.IN_DOUBT
    assert (await run_status(pruner, "live")).stop_reason is StopReason.SUBMITTED
    assert notes.count("tool live:0:action") == 1
    async with JsonlStore(archive) as archived:
        assert sorted(run.run_id for run in await archived.list_runs()) == sorted(pruned)
    # A second prune has nothing old and finished left but the run that just ended.
    assert await pruner.prune(finished_before=cutoff) == ()
    await worker.aclose()
    await pruner.aclose()


def test_polyloop_prune_archives_and_polyloop_show_reads_the_archive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "runs.db"

    async def fill() -> None:
        async with SqliteStore(path) as store:
            for run_id in ("a", "b"):
                await run(definition(store, script=SCRIPT), request(run_id, make_tools(Ledger())))
            with pytest.raises(SimulatedCrash):
                await run(
                    definition(FaultyStore(store, fail_after_writes=5), script=SCRIPT),
                    request("c", make_tools(Ledger())),
                )

    anyio.run(fill)
    archive = tmp_path / "archive"
    later = datetime.now(UTC).isoformat()
    assert (
        main(["prune", f"sqlite:{path}", "--finished-before", later, "--archive", str(archive)])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("pruned 2 of 3 runs (finished before ")
    assert out.rstrip().endswith(f"archived to {archive}; 1 left")
    assert main(["show", f"jsonl:{archive}", "a"]) == 0
    shown = capsys.readouterr().out
    assert "run a  finished" in shown and "submitted" in shown
    assert main(["runs", f"sqlite:{path}"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["c"]
    assert main(["prune", f"sqlite:{path}", "--finished-before", "not a date"]) == 1
    assert "expected an ISO date" in capsys.readouterr().err
