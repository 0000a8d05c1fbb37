"""The SQLite store: the shared contract, crash recovery at every write, and its own rules."""

from __future__ import annotations

import json
import sqlite3
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_kit import (
    SIX_STEP_INTENT_WRITES,
    SIX_STEP_WRITES,
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
from polyloop import Replay, RunEnded, StopReason, run, serialization
from polyloop.ports import Store
from polyloop.stores import SqliteStore
from polyloop.stores._common import LockFile
from polyloop.testing.store_contract import (
    AWKWARD_RUN_IDS,
    DurableStoreContract,
    apply,
    expected_records,
    sample_run,
)
from polyloop.types import (
    CorruptLog,
    RunAlreadyExists,
    RunLocked,
    SchemaMajorMismatch,
    StoreError,
)

pytestmark = pytest.mark.anyio

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
        db.execute("INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)",
                   (run_id, seq, kind, body))


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


async def _clean_run(tmp_path: Path, replay: Replay) -> Any:
    return await uninterrupted(lambda: SqliteStore(tmp_path / "clean.db"), replay,
                               six_step_script())


@pytest.mark.parametrize("k", range(1, SIX_STEP_WRITES))
async def test_crash_after_write_k_resumes_like_an_uninterrupted_run(
    tmp_path: Path, k: int
) -> None:
    path = tmp_path / f"crash-{k}.db"
    resumed, _, store = await crash_and_resume(
        lambda: SqliteStore(path), k, Replay.ALLOWED, six_step_script()
    )
    await close_store(store)
    assert resumed.resumed
    assert same_outcome(resumed, await _clean_run(tmp_path, Replay.ALLOWED))


@pytest.mark.parametrize("k", range(1, SIX_STEP_WRITES))
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
        assert same_outcome(resumed, await _clean_run(tmp_path, Replay.NEVER))
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
        # Both of the store's connections: the worker threads' and the inline one.
        worker, inline = connections
        for own in (worker, inline):
            assert own.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert own.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        # The worker connection waits for other writers; the inline one never does.
        assert worker.execute("PRAGMA busy_timeout").fetchone()[0] > 0
        assert inline.execute("PRAGMA busy_timeout").fetchone()[0] == 0
        await apply(store, sample_run("r1", steps=1))
        assert len(connections) == 2
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
    with pytest.raises(StoreError, match=r"cannot open runs\.db") as error:
        await store.read_log("r1")
    assert isinstance(error.value.__cause__, sqlite3.Error)
    await store.aclose()


async def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "runs.db"
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=1))
    assert path.is_file()


async def test_schema_rows_and_format_are_as_documented(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=1)
    async with SqliteStore(path) as store:
        await apply(store, writes)
    async with SqliteStore(path) as store:  # the DDL runs again on an existing file
        assert len((await store.read_log("r1")).records) == len(expected_records(writes))
    with raw(path) as db:
        assert db.execute("SELECT key, value FROM meta").fetchall() == [("format", "polyloop/1")]
        rows = db.execute("SELECT seq, kind, body FROM records WHERE run_id = ? ORDER BY seq",
                          ("r1",)).fetchall()
    assert [(seq, kind) for seq, kind, _ in rows] == [
        (0, "run_started"), (1, "intent"), (2, "result"), (3, "intent"),
        (4, "result"), (5, "step"), (6, "run_ended"),
    ]
    assert [serialization.loads(body) for _, _, body in rows] == expected_records(writes)


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
    assert mismatch.value.location == "runs.db: meta format"
    with pytest.raises(SchemaMajorMismatch):
        await store.claim_run("r2")
    with pytest.raises(RunLocked):  # the refused claim left nothing to write under
        await store.start_run(sample_run("r2")[0][1][0])
    await store.aclose()
    # The refused claim registered no owner: no file is left of it.
    assert names_in(tmp_path / "runs.db.owners") == set()


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
        db.execute("CREATE TRIGGER refuse_steps BEFORE INSERT ON records WHEN NEW.kind = 'step' "
                   "BEGIN SELECT RAISE(ABORT, 'steps refused'); END")
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


