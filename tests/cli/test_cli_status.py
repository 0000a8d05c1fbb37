"""The command line on the public status API: running runs, corrupt logs, schemas."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import Ledger, definition, make_tools, request, tool_call
from kit.show import SPAN
from polyloop import run
from polyloop.cli import main
from polyloop.cli._view import span_text
from polyloop.stores import JsonlStore, PostgresStore, SqliteStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

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


async def _finished(store: Any, run_id: str) -> None:
    async with store:
        await run(definition(store, script=SCRIPT), request(run_id, make_tools(Ledger())))


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


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (0.04, "0.0s"),
        (9.94, "9.9s"),
        (10, "10s"),
        (59.9, "59s"),
        (60, "1m00s"),
        (3599, "59m59s"),
        (3600, "1h00m"),
        (86399, "23h59m"),
        (86400, "1d00h"),
        (90061, "1d01h"),
    ],
)
def test_a_span_is_shown_compactly_to_the_unit_that_matters(
    seconds: float | None, shown: str
) -> None:
    assert span_text(seconds) == shown
    assert SPAN.fullmatch(shown)


@pytest.mark.anyio
async def test_a_model_call_in_flight_is_in_progress_for_as_long_as_it_has_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "runs"
    model = ScriptedModelClient(SCRIPT, delay=30)
    async with JsonlStore(directory) as store, anyio.create_task_group() as group:
        group.start_soon(run, definition(store, model=model), request("slow", make_tools(Ledger())))
        while not model.calls:  # noqa: ASYNC110 - the scripted model has no event to wait on
            await anyio.sleep(0.01)
        await anyio.sleep(0.2)  # the call has been in flight a while

        def polyloop(*args: str) -> str:
            assert main(list(args)) == 0
            return capsys.readouterr().out

        shown = await anyio.to_thread.run_sync(polyloop, "show", f"jsonl:{directory}", "slow")
        as_json = await anyio.to_thread.run_sync(
            polyloop, "show", f"jsonl:{directory}", "slow", "--json"
        )
        listed = await anyio.to_thread.run_sync(polyloop, "runs", f"jsonl:{directory}")
        group.cancel_scope.cancel()
    in_progress = re.search(
        r"in progress step 0: the model call 'slow:0:model' has been in progress for "
        r"(\S+), since (\S+ \S+Z) \(a live writer is on it now\)",
        " ".join(shown.split()),  # as one line, however the terminal wrapped it
    )
    assert in_progress is not None, shown
    assert SPAN.fullmatch(in_progress.group(1)) and in_progress.group(1) != "-"
    assert "interrupted" not in shown
    progress = json.loads(as_json)["in_progress"]
    assert (progress["result_id"], progress["kind"]) == ("slow:0:model", "model_call")
    assert 0.2 <= progress["for_s"] < 30
    assert datetime.fromisoformat(progress["since"]) <= datetime.now(UTC)
    # runs: running, the age since its start, and no duration yet.
    (line,) = [line for line in listed.splitlines() if line.split()[:1] == ["slow"]]
    *_, age, duration = line.split()
    assert line.split()[1] == "running"
    assert SPAN.fullmatch(age) and age != "-"
    assert duration == "-"


def test_a_run_with_an_end_record_is_listed_with_its_age_and_duration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "runs"
    anyio.run(_fill, JsonlStore(directory), ("one",))
    assert main(["runs", f"jsonl:{directory}"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[-2:] == ["age", "duration"]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert SPAN.fullmatch(rows["one"][-2]) and SPAN.fullmatch(rows["one"][-1])
    assert rows["one"][-1] != "-"  # it ended: the time from its start to its end
    assert rows["paused"][-1] == "-"  # it has no end record yet


@pytest.mark.slow  # a process of its own, listing several times
def test_runs_watch_lists_again_until_interrupted(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    anyio.run(_fill, JsonlStore(directory), ("one",))
    watching = subprocess.Popen(
        [sys.executable, "-m", "polyloop", "runs", f"jsonl:{directory}", "--watch", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watching.stdout is not None
        headers = 0
        seen_two = False
        deadline = time.monotonic() + 60
        while not seen_two:
            assert time.monotonic() < deadline, f"{headers} listings, and no run 'two' in them"
            line = watching.stdout.readline()
            assert line, watching.stderr.read() if watching.stderr else "no output"
            if line.startswith(f"jsonl:{directory} at "):
                assert line.rstrip().endswith("every 0.2 s (Ctrl-C stops)")
                headers += 1
                if headers == 2:
                    anyio.run(_finished, JsonlStore(directory), "two")  # a run is added
            seen_two = line.split()[:1] == ["two"]
        watching.send_signal(signal.SIGINT)
        _, err = watching.communicate(timeout=30)
    finally:
        watching.kill()
    assert headers >= 3  # listed again, and the new run showed up in a later listing
    assert watching.returncode == 0, err
    assert err == ""


def test_runs_watch_and_json_do_not_go_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "jsonl:.", "--json", "--watch"]) == 1
    assert "argument --watch: not allowed with argument --json" in capsys.readouterr().err
