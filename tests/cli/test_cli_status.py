"""The command line on the public status API: running runs, corrupt logs, schemas."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import Ledger, definition, make_tools, request, tool_call
from polyloop import run
from polyloop.cli import main
from polyloop.stores import JsonlStore, PostgresStore, SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash

SCRIPT = [tool_call("double", n=1), tool_call("submit", answer="2")]


async def _fill(store: Any, run_ids: tuple[str, ...] = ("one", "two", "three")) -> None:
    """Finished runs, and one more (``paused``) that stopped after its first step."""
    async with store:
        for run_id in run_ids:
            await run(definition(store, script=SCRIPT), request(run_id, make_tools(Ledger())))
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=5), script=SCRIPT),
                request("paused", make_tools(Ledger())),
            )


def _json_lines(out: str) -> dict[str, dict[str, Any]]:
    return {line["run_id"]: line for line in map(json.loads, out.splitlines())}


def _break_jsonl(directory: Path, run_id: str) -> None:
    """Damage a complete line in the middle of a run's log (its first line stays)."""
    (path,) = [path for path in directory.glob("*.jsonl") if path.name.startswith(run_id)]
    lines = path.read_bytes().split(b"\n")
    lines[2] = b'{"this is": "not a record"}'
    path.write_bytes(b"\n".join(lines))


def test_runs_marks_a_corrupt_log_and_still_lists_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "runs"
    anyio.run(_fill, JsonlStore(directory))
    _break_jsonl(directory, "two")
    assert main(["runs", f"jsonl:{directory}", "--json"]) == 0
    listed = _json_lines(capsys.readouterr().out)
    assert sorted(listed) == ["one", "paused", "three", "two"]
    assert listed["two"]["state"] == "corrupt"
    assert listed["two"]["step_count"] is None
    assert ".jsonl:3" in listed["two"]["detail"]  # names the damaged line
    assert {listed[run_id]["state"] for run_id in ("one", "three")} == {"finished"}
    assert listed["paused"]["state"] == "resumable"
    assert listed["one"]["last_record_at"] is not None
    assert main(["runs", f"jsonl:{directory}"]) == 0
    table = capsys.readouterr().out
    (line,) = [line for line in table.splitlines() if line.split()[:1] == ["two"]]
    assert line.split()[1] == "corrupt"


def test_runs_marks_a_corrupt_sqlite_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "runs.db"
    anyio.run(_fill, SqliteStore(path))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE records SET body = '{}' WHERE run_id = 'one' AND seq = 3")
    conn.close()
    assert main(["runs", f"sqlite:{path}", "--json"]) == 0
    listed = _json_lines(capsys.readouterr().out)
    assert listed["one"]["state"] == "corrupt"
    assert [listed[run_id]["state"] for run_id in ("two", "three", "paused")] == [
        "finished",
        "finished",
        "resumable",
    ]


def test_a_run_another_writer_holds_shows_as_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "runs"
    anyio.run(_fill, JsonlStore(directory))
    holder = JsonlStore(directory)
    anyio.run(holder.claim_run, "paused")  # a worker is driving it now
    try:
        assert main(["runs", f"jsonl:{directory}", "--json"]) == 0
        assert _json_lines(capsys.readouterr().out)["paused"]["state"] == "running"
        assert main(["show", f"jsonl:{directory}", "paused"]) == 0
        assert "a live writer is on it now" not in capsys.readouterr().out  # nothing open
    finally:
        anyio.run(holder.aclose)
    assert main(["runs", f"jsonl:{directory}", "--json"]) == 0
    assert _json_lines(capsys.readouterr().out)["paused"]["state"] == "resumable"


@pytest.mark.parametrize("command", ["runs", "verify"])
def test_schema_names_the_postgres_schema(
    postgres_shared: str, postgres_schemas: Any, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mine, other = postgres_schemas(), postgres_schemas()
    anyio.run(_fill, PostgresStore(postgres_shared, schema=mine), ("a",))
    anyio.run(_fill, PostgresStore(postgres_shared, schema=other), ("b",))
    assert main([command, postgres_shared, "--schema", mine]) == 0
    out = capsys.readouterr().out
    assert "a" in out.split() and "b" not in out.split()
    assert "paused" in out


def test_schema_is_refused_for_a_store_that_has_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", f"jsonl:{tmp_path}", "--schema", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("polyloop: error: --schema names a PostgreSQL schema")
    assert len(err.splitlines()) == 1
