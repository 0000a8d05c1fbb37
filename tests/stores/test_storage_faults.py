"""Storage faults at the operating-system boundary, at barriers, and during recovery.

1. A full disk (``ENOSPC``) and an I/O error (``EIO``) at every write of a six-step run:
   for the JSON-lines store raised by ``os.write`` and ``os.fsync`` themselves; for the
   SQLite store raised where SQLite does its I/O (see :class:`FaultyConnection` for why
   that is the lowest point reachable from Python). Each time the run ends with
   ``StoreError`` (the cause chained), the log a new store object reads is valid and holds
   exactly the writes that landed, and ``resume`` on a new store object finishes the run
   as if nothing had happened. For PostgreSQL, a writer session killed by the server
   (``pg_terminate_backend``), idle before a write or in the middle of its transaction,
   costs a connection, not the run: the run ends as if nothing had happened.
2. At a failed barrier nothing later happens: no tool runs after its intent failed, the
   model is not called after its intent failed, and the store object refuses the run
   until it is reopened. (``tests/stores/test_jsonl.py`` already shows the refusal for
   direct writes, that the fsync is not retried and that other runs go on:
   ``test_an_fsync_error_fails_the_run_for_this_store_object``,
   ``test_a_failed_store_object_releases_the_run_at_once``.) Here it is checked at every
   write point: the side effects that ran are exactly those whose intents had returned.
3. Faults during recovery itself: reading the log or cutting its torn tail fails, the
   recovery fails cleanly and leaves a valid log, and a second attempt ends where one
   clean recovery would; a recovery run twice is idempotent.

Every run here uses ``Replay.ALLOWED``, so that recovery can always finish.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest
from psycopg import sql

import polyloop.stores._sql.sqlite.sql as sqlite_sql
from kit.agent import (
    SIX_STEP_INTENT_WRITES,
    SIX_STEP_WRITES,
    Ledger,
    definition,
    kinds,
    make_tools,
    request,
    same_outcome,
    six_step_script,
)
from kit.store import DURABLE_STORE_BACKENDS, jsonl_store_on
from kit.sweep import every_point
from polyloop import resume, run
from polyloop.ports import Store
from polyloop.serialization import dumps
from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash
from polyloop.types import (
    Intent,
    IntentKind,
    Record,
    Replay,
    Result,
    RunEnded,
    RunNotFound,
    RunResult,
    StoreError,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


REPLAY = Replay.ALLOWED
# The writes of a six-step run that sync: start_run and every intent.
BARRIER_WRITES = (1, *sorted(SIX_STEP_INTENT_WRITES))
EVERY_WRITE = range(1, SIX_STEP_WRITES + 1)


# -- the reference run and what each write point means ------------------------------------


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run, and its log cut into the store calls that wrote it."""

    result: RunResult
    writes: tuple[tuple[Record, ...], ...]
    tool_calls: tuple[str, ...]  # result ids of the tool handlers that ran, in order

    def records(self, count: int) -> list[Record]:
        """The records of the first ``count`` writes."""
        return [record for write in self.writes[:count] for record in write]

    def effects(self, count: int) -> tuple[list[str], list[int]]:
        """Tool result ids and model call indexes whose intents are among ``count`` writes.

        After a failure at write ``count + 1``, these side effects, and only these, ran.
        """
        intents = [r for r in self.records(count) if isinstance(r, Intent)]
        actions = {i.result_id for i in intents if i.kind is IntentKind.ACTION}
        return (
            # An announced action the executor refuses (a schema violation) runs no tool.
            [result_id for result_id in self.tool_calls if result_id in actions],
            [i.call_index for i in intents if i.kind is IntentKind.MODEL_CALL],
        )


_REFERENCE: list[Reference] = []


async def reference() -> Reference:
    if not _REFERENCE:
        store, ledger = MemoryStore(), Ledger()
        result = await run(
            definition(store, script=six_step_script()),
            request("r", make_tools(ledger, replay=REPLAY), model_replay=REPLAY),
        )
        writes: list[tuple[Record, ...]] = []
        pending: Record | None = None
        for record in (await store.read_log("r")).records:
            if isinstance(record, Result) and record.kind is IntentKind.ACTION:
                pending = record  # written together with the step that follows it
            elif pending is not None:
                writes.append((pending, record))
                pending = None
            else:
                writes.append((record,))
        assert len(writes) == SIX_STEP_WRITES
        tool_calls = tuple(result_id for _, result_id in ledger.calls)
        _REFERENCE.append(Reference(result, tuple(writes), tool_calls))
    return _REFERENCE[0]


