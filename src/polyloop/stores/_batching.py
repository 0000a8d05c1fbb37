"""Shared commits: the writes waiting at one moment share one worker-thread hop, so
batches grow only while the threads are busy (research records 0013 and 0019)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

_T = TypeVar("_T")


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
    """Runs ``commit`` in a worker thread over every item waiting at the same moment, up to
    ``parallel`` batches at once. ``commit(items)`` returns, per item, ``None`` once it is
    durable or the error its caller must see; what it raises is every item's error."""

    __slots__ = ("_active", "_commit", "_open", "_parallel")

    def __init__(
        self, commit: Callable[[Sequence[_T]], Sequence[BaseException | None]], *, parallel: int = 1
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, not {parallel}")
        self._commit = commit
        self._parallel = parallel
        self._open: _Batch[_T] | None = None  # collecting items, not started yet
        self._active = 0  # batches running

    @property
    def idle(self) -> bool:
        """No batch runs or waits."""
        return self._active == 0 and self._open is None

    async def submit(self, item: _T) -> None:
        """Return once ``item`` is committed; raise its error if its commit failed.

        Cancellation: a caller cancelled before its batch starts is taken out of it
        (nothing of it is written) and the cancellation propagates. Once its batch has
        started, the caller waits, shielded, for the commit to end and then the
        cancellation is delivered, so its item is committed (or failed) either way."""
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
        if not batch.started:
            await self._lead(batch)
        with anyio.CancelScope(shield=True):
            await batch.done.wait()
        await anyio.lowlevel.checkpoint_if_cancelled()  # a cancellation held off comes now
        if entry.error is not None:
            raise entry.error

    async def _lead(self, batch: _Batch[_T]) -> None:
        batch.started = True
        if self._open is batch:
            self._open = None
        self._active += 1
        for entry in batch.entries:  # until the commit reports each outcome
            entry.error = RuntimeError("the commit ended without reporting its outcome")
        try:
            with anyio.CancelScope(shield=True):  # started: it runs even if its leader is cancelled
                await anyio.to_thread.run_sync(self._commit_all, batch.entries)
        finally:
            batch.done.set()
            self._active -= 1
            if self._open is not None:
                self._open.turn.set()

    def _commit_all(self, entries: Sequence[_Entry[_T]]) -> None:
        try:
            errors = list(self._commit([entry.item for entry in entries]))
        except Exception as exc:  # noqa: BLE001 -- every item shares the fate of the commit
            errors = [exc] * len(entries)
        if len(errors) == len(entries):
            for entry, error in zip(entries, errors, strict=True):
                entry.error = error
