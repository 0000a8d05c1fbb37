"""The PostgreSQL store's change feed: which writes notify (in their own transaction),
``PostgresStore.changes()`` waking on them, a lost listening connection opened again,
and its thread stopping with the block or the store; under asyncio and Trio."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest
from psycopg import sql

from kit import pg
from kit.hosting import eventually
from kit.store import DURABLE_STORE_BACKENDS
from polyloop.ports import ChangeFeed
from polyloop.stores import PostgresStore
from polyloop.stores._sql.postgres.sql import appended_channel, channel, run_id_column, run_key
from polyloop.testing.store_contract import sample_run
from polyloop.types import (
    CancelRequest,
    Proposal,
    Replay,
    RunEnded,
    Settlement,
    StopReason,
    StoreError,
    Verdict,
)

pytestmark = pytest.mark.anyio

LISTENER = "polyloop-listener"


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def schema(postgres_schemas: Callable[[], str]) -> str:
    return postgres_schemas()


@pytest.fixture
async def store(postgres_shared: str, schema: str) -> AsyncIterator[PostgresStore]:
    async with PostgresStore(postgres_shared, schema=schema) as opened:
        yield opened


class Heard:
    """A connection of the test's own listening on a store's channel: every payload; and
    another that marks where each take ends."""

    def __init__(self, conninfo: str, schema: str, run_id: str | None = None) -> None:
        self.channel = channel(schema) if run_id is None else appended_channel(schema, run_id)
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        self.marker = psycopg.connect(conninfo, autocommit=True)
        self.mark = f"mark {uuid.uuid4()}"  # no payload a store sends in these tests

    async def take(self) -> list[str]:
        """The payloads of the notifications committed since the last take.

        The take notifies a mark of its own and reads up to it: PostgreSQL delivers the
        notifications of different transactions in the order they committed, so one that a
        write committed before this call cannot come after the mark.
        """

        def read() -> list[str]:
            self.marker.execute("SELECT pg_notify(%s, %s)", (self.channel, self.mark))
            payloads = []
            for notify in self.conn.notifies(timeout=10):
                if notify.payload == self.mark:
                    return payloads
                payloads.append(notify.payload)
            raise AssertionError("the take's own mark was not heard within 10 s")

        return await anyio.to_thread.run_sync(read)


@contextmanager
def heard(conninfo: str, schema: str, run_id: str | None = None) -> Iterator[Heard]:
    """A listener on the store's change feed channel (or, with ``run_id``, on the channel
    of that run's followers)."""
    listening = Heard(conninfo, schema, run_id)
    try:
        yield listening
    finally:
        listening.conn.close()
        listening.marker.close()


def _ended(run_id: str, reason: StopReason) -> RunEnded:
    return RunEnded(
        run_id=run_id, stop_reason=reason, final_answer=None, steps=1, valid_steps=1, detail=None
    )


def _proposal(run_id: str) -> Proposal:
    return Proposal(
        run_id=run_id,
        result_id=f"{run_id}:0:action",
        step=0,
        replay=Replay.NEVER,
        payload={"name": "t", "arguments": {}},
        action_text="t()",
        history_text="call t",
        description="t",
    )


def _listeners() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == LISTENER}


async def _gone(threads: set[threading.Thread]) -> bool:
    await eventually(lambda: not any(thread.is_alive() for thread in threads), what="threads end")
    return True


# -- which writes notify -------------------------------------------------------------------------