class Subject:
    """One run of the six-step script: its ledger of tool calls and its model's calls."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.tools = make_tools(self.ledger, replay=REPLAY)
        self.model = ScriptedModelClient(six_step_script())

    def run(self, store: Store) -> Awaitable[RunResult]:
        return run(definition(store, model=self.model), self.request())

    def resume(self, store: Store) -> Awaitable[RunResult]:
        return resume(definition(store, model=self.model), self.request())

    def request(self) -> Any:
        return request("r", self.tools, model_replay=REPLAY)

    def effects(self) -> tuple[list[str], list[int]]:
        return ([rid for _, rid in self.ledger.calls], [c.call_index for c in self.model.calls])


async def check_failed_then_recover(
    subject: Subject,
    error: StoreError,
    failed: Store,
    open_store: Callable[[], Store],
    *,
    k: int,
    landed: int,
) -> None:
    """The common checks after a store failed at write ``k`` (``landed`` writes are in).

    Item 1: the error names the run and chains its cause; a new store object reads a valid
    log holding exactly the writes that landed; a new store object resumes the run (or,
    when not even the first record landed, starts it) to the uninterrupted outcome.
    Item 2: the side effects that ran are exactly those whose intents had returned, and
    the failed store object refuses the run.
    """
    ref = await reference()
    assert error.run_id == "r"
    assert error.__cause__ is not None
    assert subject.effects() == ref.effects(k - 1)

    probe = Result(
        run_id="r", result_id="r:99:model", kind=IntentKind.MODEL_CALL, payload={"probe": True}
    )
    with pytest.raises(StoreError, match="earlier write"):
        await failed.write_result(probe)
    await _close(failed)

    reader = open_store()
    try:
        records = list((await reader.read_log("r")).records)
    finally:
        await _close(reader)
    assert kinds(records) == kinds(ref.records(landed))

    store = open_store()
    try:
        if landed == 0:
            # Not even the start landed: the run does not exist, and can be started anew.
            with pytest.raises(RunNotFound):
                await subject.resume(store)
            result = await subject.run(store)
        else:
            result = await subject.resume(store)
            assert result.resumed
        assert same_outcome(result, ref.result)
        final = (await store.read_log("r")).records
        assert kinds(final) == kinds(ref.records(SIX_STEP_WRITES))
        assert isinstance(final[-1], RunEnded)
    finally:
        await _close(store)


async def _close(store: Any) -> None:
    aclose = getattr(store, "aclose", None)
    if aclose is not None:
        await aclose()


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A directory for stores whose faults the tests inject themselves.

    A real device sync proves nothing here and costs most of the time, so the directory
    lives in a memory-backed file system when the machine offers one.
    """
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK | os.X_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="polyloop-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- 1 and 2: the JSON-lines store, faults from os.write and os.fsync ---------------------


def _is(fd: int, kind: Callable[[int], bool]) -> bool:
    try:
        return kind(os.fstat(fd).st_mode)
    except OSError:
        return False


