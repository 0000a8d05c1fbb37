"""A PostgreSQL statement deadline still fires in a process forked from one that used a
store (``stores/_sql/postgres/connection.py``).

A forked child has no thread but the one that forked, so a parent that had used a store
(to list runs, say) and then forked its workers (multiprocessing's ``fork`` start method,
a prefork server) must not hand its children a deadline that rests on a thread of the
parent's. Here the child's path to the server goes silent (``tests/kit/net_proxy.py``,
served by the parent) while it writes, and its write must fail within the deadline plus
the connect timeout.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import anyio
import anyio.to_thread
import pytest

from kit.net_proxy import Mode, Proxy
from polyloop import StoreError
from polyloop.stores import PostgresStore
from polyloop.testing.store_contract import sample_run

# Slow: a child process, and the deadline of a statement on a silent path.
pytestmark = pytest.mark.slow

STATEMENT_TIMEOUT_S = 0.5
DEADLINE_S = 1.5  # the statement timeout and half again, at least a second more
CONNECT_S = 1.0
SLACK_S = 3.0  # a loaded machine's scheduling (CI has run 1.55 s late), never a wait relied on
CHILD_LIMIT_S = 20.0  # far past any bound: a child still waiting then waits for ever


@pytest.fixture
def proxy(postgres_conninfo: str) -> Iterator[Proxy]:
    with Proxy.before(postgres_conninfo) as through:
        yield through


async def _use_a_store(conninfo: str) -> None:
    """What a parent does before forking its workers: list the runs, say."""
    async with PostgresStore(conninfo) as store:
        await store.list_runs()


def _child(
    conninfo: str,
    backend: str,
    ready: multiprocessing.synchronize.Event,
    silent: multiprocessing.synchronize.Event,
    report: Connection,
) -> None:
    """Start a run, wait for the path to go silent, write; report how the write ended."""

    async def main() -> None:
        store = PostgresStore(
            conninfo, statement_timeout_s=STATEMENT_TIMEOUT_S, timeout=CONNECT_S, lease_s=30.0
        )
        await store.claim_run("r")
        method, arguments = sample_run("r")[0]
        await getattr(store, method)(*arguments)
        _, (intent,) = sample_run("r", steps=1)[1]
        ready.set()
        await anyio.to_thread.run_sync(silent.wait)
        began = time.monotonic()
        try:
            await store.write_intent(intent)
        except StoreError as exc:
            report.send((type(exc).__name__, time.monotonic() - began, str(exc)))
        else:
            report.send(("written", time.monotonic() - began, ""))

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_forked_child_on_a_silent_path_fails_its_write_within_the_deadline(
    proxy: Proxy, postgres_conninfo: str, backend: str
) -> None:
    anyio.run(_use_a_store, postgres_conninfo, backend=backend)  # the watchdog runs now
    context = multiprocessing.get_context("fork")
    ready, silent = context.Event(), context.Event()
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_child, args=(proxy.conninfo(postgres_conninfo), backend, ready, silent, send)
    )
    child.start()
    try:
        assert ready.wait(CHILD_LIMIT_S), "the child did not start its run"
        proxy.set(Mode.BLACKHOLE)
        silent.set()
        assert receive.poll(CHILD_LIMIT_S), "the child's write was still waiting"
        outcome, waited, message = receive.recv()
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
    assert outcome == "StoreError"
    assert "the server did not answer within 1.5 s" in message
    # The deadline, then a new connection to learn what the lost statement wrote.
    assert waited < DEADLINE_S + CONNECT_S + SLACK_S
