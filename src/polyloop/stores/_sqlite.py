"""The SQLite store: every run in one database file, committed in shared transactions.

Tables ``meta`` (the record format), ``records`` (one row per record, its body the line
:func:`polyloop.serialization.dumps` writes), ``runs`` (one row per run: where its log
stands, whether it finished, its owner and claim epoch) and ``owners`` (the store
objects that claim runs, with their leases); ``docs/stores.md`` describes them for
users. The database runs in WAL mode: starts and intents commit with
``synchronous=FULL``, every other write with ``NORMAL`` unless a barrier shares its
commit. Each write moves its run's row on in the same transaction, under the writer's
claim epoch, or is rolled back whole. Research records 0010 (durability), 0017 (claims),
0018 (owners and leases) and 0019 (one write path, off the event loop) say why.

Every blocking call runs in a worker thread, on one connection guarded by the store
mutex: the writes waiting at the same moment share one ``BEGIN IMMEDIATE`` ... ``COMMIT``
(:class:`~polyloop.stores._batching.GroupCommit`), one savepoint per write, so a refused
write rolls back alone. The lease keeper renews on a connection of its own.
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

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import (
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

    ``path`` names the database file; missing parent directories are created. Runs
    survive the store object, the process and the machine: a new store object on the
    same file (or a copy moved elsewhere) reads and resumes them. ``lease_s`` is how long
    this store object's claims hold without a renewal; another process on the host may
    take over the runs of an owner whose lease ended or whose process died. The owners'
    lock files live in the sibling directory ``<path>.owners`` (one per store object
    that claims runs, removed when it closes). The store is an async context manager;
    :meth:`aclose` gives up every claim and closes its connections.

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its shared commit started
    writes nothing; once the commit started, the call waits for it, shielded, then lets
    the cancellation go on (its rows are committed, or it failed). Reads change nothing;
    closing completes even in a cancelled scope.
    """

    __slots__ = (
        "_claims",
        "_group",
        "_lease",
        "_owner_lock",
        "_owners_dir",
        "_path",
        "_renewer",
        "_state",
        "_worker",
    )

    def __init__(self, path: str | os.PathLike[str], *, lease_s: float = 15.0) -> None:
        check_lease_s(lease_s)
        self._path = Path(os.fspath(path))
        self._owners_dir = self._path.with_name(self._path.name + ".owners")
        self._worker: Db | None = None  # opened at first use, in a worker thread
        self._claims: dict[str, _Claim] = {}
        self._lease = Lease(lease_s, self._renew_lease)
        self._owner_lock: LockFile | None = None  # held while this owner lives
        self._renewer: sqlite3.Connection | None = None  # the lease keeper's own
        self._state = WriterState()
        self._group = GroupCommit(self._commit_batch)

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the path."""
        return {"kind": "sqlite", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Make this store object's owner the run's owner and move its claim epoch on.

        Raises ``RunLocked`` (naming the holder) if a live owner, this store object's
        included, holds it: one whose lease has not ended and whose process holds its
        owner lock.
        """
        token = anyio.lowlevel.current_token()
        await claim_in_thread(partial(self._claim, run_id, token), partial(self._unclaim, run_id))

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (the row of a run never started goes)."""
        if run_id in self._claims:
            await anyio.to_thread.run_sync(self._unclaim, run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the run's first record; ``RunAlreadyExists`` if the run has any row.

        A barrier: the row is fsync'd before this returns.
        """
        await self._write(Write(record.run_id, [record_row(record)], start=True, barrier=True))

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent; it is fsync'd to disk when this returns (a barrier)."""
        await self._write(Write(intent.run_id, [record_row(intent)], barrier=True))

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call; committed, not necessarily fsync'd."""
        await self._write(Write(result.run_id, [record_row(result)]))

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record atomically; not fsync'd."""
        if action_result is None:
            await self._write(Write(step.run_id, [record_row(step)]))
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(Write(step.run_id, [record_row(action_result), record_row(step)]))

    async def end_run(self, record: RunEnded) -> None:
        """Write the run's end record (not fsync'd), then release the run's writer lock."""
        await self._write(
            Write(
                record.run_id,
                [record_row(record)],
                end=True,
                final=record.is_final,
                reason=record.stop_reason.value,
            )
        )

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id`` in write order; empty if the run has no row.

        Raises ``CorruptLog`` (naming the row) for a body that does not decode or does
        not belong to its row, and ``SchemaMajorMismatch`` for another record format.
        """
        records = await anyio.to_thread.run_sync(self._read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run, in the order the runs started (only unfinished ones if asked).

        Read from the table of runs; the unfinished ones through an index that holds
        only them, so finished runs cost nothing. Whether a run is claimed is asked of
        the owners: a live owner's lease has not ended and its process holds its lock.
        """
        return await anyio.to_thread.run_sync(self._list, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no row."""
        return await anyio.to_thread.run_sync(self._describe, run_id)

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before``; their ids.

        A run that is unfinished, ended in doubt, or claimed is never touched: each run
        is deleted under its claim, in one transaction that checks again that it
        finished before the cutoff. With ``archive``, each run's log is first written
        durably to that directory, as a :class:`~polyloop.stores.JsonlStore` keeps it.
        """
        before = check_cutoff(finished_before).timestamp()
        candidates = await anyio.to_thread.run_sync(self._prunable, before)
        return await prune_runs(
            self,
            candidates,
            archive=Path(archive) if archive is not None else None,
            delete=partial(self._delete_claimed, before=before),
        )

    async def aclose(self) -> None:
        """Release every writer lock and close both connections. Idempotent.

        A shared commit that is running completes first; writes that arrive later are
        refused. Cancellation: closing runs shielded, so it completes even in a
        cancelled scope.
        """
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._close)

    async def __aenter__(self) -> SqliteStore:
        """Open and check the database now rather than at first use."""
        await anyio.to_thread.run_sync(self._open_now)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the store (see :meth:`aclose`)."""
        await self.aclose()

    def __repr__(self) -> str:
        return f"SqliteStore({os.fspath(self._path)!r})"

    # -- committing (worker thread, store mutex held) ------------------------------------

    async def _write(self, write: Write) -> None:
        await self._group.submit(write)

    def _commit_batch(self, writes: Sequence[Write]) -> _Outcome:
        """One transaction for ``writes``, in a worker thread; one error or None each."""
        with self._state.mutex:
            batch = _Batch.of(writes)
            admitted = [i for i in range(len(writes)) if self._admit(batch, i)]
            if admitted:
                assert self._worker is not None  # _admit opened it
                self._transact(self._worker, batch, admitted, self._level_for(writes, admitted))
            self._settle(batch)
            return batch.errors

    def _admit(self, batch: _Batch, i: int) -> bool:
        """Refuse the write unless its run is claimed; make sure the connections are open."""
        write = batch.writes[i]
        try:
            self._state.check_writable(write.run_id)
            if write.run_id not in self._claims:
                raise RunLocked(
                    "this store object does not hold the run's claim", run_id=write.run_id
                )
            self._connection(write.run_id)
        except PolyLoopError as exc:
            batch.errors[i] = exc
            return False
        return True

    def _level_for(self, writes: Sequence[Write], admitted: Sequence[int]) -> int:
        if any(writes[i].barrier for i in admitted):
            return SYNCHRONOUS_FULL
        return SYNCHRONOUS_NORMAL

    def _transact(self, db: Db, batch: _Batch, admitted: Sequence[int], level: int) -> None:
        """Insert the admitted writes in one transaction.

        A failure that ends the transaction fails every admitted write still standing.
        """
        conn = db.conn
        try:
            db.synchronous(level)
            conn.execute("BEGIN IMMEDIATE")
            for i in admitted:
                self._insert(conn, batch, i, savepoint=len(admitted) > 1)
            self._end(conn, level, committing=any(batch.errors[i] is None for i in admitted))
        except (sqlite3.Error, OSError) as exc:
            rollback_quietly(conn)
            batch.next_seq.clear()
            for i in admitted:
                if batch.errors[i] is None:
                    batch.errors[i] = self._state.fail(batch.writes[i].run_id, exc)

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
            raise StoreError(
                "the run has ended; nothing may follow its end record", run_id=write.run_id
            )
        return first

    def _advance(self, conn: sqlite3.Connection, write: Write, first: int) -> None:
        """Move the run's row on, in the write's transaction; refuse a write the row
        does not expect (another writer claimed the run since, or it ended)."""
        key, following = run_key(write.run_id), first + len(write.rows)
        epoch = self._claims[write.run_id].epoch
        moved = conn.execute(
            ADVANCE_RUN,
            (following, write.final, write.reason, time.time(), write.end, key, epoch, first),
        )
        if moved.rowcount == 1:
            return
        row = conn.execute(EXPLAIN_REFUSAL, (key,)).fetchone()
        if row is None or row[0] != epoch:
            raise RunLocked(
                "another writer claimed the run since this store object did", run_id=write.run_id
            )
        raise StoreError(
            "the run has ended, or its rows moved on without this writer", run_id=write.run_id
        )

    def _end(self, conn: sqlite3.Connection, level: int, *, committing: bool) -> None:
        conn.execute("COMMIT" if committing else "ROLLBACK")

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
                raise RunLocked("this store object already holds the run's claim", run_id=run_id)
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
                        raise RunLocked(
                            f"the run is held by {self._holder(conn, holder)}", run_id=run_id
                        )
                    conn.execute(TAKE_RUN, (owner_id, key))
                    epoch += 1
            self._claims[run_id] = _Claim(
                epoch=epoch, generation=generation, next_seq=int(next_seq), finished=bool(finished)
            )

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

    def _registered_owner(
        self, conn: sqlite3.Connection, run_id: str, token: EventLoopToken
    ) -> tuple[str, int]:
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
                conn.execute(
                    REGISTER_OWNER,
                    (owner_id, self._lease.description, now + self._lease.lease_s, now),
                )
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise StoreError(
                f"could not register this worker as an owner of runs: {exc}", run_id=run_id
            ) from exc
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
        return (
            row is not None
            and row[1] > time.time()
            and LockFile.held(self._owners_dir / f"{owner_id}.lock")
        )

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
            self._renewer = sqlite3.connect(
                self._path,
                timeout=self._lease.lease_s / 3,
                isolation_level=None,
                check_same_thread=False,
            )
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
                alive[owner] = (
                    lease_until is not None
                    and lease_until > now
                    and LockFile.held(self._owners_dir / f"{owner}.lock")
                )
            listed.append(
                StoredRun(
                    run_id=run_id_of(key),
                    finished=bool(finished),
                    claimed=owner is not None and alive[owner],
                    updated_at=datetime.fromtimestamp(updated_at, UTC),
                    owner=description,
                    lease_expires_at=(
                        datetime.fromtimestamp(lease_until, UTC)
                        if lease_until is not None
                        else None
                    ),
                )
            )
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
            self._worker = self._open(run_id)
        return self._worker.conn

    def _open(self, run_id: str | None) -> Db:
        """Open and check the database (WAL, ``synchronous=FULL``, the schema, the format)."""
        conn: sqlite3.Connection | None = None
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            created = not self._path.exists()
            conn = sqlite3.connect(
                self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            configure(conn, self._path.name, run_id)
            create_schema(conn)
            check_meta_format(conn, self._path.name, run_id)
            if created:
                fsync_directory(self._path.parent)
        except BaseException as exc:
            if conn is not None:
                with suppress(sqlite3.Error):  # the original error says more
                    conn.close()
            if isinstance(exc, (sqlite3.Error, OSError)) and not isinstance(exc, PolyLoopError):
                raise StoreError(f"cannot open {self._path.name}: {exc}", run_id=run_id) from exc
            raise
        return Db(conn)

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
                    logger.warning(
                        "could not give up the claims of owner %s", owner_id, exc_info=True
                    )
            if self._owner_lock is not None:
                self._owner_lock.release()
                self._owner_lock = None
            if self._renewer is not None:
                self._renewer.close()
                self._renewer = None
            db, self._worker = self._worker, None
            if db is not None:
                try:
                    db.conn.close()
                except sqlite3.Error as exc:
                    raise StoreError(f"closing {self._path.name} failed: {exc}") from exc


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
