"""The SQLite store: every run in one database file, each write one durable transaction.

Schema (created on first use with idempotent DDL)::

    meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)
        ('format', 'polyloop/1'): the record format the database was created with.
    records(run_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
            body TEXT NOT NULL, PRIMARY KEY (run_id, seq))

A row is one record. ``seq`` counts the records of one run from 0 in write order (the
``RunStarted`` record is row 0), ``kind`` is the record kind (``run_started``,
``intent``, ``result``, ``step``, ``run_ended``) so that plain SQL can filter on it, and
``body`` is the record as :func:`polyloop.serialization.dumps` writes it, the same line a
JSON-lines log would hold. The body is the truth: readers decode it and check that it
agrees with its row (same run, same kind). A run id that cannot be stored as SQLite text
(it holds a lone surrogate) is stored as the BLOB of its ``surrogatepass`` UTF-8 bytes,
which no text id can equal. Every statement binds its values; no SQL is built from data.

Durability. The database runs in WAL mode with ``synchronous=FULL``: a commit returns
only after the write-ahead log is flushed to disk, so every write, not only the intent
barriers, survives a crash of the process and of the machine. The store reads both
settings back after setting them and refuses a database that does not take them (an
in-memory database, a file system on which WAL does not work). Each write is one
``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction; ``write_step`` puts the action result and
the step record in the same transaction, result first, so both land or neither does.

Writers. A store object takes a run's writer lock at its first write for that run: a
``flock`` on a small file in the directory next to the database (``<file>.locks/``, one
file per run, named by :func:`~polyloop.stores._common.safe_name`). It keeps the lock
until ``end_run`` for that run, until :meth:`SqliteStore.aclose`, or until its process
dies. Any other store object, in this process or another, gets ``RunLocked``. Readers
never take the lock. A failed write (``sqlite3.Error``, ``OSError``) stops every later
write of that run through the same store object until a new one is opened.

Threads. ``sqlite3`` connections must not be used by two threads at once. A store object
owns one connection (opened with ``check_same_thread=False``) and guards it, with the
writer locks and the failed-run set, by one ``threading.Lock``; every call runs in a
worker thread (``anyio.to_thread.run_sync``), so the event loop never blocks and the
store works under asyncio and Trio alike. Writes of different runs through one store
object therefore queue on that lock; other processes wait for the database's own write
lock for up to ``busy_timeout``.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread

from polyloop.serialization import dumps, loads
from polyloop.stores._common import (
    FORMAT,
    LockFile,
    WriterState,
    check_format,
    fsync_directory,
    safe_name,
)
from polyloop.types import (
    CorruptLog,
    Intent,
    JSONValue,
    PolyLoopError,
    Record,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLog,
    RunStarted,
    StepRecord,
    StoreError,
)

__all__ = ("SqliteStore",)

# One row to insert: (kind, body).
_Row = tuple[str, str]
# How the run id is bound: text, or the bytes of an id that is not valid UTF-8 text.
_Key = str | bytes

BUSY_TIMEOUT_S = 30.0
_SYNCHRONOUS_FULL = 2

_KIND: dict[type[Any], str] = {
    RunStarted: "run_started",
    Intent: "intent",
    Result: "result",
    StepRecord: "step",
    RunEnded: "run_ended",
}

_DDL = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS records ("
    " run_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, body TEXT NOT NULL,"
    " PRIMARY KEY (run_id, seq))",
)
_SET_FORMAT = "INSERT OR IGNORE INTO meta (key, value) VALUES ('format', ?)"
_GET_FORMAT = "SELECT value FROM meta WHERE key = 'format'"
_LAST_SEQ = "SELECT MAX(seq) FROM records WHERE run_id = ?"
_INSERT = "INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)"
_SELECT_RUN = "SELECT seq, kind, body FROM records WHERE run_id = ? ORDER BY seq"
_SELECT_RUN_IDS = "SELECT run_id FROM records WHERE seq = 0 ORDER BY rowid"


def _row(record: Record) -> _Row:
    body = dumps(record)  # refuses anything that is not a record
    return _KIND[type(record)], body


def _key(run_id: str) -> _Key:
    """The value bound for ``run_id``: the text itself when SQLite can hold it."""
    if run_id.isascii():
        return run_id
    try:
        run_id.encode("utf-8")
    except UnicodeEncodeError:
        return run_id.encode("utf-8", "surrogatepass")
    return run_id


def _run_id_of(key: object) -> str:
    if isinstance(key, bytes):
        return key.decode("utf-8", "surrogatepass")
    return str(key)


class SqliteStore:
    """Keeps runs in one SQLite database file (WAL, ``synchronous=FULL``).

    ``path`` names the database file; missing parent directories are created. Writer
    locks live in the sibling directory ``<path>.locks``. The store is an async context
    manager; :meth:`aclose` releases every writer lock it holds and closes the
    connection. Runs survive the store object, the process and the machine: a new store
    object on the same file (or on a copy moved elsewhere) reads and resumes them.
    """

    __slots__ = ("_conn", "_held", "_locks_dir", "_path", "_state")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(os.fspath(path))
        self._locks_dir = self._path.with_name(self._path.name + ".locks")
        self._conn: sqlite3.Connection | None = None
        self._held: dict[str, LockFile] = {}
        self._state = WriterState()

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the path."""
        return {"kind": "sqlite", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def start_run(self, record: RunStarted) -> None:
        """Write the run's first record; ``RunAlreadyExists`` if the run has any row.

        Cancellation: the worker thread finishes the transaction (committed or rolled
        back) before the cancellation is delivered.
        """
        await self._write(record.run_id, [record], start=True)

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent; it is on disk when this returns.

        Cancellation: the worker thread finishes the transaction before the cancellation
        is delivered, so a cancelled call may still have written the intent.
        """
        await self._write(intent.run_id, [intent])

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call in its own transaction.

        Cancellation: the worker thread finishes the transaction before the cancellation
        is delivered.
        """
        await self._write(result.run_id, [result])

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record in one transaction.

        Cancellation: the worker thread finishes the transaction before the cancellation
        is delivered; both rows are there afterwards, or neither.
        """
        if action_result is None:
            await self._write(step.run_id, [step])
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(step.run_id, [action_result, step])

    async def end_run(self, record: RunEnded) -> None:
        """Write the run's end record, then release the run's writer lock.

        Cancellation: the worker thread finishes the transaction and the release before
        the cancellation is delivered.
        """
        await self._write(record.run_id, [record], end=True)

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id`` in write order; empty if the run has no row.

        Raises ``CorruptLog`` (naming the row) for a body that does not decode or does
        not belong to its row, and ``SchemaMajorMismatch`` for another record format.

        Cancellation: the worker thread finishes the query and decoding before the
        cancellation is delivered.
        """
        records = await anyio.to_thread.run_sync(self._read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def run_ids(self) -> tuple[str, ...]:
        """The id of every run in the database, in the order the runs started.

        Cancellation: the worker thread finishes the query before the cancellation is
        delivered.
        """
        return await anyio.to_thread.run_sync(self._select_run_ids)

    async def aclose(self) -> None:
        """Release every writer lock and close the connection. Idempotent.

        Cancellation: closing runs shielded, so it completes even in a cancelled scope.
        """
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._close)

    async def __aenter__(self) -> SqliteStore:
        """Open and check the database now rather than at first use.

        Cancellation: the worker thread finishes opening before the cancellation is
        delivered.
        """
        await anyio.to_thread.run_sync(self._open_now)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the store (see :meth:`aclose`).

        Cancellation: as for :meth:`aclose`, closing completes in a cancelled scope.
        """
        await self.aclose()

    def __repr__(self) -> str:
        return f"SqliteStore({os.fspath(self._path)!r})"

    # -- writing (worker thread) ------------------------------------------------------------

    async def _write(
        self, run_id: str, records: Sequence[Record], *, start: bool = False, end: bool = False
    ) -> None:
        rows = [_row(record) for record in records]
        await anyio.to_thread.run_sync(self._write_rows, run_id, rows, start, end)

    def _write_rows(self, run_id: str, rows: Sequence[_Row], start: bool, end: bool) -> None:
        """Lock the run, then insert ``rows`` in one transaction; holds the store mutex."""
        with self._state.mutex:
            self._state.check_writable(run_id)
            held_before = run_id in self._held
            try:
                conn = self._connection(run_id)
                self._take_lock(run_id)
                _insert(conn, run_id, rows, start=start)
            except PolyLoopError:
                # A refusal (locked, exists, never started, wrong format) writes nothing
                # and leaves no lock behind that this write took.
                if not held_before:
                    self._release(run_id)
                raise
            except (sqlite3.Error, OSError) as exc:
                raise self._state.fail(run_id, exc) from exc
            if end:
                self._release(run_id)

    def _take_lock(self, run_id: str) -> None:
        if run_id in self._held:
            return
        self._locks_dir.mkdir(parents=True, exist_ok=True)
        lock = LockFile(self._locks_dir / f"{safe_name(run_id)}.lock", run_id)
        lock.acquire()
        self._held[run_id] = lock

    def _release(self, run_id: str) -> None:
        lock = self._held.pop(run_id, None)
        if lock is not None:
            lock.release()

    # -- reading (worker thread) ------------------------------------------------------------

    def _read(self, run_id: str) -> tuple[Record, ...]:
        """Query under the store mutex, decode after releasing it."""
        return self._decode_rows(run_id, self._select_run(run_id))

    def _select_run(self, run_id: str) -> list[tuple[Any, ...]]:
        with self._state.mutex, self._reading(run_id):
            return self._connection(run_id).execute(_SELECT_RUN, (_key(run_id),)).fetchall()

    def _select_run_ids(self) -> tuple[str, ...]:
        with self._state.mutex, self._reading(None):
            rows = self._connection(None).execute(_SELECT_RUN_IDS).fetchall()
        return tuple(_run_id_of(key) for (key,) in rows)

    @contextmanager
    def _reading(self, run_id: str | None) -> Iterator[None]:
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {type(exc).__name__}: {exc}", run_id=run_id) from exc

    def _decode_rows(self, run_id: str, rows: Sequence[tuple[Any, ...]]) -> tuple[Record, ...]:
        return tuple(self._decode_row(run_id, seq, kind, body) for seq, kind, body in rows)

    def _decode_row(self, run_id: str, seq: int, kind: object, body: object) -> Record:
        location = f"{self._path.name}: run row seq {seq}"
        if not isinstance(body, (str, bytes)):
            raise CorruptLog(f"the body is {type(body).__name__}, not text", run_id=run_id,
                             location=location)
        try:
            record = loads(body, location=location)
        except CorruptLog as exc:
            if exc.run_id is not None:
                raise
            raise CorruptLog(exc.reason, run_id=run_id, location=location) from exc
        if record.run_id != run_id:
            raise CorruptLog(f"the row holds a record of run {record.run_id!r}",
                             run_id=run_id, location=location)
        if _KIND[type(record)] != kind:
            raise CorruptLog(f"the row says {kind!r} but holds a {_KIND[type(record)]!r} record",
                             run_id=run_id, location=location)
        return record

    # -- the connection (worker thread, store mutex held) ---------------------------------

    def _connection(self, run_id: str | None) -> sqlite3.Connection:
        """The open connection, opening and checking the database on first use."""
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)
        if self._conn is None:
            self._conn = self._open(run_id)
        return self._conn

    def _open(self, run_id: str | None) -> sqlite3.Connection:
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            created = not self._path.exists()
            conn = sqlite3.connect(
                self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                check_same_thread=False,
            )
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"cannot open {self._path.name}: {exc}", run_id=run_id) from exc
        try:
            _configure(conn, self._path.name, run_id)
            _create_schema(conn)
            _check_format(conn, self._path.name, run_id)
            if created:
                fsync_directory(self._path.parent)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, (sqlite3.Error, OSError)) and not isinstance(exc, PolyLoopError):
                raise StoreError(f"cannot open {self._path.name}: {exc}",
                                 run_id=run_id) from exc
            raise
        return conn

    def _open_now(self) -> None:
        with self._state.mutex, self._reading(None):
            self._connection(None)

    def _close(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            for run_id in list(self._held):
                self._release(run_id)
            conn, self._conn = self._conn, None
            if conn is not None:
                try:
                    conn.close()
                except sqlite3.Error as exc:
                    raise StoreError(f"closing {self._path.name} failed: {exc}") from exc


def _configure(conn: sqlite3.Connection, name: str, run_id: str | None) -> None:
    """Switch to WAL with ``synchronous=FULL`` and make sure the database took both."""
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(
            f"{name}: SQLite refused WAL journal mode (it reports {mode!r}); the store needs "
            f"a database file on a local file system, not an in-memory database",
            run_id=run_id,
        )
    conn.execute("PRAGMA synchronous=FULL")
    level = conn.execute("PRAGMA synchronous").fetchone()[0]
    if level != _SYNCHRONOUS_FULL:
        raise StoreError(
            f"{name}: SQLite refused synchronous=FULL (it reports {level!r})", run_id=run_id
        )


def _create_schema(conn: sqlite3.Connection) -> None:
    with _transaction(conn):
        for statement in _DDL:
            conn.execute(statement)
        conn.execute(_SET_FORMAT, (FORMAT,))


def _check_format(conn: sqlite3.Connection, name: str, run_id: str | None) -> None:
    row = conn.execute(_GET_FORMAT).fetchone()
    recorded = row[0] if row is not None else None
    check_format(recorded, holder="database", run_id=run_id, location=f"{name}: meta format")


def _insert(
    conn: sqlite3.Connection, run_id: str, rows: Sequence[_Row], *, start: bool
) -> None:
    """Append ``rows`` to the run in one ``BEGIN IMMEDIATE`` transaction."""
    key = _key(run_id)
    with _transaction(conn):
        last = conn.execute(_LAST_SEQ, (key,)).fetchone()[0]
        if start and last is not None:
            raise RunAlreadyExists("the run already has records", run_id=run_id)
        if not start and last is None:
            raise StoreError("the run was never started in this database", run_id=run_id)
        first = 0 if last is None else last + 1
        conn.executemany(
            _INSERT, [(key, first + i, kind, body) for i, (kind, body) in enumerate(rows)]
        )


@contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; roll back if anything inside fails."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):  # the original error says more
                conn.execute("ROLLBACK")
        raise