async def test_the_writes_that_may_let_a_run_go_on_notify_and_no_other(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    start, model_intent, model_result, action_intent, step = sample_run("r1", steps=1)[:5]
    with heard(postgres_shared, schema) as heard_:
        # (what is written, how many notifications it sends)
        writes: list[tuple[str, Any, int]] = [
            ("claim_run", ("r1",), 0),
            (*start, 1),
            (*model_intent, 0),
            (*model_result, 0),
            (*action_intent, 0),
            (*step, 0),
            ("write_review", (_proposal("r1"),), 0),
            ("end_run", (_ended("r1", StopReason.AWAITING_APPROVAL),), 1),
            ("claim_run", ("r1",), 0),
            ("write_review", (_verdict("r1"),), 1),
            ("release_run", ("r1",), 1),  # a claim given up without a record
            ("claim_run", ("r1",), 0),
            ("end_run", (_ended("r1", StopReason.IN_DOUBT),), 1),
            ("claim_run", ("r1",), 0),
            ("write_review", (_settlement("r1"),), 1),
            ("end_run", (_ended("r1", StopReason.CANCELLED),), 1),
            ("request_cancel", (CancelRequest(run_id="r1", by="ann", reason="stop"),), 1),
            ("claim_run", ("r1",), 0),
            ("end_run", (_ended("r1", StopReason.SUBMITTED),), 0),  # final: nothing goes on
        ]
        for method, args, expected in writes:
            await getattr(store, method)(*args)
            payloads = await heard_.take()
            assert payloads == ["r1"] * expected, (method, args)


async def test_each_committed_batch_tells_the_followers_of_each_run_it_wrote_once(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    """Every write of a record notifies its run's followers' channel, once a batch however
    many of the run's rows it holds (a step with its action's result is two); a claim
    writes no record; the channel of a run nobody wrote hears nothing."""
    with (
        heard(postgres_shared, schema, "r1") as first,
        heard(postgres_shared, schema, "r2") as second,
        heard(postgres_shared, schema, "idle") as idle,
    ):
        await store.claim_run("r1")
        assert await first.take() == []
        for method, args in sample_run("r1", steps=1):
            await getattr(store, method)(*args)
            assert await first.take() == [""], method
        await store.claim_run("r2")
        async with anyio.create_task_group() as tg:  # two runs, perhaps in one batch
            tg.start_soon(store.start_run, sample_run("r2")[0][1][0])
            tg.start_soon(store.request_cancel, CancelRequest(run_id="r1", by="a", reason="b"))
        assert (await first.take(), await second.take()) == ([], [""])
        assert await idle.take() == []


def _verdict(run_id: str) -> Verdict:
    return Verdict(
        run_id=run_id,
        result_id=f"{run_id}:0:action",
        approved=True,
        by="ann",
        payload={"name": "t", "arguments": {}},
        reason=None,
    )


def _settlement(run_id: str) -> Settlement:
    return Settlement(
        run_id=run_id, result_id=f"{run_id}:0:action", ran=True, observation="done", by="ann"
    )


async def test_the_payload_is_the_run_id_as_its_column_spells_it_or_empty_past_the_limit(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    awkward, long = 'a "quoted" \\ id\n\ud800é', "x" * 9_000
    with heard(postgres_shared, schema) as heard_:
        for run_id in (awkward, long):
            await store.claim_run(run_id)
            await store.start_run(sample_run(run_id)[0][1][0])
            await store.release_run(run_id)
        assert await heard_.take() == [run_id_column(awkward)] * 2 + [""] * 2
    assert len(channel(schema).encode()) <= 63
    assert channel(schema) == channel(schema) != channel(schema + "x")
    assert len(channel("é" * 31)) == len(channel(schema))  # whatever the schema's name


async def test_closing_a_store_that_holds_claims_notifies_for_its_started_runs(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    closing = PostgresStore(postgres_shared, schema=schema)
    await closing.claim_run("started")
    await closing.start_run(sample_run("started")[0][1][0])
    await closing.claim_run("never started")
    with heard(postgres_shared, schema) as heard_:
        await closing.aclose()
        assert await heard_.take() == ["started"]


async def test_a_write_rolled_back_or_refused_notifies_nothing(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    await store.claim_run("r1")
    await store.start_run(sample_run("r1")[0][1][0])
    records = sql.Identifier(schema, "records")
    with pg.admin(postgres_shared) as conn:  # a row at seq 1 the store did not write
        insert = "INSERT INTO {} (run_key, seq, run_id, kind, body) VALUES (%s, 1, 'r1', 'i', '')"
        conn.execute(sql.SQL(insert).format(records), (run_key("r1"),))
    with heard(postgres_shared, schema) as heard_:
        # The end's statement fails on that row: its transaction, notification and all, goes.
        with pytest.raises(StoreError):
            await store.end_run(_ended("r1", StopReason.AWAITING_APPROVAL))
        assert await heard_.take() == []
        # A run that does not exist has no row to notify of.
        with pytest.raises(Exception, match="no record"):
            await store.request_cancel(CancelRequest(run_id="nobody", by="ann", reason="stop"))
        assert await heard_.take() == []


# -- the feed ----------------------------------------------------------------------------------


async def test_changes_wakes_on_a_notifying_write_and_not_on_intents(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    assert isinstance(store, ChangeFeed)
    writes = sample_run("r1", steps=1)
    async with (
        PostgresStore(postgres_shared, schema=schema) as writer,
        store.changes() as wait,
    ):
        await writer.claim_run("r1")
        began = time.monotonic()
        await getattr(writer, writes[0][0])(*writes[0][1])
        with anyio.fail_after(5):
            await wait()
        assert time.monotonic() - began < 1.0
        for method, args in writes[1:5]:  # intents, a result, a step
            await getattr(writer, method)(*args)
        with anyio.move_on_after(0.5) as quiet:
            await wait()
        assert quiet.cancelled_caught  # nothing that lets a run go on was written
        # Several writes before the next wait wake it once; the listing says the rest.
        await writer.end_run(_ended("r1", StopReason.CANCELLED))
        await writer.request_cancel(CancelRequest(run_id="r1", by="ann", reason="stop"))
        await anyio.sleep(0.3)
        with anyio.fail_after(5):
            await wait()
        with anyio.move_on_after(0.3) as quiet:
            await wait()
        assert quiet.cancelled_caught


async def test_one_listening_connection_serves_every_block_of_a_store_object(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    """Its followers too (``appended``, what ``polyloop.follow`` waits on)."""
    before = _listeners()
    async with store.changes() as first, store.changes() as second, store.appended("r1") as new:
        assert len(_listeners() - before) == 1
        assert len(await _listening_sessions(postgres_shared, schema)) == 1
        await store.claim_run("r1")
        await store.start_run(sample_run("r1")[0][1][0])
        with anyio.fail_after(5):
            await first()
            await second()
            await new()
    assert await _gone(_listeners() - before)


async def test_the_listener_listens_on_a_run_while_it_has_followers_and_no_longer(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    """A follower who comes while the connection listens is heard on its run's channel
    from its first wait; the channel is given up once its last follower leaves."""
    session = None
    async with store.changes():
        async with store.appended("r1") as first:
            session = store._listener._session
            assert session is not None
            assert appended_channel(schema, "r1") in session.listening
            await store.claim_run("r1")
            await store.start_run(sample_run("r1")[0][1][0])
            with anyio.fail_after(5):
                await first()
        await eventually(
            lambda: appended_channel(schema, "r1") not in session.listening, what="unlistened"
        )
        async with store.appended("r2") as second:
            await store.claim_run("r2")
            await store.start_run(sample_run("r2")[0][1][0])
            with anyio.fail_after(5):
                await second()


async def _listening_sessions(conninfo: str, schema: str) -> list[int]:
    """The server's process ids of the sessions listening on the store's channels (its
    change feed's and its followers')."""

    def find() -> list[int]:
        with pg.admin(conninfo) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = %s AND query LIKE %s",
                (LISTENER, f'%LISTEN "{channel(schema)}%'),
            ).fetchall()
        return [pid for (pid,) in rows]

    return await anyio.to_thread.run_sync(find)


async def _none_listening(conninfo: str, schema: str) -> bool:
    return not await _listening_sessions(conninfo, schema)


async def test_a_lost_listening_connection_is_opened_again_and_wakes_the_waiter_once(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    async with PostgresStore(postgres_shared, schema=schema) as writer, store.changes() as wait:
        (pid,) = await _listening_sessions(postgres_shared, schema)
        with pg.admin(postgres_shared) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone() == (
                True,
            )
        # Notifications may have been missed while it was not listening: one wake says so.
        with anyio.fail_after(10):
            await wait()
        await eventually(
            lambda: _listening_sessions(postgres_shared, schema), what="listening again"
        )
        assert pid not in await _listening_sessions(postgres_shared, schema)
        with anyio.move_on_after(0.3) as quiet:
            await wait()
        assert quiet.cancelled_caught
        # And later writes are heard on the new connection.
        await writer.claim_run("r1")
        await writer.start_run(sample_run("r1")[0][1][0])
        with anyio.fail_after(5):
            await wait()


async def test_closing_the_store_stops_the_listening_thread(
    postgres_shared: str, schema: str
) -> None:
    before = _listeners()
    store = PostgresStore(postgres_shared, schema=schema)
    async with store.changes() as wait:
        started = _listeners() - before
        assert len(started) == 1
        await store.aclose()
        assert not any(thread.is_alive() for thread in started)  # joined by aclose
        assert await _listening_sessions(postgres_shared, schema) == []
        with anyio.move_on_after(0.3) as quiet:  # a closed store's feed never wakes
            await wait()
        assert quiet.cancelled_caught
    with pytest.raises(StoreError, match="closed"):
        async with store.changes():
            pass


async def test_a_cancelled_block_leaves_no_thread_and_no_session(
    postgres_shared: str, schema: str, store: PostgresStore
) -> None:
    before = _listeners()
    with anyio.move_on_after(0.5):
        async with store.changes() as wait:
            await wait()  # cancelled here
    assert await _gone(_listeners() - before)
    assert not _listeners() - before
    await eventually(lambda: _none_listening(postgres_shared, schema), what="its session ends")
    # The store goes on: a new block listens again.
    async with store.changes() as wait:
        await store.claim_run("r1")
        await store.start_run(sample_run("r1")[0][1][0])
        with anyio.fail_after(5):
            await wait()
