"""The web console in a real browser: headless Chromium (the distribution's, driven by
Playwright) against ``polyloop serve`` running as its own process under asyncio and
Trio, while the approvals example, as the worker, pauses and resumes runs in processes
of their own.

A person opens the list, clicks through to a run and approves, rejects or settles it;
the worker's next resume then does what the answer said, once. Markup from a log is
shown as text and no script of it runs; pages follow the store without a reload.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
from playwright.sync_api import Browser, Page, expect

from kit.agent import Ledger, answer, definition, request, tool_call
from kit.browser import chromium, launched
from kit.console import fill_deploys, fill_many
from kit.review import approval_script, review_tools
from polyloop import run
from polyloop.stores import SqliteStore
from polyloop.types import RunStarted

T = TypeVar("T")

pytestmark = pytest.mark.slow  # each test starts a console and drives a browser

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "approvals.py"
WORKER = ROOT / "tests" / "kit" / "approvals_worker_agent.py"
POLYLOOP = (sys.executable, "-m", "polyloop")
BACKENDS = ["asyncio", "trio"]
# How often the console looks at the store for live pages; short, so tests wait little.
POLL_S = "0.2"
# How long a page may take to follow a change it did not ask for.
LIVE_TIMEOUT_MS = 5_000
SERVER_START_S = 30.0
INTERRUPTED = 130  # how every command ends on Ctrl-C
SCREENSHOT_WIDTH = 1200
SCREENSHOT_MAX_BYTES = 300 * 1024  # small enough for the docs' repository

# Markup a log may hold; none of it may become an element or run a script.
SCRIPT_ID = "run-<script>alert(1)</script>"
PAUSED_ID = "paused-<b>bold</b>\"'&amp;/x"
IMG = "<img src=x onerror=alert(2)>"
SVG = "<svg onload=alert(3)>"
NAME = "<i>mallory</i><script>alert(4)</script>"
# The timeline's own drawings (svg.step-bar) are the one SVG a page may hold.
INJECTED = "main img, main svg:not(.step-bar), main b, main i, main script, main iframe"


@dataclass(frozen=True)
class Place:
    """A store the console serves and the worker drives, and the worker's file of
    effects (one line per tool call that ran)."""

    store: str
    effects_file: Path
    worker: Callable[[str, str, tuple[str, ...]], list[str]]

    def drive(self, backend: str, run_id: str, *options: str, check: bool = True) -> str:
        """Run the worker once on ``run_id``: it drives the run as far as it can go.

        A worker that died holds its runs on PostgreSQL until its (short) lease lapses:
        the next one is started again while it is refused with ``RunLocked``.
        """
        deadline = time.monotonic() + 30
        while True:
            done = subprocess.run(
                self.worker(backend, run_id, options),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if "RunLocked" not in done.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if check:
            assert done.returncode == 0, done.stderr
        return done.stdout

    def effects(self, run_id: str) -> list[str]:
        if not self.effects_file.exists():
            return []
        lines = self.effects_file.read_text(encoding="utf-8").splitlines()
        return [line for line in lines if f" {run_id}:" in line]


def sqlite_place(tmp_path: Path) -> Place:
    """The approvals example itself, on its own SQLite file."""
    db = tmp_path / "runs.db"

    def worker(backend: str, run_id: str, options: tuple[str, ...]) -> list[str]:
        command = [sys.executable, str(EXAMPLE), "--db", str(db), "--backend", backend]
        return [*command, "--run-id", run_id, *options]

    return Place(f"sqlite:{db}", tmp_path / "runs.db.effects.txt", worker)


def postgres_place(url: str, tmp_path: Path) -> Place:
    """The example's run (its model, tools and request) on a PostgreSQL database."""
    effects = tmp_path / "effects.txt"

    def worker(backend: str, run_id: str, options: tuple[str, ...]) -> list[str]:
        return [sys.executable, str(WORKER), url, str(effects), backend, run_id, *options]

    return Place(url, effects, worker)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The event loop of both the console and the worker."""
    return str(request.param)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "sqlite":
        return sqlite_place(tmp_path)
    return postgres_place(request.getfixturevalue("postgres_conninfo"), tmp_path)


@pytest.fixture
def place(tmp_path: Path) -> Place:
    return sqlite_place(tmp_path)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One browser for the module; each test opens a context of its own."""
    with launched() as opened:
        yield opened


