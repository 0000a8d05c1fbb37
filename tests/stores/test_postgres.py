"""The PostgreSQL store against the shared contract, crashes at every write, lost
connections, dead lock holders, corrupt rows and group commit, under asyncio and Trio.

Each test gets an empty database or schema of its own (see ``kit/pg.py`` for where the
server comes from and when these tests skip or fail).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import psycopg
import pytest
from psycopg import sql

from kit import pg, postgres_probe
from kit.agent import (
    SIX_STEP_INTENT_WRITES,
    SIX_STEP_WRITES,
    InterruptedModel,
    Ledger,
    close_store,
    crash_and_resume,
    definition,
    make_tools,
    request,
    same_outcome,
    six_step_script,
    uninterrupted,
)
from kit.store import DURABLE_STORE_BACKENDS
from kit.sweep import every_point
from polyloop import ModelCall, Replay, RunEnded, RunResult, StopReason, resume, run
from polyloop.ports import Store
from polyloop.stores import MemoryStore, PostgresStore
from polyloop.stores._sql.postgres import connection as _postgres_connection
from polyloop.stores._sql.postgres import sql as _postgres_sql
from polyloop.stores._sql.postgres.batch import Committer
from polyloop.stores._sql.postgres.connection import Settings, open_connection
from polyloop.stores._writes import record_rows
from polyloop.testing.store_contract import (
    AWKWARD_RUN_IDS,
    DurableStoreContract,
    apply,
    expected_records,
    sample_run,
)
from polyloop.types import (
    CorruptLog,
    Intent,
    InvalidRequest,
    Record,
    RunAlreadyExists,
    RunLocked,
    RunStarted,
    SchemaMajorMismatch,
    StoreError,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# pytest-postgresql's throw-away server, started only if no configured server answers.
pg_fallback_proc = pg.fallback_server()


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> str:
    return pg.server_conninfo(request, "pg_fallback_proc")


@pytest.fixture
def conninfo(pg_server: str) -> Iterator[str]:
    """The URL of an empty database of this test's own."""
    with pg.fresh_database(pg_server) as url:
        yield url


@pytest.fixture(scope="session")
def shared_database(pg_server: str) -> Iterator[str]:
    with pg.fresh_database(pg_server) as url:
        yield url


@pytest.fixture
def new_schema(shared_database: str) -> Iterator[Callable[[], str]]:
    """Names schemas of this test's own in a database shared with other tests."""
    with pg.fresh_schemas(shared_database) as new:
        yield new


class TestPostgresContract(DurableStoreContract):
    @pytest.fixture
    def place(self, request: pytest.FixtureRequest) -> tuple[str, str]:
        """The URL and schema of the store: a schema of the test's own in the shared
        database, which costs far less than a database; but a child process knows the store
        by its URL alone, so a test that has one opens the default schema of a database."""
        if "store_reference" in request.fixturenames:
            return request.getfixturevalue("conninfo"), "polyloop"
        return request.getfixturevalue("shared_database"), request.getfixturevalue("new_schema")()

    @pytest.fixture
    def store_factory(self, place: tuple[str, str]) -> Callable[[], Store]:
        conninfo, schema = place
        return lambda: PostgresStore(conninfo, schema=schema)

    @pytest.fixture
    def store_reference(self, place: tuple[str, str]) -> tuple[str, list[Any]]:
        # The child process opens the same database: the URL says it all.
        return ("polyloop.stores:PostgresStore", [place[0]])


# -- helpers ----------------------------------------------------------------------------------


def _intent(run_id: str, k: int = 0) -> Intent:
    _, (intent,) = sample_run(run_id, steps=k + 1)[1 + 4 * k]
    assert isinstance(intent, Intent)
    return intent


async def _query(conninfo: str, query: str | sql.Composed, *params: object) -> list[Any]:
    def fetch() -> list[Any]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    return await anyio.to_thread.run_sync(fetch)


async def _sessions_of(conninfo: str, application: str) -> list[Any]:
    """``pid`` of every session of this database with that application name."""
    return await _query(
        conninfo,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND pid <> pg_backend_pid()",
        application,
    )


