"""The SQLite store: every run in one database file, writes committed alone or in groups.

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

Durability. The database runs in WAL mode. The store sets ``synchronous=FULL`` when it
opens the database and reads both settings back, refusing a database that does not take
them (an in-memory database, a file system on which WAL does not work). What is on disk
when a call returns:

* ``start_run`` and ``write_intent`` (the barriers): their transaction committed with
  ``synchronous=FULL``, so the write-ahead log, with every frame before theirs, was
  flushed to disk (``fsync``) before the call returns. They survive a crash of the
  process and of the machine.
* ``write_result``, ``write_step`` and ``end_run``: their transaction committed, in the
  write-ahead log in the operating system's cache. When no barrier shares the commit it
  runs with ``synchronous=NORMAL`` (no ``fsync``): the rows survive a crash of the
  process, and a machine crash can lose them, but only as a suffix of the log, since the
  next barrier's ``fsync`` flushes them first and SQLite replays the log only up to its
  first damaged frame. Recovery already handles such a log (an open intent, or a run
  whose stop is decided again from the same records).

Every transaction sets the level it needs before its ``BEGIN``, so the level a
connection was left at never decides a commit; each connection remembers the level it
was last set to and issues the pragma only when it changes (SQLite refuses it inside a
transaction). ``write_step`` puts the action result and the step record in one
transaction (inside one savepoint when the commit is shared), result first, so both land
or neither does.

Runs. A third table, ``runs(run_id TEXT PRIMARY KEY, next_seq INTEGER, finished
INTEGER, updated_at REAL)`` with the index ``runs_unfinished`` (only the rows whose run
has not finished), holds one row per run: its next ``seq``, whether its log ends with a
final end record, and when it was last written (seconds since the epoch). Every write
changes the row in its own transaction, moving it on only from the ``seq`` the writer
expects and only while the run has not finished: a write the row does not expect is
rolled back whole. A database from before this table gets it, filled from its records,
when a store object first opens it.

Writers. A store object becomes a run's writer with ``claim_run``: an exclusive ``flock``
on a small file next to the database (``<file>.locks/``, named by
:func:`~polyloop.stores._common.safe_name`), which exists only while the run is claimed.
The claim then reads the run's row, and the store keeps the run's next ``seq`` in memory
from there. It holds the claim until ``end_run`` for that run, ``release_run``,
:meth:`SqliteStore.aclose`, or until its process dies. Every write needs the claim; any
other store object, in this process or another, gets ``RunLocked``. Readers never take
the lock. A failed write (``sqlite3.Error``, ``OSError``) stops every later write of
that run through the same store object until a new one is opened.

Threads. ``sqlite3`` connections must not be used by two threads at once. A store object
owns two connections to its database (opened together, with ``check_same_thread=False``)
and guards both, with the writer locks, the ``seq`` counters and the failed-run set, by
one ``threading.Lock`` (the store mutex), so at most one of them is in use at a time.
They differ only in how long they wait for another connection's write lock: the worker
connection (reads, shared commits, opening) waits up to ``BUSY_TIMEOUT_S``; the inline
connection never waits. Each keeps its busy timeout for good, so a write costs no
statement to switch it. A write takes one of two paths (see
:mod:`polyloop.stores._batching`):

* inline, on the event loop's own thread, with no thread hop, on the inline connection:
  only when the store writes a single run, its recent ``FULL`` commits were quick, no
  group commit is running or waiting, and the store mutex is free at once. If another
  connection holds the database's write lock, ``BEGIN IMMEDIATE`` reports it at once and
  the write takes the other path instead of blocking the event loop.
* a group commit otherwise, on the worker connection: writes of any runs that wait at
  the same moment share one ``BEGIN IMMEDIATE`` ... ``COMMIT`` in a worker thread, one
  savepoint per write, so a refused write (``RunAlreadyExists``, ``RunLocked``, a run
  never started, ended or failed) rolls back alone and the others commit. A failed ``COMMIT``
  fails every write in it and each of their runs.

Reads always run in a worker thread. ``SqliteStore(path, _group_commit=False)`` (private,
for the benchmarks' baseline) gives every write its own ``FULL`` transaction in its own
worker-thread hop, with no inline path and no shared commits.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from polyloop.ports import StoredRun
from polyloop.stores._batching import GroupCommit, InlineSyncGate
from polyloop.stores._common import (
    FORMAT,
    LockFile,
    WriterState,
    claim_in_thread,
    fsync_directory,
    safe_name,
)
from polyloop.stores._sqlite_sql import (
    ADVANCE_RUN,
    DESCRIBE_RUN,
    INSERT,
    INSERT_RUN,
    LIST_RUNS,
    LIST_UNFINISHED,
    SELECT_CLAIM,
    SELECT_RUN,
    SYNCHRONOUS_FULL,
    SYNCHRONOUS_NORMAL,
    Db,
    Write,
    begin,
    check_meta_format,
    configure,
    create_schema,
    decode_rows,
    params,
    record_row,
    rollback_quietly,
    run_id_of,
    run_key,
)
from polyloop.types import (
    Intent,
    JSONValue,
    PolyLoopError,
    Record,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLocked,
    RunLog,
    RunStarted,
    StepRecord,
    StoreError,
)

__all__ = ("SqliteStore",)

# One error (or None for success) per write of a commit.
_Outcome = list[BaseException | None]

BUSY_TIMEOUT_S = 30.0
# The inline connection never waits on the event loop's thread for another connection.
_NO_BUSY_WAIT = "PRAGMA busy_timeout=0"


@dataclass(eq=False, slots=True)
class _Claim:
    """This store object is a run's writer: its lock, and where the run's rows stand."""

    lock: LockFile
    next_seq: int  # 0: the run has no row yet
    finished: bool


@dataclass(eq=False, slots=True)
class _Batch:
    """What one transaction learns about its writes before it commits."""

    writes: Sequence[Write]
    errors: _Outcome
    next_seq: dict[str, int] = field(default_factory=dict)  # valid once committed

    @classmethod
    def of(cls, writes: Sequence[Write]) -> _Batch:
        return cls(writes, [None] * len(writes))


class SqliteStore:
    """Keeps runs in one SQLite database file (WAL; intents and starts fsync'd).

    ``path`` names the database file; missing parent directories are created. Writer
    locks live in the sibling directory ``<path>.locks``. The store is an async context
    manager; :meth:`aclose` releases every writer lock it holds and closes its
    connections. Runs survive the store object, the process and the machine: a new store
    object on the same file (or on a copy moved elsewhere) reads and resumes them.
    ``_group_commit=False`` (private, the benchmarks' baseline) commits every write alone
    with ``synchronous=FULL`` in its own worker-thread hop.
    """

    __slots__ = ("_claims", "_gate", "_group", "_inline", "_locks_dir", "_path", "_state",
                 "_worker")

    def __init__(self, path: str | os.PathLike[str], *, _group_commit: bool = True) -> None:
        self._path = Path(os.fspath(path))
        self._locks_dir = self._path.with_name(self._path.name + ".locks")
        # Two connections, opened together: one for worker threads, which may wait for
        # other processes, and one for inline writes, which never waits.
        self._worker: Db | None = None
        self._inline: Db | None = None
        self._claims: dict[str, _Claim] = {}
        self._state = WriterState()
        self._gate = InlineSyncGate()
        self._group = GroupCommit(self._commit_batch) if _group_commit else None

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the path."""
        return {"kind": "sqlite", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Take the run's writer lock and read where its rows stand.

        Raises ``RunLocked`` if another store object, here or in another process, or this
        one already, holds it.

        Cancellation: the worker thread finishes before the cancellation is delivered,
        and the claim is given up again if the call does not return.
        """
        await claim_in_thread(partial(self._claim, run_id), partial(self._unclaim, run_id))

    async def release_run(self, run_id: str) -> None:
        """Give up the claim (its lock file goes with it), writing nothing.

        Cancellation: the worker thread finishes before the cancellation is delivered.
        """
        if run_id in self._claims:
            await anyio.to_thread.run_sync(self._unclaim, run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the run's first record; ``RunAlreadyExists`` if the run has any row.

        A barrier: the row is fsync'd before this returns.

        Cancellation: a call made in an already cancelled scope writes nothing. An
        inline write completes before any cancellation is delivered; a write waiting to
        join a shared commit that has not started is withdrawn (nothing written) and the
        cancellation propagates; once its commit has started, the call waits for it to
        end, then the cancellation is delivered.
        """
        await self._write(Write(record.run_id, [record_row(record)], start=True, barrier=True))

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent; it is fsync'd to disk when this returns (a barrier).

        Cancellation: as for :meth:`start_run`; a cancelled call whose commit had
        started may still have written the intent.
        """
        await self._write(Write(intent.run_id, [record_row(intent)], barrier=True))

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call; committed, not necessarily fsync'd.

        Cancellation: as for :meth:`start_run`.
        """
        await self._write(Write(result.run_id, [record_row(result)]))

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record atomically; not fsync'd.

        Cancellation: as for :meth:`start_run`; both rows are there afterwards, or
        neither.
        """
        if action_result is None:
            await self._write(Write(step.run_id, [record_row(step)]))
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(Write(step.run_id, [record_row(action_result), record_row(step)]))

    async def end_run(self, record: RunEnded) -> None:
        """Write the run's end record (not fsync'd), then release the run's writer lock.

        Cancellation: as for :meth:`start_run`; the lock is released together with the
        commit of the record.
        """
        await self._write(Write(record.run_id, [record_row(record)], end=True,
                                final=record.is_final))

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id`` in write order; empty if the run has no row.

        Raises ``CorruptLog`` (naming the row) for a body that does not decode or does
        not belong to its row, and ``SchemaMajorMismatch`` for another record format.

        Cancellation: the worker thread finishes the query and decoding before the
        cancellation is delivered.
        """
        records = await anyio.to_thread.run_sync(self._read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run, in the order the runs started (only unfinished ones if asked).

        Read from the table of runs; the unfinished ones through an index that holds
        only them, so finished runs cost nothing. Whether a run is claimed is asked of
        the lock files that exist (one per claimed run).

        Cancellation: the worker thread finishes the query before the cancellation is
        delivered.
        """
        return await anyio.to_thread.run_sync(self._list, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no row.

        Cancellation: as for :meth:`list_runs`.
        """
        return await anyio.to_thread.run_sync(self._describe, run_id)

    async def aclose(self) -> None:
        """Release every writer lock and close both connections. Idempotent.

        A shared commit that is running completes first; writes that arrive later are
        refused. Cancellation: closing runs shielded, so it completes even in a
        cancelled scope.
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

    # -- choosing the path of a write (event loop) ----------------------------------------

    async def _write(self, write: Write) -> None:
        group = self._group
        if group is None:
            (error,) = await anyio.to_thread.run_sync(self._commit_batch, [write])
            if error is not None:
                raise error
        elif not (self._inline_allowed(write, group) and await self._write_inline(write)):
            await group.submit(write)

    def _inline_allowed(self, write: Write, group: GroupCommit[Write]) -> bool:
        # The runs this store writes, counting this one: a second run's first write must
        # not block the loop either. Opening the database (slow, and it may wait on other
        # processes) is left to a thread.
        writing = len(self._claims) + (write.run_id not in self._claims)
        return self._inline is not None and group.idle and self._gate.allows(writing)

    async def _write_inline(self, write: Write) -> bool:
        """Commit ``write`` on this thread; False if that would have to wait."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        if not self._state.mutex.acquire(blocking=False):
            return False  # a worker thread holds the connections
        try:
            outcome = self._commit_locked([write], inline=True)
        finally:
            self._state.mutex.release()
        if outcome is None:
            return False  # another connection holds the database's write lock
        if outcome[0] is not None:
            raise outcome[0]
        return True

    # -- committing (worker thread, or inline; store mutex held) ------------------------

    def _commit_batch(self, writes: Sequence[Write]) -> _Outcome:
        """One transaction for ``writes``, in a worker thread; one error or None each."""
        with self._state.mutex:
            outcome = self._commit_locked(writes, inline=False)
        assert outcome is not None  # only an inline commit gives up on a busy database
        return outcome

    def _commit_locked(self, writes: Sequence[Write], *, inline: bool) -> _Outcome | None:
        """Prepare every write, then commit the admitted ones together.

        Returns None, having written nothing, when ``inline`` and another connection
        holds the database's write lock.
        """
        batch = _Batch.of(writes)
        admitted = [i for i in range(len(writes)) if self._admit(batch, i)]
        if admitted:
            db = self._inline if inline else self._worker
            assert db is not None  # _admit opened it
            level = self._level_for(writes, admitted)
            if not self._transact(db, batch, admitted, level, inline=inline):
                return None
        self._settle(batch)
        return batch.errors

    def _admit(self, batch: _Batch, i: int) -> bool:
        """Refuse the write unless its run is claimed; make sure the connections are open."""
        write = batch.writes[i]
        try:
            self._state.check_writable(write.run_id)
            if write.run_id not in self._claims:
                raise RunLocked("this store object does not hold the run's claim",
                                run_id=write.run_id)
            self._connection(write.run_id)
        except PolyLoopError as exc:
            batch.errors[i] = exc
            return False
        return True

    def _level_for(self, writes: Sequence[Write], admitted: Sequence[int]) -> int:
        if self._group is None or any(writes[i].barrier for i in admitted):
            return SYNCHRONOUS_FULL
        return SYNCHRONOUS_NORMAL

    def _transact(
        self, db: Db, batch: _Batch, admitted: Sequence[int], level: int, *, inline: bool
    ) -> bool:
        """Insert the admitted writes in one transaction; False if it could not begin.

        A failure that ends the transaction fails every admitted write still standing.
        """
        conn = db.conn
        try:
            db.synchronous(level)
            if not begin(conn, inline=inline):
                return False
            for i in admitted:
                self._insert(conn, batch, i, savepoint=len(admitted) > 1)
            self._end(conn, level, committing=any(batch.errors[i] is None for i in admitted))
        except (sqlite3.Error, OSError) as exc:
            rollback_quietly(conn)
            batch.next_seq.clear()
            for i in admitted:
                if batch.errors[i] is None:
                    batch.errors[i] = self._state.fail(batch.writes[i].run_id, exc)
        return True

    def _insert(self, conn: sqlite3.Connection, batch: _Batch, i: int, *, savepoint: bool) -> None:
        """Insert one write's rows; a refused or failed write is undone alone.

        Raises only when the failure ended the whole transaction.
        """
        write = batch.writes[i]
        if savepoint:
            conn.execute("SAVEPOINT write")
        try:
            first = self._first_seq(batch, write)
            conn.executemany(INSERT, params(write, first))
            self._advance(conn, write, first)
        except PolyLoopError as exc:
            batch.errors[i] = exc
        except (sqlite3.Error, OSError) as exc:
            batch.errors[i] = self._state.fail(write.run_id, exc)
            if not conn.in_transaction:
                raise
        else:
            batch.next_seq[write.run_id] = first + len(write.rows)
            if savepoint:
                conn.execute("RELEASE write")
            return
        if savepoint:  # alone in its transaction, the write is undone by its rollback
            conn.execute("ROLLBACK TO write")
            conn.execute("RELEASE write")

    def _first_seq(self, batch: _Batch, write: Write) -> int:
        """The run's next ``seq``, from this batch or from the claim."""
        claim = self._claims[write.run_id]
        first = batch.next_seq.get(write.run_id, claim.next_seq)
        if write.start and first:
            raise RunAlreadyExists("the run already has records", run_id=write.run_id)
        if not write.start and not first:
            raise StoreError("the run was never started in this database", run_id=write.run_id)
        if claim.finished:
            raise StoreError("the run has ended; nothing may follow its end record",
                             run_id=write.run_id)
        return first

    def _advance(self, conn: sqlite3.Connection, write: Write, first: int) -> None:
        """Move the run's row on, in the write's transaction; refuse a write the row
        does not expect (the run ended, or someone else wrote to it)."""
        key, following = run_key(write.run_id), first + len(write.rows)
        if write.start:
            try:
                conn.execute(INSERT_RUN, (key, following, write.final, time.time()))
            except sqlite3.IntegrityError:
                raise RunAlreadyExists("the run already has a row", run_id=write.run_id) from None
            return
        moved = conn.execute(ADVANCE_RUN, (following, write.final, time.time(), key, first))
        if moved.rowcount != 1:
            raise StoreError("the run has ended, or its rows moved on without this writer",
                             run_id=write.run_id)

    def _end(self, conn: sqlite3.Connection, level: int, *, committing: bool) -> None:
        if committing:
            self._commit(conn, level)
        else:
            conn.execute("ROLLBACK")

    def _commit(self, conn: sqlite3.Connection, level: int) -> None:
        if level == SYNCHRONOUS_FULL:
            # The fsync: timed so that a slow disk sends writes back to worker threads.
            self._gate.timed(lambda: conn.execute("COMMIT"))
        else:
            conn.execute("COMMIT")

    def _settle(self, batch: _Batch) -> None:
        """After the commit: remember each run's next seq; an ended run gives up its claim."""
        for i, write in enumerate(batch.writes):
            if batch.errors[i] is None and write.end:
                self._unclaim_locked(write.run_id)
        for run_id, seq in batch.next_seq.items():
            claim = self._claims.get(run_id)
            if claim is not None:
                claim.next_seq = seq

    # -- claims (worker thread) -----------------------------------------------------------

    def _claim(self, run_id: str) -> None:
        with self._state.mutex:
            self._state.check_writable(run_id)
            if run_id in self._claims:
                raise RunLocked("this store object already holds the run's claim",
                                run_id=run_id)
            conn = self._connection(run_id)
            lock = self._lock_file(run_id)
            try:
                self._locks_dir.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except OSError as exc:
                if isinstance(exc, PolyLoopError):
                    raise
                raise StoreError(f"could not lock the run: {exc}", run_id=run_id) from exc
            try:
                # Read only once the lock is held: every earlier writer's rows are in.
                with self._reading(run_id):
                    row = conn.execute(SELECT_CLAIM, (run_key(run_id),)).fetchone()
            except BaseException:
                lock.release()
                raise
            self._claims[run_id] = _Claim(
                lock=lock,
                next_seq=0 if row is None else int(row[0]),
                finished=row is not None and bool(row[1]),
            )

    def _unclaim(self, run_id: str) -> None:
        with self._state.mutex:
            self._unclaim_locked(run_id)

    def _unclaim_locked(self, run_id: str) -> None:
        claim = self._claims.pop(run_id, None)
        if claim is not None:
            claim.lock.release()

    def _lock_file(self, run_id: str) -> LockFile:
        return LockFile(self._locks_dir / f"{safe_name(run_id)}.lock", run_id)

    # -- reading (worker thread) ------------------------------------------------------------

    def _read(self, run_id: str) -> tuple[Record, ...]:
        """Query under the store mutex, decode after releasing it."""
        return decode_rows(self._path.name, run_id, self._select_run(run_id))

    def _select_run(self, run_id: str) -> list[tuple[Any, ...]]:
        with self._state.mutex, self._reading(run_id):
            return self._connection(run_id).execute(SELECT_RUN, (run_key(run_id),)).fetchall()

    def _list(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        query = LIST_UNFINISHED if unfinished_only else LIST_RUNS
        with self._state.mutex, self._reading(None):
            rows = self._connection(None).execute(query).fetchall()
        try:
            locks = set(os.listdir(self._locks_dir))
        except FileNotFoundError:
            locks = set()
        return tuple(self._stored(row, locks) for row in rows)

    def _describe(self, run_id: str) -> StoredRun | None:
        with self._state.mutex, self._reading(run_id):
            row = self._connection(run_id).execute(DESCRIBE_RUN, (run_key(run_id),)).fetchone()
        return None if row is None else self._stored(row, None)

    def _stored(self, row: tuple[Any, ...], locks: set[str] | None) -> StoredRun:
        """A row of the runs table; ``locks`` names the lock files there are, if known."""
        key, finished, updated_at = row
        run_id = run_id_of(key)
        lock = self._lock_file(run_id).path
        claimed = (locks is None or lock.name in locks) and LockFile.held(lock)
        return StoredRun(run_id=run_id, finished=bool(finished), claimed=claimed,
                         updated_at=datetime.fromtimestamp(updated_at, UTC))

    @contextmanager
    def _reading(self, run_id: str | None) -> Iterator[None]:
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {type(exc).__name__}: {exc}", run_id=run_id) from exc

    # -- the connections (worker thread, store mutex held) --------------------------------

    def _connection(self, run_id: str | None) -> sqlite3.Connection:
        """The worker threads' connection, opening and checking the database on first use."""
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)
        if self._worker is None:
            self._worker, self._inline = self._open(run_id)
        return self._worker.conn

    def _open(self, run_id: str | None) -> tuple[Db, Db]:
        """Open and check the database: the worker threads' connection, then the inline one."""
        opened: list[sqlite3.Connection] = []
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            created = not self._path.exists()
            worker = self._connect(opened, run_id)
            create_schema(worker)
            check_meta_format(worker, self._path.name, run_id)
            if created:
                fsync_directory(self._path.parent)
            # Configured while it may still wait (SQLite may be recovering the log for
            # another process), then it never waits again.
            inline = self._connect(opened, run_id)
            inline.execute(_NO_BUSY_WAIT)
        except BaseException as exc:
            for conn in opened:
                with suppress(sqlite3.Error):  # the original error says more
                    conn.close()
            if isinstance(exc, (sqlite3.Error, OSError)) and not isinstance(exc, PolyLoopError):
                raise StoreError(f"cannot open {self._path.name}: {exc}",
                                 run_id=run_id) from exc
            raise
        return Db(worker), Db(inline)

    def _connect(self, opened: list[sqlite3.Connection], run_id: str | None) -> sqlite3.Connection:
        """Open one more connection (added to ``opened``) in WAL with ``synchronous=FULL``."""
        conn = sqlite3.connect(
            self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        opened.append(conn)
        configure(conn, self._path.name, run_id)
        return conn

    def _open_now(self) -> None:
        with self._state.mutex, self._reading(None):
            self._connection(None)

    def _close(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            for run_id in list(self._claims):
                self._unclaim_locked(run_id)
            dbs = [db for db in (self._inline, self._worker) if db is not None]
            self._inline = self._worker = None
            failures: list[sqlite3.Error] = []
            for db in dbs:
                try:
                    db.conn.close()
                except sqlite3.Error as exc:
                    failures.append(exc)
            if failures:
                error = failures[0]
                raise StoreError(f"closing {self._path.name} failed: {error}") from error
