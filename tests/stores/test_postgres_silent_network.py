"""A silent path to PostgreSQL never hangs a worker (research record 0035).

Worker A talks to PostgreSQL through a loopback proxy (``tests/kit/net_proxy.py``) that
can drop every byte both ways, drop only the server's replies, or hold bytes back, the
shapes of a partition behind a pooler, a load balancer or a NAT, which acknowledge bytes
they never deliver. With ``statement_timeout_s=2`` the client gives a statement up at
its deadline (3 s); each of A's calls then fails within that deadline plus the connect
timeout, a cancelled run returns, and ``aclose()`` returns. Worker B, on a direct path,
takes A's runs over once A's lease is gone; no effect runs twice (every one is noted in
a ledger outside the store), and ``polyloop verify`` finds the log clean. A blip of a
second that loses bytes costs A a connection, not its run. And a server that is only slow
ends the wait with its own statement timeout, well before the deadline.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from psycopg import sql

from kit import lease as lease_kit
from kit import one_writer, pg, postgres_probe
from kit.agent import cancel_when
from kit.net_proxy import Mode, Proxy
from polyloop import Replay, RunEnded, RunLocked, StopReason, StoreError, resume, run
from polyloop.cli import main as polyloop_command
from polyloop.stores import PostgresStore
from polyloop.stores._sql.postgres.owner import CANCELLED_WRITE_WAIT_S
from polyloop.testing.store_contract import sample_run

# Slow: each case waits out real network deadlines of several seconds.
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

STATEMENT_TIMEOUT_S = 2.0
DEADLINE_S = 3.0  # the statement timeout and half of it again (at least a second)
CONNECT_S = 2.0  # the store's ``timeout``: connecting, or waiting for a pooled connection
LEASE_S = 4.0
SLACK_S = 3.0  # a loaded machine's scheduling (CI has run 1.55 s late), never a wait relied on
SILENT = [Mode.BLACKHOLE, Mode.DROP_REPLIES, Mode.HOLD]


@pytest.fixture
def proxy(postgres_conninfo: str) -> Iterator[Proxy]:
    with Proxy.before(postgres_conninfo) as through:
        yield through


def behind(proxy: Proxy, conninfo: str) -> PostgresStore:
    return PostgresStore(
        proxy.conninfo(conninfo),
        statement_timeout_s=STATEMENT_TIMEOUT_S,
        timeout=CONNECT_S,
        lease_s=LEASE_S,
    )


async def _started(store: PostgresStore, run_id: str) -> None:
    await store.claim_run(run_id)
    method, arguments = sample_run(run_id)[0]
    await getattr(store, method)(*arguments)


@pytest.mark.parametrize("mode", SILENT, ids=lambda mode: mode.value)
async def test_every_call_on_a_silent_path_fails_within_its_bound(
    proxy: Proxy, postgres_conninfo: str, mode: Mode
) -> None:
    a = behind(proxy, postgres_conninfo)
    await _started(a, "r")
    _, (intent,) = sample_run("r", steps=1)[1]
    proxy.set(mode)
    began = time.monotonic()
    with pytest.raises(StoreError) as failed:
        await a.write_intent(intent)
    # The deadline, then a new connection to learn what the lost statement wrote.
    assert time.monotonic() - began < DEADLINE_S + CONNECT_S + SLACK_S
    assert failed.value.run_id == "r"
    assert "the server did not answer within 3 s" in str(failed.value)
    began = time.monotonic()
    with pytest.raises(StoreError):
        await a.read_log("r")
    assert time.monotonic() - began < DEADLINE_S + CONNECT_S + SLACK_S
    began = time.monotonic()
    await a.aclose()
    # The owner's renewal in flight, its row dropped on the old and on a new connection.
    assert time.monotonic() - began < 2 * DEADLINE_S + CONNECT_S + SLACK_S


@pytest.mark.parametrize("mode", SILENT, ids=lambda mode: mode.value)
async def test_a_run_on_a_silent_path_fails_is_taken_over_and_nothing_runs_twice(
    proxy: Proxy, postgres_conninfo: str, mode: Mode
) -> None:
    """A's path goes silent during its model call; A's run fails within its bound, B
    takes the run over once A's lease has gone, and each effect ran once."""
    ledger: list[str] = []
    registry = one_writer.tools(ledger.append, Replay.NEVER)

    class GoesSilent(one_writer.Model):
        async def call(self, call: object) -> object:
            proxy.set(mode)  # the reply's record is the first write that meets it
            return await super().call(call)  # type: ignore[arg-type]

    a = behind(proxy, postgres_conninfo)
    began = time.monotonic()
    with pytest.raises(StoreError):
        await run(
            lease_kit.definition(a, ledger.append, GoesSilent(ledger.append)),
            one_writer.request("r", registry, Replay.NEVER),
        )
    # Its write within the deadline and a connect; its claim is given up in the background.
    assert time.monotonic() - began < DEADLINE_S + CONNECT_S + SLACK_S
    async with PostgresStore(postgres_conninfo) as b:
        with anyio.fail_after(LEASE_S * 3):
            while True:
                try:
                    outcome = await resume(
                        one_writer.definition(b, ledger.append),
                        one_writer.request("r", registry, Replay.NEVER),
                    )
                    break
                except RunLocked:
                    await anyio.sleep(0.1)
    # Whether A's result reached the server or not, the model call ran once and the
    # action at most once: B answers from the log or ends in doubt, never calls again.
    assert ledger.count("model r:0:model") == 1
    assert ledger.count("tool r:0:action") <= 1
    assert outcome.stop_reason in (StopReason.SUBMITTED, StopReason.IN_DOUBT)
    assert await anyio.to_thread.run_sync(polyloop_command, ["verify", postgres_conninfo, "r"]) == 0
    with anyio.move_on_after(2 * DEADLINE_S + CONNECT_S + SLACK_S) as bounded:
        await a.aclose()
    assert not bounded.cancelled_caught


