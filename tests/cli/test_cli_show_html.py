"""``polyloop show --html`` as a browser renders it: headless Chromium loads each page, and
the tests read the text a reader would see in the DOM it leaves.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import anyio
import pytest
from playwright.sync_api import Browser

from kit.browser import launched
from kit.fork import write_forks
from kit.show import UTC_TIME, show, write_stores
from polyloop import run_trace_id
from polyloop.cli import main
from polyloop.stores import JsonlStore


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    written = write_stores(tmp_path_factory.mktemp("show"))
    forks = tmp_path_factory.mktemp("forks") / "runs"

    async def write() -> None:
        async with JsonlStore(forks) as store:
            await write_forks(store)

    anyio.run(write)
    return {**written, "f": f"jsonl:{forks}"}


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


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One browser for the module; each page is rendered in a tab of its own."""
    with launched() as opened:
        yield opened


@pytest.fixture
def rendered(stores: dict[str, str], browser: Browser, tmp_path: Path) -> Any:
    def render(name: str) -> tuple[str, str]:
        """The page's text as rendered, and its DOM once loaded."""
        path = tmp_path / f"{name}.html"
        # On a thread of its own: Playwright keeps an event loop running on this one.
        with ThreadPoolExecutor(1) as thread:
            assert thread.submit(main, show(stores, name, "--html", str(path))).result() == 0
        page = browser.new_page()
        try:
            page.goto(path.as_uri())
            dom = page.content()
        finally:
            page.close()
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
    assert f"trace id {run_trace_id('exp-7/task-12#3')}" in text
    assert "time 1.500 s" in text
    assert not UTC_TIME.search(text)


def test_html_says_the_probe_settled_a_step_in_a_browser(rendered: Any) -> None:
    text, _ = rendered("unpaid")
    step = text[text.index("step 1 ·") : text.index("step 2 ·")]
    assert re.search(
        r"settled by the probe of tool 'pay' \(it did not run\) at \S+; "
        r"the probe took \d+\.\d{3} (ms|s)",
        step,
    ), step
    assert "time unknown" in step


def test_html_of_a_pending_probe_settlement_in_a_browser(rendered: Any) -> None:
    text, dom = rendered("pending")
    settled = "settled by the probe of tool 'pay' (it ran)"
    assert f"meaning resumable: the open action was {settled}; resume goes on" in text
    assert "IN DOUBT" not in text and 'id="in-doubt"' not in dom


def test_html_of_a_fork_in_a_browser_names_its_source_and_marks_inherited_steps(
    rendered: Any,
) -> None:
    text, dom = rendered("f")
    assert "forked from run 'src' at step 2 (steps 0 to 1 inherited" in text
    assert "step 0 · action · executed inherited decision" in text
    assert "step 1 · action · executed inherited decision" in text
    assert "step 2 · action · executed decision" in text
    assert text.count("from run 'src', where it ran; not run again in this run") == 2
    assert dom.count('class="step inherited"') == 2
