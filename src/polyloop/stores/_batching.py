"""Shared commits: the writes waiting at one moment share one worker-thread hop, so
batches grow only while the threads are busy (docs/stores.md#durability-at-a-glance)."""

from __future__ import annotations

import functools
import math
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.lowlevel import EventLoopToken

_T = TypeVar("_T")
# How long a thread with nothing to commit waits for a batch before it ends.
_LINGER_S = 5.0
Serve = Callable[[Any, EventLoopToken], None]


@dataclass(eq=False)
class _Entry(Generic[_T]):
    item: _T
    error: BaseException | None = None


@dataclass(eq=False)
class _Batch(Generic[_T]):
    entries: list[_Entry[_T]] = field(default_factory=list)
    leading: bool = False  # a caller is about to start it
    started: bool = False
    done: anyio.Event = field(default_factory=anyio.Event)


class GroupCommit(Generic[_T]):
    """Runs ``commit`` in a worker thread over every item waiting at the same moment, up to
    ``parallel`` batches at once; ``commit(items)`` returns an error or ``None`` per item.
    ``abandon(item)`` (on the event loop) lets a cancelled caller stop waiting after
    ``cancelled_wait_s``, the outcome unknown; the commit still runs to its end.

    A caller waits for one event, its batch's end: the loop hands a batch to a thread of
    the group's own, which commits it and, from the loop, ends it and takes the next
    (record 0065). Every change of the group's state is made on the event loop."""

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
        self._active = 0  # batches started and not ended
        self._idle = _Idle()

    async def submit(self, item: _T) -> None:
        """Return once ``item`` is committed; raise its error if its commit failed.

        Cancellation: a caller cancelled before its batch starts is taken out of it
        (nothing of it is written) and the cancellation propagates. Once its batch has
        started, the caller waits, shielded, for the commit to end and then the
        cancellation is delivered, so its item is committed (or failed) either way;
        with ``abandon``, it waits ``cancelled_wait_s`` at most, then gives the item up."""
        await anyio.lowlevel.checkpoint_if_cancelled()  # no wake-up unless cancelled already
        batch = self._open
        if batch is None:
            batch = self._open = _Batch()
        entry = _Entry(item)
        batch.entries.append(entry)
        try:
            if not batch.leading and self._active < self._parallel:
                batch.leading = True  # a thread is free: this caller starts the batch
                await anyio.lowlevel.checkpoint()  # after the writes of this moment joined it
                if not batch.started:
                    self._hand_on(self._start(batch))
            await batch.done.wait()
        except anyio.get_cancelled_exc_class():
            if not batch.started:
                self._leave(batch, entry)
                raise
            with anyio.move_on_after(self._cancelled_wait_s, shield=True):
                await batch.done.wait()
            if not batch.done.is_set() and self._abandon is not None:
                self._abandon(entry.item)
            raise
        await anyio.lowlevel.checkpoint_if_cancelled()  # a cancellation held off comes now
        if entry.error is not None:
            raise entry.error

    def _leave(self, batch: _Batch[_T], entry: _Entry[_T]) -> None:
        """Take a cancelled caller's item out of a batch not started, which its others
        still wait in: started now if its leader was the one cancelled."""
        batch.entries.remove(entry)
        if not batch.entries:
            if self._open is batch:
                self._open = None  # nothing waits in it any more
        elif batch.leading and self._active < self._parallel:
            self._hand_on(self._start(batch))

    def _start(self, batch: _Batch[_T]) -> _Batch[_T]:
        """Close ``batch`` to newcomers and count it running (on the loop)."""
        batch.started = True
        if self._open is batch:
            self._open = None
        self._active += 1
        for entry in batch.entries:  # until the commit reports each outcome
            entry.error = RuntimeError("the commit ended without reporting its outcome")
        return batch

    def _hand_on(self, batch: _Batch[_T]) -> None:
        """Have a thread commit the started ``batch``; if none can, fail it at once."""
        try:
            self._idle.serve(batch, anyio.lowlevel.current_token(), self._run)
        except BaseException as exc:  # no thread could start: its callers get the error
            for entry in batch.entries:
                entry.error = exc
            batch.done.set()
            self._active -= 1
            raise

    def _end(self, batch: _Batch[_T]) -> _Batch[_T] | None:
        """The batch's commit returned (on the loop): wake its callers; the next batch to
        commit in the same thread, if one waits."""
        batch.done.set()
        self._active -= 1
        waiting = self._open
        return self._start(waiting) if waiting is not None else None

    def _run(self, batch: _Batch[_T], token: EventLoopToken) -> None:
        """Commit batches in this thread until none waits (a worker thread)."""
        following: _Batch[_T] | None = batch
        while following is not None:
            self._commit_all(following)
            try:
                following = anyio.from_thread.run_sync(self._end, following, token=token)
            except RuntimeError:
                return  # the loop has finished: nobody waits any more

    def _commit_all(self, batch: _Batch[_T]) -> None:
        entries = batch.entries
        try:
            errors = list(self._commit([entry.item for entry in entries]))
        except BaseException as exc:  # noqa: BLE001 -- its own thread: every item fails with it
            errors = [exc] * len(entries)
        if len(errors) == len(entries):
            for entry, error in zip(entries, errors, strict=True):
                entry.error = error


class _Idle:
    """The group's threads with nothing to commit: each waits ``_LINGER_S`` for a batch,
    then ends; a batch with no thread waiting starts a new one."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._waiting = 0  # threads waiting, less the batches handed to them not yet taken
        self._handed: queue.SimpleQueue[tuple[Any, EventLoopToken, Serve]] = queue.SimpleQueue()

    def serve(self, batch: Any, token: EventLoopToken, run: Serve) -> None:
        """Have ``run(batch, token)`` called in an idle thread, or a new one."""
        if self._pid != os.getpid():  # a forked child has none of its parent's threads
            self._reset()
        with self._lock:
            if self._waiting:
                self._waiting -= 1
                self._handed.put((batch, token, run))
                return
        work = functools.partial(self._work, batch, token, run)
        threading.Thread(target=work, name="polyloop-commit", daemon=True).start()

    def _work(self, batch: Any, token: EventLoopToken, run: Serve) -> None:
        while True:
            run(batch, token)
            with self._lock:
                self._waiting += 1
            try:
                batch, token, run = self._handed.get(timeout=_LINGER_S)
            except queue.Empty:
                with self._lock:
                    try:  # handed while the wait timed out
                        batch, token, run = self._handed.get_nowait()
                    except queue.Empty:
                        self._waiting -= 1
                        return