@pytest.mark.parametrize("where", ["start", "model call", "write"])
@pytest.mark.parametrize("mode", SILENT, ids=lambda mode: mode.value)
async def test_a_cancelled_run_on_a_silent_path_returns_within_its_grace_and_resumes(
    proxy: Proxy, postgres_conninfo: str, mode: Mode, where: str
) -> None:
    """Cancelled while its start record or another write is stuck on the silent path, or
    in its model call (the end record then meets the silence), A's run returns within its
    grace and the margin; its log ends with a cancelled end record or with none (or is
    empty), and B resumes it once A's lease is gone, with nothing run twice."""
    ledger: list[str] = []
    registry = one_writer.tools(ledger.append, Replay.NEVER)
    silent, cancel_now = threading.Event(), anyio.Event()

    def start_goes_silent(conn: object, rows: tuple[tuple[str, str], ...], _: object) -> None:
        if where == "start" and ("r", "run_started") in rows:
            proxy.set(mode)
            silent.set()

    class GoesSilent(one_writer.Model):
        async def call(self, call: object) -> object:
            reply = await super().call(call)  # type: ignore[arg-type]
            proxy.set(mode)
            silent.set()
            if where == "model call":
                await anyio.sleep(60)  # cancelled here; the end record meets the silence
            return reply

    async def cancel_soon() -> None:
        await anyio.to_thread.run_sync(silent.wait)
        if where != "model call":
            await anyio.sleep(0.5)  # the record is being written by now, in vain
        cancel_now.set()

    a = postgres_probe.probed(
        proxy.conninfo(postgres_conninfo),
        start_goes_silent,
        statement_timeout_s=STATEMENT_TIMEOUT_S,
        timeout=CONNECT_S,
        lease_s=LEASE_S,
    )
    request = dataclasses.replace(
        one_writer.request("r", registry, Replay.NEVER), cancel_grace_s=1.0
    )
    definition = lease_kit.definition(a, ledger.append, GoesSilent(ledger.append))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(cancel_soon)
        returned = await cancel_when(cancel_now, lambda: run(definition, request))
    assert returned is not None
    assert returned < request.cancel_grace_s + CANCELLED_WRITE_WAIT_S + 2.0
    async with PostgresStore(postgres_conninfo) as b:
        records = (await b.read_log("r")).records
        # Nothing of the run may have landed if its start record met the silence.
        if records or where != "start":
            last = records[-1]
            cancelled = isinstance(last, RunEnded) and last.stop_reason is StopReason.CANCELLED
            assert cancelled or not isinstance(last, RunEnded)
            outcome = await _resumed_once_free(b, registry, ledger)
            assert outcome.stop_reason in (StopReason.SUBMITTED, StopReason.IN_DOUBT)
            assert (
                await anyio.to_thread.run_sync(polyloop_command, ["verify", postgres_conninfo, "r"])
                == 0
            )
    # A's model call, or B's if A's run never reached one (its start met the silence).
    assert ledger.count("model r:0:model") == (1 if records or where != "start" else 0)
    assert ledger.count("tool r:0:action") <= 1
    with anyio.move_on_after(2 * DEADLINE_S + CONNECT_S + SLACK_S) as bounded:
        await a.aclose()
    assert not bounded.cancelled_caught


async def _resumed_once_free(b: PostgresStore, registry: Any, ledger: list[str]) -> Any:
    """B resumes the run as soon as A's claim is gone (its lease ends on the silent path)."""
    with anyio.fail_after(LEASE_S * 3):
        while True:
            try:
                return await resume(
                    one_writer.definition(b, ledger.append),
                    one_writer.request("r", registry, Replay.NEVER),
                )
            except RunLocked:
                await anyio.sleep(0.1)


