"""The one engine of the durable stores: the store port over a backend.

What ``JsonlStore``, ``SqliteStore`` and ``PostgresStore`` do alike is written here once:
the public methods, the one value each write becomes (:class:`Write`), the hops to worker
threads, pruning under claims, closing. A backend supplies what differs: where records
live (files, a database), how they are read, and how a run is claimed (a locked byte, or
an owner with a lease). Every blocking call of a backend runs in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Protocol, Self

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.lowlevel import EventLoopToken

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._common import ClosedOnExit, Write, claim_in_thread, record_row
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

__all__ = ("Backend", "EngineStore")


class Backend(Protocol):
    """What the engine needs of a store's backend. Every method but :meth:`submit`,
    :meth:`confirm` and :meth:`holds` blocks, and runs in a worker thread."""

    kind: str

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        """Become the run's writer, or raise ``RunLocked``."""

    def release(self, run_id: str) -> None:
        """Give the claim up, writing no record."""

    def holds(self, run_id: str) -> bool:
        """Whether this store object holds the run's claim (no I/O)."""

    async def confirm(self, run_id: str) -> None:
        """Return only if an effect of the run may start now (``check_claim``)."""

    async def submit(self, write: Write) -> None:
        """Commit ``write``, in a shared commit, before returning."""

    def read(self, run_id: str) -> tuple[Record, ...]:
        """Every record of the run, each checked against where it is kept."""

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        """Every started run (only unfinished ones if asked), in the order they started."""

    def describe(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`runs` lists it."""

    def prunable(self, cutoff: datetime) -> list[str]:
        """The runs nobody holds that finished, not in doubt, before ``cutoff``."""

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        """Delete a run this object holds the claim of, if it still may go."""

    def open(self) -> None:
        """Open and check the store now rather than at first use."""

    def close(self) -> None:
        """Give up every claim, then release every resource."""


class EngineStore(ClosedOnExit):
    """The store port over a :class:`Backend`; each durable store only chooses its
    backend and says what it promises."""

    __slots__ = ("_backend",)

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never where the data is, so moved data
        still resumes."""
        return {"kind": self._backend.kind, "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Become the run's writer and move its claim epoch on; ``RunLocked`` (naming the
        holder where the database knows it) if a living writer, this object included,
        holds it."""
        backend, token = self._backend, anyio.lowlevel.current_token()
        await claim_in_thread(
            partial(backend.claim, run_id, token), partial(backend.release, run_id), run_id=run_id
        )

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (a run never started leaves no trace)."""
        if self._backend.holds(run_id):
            await anyio.to_thread.run_sync(self._backend.release, run_id)

    async def check_claim(self, run_id: str) -> None:
        """Return only if an effect of the run may start now under this object's claim
        (``RunLocked``, ``LeaseLost`` or ``StoreError`` otherwise); sends no statement."""
        await self._backend.confirm(run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the run's first record, a durable barrier; ``RunAlreadyExists`` if the
        run has any record."""
        await self._backend.submit(
            Write(record.run_id, [record_row(record)], start=True, barrier=True)
        )

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent, a durable barrier."""
        await self._backend.submit(Write(intent.run_id, [record_row(intent)], barrier=True))

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call; committed, not necessarily durable."""
        await self._backend.submit(Write(result.run_id, [record_row(result)]))

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record in one transaction."""
        if action_result is None:
            await self._backend.submit(Write(step.run_id, [record_row(step)]))
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._backend.submit(
            Write(step.run_id, [record_row(action_result), record_row(step)])
        )

    async def write_review(self, record: Review) -> None:
        """Write a proposal, verdict or settlement, a durable barrier like an intent."""
        await self._backend.submit(Write(record.run_id, [record_row(record)], barrier=True))

    async def end_run(self, record: RunEnded) -> None:
        """Write the run's end record and give up the claim, in one transaction."""
        await self._backend.submit(
            Write(
                record.run_id,
                [record_row(record)],
                end=True,
                final=record.is_final,
                reason=record.stop_reason.value,
            )
        )

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id`` in write order; empty if the run has none.

        Raises ``CorruptLog`` (naming the line or row) for a record that does not decode
        or does not belong where it is, and ``SchemaMajorMismatch`` for another record
        format. Readers never need the claim.
        """
        records = await anyio.to_thread.run_sync(self._backend.read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run (only unfinished ones if asked): in the order the runs started in a
        database, where the unfinished ones come from an index that holds only them; by
        id in a directory of run files."""
        return await anyio.to_thread.run_sync(self._backend.runs, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no record."""
        return await anyio.to_thread.run_sync(self._backend.describe, run_id)

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before``; their ids.

        A run that is unfinished, ended in doubt, or claimed is never touched: each run
        is deleted under its claim, by a statement that checks again that it finished
        before the cutoff. With ``archive``, each run's log is first written durably to
        that directory, as a :class:`~polyloop.stores.JsonlStore` keeps it. Safe while
        workers run.
        """
        cutoff = check_cutoff(finished_before)
        candidates = await anyio.to_thread.run_sync(self._backend.prunable, cutoff)
        return await prune_runs(
            self,
            candidates,
            archive=Path(archive) if archive is not None else None,
            delete=partial(self._delete_claimed, cutoff=cutoff),
        )

    async def aclose(self) -> None:
        """Give up every claim and close every connection or file. Idempotent.

        Cancellation: closing runs shielded, so it completes even in a cancelled scope.
        """
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._backend.close)

    async def __aenter__(self) -> Self:
        """Open and check the store now rather than at first use."""
        await anyio.to_thread.run_sync(self._backend.open)
        return self

    async def _delete_claimed(self, run_id: str, *, cutoff: datetime) -> bool:
        return await anyio.to_thread.run_sync(self._backend.delete, run_id, cutoff)
