"""``polyloop show`` tells the truth about time, tokens, resumes and an effect in doubt.

The runs are written by the kernel (a crash by ``FaultyStore``, then ``resume``), except
the old log, which is put together from the first release's record fixtures: it has
none of the later facts, and show must say so rather than fail. The HTML page is
rendered by headless Chromium, so what is checked is the text a reader sees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_kit import (
    Ledger,
    close_store,
    crash_and_resume,
    definition,
    five_step_script,
    make_tools,
    request,
    tool_call,
)
from polyloop import ModelReply, Replay, Usage, run
from polyloop.cli import main
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._common import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

BACKENDS = ["asyncio", "trio"]
FIXTURES = Path(__file__).parent.parent / "fixtures" / "records" / "v1"
OLD_RUN = "exp-7/task-12#3"
# A time in UTC as the terminal and the page show it.
UTC_TIME = re.compile(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z")


def reply(content: str, usage: Usage | None) -> ModelReply:
    return ModelReply(content=content, call_id=None, reasoning=None, usage=usage)


async def _write_runs(directory: Path) -> None:
    """Finished, partly metered, cancelled, resumed and in-doubt runs, one store each."""
    async with SqliteStore(directory / "done.db") as store:
        script = [
            reply(tool_call("double", n=1), Usage(input_tokens=100, output_tokens=20)),
            reply(tool_call("submit", answer="2"), Usage(input_tokens=130, output_tokens=10)),
        ]
        await run(definition(store, script=script), request("done", make_tools(Ledger())))
    async with SqliteStore(directory / "partial.db") as store:
        script = [
            reply(tool_call("double", n=1), Usage(input_tokens=100, output_tokens=20)),
            reply(tool_call("submit", answer="2"), None),
        ]
        await run(definition(store, script=script), request("partial", make_tools(Ledger())))
    async with SqliteStore(directory / "stopped.db") as store:
        slow = make_tools(Ledger(), delay=30, replay=Replay.ALLOWED)
        with anyio.move_on_after(0.3):
            await run(definition(store, script=five_step_script()), request("stopped", slow))
    # Crash once step 1's model intent is written; the resumed process writes steps 1-4.
    _, _, resumed = await crash_and_resume(
        lambda: SqliteStore(directory / "resumed.db"), 7, Replay.ALLOWED, five_step_script()
    )
    await close_store(resumed)
    # Crash once step 0's action intent is written; its replay is never: in doubt.
    _, _, doubt = await crash_and_resume(
        lambda: SqliteStore(directory / "doubt.db"), 4, Replay.NEVER, five_step_script()
    )
    await close_store(doubt)


async def _write_held(directory: Path) -> None:
    """An action intent left open by a crash, its replay never; a model call likewise, resumed."""
    async with JsonlStore(directory / "held") as store:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=4), script=five_step_script()),
                request("held", make_tools(Ledger())),
            )
    _, _, resumed = await crash_and_resume(
        lambda: SqliteStore(directory / "model.db"), 2, Replay.NEVER, five_step_script()
    )
    await close_store(resumed)


def _write_old_log(directory: Path) -> None:
    """A run cut short after step 0, in records as the first release wrote them."""
    names = ["run_started", "intent_model_call", "result_model_call", "step_action"]
    lines = [(FIXTURES / f"{name}.json").read_text(encoding="utf-8") for name in names]
    directory.mkdir()
    (directory / f"{safe_name(OLD_RUN)}.jsonl").write_text("".join(lines), encoding="utf-8")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The STORE argument of each run, by run id (the crashed runs are both ``r``)."""
    directory = tmp_path_factory.mktemp("show")
    anyio.run(_write_runs, directory)
    anyio.run(_write_held, directory)
    _write_old_log(directory / "old")
    shown = {name: f"sqlite:{directory / name}.db" for name in ("done", "partial", "stopped")}
    shown |= {name: f"sqlite:{directory / name}.db" for name in ("resumed", "doubt")}
    shown["old"] = f"jsonl:{directory / 'old'}"
    shown["held"] = f"jsonl:{directory / 'held'}"
    shown["model"] = f"sqlite:{directory / 'model.db'}"
    return shown


RUN_IDS = {"resumed": "r", "doubt": "r", "model": "r", "old": OLD_RUN}


def show(stores: dict[str, str], name: str, *options: str, backend: str = "asyncio") -> list[str]:
    return ["--backend", backend, "show", stores[name], RUN_IDS.get(name, name), *options]


