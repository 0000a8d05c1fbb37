"""The one child-process spawner: benchmarks that measure in processes of their own.

A child is ``python -m bench NAME --child SPEC`` with the repository on its import path:
the registry hands the spec (a dataclass, sent as JSON) to the benchmark's ``child``.
Its report is the last line of its output, as JSON. Children meet in a directory: each
says it is ready by creating ``ready-N`` there, and waits, if asked to, until the
parent creates ``go``, so that workers that took different times to open their stores
start together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio

from bench._common import ROOT

POLL_S = 0.002  # how often a waiting side looks for the other's file


class ChildFailed(Exception):
    """A child exited with an error; the message is the last line it wrote to stderr."""


def child_command(benchmark: str, spec: Any) -> list[str]:
    """The command of a child of ``benchmark`` that does what ``spec`` says."""
    return [
        sys.executable,
        "-m",
        "bench",
        benchmark,
        "--child",
        json.dumps(dataclasses.asdict(spec)),
    ]


class Children:
    """Child processes started together, one per command, meeting in ``meeting``."""

    def __init__(self, meeting: Path, commands: list[list[str]]) -> None:
        self.meeting = meeting
        self.commands = commands
        self.processes: list[subprocess.Popen[bytes]] = []
        self._files = contextlib.ExitStack()

    def __enter__(self) -> Children:
        self.meeting.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        for index, command in enumerate(self.commands):
            out = self._files.enter_context(open(self.meeting / f"stdout-{index}", "wb"))
            err = self._files.enter_context(open(self.meeting / f"stderr-{index}", "wb"))
            self.processes.append(subprocess.Popen(command, stdout=out, stderr=err, env=env))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop()
        self._files.close()

    def all_ready(self) -> bool:
        """Wait until every child is ready (``True``) or one has exited (``False``, and
        the others are stopped)."""
        while True:
            if all((self.meeting / f"ready-{i}").exists() for i in range(len(self.processes))):
                return True
            if any(process.poll() is not None for process in self.processes):
                self._stop()
                return False
            time.sleep(POLL_S)

    def go(self) -> None:
        (self.meeting / "go").touch()

    def terminate(self) -> None:
        """Ask every child to finish (``SIGTERM``): they serve until told to stop."""
        for process in self.processes:
            process.send_signal(signal.SIGTERM)

    def reports(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Each child's report, once all have exited; :class:`ChildFailed` if one failed."""
        for process in self.processes:
            process.wait(timeout)
        reports = []
        for index, process in enumerate(self.processes):
            if process.returncode != 0:
                err = (self.meeting / f"stderr-{index}").read_text(errors="replace")
                raise ChildFailed((err.strip().splitlines() or ["no output"])[-1])
            lines = (self.meeting / f"stdout-{index}").read_text().strip().splitlines()
            reports.append(json.loads(lines[-1]))
        return reports

    def _stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


async def meet(meeting: str | None, index: int, *, wait_for_go: bool = True) -> None:
    """In a child: say this one is ready, then wait until the parent says go."""
    if meeting is None:
        return
    place = anyio.Path(meeting)
    await (place / f"ready-{index}").touch()
    # A file, polled: the signal comes from another process, which no Event can span.
    while wait_for_go and not await (place / "go").exists():  # noqa: ASYNC110
        await anyio.sleep(POLL_S)


def report(part: dict[str, Any]) -> None:
    """In a child: hand the parent its report."""
    print(json.dumps(part), flush=True)
