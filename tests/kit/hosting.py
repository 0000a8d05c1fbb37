"""Agents for the tests of hosts (``serve_agents``, ``polyloop worker``), and a host
served in the test's own task group whose log records the test can read."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit import one_writer
from kit.agent import NUMBER_SCHEMA, answer, definition, request, tool_call
from kit.store import sampled
from polyloop import (
    Agent,
    JSONValue,
    Reconciled,
    Replay,
    Request,
    Store,
    ToolRegistry,
    ToolSpec,
    serve_agents,
)
from polyloop.stores import MemoryStore

SCRIPT = [tool_call("pay", n=2), answer("paid")]
# Hosts run quick on the memory store and SQLite, and on every store with --run-slow.
KINDS = sampled(["memory", "sqlite", "jsonl", "postgresql"])


class Opener:
    """New store objects over one set of data (the memory store: one shared object)."""

    def __init__(self, kind: str, location: str, schema: str = "") -> None:
        self.kind, self.location, self.schema = kind, location, schema
        self.memory = MemoryStore()
        self.opened: list[Any] = []

    @classmethod
    def of(cls, request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
        """The opener of a fixture parametrized over :data:`KINDS`."""
        kind = request.param
        if kind == "postgresql":
            return cls(kind, *request.getfixturevalue("postgres_place"))
        return cls(kind, str(tmp_path / ("runs.db" if kind == "sqlite" else "runs")))

    def __call__(self) -> Any:
        if self.kind == "memory":
            return self.memory
        store = one_writer.open_store(self.kind, self.location, self.schema)
        self.opened.append(store)
        return store

    async def aclose(self) -> None:
        for store in self.opened:
            await store.aclose()


class Till:
    """The outside world the ``pay`` tool acts on: every payment by result id, how many
    calls are running now and at most, and a gate that holds calls while it is shut."""

    def __init__(self, *, shut: bool = False) -> None:
        self.paid: list[str] = []
        self.running = 0
        self.most = 0
        self.entered = anyio.Event()
        self._open = anyio.Event()
        if not shut:
            self._open.set()

    def open(self) -> None:
        self._open.set()

    async def pay(self, arguments: dict[str, Any], *, result_id: str) -> str:
        self.running += 1
        self.most = max(self.most, self.running)
        self.entered.set()
        try:
            await self._open.wait()
            await anyio.lowlevel.checkpoint()
            self.paid.append(result_id)
        finally:
            self.running -= 1
        return f"paid {arguments['n']}"

    async def probe(self, arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        if result_id in self.paid:
            return Reconciled(ran=True, observation=f"paid {arguments['n']}")
        return Reconciled(ran=False, observation="no payment under this key")


def tools(
    till: Till,
    *,
    needs_approval: bool = False,
    probe: bool = False,
    replay: Replay = Replay.NEVER,
) -> ToolRegistry:
    spec = ToolSpec(
        name="pay",
        description="Pay n coins.",
        parameters=NUMBER_SCHEMA,
        handler=till.pay,
        replay=replay,
        needs_approval=needs_approval,
        reconcile=till.probe if probe else None,
    )
    return ToolRegistry([spec], max_observation_chars=1_000)


def payer(
    store: Store,
    till: Till,
    *,
    name: str = "payer",
    script: list[Any] = SCRIPT,
    **options: Any,
) -> Agent:
    """An agent whose runs pay once and answer; ``options`` go to :func:`tools`."""
    registry = tools(till, **options)

    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, registry)

    return Agent(name=name, definition=definition(store, script=script), request_for=request_for)


class Records(logging.Handler):
    """The facts of every record the host logs, in order."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.facts: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        facts = getattr(record, "polyloop_worker", None)
        if facts is not None:
            self.facts.append(dict(facts))

    def of(self, run_id: str, event: str | None = None) -> list[dict[str, Any]]:
        return [
            facts
            for facts in self.facts
            if facts["run_id"] == run_id and (event is None or facts["event"] == event)
        ]


@contextmanager
def host_records() -> Iterator[Records]:
    """What the host logs while the block runs."""
    records = Records()
    logger = logging.getLogger("polyloop.worker")
    saved = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(saved)


class Serving:
    """A host running in the test's task group: ``stop()`` asks it to drain."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.stop_requested = anyio.Event()
        self.done = anyio.Event()

    def stop(self) -> None:
        self.stop_requested.set()


@asynccontextmanager
async def serving(
    agents: Any,
    *,
    concurrency: int = 4,
    poll_s: float = 0.02,
    drain_grace_s: float = 10.0,
) -> AsyncIterator[Serving]:
    """Serve ``agents`` while the block runs; drain when it ends (or when asked)."""
    with host_records() as records:
        host = Serving(records)

        async def serve() -> None:
            try:
                await serve_agents(
                    agents,
                    concurrency=concurrency,
                    poll_s=poll_s,
                    stop=host.stop_requested.wait,
                    drain_grace_s=drain_grace_s,
                )
            finally:
                host.done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(serve)
            try:
                yield host
            finally:
                host.stop()


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], *, timeout_s: float = 20.0, what: str = "it"
) -> float:
    """Wait until ``check()`` (a function or a coroutine function) is true; the seconds
    it took. Fails after ``timeout_s``."""
    began = time.monotonic()
    while not await _holds(check):
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        await anyio.sleep(0.01)
    return time.monotonic() - began


async def _holds(check: Callable[[], Awaitable[bool] | bool]) -> bool:
    found = check()
    return await found if inspect.isawaitable(found) else found
