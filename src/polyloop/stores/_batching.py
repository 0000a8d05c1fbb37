"""Shared commits: the writes that wait at the same moment share one worker-thread hop.

:class:`GroupCommit` lets writes of different runs that wait at the same moment share
one commit: the first caller runs a batch in a worker thread; callers arriving while it
runs join the next batch, which starts as soon as the running one ends (or at once, for a
``GroupCommit`` allowed several batches in parallel). Every caller returns only after the
commit that holds its item, with that item's own error if it failed. Under light load
each item is a batch of its own; batches grow only when the threads are busy, which is
when sharing pays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

__all__ = ("GroupCommit",)

_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(eq=False)
class _Entry(Generic[_T]):
    item: _T
    error: BaseException | None = None


@dataclass(eq=False)
class _Batch(Generic[_T]):
    entries: list[_Entry[_T]] = field(default_factory=list)
    started: bool = False
    turn: anyio.Event = field(default_factory=anyio.Event)
    done: anyio.Event = field(default_factory=anyio.Event)


class GroupCommit(Generic[_T]):
    """Runs ``commit`` in a worker thread over every item waiting at the same moment.

    ``commit(items)`` is blocking and returns one entry per item: ``None`` when the
    item is durable, or the exception its caller must see. An exception escaping
    ``commit`` itself counts as every item's error. Must be used from one event loop.

    ``parallel`` batches may run at once (each in its own worker thread): one for a
    database connection, which commits one transaction at a time; more for files, whose
    syncs the disk can overlap. A batch starts at once while fewer are running, so under
    light load each item is its own batch, and batches grow only when the threads are
    busy.
    """

    __slots__ = ("_active", "_commit", "_open", "_parallel", "_running")

    def __init__(
        self,
        commit: Callable[[Sequence[_T]], Sequence[BaseException | None]],
        *,
        parallel: int = 1,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, not {parallel}")
        self._commit = commit
        self._parallel = parallel
        self._open: _Batch[_T] | None = None  # collecting; not started yet
        self._running: _Batch[_T] | None = None  # the batch started last, while it runs
        self._active = 0  # batches running

    @property
    def idle(self) -> bool:
        """No batch runs or waits."""
        return self._active == 0 and self._open is None

    async def submit(self, item: _T) -> None:
        """Return once ``item`` is committed; raise its error if its commit failed.

        Cancellation: a caller cancelled before its batch starts is taken out of the
        batch (nothing of it is written) and the cancellation propagates. Once its batch
        has started, the caller waits, shielded, for the commit to end and then the
        cancellation is delivered, so its item is committed (or failed) either way.
        """
        batch = self._open
        if batch is None:
            batch = self._open = _Batch()
            if self._active < self._parallel:
                batch.turn.set()
        entry = _Entry(item)
        batch.entries.append(entry)
        try:
            await batch.turn.wait()
        except anyio.get_cancelled_exc_class():
            if not batch.started:
                batch.entries.remove(entry)
                if not batch.entries and self._open is batch:
                    self._open = None  # an empty batch would keep ``idle`` false
                raise
            await self._wait_shielded(batch)
            raise
        if not batch.started:
            await self._lead(batch)
        else:
            await self._wait_shielded(batch)
        await anyio.lowlevel.checkpoint_if_cancelled()
        if entry.error is not None:
            raise entry.error

    async def _lead(self, batch: _Batch[_T]) -> None:
        batch.started = True
        if self._open is batch:
            self._open = None
        self._running = batch
        self._active += 1
        outcome_known = False
        try:
            # Shielded: a started batch runs, and is waited for, even if its leader is
            # cancelled (``run_sync`` alone may still raise before the thread starts,
            # and would leave every entry without its commit).
            with anyio.CancelScope(shield=True):
                errors = await anyio.to_thread.run_sync(self._commit_all, batch.entries)
            for entry, error in zip(batch.entries, errors, strict=True):
                entry.error = error
            outcome_known = True
        finally:
            if not outcome_known:
                for entry in batch.entries:
                    entry.error = RuntimeError("the commit ended without reporting its outcome")
            batch.done.set()
            self._active -= 1
            if self._running is batch:
                self._running = None
            following = self._open
            if following is not None:
                following.turn.set()

    def _commit_all(self, entries: Sequence[_Entry[_T]]) -> Sequence[BaseException | None]:
        try:
            return self._commit([entry.item for entry in entries])
        except Exception as exc:  # noqa: BLE001 -- every item shares the fate of the commit
            return [exc] * len(entries)

    @staticmethod
    async def _wait_shielded(batch: _Batch[_T]) -> None:
        with anyio.CancelScope(shield=True):
            await batch.done.wait()