async def _advisory_locks(conninfo: str) -> int:
    """How many advisory locks sessions connected to this database hold."""
    rows = await _query(
        conninfo,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    return int(rows[0][0])


async def _sessions(conninfo: str, application: str) -> int:
    rows = await _query(
        conninfo,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s",
        application,
    )
    return int(rows[0][0])


async def _terminate_writers(conninfo: str) -> None:
    """End every writer session of this database, and wait until they are gone."""
    pids = await _sessions_of(conninfo, "polyloop-writer")
    assert pids
    for (pid,) in pids:
        rows = await _query(conninfo, "SELECT pg_terminate_backend(%s, 10000)", pid)
        assert rows == [(True,)]


async def _claim_until_unlocked(store: PostgresStore, run_id: str) -> None:
    """The server frees a dead session's locks moments after the socket closes."""
    with anyio.fail_after(20):
        while True:
            try:
                await store.claim_run(run_id)
            except RunLocked:
                await anyio.sleep(0.05)
            else:
                return


# -- crash at every write ---------------------------------------------------------------------


@pytest.mark.parametrize("k", every_point(range(1, SIX_STEP_WRITES)))
async def test_crash_after_every_write_resumes_like_an_uninterrupted_run(
    shared_database: str, new_schema: Callable[[], str], k: int
) -> None:
    crashed = new_schema()
    expected = await uninterrupted(MemoryStore, Replay.ALLOWED, six_step_script())
    resumed, ledger, store = await crash_and_resume(
        lambda: PostgresStore(shared_database, schema=crashed),
        k,
        Replay.ALLOWED,
        six_step_script(),
    )
    try:
        assert resumed.resumed
        assert same_outcome(resumed, expected)
        # A replayed action reuses its result id; at most the one open action ran twice.
        assert {rid for _, rid in ledger.calls} <= {f"r:{i}:action" for i in range(6)}
        assert len(ledger.calls) <= expected.valid_step_count + 1
        log = await store.read_log("r")
        assert isinstance(log.records[-1], RunEnded)
        assert log.records[-1].stop_reason is StopReason.SUBMITTED
    finally:
        await close_store(store)


@pytest.mark.parametrize("k", every_point(range(1, SIX_STEP_WRITES)))
async def test_crash_with_replay_never_is_in_doubt_only_after_an_intent(
    shared_database: str, new_schema: Callable[[], str], k: int
) -> None:
    crashed = new_schema()
    expected = await uninterrupted(MemoryStore, Replay.NEVER, six_step_script())
    resumed, ledger, store = await crash_and_resume(
        lambda: PostgresStore(shared_database, schema=crashed),
        k,
        Replay.NEVER,
        six_step_script(),
    )
    try:
        if k in SIX_STEP_INTENT_WRITES:
            assert resumed.stop_reason is StopReason.IN_DOUBT
            log = await store.read_log("r")
            open_intent = log.records[-2]
            assert isinstance(open_intent, Intent)
            assert resumed.detail is not None and open_intent.result_id in resumed.detail
        else:
            assert same_outcome(resumed, expected)
        # Whatever happened, no action ran twice.
        assert all(ledger.count(rid) == 1 for _, rid in ledger.calls)
    finally:
        await close_store(store)


# -- the writer lock ----------------------------------------------------------------------------

_HOLDER = textwrap.dedent(
    """
    import sys
    import anyio
    from polyloop.stores import PostgresStore
    from polyloop.testing.store_contract import sample_run

    async def main():
        # A short lease: a killed owner's runs are free once a sixth of it is left.
        store = PostgresStore(sys.argv[1], lease_s=3)
        [(_, (record,))] = sample_run(sys.argv[2], steps=0, ended=False)
        await store.claim_run(sys.argv[2])
        await store.start_run(record)
        print("holding", flush=True)
        await anyio.sleep(3600)

    anyio.run(main)
    """
)


async def _first_line(process: anyio.abc.Process) -> bytes:
    assert process.stdout is not None
    received = b""
    with anyio.fail_after(30):
        while b"\n" not in received:
            received += await process.stdout.receive()
    return received.split(b"\n", 1)[0]


@pytest.mark.slow
async def test_the_lock_of_a_killed_process_is_free_again(conninfo: str) -> None:
    other = PostgresStore(conninfo)
    process = await anyio.open_process([sys.executable, "-c", _HOLDER, conninfo, "r1"], stderr=None)
    try:
        assert await _first_line(process) == b"holding"
        with pytest.raises(RunLocked):
            await other.claim_run("r1")
        with pytest.raises(RunLocked):  # and without the claim, no write either
            await other.write_intent(_intent("r1"))
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
        await process.aclose()
    assert process.returncode == -signal.SIGKILL
    await _claim_until_unlocked(other, "r1")
    await other.write_intent(_intent("r1"))
    assert len((await other.read_log("r1")).records) == 2
    await other.aclose()


async def test_claims_live_with_one_owner_session_never_in_the_pool(conninfo: str) -> None:
    """A store object holds one advisory lock, its owner's, on a session of its own; its
    claims are rows that name it. Ending a run gives its claim up; closing the store
    gives up every claim and the owner's lock before it returns."""
    store = PostgresStore(conninfo)
    writes = sample_run("r1", steps=1)
    await apply(store, writes[:-1])
    assert len((await store.read_log("r1")).records) == 6  # the pool is in use too
    assert len(await _sessions_of(conninfo, "polyloop-owner")) == 1
    assert await _advisory_locks(conninfo) == 1
    assert await _sessions(conninfo, "polyloop-reader") >= 1
    owners = await _query(conninfo, "SELECT owner FROM polyloop.runs")
    assert len(owners) == 1 and owners[0][0] is not None

    await apply(store, writes[-1:], claim=False)  # end_run gives the claim up at once
    assert await _query(conninfo, "SELECT owner FROM polyloop.runs") == [(None,)]

    await apply(store, sample_run("r2", steps=1, ended=False))
    await store.aclose()  # so does closing the store, before it returns
    assert await _query(conninfo, "SELECT count(*) FROM polyloop.runs WHERE owner IS NOT NULL") == [
        (0,)
    ]
    assert await _query(conninfo, "SELECT count(*) FROM polyloop.owners") == [(0,)]
    assert await _advisory_locks(conninfo) == 0
    # Server sessions end moments after their client closes them.
    for _ in range(200):
        sessions = [
            await _sessions(conninfo, name)
            for name in ("polyloop-reader", "polyloop-writer", "polyloop-owner")
        ]
        if sessions == [0, 0, 0]:
            break
        await anyio.sleep(0.05)
    assert sessions == [0, 0, 0]


async def test_runs_share_a_bounded_number_of_writer_connections(conninfo: str) -> None:
    store = PostgresStore(conninfo, max_writer_connections=2)
    run_ids = [f"run-{i}" for i in range(20)]
    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(apply, store, sample_run(run_id, steps=1, ended=False))
    assert await _sessions(conninfo, "polyloop-writer") == 2
    other = PostgresStore(conninfo)
    with pytest.raises(RunLocked):
        await other.claim_run("run-7")
    for run_id in run_ids:
        log = await store.read_log(run_id)
        assert list(log.records) == expected_records(sample_run(run_id, steps=1, ended=False))
    await store.aclose()
    await other.claim_run("run-7")
    await other.write_intent(_intent("run-7", 1))
    await other.aclose()


async def test_schemas_in_one_database_lock_independently(conninfo: str) -> None:
    first = PostgresStore(conninfo, schema="first")
    second = PostgresStore(conninfo, schema="second")
    writes = sample_run("r1", steps=1)
    await apply(first, writes[:2])
    await apply(second, writes)
    assert len((await first.read_log("r1")).records) == 2
    await first.aclose()
    await second.aclose()


@pytest.mark.slow
async def test_concurrent_first_use_from_many_processes(conninfo: str) -> None:
    script = textwrap.dedent(
        """
        import sys
        import anyio
        from polyloop.stores import PostgresStore
        from polyloop.testing.store_contract import sample_run

        async def main():
            async with PostgresStore(sys.argv[1]) as store:
                await store.claim_run(sys.argv[2])
                for method, args in sample_run(sys.argv[2], steps=1):
                    await getattr(store, method)(*args)

        anyio.run(main)
        """
    )

    async def child(run_id: str) -> None:
        done = await anyio.run_process(
            [sys.executable, "-c", script, conninfo, run_id], check=False
        )
        assert done.returncode == 0, done.stderr.decode(errors="replace")

    async with anyio.create_task_group() as group:
        for i in range(6):
            group.start_soon(child, f"p{i}")
    async with PostgresStore(conninfo) as store:
        for i in range(6):
            log = await store.read_log(f"p{i}")
            assert list(log.records) == expected_records(sample_run(f"p{i}", steps=1))


# -- a lost connection ----------------------------------------------------------------------


async def test_a_dropped_writer_connection_costs_a_connection_not_the_run(
    conninfo: str,
) -> None:
    """The writer sessions end under a run (a restart, a pooler that drops them): the
    write that met the lost connection is looked up on a new one by its run's row and
    sent again, and the run ends as an uninterrupted one (research record 0035)."""
    script = six_step_script()
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)

    async def drop_writers(call: ModelCall) -> None:
        await _terminate_writers(conninfo)

    async with PostgresStore(conninfo) as store:
        dropping = definition(store, model=InterruptedModel(script, at=2, before=drop_writers))
        outcome = await run(dropping, request("r", tools, model_replay=Replay.ALLOWED))
    expected = await uninterrupted(
        lambda: PostgresStore(conninfo, schema="uninterrupted"), Replay.ALLOWED, script
    )
    assert not outcome.resumed
    assert same_outcome(outcome, expected)


