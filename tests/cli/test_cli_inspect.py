"""``polyloop runs``, ``show`` and ``verify`` on stores holding runs in every state.

The stores are filled by the kernel itself (``polyloop.run`` with the test tools, a
``FaultyStore`` for crashes, a cancel scope for a cancelled run); the command then reads
them in the same process through ``main()``, under asyncio and Trio.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from html import escape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import surrogate as surrogate_kit
from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.show import without_times
from kit.store import sampled
from kit.surrogate import HALF, RUN_ID, SHOWN, StrictOutput
from polyloop import FinishReason, ModelReply, Replay, Usage, run, run_trace_id, serialization
from polyloop.cli import main
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.tools import ToolRegistry, ToolSpec
from polyloop.types import StepRecord

BACKENDS = ["asyncio", "trio"]
LONG = "x" * 3_000
MARKUP = "<script>alert('boo')</script> & <b>bold</b>"


# -- building stores ---------------------------------------------------------------------------


def long_tools(ledger: Ledger) -> ToolRegistry:
    async def echo(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("echo", result_id))
        return LONG

    return ToolRegistry(
        [ToolSpec(name="echo", description="Echo.", parameters={"type": "object"}, handler=echo)],
        max_observation_chars=10_000,
    )


async def fill(store_factory: Callable[[], Any]) -> None:
    """Five runs: finished, resumable (crashed), in doubt, cancelled, and a long one."""
    tools = make_tools(Ledger())
    script = [tool_call("double", n=1), MARKUP, tool_call("submit", answer="2")]

    async def with_store(body: Callable[[Any], Any]) -> None:
        store = store_factory()
        try:
            await body(store)
        finally:
            await store.aclose()

    async def finished(store: Any) -> None:
        await run(definition(store, script=script), request("done", tools))

    async def crashed(store: Any, run_id: str, writes: int) -> None:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=writes), script=script),
                request(run_id, tools),
            )

    async def cancelled(store: Any) -> None:
        slow = make_tools(Ledger(), delay=30, replay=Replay.ALLOWED)
        with anyio.move_on_after(0.3):
            await run(definition(store, script=script), request("stopped", slow))

    async def long(store: Any) -> None:
        await run(
            definition(store, script=[tool_call("echo"), answer("seen")]),
            request("long", long_tools(Ledger())),
        )

    await with_store(finished)
    # After step 0's model result: nothing open, the run can go on.
    await with_store(lambda store: crashed(store, "crashed", 3))
    # After step 0's action intent, whose replay is never: in doubt.
    await with_store(lambda store: crashed(store, "doubt", 4))
    await with_store(cancelled)
    await with_store(long)


@pytest.fixture(scope="module")
def filled_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The five runs of :func:`fill` in a store of each kind, written once for the module
    (a fill waits out a cancelled run); each test gets a copy of its own (:func:`copy_of`)."""
    place = tmp_path_factory.mktemp("filled")
    anyio.run(fill, lambda: SqliteStore(place / "sqlite" / "runs.db"))
    anyio.run(fill, lambda: JsonlStore(place / "jsonl" / "runs"))
    return place


def copy_of(filled_once: Path, kind: str, tmp_path: Path) -> Path:
    """A copy in ``tmp_path`` of the filled store of ``kind``, for a test to read or spoil."""
    shutil.copytree(filled_once / kind, tmp_path, dirs_exist_ok=True)
    return tmp_path / ("runs.db" if kind == "sqlite" else "runs")


@pytest.fixture(params=sampled(["sqlite", "jsonl"]))
def filled(request: pytest.FixtureRequest, filled_once: Path, tmp_path: Path) -> str:
    """A store with the five runs of :func:`fill`; its STORE argument."""
    if request.param == "sqlite":
        return f"sqlite:{copy_of(filled_once, 'sqlite', tmp_path)}"
    return f"jsonl:{copy_of(filled_once, 'jsonl', tmp_path)}"


def flat(text: str) -> str:
    """``text`` with every run of whitespace (terminal wrapping included) as one space."""
    return " ".join(text.split())


