"""The SQLite store: the shared contract, crash recovery at every write, its own rules, and
its one write path, commits shared between runs in a worker thread.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

import polyloop.stores._sql.sqlite.sql as sqlite_sql
from kit.agent import (
    SIX_STEP_INTENT_WRITES,
    SIX_STEP_WRITES,
    Ledger,
    close_store,
    crash_and_resume,
    definition,
    kinds,
    make_tools,
    request,
    same_outcome,
    six_step_script,
    uninterrupted,
)
from kit.store import DURABLE_STORE_BACKENDS
from kit.sweep import every_point
from polyloop import Replay, RunEnded, StopReason, resume, run, serialization
from polyloop.ports import Store
from polyloop.serialization import dumps
from polyloop.stores import MemoryStore, SqliteStore
from polyloop.stores._jsonl.fileops import OsFileOps
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
    Record,
    RunAlreadyExists,
    RunLocked,
    RunResult,
    SchemaMajorMismatch,
    StoreError,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


_real_connect = sqlite3.connect


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain connection of the test's own, next to the store's."""
    conn = _real_connect(path, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def insert_row(path: Path, run_id: str, seq: int, kind: str, body: str) -> None:
    with raw(path) as db:
        db.execute(
            "INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)",
            (run_id, seq, kind, body),
        )


def names_in(directory: Path) -> set[str]:
    return {entry.name for entry in directory.iterdir()}


def intent_of(run_id: str) -> Any:
    _, (intent,) = sample_run(run_id, steps=1)[1]
    return intent


@pytest.fixture
def connections(monkeypatch: pytest.MonkeyPatch) -> list[sqlite3.Connection]:
    """Every connection the store opens during the test, in order."""
    made: list[sqlite3.Connection] = []

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn: sqlite3.Connection = _real_connect(*args, **kwargs)
        made.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    return made


# -- the shared contract ----------------------------------------------------------------------


class TestSqliteContract(DurableStoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Callable[[], Store]:
        return lambda: SqliteStore(tmp_path / "runs.db")

    @pytest.fixture
    def store_reference(self, tmp_path: Path) -> tuple[str, list[Any]]:
        return ("polyloop.stores:SqliteStore", [str(tmp_path / "runs.db")])


# -- crash after every write, then resume -------------------------------------------------------


async def _clean_run(replay: Replay) -> Any:
    # The run as it goes without a crash; the memory store keeps it quickest.
    return await uninterrupted(MemoryStore, replay, six_step_script())


@pytest.mark.parametrize("k", every_point(range(1, SIX_STEP_WRITES)))
async def test_crash_after_write_k_resumes_like_an_uninterrupted_run(
    tmp_path: Path, k: int
) -> None:
    path = tmp_path / f"crash-{k}.db"
    resumed, _, store = await crash_and_resume(
        lambda: SqliteStore(path), k, Replay.ALLOWED, six_step_script()
    )
    await close_store(store)
    assert resumed.resumed
    assert same_outcome(resumed, await _clean_run(Replay.ALLOWED))


@pytest.mark.parametrize("k", every_point(range(1, SIX_STEP_WRITES)))
async def test_crash_after_write_k_without_replay_never_repeats_an_action(
    tmp_path: Path, k: int
) -> None:
    path = tmp_path / f"crash-{k}.db"
    resumed, ledger, store = await crash_and_resume(
        lambda: SqliteStore(path), k, Replay.NEVER, six_step_script()
    )
    await close_store(store)
    assert all(ledger.count(result_id) == 1 for _, result_id in ledger.calls)
    if k in SIX_STEP_INTENT_WRITES:
        assert resumed.stop_reason is StopReason.IN_DOUBT
    else:
        assert same_outcome(resumed, await _clean_run(Replay.NEVER))
    async with SqliteStore(path) as reader:
        last = (await reader.read_log("r")).records[-1]
    assert isinstance(last, RunEnded)
    assert last.stop_reason is resumed.stop_reason


# -- opening: WAL, synchronous=FULL, schema, format ------------------------------------------------


async def test_database_runs_in_wal_with_full_sync(
    tmp_path: Path, connections: list[sqlite3.Connection]
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        (own,) = connections  # the store's one connection, used from worker threads
        assert own.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert own.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        # It waits for other writers (in its worker thread) instead of failing at once.
        assert own.execute("PRAGMA busy_timeout").fetchone()[0] > 0
        await apply(store, sample_run("r1", steps=1))
        assert len(connections) == 1
    # WAL is a property of the file: any other connection sees it too.
    with raw(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_a_database_that_refuses_wal_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = SqliteStore(":memory:")  # SQLite keeps this one in memory: no WAL possible
    with pytest.raises(StoreError, match="WAL"):
        await store.read_log("r1")
    # The claim opens the database before it takes a lock, so it is refused the same way.
    with pytest.raises(StoreError, match="WAL"):
        await store.claim_run("r1")
    with pytest.raises(RunLocked):  # and no claim was left behind to write under
        await store.start_run(sample_run("r1")[0][1][0])
    await store.aclose()
    assert names_in(tmp_path) == set()  # no lock taken, nothing left behind


class _IgnoresSynchronous(sqlite3.Connection):
    """A connection on which setting ``synchronous`` silently does something else."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.replace(" ", "").upper().startswith("PRAGMASYNCHRONOUS="):
            sql = "PRAGMA synchronous=NORMAL"
        return super().execute(sql, *args)


async def test_a_database_that_refuses_full_sync_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        return _real_connect(*args, factory=_IgnoresSynchronous, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    store = SqliteStore(tmp_path / "runs.db")
    with pytest.raises(StoreError, match="synchronous=FULL"):
        await apply(store, sample_run("r1", steps=0, ended=False))
    await store.aclose()


async def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not an SQLite database, not even close" * 100)
    store = SqliteStore(path)
    with pytest.raises(StoreError) as error:
        await store.read_log("r1")
    assert f"cannot open the database {path}:" in str(error.value)  # the path, in full
    assert isinstance(error.value.__cause__, sqlite3.Error)
    await store.aclose()


async def test_missing_parent_directories_are_created_and_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    real_fsync_directory = OsFileOps.fsync_directory

    def record(files: OsFileOps, directory: Path) -> None:
        synced.append(Path(directory))
        real_fsync_directory(files, directory)

    monkeypatch.setattr(OsFileOps, "fsync_directory", record)
    path = tmp_path / "a" / "b" / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=1))
        assert len((await store.read_log("r1")).records) > 0
    assert path.is_file()
    # Each new directory's entry is synced into its parent, then the new file's entry,
    # then, at the first claim, the entry of the claims directory beside it.
    b = tmp_path / "a" / "b"
    assert synced == [tmp_path, tmp_path / "a", b, b]


@pytest.mark.parametrize("inside", ["runs.db", "b/runs.db"])
async def test_a_parent_that_is_a_file_is_refused_naming_it(tmp_path: Path, inside: str) -> None:
    (tmp_path / "a").write_text("a file, not a directory")
    store = SqliteStore(tmp_path / "a" / inside)
    with pytest.raises(StoreError) as error:
        await store.read_log("r1")
    # What is in the way, by its path, and what it is.
    assert f"{tmp_path / 'a'} is a file, not a directory" in str(error.value)
    await store.aclose()
    assert (tmp_path / "a").read_text() == "a file, not a directory"


async def test_a_store_that_may_not_create_opens_only_an_existing_database(
    tmp_path: Path,
) -> None:
    def tree() -> dict[str, bytes | None]:
        """Every path under ``tmp_path``, with a file's contents."""
        return {
            str(path.relative_to(tmp_path)): path.read_bytes() if path.is_file() else None
            for path in tmp_path.rglob("*")
        }

    (tmp_path / "empty.db").write_bytes(b"")
    with raw(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    before = tree()
    for name, message in [
        ("missing.db", f"no PolyLoop store at {tmp_path / 'missing.db'}: the file does not exist"),
        (
            "a/b/missing.db",
            f"no PolyLoop store at {tmp_path / 'a/b/missing.db'}: the file does not exist",
        ),
        (".", f"no PolyLoop store at {tmp_path / '.'}: the file is not a file"),
        (
            "empty.db",
            "no PolyLoop store in database 'empty.db': the database holds no PolyLoop tables",
        ),
        (
            "other.db",
            "no PolyLoop store in database 'other.db': the database holds no PolyLoop tables",
        ),
    ]:
        store = SqliteStore(tmp_path / name, create=False)
        with pytest.raises(StoreError) as refused:
            await store.list_runs()
        assert str(refused.value) == message
        with pytest.raises(StoreError, match="no PolyLoop store"):  # nor does a claim
            await store.claim_run("r1")
        await store.aclose()
    assert tree() == before  # no directory, file, table or journal mode was made

    async with SqliteStore(tmp_path / "runs.db") as writer:
        await apply(writer, sample_run("r1", steps=1))
    async with SqliteStore(tmp_path / "runs.db", create=False) as reader:
        assert [run.run_id for run in await reader.list_runs()] == ["r1"]
        assert list((await reader.read_log("r1")).records) == expected_records(
            sample_run("r1", steps=1)
        )


async def test_schema_rows_and_format_are_as_documented(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=1)
    async with SqliteStore(path) as store:
        await apply(store, writes)
    async with SqliteStore(path) as store:  # the DDL runs again on an existing file
        assert len((await store.read_log("r1")).records) == len(expected_records(writes))
    with raw(path) as db:
        assert sorted(db.execute("SELECT key, value FROM meta").fetchall()) == [
            ("format", "polyloop/1"),
            ("layout", "7"),
        ]
        rows = db.execute(
            "SELECT seq, kind, body FROM records WHERE run_id = ? ORDER BY seq", ("r1",)
        ).fetchall()
    assert [(seq, kind) for seq, kind, _ in rows] == [
        (0, "run_started"),
        (1, "intent"),
        (2, "result"),
        (3, "intent"),
        (4, "result"),
        (5, "step"),
        (6, "run_ended"),
    ]
    # Each body reads back after the row before it: the step names its result's observation.
    records: list[Record] = []
    for _, _, body in rows:
        records.append(serialization.loads(body, after=records[-1] if records else None))
    assert records == expected_records(writes)
    assert '"observation_of":"r1:0:action"' in rows[5][2]
    assert '"observation"' not in rows[5][2]


async def test_parameters_name_kind_and_format_never_the_path(tmp_path: Path) -> None:
    path = tmp_path / "somewhere" / "runs.db"
    params = SqliteStore(path).parameters()
    assert params == {"kind": "sqlite", "format": "polyloop/1"}
    assert "somewhere" not in json.dumps(params)


async def test_a_database_of_another_major_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=1))
    with raw(path) as db:
        db.execute("UPDATE meta SET value = 'polyloop/2' WHERE key = 'format'")
    store = SqliteStore(path)
    with pytest.raises(SchemaMajorMismatch) as mismatch:
        await store.read_log("r1")
    assert mismatch.value.location == f"{path}: meta format"  # the path, not its base name
    with pytest.raises(SchemaMajorMismatch):
        await store.claim_run("r2")
    with pytest.raises(RunLocked):  # the refused claim left nothing to write under
        await store.start_run(sample_run("r2")[0][1][0])
    await store.aclose()


async def test_a_later_minor_of_the_format_is_read(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=1)
    async with SqliteStore(path) as store:
        await apply(store, writes)
    with raw(path) as db:
        db.execute("UPDATE meta SET value = 'polyloop/1.4' WHERE key = 'format'")
    async with SqliteStore(path) as store:
        assert list((await store.read_log("r1")).records) == expected_records(writes)


async def test_a_database_without_a_readable_format_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=0))
    with raw(path) as db:
        db.execute("UPDATE meta SET value = 'something else' WHERE key = 'format'")
    store = SqliteStore(path)
    with pytest.raises(CorruptLog, match="meta format"):
        await store.read_log("r1")
    await store.aclose()


# -- atomicity and failures ----------------------------------------------------------------------


async def test_write_step_lands_both_rows_or_neither(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=1, ended=False)
    before, step_write = writes[:-1], writes[-1:]
    store = SqliteStore(path)
    await apply(store, before)
    with raw(path) as db:
        db.execute(
            "CREATE TRIGGER refuse_steps BEFORE INSERT ON records WHEN NEW.kind = 'step' "
            "BEGIN SELECT RAISE(ABORT, 'steps refused'); END"
        )
    with pytest.raises(StoreError, match="steps refused") as failed:
        await apply(store, step_write, claim=False)
    assert isinstance(failed.value.__cause__, sqlite3.Error)
    assert failed.value.run_id == "r1"
    # The action result (inserted first) was rolled back with the step.
    assert list((await store.read_log("r1")).records) == expected_records(before)

    with raw(path) as db:
        db.execute("DROP TRIGGER refuse_steps")
    # This store object writes nothing more for the run, even once the cause is gone...
    with pytest.raises(StoreError, match="earlier write"):
        await apply(store, step_write, claim=False)
    # ...not even under a new claim of its own.
    with pytest.raises(StoreError, match="earlier write"):
        await store.claim_run("r1")
    assert list((await store.read_log("r1")).records) == expected_records(before)
    # ...while other runs go on.
    await apply(store, sample_run("r2", steps=1))
    await store.aclose()
    # A new store object may write the run again.
    async with SqliteStore(path) as reopened:
        await apply(reopened, step_write)
        assert list((await reopened.read_log("r1")).records) == expected_records(writes)


async def test_every_use_after_aclose_is_refused(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "runs.db")
    await apply(store, sample_run("r1", steps=0, ended=False))
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await store.write_intent(intent_of("r1"))
    with pytest.raises(StoreError, match="closed"):
        await store.read_log("r1")
    await store.aclose()


async def test_a_cancelled_write_still_commits_before_the_cancellation_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()

    def gate() -> int:
        entered.set()
        release.wait(10)
        return 0

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn: sqlite3.Connection = _real_connect(*args, **kwargs)
        conn.create_function("gate", 0, gate)
        return conn

    path = tmp_path / "runs.db"
    monkeypatch.setattr(sqlite3, "connect", connect)
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=0, ended=False))
        with raw(path) as db:
            db.execute(
                "CREATE TRIGGER hold_intents AFTER INSERT ON records "
                "WHEN NEW.kind = 'intent' BEGIN SELECT gate(); END"
            )
        scope = anyio.CancelScope()

        async def write() -> None:
            with scope:
                await store.write_intent(intent_of("r1"))
                await anyio.sleep(10)

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(write)
                assert await anyio.to_thread.run_sync(entered.wait, 5)
                scope.cancel()
                await anyio.sleep(0.05)
                release.set()
        finally:
            release.set()
        assert scope.cancelled_caught
        assert (await store.read_log("r1")).records[-1] == intent_of("r1")


