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

Runs and owners. The table ``runs(run_id TEXT PRIMARY KEY, next_seq INTEGER, finished
INTEGER, updated_at REAL, owner TEXT, epoch INTEGER, stop_reason TEXT)``, with the
indexes ``runs_unfinished`` (only the rows whose run has not finished), ``runs_owned`` and
``runs_finished``, holds one row per run: its next ``seq``, whether its log ends with a
final end record (and its stop reason), when it was last written (seconds since the
epoch), which owner holds its claim and the claim's epoch. Every write changes the row in
its own transaction, moving it on only under the writer's epoch, from the ``seq`` it
expects, while the run has not finished; an end record gives the owner up. A write the
row does not expect is rolled back whole. ``owners(owner_id, description, lease_until,
started_at)`` holds the store objects that claim runs. A database from before these
tables or columns gets them (``runs`` filled from the records) when a store object first
opens it.

Writers. A store object becomes a run's writer with ``claim_run``, an owner with a lease
(see :mod:`polyloop.stores._lease`): at its first claim it takes a ``flock`` on
``<file>.owners/<owner id>.lock``, held while it lives, and writes its ``owners`` row. A
claim, in one ``BEGIN IMMEDIATE`` transaction, makes the run's row name this owner and
moves its epoch on, unless the row names a live owner (lease not ended, lock held):
``RunLocked``. The claim lasts until ``end_run``, ``release_run``, :meth:`SqliteStore.aclose`,
the end of the lease, or the death of the process. Readers never need a claim. A failed
write (``sqlite3.Error``, ``OSError``) stops every later write of that run through the
same store object until a new one is opened.

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

import logging
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
from anyio.lowlevel import EventLoopToken