def text_of(capsys: pytest.CaptureFixture[str]) -> str:
    """Standard output with every run of whitespace as one space (terminal wrapping too)."""
    return " ".join(capsys.readouterr().out.split())


def document(stores: dict[str, str], name: str, capsys: pytest.CaptureFixture[str]) -> Any:
    assert main(show(stores, name, "--json")) == 0
    return json.loads(capsys.readouterr().out)


# -- the terminal ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_of_a_finished_run_has_times_and_tokens(
    stores: dict[str, str], backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "done", backend=backend)) == 0
    out = text_of(capsys)
    assert out.startswith("run done finished")
    assert "state finished (submitted)" in out
    assert len(UTC_TIME.findall(out)) == 4  # started, ended, and each step's record
    assert re.search(r"wall time \d+\.\d{3} s", out)
    assert re.search(r"time \d+\.\d{3} s \(model \d+\.\d{3} s, tool \d+\.\d{3} s\)", out)
    assert "tokens 100 in, 20 out, 120 total" in out
    assert out.count("tokens 230 in, 30 out, 260 total") == 2  # the summary and the end
    assert "resumed" not in out and "IN DOUBT" not in out


def test_text_says_a_total_is_unknown_rather_than_understate_it(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "partial")) == 0
    out = text_of(capsys)
    assert "tokens ? in, ? out, ? total; unknown, as the reply of step 1 reported no counts" in out
    assert "120 total" in out  # step 0's own count is still shown


def test_text_marks_the_steps_a_resumed_process_wrote(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "resumed")) == 0
    out = text_of(capsys)
    assert "resumed after step 0 (at least 2 attempts)" in out
    assert "step 0 · action · executed ─" in out
    for step in (1, 2, 3, 4):
        assert re.search(rf"step {step} · \w+ · [\w ]+ · resumed", out), step
    assert out.count("written by a process that resumed the run") == 4


def test_text_puts_the_effect_in_doubt_first(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "doubt")) == 0
    out = text_of(capsys)
    assert out.startswith("run r in doubt")
    banner = out[: out.index("started")]
    assert "IN DOUBT step 0's action double was announced and has no result" in banner
    assert 'tool double arguments {"n": 1}' in banner
    assert "result id r:0:action" in banner
    assert UTC_TIME.search(banner)  # when the intent was written
    assert "finished" not in out


def test_text_of_a_model_call_in_doubt(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "model")) == 0
    out = text_of(capsys)
    assert "IN DOUBT step 0's model call was announced and has no result" in out
    assert "kind model_call result id r:0:model" in out


def test_an_open_intent_under_a_live_writer_is_running_not_in_doubt(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    holder = JsonlStore(stores["held"].removeprefix("jsonl:"))
    anyio.run(holder.claim_run, "held")  # a worker is driving it now
    try:
        assert main(show(stores, "held")) == 0
        out = text_of(capsys)
        assert out.startswith("run held running")
        assert "state running: a live worker" in out
        assert "IN DOUBT" not in out
    finally:
        anyio.run(holder.aclose)
    assert main(show(stores, "held")) == 0  # nobody holds it: the action is in doubt
    out = text_of(capsys)
    assert out.startswith("run held in doubt (4 records) IN DOUBT step 0's action double was")


def test_text_of_a_cancelled_run_says_resume_goes_on(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "stopped")) == 0
    out = text_of(capsys)
    assert out.startswith("run stopped resumable")
    assert "state resumable: cancelled; resume goes on" in out


def test_text_of_an_old_log_without_times(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "old")) == 0
    out = text_of(capsys)
    assert "state resumable: not finished; resume goes on" in out
    assert "started — last record — wall time —" in out
    assert "time 1.500 s" in out  # the first release already wrote a step's duration
    assert not UTC_TIME.search(out)
    assert "written" not in out and "resumed" not in out


# -- JSON --------------------------------------------------------------------------------------

OLD_KEYS = {
    "run_id",
    "state",
    "stop_reason",
    "step_count",
    "valid_step_count",
    "detail",
    "last_record_at",
    "final_answer",
    "records",
    "interrupted",
    "snapshot",
    "open_intent",
    "usage",
    "steps",
}