# -- corrupt rows ------------------------------------------------------------------------------


@pytest.fixture
async def started(tmp_path: Path) -> Path:
    """A database holding run ``r1`` with its first record only (row seq 0)."""
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=0, ended=False))
    return path


async def _read_error(path: Path, run_id: str = "r1") -> Any:
    async with SqliteStore(path) as store:
        with pytest.raises((CorruptLog, SchemaMajorMismatch)) as error:
            await store.read_log(run_id)
    return error.value


async def test_a_body_that_does_not_decode_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "intent", '{"schema":"polyloop/1","kind":')
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == f"{started}: run row seq 1"
    assert error.run_id == "r1"


async def test_an_empty_object_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "intent", "{}")
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == f"{started}: run row seq 1"


async def test_a_record_of_another_run_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "intent", serialization.dumps(intent_of("r2")))
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == f"{started}: run row seq 1"
    assert "'r2'" in str(error)


async def test_a_row_whose_kind_disagrees_with_its_body_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "result", serialization.dumps(intent_of("r1")))
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == f"{started}: run row seq 1"


async def test_a_body_of_another_major_is_a_schema_mismatch(started: Path) -> None:
    body = serialization.dumps(intent_of("r1"))
    assert '"schema":"polyloop/1"' in body
    insert_row(
        started, "r1", 1, "intent", body.replace('"schema":"polyloop/1"', '"schema":"polyloop/2"')
    )
    error = await _read_error(started)
    assert isinstance(error, SchemaMajorMismatch)
    assert error.location == f"{started}: run row seq 1"


