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
on a connection at the same moment are one batch, one statement, which moves each run's
row on under its epoch and inserts its records, or refuses the run. Every call runs in a
worker thread on plain blocking psycopg connections (psycopg's async API is tied to
asyncio), so the store serves asyncio and Trio alike; a store object must be used from
one event loop at a time.

The class below only delegates. Its collaborators each hold one job:
:mod:`~polyloop.stores._postgres_connect` (the checked options, opening a connection),
:mod:`~polyloop.stores._postgres_read` (the reader pool, the schema, reading),
:mod:`~polyloop.stores._postgres_owners` (the owner, its lease, its claims),
:mod:`~polyloop.stores._postgres_writers` (which writer connection a run uses),
:mod:`~polyloop.stores._postgres_batch` (committing a batch) and
:mod:`~polyloop.stores._postgres_sql` (the statements).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._common import WriterState, claim_in_thread
from polyloop.stores._postgres_batch import Committer, Item, Mode, Probe
from polyloop.stores._postgres_connect import Settings
from polyloop.stores._postgres_owners import Claims, Owner
from polyloop.stores._postgres_read import Reader
from polyloop.stores._postgres_sql import Queries, record_row
from polyloop.stores._postgres_writers import Writers
from polyloop.types import (
    Intent,
    JSONValue,
    Record,
    Result,
    Review,
    RunEnded,
    RunLog,
    RunStarted,
    StepRecord,
    StoreError,
)

__all__ = ("PostgresStore",)

_T = TypeVar("_T")


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

    __slots__ = ("_claims", "_owner", "_reader", "_settings", "_writers")

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
        self._settings = settings = Settings.checked(
            conninfo,
            schema=schema,
            pool_size=pool_size,
            max_writers=max_writer_connections,
            timeout=timeout,
            lease_s=lease_s,
            statement_timeout_s=statement_timeout_s,
        )
        queries = Queries.for_schema(schema)
        state = WriterState()  # the runs that failed, and whether the store is closed
        self._reader = Reader(settings, queries, state)
        self._owner = Owner(settings, queries, state)
        # ``_probe`` is a test seam: it sees each batch just before its commit.
        committer = Committer(state, queries, self._owner.lease, _probe)
        self._writers = Writers(settings, state, committer)
        self._claims = Claims(self._owner, self._writers, self._reader, queries, state)

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
            partial(self._claims.claim, run_id, token),
            partial(self._claims.release, run_id),
            run_id=run_id,
        )

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (the row of a run never started goes)."""
        if self._claims.held(run_id):
            await self._in_thread(self._claims.release, run_id)

    async def check_claim(self, run_id: str) -> None:
        """Pass if this store object holds the run's claim with its lease's margin to
        spare, by this process's clock (``LeaseLost`` otherwise): no statement is sent.
        A late lease is waited on while its renewal may still come."""
        claim = self._claims.claim_of(run_id)
        await self._owner.lease.confirm(claim.generation, run_id)

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

    async def write_review(self, record: Review) -> None:
        """Write a proposal, verdict or settlement, a durable barrier like an intent."""
        await self._write(record.run_id, [record], "append", barrier=True)

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
        records = await self._in_thread(self._reader.read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run, in the order the runs started (only unfinished ones if asked).

        Read from the table of runs; the unfinished ones through an index that holds
        only them, so finished runs cost nothing. Whether a run is claimed is read from
        the server's advisory locks.
        """
        return await self._in_thread(self._reader.runs, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no row."""
        return await self._in_thread(self._reader.describe, run_id)

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
        candidates = await self._in_thread(self._reader.prunable, cutoff)
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
        await self._in_thread(self._reader.open)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self._settings.schema!r})"

    # -- the one write path -----------------------------------------------------------------

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
        self._owner.lease.beat()
        with self._writers.used(run_id) as slot:
            await slot.writer.group.submit(Item(slot, rows, mode, barrier, final, reason))

    # -- worker threads ---------------------------------------------------------------------

    async def _delete_claimed(self, run_id: str, *, cutoff: datetime) -> bool:
        return await self._in_thread(self._claims.delete, run_id, cutoff)

    def _close(self) -> None:
        """Refuse new work, stop the lease, close the writers, free the owner's runs,
        close the pool: in this order, so that nothing is written once the runs are free."""
        writers = self._writers.close()
        self._owner.lease.stop()
        for writer in writers:
            with writer.lock:
                writer.close()
        self._owner.close()
        self._reader.close()

    async def _in_thread(self, func: Callable[..., _T], *args: object) -> _T:
        return await anyio.to_thread.run_sync(func, *args)