async def test_a_renewal_met_by_a_blip_is_given_up_and_the_lease_outlives_the_blip(
    proxy: Proxy, postgres_conninfo: str
) -> None:
    """A renewal that gets no answer fails within a quarter of the lease and is tried
    again on a new connection, so a blip longer than that costs the lease nothing; a
    renewal left waiting would hold the keeper until the lease ended."""
    lease_s = 12.0
    a = PostgresStore(
        proxy.conninfo(postgres_conninfo),
        statement_timeout_s=STATEMENT_TIMEOUT_S,
        timeout=CONNECT_S,
        lease_s=lease_s,
    )
    async with a, PostgresStore(postgres_conninfo) as b:
        await _started(a, "r")
        proxy.set(Mode.BLACKHOLE)
        await anyio.sleep(lease_s / 3)  # a renewal falls due within the blip
        proxy.set(Mode.PASS)
        # The renewal met by the blip is given up (a quarter of the lease after it was
        # sent), then tried again, well before the lease or its margins end.
        await anyio.sleep(lease_s / 2)
        await a.check_claim("r")
        with pytest.raises(RunLocked):
            await b.claim_run("r")
        _, (intent,) = sample_run("r", steps=1)[1]
        await a.write_intent(intent)


async def test_a_blip_that_loses_bytes_costs_a_connection_not_the_run(
    proxy: Proxy, postgres_conninfo: str
) -> None:
    ledger: list[str] = []
    registry = one_writer.tools(ledger.append, Replay.NEVER)

    class Blips(one_writer.Model):
        async def call(self, call: object) -> object:
            proxy.set(Mode.BLACKHOLE)  # the reply's record is sent into the blip

            async def heal() -> None:
                await anyio.sleep(1.0)
                proxy.set(Mode.PASS)

            group.start_soon(heal)
            return await super().call(call)  # type: ignore[arg-type]

    async with behind(proxy, postgres_conninfo) as a, anyio.create_task_group() as group:
        outcome = await run(
            lease_kit.definition(a, ledger.append, Blips(ledger.append)),
            one_writer.request("r", registry, Replay.NEVER),
        )
    assert outcome.stop_reason is StopReason.SUBMITTED
    assert ledger == ["model r:0:model", "tool r:0:action"]
    assert await anyio.to_thread.run_sync(polyloop_command, ["verify", postgres_conninfo, "r"]) == 0


# -- a server that is slow to answer: its own statement timeout ends the wait -------------


def _slow_inserts(conninfo: str, schema: str) -> None:
    """Make every insert into the schema's records sleep (a server that stops answering)."""
    name = sql.Identifier(schema)
    with pg.admin(conninfo) as conn:
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {}.stall() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_sleep(60); RETURN NEW; END $$"
            ).format(name)
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER stall BEFORE INSERT ON {}.records FOR EACH ROW "
                "EXECUTE FUNCTION {}.stall()"
            ).format(name, name)
        )


async def test_a_silent_server_becomes_a_store_error_within_the_statement_timeout(
    postgres_shared: str, postgres_schemas: Any
) -> None:
    schema = postgres_schemas()
    store = PostgresStore(postgres_shared, schema=schema, statement_timeout_s=1.0)
    notes: list[str] = []
    await store.claim_run("r")
    await store.release_run("r")  # the schema exists now
    await anyio.to_thread.run_sync(_slow_inserts, postgres_shared, schema)
    began = time.monotonic()
    with pytest.raises(StoreError) as failed:
        await run(
            lease_kit.definition(store, notes.append, one_writer.Model(notes.append)),
            one_writer.request("r", lease_kit.held_tools(notes.append, None), Replay.ALLOWED),
        )
    assert time.monotonic() - began < 5
    assert "statement timeout" in str(failed.value)
    assert notes == []  # nothing ran: the start record never landed
    await store.aclose()


async def test_a_cancelled_run_on_a_silent_server_returns_within_its_grace_and_timeout(
    postgres_shared: str, postgres_schemas: Any, caplog: pytest.LogCaptureFixture
) -> None:
    schema = postgres_schemas()
    store = PostgresStore(postgres_shared, schema=schema, statement_timeout_s=1.0)
    # The schema and the connections exist before the clock starts, so the cancellation
    # comes during the model call however slow the machine, never before the run began.
    await store.claim_run("warm")
    await store.release_run("warm")
    notes: list[str] = []
    stalled = anyio.Event()

    class Stalling(one_writer.Model):
        async def call(self, call: Any) -> Any:
            await anyio.to_thread.run_sync(_slow_inserts, postgres_shared, schema)
            stalled.set()
            await anyio.sleep(30)  # cancelled here; the end record then meets the stall
            return await super().call(call)

    request = one_writer.request("r", lease_kit.held_tools(notes.append, None), Replay.ALLOWED)
    try:
        returned = await cancel_when(
            stalled,
            lambda: run(lease_kit.definition(store, notes.append, Stalling(notes.append)), request),
        )
        # The grace is 5 s; the end record's statement gave up after its 1 s timeout, and
        # the cancellation went on.
        assert returned is not None and returned < 4
        assert "could not write the cancelled end record" in caplog.text
    finally:
        await store.aclose()