async def test_after_a_dropped_writer_connection_every_run_writes_on(conninfo: str) -> None:
    """Claims live with the owner, not with a writer connection: after the writer
    session dies, each run of the connection goes on through a new one, still its
    claim's only writer."""
    store = PostgresStore(conninfo, max_writer_connections=1)
    for run_id in ("r1", "r2"):
        await apply(store, sample_run(run_id, steps=0, ended=False))
    await _terminate_writers(conninfo)
    await store.write_intent(_intent("r1"))  # met the lost connection, sent again
    await store.write_intent(_intent("r2"))
    other = PostgresStore(conninfo)
    for run_id in ("r1", "r2"):
        with pytest.raises(RunLocked):
            await other.claim_run(run_id)
        assert [type(r).__name__ for r in (await other.read_log(run_id)).records] == [
            "RunStarted",
            "Intent",
        ]
    await other.aclose()
    await store.aclose()


async def test_an_unreachable_server_is_a_store_error() -> None:
    store = PostgresStore("postgresql://nobody@127.0.0.1:1/none", timeout=0.5)
    with pytest.raises(StoreError):
        await store.read_log("r1")
    with pytest.raises(StoreError) as refused:  # the claim needs the server too
        await store.claim_run("r1")
    assert not isinstance(refused.value, RunLocked)
    await store.aclose()


@dataclass(frozen=True)
class Place:
    """A schema of this test's own in the shared database."""

    conninfo: str
    schema: str

    def store(self) -> PostgresStore:
        return PostgresStore(self.conninfo, schema=self.schema)

    def location(self, run_id: str, seq: int) -> str:
        return f"{self.schema}.records run {run_id!r} seq {seq}"

    async def execute(self, statement: str, *params: object) -> None:
        """Run ``statement``; ``{records}`` and ``{meta}`` name this schema's tables."""
        query = sql.SQL(statement).format(  # type: ignore[arg-type]
            records=sql.Identifier(self.schema, "records"),
            meta=sql.Identifier(self.schema, "meta"),
        )
        await _query(self.conninfo, query, *params)

    async def write(self, *run_ids: str) -> None:
        async with self.store() as store:
            for run_id in run_ids:
                await apply(store, sample_run(run_id, steps=1))

    async def read(self, run_id: str) -> Any:
        async with self.store() as store:
            return await store.read_log(run_id)


@pytest.fixture
def place(shared_database: str, new_schema: Callable[[], str]) -> Place:
    return Place(shared_database, new_schema())


async def test_writes_and_reads_after_aclose_are_refused(place: Place) -> None:
    store = place.store()
    await apply(store, sample_run("r1", steps=0, ended=False))
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await store.write_intent(_intent("r1"))
    with pytest.raises(StoreError, match="closed"):
        await store.read_log("r1")


# -- what the rows hold -------------------------------------------------------------------------


async def test_an_undecodable_body_is_corrupt_with_its_location(place: Place) -> None:
    await place.write("r1")
    await place.execute("UPDATE {records} SET body = %s WHERE seq = 2", '{"half')
    with pytest.raises(CorruptLog) as corrupt:
        await place.read("r1")
    assert corrupt.value.run_id == "r1"
    assert corrupt.value.location == place.location("r1", 2)


async def test_an_empty_object_body_is_corrupt(place: Place) -> None:
    await place.write("r1")
    await place.execute("UPDATE {records} SET body = '{{}}' WHERE seq = 1")
    with pytest.raises(CorruptLog, match="seq 1"):
        await place.read("r1")


async def test_a_record_of_another_run_is_corrupt(place: Place) -> None:
    await place.write("r1", "r2")
    await place.execute(
        "UPDATE {records} AS mine SET body = theirs.body FROM {records} AS theirs"
        " WHERE mine.run_id = 'r1' AND mine.seq = 3 AND theirs.run_id = 'r2' AND theirs.seq = 3"
    )
    with pytest.raises(CorruptLog, match="record of run 'r2'") as corrupt:
        await place.read("r1")
    assert corrupt.value.location == place.location("r1", 3)


async def test_a_body_of_another_major_is_a_schema_mismatch(place: Place) -> None:
    await place.write("r1")
    await place.execute(
        "UPDATE {records} SET body = replace(body, %s, %s) WHERE seq = 4",
        '"polyloop/1"',
        '"polyloop/2"',
    )
    with pytest.raises(SchemaMajorMismatch) as mismatch:
        await place.read("r1")
    assert mismatch.value.location == place.location("r1", 4)


async def test_a_row_whose_kind_disagrees_or_a_gap_is_corrupt(place: Place) -> None:
    await place.write("r1", "r2")
    await place.execute("UPDATE {records} SET kind = 'result' WHERE run_id = 'r1' AND seq = 1")
    with pytest.raises(CorruptLog, match="says 'result'"):
        await place.read("r1")
    await place.execute("DELETE FROM {records} WHERE run_id = 'r2' AND seq = 2")
    with pytest.raises(CorruptLog, match="seq 2 is missing"):
        await place.read("r2")


async def test_a_row_whose_run_id_column_disagrees_is_corrupt(place: Place) -> None:
    await place.write("r1")
    await place.execute("UPDATE {records} SET run_id = 'r9' WHERE seq = 1")
    with pytest.raises(CorruptLog, match="run_id column says 'r9'") as corrupt:
        await place.read("r1")
    assert corrupt.value.location == place.location("r1", 1)


async def test_a_schema_of_another_major_is_refused(place: Place) -> None:
    await place.write("r1")
    await place.execute("UPDATE {meta} SET value = 'polyloop/2' WHERE key = 'format'")
    store = place.store()
    with pytest.raises(SchemaMajorMismatch) as mismatch:
        await store.read_log("r1")
    assert mismatch.value.location == f"{place.schema}.meta format"
    with pytest.raises(SchemaMajorMismatch):  # no claim, so no write either
        await store.claim_run("r1")
    await store.aclose()


async def test_long_run_ids_are_kept_whole_and_shown_short(place: Place) -> None:
    # Incompressible and longer than a btree entry may be: the key is its hash.
    run_id = "".join(chr(0x4E00 + (i * 7919) % 20_000) for i in range(3_000))
    await place.write(run_id)
    assert list((await place.read(run_id)).records) == expected_records(sample_run(run_id, steps=1))
    await place.execute("UPDATE {records} SET body = 'nope' WHERE seq = 0")
    with pytest.raises(CorruptLog) as corrupt:
        await place.read(run_id)
    assert corrupt.value.run_id == run_id
    assert corrupt.value.location is not None and len(corrupt.value.location) < 120


INJECTIONS = (
    "r'); DROP TABLE polyloop.records; --",
    'x" OR 1=1 --',
    "%s %(name)s {} $1",
    "back\\slash\x00nul\x1fcontrol",
)


async def test_hostile_run_ids_and_schema_names_are_plain_data(conninfo: str) -> None:
    schema = 'we"ird; DROP SCHEMA public CASCADE; --'
    async with PostgresStore(conninfo, schema=schema) as store:
        for run_id in INJECTIONS + AWKWARD_RUN_IDS:
            await apply(store, sample_run(run_id, steps=1))
        for run_id in INJECTIONS + AWKWARD_RUN_IDS:
            log = await store.read_log(run_id)
            assert list(log.records) == expected_records(sample_run(run_id, steps=1))
        listed = [run.run_id for run in await store.list_runs()]
        assert sorted(listed) == sorted(INJECTIONS + AWKWARD_RUN_IDS)
        assert (await store.read_log("r")).records == ()
    schemas = {name for (name,) in await _query(conninfo, "SELECT nspname FROM pg_namespace")}
    assert {schema, "public"} <= schemas
    ordinary = await _query(
        conninfo,
        sql.SQL("SELECT count(*) FROM {} WHERE run_id = %s").format(
            sql.Identifier(schema, "records")
        ),
        INJECTIONS[0],
    )
    assert ordinary == [(7,)]  # an ordinary id is stored as itself


async def test_a_store_that_may_not_create_opens_only_an_existing_schema(
    shared_database: str, new_schema: Callable[[], str]
) -> None:
    schema = new_schema()

    async def named(schema: str) -> list[Any]:
        return await _query(
            shared_database, "SELECT nspname FROM pg_namespace WHERE nspname = %s", schema
        )

    reader = PostgresStore(shared_database, schema=schema, create=False)
    with pytest.raises(StoreError) as missing:
        await reader.list_runs()
    assert (
        str(missing.value) == f"no PolyLoop store in schema {schema!r}: the schema does not exist"
    )
    with pytest.raises(StoreError, match="the schema does not exist"):  # nor does a claim
        await reader.claim_run("r1")
    await reader.aclose()
    assert await named(schema) == []

    # A schema that exists but holds other things is no store either, and stays as it was.
    await _query(shared_database, sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    with pytest.raises(StoreError) as empty:
        async with PostgresStore(shared_database, schema=schema, create=False):
            pass
    assert str(empty.value) == (
        f"no PolyLoop store in schema {schema!r}: the schema holds no PolyLoop tables"
    )
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = %s"
    assert await _query(shared_database, tables, schema) == []

    async with PostgresStore(shared_database, schema=schema) as writer:
        await apply(writer, sample_run("r1", steps=1))
    async with PostgresStore(shared_database, schema=schema, create=False) as reader:
        assert [run.run_id for run in await reader.list_runs()] == ["r1"]
        assert list((await reader.read_log("r1")).records) == expected_records(
            sample_run("r1", steps=1)
        )


# -- options and surface ------------------------------------------------------------------------


def test_parameters_and_repr_never_show_the_connection_string() -> None:
    store = PostgresStore("postgresql://someone:secret@db.example/runs", schema="other")
    assert store.parameters() == {"kind": "postgresql", "format": "polyloop/1"}
    assert repr(store) == "PostgresStore(schema='other')"


@pytest.mark.parametrize(
    "options",
    [
        {"schema": ""},
        {"schema": "s" * 64},
        {"schema": "nul\x00"},
        {"schema": "é" * 32},
        {"pool_size": 0},
        {"max_writer_connections": 0},
        {"timeout": 0},
    ],
)
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest, match="must be"):
        PostgresStore("postgresql://", **options)


def test_a_bad_connection_string_is_refused_without_repeating_it() -> None:
    with pytest.raises(InvalidRequest, match="not a valid") as refused:
        PostgresStore("host=db password=secret nonsense")
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize(
    ("conninfo", "expected"),
    [
        (
            "postgresql://db/runs",
            {
                "connect_timeout": 8,
                "tcp_user_timeout": 2000,
                "keepalives": 1,
                "keepalives_idle": 1,
                "keepalives_interval": 1,
                "keepalives_count": 3,
            },
        ),
        (
            "host=db connect_timeout=3 keepalives_idle=60 tcp_user_timeout=0",
            {"keepalives": 1, "keepalives_interval": 1, "keepalives_count": 3},
        ),
    ],
)
def test_connections_get_timeouts_and_keepalives_unless_the_conninfo_sets_its_own(
    conninfo: str, expected: dict[str, int]
) -> None:
    settings = Settings(
        conninfo=conninfo,
        schema="polyloop",
        pool_size=1,
        max_writers=1,
        timeout=7.5,
        lease_s=15,
        statement_timeout_s=2,
    )
    assert settings.options == expected


async def test_every_connection_of_a_store_has_a_deadline(
    shared_database: str, new_schema: Callable[[], str]
) -> None:
    """Writers and readers wait the statement deadline at most; the owner's connection a
    quarter of the lease, if that is shorter (research record 0035)."""
    options = {"statement_timeout_s": 2.0, "lease_s": 6.0}
    async with PostgresStore(shared_database, schema=new_schema(), **options) as store:
        await store.claim_run("r")
        backend: Any = store._backend  # type: ignore[attr-defined]

        def reader_deadline() -> float:
            with backend._pool.connection() as reader:
                return float(reader.deadline_s)

        reader = await anyio.to_thread.run_sync(reader_deadline)
        writer = backend._writers[0].connection.deadline_s
        owner = backend._owner._link.connection.deadline_s
    assert (writer, reader, owner) == (3.0, 3.0, 1.5)


async def test_a_server_that_cannot_be_reached_is_named_on_one_line() -> None:
    """Not the schema's fault: the message says the server could not be reached, on one
    line, and never shows the password."""
    store = PostgresStore("postgresql://polyloop:secret-pw@127.0.0.1:1/runs", timeout=2)
    try:
        with pytest.raises(StoreError) as failed:
            await store.list_runs()
    finally:
        await store.aclose()
    message = str(failed.value)
    assert message.startswith("could not connect to the PostgreSQL server: OperationalError:")
    assert "Connection refused" in message
    assert "\n" not in message and "secret-pw" not in message and "schema" not in message


async def test_a_writer_session_never_runs_without_synchronous_commit(
    shared_database: str,
) -> None:
    lax = psycopg.conninfo.make_conninfo(shared_database, options="-c synchronous_commit=off")

    def setting() -> str:
        with open_connection(lax, 30.0, name="polyloop-writer") as conn:
            row = conn.execute("SHOW synchronous_commit").fetchone()
            assert row is not None
            return str(row[0])

    assert await anyio.to_thread.run_sync(setting) == "on"


def test_importing_the_stores_does_not_import_psycopg() -> None:
    code = (
        "import sys, polyloop, polyloop.stores; "
        "assert 'psycopg' not in sys.modules and 'psycopg_pool' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- group commit ------------------------------------------------------------------------------
#
# Writes of different runs that wait at the same moment share one commit; each caller
# returns only after the commit that holds its rows; an item refused or failing on its own
# fails alone; a connection lost in the middle of a batch fails every run of that
# connection and a new store object resumes them; a cancellation before a batch starts
# writes nothing; a batch holding a barrier always commits with ``synchronous_commit`` on.
#
# The tests watch commits through the store's private probe, which the batch thread calls
# just before each statement, and steer batches by holding the only writer connection's
# batch at the probe: every write made meanwhile waits for the connection's next batch.
# Every run is claimed before its writes are queued: a claim needs the writer connection,
# which a held batch keeps busy.


Rows = tuple[tuple[str, str], ...]
Call = Callable[[], Awaitable[object]]
BARRIER_KINDS = frozenset({"run_started", "intent"})
WAIT_S = 30


@dataclass(frozen=True)
class Commit:
    """One statement (one transaction) as the batch thread saw it just before sending it;
    a statement the server refused is one too."""

    setting: str  # SHOW synchronous_commit on the connection, inside the transaction if open
    rows: Rows  # (run id, kind) of every row the statement carries
    sent: tuple[str, ...]  # the SQL of the statements that make up the transaction

    @property
    def barrier(self) -> bool:
        return any(kind in BARRIER_KINDS for _, kind in self.rows)

    @property
    def lazy(self) -> bool:
        return any("synchronous_commit" in text for text in self.sent)


class Probe:
    """Watches a store's commits from its batch thread.

    ``commits`` holds every commit (see :class:`Commit`). :meth:`hold` makes the next
    commit wait until the function it returns (or :meth:`release`, for the latest hold)
    is called; ``entered`` is set once that commit waits. :meth:`kill_at` ends the server
    session at the commit that holds a row of the given run.
    """

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.commits: list[Commit] = []
        self.entered = threading.Event()
        self._go = threading.Event()
        self._holding = False
        self._kill: str | None = None

    def hold(self) -> Callable[[], None]:
        self.entered = threading.Event()
        self._go = threading.Event()
        self._holding = True
        return self._go.set

    def release(self) -> None:
        self._go.set()

    def kill_at(self, run_id: str) -> None:
        self._kill = run_id

    def __call__(self, conn: psycopg.Connection[Any], rows: Rows, sent: tuple[str, ...]) -> None:
        if self._holding:
            self._holding = False
            entered, go = self.entered, self._go
            entered.set()
            assert go.wait(WAIT_S)
        if self._kill is not None and any(run_id == self._kill for run_id, _ in rows):
            self._kill = None
            _terminate(self.conninfo, conn.info.backend_pid)
            return
        row = conn.execute("SHOW synchronous_commit").fetchone()
        assert row is not None
        self.commits.append(Commit(str(row[0]), rows, sent))


def _terminate(conninfo: str, pid: int) -> None:
    """End a server session and wait until it is gone (its locks with it)."""
    with pg.admin(conninfo) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
    assert row == (True,)


@pytest.fixture
def probe(postgres_conninfo: str) -> Probe:
    return Probe(postgres_conninfo)


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The run ids of every batch any store commits during the test, batch by batch."""
    seen: list[list[str]] = []
    original = Committer.commit

    def spy(self: Committer, writer: Any, writes: Any) -> Any:
        seen.append([write.run_id for write in writes])
        return original(self, writer, writes)

    monkeypatch.setattr(Committer, "commit", spy)
    return seen


def watched(conninfo: str, probe: Probe, **options: Any) -> PostgresStore:
    return postgres_probe.probed(conninfo, probe, **options)


def started(run_id: str) -> RunStarted:
    record = sample_run(run_id)[0][1][0]
    assert isinstance(record, RunStarted)
    return record


def write(store: PostgresStore, writes: list[tuple[str, Any]]) -> Call:
    """Make ``writes`` on a run that ``store`` has claimed already."""
    return lambda: apply(store, writes, claim=False)


async def claim(store: PostgresStore, *run_ids: str) -> None:
    for run_id in run_ids:
        await store.claim_run(run_id)


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(WAIT_S):
        while True:
            if condition():
                return
            await anyio.sleep(0.002)


async def log_of(store: PostgresStore, run_id: str) -> list[Record]:
    return list((await store.read_log(run_id)).records)


class Busy:
    """Keeps a store's only writer connection busy, so that what comes next queues.

    One write's batch is held at its commit by the probe; every write made until
    :meth:`release` waits for the connection's next batch, and they all share it.
    """

    def __init__(self, store: PostgresStore, probe: Probe) -> None:
        self.store = store
        self.probe = probe
        self.run = f"busy-{uuid.uuid4().hex[:8]}"
        self.release: Callable[[], None] = probe.release

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        await claim(self.store, self.run)
        self.release = self.probe.hold()
        group.start_soon(self.store.start_run, started(self.run))
        assert await anyio.to_thread.run_sync(self.probe.entered.wait, WAIT_S)


async def queued(group: anyio.abc.TaskGroup, call: Callable[[], Awaitable[object]]) -> None:
    """Start ``call`` and return once it waits (for the busy connection's next batch)."""
    group.start_soon(call)
    await anyio.wait_all_tasks_blocked()


async def in_one_batch(
    store: PostgresStore, probe: Probe, calls: list[Call]
) -> list[BaseException | None]:
    """Make ``calls`` one after another while the connection is busy: one batch holds
    them all, in that order. Returns each call's exception, or None."""
    outcomes: list[BaseException | None] = [None] * len(calls)

    async def capture(index: int, call: Call) -> None:
        try:
            await call()
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcomes[index] = exc

    busy = Busy(store, probe)
    async with anyio.create_task_group() as group:
        await busy.start(group)
        for index, call in enumerate(calls):
            await queued(group, partial(capture, index, call))
        busy.release()
    return outcomes


# -- shared commits ---------------------------------------------------------------------------


async def _write_at_once_and_check(store: PostgresStore, run_ids: list[str]) -> None:
    """Write a two-step sample run for each id, all at once; each log must be exactly it."""
    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(apply, store, sample_run(run_id, steps=2))
    for run_id in run_ids:
        assert await log_of(store, run_id) == expected_records(sample_run(run_id, steps=2))


async def test_concurrent_runs_share_commits(postgres_conninfo: str, probe: Probe) -> None:
    run_ids = [f"run-{n}" for n in range(50)]
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await _write_at_once_and_check(store, run_ids)
    writes = len(run_ids) * len(sample_run("x", steps=2))
    rows = [row for commit in probe.commits for row in commit.rows]
    assert len(rows) == len(run_ids) * len(expected_records(sample_run("x", steps=2)))
    assert len(probe.commits) <= writes // 5
    assert max(len({run_id for run_id, _ in commit.rows}) for commit in probe.commits) >= 10


async def test_each_row_is_visible_elsewhere_when_its_call_returns(
    postgres_conninfo: str,
) -> None:
    store = PostgresStore(postgres_conninfo, max_writer_connections=2)
    async with store, PostgresStore(postgres_conninfo) as reader:

        async def one(run_id: str) -> None:
            writes = sample_run(run_id, steps=2)
            await store.claim_run(run_id)
            for done in range(1, len(writes) + 1):
                await apply(store, writes[done - 1 : done], claim=False)
                assert await log_of(reader, run_id) == expected_records(writes[:done])

        async with anyio.create_task_group() as group:
            for n in range(20):
                group.start_soon(one, f"run-{n}")


async def test_several_writes_of_one_run_in_one_batch_get_consecutive_seqs(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    writes = sample_run("m", steps=2)
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await apply(store, writes[:1])
        calls = [write(store, [one]) for one in writes[1:9]]
        assert await in_one_batch(store, probe, calls) == [None] * len(calls)
        assert ["m"] * len(calls) in batches
        await apply(store, writes[9:], claim=False)
        assert await log_of(store, "m") == expected_records(writes)


async def test_runs_ended_in_one_batch_are_unlocked_once_it_commits(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    runs = {run_id: sample_run(run_id, steps=1) for run_id in ("e1", "e2", "open")}
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        for writes in runs.values():
            await apply(store, writes[:-1])
        calls = [write(store, runs[run_id][-1:]) for run_id in ("e1", "e2")]
        assert await in_one_batch(store, probe, calls) == [None, None]
        assert ["e1", "e2"] in batches
        async with PostgresStore(postgres_conninfo) as other:
            for run_id in ("e1", "e2"):
                await other.claim_run(run_id)
                with pytest.raises(StoreError, match="has ended"):  # a final end
                    await other.write_intent(_postgres_intent(run_id))
            with pytest.raises(RunLocked):  # the run still open keeps its lock
                await other.claim_run("open")


def _postgres_intent(run_id: str) -> Any:
    return sample_run(run_id, steps=2)[5][1][0]


class Statements:
    """Every statement the store's writer connections execute, in order (the probe's own
    ``SHOW`` left out)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[str] = []
        opened = _postgres_connection.open_connection

        def open_writer(conninfo: str, *args: Any, **options: Any) -> psycopg.Connection[Any]:
            conn = opened(conninfo, *args, **options)
            if options.get("name") != "polyloop-writer":
                return conn
            execute = conn.execute

            def counted(query: Any, *args: Any, **kwargs: Any) -> Any:
                text = query if isinstance(query, str) else query.as_string(conn)
                if text != "SHOW synchronous_commit":
                    self.sent.append(text)
                return execute(query, *args, **kwargs)

            conn.execute = counted  # type: ignore[method-assign]
            return conn

        monkeypatch.setattr(_postgres_connection, "open_connection", open_writer)


@pytest.mark.slow
async def test_a_batch_of_more_than_a_thousand_rows_is_one_statement(
    postgres_conninfo: str,
    probe: Probe,
    batches: list[list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each run writes one step with its action result (two rows) in the batch.
    run_ids = [f"wide-{n:03d}" for n in range(600)]
    steps = {run_id: sample_run(run_id, steps=1)[4] for run_id in run_ids}
    statements = Statements(monkeypatch)
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(apply, store, [("start_run", (started(run_id),))])
        busy = Busy(store, probe)
        async with anyio.create_task_group() as group:
            await busy.start(group)
            for run_id in run_ids:
                group.start_soon(write(store, [steps[run_id]]))
            await anyio.wait_all_tasks_blocked()  # every write waits for the next batch
            sent_before = len(statements.sent)
            commits_before = len(probe.commits)
            busy.release()
        assert sorted(run_ids) in [sorted(batch) for batch in batches]
        [wide] = [commit for commit in probe.commits[commits_before:] if len(commit.rows) > 2]
        assert len(wide.rows) == 2 * len(run_ids) > 1000
        assert len(wide.sent) == 1
        # What the connection really executed meanwhile: the held write, one statement,
        # then the wide batch in one statement.
        assert statements.sent[sent_before:] == [
            commit.sent[0] for commit in probe.commits[commits_before:]
        ]
        assert len(probe.commits[commits_before:]) == 2
        for run_id in run_ids:
            assert await log_of(store, run_id) == expected_records(
                [("start_run", (started(run_id),)), steps[run_id]]
            )


# -- durability of barriers --------------------------------------------------------------------


async def test_barriers_commit_with_synchronous_commit_on(
    postgres_conninfo: str, probe: Probe
) -> None:
    # Whether the setting really is off inside a lazy statement's own transaction (and
    # only there) is checked below, on the store's own statements.
    async with watched(postgres_conninfo, probe, max_writer_connections=2) as store:
        await apply(store, sample_run("alone", steps=2))
        async with anyio.create_task_group() as group:
            for n in range(20):
                group.start_soon(apply, store, sample_run(f"run-{n}", steps=2))
    for commit in probe.commits:
        assert commit.lazy is not commit.barrier, commit
        if commit.barrier:
            assert commit.setting == "on", commit
    assert any(commit.barrier and len(commit.rows) > 1 for commit in probe.commits)
    assert any(not commit.barrier for commit in probe.commits)
    assert all(len(commit.sent) == 1 for commit in probe.commits)


async def test_a_lazy_write_turns_synchronous_commit_off_for_its_own_transaction(
    postgres_conninfo: str,
) -> None:
    writes = sample_run("r", steps=1)
    async with PostgresStore(postgres_conninfo) as store:
        await apply(store, writes[:1])  # creates the schema and the run's row
    queries = _postgres_sql.Queries("polyloop")  # the store's statements
    # The store's own statements, appending the run's intent as its claim would; the
    # claim above has been given up, so its epoch is still the run's.
    key = _postgres_sql.run_key("r")
    ((kind, body),) = record_rows((writes[1][1][0],))
    runs = sql.Identifier("polyloop", "runs")

    def settings() -> list[tuple[str, bool]]:
        with pg.admin(postgres_conninfo) as conn:
            row = conn.execute(
                sql.SQL("SELECT epoch FROM {} WHERE run_key = %s").format(runs), (key,)
            ).fetchone()
            assert row is not None
            params = {
                "run_keys": [key],
                "epochs": [row[0]],
                "first_seqs": [1],
                "next_seqs": [2],
                "finals": [False],
                "ends": [False],
                "reasons": [None],
                "fenceds": [False],
                "announces": [False],
                "first_rows": [1],
                "kinds": kind,
                "bodies": body,
            }
            seen = []
            for query in (queries.write, queries.lazy_write):
                conn.execute("BEGIN")
                admitted = conn.execute(query, params).fetchall()
                seen.append((_setting(conn), [row[:2] for row in admitted] == [(key, None)]))
                conn.execute("ROLLBACK")
            admitted = conn.execute(queries.lazy_write, params).fetchall()  # alone
            seen.append((_setting(conn), [row[:2] for row in admitted] == [(key, None)]))
            return seen

    # Barrier: on. Lazy: off inside its transaction, and on again once it committed.
    assert await anyio.to_thread.run_sync(settings) == [("on", True), ("off", True), ("on", True)]
    async with PostgresStore(postgres_conninfo) as store:
        assert await log_of(store, "r") == expected_records(writes[:2])


def _setting(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None
    return str(row[0])


# -- refusals and failures ---------------------------------------------------------------------


async def test_items_refused_on_their_own_do_not_fail_their_neighbours(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    async with PostgresStore(postgres_conninfo) as other:
        await apply(other, [("start_run", (started("existing"),))])
    holder = PostgresStore(postgres_conninfo)
    await apply(holder, [("start_run", (started("held"),))])
    ongoing = sample_run("ongoing", steps=1)
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await apply(store, ongoing[:1])
        await claim(store, "existing", "fresh-a", "never", "fresh-b")
        with pytest.raises(RunLocked):
            await store.claim_run("held")
        outcomes = await in_one_batch(
            store,
            probe,
            [
                lambda: store.start_run(started("existing")),
                lambda: store.start_run(started("fresh-a")),
                lambda: store.start_run(started("held")),
                write(store, ongoing[1:2]),
                write(store, sample_run("never", steps=1)[1:2]),
                lambda: store.start_run(started("fresh-b")),
            ],
        )
        assert ["existing", "fresh-a", "held", "ongoing", "never", "fresh-b"] in batches
        assert [type(outcome) for outcome in outcomes] == [
            RunAlreadyExists,
            type(None),
            RunLocked,
            type(None),
            StoreError,
            type(None),
        ]
        assert "never started" in str(outcomes[4])
        assert probe.commits[-1].rows == (
            ("fresh-a", "run_started"),
            ("ongoing", "intent"),
            ("fresh-b", "run_started"),
        )
        for run_id in ("fresh-a", "fresh-b"):
            assert await log_of(store, run_id) == [started(run_id)]
        assert await log_of(store, "ongoing") == expected_records(ongoing[:2])
        assert await log_of(store, "never") == []
        assert await log_of(store, "existing") == [started("existing")]
        # A refusal leaves the claims as they were: this store object still holds the
        # runs it claimed, and once it gives them up another store object writes them
        # while this one is still open.
        async with PostgresStore(postgres_conninfo) as third:
            for run_id in ("never", "existing"):
                with pytest.raises(RunLocked):
                    await third.claim_run(run_id)
                await store.release_run(run_id)
            await apply(third, [("start_run", (started("never"),))])
            await apply(third, sample_run("existing", steps=1)[1:2])
    await holder.aclose()


async def _conflicting_row(conninfo: str, run_id: str, seq: int) -> None:
    """A row at ``seq`` that no store wrote: the store's own row there will clash."""
    records = sql.Identifier("polyloop", "records")
    query = sql.SQL(
        "INSERT INTO {} (run_key, seq, run_id, kind, body) VALUES (%s, %s, %s, 'intent', '{{}}')"
    ).format(records)
    with pg.admin(conninfo) as conn:
        conn.execute(query, (_postgres_sql.run_key(run_id), seq, run_id))


async def _row_count(conninfo: str, run_id: str) -> int:
    records = sql.Identifier("polyloop", "records")
    query = sql.SQL("SELECT count(*) FROM {} WHERE run_key = %s").format(records)
    with pg.admin(conninfo) as conn:
        row = conn.execute(query, (_postgres_sql.run_key(run_id),)).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_row_the_server_refuses_fails_alone(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    runs = {run_id: sample_run(run_id, steps=1) for run_id in ("a", "bad", "b")}
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        for writes in runs.values():
            await apply(store, writes[:1])
        await _conflicting_row(postgres_conninfo, "bad", 1)
        outcomes = await in_one_batch(
            store,
            probe,
            [
                write(store, runs["a"][1:2]),
                write(store, runs["bad"][1:2]),
                write(store, runs["bad"][2:3]),  # the same run: it fails with it, no gap
                write(store, runs["b"][1:2]),
            ],
        )
        assert ["a", "bad", "bad", "b"] in batches
        assert outcomes[0] is None
        assert outcomes[3] is None
        for outcome in outcomes[1:3]:
            assert isinstance(outcome, StoreError)
            assert isinstance(outcome.__cause__, psycopg.errors.UniqueViolation)
        # The batch's one statement was refused; then each run went again on its own.
        tried = [commit.rows for commit in probe.commits[-4:]]
        assert tried == [
            (("a", "intent"), ("bad", "intent"), ("bad", "result"), ("b", "intent")),
            (("a", "intent"),),
            (("bad", "intent"), ("bad", "result")),
            (("b", "intent"),),
        ]
        for commit in probe.commits[-4:]:
            assert commit.setting == "on"
            assert not commit.lazy
            assert len(commit.sent) == 1
        # The connection goes on serving its other runs; the failed run stays refused.
        for run_id in ("a", "b"):
            await apply(store, runs[run_id][2:], claim=False)
            assert await log_of(store, run_id) == expected_records(runs[run_id])
        with pytest.raises(StoreError, match="earlier write"):
            await apply(store, runs["bad"][2:3], claim=False)
        # Nothing of "bad" was written: its start and the clashing row, no more.
        assert await _row_count(postgres_conninfo, "bad") == 2


async def test_a_connection_lost_mid_batch_costs_no_run(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    """The connection is lost as a batch of four runs commits: on a new connection the
    runs' rows show the batch wrote nothing, so it is sent again, and every run goes on."""
    runs = {f"r{n}": sample_run(f"r{n}", steps=2) for n in range(5)}
    store = watched(postgres_conninfo, probe, max_writer_connections=1)
    for writes in runs.values():
        await apply(store, writes[:3])
    probe.kill_at("r1")
    outcomes = await in_one_batch(
        store, probe, [write(store, runs[f"r{n}"][3:4]) for n in range(1, 5)]
    )
    assert ["r1", "r2", "r3", "r4"] in batches
    assert outcomes == [None] * 4
    for run_id, writes in runs.items():
        landed = 3 if run_id == "r0" else 4
        await apply(store, writes[landed:], claim=False)
    await store.aclose()
    async with PostgresStore(postgres_conninfo) as fresh:
        for run_id, writes in runs.items():
            assert await log_of(fresh, run_id) == expected_records(writes)


async def _kill_writers(conninfo: str) -> None:
    """End every writer session of the database."""

    def kill() -> None:
        with pg.admin(conninfo) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = %s",
                ("polyloop-writer",),
            )

    await anyio.to_thread.run_sync(kill)


async def test_concurrent_runs_on_a_lost_connection_resume_like_uninterrupted_ones(
    postgres_conninfo: str,
) -> None:
    script = six_step_script()
    run_ids = [f"k{n}" for n in range(6)]
    store = PostgresStore(postgres_conninfo, max_writer_connections=1)
    failures: dict[str, BaseException] = {}

    async def one(run_id: str) -> None:
        model = None
        if run_id == "k0":
            model = InterruptedModel(
                script, at=2, before=lambda _: _kill_writers(postgres_conninfo)
            )
        tools = make_tools(Ledger(), replay=Replay.ALLOWED)
        try:
            await run(
                definition(store, model=model, script=script),
                request(run_id, tools, model_replay=Replay.ALLOWED),
            )
        except StoreError as exc:
            failures[run_id] = exc

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    # The runs whose writes were on the connection when it went failed; the others went
    # on through a new one. Either way each ends below like an uninterrupted run.
    for failure in failures.values():
        assert isinstance(failure.__cause__, psycopg.OperationalError)
    await store.aclose()

    async def finish(opened: PostgresStore, run_id: str, *, again: bool) -> RunResult:
        tools = make_tools(Ledger(), replay=Replay.ALLOWED)
        go = resume if again else run
        return await go(
            definition(opened, script=script), request(run_id, tools, model_replay=Replay.ALLOWED)
        )

    async with PostgresStore(postgres_conninfo) as fresh:
        resumed = [await finish(fresh, run_id, again=True) for run_id in run_ids]
    async with PostgresStore(postgres_conninfo, schema="reference") as reference:
        expected = [await finish(reference, run_id, again=False) for run_id in run_ids]
    for result, reference_result in zip(resumed, expected, strict=True):
        assert result.resumed
        assert same_outcome(result, reference_result)


# -- cancellation -------------------------------------------------------------------------------


async def test_cancelled_before_its_batch_starts_writes_nothing_and_reraises(
    postgres_conninfo: str, probe: Probe
) -> None:
    reached = False
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        busy = Busy(store, probe)
        await claim(store, "neighbour", "z")
        async with anyio.create_task_group() as group:
            await busy.start(group)
            await queued(group, partial(store.start_run, started("neighbour")))
            with anyio.CancelScope() as scope:

                async def cancel_when_queued() -> None:
                    await anyio.wait_all_tasks_blocked()  # z's write waits for the batch
                    scope.cancel()

                group.start_soon(cancel_when_queued)
                await store.start_run(started("z"))
                reached = True
            busy.release()  # withdrawn while the others still wait
        assert scope.cancelled_caught
        assert not reached
        # The batch that followed the held one carried the neighbour's row alone.
        assert probe.commits[-1].rows == (("neighbour", "run_started"),)
        assert await log_of(store, "z") == []
        assert await log_of(store, "neighbour") == [started("neighbour")]
        assert all(run_id != "z" for commit in probe.commits for run_id, _ in commit.rows)
        # The claim is as it was: still this store object's, and the run still new.
        async with PostgresStore(postgres_conninfo) as other:
            with pytest.raises(RunLocked):
                await other.claim_run("z")
        await store.start_run(started("z"))
        assert await log_of(store, "z") == [started("z")]


@pytest.mark.parametrize("neighbour", [False, True], ids=["alone", "with-a-neighbour"])
async def test_cancelled_once_its_batch_started_commits_then_reraises(
    postgres_conninfo: str, probe: Probe, neighbour: bool
) -> None:
    reached = False
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        busy = Busy(store, probe)
        await claim(store, "n", "z")
        async with anyio.create_task_group() as group:
            if neighbour:  # behind a held batch, n's write and then z's wait for the next
                await busy.start(group)
                await queued(group, partial(store.start_run, started("n")))
            else:
                probe.hold()  # z's own batch is held at its commit
            with anyio.CancelScope() as scope:

                async def cancel_when_started() -> None:
                    if neighbour:
                        await anyio.wait_all_tasks_blocked()  # z's write waits too
                        probe.hold()  # their batch is held at its commit in turn
                        busy.release()
                    assert await anyio.to_thread.run_sync(probe.entered.wait, WAIT_S)
                    scope.cancel()
                    await anyio.sleep(0.05)  # cancelled, yet still waiting for the commit
                    probe.release()

                group.start_soon(cancel_when_started)
                await store.start_run(started("z"))
                reached = True
        assert scope.cancelled_caught
        assert not reached
        assert await log_of(store, "z") == [started("z")]
        if neighbour:
            assert sorted(probe.commits[-1].rows) == [("n", "run_started"), ("z", "run_started")]
            assert await log_of(store, "n") == [started("n")]


async def test_writes_cancelled_once_their_batch_started_waiting_for_a_thread_all_commit(
    postgres_conninfo: str, batches: list[list[str]]
) -> None:
    # Every worker thread is busy, so the batch, once started, waits for one. All its
    # callers are cancelled there, its leader (whichever of them it is) included: the
    # batch still commits every write, and then each caller sees its cancellation.
    run_ids = ["a", "b", "c", "d"]
    scopes = {run_id: anyio.CancelScope() for run_id in run_ids}
    outcomes: dict[str, str] = {}
    release = threading.Event()
    async with PostgresStore(postgres_conninfo, max_writer_connections=1) as store:

        async def start(run_id: str) -> None:
            with scopes[run_id]:
                try:
                    await store.start_run(started(run_id))
                except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                    outcomes[run_id] = type(exc).__name__
                else:
                    outcomes[run_id] = "written"
                return
            outcomes[run_id] = "cancelled"

        await claim(store, *run_ids)  # while worker threads are free
        async with anyio.create_task_group() as tasks:
            try:
                limiter = anyio.to_thread.current_default_thread_limiter()
                for _ in range(int(limiter.total_tokens)):
                    tasks.start_soon(anyio.to_thread.run_sync, release.wait)
                await anyio.wait_all_tasks_blocked()
                for run_id in run_ids:  # started together: they all wait for one batch
                    tasks.start_soon(start, run_id)
                await anyio.wait_all_tasks_blocked()  # its leader waits for a thread
                for scope in scopes.values():
                    scope.cancel()
                await anyio.wait_all_tasks_blocked()
            finally:
                release.set()
        assert outcomes == dict.fromkeys(run_ids, "cancelled")
        assert sorted(run_ids) in [sorted(batch) for batch in batches]
        for run_id in run_ids:  # the batch committed every item, the leader's too
            assert await log_of(store, run_id) == [started(run_id)]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"dbname": "polyloop_no_such_database"}, "does not exist"),
        ({"host": "127.0.0.1", "port": "1"}, "refused"),
    ],
    ids=["missing-database", "closed-port"],
)
async def test_an_unreachable_database_fails_at_once_with_the_servers_message(
    conninfo: str, change: dict[str, str], says: str
) -> None:
    """Not after the pool's timeout with only "couldn't get a connection": the first
    connection is made outside the pool, so its error is the server's own."""
    wrong = psycopg.conninfo.make_conninfo(conninfo, **change)
    began = anyio.current_time()
    with pytest.raises(StoreError, match=says):
        async with PostgresStore(wrong, timeout=30.0):
            pass
    assert anyio.current_time() - began < 20  # the pool alone waits its full 30 s
