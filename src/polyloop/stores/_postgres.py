"""The PostgreSQL store: one database shared by many worker processes on many hosts.

Tables in one schema: ``meta`` (the record format and the layout), ``records`` (one row
per record, keyed by the sha256 of the run id and the record's seq, its body the line
:func:`polyloop.serialization.dumps` writes), ``runs`` (one row per run: where its log
stands, whether it finished, its owner and claim epoch) and ``owners`` (the store
objects that claim runs, with their leases); ``docs/stores.md`` describes them for
users. Starts and intents commit with ``synchronous_commit`` on; a batch without them
commits with it off for its own transaction. Research records 0011 (durability), 0017
(claims), 0018 (owners, leases, timeouts) and 0019 (one write path) say why.

A claim is the run's row naming this store object's owner id, with a claim epoch; the
owner holds a session-level advisory lock on a connection of its own while it lives, and
a lease that :mod:`polyloop.stores._lease` keeps. Writes go through *writer connections*
(at most ``max_writer_connections``, never lent to the reader pool): the writes that wait
on a connection at the same moment are one batch, one statement
(:mod:`polyloop.stores._postgres_batch`), which moves each run's row on under its epoch
and inserts its records, or refuses the run. Every call runs in a worker thread on plain
blocking psycopg connections (psycopg's async API is tied to asyncio), so the store
serves asyncio and Trio alike; a store object must be used from one event loop at a time.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import psycopg
from anyio.lowlevel import EventLoopToken
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from polyloop import serialization
from polyloop._shared import FORMAT, record_kind
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import WriterState, check_format, claim_in_thread
from polyloop.stores._lease import Lease, check_lease_s
from polyloop.stores._postgres_batch import (
    Claim,
    Committer,
    Connection,
    Item,
    Mode,
    Probe,
    Slot,
    Writer,
    fail_run,
    open_connection,
    set_statement_timeout,
)
from polyloop.stores._postgres_sql import (
    LAYOUT,
    Queries,
    ddl_lock_key,
    lock_halves,
    owner_lock_key,
    record_row,
    run_id_column,
    run_key,
    shown,
)
from polyloop.types import (
    CorruptLog,
    Intent,
    JSONValue,
    Record,
    Result,
    RunEnded,
    RunLocked,
    RunLog,
    RunStarted,
    StepRecord,
    StoreError,
)

__all__ = ("PostgresStore",)

_T = TypeVar("_T")
logger = logging.getLogger("polyloop")
_MAX_IDENTIFIER_BYTES = 63
_WRITER_NAME = "polyloop-writer"
_READER_NAME = "polyloop-reader"
_OWNER_NAME = "polyloop-owner"


class PostgresStore:
    """Keeps runs in a PostgreSQL database that many workers on many hosts can share.

    ``conninfo`` is a libpq connection string or URL (it is never reported: not by
    :meth:`parameters`, not by ``repr``). ``schema`` names the PostgreSQL schema that
    holds the tables; it is created on first use. ``pool_size`` bounds the connections
    used for reads and the DDL; ``max_writer_connections`` bounds the connections that
    hold writer locks (see the module documentation). ``timeout`` is how many seconds to
    wait for the pool to open or to lend a connection, and the connect timeout of every
    connection unless ``conninfo`` sets ``connect_timeout`` itself. ``lease_s`` is how
    long this store object's claims hold without a renewal (renewed every third of it
    while its event loop runs); another worker may take over the runs of an owner whose
    lease has ended, or whose process died. ``statement_timeout_s`` bounds every
    statement on the server (``statement_timeout``) and how long sent data may go
    unacknowledged (``tcp_user_timeout``, unless ``conninfo`` sets it), so a server that
    stops answering becomes a ``StoreError`` within about that time.

    The store is an async context manager; :meth:`aclose` gives up every claim it holds
    and closes every connection. Any worker connected to the same database resumes any
    run; a second writer of a run gets ``RunLocked``. Needs the ``postgres`` extra
    (psycopg 3 and psycopg-pool).

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its batch started writes
    nothing; once the batch started, the call waits for its commit, shielded, then lets
    the cancellation go on (its rows are committed, or it failed). Reads change nothing;
    closing completes even in a cancelled scope.
    """

    __slots__ = (
        "_committer",
        "_connect",
        "_conninfo",
        "_lease",
        "_max_writers",
        "_owner_conn",
        "_owner_lock",
        "_pool",
        "_pool_size",
        "_queries",
        "_ready",
        "_ready_lock",
        "_schema",
        "_slots",
        "_state",
        "_statement_timeout_s",
        "_timeout",
        "_writers",
    )

    def __init__(
        self,
        conninfo: str,
        *,
        schema: str = "polyloop",
        pool_size: int = 4,
        max_writer_connections: int = 8,
        timeout: float = 30.0,
        lease_s: float = 15.0,
        statement_timeout_s: float = 30.0,
        _probe: Probe | None = None,
    ) -> None:
        _check_options(schema, pool_size, max_writer_connections, timeout)
        check_lease_s(lease_s)
        if not statement_timeout_s > 0:
            raise ValueError("statement_timeout_s must be a positive number of seconds")
        self._conninfo = conninfo
        self._statement_timeout_s = float(statement_timeout_s)
        self._connect = _connect_options(conninfo, timeout, self._statement_timeout_s)
        self._schema = schema
        self._pool_size = pool_size
        self._max_writers = max_writer_connections
        self._timeout = timeout
        self._queries = Queries.for_schema(schema)
        self._state = WriterState()
        self._ready_lock = threading.Lock()
        self._ready = False
        self._pool: ConnectionPool[Connection] | None = None
        self._writers: list[Writer] = []
        self._slots: dict[str, Slot] = {}
        self._lease = Lease(lease_s, self._renew_lease)
        # ``_probe`` is a test seam: it sees each batch just before its commit.
        self._committer = Committer(self._state, self._queries, self._lease, _probe)
        self._owner_lock = threading.Lock()
        self._owner_conn: Connection | None = None

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the connection string or schema."""
        return {"kind": "postgresql", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Make this store object's owner the run's owner and move its claim epoch on.

        Raises ``RunLocked`` (naming the holder) if a live owner, this store object's
        included, holds it: one whose lease has not ended and whose session lives.
        """
        token = anyio.lowlevel.current_token()
        await claim_in_thread(
            partial(self._claim_run, run_id, token), partial(self._release_run, run_id)
        )

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (the row of a run never started goes)."""
        slot = self._slots.get(run_id)
        if slot is not None and slot.claim is not None:
            await self._in_thread(self._release_run, run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the claimed run's first record, a durable barrier.

        When this returns the record is committed and flushed to the server's disk.
        Raises ``RunAlreadyExists`` if the run has any row (nothing is written).
        """
        await self._write(record.run_id, [record], "start", barrier=True)

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent, a durable barrier: committed and flushed when this returns."""
        await self._write(intent.run_id, [intent], "append", barrier=True)

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call; committed (not yet flushed) when this returns."""
        await self._write(result.run_id, [result], "append")

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record in one transaction.

        Committed (not yet flushed) when this returns: both rows, or neither.
        """
        if action_result is None:
            await self._write(step.run_id, [step], "append")
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(step.run_id, [action_result, step], "append")

    async def end_run(self, record: RunEnded) -> None:
        """Write the run's end record and give up the claim, in one statement.

        The record is committed (not yet flushed) and the claim given up when this returns.
        """
        await self._write(
            record.run_id, [record], "end", final=record.is_final, reason=record.stop_reason.value
        )

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id`` in write order; empty if the run has no row.

        Raises ``CorruptLog`` (naming the row) for a body that does not decode or does
        not belong to its row, and ``SchemaMajorMismatch`` for another record format.
        Readers never take the writer lock.
        """
        records = await self._in_thread(self._read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run, in the order the runs started (only unfinished ones if asked).

        Read from the table of runs; the unfinished ones through an index that holds
        only them, so finished runs cost nothing. Whether a run is claimed is read from
        the server's advisory locks.
        """
        return await self._in_thread(self._list, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no row."""
        return await self._in_thread(self._describe, run_id)

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before``; their ids.

        A run that is unfinished, ended in doubt, or claimed is never touched: each run
        is deleted under its claim, by one statement that checks again that it finished
        before the cutoff. With ``archive``, each run's log is first written durably to
        that directory, as a :class:`~polyloop.stores.JsonlStore` keeps it. Safe while
        workers run.
        """
        cutoff = check_cutoff(finished_before)
        candidates = await self._in_thread(self._prunable, cutoff)
        return await prune_runs(
            self,
            candidates,
            archive=Path(archive) if archive is not None else None,
            delete=partial(self._delete_claimed, cutoff=cutoff),
        )

    async def aclose(self) -> None:
        """Give up every claim, end this owner's lease, close every connection. Idempotent."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._close)

    async def __aenter__(self) -> PostgresStore:
        """Open the pool and check (or create) the schema now rather than at first use."""
        await self._in_thread(self._open_now)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self._schema!r})"

    # -- writing ----------------------------------------------------------------------------

    async def _write(
        self,
        run_id: str,
        records: Sequence[Record],
        mode: Mode,
        *,
        barrier: bool = False,
        final: bool = False,
        reason: str | None = None,
    ) -> None:
        rows = [record_row(record) for record in records]
        with self._used(run_id) as slot:
            await slot.writer.group.submit(Item(slot, rows, mode, barrier, final, reason))

    @contextmanager
    def _used(self, run_id: str) -> Iterator[Slot]:
        """``run_id``'s slot, kept while in use; forgotten when nobody uses or claims it."""
        with self._state.mutex:
            self._state.check_writable(run_id)
            slot = self._slots.get(run_id)
            if slot is None:
                slot = self._slots[run_id] = Slot(run_id, self._pick_writer())
                slot.writer.runs.add(run_id)
            slot.users += 1
        try:
            yield slot
        finally:
            with self._state.mutex:
                slot.users -= 1
                if slot.users == 0 and slot.claim is None and self._slots.get(run_id) is slot:
                    del self._slots[run_id]
                    slot.writer.runs.discard(run_id)

    def _pick_writer(self) -> Writer:
        """An idle writer, a new one, or the least busy (called with the mutex held)."""
        writer = min(self._writers, key=lambda w: len(w.runs), default=None)
        if writer is None or (writer.runs and len(self._writers) < self._max_writers):
            writer = self._new_writer()
            self._writers.append(writer)
        return writer

    def _new_writer(self) -> Writer:
        writer = Writer(
            connect=partial(
                open_connection,
                self._conninfo,
                self._statement_timeout_s,
                name=_WRITER_NAME,
                **self._connect,
            )
        )
        writer.group = GroupCommit(partial(self._committer.commit, writer))
        return writer

    # -- claims and the owner's lease (worker threads) -----------------------------------

    def _claim_run(self, run_id: str, token: EventLoopToken) -> None:
        with self._used(run_id) as slot:
            if slot.claim is not None:
                raise RunLocked("this store object already holds the run's claim", run_id=run_id)
            self._ensure_ready(run_id)
            owner_id, generation = self._registered_owner(run_id, token)
            with slot.writer.lock:
                slot.claim = self._claim(slot.writer, run_id, owner_id, generation)

    def _release_run(self, run_id: str) -> None:
        """Give the claim up through the owner's connection, which outlives any writer's."""
        slot = self._slots.get(run_id)
        if slot is None or slot.claim is None:
            return
        with slot.writer.lock:
            claim, slot.claim = slot.claim, None
        if claim is not None:
            with self._owner_lock:
                try:
                    self._owner_connection().execute(
                        self._queries.release, {"run_key": run_key(run_id), "epoch": claim.epoch}
                    )
                except (psycopg.Error, StoreError):
                    # The row keeps this owner until the store closes or its lease ends.
                    logger.warning("run %r: could not give its claim up", run_id, exc_info=True)
                    self._close_owner_connection()
        with self._state.mutex:
            if slot.users == 0 and slot.claim is None and self._slots.get(run_id) is slot:
                del self._slots[run_id]
                slot.writer.runs.discard(run_id)

    def _prunable(self, cutoff: datetime) -> list[str]:
        with self._reading(None) as pool, pool.connection(timeout=self._timeout) as conn:
            rows = conn.execute(self._queries.prunable, (cutoff,)).fetchall()
        return [self._run_id_of(column) for (column,) in rows]

    async def _delete_claimed(self, run_id: str, *, cutoff: datetime) -> bool:
        return await self._in_thread(self._delete_sync, run_id, cutoff)

    def _delete_sync(self, run_id: str, cutoff: datetime) -> bool:
        """Delete a run this store object holds the claim of, if it still may go."""
        slot = self._slots.get(run_id)
        claim = slot.claim if slot is not None else None
        if slot is None or claim is None:
            return False
        with slot.writer.lock:
            try:
                conn = slot.writer.connected(run_id)
                gone = _scalar(
                    conn,
                    self._queries.prune_run,
                    {"run_key": run_key(run_id), "epoch": claim.epoch, "before": cutoff},
                )
            except psycopg.Error as exc:
                raise fail_run(self._state, slot.writer, run_id, exc) from exc
            if gone:
                slot.claim = None
        if gone:
            with self._state.mutex:
                if slot.users == 0 and self._slots.get(run_id) is slot:
                    del self._slots[run_id]
                    slot.writer.runs.discard(run_id)
        return bool(gone)

    def _claim(self, writer: Writer, run_id: str, owner_id: str, generation: int) -> Claim:
        """Make ``owner_id`` the run's owner, if no live owner holds it (``writer.lock`` held).

        Raises ``RunLocked`` naming the holder, ``StoreError`` if the query fails.
        """
        key = run_key(run_id)
        try:
            conn = writer.connected(run_id)
            row = conn.execute(
                self._queries.claim,
                {
                    "run_key": key,
                    "run_id": run_id_column(run_id),
                    "owner": owner_id,
                },
            ).fetchone()
            holder = None if row else conn.execute(self._queries.holder, (key,)).fetchone()
        except psycopg.Error as exc:
            raise fail_run(self._state, writer, run_id, exc) from exc
        if row is None:
            who = (
                f"{holder[0]}, whose lease runs until {holder[1]:%Y-%m-%d %H:%M:%S %Z}"
                if holder
                else "another writer"
            )
            raise RunLocked(f"the run is held by {who}", run_id=run_id)
        epoch, next_seq, finished = row
        return Claim(
            run_id=run_id,
            writer=writer,
            epoch=int(epoch),
            generation=generation,
            next_seq=int(next_seq),
            finished=bool(finished),
        )

    def _registered_owner(self, run_id: str, token: EventLoopToken) -> tuple[str, int]:
        """This store object's owner id and lease generation, registering it if need be.

        Registering takes the owner's lock on a connection of its own (it lives as long
        as the session), writes its row with a lease, and starts keeping the lease.
        """
        with self._owner_lock:
            owner_id, generation, registered = self._lease.current()
            if registered:
                return owner_id, generation
            sent_at = time.monotonic()
            hi, lo = lock_halves(owner_lock_key(self._schema, owner_id))
            try:
                conn = self._owner_connection()
                # A lapsed identity's lock goes: its lease has ended anyway.
                conn.execute("SELECT pg_advisory_unlock_all()")
                conn.execute(
                    "SELECT pg_advisory_lock(%s)", (owner_lock_key(self._schema, owner_id),)
                )
                conn.execute(self._queries.forget_owners)
                conn.execute(
                    self._queries.register_owner,
                    (owner_id, self._lease.description, hi, lo, self._lease.lease_s),
                )
            except psycopg.Error as exc:
                self._close_owner_connection()
                raise StoreError(
                    f"could not register this worker as an owner of runs: "
                    f"{type(exc).__name__}: {exc}",
                    run_id=run_id,
                ) from exc
            self._lease.registered(owner_id, sent_at, token)
            return owner_id, generation

    def _renew_lease(self, owner_id: str) -> bool:
        """Extend the owner's lease if it has not ended (the lease keeper's thread)."""
        with self._owner_lock:
            conn = self._owner_conn
            if conn is None or conn.broken or conn.closed:
                return False
            try:
                done = conn.execute(self._queries.renew_owner, (self._lease.lease_s, owner_id))
            except psycopg.Error:
                self._close_owner_connection()
                raise
            return done.rowcount == 1

    def _owner_connection(self) -> Connection:
        """The connection that holds the owner's lock (``_owner_lock`` held)."""
        if self._state.closed:
            raise StoreError("the store is closed")
        conn = self._owner_conn
        if conn is None or conn.broken or conn.closed:
            self._close_owner_connection()
            conn = self._owner_conn = open_connection(
                self._conninfo, self._statement_timeout_s, name=_OWNER_NAME, **self._connect
            )
        return conn

    def _close_owner_connection(self) -> None:
        conn, self._owner_conn = self._owner_conn, None
        if conn is not None:
            conn.close()

    # -- reading (worker thread) ------------------------------------------------------------

    def _read(self, run_id: str) -> tuple[Record, ...]:
        with self._reading(run_id) as pool, pool.connection(timeout=self._timeout) as conn:
            rows = conn.execute(self._queries.select_run, (run_key(run_id),)).fetchall()
        return tuple(self._decode_row(run_id, index, row) for index, row in enumerate(rows))

    def _list(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        query = self._queries.list_unfinished if unfinished_only else self._queries.list_runs
        with self._reading(None) as pool, pool.connection(timeout=self._timeout) as conn:
            rows = conn.execute(query).fetchall()
        return tuple(self._stored(row) for row in rows)

    def _describe(self, run_id: str) -> StoredRun | None:
        with self._reading(run_id) as pool, pool.connection(timeout=self._timeout) as conn:
            row = conn.execute(self._queries.describe_run, (run_key(run_id),)).fetchone()
        return None if row is None else self._stored(row)

    def _stored(self, row: TupleRow) -> StoredRun:
        column, finished, updated_at, owner, lease_until, claimed = row
        return StoredRun(
            run_id=self._run_id_of(column),
            finished=bool(finished),
            claimed=bool(claimed),
            updated_at=updated_at,
            owner=owner,
            lease_expires_at=lease_until,
        )

    def _run_id_of(self, column: str) -> str:
        """The run id whose ``run_id`` column value is ``column`` (undoes :func:`run_id_column`)."""
        try:
            run_id = json.loads(f'"{column}"')
        except ValueError:
            run_id = None
        if not isinstance(run_id, str):
            raise CorruptLog(
                f"unreadable run_id column {shown(column)}", location=f"{self._schema}.records"
            )
        return run_id

    @contextmanager
    def _reading(self, run_id: str | None) -> Iterator[ConnectionPool[Connection]]:
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)
        pool = self._ensure_ready(run_id)
        try:
            yield pool
        except psycopg.Error as exc:
            raise StoreError(f"read failed: {type(exc).__name__}: {exc}", run_id=run_id) from exc

    def _decode_row(self, run_id: str, index: int, row: TupleRow) -> Record:
        seq, column, kind, body = row
        location = f"{self._schema}.records run {shown(run_id)} seq {seq}"

        def corrupt(reason: str) -> CorruptLog:
            return CorruptLog(reason, run_id=run_id, location=location)

        if seq != index:
            raise corrupt(f"seq {index} is missing: the run's rows have a gap")
        try:
            record = serialization.loads(body, location=location)
        except CorruptLog as exc:
            if exc.run_id is not None:
                raise
            raise corrupt(exc.reason) from exc
        if record.run_id != run_id:
            raise corrupt(f"the row holds a record of run {shown(record.run_id)}")
        if column != run_id_column(run_id):
            raise corrupt(f"the row's run_id column says {shown(column)}")
        if record_kind(record) != kind:
            raise corrupt(f"the row says {kind!r} but holds a {record_kind(record)!r} record")
        return record

    # -- opening and closing (worker thread) ------------------------------------------------

    def _open_now(self) -> None:
        with self._reading(None):
            pass

    def _ensure_ready(self, run_id: str | None) -> ConnectionPool[Connection]:
        """The open pool, after checking (or creating) the schema once per store object."""
        with self._ready_lock:
            if self._state.closed:
                raise StoreError("the store is closed", run_id=run_id)
            pool = self._pool
            try:
                if pool is None:
                    pool = self._pool = self._open_pool()
                if not self._ready:
                    with pool.connection(timeout=self._timeout) as conn:
                        self._prepare_schema(conn, run_id)
                    self._ready = True
            except psycopg.Error as exc:
                raise StoreError(
                    f"cannot prepare the {self._schema!r} schema: {type(exc).__name__}: {exc}",
                    run_id=run_id,
                ) from exc
            return pool

    def _open_pool(self) -> ConnectionPool[Connection]:
        pool: ConnectionPool[Connection] = ConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=self._pool_size,
            open=False,
            timeout=self._timeout,
            kwargs={**self._connect, "autocommit": True, "fallback_application_name": _READER_NAME},
            configure=partial(set_statement_timeout, seconds=self._statement_timeout_s),
            check=ConnectionPool.check_connection,
            name=f"polyloop-{self._schema}",
        )
        try:
            pool.open(wait=True, timeout=self._timeout)
        except BaseException:
            pool.close()
            raise
        return pool

    def _prepare_schema(self, conn: Connection, run_id: str | None) -> None:
        """Create or upgrade what is missing (under a transaction-level advisory lock), then
        check the record format."""
        with conn.transaction():
            meta = self._meta(conn)
            if meta.get("layout") != LAYOUT:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (ddl_lock_key(self._schema),))
                meta = self._meta(conn)
                if meta.get("layout") != LAYOUT:  # another process may have just made them
                    self._create_tables(conn)
                    meta = self._meta(conn)
        self._check_format(meta.get("format"), run_id)

    def _create_tables(self, conn: Connection) -> None:
        """Create what is missing; a schema from before the runs table gets one, filled."""
        queries = self._queries
        for statement in (*queries.ddl, queries.fill_runs):
            conn.execute(statement)
        conn.execute(queries.set_meta, ("format", FORMAT))
        conn.execute(queries.set_meta, ("layout", LAYOUT))

    def _meta(self, conn: Connection) -> dict[str, str]:
        """The schema's meta rows (none if it has no tables yet)."""
        exists = _scalar(
            conn,
            sql.SQL("SELECT to_regclass(%s) IS NOT NULL"),
            (sql.Identifier(self._schema, "meta").as_string(conn),),
        )
        if not exists:
            return {}
        return dict(conn.execute(self._queries.get_meta).fetchall())

    def _check_format(self, recorded: object, run_id: str | None) -> None:
        check_format(
            recorded, holder="schema", run_id=run_id, location=f"{self._schema}.meta format"
        )

    def _close(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            writers, self._writers = self._writers, []
            for slot in self._slots.values():
                slot.claim = None
        self._lease.stop()
        for writer in writers:
            with writer.lock:
                writer.close()
        with self._owner_lock:
            owner_id, _, registered = self._lease.current()
            conn = self._owner_conn
            if registered and conn is not None and not (conn.broken or conn.closed):
                # Every run this owner still holds is free before this returns.
                with suppress(psycopg.Error):
                    conn.execute(self._queries.drop_owner, (owner_id, owner_id))
            self._close_owner_connection()
        with self._ready_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    async def _in_thread(self, func: Callable[..., _T], *args: object) -> _T:
        return await anyio.to_thread.run_sync(func, *args)


def _check_options(schema: str, pool_size: int, max_writers: int, timeout: float) -> None:
    if not schema or len(schema.encode()) > _MAX_IDENTIFIER_BYTES or "\x00" in schema:
        raise ValueError(f"schema must be 1 to {_MAX_IDENTIFIER_BYTES} bytes without NUL")
    if pool_size < 1 or max_writers < 1:
        raise ValueError("pool_size and max_writer_connections must be at least 1")
    if not timeout > 0:
        raise ValueError("timeout must be a positive number of seconds")


def _connect_options(conninfo: str, timeout: float, statement_timeout_s: float) -> dict[str, Any]:
    """Connection options added to ``conninfo`` unless it sets them itself: a connect
    timeout, and how long sent data may go unacknowledged before the connection is
    given up (so that a host or network that goes silent cannot hold a thread forever)."""
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        # The message would quote the string, which may hold a password.
        raise ValueError("conninfo is not a valid libpq connection string or URL") from None
    options: dict[str, Any] = {}
    if "connect_timeout" not in given:
        options["connect_timeout"] = max(1, math.ceil(timeout))
    if "tcp_user_timeout" not in given:
        options["tcp_user_timeout"] = max(1, math.ceil(statement_timeout_s * 1000))
    return options


def _scalar(
    conn: Connection, query: sql.SQL | sql.Composed, params: Sequence[object] | Mapping[str, object]
) -> Any:
    """The first column of the first row of ``query`` (``None`` if there is no row)."""
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]