class OsFault:
    """Makes one ``os.write`` or ``os.fsync`` call fail, counting only the store's calls.

    ``call`` is ``"write"`` (the ``number``-th write of a record to a regular file),
    ``"fsync"`` (the ``number``-th fsync of a regular file) or ``"dir-fsync"`` (the
    ``number``-th fsync of a directory). A full disk often first accepts part of a write
    and refuses the rest: with ``partial`` the failing write takes half of its bytes and
    the call that would complete it fails, leaving a torn line in the file.
    """

    def __init__(self, call: str, number: int, code: int, *, partial: bool = False) -> None:
        self.call, self.number, self.code, self.partial = call, number, code, partial
        self.counts = {"write": 0, "fsync": 0, "dir-fsync": 0}
        self.active = True
        self.fired = False
        self._refuse_next_write = False
        self._write, self._fsync = os.write, os.fsync

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "fsync", self.fsync)

    def _error(self) -> OSError:
        self.fired = True
        return OSError(self.code, os.strerror(self.code))

    def write(self, fd: int, data: Any) -> int:
        if self.active and _is(fd, stat.S_ISREG):
            if self._refuse_next_write:
                raise self._error()
            self.counts["write"] += 1
            if self.call == "write" and self.counts["write"] == self.number:
                if not self.partial:
                    raise self._error()
                self._refuse_next_write = True
                return self._write(fd, bytes(data[: len(data) // 2]))
        return self._write(fd, data)

    def fsync(self, fd: int) -> None:
        if self.active:
            call = "fsync" if _is(fd, stat.S_ISREG) else "dir-fsync"
            self.counts[call] += 1
            if self.call == call and self.counts[call] == self.number:
                raise self._error()
        self._fsync(fd)


JSONL_FAULTS = [
    *(
        pytest.param("write", k, errno.ENOSPC, True, id=f"write-ENOSPC-partial-{k}")
        for k in EVERY_WRITE
    ),
    *(pytest.param("write", k, errno.EIO, False, id=f"write-EIO-{k}") for k in EVERY_WRITE),
    *(
        pytest.param("fsync", k, code, False, id=f"fsync-{errno.errorcode[code]}-{k}")
        for k in BARRIER_WRITES
        for code in (errno.ENOSPC, errno.EIO)
    ),
    *(
        pytest.param("dir-fsync", 1, code, False, id=f"dir-fsync-{errno.errorcode[code]}-1")
        for code in (errno.ENOSPC, errno.EIO)
    ),
]


@pytest.mark.parametrize(("call", "k", "code", "partial"), every_point(JSONL_FAULTS))
async def test_jsonl_os_error_at_every_write_point(
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
    call: str,
    k: int,
    code: int,
    partial: bool,
) -> None:
    directory = scratch / "runs"
    directory.mkdir()  # so that the only directory sync is the one of start_run
    path = directory / f"{safe_name('r')}.jsonl"
    number = BARRIER_WRITES.index(k) + 1 if call == "fsync" else k
    fault = OsFault(call, number, code, partial=partial)
    fault.install(monkeypatch)
    subject = Subject()
    store = JsonlStore(directory)
    with pytest.raises(StoreError) as caught:
        await subject.run(store)
    fault.active = False
    assert fault.fired
    cause = caught.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == code
    content = path.read_bytes()
    if call == "write":
        # The refused record is not in the file; a partial one is an unterminated tail.
        if partial:
            assert content and not content.endswith(b"\n")
        else:
            assert content == b"" or content.endswith(b"\n")
        landed = k - 1
    else:
        landed = k  # the bytes reached the file; only their sync failed
    await check_failed_then_recover(
        subject, caught.value, store, lambda: JsonlStore(directory), k=k, landed=landed
    )


# -- 1 and 2: the SQLite store ------------------------------------------------------------

FULL = "database or disk is full"  # what SQLite reports when the OS says ENOSPC
IOERR = "disk I/O error"  # what SQLite reports when the OS says EIO


class SqliteFault:
    """Which write transaction fails, where in it, and with which of SQLite's errors.

    ``stage`` is ``"statement"`` (the ``INSERT``: SQLite may need to grow the file, and a
    full disk refuses), ``"commit"`` (the ``COMMIT``, where the write-ahead log is
    written and synced, fails and nothing lands) or ``"after-commit"`` (the commit
    reached the disk but the call still reports the error, as when a sync reports a
    failure for data that was in fact written). ``stage="read"`` fails the
    ``number``-th query of a run's rows.
    """

    def __init__(self, stage: str, number: int, message: str) -> None:
        self.stage, self.number, self.message = stage, number, message
        self.active = True
        self.fired = False
        self.writes = self.reads = 0
        self.current: int | None = None

    def error(self) -> sqlite3.OperationalError:
        self.fired = True
        return sqlite3.OperationalError(self.message)


class FaultyConnection(sqlite3.Connection):
    """A connection that fails where the fault says; used through ``connect(factory=...)``.

    Python's ``sqlite3`` offers no way below the connection (no custom VFS, no hook on
    SQLite's own reads, writes and syncs), so the nearest reachable point to the OS is
    the statement during which SQLite does the I/O, raising the very error SQLite raises
    when the OS reports ``ENOSPC`` (``SQLITE_FULL``) or ``EIO`` (``SQLITE_IOERR``). The
    "after-commit" stage covers what a failure below SQLite cannot rule out: the data
    reached the disk even though the call failed.
    """

    fault: SqliteFault | None = None

    def executemany(self, statement: str, rows: Any, /) -> sqlite3.Cursor:
        fault = self.fault
        if fault is not None and fault.active and statement.startswith("INSERT INTO records"):
            fault.writes += 1
            fault.current = fault.writes
            if fault.stage == "statement" and fault.writes == fault.number:
                raise fault.error()
        return super().executemany(statement, rows)

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        fault = self.fault
        if fault is None or not fault.active:
            return super().execute(statement, parameters)
        if (
            statement == "COMMIT"
            and fault.current == fault.number
            and fault.stage in ("commit", "after-commit")
        ):
            fault.current = None
            if fault.stage == "commit":
                raise fault.error()
            cursor = super().execute(statement, parameters)
            if fault.stage == "after-commit":
                raise fault.error()
            return cursor
        if statement.startswith("SELECT seq, kind, body FROM records"):
            fault.reads += 1
            if fault.stage == "read" and fault.reads == fault.number:
                raise fault.error()
        return super().execute(statement, parameters)


def install_sqlite_fault(monkeypatch: pytest.MonkeyPatch, fault: SqliteFault) -> None:
    """Make the SQLite store's connections faulty (only those: the patch is on the
    module that opens them)."""

    class Sqlite3:
        def __getattr__(self, name: str) -> Any:
            return getattr(sqlite3, name)

        @staticmethod
        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = sqlite3.connect(*args, factory=FaultyConnection, **kwargs)
            assert isinstance(conn, FaultyConnection)
            conn.fault = fault
            return conn

    monkeypatch.setattr(sqlite_sql, "sqlite3", Sqlite3())


SQLITE_FAULTS = [
    pytest.param(stage, message, k, id=f"{stage}-{'FULL' if message == FULL else 'IOERR'}-{k}")
    for stage, message in (
        ("statement", FULL),
        ("statement", IOERR),
        ("commit", FULL),
        ("commit", IOERR),
        ("after-commit", IOERR),
    )
    for k in EVERY_WRITE
]


@pytest.mark.parametrize(("stage", "message", "k"), every_point(SQLITE_FAULTS))
async def test_sqlite_io_error_at_every_write_point(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, stage: str, message: str, k: int
) -> None:
    path = scratch / "runs.db"
    fault = SqliteFault(stage, k, message)
    install_sqlite_fault(monkeypatch, fault)
    subject = Subject()
    store = SqliteStore(path)
    with pytest.raises(StoreError) as caught:
        await subject.run(store)
    fault.active = False
    assert fault.fired
    cause = caught.value.__cause__
    assert isinstance(cause, sqlite3.OperationalError) and str(cause) == message
    landed = k if stage == "after-commit" else k - 1
    await check_failed_then_recover(
        subject, caught.value, store, lambda: SqliteStore(path), k=k, landed=landed
    )


# -- 1: the PostgreSQL store, the writer's session terminated ---------------------------------


@pytest.fixture
def pg_place(postgres_shared: str, postgres_schemas: Callable[[], str]) -> tuple[str, str]:
    """A database URL and a schema of this test's own in it."""
    return postgres_shared, postgres_schemas()


async def _query(conninfo: str, query: str | sql.Composed, *params: object) -> list[Any]:
    def fetch() -> list[Any]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            cursor = conn.execute(query, params)
            return cursor.fetchall() if cursor.description else []

    return await anyio.to_thread.run_sync(fetch)


_WRITER = (
    "SELECT a.pid FROM pg_stat_activity a WHERE a.datname = current_database()"
    " AND a.application_name = 'polyloop-writer'"
)


async def _terminate_writer(conninfo: str, schema: str, *, stalled: bool) -> None:
    """End the writer session (once it stalls, if asked); the test has only one."""
    query = _WRITER + (" AND a.wait_event = 'PgSleep'" if stalled else "")
    with anyio.fail_after(20):
        while True:
            rows = await _query(conninfo, query)
            if rows:
                break
            await anyio.sleep(0.02)
    [(pid,)] = rows
    assert await _query(conninfo, "SELECT pg_terminate_backend(%s, 10000)", pid) == [(True,)]


class TerminatingStore(FaultyStore):
    """Passes every call to a ``PostgresStore``; at write ``k`` the writer session dies.

    ``mode="before"``: the writer's idle session is terminated just before write ``k``
    is sent. ``mode="inside"``: a trigger makes the first row of write ``k`` sleep inside
    its transaction, and the session is terminated while it sleeps, so the connection
    drops in the middle of the transaction. Claims, releases and reads are not writes
    (:class:`FaultyStore` passes them on uncounted), and every write goes on.
    """

    def __init__(self, inner: PostgresStore, place: tuple[str, str], k: int, mode: str) -> None:
        super().__init__(inner, fail_after_writes=k - 1)  # the writes before k go on as they are
        self.postgres, self.place, self.k, self.mode = inner, place, k, mode

    async def aclose(self) -> None:
        await self.postgres.aclose()

    async def _write(self, method: Callable[..., Awaitable[None]], *args: Any) -> None:
        self.writes += 1
        if self.writes != self.k:
            await method(*args)
            return
        conninfo, schema = self.place
        if self.mode == "before":
            await _terminate_writer(conninfo, schema, stalled=False)
            await method(*args)
            return
        failure: StoreError | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: _terminate_writer(conninfo, schema, stalled=True))
            try:
                await method(*args)
            except StoreError as exc:
                failure = exc
        if failure is not None:
            raise failure


async def _stall_at(place: tuple[str, str], seq: int) -> None:
    """Install a trigger that stalls the insert of row ``seq`` the first time it is tried
    (a sequence counts the tries: it is not rolled back with the transaction)."""
    conninfo, schema = place
    name = sql.Identifier(schema)
    await _query(conninfo, sql.SQL("CREATE SEQUENCE {}.stalls").format(name))
    await _query(
        conninfo,
        sql.SQL(
            "CREATE FUNCTION {}.stall() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.seq = {} AND nextval({}) = 1 THEN PERFORM pg_sleep(60); END IF;"
            " RETURN NEW; END $$"
        ).format(name, sql.Literal(seq), sql.Literal(f'"{schema}".stalls')),
    )
    await _query(
        conninfo,
        sql.SQL(
            "CREATE TRIGGER stall BEFORE INSERT ON {}.records"
            " FOR EACH ROW EXECUTE FUNCTION {}.stall()"
        ).format(name, name),
    )


@pytest.mark.parametrize(
    ("mode", "k"),
    every_point(
        [
            *(("inside", k) for k in (1, 2, 3, 4, 5, 13, 25)),
            *(("before", k) for k in (2, 10, 25)),
        ]
    ),
)
async def test_postgres_writer_session_dies_at_a_write_and_the_run_goes_on(
    pg_place: tuple[str, str], mode: str, k: int
) -> None:
    """The write that met the dead session is looked up on a new connection by its run's
    row, and sent again since it did not land (research record 0035): the run ends as the
    uninterrupted one did, each record and each effect once."""
    conninfo, schema = pg_place
    ref = await reference()
    if mode == "inside":
        async with PostgresStore(conninfo, schema=schema):
            pass  # creates the schema, so that the trigger has a table
        await _stall_at(pg_place, len(ref.records(k - 1)))
    subject = Subject()
    store = TerminatingStore(PostgresStore(conninfo, schema=schema), pg_place, k, mode)
    try:
        result = await subject.run(store)
    finally:
        await store.aclose()
    assert store.writes == SIX_STEP_WRITES
    assert same_outcome(result, ref.result)
    assert subject.effects() == ref.effects(SIX_STEP_WRITES)
    async with PostgresStore(conninfo, schema=schema) as reader:
        records = (await reader.read_log("r")).records
    assert kinds(records) == kinds(ref.records(SIX_STEP_WRITES))


# -- 3: faults during recovery ------------------------------------------------------------


class FailingFiles(OsFileOps):
    """The real file operations, except that one kind of call fails with ``EIO``."""

    __slots__ = ("active", "calls", "failing")

    def __init__(self, failing: str) -> None:
        self.failing = failing
        self.active = True
        self.calls = 0

    def _maybe_fail(self, name: str) -> None:
        if self.active and name == self.failing:
            self.calls += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def read(self, fd: int, size: int) -> bytes:
        self._maybe_fail("read")
        return super().read(fd, size)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._maybe_fail("pread")
        return super().pread(fd, size, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        self._maybe_fail("ftruncate")
        super().ftruncate(fd, length)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)


async def crashed_with_torn_tail(directory: Path, k: int, subject: Subject) -> Path:
    """A run whose process died after write ``k`` in the middle of writing write ``k+1``."""
    ref = await reference()
    async with JsonlStore(directory) as first:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(first, fail_after_writes=k), model=subject.model),
                subject.request(),
            )
    path = directory / f"{safe_name('r')}.jsonl"
    nxt = ref.writes[k]
    line = dumps(nxt[0]) if len(nxt) == 1 else f"[{dumps(nxt[0])},{dumps(nxt[1])}]"
    with path.open("ab") as file:
        file.write(line.encode()[: len(line) // 2])
    return path


async def clean_recovery(directory: Path, subject: Subject) -> tuple[RunResult, list[Any]]:
    async with JsonlStore(directory) as store:
        result = await subject.resume(store)
        return result, list((await store.read_log("r")).records)


@pytest.mark.parametrize("k", [3, 4, 5, 24])
@pytest.mark.parametrize("failing", ["read", "pread", "ftruncate", "fsync"])
async def test_a_fault_during_recovery_fails_cleanly_and_a_retry_recovers(
    scratch: Path, failing: str, k: int
) -> None:
    """``pread``: finding the torn tail; ``ftruncate``: cutting it off; ``fsync``: syncing
    the cut (after which the file is already shorter), all three when ``resume`` claims
    the run; ``read``: reading the log, once the claim has cut the tail and synced the cut."""
    control_subject, subject = Subject(), Subject()
    control = await crashed_with_torn_tail(scratch / "control", k, control_subject)
    path = await crashed_with_torn_tail(scratch / "faulty", k, subject)
    expected, expected_records = await clean_recovery(scratch / "control", control_subject)
    assert control.read_bytes().endswith(b"\n")

    ref = await reference()
    before = path.read_bytes()
    effects = subject.effects()
    files = FailingFiles(failing)
    async with jsonl_store_on(scratch / "faulty", files) as store:
        with pytest.raises(StoreError) as caught:
            await subject.resume(store)
    assert files.calls == 1
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.EIO
    # The failed attempt ran nothing: the claim (where the torn tail is cut) and the
    # reading of the log both come before the recovery replays or runs anything.
    assert subject.effects() == effects
    after = path.read_bytes()
    if failing in ("fsync", "read"):
        # Cut at the claim: not yet synced (fsync), or synced before the read failed.
        assert after == before[: before.rfind(b"\n") + 1]
    else:
        assert after == before
    async with JsonlStore(scratch / "faulty") as reader:
        assert kinds((await reader.read_log("r")).records) == kinds(ref.records(k))

    # The second attempt, fault cleared, ends where one clean recovery ends.
    result, records = await clean_recovery(scratch / "faulty", subject)
    assert same_outcome(result, expected)
    assert kinds(records) == kinds(expected_records)
    assert set(subject.effects()[0]) == set(control_subject.effects()[0])


@pytest.mark.parametrize("k", [3, 4, 24])
async def test_sqlite_read_error_during_recovery_fails_cleanly(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    path = scratch / "runs.db"
    subject = Subject()
    async with SqliteStore(path) as first:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(first, fail_after_writes=k), model=subject.model),
                subject.request(),
            )
    fault = SqliteFault("read", 1, IOERR)
    install_sqlite_fault(monkeypatch, fault)
    effects = subject.effects()
    async with SqliteStore(path) as store:
        with pytest.raises(StoreError) as caught:
            await subject.resume(store)
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        assert subject.effects() == effects
        fault.active = False
        # A read failure does not fail the run: the same store object recovers it.
        result = await subject.resume(store)
    assert same_outcome(result, (await reference()).result)


@pytest.mark.parametrize("kind", ["jsonl", "sqlite"])
@pytest.mark.parametrize("k", [4, 24])
async def test_recovery_twice_is_idempotent(scratch: Path, kind: str, k: int) -> None:
    def open_store() -> Store:
        if kind == "jsonl":
            return JsonlStore(scratch / "runs")
        return SqliteStore(scratch / "runs.db")

    def snapshot() -> bytes:
        if kind == "jsonl":
            return (scratch / "runs" / f"{safe_name('r')}.jsonl").read_bytes()
        with closing(sqlite3.connect(scratch / "runs.db")) as conn:
            rows = conn.execute("SELECT run_id, seq, kind, body FROM records ORDER BY seq")
            return repr(rows.fetchall()).encode()

    subject = Subject()
    first = open_store()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(first, fail_after_writes=k), model=subject.model),
            subject.request(),
        )
    await _close(first)
    store = open_store()
    try:
        recovered = await subject.resume(store)
        assert recovered.resumed
        content, effects = snapshot(), subject.effects()
        again_same = await subject.resume(store)  # through the same store object
    finally:
        await _close(store)
    other = open_store()
    try:
        again_new = await subject.resume(other)  # and through a new one
    finally:
        await _close(other)
    for again in (again_same, again_new):
        assert same_outcome(again, recovered)
    assert snapshot() == content  # nothing written
    assert subject.effects() == effects  # nothing run
