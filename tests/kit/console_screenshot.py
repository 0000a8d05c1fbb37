"""The screenshots of the web console in the docs, taken from a real console and browser.

    python tests/kit/console_screenshot.py [OUT_DIR]      # default: docs/

It fills a SQLite store with the approvals example's release runs in every state an
operator meets (finished, approved or rejected by a person, settled after a crash,
resumable, running, in doubt, awaiting approval), serves it with ``polyloop serve``,
and saves what the distribution's headless Chromium shows of the list
(``console-runs.png``) and of the run awaiting approval (``console-run.png``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import anyio
import anyio.abc
import anyio.from_thread
from playwright.sync_api import Page, sync_playwright

from kit import approvals_worker_agent
from polyloop import (
    JSONValue,
    RunState,
    ToolRegistry,
    approve,
    reject,
    run_status,
    settle,
    start_or_resume,
)
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash

ROOT = Path(__file__).resolve().parents[2]
# The distribution's browser; Playwright's own are never downloaded.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WIDTH = 1200
# Writes of a release run up to the model's second call: a crash there leaves it resumable.
WRITES_BEFORE_SECOND_CALL = 5

example = approvals_worker_agent.example()


class Releases:
    """The example's release runs on one store, each in the state it is asked for."""

    def __init__(self, store: SqliteStore, db: Path) -> None:
        self.store = store
        self.db = db
        self.effects = db.with_suffix(".effects.txt")

    def tools(self, *, auto_approve: bool) -> ToolRegistry:
        made: ToolRegistry = example.make_tools(
            self.effects, auto_approve=auto_approve, crash_after_paying=False
        )
        return made

    async def drive(self, run_id: str, *, auto_approve: bool = False, store: Any = None) -> None:
        definition, request = example.build(
            store or self.store, run_id, self.tools(auto_approve=auto_approve)
        )
        await start_or_resume(definition, request)

    async def finished(self, run_id: str) -> None:
        await self.drive(run_id, auto_approve=True)

    async def approved(self, run_id: str, by: str) -> None:
        await self.drive(run_id)
        await approve(self.store, run_id, by=by)
        await self.drive(run_id)

    async def rejected(self, run_id: str, by: str, reason: str) -> None:
        await self.drive(run_id)
        await reject(self.store, run_id, by=by, reason=reason)
        await self.drive(run_id)

    async def in_doubt(self, run_id: str) -> None:
        """Paid, and the process died before the payment's result was written."""
        worker = [sys.executable, approvals_worker_agent.__file__, f"sqlite:{self.db}"]
        options = ["--auto-approve", "--crash-after-paying"]
        await anyio.run_process(
            [*worker, str(self.effects), "asyncio", run_id, *options], check=False
        )
        await self.expect(run_id, RunState.IN_DOUBT)

    async def settled(self, run_id: str, by: str) -> None:
        await self.in_doubt(run_id)
        await settle(self.store, run_id, by=by, ran=True, observation="paid 5")
        await self.drive(run_id, auto_approve=True)

    async def resumable(self, run_id: str) -> None:
        """Its process died between two steps; the next resume goes on from there."""
        crashing = FaultyStore(self.store, fail_after_writes=WRITES_BEFORE_SECOND_CALL)
        with suppress(SimulatedCrash):
            await self.drive(run_id, auto_approve=True, store=crashing)
        await self.expect(run_id, RunState.RESUMABLE)

    async def awaiting(self, run_id: str) -> None:
        await self.drive(run_id)
        await self.expect(run_id, RunState.AWAITING_APPROVAL)

    async def expect(self, run_id: str, state: RunState) -> None:
        found = (await run_status(self.store, run_id)).state
        if found is not state:
            raise RuntimeError(f"run {run_id!r} is {found.value}, not {state.value}")


async def fill(db: Path) -> None:
    async with SqliteStore(db, create=True) as store:
        releases = Releases(store, db)
        for number in range(2031, 2037):
            await releases.finished(f"release-{number}")
        await releases.approved("release-2037", by="alice")
        await releases.rejected("release-2038", by="bob", reason="freeze until Monday")
        await releases.settled("release-2039", by="carol")
        await releases.resumable("release-2040")
        await releases.in_doubt("release-2041")
        await releases.awaiting("release-2042")


async def hold_running(
    db: Path, run_id: str, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """A worker in the middle of a deploy, holding the run's lease until cancelled."""

    async def slow_deploy(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        task_status.started()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with SqliteStore(db) as store:
        tools = example.make_tools(
            db.with_suffix(".effects.txt"), auto_approve=True, crash_after_paying=False
        )
        specs = [tools.get(name) for name in tools.names]
        slow = [
            dataclasses.replace(spec, handler=slow_deploy) if spec.name == "deploy" else spec
            for spec in specs
            if spec is not None
        ]
        registry = ToolRegistry(slow, max_observation_chars=tools.max_observation_chars)
        definition, request = example.build(store, run_id, registry)
        await start_or_resume(definition, request)


@contextmanager
def serving(db: Path) -> Iterator[str]:
    """``polyloop serve`` started next to the store, so the page names it as people would."""
    source = os.pathsep.join(str(ROOT / part) for part in ("src", "tests"))
    server = subprocess.Popen(
        [sys.executable, "-m", "polyloop", "serve", f"sqlite:{db.name}", "--port", "0"],
        cwd=db.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its goodbye on Ctrl-C
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": source},
    )
    try:
        assert server.stdout is not None
        url = next(line[5:].strip() for line in server.stdout if line.startswith("open "))
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=30)


def shoot(page: Page, url: str, path: Path) -> None:
    page.goto(url)
    page.screenshot(path=str(path), full_page=True)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs"
    with tempfile.TemporaryDirectory() as scratch:
        db = Path(scratch) / "releases.db"
        anyio.run(fill, db)
        with anyio.from_thread.start_blocking_portal() as portal:
            holding, _ = portal.start_task(hold_running, db, "release-2043")
            try:
                with serving(db) as url, sync_playwright() as playwright:
                    browser = playwright.chromium.launch(executable_path=CHROMIUM)
                    page = browser.new_page(viewport={"width": WIDTH, "height": 700})
                    shoot(page, url, out / "console-runs.png")
                    shoot(page, f"{url}runs/release-2042", out / "console-run.png")
                    browser.close()
            finally:
                holding.cancel()
    for name in ("console-runs.png", "console-run.png"):
        print(f"{out / name}: {(out / name).stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
