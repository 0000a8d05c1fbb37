"""``polyloop worker`` processes over one store, for the tests of real processes.

:class:`WorkerApp` is the application of :mod:`kit.worker_app` on one store (SQLite or
PostgreSQL) with its outside ledger; it starts worker processes, each a
:class:`Worker` whose ``--json`` lines go to a file (a pipe nobody reads would stall a
worker that says a lot), and ends every one it started by its pid. :func:`web_app` is
an application's web front that starts runs, served over real HTTP by
:func:`http_served`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kit import worker_app
from kit.hosting import eventually
from polyloop import Agent

TESTS = Path(__file__).resolve().parents[1]
SOURCE = TESTS.parent / "src"


class Worker:
    """One ``polyloop worker`` child process and what it said."""

    def __init__(self, process: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.process = process
        self.out = out
        self.err = err

    @property
    def pid(self) -> int:
        return self.process.pid

    def said(self) -> list[dict[str, Any]]:
        """Its ``--json`` lines so far, whole lines only."""
        text = self.out.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    def of(self, run_id: str, event: str | None = None) -> list[dict[str, Any]]:
        """What it said of ``run_id`` (of one kind of event, if given)."""
        return [
            facts
            for facts in self.said()
            if facts["run_id"] == run_id and (event is None or facts["event"] == event)
        ]

    def stderr(self) -> str:
        return self.err.read_text(encoding="utf-8")

    def serving(self) -> bool:
        """Whether it has begun to serve."""
        return any(facts["event"] == "serving" for facts in self.said())

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def kill(self) -> None:
        """SIGKILL it, by its pid."""
        self.process.kill()

    def ended(self) -> bool:
        return self.process.poll() is not None

    async def exit_status(self, timeout_s: float = 30.0) -> int:
        """Its exit status, once it has ended (waiting for at most ``timeout_s``)."""
        await eventually(self.ended, what=f"worker {self.pid} ending", timeout_s=timeout_s)
        assert self.process.returncode is not None
        return self.process.returncode

    async def stop(self) -> None:
        """Drain it with SIGTERM; it must end with status 0."""
        self.signal(signal.SIGTERM)
        status = await self.exit_status()
        assert status == 0, self.stderr()

    def end(self) -> None:
        """Kill it, by its pid, if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class WorkerApp:
    """:mod:`kit.worker_app` on ``store`` (``sqlite:FILE`` or a PostgreSQL URL) with its
    ledger and its gate (shut until the test creates it, if ``gated``) in ``folder``;
    ``env`` sets its other options."""

    def __init__(self, folder: Path, store: str, *, gated: bool = False, **env: str) -> None:
        self.folder = folder
        self.ledger = folder / "ledger"
        self.gate = folder / "gate"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SOURCE), str(TESTS)]),
            "WORKER_STORE": store,
            "WORKER_LEDGER": str(self.ledger),
            **({"WORKER_GATE": str(self.gate)} if gated else {}),
            **env,
        }
        self.settings = worker_app.Settings.of(self.env)
        self.workers: list[Worker] = []

    def worker(
        self,
        *options: str,
        target: str = "kit.worker_app:lifespan",
        backend: str = "asyncio",
        poll_s: float = 0.1,
    ) -> Worker:
        """Start a worker process hosting ``target`` with ``options``, saying ``--json``."""
        number = len(self.workers)
        out, err = self.folder / f"worker-{number}.out", self.folder / f"worker-{number}.err"
        command = [
            *("--backend", backend, "worker", target),
            *("--poll-s", str(poll_s), "--json", *options),
        ]
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "polyloop", *command],
                stdout=stdout,
                stderr=stderr,
                env=self.env,
            )
        self.workers.append(Worker(process, out, err))
        return self.workers[-1]

    def end_all(self) -> None:
        """Kill, by its pid, every worker started here that still runs."""
        for worker in self.workers:
            worker.end()

    async def polyloop(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        """Run the command line with ``args`` in a process of its own."""
        command = [sys.executable, "-m", "polyloop", *args]
        return await anyio.run_process(command, env=self.env, check=False)

    @asynccontextmanager
    async def store(self) -> AsyncIterator[Any]:
        """A store object of this process over the application's store."""
        async with worker_app.open_store(self.settings) as store:
            yield store

    def agent(self, store: Any, *, name: str = "payer") -> Agent:
        """The agent the workers host, built here over ``store``."""
        return worker_app.agent(store, self.settings, name=name)

    def entries(self, what: str | None = None) -> list[worker_app.Entry]:
        """The ledger's lines (of one kind, if given), in order."""
        return [
            entry
            for entry in worker_app.read_ledger(self.ledger)
            if what is None or entry.what == what
        ]

    def paid(self) -> list[str]:
        """The result ids paid under, in order."""
        return [entry.result_id for entry in self.entries("paid")]


STORES = ["sqlite", "postgresql"]


@contextmanager
def apps(request: pytest.FixtureRequest, folder: Path) -> Iterator[Callable[..., WorkerApp]]:
    """Make :class:`WorkerApp` objects on the store ``request.param`` names (a SQLite
    file in ``folder``, or an empty PostgreSQL database of the test's own); every worker
    they started is killed, by its pid, at the end."""
    if request.param == "sqlite":
        store = f"sqlite:{folder / 'runs.db'}"
    else:
        store = request.getfixturevalue("postgres_conninfo")
    made: list[WorkerApp] = []

    def make(*, gated: bool = False, **env: str) -> WorkerApp:
        made.append(WorkerApp(folder, store, gated=gated, **env))
        return made[-1]

    try:
        yield make
    finally:
        for app in made:
            app.end_all()


def web_app(agent: Agent) -> Starlette:
    """An application's web front: ``POST /runs/{run_id}`` with a JSON body starts a run
    of ``agent`` with that input and answers 202; a worker drives it from there."""

    async def start(request: Request) -> JSONResponse:
        run_id = request.path_params["run_id"]
        await agent.start(run_id, await request.json())
        return JSONResponse({"run_id": run_id, "agent": agent.name}, status_code=202)

    return Starlette(routes=[Route("/runs/{run_id}", start, methods=["POST"])])


@asynccontextmanager
async def http_served(app: Starlette, backend: str) -> AsyncIterator[str]:
    """Serve ``app`` over HTTP on a free local port, under ``backend``, while the block
    runs; its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    stop = anyio.Event()
    if backend == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]
    async with anyio.create_task_group() as group:
        group.start_soon(partial(serve, app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()