from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit, InlineSyncGate
from polyloop.stores._common import (
    FORMAT,
    LockFile,
    WriterState,
    claim_in_thread,
    fsync_directory,
)
from polyloop.stores._lease import Lease, check_lease_s
from polyloop.stores._sqlite_sql import (
    ADVANCE_RUN,
    DESCRIBE_RUN,
    DROP_OWNER,
    DROP_UNSTARTED,
    EXPLAIN_REFUSAL,
    FREE_OWNED,
    FREE_RUN,
    INSERT,
    LIST_RUNS,
    LIST_UNFINISHED,
    NEW_RUN,
    OWNER_OF,
    PRUNABLE,
    PRUNE_ROWS,
    PRUNE_RUN,
    REGISTER_OWNER,
    RENEW_OWNER,
    SELECT_CLAIM,
    SELECT_RUN,
    STALE_OWNERS,
    SYNCHRONOUS_FULL,
    SYNCHRONOUS_NORMAL,
    TAKE_RUN,
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

logger = logging.getLogger("polyloop")

# One error (or None for success) per write of a commit.
_Outcome = list[BaseException | None]

BUSY_TIMEOUT_S = 30.0
# The inline connection never waits on the event loop's thread for another connection.
_NO_BUSY_WAIT = "PRAGMA busy_timeout=0"


# An owner row whose lease ended this long ago, holding no run, is removed.
_FORGET_OWNERS_AFTER_S = 86_400.0


@dataclass(eq=False, slots=True)
class _Claim:
    """This store object is a run's writer: its claim epoch, the lease generation it was
    taken under, and where the run's rows stand."""

    epoch: int
    generation: int
    next_seq: int  # 0: the run has no record yet
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
    owners' lock files live in the sibling directory ``<path>.owners`` (one per store
    object that claims runs, removed when it closes). ``lease_s`` is how long this store
    object's claims hold without a renewal; another process on the host may take over
    the runs of an owner whose lease ended or whose process died. The store is an async
    context
    manager; :meth:`aclose` releases every writer lock it holds and closes its
    connections. Runs survive the store object, the process and the machine: a new store
    object on the same file (or on a copy moved elsewhere) reads and resumes them.
    ``_group_commit=False`` (private, the benchmarks' baseline) commits every write alone
    with ``synchronous=FULL`` in its own worker-thread hop.
    """

    __slots__ = ("_claims", "_gate", "_group", "_inline", "_lease", "_owner_lock",
                 "_owners_dir", "_path", "_renewer", "_state", "_worker")

    def __init__(self, path: str | os.PathLike[str], *, lease_s: float = 15.0,
                 _group_commit: bool = True) -> None:
        check_lease_s(lease_s)
        self._path = Path(os.fspath(path))
        self._owners_dir = self._path.with_name(self._path.name + ".owners")
        # Two connections, opened together: one for worker threads, which may wait for
        # other processes, and one for inline writes, which never waits.
        self._worker: Db | None = None
        self._inline: Db | None = None
        self._claims: dict[str, _Claim] = {}
        self._lease = Lease(lease_s, self._renew_lease)
        self._owner_lock: LockFile | None = None  # held while this owner lives
        self._renewer: sqlite3.Connection | None = None  # the lease keeper's own
        self._state = WriterState()
        self._gate = InlineSyncGate()
        self._group = GroupCommit(self._commit_batch) if _group_commit else None

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the path."""
        return {"kind": "sqlite", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Make this store object's owner the run's owner and move its claim epoch on.

        Raises ``RunLocked`` (naming the holder) if a live owner, this store object's
        included, holds it: one whose lease has not ended and whose process holds its
        owner lock.

        Cancellation: the worker thread finishes before the cancellation is delivered,
        and the claim is given up again if the call does not return.
        """
        token = anyio.lowlevel.current_token()
        await claim_in_thread(partial(self._claim, run_id, token),
                              partial(self._unclaim, run_id))

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (the row of a run never started goes).

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
                                final=record.is_final, reason=record.stop_reason.value))

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
        the owners: a live owner's lease has not ended and its process holds its lock.

        Cancellation: the worker thread finishes the query before the cancellation is
        delivered.
        """
        return await anyio.to_thread.run_sync(self._list, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no row.

        Cancellation: as for :meth:`list_runs`.
        """
        return await anyio.to_thread.run_sync(self._describe, run_id)

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before``; their ids.

        A run that is unfinished, ended in doubt, or claimed is never touched: each run
        is deleted under its claim, in one transaction that checks again that it
        finished before the cutoff. With ``archive``, each run's log is first written
        durably to that directory, as a :class:`~polyloop.stores.JsonlStore` keeps it.

        Cancellation: each run is archived and deleted whole or not at all.
        """
        before = check_cutoff(finished_before).timestamp()
        candidates = await anyio.to_thread.run_sync(self._prunable, before)
        return await prune_runs(self, candidates,
                                archive=Path(archive) if archive is not None else None,
                                delete=partial(self._delete_claimed, before=before))

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
        self._lease.check(claim.generation, write.run_id)
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
        does not expect (another writer claimed the run since, or it ended)."""
        key, following = run_key(write.run_id), first + len(write.rows)
        epoch = self._claims[write.run_id].epoch
        moved = conn.execute(ADVANCE_RUN, (following, write.final, write.reason, time.time(),
                                           write.end, key, epoch, first))
        if moved.rowcount == 1:
            return
        row = conn.execute(EXPLAIN_REFUSAL, (key,)).fetchone()
        if row is None or row[0] != epoch:
            raise RunLocked("another writer claimed the run since this store object did",
                            run_id=write.run_id)
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
                # The end record's own statement gave the owner up in the run's row.
                self._claims.pop(write.run_id, None)
        for run_id, seq in batch.next_seq.items():
            claim = self._claims.get(run_id)
            if claim is not None:
                claim.next_seq = seq

    # -- claims and the owner's lease (worker threads) -----------------------------------

    def _claim(self, run_id: str, token: EventLoopToken) -> None:
        with self._state.mutex:
            self._state.check_writable(run_id)
            if run_id in self._claims:
                raise RunLocked("this store object already holds the run's claim",
                                run_id=run_id)
            conn = self._connection(run_id)
            owner_id, generation = self._registered_owner(conn, run_id, token)
            key = run_key(run_id)
            with self._reading(run_id), _immediate(conn):
                row = conn.execute(SELECT_CLAIM, (key,)).fetchone()
                if row is None:
                    conn.execute(NEW_RUN, (key, time.time(), owner_id))
                    epoch, next_seq, finished = 1, 0, False
                else:
                    holder, epoch, next_seq, finished = row
                    if holder is not None and self._alive(conn, holder):
                        raise RunLocked(f"the run is held by {self._holder(conn, holder)}",
                                        run_id=run_id)
                    conn.execute(TAKE_RUN, (owner_id, key))
                    epoch += 1
            self._claims[run_id] = _Claim(epoch=epoch, generation=generation,
                                          next_seq=int(next_seq), finished=bool(finished))

    def _unclaim(self, run_id: str) -> None:
        with self._state.mutex:
            self._unclaim_locked(run_id)

    def _prunable(self, before: float) -> list[str]:
        with self._state.mutex, self._reading(None):
            rows = self._connection(None).execute(PRUNABLE, (before,)).fetchall()
        return [run_id_of(key) for (key,) in rows]

    async def _delete_claimed(self, run_id: str, *, before: float) -> bool:
        return await anyio.to_thread.run_sync(self._delete_sync, run_id, before)

    def _delete_sync(self, run_id: str, before: float) -> bool:
        """Delete a run this store object holds the claim of, if it still may go."""
        with self._state.mutex:
            claim = self._claims.get(run_id)
            if claim is None:
                return False
            conn, key = self._connection(run_id), run_key(run_id)
            with self._reading(run_id), _immediate(conn):
                gone = conn.execute(PRUNE_RUN, (key, claim.epoch, before)).rowcount
                if gone:
                    conn.execute(PRUNE_ROWS, (key,))
            if gone:
                del self._claims[run_id]
            return bool(gone)

    def _unclaim_locked(self, run_id: str) -> None:
        claim = self._claims.pop(run_id, None)
        conn = self._worker.conn if self._worker is not None else None
        if claim is None or conn is None:
            return
        try:
            with _immediate(conn):
                conn.execute(DROP_UNSTARTED, (run_key(run_id), claim.epoch))
                conn.execute(FREE_RUN, (run_key(run_id), claim.epoch))
        except sqlite3.Error:
            # The row keeps this owner until the store closes or its lease ends.
            logger.warning("run %r: could not give its claim up", run_id, exc_info=True)

    def _registered_owner(self, conn: sqlite3.Connection, run_id: str,
                          token: EventLoopToken) -> tuple[str, int]:
        """This store object's owner id and lease generation, registering it if need be
        (store mutex held): take the owner's lock, write its row, keep its lease."""
        owner_id, generation, registered = self._lease.current()
        if registered:
            return owner_id, generation
        sent_at = time.monotonic()
        lock = LockFile(self._owners_dir / f"{owner_id}.lock", run_id)
        try:
            self._owners_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            if self._owner_lock is not None:  # a lapsed identity's lock goes
                self._owner_lock.release()
            self._owner_lock = lock
            now = time.time()
            with self._reading(run_id), _immediate(conn):
                self._forget_owners(conn, now)
                conn.execute(REGISTER_OWNER, (owner_id, self._lease.description,
                                              now + self._lease.lease_s, now))
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise StoreError(f"could not register this worker as an owner of runs: {exc}",
                             run_id=run_id) from exc
        self._lease.registered(owner_id, sent_at, token)
        return owner_id, generation

    def _forget_owners(self, conn: sqlite3.Connection, now: float) -> None:
        """Remove owners whose lease ended long ago and who hold nothing, with their files."""
        for (owner_id,) in conn.execute(STALE_OWNERS, (now - _FORGET_OWNERS_AFTER_S,)).fetchall():
            path = self._owners_dir / f"{owner_id}.lock"
            if not LockFile.held(path):
                with suppress(FileNotFoundError):
                    path.unlink()
                conn.execute(DROP_OWNER, (owner_id,))

    def _alive(self, conn: sqlite3.Connection, owner_id: str) -> bool:
        """Whether ``owner_id``'s lease has not ended and its process holds its lock."""
        row = conn.execute(OWNER_OF, (owner_id,)).fetchone()
        return (row is not None and row[1] > time.time()
                and LockFile.held(self._owners_dir / f"{owner_id}.lock"))

    @staticmethod
    def _holder(conn: sqlite3.Connection, owner_id: str) -> str:
        row = conn.execute(OWNER_OF, (owner_id,)).fetchone()
        if row is None:
            return "another writer"
        until = datetime.fromtimestamp(row[1], UTC)
        return f"{row[0]}, whose lease runs until {until:%Y-%m-%d %H:%M:%S %Z}"

    def _renew_lease(self, owner_id: str) -> bool:
        """Extend the owner's lease if it has not ended (the lease keeper's thread, on a
        connection of its own: it must not wait behind the store's commits)."""
        if self._state.closed:
            return False
        if self._renewer is None:
            self._renewer = sqlite3.connect(self._path, timeout=self._lease.lease_s / 3,
                                            isolation_level=None, check_same_thread=False)
        now = time.time()
        done = self._renewer.execute(RENEW_OWNER, (now + self._lease.lease_s, owner_id, now))
        return done.rowcount == 1

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
        return self._stored(rows)

    def _describe(self, run_id: str) -> StoredRun | None:
        with self._state.mutex, self._reading(run_id):
            rows = self._connection(run_id).execute(DESCRIBE_RUN, (run_key(run_id),)).fetchall()
        return self._stored(rows)[0] if rows else None

    def _stored(self, rows: list[tuple[Any, ...]]) -> tuple[StoredRun, ...]:
        """Rows of the runs table joined with their owners; each owner's lock asked once."""
        now, alive = time.time(), {}
        listed = []
        for key, finished, updated_at, owner, description, lease_until in rows:
            if owner is not None and owner not in alive:
                alive[owner] = (lease_until is not None and lease_until > now
                                and LockFile.held(self._owners_dir / f"{owner}.lock"))
            listed.append(StoredRun(
                run_id=run_id_of(key), finished=bool(finished),
                claimed=owner is not None and alive[owner],
                updated_at=datetime.fromtimestamp(updated_at, UTC),
                owner=description,
                lease_expires_at=(datetime.fromtimestamp(lease_until, UTC)
                                  if lease_until is not None else None)))
        return tuple(listed)

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
        self._lease.stop()
        with self._state.mutex:
            self._state.closed = True
            owner_id, _, registered = self._lease.current()
            worker = self._worker.conn if self._worker is not None else None
            self._claims.clear()
            if registered and worker is not None:
                # Every run this owner still holds is free before this returns.
                try:
                    with _immediate(worker):
                        worker.execute(FREE_OWNED, (owner_id,))
                        worker.execute(DROP_OWNER, (owner_id,))
                except sqlite3.Error:
                    logger.warning("could not give up the claims of owner %s", owner_id,
                                   exc_info=True)
            if self._owner_lock is not None:
                self._owner_lock.release()
                self._owner_lock = None
            if self._renewer is not None:
                self._renewer.close()
                self._renewer = None
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


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """One ``BEGIN IMMEDIATE`` ... ``COMMIT`` on a worker-thread connection."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise
