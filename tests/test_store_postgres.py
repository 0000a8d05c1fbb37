"""The PostgreSQL store against the shared contract, crashes at every write, lost
connections, dead lock holders and corrupt rows, under asyncio and Trio.

Each test gets an empty database or schema of its own (see ``pg.py`` for where the
server comes from and when these tests skip or fail).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import psycopg
import pytest
from psycopg import sql

import pg
from agent_kit import (
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
from polyloop import ModelCall, Replay, RunEnded, StopReason, resume, run
from polyloop.ports import Store
from polyloop.stores import PostgresStore
from polyloop.stores._postgres import _open_writer
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
    RunLocked,
    SchemaMajorMismatch,
    StoreError,
)

pytestmark = pytest.mark.anyio

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
    def store_factory(self, conninfo: str) -> Callable[[], Store]:
        return lambda: PostgresStore(conninfo)

    @pytest.fixture
    def store_reference(self, conninfo: str) -> tuple[str, list[Any]]:
        # The child process opens the same database: the URL says it all.
        return ("polyloop.stores:PostgresStore", [conninfo])


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


@pytest.mark.parametrize("k", range(1, SIX_STEP_WRITES))
async def test_crash_after_every_write_resumes_like_an_uninterrupted_run(
    shared_database: str, new_schema: Callable[[], str], k: int
) -> None:
    plain, crashed = new_schema(), new_schema()
    expected = await uninterrupted(
        lambda: PostgresStore(shared_database, schema=plain), Replay.ALLOWED, six_step_script()
    )
    resumed, ledger, store = await crash_and_resume(
        lambda: PostgresStore(shared_database, schema=crashed), k, Replay.ALLOWED,
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


@pytest.mark.parametrize("k", range(1, SIX_STEP_WRITES))
async def test_crash_with_replay_never_is_in_doubt_only_after_an_intent(
    shared_database: str, new_schema: Callable[[], str], k: int
) -> None:
    plain, crashed = new_schema(), new_schema()
    expected = await uninterrupted(
        lambda: PostgresStore(shared_database, schema=plain), Replay.NEVER, six_step_script()
    )
    resumed, ledger, store = await crash_and_resume(
        lambda: PostgresStore(shared_database, schema=crashed), k, Replay.NEVER,
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
        store = PostgresStore(sys.argv[1])
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


async def test_the_lock_of_a_killed_process_is_free_again(conninfo: str) -> None:
    other = PostgresStore(conninfo)
    process = await anyio.open_process(
        [sys.executable, "-c", _HOLDER, conninfo, "r1"], stderr=None
    )
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
    assert await _query(conninfo, "SELECT count(*) FROM polyloop.runs WHERE owner IS NOT NULL"
                        ) == [(0,)]
    assert await _query(conninfo, "SELECT count(*) FROM polyloop.owners") == [(0,)]
    assert await _advisory_locks(conninfo) == 0
    # Server sessions end moments after their client closes them.
    for _ in range(200):
        sessions = [await _sessions(conninfo, name)
                    for name in ("polyloop-reader", "polyloop-writer", "polyloop-owner")]
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


async def test_a_dropped_connection_fails_the_run_and_a_new_store_resumes_it(
    conninfo: str,
) -> None:
    script = six_step_script()
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)
    store = PostgresStore(conninfo)
    async def drop_writers(call: ModelCall) -> None:
        await _terminate_writers(conninfo)

    killing = definition(store, model=InterruptedModel(script, at=2, before=drop_writers))
    with pytest.raises(StoreError) as failed:
        await run(killing, request("r", tools, model_replay=Replay.ALLOWED))
    assert failed.value.run_id == "r"
    assert isinstance(failed.value.__cause__, psycopg.Error)

    # This store object writes nothing more for the run, even through resume.
    with pytest.raises(StoreError, match="earlier write"):
        await store.write_intent(_intent("r", 2))
    with pytest.raises(StoreError):
        await resume(definition(store, script=script),
                     request("r", tools, model_replay=Replay.ALLOWED))
    await store.aclose()

    fresh = PostgresStore(conninfo)
    resumed = await resume(definition(fresh, script=script),
                           request("r", tools, model_replay=Replay.ALLOWED))
    await fresh.aclose()
    expected = await uninterrupted(
        lambda: PostgresStore(conninfo, schema="uninterrupted"), Replay.ALLOWED, script
    )
    assert resumed.resumed
    assert same_outcome(resumed, expected)


async def test_a_dropped_writer_connection_fails_only_the_run_that_was_writing(
    conninfo: str,
) -> None:
    """Claims live with the owner, not with a writer connection: after a writer session
    dies, the run whose write met the dead connection fails (its outcome is unknown),
    and another run of the same connection goes on writing through a new one, still
    its claim's only writer."""
    store = PostgresStore(conninfo, max_writer_connections=1)
    for run_id in ("r1", "r2"):
        await apply(store, sample_run(run_id, steps=0, ended=False))
    await _terminate_writers(conninfo)
    with pytest.raises(StoreError) as failed:
        await store.write_intent(_intent("r1"))
    assert isinstance(failed.value.__cause__, psycopg.OperationalError)
    with pytest.raises(StoreError, match="earlier write"):
        await store.write_intent(_intent("r1"))
    await store.write_intent(_intent("r2"))  # through a new writer connection
    other = PostgresStore(conninfo)
    with pytest.raises(RunLocked):
        await other.claim_run("r2")
    with pytest.raises(RunLocked):  # the failed run stays claimed until it is given up
        await other.claim_run("r1")
    await store.release_run("r1")
    await other.claim_run("r1")
    await other.write_intent(_intent("r1"))
    await other.aclose()
    assert [type(r).__name__ for r in (await store.read_log("r2")).records] == [
        "RunStarted", "Intent"]
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
        '"polyloop/1"', '"polyloop/2"',
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
    assert list((await place.read(run_id)).records) == expected_records(
        sample_run(run_id, steps=1)
    )
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
        conninfo, sql.SQL("SELECT count(*) FROM {} WHERE run_id = %s").format(
            sql.Identifier(schema, "records")), INJECTIONS[0],
    )
    assert ordinary == [(7,)]  # an ordinary id is stored as itself


# -- options and surface ------------------------------------------------------------------------


def test_parameters_and_repr_never_show_the_connection_string() -> None:
    store = PostgresStore("postgresql://someone:secret@db.example/runs", schema="other")
    assert store.parameters() == {"kind": "postgresql", "format": "polyloop/1"}
    assert repr(store) == "PostgresStore(schema='other')"


@pytest.mark.parametrize(
    "options",
    [{"schema": ""}, {"schema": "s" * 64}, {"pool_size": 0},
     {"max_writer_connections": 0}, {"timeout": 0}],
)
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be"):
        PostgresStore("postgresql://", **options)


def test_a_bad_connection_string_is_refused_without_repeating_it() -> None:
    with pytest.raises(ValueError, match="not a valid") as refused:
        PostgresStore("host=db password=secret nonsense")
    assert "secret" not in str(refused.value)


async def test_a_writer_session_never_runs_without_synchronous_commit(
    shared_database: str,
) -> None:
    lax = psycopg.conninfo.make_conninfo(shared_database, options="-c synchronous_commit=off")

    def setting() -> str:
        with _open_writer(lax, 30.0) as conn:
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