def row(out: str, run_id: str) -> str:
    """The run's line of ``polyloop runs``, up to its age and duration."""
    (line,) = [line for line in out.splitlines() if line.split()[:1] == [run_id]]
    return without_times(line)


def recent_utc(text: object) -> bool:
    """Whether ``text`` is an ISO time in UTC from the last few minutes (a store's clock)."""
    assert isinstance(text, str), text
    at = datetime.fromisoformat(text)
    now = datetime.now(UTC)
    return at.utcoffset() == timedelta(0) and now - timedelta(minutes=10) <= at <= now


# -- runs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_lists_every_run_with_its_state_on_one_line(
    filled: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", backend, "runs", filled]) == 0
    out = capsys.readouterr().out
    assert row(out, "done").split() == ["done", "finished", "submitted", "3", "2"]
    # The state's word first, then why a run nobody drives goes on, or who it waits for.
    interrupted = ["resumable", "(interrupted,", "resume", "it", "to", "go", "on)"]
    assert row(out, "crashed").split() == ["crashed", *interrupted, "-", "0", "0"]
    waiting = ["in", "doubt", "(waiting", "for", "a", "person)"]
    assert row(out, "doubt").split() == ["doubt", *waiting, "-", "0", "0"]
    assert row(out, "stopped").split() == ["stopped", *interrupted, "cancelled", "0", "0"]
    assert row(out, "long").split() == ["long", "finished", "final_answer", "2", "1"]


def test_runs_as_json_lines(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", filled, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_id = {line["run_id"]: line for line in lines}
    assert set(by_id) == {"done", "crashed", "doubt", "stopped", "long"}
    assert {k: v["state"] for k, v in by_id.items()} == {
        "done": "finished",
        "crashed": "resumable",
        "doubt": "in doubt",
        "stopped": "resumable",
        "long": "finished",
    }
    assert by_id["stopped"]["stop_reason"] == "cancelled"
    assert {k: v["ready"] for k, v in by_id.items()} == {
        "done": None,
        "crashed": "interrupted",
        "doubt": None,
        "stopped": "interrupted",
        "long": None,
    }
    assert all(recent_utc(line.pop("last_record_at")) for line in lines)
    # When each run started and, if its log ends with an end record, when it ended.
    assert all(recent_utc(line.pop("started_at")) for line in lines)
    # Two crashed before their end record: no end, no duration.
    ended = {run_id: line.pop("ended_at") for run_id, line in by_id.items()}
    durations = {run_id: line.pop("duration_s") for run_id, line in by_id.items()}
    for run_id in ("crashed", "doubt"):
        assert ended[run_id] is None and durations[run_id] is None
    for run_id in ("done", "stopped", "long"):
        assert recent_utc(ended[run_id]) and 0 <= durations[run_id] < 60
    assert by_id["done"] == {
        "run_id": "done",
        "state": "finished",
        "stop_reason": "submitted",
        "step_count": 3,
        "valid_step_count": 2,
        "detail": None,
        "ready": None,
        "agent": None,
    }


def test_runs_on_an_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", f"jsonl:{tmp_path}"]) == 0
    assert capsys.readouterr().out == f"no runs in jsonl:{tmp_path}\n"
    assert main(["runs", f"jsonl:{tmp_path}", "--json"]) == 0
    assert capsys.readouterr().out == ""


def test_runs_keeps_one_line_per_run_for_long_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = "a-run-id-long-enough-to-push-the-table-past-eighty-columns-" + "z" * 40

    async def build() -> None:
        async with JsonlStore(tmp_path) as store:
            await run(
                definition(store, script=[answer("ok")]), request(run_id, make_tools(Ledger()))
            )

    anyio.run(build)
    assert main(["runs", f"jsonl:{tmp_path}"]) == 0
    assert row(capsys.readouterr().out, run_id).split() == [
        run_id,
        "finished",
        "final_answer",
        "1",
        "0",
    ]


# -- show --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_show_prints_one_block_per_step_and_the_end(
    filled: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", backend, "show", filled, "done"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run done  finished")
    assert "step 0 · action · executed" in out
    assert "step 1 · invalid · invalid reply" in out
    assert 'double({"n": 1})' in out
    assert "2 (done:0:action)" in out
    assert MARKUP in out  # shown as text, never interpreted
    assert "end" in out and "submitted" in out
    assert "3 (2 valid)" in out


