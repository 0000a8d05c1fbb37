"""Pruning while workers run, and ``polyloop prune``.

Finished runs older than the cutoff go (archived first, when asked); runs that are
unfinished, in doubt or driven by a live worker stay, whatever their age; the archive
reads back with ``polyloop show``.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import one_writer
from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from polyloop import InvalidRequest, Replay, RunState, StopReason, StoreError, run, run_status
from polyloop.cli import main
from polyloop.stores import JsonlStore, MemoryStore, SqliteStore
from polyloop.stores._engine import prune_runs
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.types import RunEnded

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


@pytest.fixture(params=["memory", "jsonl", "sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """One store object of each kind, the in-memory one included."""
    return MemoryStore() if request.param == "memory" else _opener(request, tmp_path)()


async def _finish(store: Any, run_id: str, text: str) -> None:
    script = [answer(text)]
    await run(definition(store, script=script), request(run_id, make_tools(Ledger())))


async def _archived_answer(folder: Path, run_id: str) -> str | None:
    async with JsonlStore(folder) as archived:
        (stored,) = await archived.list_runs()
        assert stored.run_id == run_id
        return _answer(await archived.read_log(run_id))


def _answer(log: Any) -> str | None:
    ended = log.records[-1]
    assert isinstance(ended, RunEnded)
    return ended.final_answer


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
    gate = one_writer.Gate()
    notes: list[str] = []
    worker, pruner = opener(), opener()
    async with anyio.create_task_group() as group:
        # A live worker, in the middle of its tool, on a run that started before the cutoff.
        group.start_soon(
            run,
            one_writer.definition(worker, notes.append),
            one_writer.request(
                "live", one_writer.tools(notes.append, Replay.NEVER, gate), Replay.NEVER
            ),
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


@pytest.mark.anyio
async def test_a_reused_run_id_keeps_every_archived_log(any_store: Any, tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    async with any_store as store:
        for night in ("first", "second", "third"):
            await _finish(store, "nightly", night)
            assert await store.prune(finished_before=datetime.now(UTC), archive=archive) == (
                "nightly",
            )
    # The first log keeps its place; each later one is a JSONL store of its own.
    assert await _archived_answer(archive, "nightly") == "first"
    assert await _archived_answer(archive / "2", "nightly") == "second"
    assert await _archived_answer(archive / "3", "nightly") == "third"
    assert sorted(name for name in os.listdir(archive) if "." not in name) == ["2", "3"]


@pytest.mark.anyio
async def test_a_log_archived_again_after_a_crash_is_kept_once(tmp_path: Path) -> None:
    archive = tmp_path / "archive"

    async def crash_before_delete(run_id: str) -> bool:
        return False  # the log is archived, the run stays: as after a crash in between

    async with JsonlStore(tmp_path / "runs") as store:
        await _finish(store, "a", "once")
        assert await prune_runs(store, ["a"], archive=archive, delete=crash_before_delete) == ()
        assert await store.prune(finished_before=datetime.now(UTC), archive=archive) == ("a",)
    assert await _archived_answer(archive, "a") == "once"
    assert [name[-6:] for name in os.listdir(archive)] == [".jsonl"]  # one file, no copy


@pytest.mark.anyio
async def test_an_archive_holding_the_jsonl_stores_own_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    (tmp_path / "link").symlink_to(runs, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    async with JsonlStore(runs) as store:
        await _finish(store, "a", "kept")
        later = datetime.now(UTC)
        for archive in (runs, "runs", "./link/", tmp_path / "link", tmp_path):
            with pytest.raises(InvalidRequest, match="cannot archive the runs of"):
                await store.prune(finished_before=later, archive=archive)
        assert [stored.run_id for stored in await store.list_runs()] == ["a"]
        assert _answer(await store.read_log("a")) == "kept"
        # An archive inside the store's directory is not the store: its files are not runs.
        assert await store.prune(finished_before=later, archive="link/archive") == ("a",)
    assert await _archived_answer(runs / "archive", "a") == "kept"
    assert sorted(os.listdir(tmp_path)) == ["link", "runs"]


def test_two_stores_pruned_into_one_archive_keep_both_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "archive"

    async def fill_and_prune() -> None:
        for store, text in (
            (SqliteStore(tmp_path / "a.db"), "from sqlite"),
            (JsonlStore(tmp_path / "runs"), "from jsonl"),
        ):
            async with store:
                await _finish(store, "a", text)
                assert await store.prune(finished_before=datetime.now(UTC), archive=archive) == (
                    "a",
                )

    anyio.run(fill_and_prune)
    assert main(["show", f"jsonl:{archive}", "a"]) == 0
    assert "from sqlite" in capsys.readouterr().out
    assert main(["show", f"jsonl:{archive / '2'}", "a"]) == 0
    assert "from jsonl" in capsys.readouterr().out
    for folder in (archive, archive / "2"):
        assert main(["verify", f"jsonl:{folder}"]) == 0
        assert capsys.readouterr().out.endswith(
            "1 run checked: 1 clean, 0 with warnings, 0 with errors\n"
        )


@pytest.mark.anyio
async def test_an_archive_that_cannot_be_made_is_a_store_error_and_the_run_stays(
    any_store: Any, tmp_path: Path
) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    archive = blocker / "archive"
    async with any_store as store:
        await run(definition(store, script=SCRIPT), request("kept", make_tools(Ledger())))
        with pytest.raises(StoreError) as caught:
            await store.prune(finished_before=datetime.now(UTC), archive=archive)
        assert caught.value.run_id == "kept" and caught.value.location == str(archive)
        assert str(caught.value) == (
            f"run 'kept', at {archive}: cannot archive the run: "
            f"{blocker} is a file, not a directory"
        )
        assert [stored.run_id for stored in await store.list_runs()] == ["kept"]
        await run(definition(store, script=SCRIPT), request("next", make_tools(Ledger())))
