"""Shared commits: the writes waiting at one moment share one worker-thread hop, so
batches grow only while the threads are busy (docs/stores.md#durability-at-a-glance)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from anyio.lowlevel import EventLoopToken

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
    # Under the group's lock: the attempt that may run the commit, and its progress.
    attempt: int = 0
    running: bool = False
    returned: bool = False
    orphaned: bool = False


class GroupCommit(Generic[_T]):
    """Runs ``commit`` in a worker thread over every item waiting at the same moment, up to
    ``parallel`` batches at once; ``commit(items)`` returns an error or ``None`` per item.
    ``abandon(item)`` (on the event loop) lets a cancelled caller stop waiting after
    ``cancelled_wait_s``, the outcome unknown; the commit still runs to its end."""

    def __init__(
        self,
        commit: Callable[[Sequence[_T]], Sequence[BaseException | None]],
        *,
        parallel: int = 1,
        abandon: Callable[[_T], None] | None = None,
        cancelled_wait_s: float = math.inf,
    ) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, not {parallel}")
        self._commit = commit
        self._parallel = parallel
        self._abandon = abandon
        self._cancelled_wait_s = cancelled_wait_s if abandon is not None else math.inf
        self._open: _Batch[_T] | None = None  # collecting items, not started yet
        self._active = 0  # batches running
        self._lock = threading.Lock()  # between a commit's thread and its leader

    async def submit(self, item: _T) -> None:
        """Return once ``item`` is committed; raise its error if its commit failed.

        Cancellation: a caller cancelled before its batch starts is taken out of it
        (nothing of it is written) and the cancellation propagates. Once its batch has
        started, the caller waits, shielded, for the commit to end and then the
        cancellation is delivered, so its item is committed (or failed) either way;
        with ``abandon``, it waits ``cancelled_wait_s`` at most, then gives the item up."""
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
                    self._open = None  # nothing waits in it any more
                raise
        try:
            if batch.started:
                await batch.done.wait()
            else:
                await self._lead(batch)
        except anyio.get_cancelled_exc_class():
            with anyio.move_on_after(self._cancelled_wait_s, shield=True):
                await batch.done.wait()
            if not batch.done.is_set() and self._abandon is not None:
                self._abandon(entry.item)
            raise
        await anyio.lowlevel.checkpoint_if_cancelled()  # a cancellation held off comes now
        if entry.error is not None:
            raise entry.error

    async def _lead(self, batch: _Batch[_T]) -> None:
        """Start the batch's commit and wait for it; a leader cancelled meanwhile (with
        ``abandon``) leaves the commit's thread to end the batch."""
        batch.started = True
        if self._open is batch:
            self._open = None
        self._active += 1
        for entry in batch.entries:  # until the commit reports each outcome
            entry.error = RuntimeError("the commit ended without reporting its outcome")
        token = anyio.lowlevel.current_token()
        if self._abandon is None:
            await self._commit_shielded(batch, token)
            return
        try:
            await anyio.to_thread.run_sync(
                self._commit_all, batch, token, 0, abandon_on_cancel=True
            )
        except BaseException:
            with self._lock:
                ran, batch.orphaned = batch.running, batch.running and not batch.returned
                batch.attempt += 1  # a thread that has not begun it yet never will
            if not ran:  # cancelled before a thread took the commit: it must still run
                await self._commit_shielded(batch, token)
            elif not batch.orphaned:
                self._end(batch)
            raise
        self._end(batch)

    async def _commit_shielded(self, batch: _Batch[_T], token: EventLoopToken) -> None:
        try:
            with anyio.CancelScope(shield=True):  # started: it runs even if its leader is cancelled
                await anyio.to_thread.run_sync(self._commit_all, batch, token, batch.attempt)
        finally:
            self._end(batch)

    def _end(self, batch: _Batch[_T]) -> None:
        """The batch's commit returned: wake its callers and let the next batch go."""
        batch.done.set()
        self._active -= 1
        if self._open is not None:
            self._open.turn.set()

    def _commit_all(self, batch: _Batch[_T], token: EventLoopToken, attempt: int) -> None:
        with self._lock:
            if attempt != batch.attempt:
                return  # its leader was cancelled before this thread began, and runs it again
            batch.running = True
        entries = batch.entries
        try:
            try:
                errors = list(self._commit([entry.item for entry in entries]))
            except Exception as exc:  # noqa: BLE001 -- every item shares the fate of the commit
                errors = [exc] * len(entries)
            if len(errors) == len(entries):
                for entry, error in zip(entries, errors, strict=True):
                    entry.error = error
        finally:
            with self._lock:
                batch.returned = True
                orphaned = batch.orphaned
            if orphaned:
                # The loop may have finished meanwhile: then nobody waits for the batch.
                with contextlib.suppress(RuntimeError):
                    anyio.from_thread.run_sync(self._end, batch, token=token)
