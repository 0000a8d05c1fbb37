"""The SQLite store: every run in one database file, committed in shared transactions.

Tables ``meta`` (the record format), ``records`` (one row per record, its body the line
:func:`polyloop.serialization.dumps` writes) and ``runs`` (one row per run: where its
log stands, whether it finished, its writer and claim epoch); ``docs/stores.md``
describes them for users. The database runs in WAL mode: starts and intents commit with
``synchronous=FULL``, every other write with ``NORMAL`` unless a barrier shares its
commit. Each write moves its run's row on in the same transaction, under the writer's
claim epoch, or is rolled back whole. SQLite is a store for one host: a claim is a lock
the operating system keeps for a living process, with no lease. Research records 0010
(durability), 0017 (claims), 0019 (one write path, off the event loop) and 0032 (claims
by locks) say why.

Every blocking call runs in a worker thread, on one connection guarded by the store
mutex: the writes waiting at the same moment share one ``BEGIN IMMEDIATE`` ... ``COMMIT``
(:class:`~polyloop.stores._batching.GroupCommit`), one savepoint per write, so a refused
write rolls back alone. The store class keeps the public methods;
:mod:`~polyloop.stores._sqlite_commit` commits, :mod:`~polyloop.stores._sqlite_claims`
keeps the claims, and :mod:`~polyloop.stores._sqlite_sql` holds the statements and
opens the database.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import WriterState, claim_in_thread
from polyloop.stores._sqlite_claims import Claims
from polyloop.stores._sqlite_commit import Committer
from polyloop.stores._sqlite_sql import (
    DESCRIBE_RUN,
    LIST_RUNS,
    LIST_UNFINISHED,
    SELECT_RUN,
    Database,
    Write,
    decode_rows,
    record_row,
    run_id_of,
    run_key,
)
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

__all__ = ("SqliteStore",)


class SqliteStore:
    """Keeps runs in one SQLite database file (WAL; intents and starts fsync'd).

    ``path`` names the database file; missing parent directories are created, each
    synced into its parent, and one that cannot be made is a ``StoreError`` naming it.
    Runs survive the store object, the process and the machine: a new store object on
    the same file (or a copy moved elsewhere) reads and resumes them. It is a store for
    one host: a claim is a lock on one byte of a lock file in the sibling directory
    ``<path>.claims``, which the operating system keeps for the living process that
    took it. A killed process's runs are free at once; a hung one keeps them until it
    is killed. The store is an async context manager; :meth:`aclose` gives up every
    claim and closes its connection.

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its shared commit started
    writes nothing; once the commit started, the call waits for it, shielded, then lets
    the cancellation go on (its rows are committed, or it failed). Reads change nothing;
    closing completes even in a cancelled scope.
    """

    __slots__ = ("_claims", "_committer", "_database", "_group", "_state")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._state = WriterState()
        self._database = Database(Path(os.fspath(path)), self._state)  # opened at first use
        self._claims = Claims(self._database)
        self._committer = Committer(self._database, self._claims)
        self._group = GroupCommit(self._committer.commit)

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the path."""
        return {"kind": "sqlite", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Take the run's lock, then name this store object in the run's row and move
        its claim epoch on; ``RunLocked`` if a living process, this store object
        included, holds it."""
        claims = self._claims
        await claim_in_thread(
            partial(claims.claim, run_id), partial(claims.unclaim, run_id), run_id=run_id
        )

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (the row of a run never started goes)."""
        if run_id in self._claims.claims:
            await anyio.to_thread.run_sync(self._claims.unclaim, run_id)

    async def check_claim(self, run_id: str) -> None:
        """Pass if this store object holds the run's claim: a lock with no lease, held
        as long as this process lives."""
        self._claims.held(run_id)

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

    async def write_review(self, record: Review) -> None:
        """Write a proposal, verdict or settlement; fsync'd when this returns (a barrier)."""
        await self._write(Write(record.run_id, [record_row(record)], barrier=True))

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
        the locks: a claim is held while a living process holds the run's lock.
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
        candidates = await anyio.to_thread.run_sync(self._claims.prunable, before)
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
        return f"SqliteStore({os.fspath(self._database.path)!r})"

    # -- writing, pruning, closing (worker threads) -----------------------------------------

    async def _write(self, write: Write) -> None:
        await self._group.submit(write)

    async def _delete_claimed(self, run_id: str, *, before: float) -> bool:
        return await anyio.to_thread.run_sync(self._claims.delete, run_id, before)

    def _open_now(self) -> None:
        with self._state.mutex, self._database.reading(None):
            self._database.connection(None)

    def _close(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            self._claims.close()  # every claim given up before the connection goes
            self._database.close()

    # -- reading (worker thread) ------------------------------------------------------------

    def _read(self, run_id: str) -> tuple[Record, ...]:
        """Query under the store mutex, decode after releasing it."""
        return decode_rows(self._database.path.name, run_id, self._select(SELECT_RUN, run_id))

    def _list(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        return self._stored(self._select(LIST_UNFINISHED if unfinished_only else LIST_RUNS))

    def _describe(self, run_id: str) -> StoredRun | None:
        rows = self._select(DESCRIBE_RUN, run_id)
        return self._stored(rows)[0] if rows else None

    def _select(self, query: str, run_id: str | None = None) -> list[tuple[Any, ...]]:
        """The rows of ``query`` (about ``run_id``, if given), under the store mutex."""
        parameters = () if run_id is None else (run_key(run_id),)
        with self._state.mutex, self._database.reading(run_id):
            return self._database.connection(run_id).conn.execute(query, parameters).fetchall()

    def _stored(self, rows: list[tuple[Any, ...]]) -> tuple[StoredRun, ...]:
        """Rows of the runs table; a run whose row names a writer is asked of its lock."""
        named = [run_id_of(key) for key, _, _, owner in rows if owner is not None]
        claimed = dict(zip(named, self._claims.claimed(named), strict=True))
        return tuple(
            StoredRun(
                run_id=run_id_of(key),
                finished=bool(finished),
                claimed=claimed.get(run_id_of(key), False),
                updated_at=datetime.fromtimestamp(updated_at, UTC),
                owner=owner,
            )
            for key, finished, updated_at, owner in rows
        )