@pytest.mark.parametrize("group_commit", [True, False])
async def test_a_cancelled_write_still_commits_before_the_cancellation_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_commit: bool
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
    async with SqliteStore(path, _group_commit=group_commit) as store:
        await apply(store, sample_run("r1", steps=0, ended=False))
        # With a second run open, the store writes two runs: no write runs inline (on
        # the event loop, where the gate below would block the test itself).
        await apply(store, sample_run("r0", steps=0, ended=False))
        with raw(path) as db:
            db.execute("CREATE TRIGGER hold_intents AFTER INSERT ON records "
                       "WHEN NEW.kind = 'intent' BEGIN SELECT gate(); END")
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
    assert error.location == "runs.db: run row seq 1"
    assert error.run_id == "r1"


async def test_an_empty_object_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "intent", "{}")
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == "runs.db: run row seq 1"


async def test_a_record_of_another_run_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "intent", serialization.dumps(intent_of("r2")))
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == "runs.db: run row seq 1"
    assert "'r2'" in str(error)


async def test_a_row_whose_kind_disagrees_with_its_body_is_corrupt(started: Path) -> None:
    insert_row(started, "r1", 1, "result", serialization.dumps(intent_of("r1")))
    error = await _read_error(started)
    assert isinstance(error, CorruptLog)
    assert error.location == "runs.db: run row seq 1"


async def test_a_body_of_another_major_is_a_schema_mismatch(started: Path) -> None:
    body = serialization.dumps(intent_of("r1"))
    assert '"schema":"polyloop/1"' in body
    insert_row(started, "r1", 1, "intent",
               body.replace('"schema":"polyloop/1"', '"schema":"polyloop/2"'))
    error = await _read_error(started)
    assert isinstance(error, SchemaMajorMismatch)
    assert error.location == "runs.db: run row seq 1"


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
            assert list(log.records) == expected_records(sample_run(run_id, steps=1,
                                                                    ended=ended))
        assert tuple(run.run_id for run in await store.list_runs()) == ("r1", *HOSTILE_RUN_IDS)
        claimed = {run.run_id for run in await store.list_runs() if run.claimed}
        assert claimed == set(HOSTILE_RUN_IDS)
        owners = home / "runs.db.owners"
        # One lock file for the store object, whatever its runs are called, and none per
        # run: the claims are rows that name the owner.
        (held,) = owners.iterdir()
        assert held.resolve().parent == owners.resolve() and held.suffix == ".lock"
    assert names_in(owners) == set()  # closing gave every claim up, and the owner's file
    assert names_in(home) <= {"runs.db", "runs.db-wal", "runs.db-shm", "runs.db.owners"}
    assert names_in(tmp_path) == {"home"}
    with raw(path) as db:
        tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master "
                                                 "WHERE type = 'table'")}
        assert tables == {"meta", "records", "runs", "owners"}
        (count,) = db.execute("SELECT COUNT(*) FROM records WHERE seq = 0").fetchone()
    assert count == len(HOSTILE_RUN_IDS) + 1


async def test_a_refused_start_leaves_no_lock_behind(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    owners = tmp_path / "runs.db.owners"
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
    # Released, neither refusal kept a claim in ``late``; the only files are the two live
    # owners' own, none per run.
    assert len(names_in(owners)) == 2
    assert await other.describe_run("ghost") is None
    await other.claim_run("r1")
    await other.write_intent(intent_of("r1"))
    with pytest.raises(RunLocked):
        await late.write_intent(intent_of("r1"))
    with pytest.raises(RunLocked):
        await late.claim_run("r1")
    assert list((await other.read_log("r1")).records) == expected_records(
        sample_run("r1", steps=1, ended=False)[:2])
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
    done = await anyio.run_process([sys.executable, "-c", _DYING_WRITER, str(path)],
                                   check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    # The dead writer's owner file is left behind, but nobody holds its lock any more.
    (dead,) = (tmp_path / "runs.db.owners").iterdir()
    assert not LockFile.held(dead)
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
            results[run_id] = await run(definition(store, script=six_step_script()),
                                        request(run_id, make_tools(ledgers[run_id])))

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