@contextmanager
def serving(store: str, backend: str, port: int = 0) -> Iterator[str]:
    """``polyloop serve STORE`` on ``port`` (a free one by default); the address it prints.
    Ends it with Ctrl-C afterwards, as a person would, and checks it ended as every
    command does."""
    server = subprocess.Popen(
        [*POLYLOOP, "serve", store, "--port", str(port), "--backend", backend, "--poll", POLL_S],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    watchdog = threading.Timer(SERVER_START_S, server.kill)  # a server that never says
    watchdog.start()
    try:
        url = _address(server)
        watchdog.cancel()
        yield url
    finally:
        watchdog.cancel()
        server.send_signal(signal.SIGINT)
        _, errors = server.communicate(timeout=30)
    assert server.returncode == INTERRUPTED, errors


def _address(server: subprocess.Popen[str]) -> str:
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("open "):
            return line.removeprefix("open ").strip()
    errors = server.stderr.read() if server.stderr else ""
    raise AssertionError(f"the console ended without saying where it listens: {errors}")


@contextmanager
def served_after(
    fill: Callable[[Path], Awaitable[T]], tmp_path: Path, backend: str
) -> Iterator[tuple[str, T]]:
    """The console's address over a SQLite store ``fill`` filled first, and what ``fill``
    returned. Playwright's own event loop holds this thread: the store is filled in
    another."""
    path = tmp_path / "runs.db"
    with ThreadPoolExecutor(1) as thread:
        filled = thread.submit(anyio.run, fill, path, backend=backend).result()
    with serving(f"sqlite:{path}", backend) as url:
        yield url, filled


@dataclass
class Tab:
    """A page in a fresh browser context, and every sign of a script that should not
    have run: dialogs, console errors, uncaught exceptions."""

    page: Page
    problems: list[str] = field(default_factory=list)

    def watch(self) -> None:
        def dialog(found: Any) -> None:
            self.problems.append(f"dialog: {found.message}")
            found.dismiss()

        self.page.on("dialog", dialog)
        self.page.on("pageerror", lambda error: self.problems.append(f"error: {error}"))
        self.page.on(
            "console",
            lambda message: (
                self.problems.append(f"console: {message.text}")
                if message.type == "error"
                else None
            ),
        )


@contextmanager
def opened(browser: Browser) -> Iterator[Tab]:
    context = browser.new_context()
    try:
        tab = Tab(context.new_page())
        tab.watch()
        yield tab
    finally:
        context.close()


def open_run_from_the_list(page: Page, url: str, run_id: str, state: str) -> None:
    """Open the list, find the run in ``state``, and click through to its page."""
    page.goto(url)
    row = page.locator("tr.run").filter(has=page.get_by_role("link", name=run_id, exact=True))
    expect(row.locator(".state")).to_have_text(state)
    row.get_by_role("link", name=run_id, exact=True).click()
    expect(page.locator("h1")).to_have_text(f"run {run_id}")


def answered(page: Page, verb: str, by: str) -> None:
    """The run's page says who answered, and when."""
    expect(page.locator("p.notice")).to_contain_text(verb.capitalize())
    fact = page.locator("#live dt", has_text=re.compile(f"^{verb}$"))
    expect(fact).to_have_count(1)
    expect(fact.locator("xpath=following-sibling::dd[1]")).to_have_text(
        re.compile(rf"by {re.escape(by)} at \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d")
    )


# -- answering -----------------------------------------------------------------------------


def test_approve_in_the_browser_then_the_next_resume_runs_the_tool_once(
    browser: Browser, any_place: Place, backend: str
) -> None:
    place = any_place
    paused = place.drive(backend, "release-1")
    assert "stop reason: awaiting_approval after 0 steps" in paused
    with serving(place.store, backend) as url, opened(browser) as tab:
        page = tab.page
        open_run_from_the_list(page, url, "release-1", "awaiting approval")
        expect(page.locator("#waiting")).to_contain_text("deploy")
        page.locator("#by-approve").fill("alice")
        page.get_by_role("button", name="Approve").click()
        answered(page, "approved", "alice")
        expect(page.get_by_role("button", name="Approve")).to_have_count(0)
        assert place.effects("release-1") == []  # an answer runs nothing by itself
        assert tab.problems == []
    resumed = place.drive(backend, "release-1")
    assert "stop reason: submitted after 3 steps" in resumed
    assert place.effects("release-1") == [
        "deploy prod release-1:0:action",
        "pay 5 release-1:1:action",
        "submit release-1:2:action",
    ]


def test_reject_in_the_browser_tells_the_model_why_and_the_tool_never_runs(
    browser: Browser, any_place: Place, backend: str
) -> None:
    place = any_place
    place.drive(backend, "release-1")
    with serving(place.store, backend) as url, opened(browser) as tab:
        page = tab.page
        open_run_from_the_list(page, url, "release-1", "awaiting approval")
        page.locator("#by-reject").fill("bob")
        page.locator("#reason").fill("no deploys on Friday")
        page.get_by_role("button", name="Reject").click()
        answered(page, "rejected", "bob")
        assert tab.problems == []
    resumed = place.drive(backend, "release-1")
    assert 'step 0: deploy({"env": "prod"}) -> ' in resumed
    step_0 = next(line for line in resumed.splitlines() if "step 0:" in line)
    assert "no deploys on Friday" in step_0  # what the model was told
    assert not any(line.startswith("deploy ") for line in place.effects("release-1"))


def test_settle_in_the_browser_then_the_next_resume_never_pays_again(
    browser: Browser, any_place: Place, backend: str
) -> None:
    place = any_place
    options = ("--auto-approve",)
    crashed = place.drive(backend, "release-2", *options, "--crash-after-paying", check=False)
    assert "dies after paying" in crashed
    assert "stop reason: in_doubt after 1 steps" in place.drive(backend, "release-2", *options)
    with serving(place.store, backend) as url, opened(browser) as tab:
        page = tab.page
        open_run_from_the_list(page, url, "release-2", "in doubt")
        expect(page.locator("#waiting")).to_contain_text("pay")
        page.locator("#by-settle").fill("carol")
        page.get_by_role("radio", name="it ran").check()
        page.locator("#observation").fill("paid 5")
        page.get_by_role("button", name="Settle").click()
        answered(page, "settled", "carol")
        assert tab.problems == []
    resumed = place.drive(backend, "release-2", *options)
    assert 'step 1: pay({"amount": 5}) -> paid 5 (settled by carol)' in resumed
    assert "stop reason: submitted after 3 steps" in resumed
    assert [line.split()[0] for line in place.effects("release-2")] == [
        "deploy",
        "pay",  # once: before the crash, never again
        "submit",
    ]


# -- escaping ------------------------------------------------------------------------------


async def _fill_with_markup(db: Path) -> None:
    """A finished run whose id, model replies and observations hold markup, and one
    whose id does, paused for approval."""
    tools = review_tools(Ledger())
    async with SqliteStore(db) as store:
        script = [tool_call("double", n=SVG), tool_call("submit", answer=IMG), answer(IMG)]
        await run(definition(store, script=script), request(SCRIPT_ID, tools))
        await run(definition(store, script=approval_script()), request(PAUSED_ID, tools))


def test_markup_from_the_log_is_text_and_no_script_of_it_runs(
    browser: Browser, tmp_path: Path, backend: str
) -> None:
    with served_after(_fill_with_markup, tmp_path, backend) as (url, _), opened(browser) as tab:
        page = tab.page
        response = page.goto(url)
        assert response is not None
        assert "script-src 'nonce-" in response.headers["content-security-policy"]
        ids = page.locator("td.id a").all_inner_texts()
        assert sorted(ids) == sorted([SCRIPT_ID, PAUSED_ID])
        assert page.locator(INJECTED).count() == 0

        open_run_from_the_list(page, url, SCRIPT_ID, "finished")
        live = page.locator("#live")
        expect(live).to_contain_text(f"accepted {IMG}")  # an observation
        expect(live).to_contain_text(SVG)  # the refusal of a bad argument
        replies = live.locator("details pre").all_text_contents()
        assert any(IMG in reply for reply in replies)  # a model reply
        assert page.locator(INJECTED).count() == 0

        # A name given in a form is shown as text too, on a run whose id holds markup.
        open_run_from_the_list(page, url, PAUSED_ID, "awaiting approval")
        page.locator("#by-approve").fill(NAME)
        page.get_by_role("button", name="Approve").click()
        answered(page, "approved", NAME)
        assert page.locator(INJECTED).count() == 0
        assert tab.problems == []


# -- live updates --------------------------------------------------------------------------


def test_open_pages_follow_the_run_without_a_reload(
    browser: Browser, place: Place, backend: str
) -> None:
    place.drive(backend, "release-1")
    with serving(place.store, backend) as url, opened(browser) as tab, opened(browser) as other:
        runs = other.page
        runs.goto(url)
        expect(runs.locator("tr.run .state")).to_have_text(["awaiting approval"])
        runs.evaluate("window.kept = 'this page was never reloaded'")
        page = tab.page
        open_run_from_the_list(page, url, "release-1", "awaiting approval")

        # A second person answers from a terminal: the open page says so by itself.
        approve_from_a_terminal(place, "release-1", by="dave")
        expect(page.get_by_role("button", name="Approve")).to_have_count(0, timeout=LIVE_TIMEOUT_MS)
        fact = page.locator("#live dt", has_text=re.compile("^approved$"))
        expect(fact.locator("xpath=following-sibling::dd[1]")).to_contain_text("by dave")

        # The worker resumes and finishes the run: both pages follow.
        place.drive(backend, "release-1")
        summary = page.locator("#summary dd").first
        expect(summary).to_have_text("finished", timeout=LIVE_TIMEOUT_MS)
        expect(page.locator("#end")).to_contain_text("submitted")
        expect(runs.locator("tr.run .state")).to_have_text(["finished"], timeout=LIVE_TIMEOUT_MS)
        assert runs.evaluate("window.kept") == "this page was never reloaded"
        assert tab.problems == [] and other.problems == []


def approve_from_a_terminal(place: Place, run_id: str, *, by: str) -> None:
    approved = subprocess.run(
        [*POLYLOOP, "approve", place.store, run_id, "--by", by],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert approved.returncode == 0, approved.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_an_open_run_page_goes_on_after_the_console_restarts(
    browser: Browser, place: Place, backend: str
) -> None:
    place.drive(backend, "release-1")
    port = _free_port()
    with opened(browser) as tab:
        page = tab.page
        with serving(place.store, backend, port) as url:
            open_run_from_the_list(page, url, "release-1", "awaiting approval")
        # While the console is down, a person answers from a terminal and a worker
        # finishes the run: the records the page has not seen pile up in the store.
        approve_from_a_terminal(place, "release-1", by="dave")
        place.drive(backend, "release-1")
        with serving(place.store, backend, port):
            # The page's stream reconnects by itself, from the last record it showed.
            summary = page.locator("#summary dd").first
            expect(summary).to_have_text("finished", timeout=4 * LIVE_TIMEOUT_MS)
            expect(page.locator("#end")).to_contain_text("submitted")
            fact = page.locator("#live dt", has_text=re.compile("^approved$"))
            expect(fact.locator("xpath=following-sibling::dd[1]")).to_contain_text("by dave")
        # The stream cut by the restart is logged by the browser; nothing else went wrong.
        assert [problem for problem in tab.problems if "net::ERR_" not in problem] == []


# -- the screenshots in the docs -----------------------------------------------------------


def test_the_docs_screenshots_are_taken_from_a_real_console(tmp_path: Path) -> None:
    chromium()
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kit" / "console_screenshot.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for name in ("console-runs.png", "console-run.png"):
        picture = (tmp_path / name).read_bytes()
        assert picture.startswith(b"\x89PNG\r\n\x1a\n")
        width = int.from_bytes(picture[16:20], "big")  # the IHDR chunk comes first
        assert width == SCREENSHOT_WIDTH
        assert len(picture) < SCREENSHOT_MAX_BYTES


# -- investigating -------------------------------------------------------------------------


async def _fill_deploys(path: Path) -> tuple[str, ...]:
    async with SqliteStore(path) as store:
        return await fill_deploys(store)


def test_the_deploys_in_doubt_are_two_clicks_from_the_list(
    browser: Browser, tmp_path: Path, backend: str
) -> None:
    """A time link, then a row's "in doubt about deploy": the list holds exactly the
    runs that called deploy in that time and ended in doubt, and its address says so."""
    with served_after(_fill_deploys, tmp_path, backend) as (url, expected), opened(browser) as tab:
        page = tab.page
        page.goto(url)
        expect(page.locator("td.id a")).to_have_count(6)
        page.locator("#times").get_by_role("link", name="today", exact=True).click()  # 1
        page.get_by_role("link", name="in doubt about deploy").first.click()  # 2
        expect(page.locator("td.id a")).to_have_count(len(expected))
        assert sorted(page.locator("td.id a").all_inner_texts()) == sorted(expected)
        assert "tool=deploy" in page.url and "stop_reason=in_doubt" in page.url
        # The form shows the filters the list holds, and the address opens the same list.
        expect(page.locator('input[name="tool"]')).to_have_value("deploy")
        expect(page.locator('select[name="stop_reason"]')).to_have_value("in_doubt")
        page.goto(page.url)
        assert sorted(page.locator("td.id a").all_inner_texts()) == sorted(expected)
        assert tab.problems == []


async def _fill_paused(path: Path) -> None:
    async with SqliteStore(path) as store:
        tools = review_tools(Ledger())
        await run(definition(store, script=approval_script()), request("release-3", tools))


def test_edited_arguments_are_shown_beside_the_proposed_ones_after_approval(
    browser: Browser, tmp_path: Path, backend: str
) -> None:
    with served_after(_fill_paused, tmp_path, backend) as (url, _), opened(browser) as tab:
        page = tab.page
        open_run_from_the_list(page, url, "release-3", "awaiting approval")
        expect(page.locator("#edits")).to_have_count(0)
        page.locator("#by-approve").fill("erin")
        page.locator("#arguments").fill('{"env": "staging"}')
        page.get_by_role("button", name="Approve").click()
        answered(page, "approved", "erin")
        proposed = page.locator("#edits figure.proposed pre")
        approved = page.locator("#edits figure.approved pre")
        expect(proposed).to_contain_text('"env": "prod"')
        expect(approved).to_contain_text('"env": "staging"')
        expect(page.locator("#edits")).to_contain_text("changed: env")
        left, right = proposed.bounding_box(), approved.bounding_box()
        assert left is not None and right is not None
        # Side by side: the approved arguments to the right, on the same line.
        assert right["x"] >= left["x"] + left["width"] and abs(right["y"] - left["y"]) < 2
        # The step that ran before the proposal is a bar on the timeline, drawn.
        bar = page.locator("#timeline svg rect.rest").first
        box = bar.bounding_box()
        assert box is not None and box["width"] > 0 and box["height"] > 0
        assert tab.problems == []


# A store with a long history: the list's first page must not cost the whole of it.
MANY = 100_000


async def _fill_many(path: Path) -> list[str]:
    """``MANY`` finished runs, then one left open and one more finished; every run id
    newest first, as the list must show them (the run table's times, sorted here)."""
    async with SqliteStore(path) as store:
        await fill_many(store, [f"run-{n:06}" for n in range(MANY)])
        await store.claim_run("latest-open")
        await store.start_run(RunStarted(run_id="latest-open", snapshot={"model.name": "m"}))
        await fill_many(store, ["latest-finished"])
        listed = await store.list_runs()
        await store.release_run("latest-open")
    listed = sorted(listed, key=lambda found: found.run_id)
    return [found.run_id for found in sorted(listed, key=lambda f: f.updated_at, reverse=True)]


@pytest.fixture(scope="module")
def many_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A SQLite store of ``MANY`` + 2 runs written through its own calls (about a
    minute), shared by the module's tests, and its run ids newest first."""
    path = tmp_path_factory.mktemp("many") / "runs.db"
    with ThreadPoolExecutor(1) as thread:
        return path, thread.submit(anyio.run, _fill_many, path).result()


def test_the_list_of_a_hundred_thousand_runs_shows_the_most_recent_and_pages_on(
    browser: Browser,
    many_runs: tuple[Path, list[str]],
    backend: str,
    record_property: Callable[[str, object], None],
) -> None:
    """The first page holds the 50 runs with the latest records, newest first; older
    and newer walk on and back. How long the first page took is reported, not judged
    (benchmark 10 is where speed is measured)."""
    path, newest_first = many_runs
    assert len(newest_first) == MANY + 2 and newest_first[:2] == ["latest-finished", "latest-open"]
    with serving(f"sqlite:{path}", backend) as url, opened(browser) as tab:
        page = tab.page
        began = time.monotonic()
        page.goto(url)
        first_page_ms = (time.monotonic() - began) * 1e3
        shown = page.locator("td.id a")
        assert shown.all_inner_texts() == newest_first[:50]
        page.get_by_role("link", name="older", exact=True).click()
        expect(shown.first).to_have_text(newest_first[50])
        assert shown.all_inner_texts() == newest_first[50:100]
        page.get_by_role("link", name="newer", exact=True).click()
        expect(shown.first).to_have_text(newest_first[0])
        assert shown.all_inner_texts() == newest_first[:50]
        expect(page.locator('a[rel="prev"]')).to_have_count(0)
        assert tab.problems == []
    record_property("first_page_ms", round(first_page_ms))
    print(f"\nthe first page of {MANY + 2:,} runs ({backend}): {first_page_ms:.0f} ms in Chromium")