# -- run ids, locks and concurrency ---------------------------------------------------------------


HOSTILE_RUN_IDS = (
    *AWKWARD_RUN_IDS,
    "r1'); DELETE FROM records; --",
    'r1" OR 1=1 --',
    "lone\ud800surrogate",
    "../../runs.db",
)


async def test_hostile_run_ids_are_plain_data_and_locks_stay_in_their_directory(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    path = home / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=1))
        for run_id in HOSTILE_RUN_IDS:
            await apply(store, sample_run(run_id, steps=1, ended=False))
        for run_id in ("r1", *HOSTILE_RUN_IDS):
            log = await store.read_log(run_id)
            ended = run_id == "r1"
            assert list(log.records) == expected_records(sample_run(run_id, steps=1, ended=ended))
        assert tuple(run.run_id for run in await store.list_runs()) == ("r1", *HOSTILE_RUN_IDS)
        claimed = {run.run_id for run in await store.list_runs() if run.claimed}
        assert claimed == set(HOSTILE_RUN_IDS)
        claims = home / "runs.db.claims"
        # A few shared lock files, whatever the runs are called, and none per run: a
        # claim is a locked byte of one of them.
        held = list(claims.iterdir())
        assert 1 <= len(held) <= 16
        for lock_file in held:
            assert lock_file.resolve().parent == claims.resolve()
            assert lock_file.name.startswith(".claims-") and lock_file.suffix == ".lock"
    assert names_in(home) <= {"runs.db", "runs.db-wal", "runs.db-shm", "runs.db.claims"}
    assert names_in(tmp_path) == {"home"}
    with raw(path) as db:
        tables = {
            name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        assert tables == {"meta", "records", "runs"}
        (count,) = db.execute("SELECT COUNT(*) FROM records WHERE seq = 0").fetchone()
    assert count == len(HOSTILE_RUN_IDS) + 1


async def test_a_refused_start_leaves_no_lock_behind(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as first:
        await apply(first, sample_run("r1", steps=0, ended=False))
    late, other = SqliteStore(path), SqliteStore(path)
    with pytest.raises(RunAlreadyExists):
        await apply(late, sample_run("r1", steps=0))
    # A refused write leaves the claim where it was: with ``late``, until it lets go.
    with pytest.raises(RunLocked):
        await other.claim_run("r1")
    await late.release_run("r1")
    await late.claim_run("ghost")
    with pytest.raises(StoreError):
        await late.write_intent(intent_of("ghost"))
    await late.release_run("ghost")
    # Released, neither refusal kept a claim in ``late``.
    assert await other.describe_run("ghost") is None
    await other.claim_run("r1")
    await other.write_intent(intent_of("r1"))
    with pytest.raises(RunLocked):
        await late.write_intent(intent_of("r1"))
    with pytest.raises(RunLocked):
        await late.claim_run("r1")
    assert list((await other.read_log("r1")).records) == expected_records(
        sample_run("r1", steps=1, ended=False)[:2]
    )
    await late.aclose()
    await other.aclose()


_DYING_WRITER = textwrap.dedent(
    """
    import os, sys
    import anyio
    from polyloop.stores import SqliteStore
    from polyloop.testing.store_contract import sample_run

    async def main():
        store = SqliteStore(sys.argv[1])
        _, (intent,) = sample_run("r1", steps=1)[1]
        await store.claim_run("r1")
        await store.write_intent(intent)
        os._exit(0)  # dies holding the writer lock, without closing anything

    anyio.run(main)
    """
)


async def test_a_dead_writer_process_releases_the_run(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=1, ended=False)
    async with SqliteStore(path) as store:
        await apply(store, writes[:1])
    done = await anyio.run_process([sys.executable, "-c", _DYING_WRITER, str(path)], check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    # The dead writer's row still names it, but its lock died with it.
    async with SqliteStore(path) as store:
        described = await store.describe_run("r1")
        assert described is not None and not described.claimed
        await apply(store, writes[2:])
        assert list((await store.read_log("r1")).records) == expected_records(writes)


async def test_many_concurrent_runs_through_one_store(tmp_path: Path) -> None:
    run_ids = [f"run-{i}" for i in range(40)]
    results: dict[str, Any] = {}
    ledgers = {run_id: Ledger() for run_id in run_ids}

    async with SqliteStore(tmp_path / "runs.db") as store:

        async def one(run_id: str) -> None:
            results[run_id] = await run(
                definition(store, script=six_step_script()),
                request(run_id, make_tools(ledgers[run_id])),
            )

        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(one, run_id)
        for run_id in run_ids:
            records = (await store.read_log(run_id)).records
            # 25 writes; five steps ran an action, and their write_step put two rows.
            assert len(records) == SIX_STEP_WRITES + 5
            assert {record.run_id for record in records} == {run_id}
            assert results[run_id].stop_reason is StopReason.SUBMITTED
            assert all(rid.startswith(f"{run_id}:") for _, rid in ledgers[run_id].calls)


# -- the one write path: shared commits in a worker thread -------------------------------------
#
# What is checked, under asyncio and Trio:
#
# * concurrent runs share commits (fewer ``COMMIT`` statements than writes);
# * every barrier (``start_run``, ``write_intent``) commits under ``synchronous=FULL``,
#   transactions of non-barriers only may commit under ``NORMAL``; a lone write runs
#   ``BEGIN IMMEDIATE``, its ``INSERT`` and ``COMMIT``, preceded by a ``synchronous``
#   pragma only when the level changes, and a barrier after a failed switch still commits
#   under ``FULL``;
# * a caller's rows are visible to another connection the moment its call returns;
# * a refused or failed write in a shared commit rolls back alone;
# * a failing ``COMMIT`` fails every write and run in it, and the logs stay valid and
#   resumable on a new store object;
# * a write withdrawn by cancellation before its commit started writes nothing;
# * a write that waits for another connection's write lock waits in its worker thread:
#   the event loop goes on meanwhile.
#
# (That no call of the store blocks the event loop at all is checked in
# ``test_batching.py``, for every durable store.)


FULL, NORMAL = 2, 1
_NAME = {FULL: "FULL", NORMAL: "NORMAL"}
BARRIER_KINDS = frozenset({"run_started", "intent"})


# -- a connection that records every commit ------------------------------------------------


@dataclass
class Commit:
    """One ``COMMIT``: the synchronous level SQLite reported, and the rows it held."""

    level: int
    rows: list[tuple[Any, str]]  # (run id as bound, kind)

    @property
    def runs(self) -> set[Any]:
        return {run_id for run_id, _ in self.rows}

    @property
    def has_barrier(self) -> bool:
        return any(kind in BARRIER_KINDS for _, kind in self.rows)


@dataclass
class Recorder:
    """What the store's connections did, and an optional fault for one ``COMMIT``.

    ``fail`` decides, from the commit about to happen, whether it fails: ``"commit"``
    (nothing lands), ``"after-commit"`` (it lands, the call still fails) or None.
    """

    commits: list[Commit] = field(default_factory=list)
    fail: Callable[[Commit], str | None] | None = None
    failed: list[Commit] = field(default_factory=list)


class RecordingConnection(sqlite3.Connection):
    recorder: Recorder
    pending: list[tuple[Any, str]]
    marks: list[int]

    def executemany(self, statement: str, rows: Any, /) -> sqlite3.Cursor:
        rows = list(rows)
        cursor = super().executemany(statement, rows)
        if statement.startswith("INSERT INTO records"):
            self.pending += [(row[0], row[2]) for row in rows]
        return cursor

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if statement == "COMMIT":
            return self._commit()
        cursor = super().execute(statement, parameters)
        if statement in ("BEGIN IMMEDIATE", "ROLLBACK"):
            self.pending, self.marks = [], []
        elif statement.startswith("SAVEPOINT"):
            self.marks.append(len(self.pending))
        elif statement.startswith("ROLLBACK TO"):
            del self.pending[self.marks[-1] :]
        elif statement.startswith("RELEASE"):
            self.marks.pop()
        return cursor

    def _commit(self) -> sqlite3.Cursor:
        level = super().execute("PRAGMA synchronous").fetchone()[0]
        commit = Commit(level, self.pending)
        self.pending = []
        stage = self.recorder.fail(commit) if self.recorder.fail else None
        if stage == "commit":
            self.recorder.failed.append(commit)
            raise sqlite3.OperationalError("disk I/O error")
        cursor = super().execute("COMMIT")
        if commit.rows:  # not the schema's own transaction
            self.recorder.commits.append(commit)
        if stage == "after-commit":
            self.recorder.failed.append(commit)
            raise sqlite3.OperationalError("disk I/O error")
        return cursor


def install_recorder(
    monkeypatch: pytest.MonkeyPatch, factory: type[RecordingConnection] = RecordingConnection
) -> Recorder:
    """Make the SQLite store's connections (of class ``factory``) record commits.

    Its module of statements makes every connection the store opens, so it is patched there.
    """
    found = Recorder()

    class Sqlite3:
        def __getattr__(self, name: str) -> Any:
            return getattr(sqlite3, name)

        @staticmethod
        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = _real_connect(*args, factory=factory, **kwargs)
            assert isinstance(conn, RecordingConnection)
            conn.recorder, conn.pending, conn.marks = found, [], []
            return conn

    monkeypatch.setattr(sqlite_sql, "sqlite3", Sqlite3())
    return found


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Make the SQLite store's connections record their commits."""
    return install_recorder(monkeypatch)


def intent(run_id: str, k: int = 0) -> Intent:
    _, (found,) = sample_run(run_id, steps=k + 1)[1 + 4 * k]
    assert isinstance(found, Intent)
    return found


async def run_many(store: Any, run_ids: list[str]) -> dict[str, RunResult]:
    """The six-step run under every id at once through ``store``."""
    results: dict[str, RunResult] = {}

    async def one(run_id: str) -> None:
        results[run_id] = await run(
            definition(store, script=six_step_script()), request(run_id, make_tools(Ledger()))
        )

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    return results


# -- sharing commits ------------------------------------------------------------------------


async def test_concurrent_runs_share_commits(tmp_path: Path, recorder: Recorder) -> None:
    run_ids = [f"run-{i}" for i in range(50)]
    async with SqliteStore(tmp_path / "runs.db") as store:
        results = await run_many(store, run_ids)
        for run_id in run_ids:
            assert results[run_id].stop_reason is StopReason.SUBMITTED
            records = (await store.read_log(run_id)).records
            assert len(records) == SIX_STEP_WRITES + 5  # five write_steps hold two rows
            assert {record.run_id for record in records} == {run_id}
    writes = len(run_ids) * SIX_STEP_WRITES
    assert sum(len(commit.rows) for commit in recorder.commits) == len(run_ids) * 30
    assert len(recorder.commits) < writes / 5
    assert max(len(commit.runs) for commit in recorder.commits) > 10


# -- durability levels ----------------------------------------------------------------------


@pytest.mark.parametrize("runs", [1, 30])
async def test_barriers_commit_under_full_and_only_non_barriers_under_normal(
    tmp_path: Path, recorder: Recorder, runs: int
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        await run_many(store, [f"run-{i}" for i in range(runs)])
    barriers = [commit for commit in recorder.commits if commit.has_barrier]
    others = [commit for commit in recorder.commits if not commit.has_barrier]
    assert barriers
    assert all(commit.level == FULL for commit in barriers)
    # A transaction without a barrier does not pay for an fsync. (Shared commits of many
    # runs nearly always hold some barrier; a lone run's results and steps never do.)
    assert all(commit.level == NORMAL for commit in others)
    if runs == 1:
        assert len(others) == SIX_STEP_WRITES - len(barriers)


class LoggingConnection(sqlite3.Connection):
    """Keeps every statement it runs (``execute`` and ``executemany`` alike)."""

    log: list[str]

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        self.log.append(statement)
        return super().execute(statement, parameters)

    def executemany(self, statement: str, rows: Any, /) -> sqlite3.Cursor:
        self.log.append(statement)
        return super().executemany(statement, rows)


async def test_a_write_switches_the_level_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[LoggingConnection] = []

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = _real_connect(*args, factory=LoggingConnection, **kwargs)
        assert isinstance(conn, LoggingConnection)
        conn.log = []
        made.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    # Starts with two barriers in a row; a second result after the first makes two
    # non-barriers in a row (the store does not look into what a result says).
    writes = sample_run("r1", steps=2)
    writes.insert(3, writes[2])
    switches = 0
    async with SqliteStore(tmp_path / "runs.db") as store:
        await store.claim_run("r1")
        (conn,) = made  # the store's one connection
        conn.log.clear()
        level = FULL  # as the store opened it
        for method, args in writes:
            await getattr(store, method)(*args)
            wanted = FULL if method in ("start_run", "write_intent") else NORMAL
            expected = [] if wanted == level else [f"PRAGMA synchronous={_NAME[wanted]}"]
            switches += wanted != level
            level = wanted
            # The records' rows, then the run's row moved on in the same transaction.
            run_row = "UPDATE runs"  # the claim made the run's row, even for its start
            expected += ["BEGIN IMMEDIATE", "INSERT INTO records", run_row, "COMMIT"]
            assert [_statement(sql) for sql in conn.log] == expected, method
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == level
            assert not conn.in_transaction
            conn.log.clear()
        assert len(made) == 1  # every write went through that one connection
    assert 0 < switches < len(writes) - 1


def _statement(sql: str) -> str:
    """What a statement is, without its columns and values: ``INSERT INTO records``."""
    words = sql.split()
    if words[0] == "INSERT":
        return " ".join(words[:3]).split("(")[0].strip()
    if words[0] == "UPDATE":
        return " ".join(words[:2])
    return sql


class _FailsSwitchingOnce(RecordingConnection):
    """Switches to ``NORMAL`` as asked, then reports an error, once per test."""

    failures: ClassVar[list[bool]] = []  # set by the test

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        cursor = super().execute(statement, parameters)
        if statement == "PRAGMA synchronous=NORMAL" and self.failures:
            self.failures.pop()
            raise sqlite3.OperationalError("disk I/O error")
        return cursor


async def test_a_barrier_after_a_failed_level_switch_still_commits_under_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_FailsSwitchingOnce, "failures", [True])
    recorder = install_recorder(monkeypatch, _FailsSwitchingOnce)
    start_1, start_2 = sample_run("r1")[0], sample_run("r2")[0]
    _, (result,) = sample_run("r1", steps=1)[2]
    async with SqliteStore(tmp_path / "runs.db") as store:
        await apply(store, [start_1])
        await apply(store, [start_2])
        with pytest.raises(StoreError, match="disk I/O error"):
            await store.write_result(result)  # the connection was left at NORMAL
        await store.write_intent(intent("r2"))
        assert list((await store.read_log("r1")).records) == expected_records([start_1])
    assert _FailsSwitchingOnce.failures == []
    last = recorder.commits[-1]
    assert last.rows == [("r2", "intent")] and last.level == FULL


# -- visibility -----------------------------------------------------------------------------


class Visible:
    """Wraps a store; after every write, another connection must see the rows."""

    def __init__(self, store: SqliteStore, path: Path) -> None:
        self.store, self.path = store, path
        self.checked = 0

    def parameters(self) -> Any:
        return self.store.parameters()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        async def checked(*args: Any) -> Any:
            result = await method(*args)
            if name == "write_step":  # the action result's row comes first
                self._expect([record for record in (args[1], args[0]) if record is not None])
            elif name in ("start_run", "write_intent", "write_result", "end_run"):
                self._expect([args[0]])
            return result

        return checked

    def _expect(self, records: list[Record]) -> None:
        with raw(self.path) as db:
            found = db.execute(
                "SELECT body FROM records WHERE run_id = ? ORDER BY seq DESC LIMIT ?",
                (records[0].run_id, len(records)),
            ).fetchall()
        # A write's records are written each after the one before (a step after its result).
        written = [dumps(r, after=b) for b, r in zip((None, *records), records, strict=False)]
        assert [body for (body,) in reversed(found)] == written
        self.checked += 1


@pytest.mark.parametrize("runs", [1, 20])
async def test_rows_are_visible_to_another_connection_when_the_call_returns(
    tmp_path: Path, runs: int
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        visible = Visible(store, path)
        results = await run_many(visible, [f"run-{i}" for i in range(runs)])
    assert all(result.stop_reason is StopReason.SUBMITTED for result in results.values())
    assert visible.checked == runs * SIX_STEP_WRITES


# -- refusals and failures inside a shared commit ---------------------------------------------


@dataclass
class Hold:
    """A trigger that holds the commit writing an intent of run ``held`` until released.

    ``connections`` are the store connections opened since :meth:`install`, in order,
    each logging the statements it runs.
    """

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    connections: list[LoggingConnection] = field(default_factory=list)

    def gate(self) -> int:
        self.entered.set()
        self.release.wait(10)
        return 0

    def install(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = _real_connect(*args, factory=LoggingConnection, **kwargs)
            assert isinstance(conn, LoggingConnection)
            conn.log = []
            conn.create_function("gate", 0, self.gate)
            self.connections.append(conn)
            return conn

        monkeypatch.setattr(sqlite3, "connect", connect)
        with raw(path) as db:
            db.execute(
                "CREATE TRIGGER hold AFTER INSERT ON records WHEN NEW.kind = 'intent' "
                "AND NEW.run_id = 'held' BEGIN SELECT gate(); END"
            )

    async def entered_(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, 5)


async def _started(path: Path, *run_ids: str) -> None:
    async with SqliteStore(path) as store:
        for run_id in run_ids:
            await apply(store, sample_run(run_id, steps=0, ended=False))


async def test_a_refused_or_failed_write_rolls_back_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    await _started(path, "held", "ok-1", "ok-2", "exists", "locked", "doomed", "half")
    with raw(path) as db:
        db.execute(
            "CREATE TRIGGER doom BEFORE INSERT ON records WHEN NEW.run_id = 'doomed' "
            "BEGIN SELECT RAISE(ABORT, 'doomed refused'); END"
        )
        db.execute(
            "CREATE TRIGGER halve BEFORE INSERT ON records WHEN NEW.run_id = 'half' "
            "AND NEW.kind = 'step' BEGIN SELECT RAISE(ABORT, 'steps refused'); END"
        )
    hold = Hold()
    hold.install(monkeypatch, path)
    step_writes = sample_run("half", steps=1, ended=False)
    (_, step_args) = step_writes[-1]
    outcomes: dict[str, BaseException | None] = {}

    async with SqliteStore(path) as store, SqliteStore(path) as other:
        statements = hold.connections[0].log  # the connection ``store`` opened
        await other.claim_run("locked")  # another store object holds "locked"
        await other.write_intent(intent("locked"))
        with pytest.raises(RunLocked):
            await store.claim_run("locked")
        # Claimed before the commit is held (a claim needs the store's connection).
        for run_id in ("held", "ok-1", "ok-2", "exists", "ghost", "doomed", "half"):
            await store.claim_run(run_id)

        async def write(name: str, call: Callable[[], Any]) -> None:
            try:
                await call()
            except Exception as exc:  # noqa: BLE001 -- the outcome is what is checked
                outcomes[name] = exc
            else:
                outcomes[name] = None

        begun = len(statements)
        async with anyio.create_task_group() as group:
            group.start_soon(write, "held", lambda: store.write_intent(intent("held")))
            await hold.entered_()  # a shared commit is running: the next ones wait together
            calls: dict[str, Callable[[], Any]] = {
                "ok-1": lambda: store.write_intent(intent("ok-1")),
                "exists": lambda: store.start_run(sample_run("exists")[0][1][0]),
                "locked": lambda: store.write_intent(intent("locked")),
                "ghost": lambda: store.write_intent(intent("ghost")),
                "doomed": lambda: store.write_intent(intent("doomed")),
                "half": lambda: store.write_step(*step_args),
                "ok-2": lambda: store.write_intent(intent("ok-2")),
            }
            for name, call in calls.items():
                group.start_soon(write, name, call)
            await anyio.wait_all_tasks_blocked()
            hold.release.set()
        # Two transactions: the held write's, then one that all the others shared, each
        # run that reached it in a savepoint of its own ("locked", "exists" and "ghost"
        # are refused by the batch's plan, before anything is sent).
        shared = statements[begun:]
        assert shared.count("BEGIN IMMEDIATE") == 2
        assert shared.count("SAVEPOINT run") == len(calls) - 3

        assert outcomes["held"] is None and outcomes["ok-1"] is None and outcomes["ok-2"] is None
        assert isinstance(outcomes["exists"], RunAlreadyExists)
        assert isinstance(outcomes["locked"], RunLocked)
        assert isinstance(outcomes["ghost"], StoreError)
        assert "never started" in str(outcomes["ghost"])
        for name, message in (("doomed", "doomed refused"), ("half", "steps refused")):
            error = outcomes[name]
            assert isinstance(error, StoreError) and message in str(error)
            assert isinstance(error.__cause__, sqlite3.Error)
            # A failed run stays failed for this store object; the others go on.
            with pytest.raises(StoreError, match="earlier write"):
                await store.write_intent(intent(name, 1))
        await store.write_intent(intent("ok-1", 1))

        for run_id in ("held", "ok-2"):
            assert (await store.read_log(run_id)).records[-1] == intent(run_id)
        assert list((await store.read_log("ok-1")).records)[-2:] == [
            intent("ok-1"),
            intent("ok-1", 1),
        ]
        for run_id in ("exists", "doomed", "half"):
            assert len((await store.read_log(run_id)).records) == 1  # only its start
        assert (await store.read_log("locked")).records[1:] == (intent("locked"),)  # other's
        assert (await store.read_log("ghost")).records == ()
    with raw(path) as db:
        seqs = db.execute("SELECT seq FROM records WHERE run_id = 'ok-1' ORDER BY seq")
        assert [seq for (seq,) in seqs] == [0, 1, 2]


@pytest.mark.parametrize("stage", ["commit", "after-commit"])
async def test_a_failing_commit_fails_every_run_in_it_and_the_logs_resume(
    tmp_path: Path, recorder: Recorder, stage: str
) -> None:
    path = tmp_path / "runs.db"
    run_ids = [f"run-{i}" for i in range(12)]

    def fail(commit: Commit) -> str | None:
        # The first shared commit of many runs, once the runs are well under way.
        if not recorder.failed and len(recorder.commits) > 10 and len(commit.runs) >= 3:
            return stage
        return None

    recorder.fail = fail
    results: dict[str, RunResult | StoreError] = {}
    store = SqliteStore(path)

    async def one(run_id: str) -> None:
        try:
            results[run_id] = await run(
                definition(store, script=six_step_script()),
                request(
                    run_id, make_tools(Ledger(), replay=Replay.ALLOWED), model_replay=Replay.ALLOWED
                ),
            )
        except StoreError as exc:
            results[run_id] = exc

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    recorder.fail = None
    (failed_commit,) = recorder.failed
    doomed = {str(key) for key in failed_commit.runs}
    assert len(doomed) >= 3
    assert {run_id for run_id, r in results.items() if isinstance(r, StoreError)} == doomed
    for run_id in doomed:
        error = results[run_id]
        assert isinstance(error, StoreError) and error.run_id == run_id
        assert isinstance(error.__cause__, sqlite3.OperationalError)
        with pytest.raises(StoreError, match="earlier write"):
            await store.write_intent(intent(run_id, 9))
    await store.aclose()

    async with SqliteStore(path) as reopened:
        for run_id in run_ids:
            # The run as it goes without a failure; the memory store keeps it quickest.
            clean = await uninterrupted(
                MemoryStore, Replay.ALLOWED, six_step_script(), run_id=run_id
            )
            result = results[run_id]
            if run_id in doomed:
                recover = resume if (await reopened.read_log(run_id)).records else run
                result = await recover(
                    definition(reopened, script=six_step_script()),
                    request(
                        run_id,
                        make_tools(Ledger(), replay=Replay.ALLOWED),
                        model_replay=Replay.ALLOWED,
                    ),
                )
            assert isinstance(result, RunResult) and same_outcome(result, clean)
            log = (await reopened.read_log(run_id)).records
            assert isinstance(log[-1], RunEnded)
            assert kinds(log).count("RunEnded") == 1


# -- cancellation ---------------------------------------------------------------------------


async def test_a_write_cancelled_before_its_commit_starts_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    await _started(path, "held", "r1")
    hold = Hold()
    hold.install(monkeypatch, path)
    scope = anyio.CancelScope()
    after_write: list[bool] = []

    async with SqliteStore(path) as store:
        await store.claim_run("held")
        await store.claim_run("r1")

        async def cancelled_write() -> None:
            with scope:
                await store.write_intent(intent("r1"))
                after_write.append(True)

        async with anyio.create_task_group() as group:
            group.start_soon(store.write_intent, intent("held"))
            await hold.entered_()
            group.start_soon(cancelled_write)
            await anyio.wait_all_tasks_blocked()  # waiting to join the next commit
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            hold.release.set()
        assert scope.cancelled_caught and after_write == []
        assert list((await store.read_log("r1")).records) == expected_records(
            sample_run("r1", steps=0, ended=False)
        )
        # The withdrawn write left no gap and nothing waiting behind it: the next write
        # commits at once, and the run goes on from where it was.
        with anyio.fail_after(10):
            await store.write_intent(intent("r1"))
        assert (await store.read_log("r1")).records[-1] == intent("r1")
    with raw(path) as db:
        seqs = db.execute("SELECT seq FROM records WHERE run_id = 'r1' ORDER BY seq")
        assert [seq for (seq,) in seqs] == [0, 1]


async def test_a_started_commit_completes_when_its_leader_is_cancelled_waiting_for_a_thread(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    await _started(path, "r1", "r2")
    release = threading.Event()
    scope = anyio.CancelScope()
    async with SqliteStore(path) as store:
        await store.claim_run("r1")  # while worker threads are free
        await store.claim_run("r2")

        async def lead() -> None:
            with scope:
                await store.write_intent(intent("r1"))

        async with anyio.create_task_group() as group:
            try:
                # Every worker thread busy: the commit, once started, waits for one.
                limiter = anyio.to_thread.current_default_thread_limiter()
                for _ in range(int(limiter.total_tokens)):
                    group.start_soon(anyio.to_thread.run_sync, release.wait)
                await anyio.wait_all_tasks_blocked()
                group.start_soon(lead)
                group.start_soon(store.write_intent, intent("r2"))  # joins the same commit
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
            finally:
                release.set()
        assert scope.cancelled_caught
        # The commit ran for both writes, the cancelled leader's included.
        for run_id in ("r1", "r2"):
            assert (await store.read_log(run_id)).records[-1] == intent(run_id)


async def test_a_write_in_a_cancelled_scope_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=0, ended=False))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.write_intent(intent("r1"))
        assert scope.cancelled_caught
        assert len((await store.read_log("r1")).records) == 1


# -- waiting for another writer's lock ---------------------------------------------------


async def test_a_write_waits_for_another_writers_lock_without_blocking_the_loop(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    ticks = 0
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=0, ended=False))
        with raw(path) as db:
            db.execute("BEGIN IMMEDIATE")  # holds the database's write lock
            done = anyio.Event()

            async def write() -> None:
                await store.write_intent(intent("r1"))
                done.set()

            # A write blocking the event loop for the busy timeout would end past this.
            with anyio.fail_after(10):
                async with anyio.create_task_group() as group:
                    group.start_soon(write)
                    while ticks < 5:  # the event loop keeps running meanwhile
                        await anyio.sleep(0.01)
                        ticks += 1
                    assert not done.is_set()  # the write waits for the lock ...
                    db.execute("COMMIT")
        # ... rather than failing at once, and lands as soon as the lock is free.
        assert (await store.read_log("r1")).records[-1] == intent("r1")
        await store.write_intent(intent("r1", 1))
        started = expected_records(sample_run("r1", steps=0, ended=False))
        assert list((await store.read_log("r1")).records) == [
            *started,
            intent("r1"),
            intent("r1", 1),
        ]


# -- seq counters and writer locks -----------------------------------------------------------


async def test_the_next_seq_is_read_again_when_a_run_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=2, ended=False)
    first, second = SqliteStore(path), SqliteStore(path)
    await apply(first, writes[:3])
    await first.aclose()  # gives the run up
    await apply(second, writes[3:6])
    await second.aclose()
    third = SqliteStore(path)
    await apply(third, writes[6:])
    assert list((await third.read_log("r1")).records) == expected_records(writes)
    await third.aclose()
    with raw(path) as db:
        seqs = db.execute("SELECT seq FROM records WHERE run_id = 'r1' ORDER BY seq")
        assert [seq for (seq,) in seqs] == list(range(len(expected_records(writes))))