def test_json_of_a_finished_run_adds_the_facts(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "done", capsys)
    assert set(shown) >= OLD_KEYS
    assert shown["usage"] == {"input_tokens": 230, "output_tokens": 30, "reasoning_tokens": None}
    assert shown["total_tokens"] == 260
    assert shown["tokens_unreported_steps"] == []
    assert shown["in_doubt"] is None and shown["resumed_after_steps"] == []
    assert shown["started_at"].endswith("Z") and shown["wall_time_s"] > 0
    (first, second) = shown["timeline"]
    assert first["step"] == 0 and first["total_tokens"] == 120 and first["resumed"] is False
    assert first["duration_s"] >= first["model_duration_s"] >= 0
    assert first["at"] < second["at"]


def test_json_of_a_partly_metered_run_has_no_total(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "partial", capsys)
    assert shown["total_tokens"] is None
    assert shown["tokens_unreported_steps"] == [1]


def test_json_of_a_resumed_run(stores: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    shown = document(stores, "resumed", capsys)
    assert shown["resumed_after_steps"] == [0]
    assert [step["resumed"] for step in shown["timeline"]] == [False, True, True, True, True]


def test_json_of_an_in_doubt_run_names_the_effect(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "doubt", capsys)
    assert shown["state"] == "in doubt"
    doubt = shown["in_doubt"]
    assert {k: doubt[k] for k in ("step", "kind", "tool", "arguments", "result_id", "replay")} == {
        "step": 0,
        "kind": "action",
        "tool": "double",
        "arguments": {"n": 1},
        "result_id": "r:0:action",
        "replay": "never",
    }
    assert doubt["announced_at"].endswith("Z")
    assert shown["state_text"].startswith("IN DOUBT")


def test_json_of_an_old_log_has_nulls(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "old", capsys)
    assert set(shown) >= OLD_KEYS
    assert shown["started_at"] is None and shown["wall_time_s"] is None
    assert shown["total_tokens"] is None and shown["in_doubt"] is None
    assert shown["timeline"] == [
        {
            "step": 0,
            "at": None,
            "duration_s": 1.5,
            "model_duration_s": None,
            "action_duration_s": None,
            "resumed": False,
            "total_tokens": None,
        }
    ]


# -- HTML, as a browser renders it -------------------------------------------------------------


def chromium() -> str:
    """The browser; missing, the test fails under CI (which installs it) and skips elsewhere."""
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed; CI installs it before the tests")
        pytest.skip("chromium is not installed")
    return found


class _Text(HTMLParser):
    """The text of a rendered DOM, without the style sheet's."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if not self._in_style:
            self.parts.append(data)


def headless(browser: str, tmp_path: Path) -> list[str]:
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}/p"]


@pytest.fixture
def rendered(stores: dict[str, str], tmp_path: Path) -> Any:
    browser = chromium()

    def render(name: str) -> tuple[str, str]:
        """The page's text as rendered, and its DOM."""
        page = tmp_path / f"{name}.html"
        assert main(show(stores, name, "--html", str(page))) == 0
        dom = subprocess.run(
            [*headless(browser, tmp_path), "--dump-dom", page.as_uri()],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        parser = _Text()
        parser.feed(dom)
        parser.close()
        return " ".join(" ".join(parser.parts).split()), dom

    return render


def test_html_of_a_finished_run_in_a_browser(
    rendered: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    text, _ = rendered("done")
    assert "state finished meaning finished (submitted)" in text
    assert len(UTC_TIME.findall(text)) == 4
    assert re.search(r"time \d+\.\d{3} s \(model \d+\.\d{3} s, tool \d+\.\d{3} s\)", text)
    assert "tokens 230 in, 30 out, 260 total" in text
    assert "IN DOUBT" not in text and "resumed" not in text


def test_html_of_a_resumed_run_in_a_browser(rendered: Any) -> None:
    text, _ = rendered("resumed")
    assert "resumed after step 0 (at least 2 attempts)" in text
    assert "step 0 · action · executed decision" in text
    assert "step 1 · action · not executed resumed" in text
    assert text.count("written by a process that resumed the run") == 4


def test_html_of_an_in_doubt_run_in_a_browser_is_never_green(rendered: Any) -> None:
    text, dom = rendered("doubt")
    # The title, then the heading, then at once the banner.
    assert text.startswith("polyloop run r polyloop run r IN DOUBT step 0's action double was")
    banner = text[: text.index("state")]
    assert 'tool double arguments {"n": 1}' in banner and "result id r:0:action" in banner
    assert "finished" not in text
    assert 'class="good"' not in dom


def test_html_of_an_old_log_in_a_browser(rendered: Any) -> None:
    text, _ = rendered("old")
    assert "started — last record — wall time —" in text
    assert "time 1.500 s" in text
    assert not UTC_TIME.search(text)