def test_show_shortens_long_observations_in_the_terminal(
    filled: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", filled, "long"]) == 0
    out = capsys.readouterr().out
    assert "(2400 more characters)" in out
    assert LONG not in out.replace("\n", "").replace(" ", "")


def test_show_describes_where_an_unfinished_run_stopped(
    filled: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", filled, "doubt"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run doubt  in doubt")
    assert "the action intent 'doubt:0:action' has no result (replay never)" in flat(out)
    assert main(["show", filled, "crashed"]) == 0
    assert "step 0: the model replied; no action was announced yet" in flat(capsys.readouterr().out)


def test_show_json_is_one_document_with_the_encoded_steps(
    filled: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", filled, "done", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert {
        k: document[k]
        for k in (
            "run_id",
            "state",
            "stop_reason",
            "step_count",
            "valid_step_count",
            "final_answer",
            "detail",
            "open_intent",
            "interrupted",
        )
    } == {
        "run_id": "done",
        "state": "finished",
        "stop_reason": "submitted",
        "step_count": 3,
        "valid_step_count": 2,
        "final_answer": None,
        "detail": None,
        "open_intent": None,
        "interrupted": None,
    }
    steps = [serialization.decode(step) for step in document["steps"]]
    assert all(isinstance(step, StepRecord) for step in steps)
    assert [step.step for step in steps] == [0, 1, 2]
    assert steps[1].model_output == MARKUP
    assert document["snapshot"]["binding.episode"] == "e1"

    assert main(["show", filled, "doubt", "--json"]) == 0
    doubt = json.loads(capsys.readouterr().out)
    assert doubt["state"] == "in doubt"
    assert doubt["open_intent"]["result_id"] == "doubt:0:action"
    assert doubt["open_intent"]["replay"] == Replay.NEVER.value


class _Page(HTMLParser):
    """Collects what matters about a page: tags, attributes, ids, text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attributes: list[tuple[str, str | None]] = []
        self.ids: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attributes.extend(attrs)
        self.ids.extend(value for name, value in attrs if name == "id" and value)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_show_html_is_one_self_contained_page(
    filled: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "done.html"
    assert main(["show", filled, "done", "--html", str(target)]) == 0
    assert capsys.readouterr().out == f"wrote {target}\n"
    page = _Page()
    page.feed(target.read_text(encoding="utf-8"))
    page.close()
    assert page.tags[0] == "html"
    assert {"script", "link", "img", "iframe", "object", "embed"}.isdisjoint(page.tags)
    assert not [
        name for name, _ in page.attributes if name in ("src", "href") or name.startswith("on")
    ]
    assert not [value for _, value in page.attributes if value and "//" in value]
    assert "style" in page.tags  # the CSS is inline
    assert {"summary", "step-0", "step-1", "end"} <= set(page.ids)
    text = "".join(page.text)
    assert MARKUP in text  # escaped in the file, so the parser reads it back as text
    assert "2 (done:0:action)" in text
    assert "submitted" in text


def test_show_html_of_a_long_observation_keeps_it_whole(filled: str, tmp_path: Path) -> None:
    target = tmp_path / "long.html"
    assert main(["show", filled, "long", "--html", str(target)]) == 0
    assert LONG in target.read_text(encoding="utf-8")


def test_show_html_into_a_missing_directory_is_one_error(
    filled: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", filled, "done", "--html", str(tmp_path / "no" / "x.html")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("polyloop: error: ") and "No such file or directory" in err
    # The page's path is what could not be written: said so, not the run or the store.
    page = tmp_path / "no" / "x.html"
    assert (
        err == f"polyloop: error: cannot write the HTML page to {page}: No such file or directory\n"
    )


def test_show_of_an_unknown_run_is_one_error(
    filled: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", filled, "nobody"]) == 1
    assert capsys.readouterr().err == f"polyloop: error: unknown run id 'nobody' in {filled}\n"


# -- verify ------------------------------------------------------------------------------------


def jsonl_file(store: str, run_id: str) -> Path:
    from polyloop.stores._paths import safe_name

    return Path(store.removeprefix("jsonl:")) / f"{safe_name(run_id)}.jsonl"


def edit_lines(path: Path, edit: Callable[[list[str]], list[str]]) -> None:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    path.write_text("".join(edit(lines)), encoding="utf-8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_a_clean_store(
    filled: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", backend, "verify", filled]) == 0
    out = capsys.readouterr().out
    for run_id in ("done", "crashed", "doubt", "stopped", "long"):
        assert f"ok       {run_id} (" in out
    assert out.rstrip().endswith("5 runs checked: 5 clean, 0 with warnings, 0 with errors")


def test_verify_one_run(filled: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", filled, "done"]) == 0
    out = capsys.readouterr().out
    assert "ok       done (" in out and "crashed" not in out
    assert main(["verify", filled, "nobody"]) == 1
    assert capsys.readouterr().err == f"polyloop: error: unknown run id 'nobody' in {filled}\n"


@pytest.fixture
def jsonl_store(filled_once: Path, tmp_path: Path) -> str:
    return f"jsonl:{copy_of(filled_once, 'jsonl', tmp_path)}"


def test_verify_reports_a_torn_tail_as_a_warning(
    jsonl_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = jsonl_file(jsonl_store, "crashed")
    lines = len(path.read_text().splitlines())
    with path.open("a") as file:
        file.write('{"schema":"polyloop/1","kind":"res')
    assert main(["verify", jsonl_store]) == 0
    out = capsys.readouterr().out
    assert f"warning  crashed  {path}:{lines + 1}: torn tail: 34 bytes" in out
    assert "1 with warnings, 0 with errors" in out
    # A torn tail is invisible to readers: the run still lists as resumable.
    assert main(["runs", jsonl_store]) == 0
    assert row(capsys.readouterr().out, "crashed").split()[1] == "resumable"


def test_verify_names_every_corrupt_line(
    jsonl_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = jsonl_file(jsonl_store, "done")
    edit_lines(
        path, lambda lines: [lines[0], "this is not json\n", *lines[2:4], "{}\n", *lines[5:]]
    )
    assert main(["verify", jsonl_store]) == 1
    out = capsys.readouterr().out
    assert f"error    done  {path}:2: not a JSON record" in out
    assert f"error    done  {path}:5: no polyloop schema field" in out
    assert "ok       long (" in out
    assert "5 runs checked: 4 clean, 0 with warnings, 1 with errors" in out


def test_verify_reports_another_schema_major(
    jsonl_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = jsonl_file(jsonl_store, "long")
    edit_lines(path, lambda lines: [lines[0].replace('"polyloop/1"', '"polyloop/2"'), *lines[1:]])
    assert main(["verify", jsonl_store, "long"]) == 1
    out = capsys.readouterr().out
    assert f"error    long  {path}:1: another major of the record format" in out
    assert "'polyloop/2'" in out


def test_verify_reports_records_out_of_order_with_their_line(
    jsonl_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = jsonl_file(jsonl_store, "done")
    # Swap step 0's model-call intent and its result.
    edit_lines(path, lambda lines: [lines[0], lines[2], lines[1], *lines[3:]])
    assert main(["verify", jsonl_store, "done"]) == 1
    out = capsys.readouterr().out
    assert (
        f"error    done  {path}:2 (record 1): records out of order: "
        "result 'done:0:model' has no open intent" in out
    )


def test_verify_reports_a_record_of_another_run(
    jsonl_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    done, other = jsonl_file(jsonl_store, "done"), jsonl_file(jsonl_store, "long")
    stray = other.read_text().splitlines(keepends=True)[1]
    edit_lines(done, lambda lines: [*lines, stray])
    assert main(["verify", jsonl_store, "done"]) == 1
    out = capsys.readouterr().out
    last = len(done.read_text().splitlines())
    assert f"{done}:{last}: a record of run 'long' in the log of run 'done'" in out


def test_verify_names_a_file_by_the_path_the_user_gave(
    jsonl_store: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = jsonl_file(jsonl_store, "done")
    edit_lines(path, lambda lines: [lines[0], "this is not json\n", *lines[2:]])
    monkeypatch.chdir(path.parent.parent)
    assert main(["verify", "jsonl:runs", "done"]) == 1
    out = capsys.readouterr().out
    # A path to open from where the command ran, not the file's base name alone.
    named = f"runs/{path.name}"
    assert f"error    done  {named}:2: not a JSON record" in out
    assert Path(named).read_text().splitlines()[1] == "this is not json"


def test_runs_lists_a_corrupt_log_and_show_refuses_it_in_one_line(
    jsonl_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = jsonl_file(jsonl_store, "done")
    edit_lines(path, lambda lines: [*lines[:3], "garbage\n", *lines[4:]])
    problem = f"run 'done', at {path}:4: not a JSON record"
    # runs marks the corrupt run, says where and why, and still lists the others.
    assert main(["runs", jsonl_store]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    line = row(out, "done")
    assert line.split()[:2] == ["done", "corrupt"]
    assert problem in line
    assert line.split()[-2:] == ["-", "-"]
    assert row(out, "crashed").split()[:2] == ["crashed", "resumable"]
    assert row(out, "doubt").split()[:3] == ["doubt", "in", "doubt"]
    assert row(out, "stopped").split()[-3:] == ["cancelled", "0", "0"]
    assert row(out, "long").split() == ["long", "finished", "final_answer", "2", "1"]

    assert main(["runs", jsonl_store, "--json"]) == 0
    by_id = {line["run_id"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(by_id) == {"done", "crashed", "doubt", "stopped", "long"}
    corrupt = by_id["done"]
    assert corrupt.pop("detail").startswith(problem)
    assert corrupt == {
        "run_id": "done",
        "state": "corrupt",
        "stop_reason": None,
        "step_count": None,
        "valid_step_count": None,
        "ready": None,
        "agent": None,
        "last_record_at": None,
        "started_at": None,
        "ended_at": None,
        "duration_s": None,
    }

    # show has nothing to show: one line on standard error.
    assert main(["show", jsonl_store, "done"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"polyloop: error: {problem}")


@pytest.fixture
def sqlite_store(filled_once: Path, tmp_path: Path) -> Path:
    return copy_of(filled_once, "sqlite", tmp_path)


def test_verify_sqlite_names_the_corrupt_row(
    sqlite_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sqlite3.connect(sqlite_store) as conn:
        conn.execute("UPDATE records SET body = 'nope' WHERE run_id = 'done' AND seq = 3")
    assert main(["verify", f"sqlite:{sqlite_store}"]) == 1
    out = capsys.readouterr().out
    assert f"error    done  {sqlite_store}: run row seq 3: not a JSON record" in out
    assert "4 clean, 0 with warnings, 1 with errors" in out


def test_verify_sqlite_finds_records_out_of_order(
    sqlite_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sqlite3.connect(sqlite_store) as conn:
        rows = dict(
            conn.execute(
                "SELECT seq, body FROM records WHERE run_id = 'done' AND seq IN (1, 2)"
            ).fetchall()
        )
        kinds = dict(
            conn.execute(
                "SELECT seq, kind FROM records WHERE run_id = 'done' AND seq IN (1, 2)"
            ).fetchall()
        )
        for seq, other in ((1, 2), (2, 1)):
            conn.execute(
                "UPDATE records SET body = ?, kind = ? WHERE run_id = 'done' AND seq = ?",
                (rows[other], kinds[other], seq),
            )
    assert main(["verify", f"sqlite:{sqlite_store}", "done"]) == 1
    out = capsys.readouterr().out
    assert "error    done  record 1: records out of order" in out


def test_verify_sqlite_reports_another_schema_major_in_one_line(
    sqlite_store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sqlite3.connect(sqlite_store) as conn:
        conn.execute("UPDATE meta SET value = 'polyloop/2' WHERE key = 'format'")
    assert main(["verify", f"sqlite:{sqlite_store}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"polyloop: error: at {sqlite_store}: meta format: the database holds "
        "records in format 'polyloop/2'"
    )


# -- what the model said about its replies ------------------------------------------------------


def metered_script() -> list[ModelReply]:
    facts: dict[str, Any] = {"call_id": None, "reasoning": None, "model": "m-2024-08-06"}
    return [
        ModelReply(
            content=tool_call("double", n=1),
            finish=FinishReason.TOOL_CALLS,
            usage=Usage(input_tokens=1200, output_tokens=80, reasoning_tokens=30),
            **facts,
        ),
        ModelReply(
            content='{"tool": "submit", "argu',
            finish=FinishReason.LENGTH,
            usage=Usage(input_tokens=1300, output_tokens=4096),
            **facts,
        ),
        ModelReply(
            content="", refusal="I won't.", usage=Usage(input_tokens=1, output_tokens=2), **facts
        ),
        ModelReply(content=tool_call("submit", answer="2"), **facts),
    ]


@pytest.fixture
def metered(tmp_path: Path) -> str:
    """A SQLite store holding one finished run whose replies report finish, usage and model."""
    path = tmp_path / "metered.db"

    async def fill_one() -> None:
        async with SqliteStore(path) as store:
            await run(
                definition(store, script=metered_script()), request("m", make_tools(Ledger()))
            )

    anyio.run(fill_one)
    return f"sqlite:{path}"


def test_show_prints_how_each_reply_ended_and_what_it_cost(
    metered: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", metered, "m"]) == 0
    out = flat(capsys.readouterr().out)
    assert "finish tool calls" in out
    assert "tokens 1,200 in, 80 out (30 reasoning)" in out
    assert "finish cut off at the length limit" in out
    assert "refusal I won't." in out
    assert "model m-2024-08-06" in out
    # The last reply reported no usage, so the run's total counts are unknown.
    assert "tokens ? in, ? out" in out


def test_show_json_and_html_carry_the_reply_facts(
    metered: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", metered, "m", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    steps = [serialization.decode(step) for step in document["steps"]]
    assert [step.finish for step in steps] == [  # type: ignore[union-attr]
        FinishReason.TOOL_CALLS,
        FinishReason.LENGTH,
        None,
        None,
    ]
    assert steps[2].refusal == "I won't."  # type: ignore[union-attr]
    assert document["usage"] == {
        "input_tokens": None,
        "output_tokens": None,
        "reasoning_tokens": None,
    }
    target = tmp_path / "m.html"
    assert main(["show", metered, "m", "--html", str(target)]) == 0
    page = _Page()
    page.feed(target.read_text(encoding="utf-8"))
    text = flat(" ".join(page.text))
    assert "cut off at the length limit" in text
    assert "1,300 in, 4,096 out" in text
    assert "I won't." in text


# -- output into a pipe ------------------------------------------------------------------------


@pytest.fixture
def crowded(tmp_path: Path) -> str:
    """A SQLite store holding 1,000 finished runs: their listing is more than a pipe holds."""
    path = tmp_path / "crowded.db"

    async def fill_many() -> None:
        async with SqliteStore(path) as store:
            tools = make_tools(Ledger())
            shared = definition(store, script=[answer("x")])
            async with anyio.create_task_group() as group:
                for i in range(1_000):
                    group.start_soon(run, shared, request(f"run-{i:04d}", tools))

    anyio.run(fill_many)
    return f"sqlite:{path}"


@pytest.mark.slow
def test_a_reader_that_stops_early_gets_no_broken_pipe_message(crowded: str) -> None:
    """``polyloop runs --json | head -1``: the rest of the listing has nowhere to go, and
    the command stops without a word on stderr."""
    with subprocess.Popen(
        [sys.executable, "-m", "polyloop", "runs", crowded, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().startswith(b"{")
        process.stdout.close()
        errors = process.stderr.read().decode()
        assert process.wait(timeout=60) == 1
    assert errors == ""


def test_piped_show_has_no_trailing_spaces(filled: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "polyloop", "show", filled, "done"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "step 0" in shown
    assert all(line == line.rstrip(" ") for line in shown.splitlines())


# -- lone surrogates ---------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "jsonl"])
def halves(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store of :func:`surrogate_kit.fill`'s runs; its STORE argument."""
    if request.param == "sqlite":
        anyio.run(surrogate_kit.fill, SqliteStore(tmp_path / "runs.db"))
        return f"sqlite:{tmp_path / 'runs.db'}"
    anyio.run(surrogate_kit.fill, JsonlStore(tmp_path / "runs"))
    return f"jsonl:{tmp_path / 'runs'}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_show_escapes_a_lone_surrogate_in_every_form(
    halves: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict_output = StrictOutput(monkeypatch)
    assert main(["--backend", backend, "show", halves, "half"]) == 0
    out, err = strict_output.read()
    assert f"done {SHOWN}" in out and err == ""
    assert main(["--backend", backend, "show", halves, "half", "--json"]) == 0
    out, err = strict_output.read()
    document = json.loads(out)  # still JSON: the escape is JSON's own
    assert document["final_answer"] == f"done {HALF}" and err == ""
    target = tmp_path / "half.html"
    assert main(["--backend", backend, "show", halves, "half", "--html", str(target)]) == 0
    assert strict_output.read() == (f"wrote {target}\n", "")
    assert f"done {SHOWN}" in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_show_of_a_run_whose_id_holds_a_lone_surrogate_names_its_trace(
    halves: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict_output = StrictOutput(monkeypatch)
    shown, trace_id = RUN_ID.replace(HALF, SHOWN), run_trace_id(RUN_ID)
    assert main(["--backend", backend, "show", halves, RUN_ID]) == 0
    out, err = strict_output.read()
    assert f"trace id {trace_id}" in " ".join(out.split()) and shown in out and err == ""
    assert main(["--backend", backend, "show", halves, RUN_ID, "--json"]) == 0
    out, err = strict_output.read()
    document = json.loads(out)
    assert document["run_id"] == RUN_ID and document["trace_id"] == trace_id and err == ""
    target = tmp_path / "id.html"
    assert main(["--backend", backend, "show", halves, RUN_ID, "--html", str(target)]) == 0
    assert strict_output.read() == (f"wrote {target}\n", "")
    assert trace_id in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_show_opens_a_run_whose_id_holds_a_lone_surrogate(
    halves: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict_output = StrictOutput(monkeypatch)
    shown = RUN_ID.replace(HALF, SHOWN)
    assert main(["--backend", backend, "show", halves, RUN_ID]) == 0
    out, err = strict_output.read()
    assert out.startswith(f"run {shown}  finished") and err == ""
    # Its trace id is derived from the id's bytes, as the stores write them.
    assert run_trace_id(RUN_ID) in out
    assert run_trace_id(RUN_ID) != run_trace_id(RUN_ID.replace(HALF, "\ufffd"))
    assert main(["--backend", backend, "show", halves, RUN_ID, "--json"]) == 0
    assert json.loads(strict_output.read()[0])["trace_id"] == run_trace_id(RUN_ID)
    target = tmp_path / "id.html"
    assert main(["--backend", backend, "show", halves, RUN_ID, "--html", str(target)]) == 0
    assert f"<h1>polyloop run {shown}</h1>" in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_and_verify_escape_a_run_id_holding_a_lone_surrogate(
    halves: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict_output = StrictOutput(monkeypatch)
    shown = RUN_ID.replace(HALF, SHOWN)
    assert main(["--backend", backend, "runs", halves]) == 0
    out, err = strict_output.read()
    assert f"{shown}   finished" in out and err == ""
    # The escape is measured as it is printed: the columns still line up.
    (escaped,) = [line for line in out.splitlines() if line.startswith(shown)]
    assert escaped.index("finished") == row(out, "half").index("finished")
    assert main(["--backend", backend, "runs", halves, "--json"]) == 0
    out, err = strict_output.read()
    assert {json.loads(line)["run_id"] for line in out.splitlines()} == {"half", RUN_ID, "ask"}
    assert main(["--backend", backend, "verify", halves]) == 0
    out, err = strict_output.read()
    assert f"ok       {shown} (" in out
    assert "3 runs checked: 3 clean" in out and err == ""


# -- strings that could forge a line ------------------------------------------------------------

# A run id that, printed raw, would end its line and start one of its own, and one that
# would turn the rest of its line around on screen.
FORGING_IDS = ("evil (1 records)\nok       forged", "rtl\u202e(sdrocer 1) kcab")


async def _fill_forging(store: Any) -> None:
    async with store:
        tools = make_tools(Ledger())
        for run_id in FORGING_IDS:
            await run(definition(store, script=[answer("done")]), request(run_id, tools))


@pytest.fixture(params=["sqlite", "jsonl"])
def forging(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store whose run ids hold a newline and a right-to-left override; its STORE."""
    if request.param == "sqlite":
        anyio.run(_fill_forging, SqliteStore(tmp_path / "runs.db"))
        return f"sqlite:{tmp_path / 'runs.db'}"
    anyio.run(_fill_forging, JsonlStore(tmp_path / "runs"))
    return f"jsonl:{tmp_path / 'runs'}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_and_verify_escape_a_run_id_that_could_forge_a_line(
    forging: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", backend, "runs", forging]) == 0
    out = capsys.readouterr().out
    assert "\u202e" not in out and not any(line.startswith("ok") for line in out.splitlines())
    assert row(out, "evil").split()[:5] == ["evil", "(1", "records)\\nok", "forged", "finished"]
    assert row(out, "rtl\\u202e(sdrocer").split()[-4:] == ["finished", "final_answer", "1", "0"]
    assert main(["--backend", backend, "verify", forging]) == 0
    out = capsys.readouterr().out
    *checked, summary = out.splitlines()
    assert (
        "\u202e" not in out and summary == "2 runs checked: 2 clean, 0 with warnings, 0 with errors"
    )
    assert set(checked) == {
        "ok       evil (1 records)\\nok       forged (5 records)",
        "ok       rtl\\u202e(sdrocer 1) kcab (5 records)",
    }
    assert main(["--backend", backend, "runs", forging, "--json"]) == 0
    listed = {json.loads(line)["run_id"] for line in capsys.readouterr().out.splitlines()}
    assert listed == set(FORGING_IDS)


def test_show_escapes_a_run_id_that_could_forge_a_line(
    forging: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for run_id in FORGING_IDS:
        assert main(["show", forging, run_id]) == 0
        out = capsys.readouterr().out
        assert "\u202e" not in out and not any(line.startswith("ok") for line in out.splitlines())
        escaped = run_id.replace("\n", "\\n").replace("\u202e", "\\u202e")
        assert out.splitlines()[0] == f"run {escaped}  finished  (5 records)"


def test_show_html_names_the_run_as_show_does(forging: str, tmp_path: Path) -> None:
    """The title and the heading hold the run id as the terminal's first line does: a
    newline in it is shown as an escape, not as a space that hides it."""
    for run_id in FORGING_IDS:
        target = tmp_path / "run.html"
        assert main(["show", forging, run_id, "--html", str(target)]) == 0
        page = target.read_text(encoding="utf-8")
        escaped = escape(run_id.replace("\n", "\\n").replace("\u202e", "\\u202e"))
        assert f"<title>polyloop run {escaped}</title>" in page
        assert f"<h1>polyloop run {escaped}</h1>" in page


def test_show_html_escapes_a_bidirectional_override_that_could_reorder_the_page(
    forging: str, tmp_path: Path
) -> None:
    target = tmp_path / "rtl.html"
    assert main(["show", forging, FORGING_IDS[1], "--html", str(target)]) == 0
    page = target.read_text(encoding="utf-8")
    assert "\u202e" not in page
    assert "rtl\\u202e(sdrocer 1) kcab" in page
