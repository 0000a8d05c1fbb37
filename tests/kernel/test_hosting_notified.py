"""A host over stores that notify (``PostgresStore``, a ``ChangeFeed``) goes on with a
run within about a second of the write that lets it, however long its poll interval;
it listens again after losing its connection, and leaves no thread behind; under
asyncio and Trio."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import pg
from kit.hosting import Till, eventually, payer, serving
from kit.store import DURABLE_STORE_BACKENDS
from polyloop import (
    RunState,
    StopReason,
    approve,
    cancel,
    run_status,
    serve_agents,
    settle,
)
from polyloop.stores import PostgresStore, SqliteStore
from polyloop.stores._sql.postgres.sql import channel
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.types import CancelRequest

pytestmark = pytest.mark.anyio

# Far longer than any test waits: a run taken up at all was taken up on a notification.
LONG_POLL_S = 30.0
# "Within about a second", with room for a slow, shared machine.
SOON_S = 2.0


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Listed(PostgresStore):
    """The store, noting when the host lists it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.listings: list[float] = []

    async def list_runs(self, *, unfinished_only: bool = False) -> Any:
        self.listings.append(time.monotonic())
        return await super().list_runs(unfinished_only=unfinished_only)


@pytest.fixture
async def store(postgres_shared: str, postgres_schemas: Callable[[], str]) -> AsyncIterator[Listed]:
    async with Listed(postgres_shared, schema=postgres_schemas()) as opened:
        yield opened


async def _state(store: Any, run_id: str) -> RunState:
    return (await run_status(store, run_id)).state


def _driven(host: Any, run_id: str, why: str) -> Callable[[], bool]:
    return lambda: any(facts["why"] == why for facts in host.records.of(run_id, "driving"))


async def _stopped(store: Any, run_id: str, reason: StopReason) -> None:
    async def check() -> bool:
        return (await run_status(store, run_id)).stop_reason is reason

    await eventually(check, what=f"{run_id} stopping {reason.value}")


async def test_a_host_that_polls_rarely_goes_on_within_a_second_of_each_write(
    store: Listed,
) -> None:
    till = Till()
    asking = payer(store, till, needs_approval=True)
    # A run in doubt: its process died inside the payment, which has no probe.
    with pytest.raises(SimulatedCrash):
        await payer(FaultyStore(store, fail_after_writes=4), till, name="paying").run("r2", {})
    took: dict[str, float] = {}
    async with serving([asking, payer(store, till, name="paying")], poll_s=LONG_POLL_S) as host:
        await _stopped(store, "r2", StopReason.IN_DOUBT)  # the host found it at its start
        await asking.start("r1", {})
        took["start"] = await eventually(_driven(host, "r1", "new"), what="r1 driven")
        await _stopped(store, "r1", StopReason.AWAITING_APPROVAL)
        await approve(store, "r1", by="ann")
        took["approve"] = await eventually(_driven(host, "r1", "approved"), what="r1 approved")
        await settle(store, "r2", by="ann", ran=True, observation="paid 2")
        took["settle"] = await eventually(_driven(host, "r2", "settled"), what="r2 settled")
        for run_id in ("r1", "r2"):
            await eventually(
                lambda run_id=run_id: _finished(store, run_id), what=f"{run_id} finishing"
            )
        # Nothing is written now: the host waits, listing nothing, until a write says so.
        await anyio.sleep(0.3)
        listed = len(store.listings)
        await anyio.sleep(0.5)
        assert len(store.listings) == listed
        # A cancel request whose end nobody wrote (its asker stopped in between): the
        # host ends the run, woken by the request.
        await asking.start("r3", {})
        await _stopped(store, "r3", StopReason.AWAITING_APPROVAL)
        await store.request_cancel(CancelRequest(run_id="r3", by="ann", reason="not needed"))
        took["cancel"] = await eventually(
            _driven(host, "r3", "cancel_requested"), what="r3 driven to its end"
        )
        await _stopped(store, "r3", StopReason.CANCELLED_BY_REQUEST)
    assert all(seconds < SOON_S for seconds in took.values()), took
    assert till.paid == ["r2:0:action", "r1:0:action"]


async def test_a_cancel_stops_a_run_a_rarely_polling_host_drives(store: Listed) -> None:
    till = Till(shut=True)
    agent = payer(store, till)
    await agent.start("r1", {})
    async with serving(agent, poll_s=LONG_POLL_S) as host:
        await eventually(_driven(host, "r1", "new"), what="r1 driven")
        await till.entered.wait()  # its payment is running
        status = await cancel(store, "r1", by="ann", reason="wrong customer")
        assert status.state is RunState.RUNNING  # its writer ends it
        till.open()
        took = await eventually(lambda: _finished(store, "r1"), what="r1 ending after its payment")
    assert took < SOON_S
    ended = await run_status(store, "r1")
    assert ended.stop_reason is StopReason.CANCELLED_BY_REQUEST
    assert till.paid == ["r1:0:action"]  # the running payment finished, nothing after it


async def _finished(store: Any, run_id: str) -> bool:
    return await _state(store, run_id) is RunState.FINISHED


async def test_a_host_whose_listening_connection_is_lost_still_notices_later_writes(
    store: Listed, postgres_shared: str
) -> None:
    till = Till()
    agent = payer(store, till)
    # The store's one listening connection: its change feed's channel and its followers'.
    listen = f'%LISTEN "{channel(store._schema)}%'
    sessions = (
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE %s"
    )

    def listening() -> list[int]:
        with pg.admin(postgres_shared) as conn:
            return [pid for (pid,) in conn.execute(sessions, (listen,)).fetchall()]

    async with serving(agent, poll_s=LONG_POLL_S) as host:
        await eventually(listening, what="the host listening")
        (pid,) = listening()
        with pg.admin(postgres_shared) as conn:
            conn.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        await eventually(lambda: listening() not in ([], [pid]), what="listening again")
        await agent.start("r1", {})
        took = await eventually(_driven(host, "r1", "new"), what="r1 driven")
        await eventually(lambda: _finished(store, "r1"), what="r1 finishing")
    assert took < SOON_S
    assert till.paid == ["r1:0:action"]


def _listeners() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "polyloop-listener"}


async def test_a_cancelled_host_leaves_no_listening_thread_and_the_store_open(
    store: Listed,
) -> None:
    before, till = _listeners(), Till()
    agent = payer(store, till)
    with anyio.move_on_after(1.0) as scope:
        await serve_agents(agent, concurrency=2, poll_s=LONG_POLL_S)
    assert scope.cancelled_caught
    assert not any(thread.is_alive() for thread in _listeners() - before)
    result = await agent.run("r1", {})  # the store is still open and writes
    assert result.stop_reason is StopReason.FINAL_ANSWER


async def test_a_host_of_a_store_without_a_feed_polls_every_store(
    store: Listed, tmp_path: Path
) -> None:
    before, till = _listeners(), Till()
    async with SqliteStore(tmp_path / "runs.db") as sqlite:
        here, there = payer(sqlite, till, name="here"), payer(store, till, name="there")
        await here.start("a", {})
        await there.start("b", {})
        async with serving([here, there], poll_s=0.05):
            await eventually(lambda: _finished(sqlite, "a"), what="a finishing")
            await eventually(lambda: _finished(store, "b"), what="b finishing")
            assert not _listeners() - before  # a feed is used only if every store has one
            listed = len(store.listings)
            await anyio.sleep(0.3)
            assert len(store.listings) > listed  # listed on the timer, with the SQLite store
