"""Followers of a store that cannot notify: one thread a store object, while anyone
follows, checks every followed run at once on a timer and wakes the followers of the
runs that changed (docs/following.md#how-each-store-wakes-a-follower)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

# How often the followed runs of a store that cannot notify are checked for news.
POLL_S = 0.05

# What each followed run looks like now, by run id: its length, its file's size; a run
# that is not there (not yet, or no more) may be left out.
Marks = Callable[[Collection[str]], Mapping[str, object]]


@dataclass(eq=False)
class _Follower:
    """One ``appended`` block, on its own event loop; ``seen`` is the thread's,
    ``changed`` and ``failed`` are set on the loop only."""

    token: anyio.lowlevel.EventLoopToken
    run_id: str
    seen: object
    check: Marks
    changed: anyio.Event = field(default_factory=anyio.Event)
    failed: bool = False

    def wake(self, failed: bool) -> None:
        self.failed = self.failed or failed
        self.changed.set()

    async def wait(self) -> None:
        """Return once the run may have changed since the last return (or the block began);
        after a failed check, check again here: its error is this follower's to raise."""
        await self.changed.wait()
        self.changed = anyio.Event()
        if self.failed:
            self.failed = False
            await anyio.to_thread.run_sync(self.check, (self.run_id,), abandon_on_cancel=True)


class Poller:
    """``appended`` for one store object: a thread runs while the object has followers;
    every :data:`POLL_S` it asks ``marks`` about every followed run in one call and wakes
    the followers whose run's mark moved. A failing check wakes every follower, to check
    again on its own loop (raising its own error)."""

    def __init__(self, marks: Marks) -> None:
        self._marks = marks
        self._lock = threading.Lock()  # the followers, and whether the thread runs
        self._followers: dict[str, list[_Follower]] = {}
        self._stopping: threading.Event | None = None  # the running thread's, if one runs

    def appended(self, run_id: str) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Watch the run while the block runs; it yields ``wait``."""
        return self._following(run_id)

    @asynccontextmanager
    async def _following(self, run_id: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        marks = await anyio.to_thread.run_sync(self._marks, (run_id,), abandon_on_cancel=True)
        token = anyio.lowlevel.current_token()
        follower = _Follower(token, run_id, marks.get(run_id), self._marks)
        self._join(follower)
        try:
            yield follower.wait
        finally:
            self._leave(follower)

    def _join(self, follower: _Follower) -> None:
        with self._lock:
            self._followers.setdefault(follower.run_id, []).append(follower)
            if self._stopping is not None:
                return
            self._stopping = stopping = threading.Event()
        thread = threading.Thread(
            target=self._poll_until_stopped, args=(stopping,), name="polyloop-poller", daemon=True
        )
        thread.start()

    def _leave(self, follower: _Follower) -> None:
        with self._lock:
            each = self._followers.get(follower.run_id, [])
            if follower in each:
                each.remove(follower)
            if not each:
                self._followers.pop(follower.run_id, None)
            if not self._followers and self._stopping is not None:
                self._stopping.set()
                self._stopping = None

    # -- the thread ----------------------------------------------------------------------

    def _poll_until_stopped(self, stopping: threading.Event) -> None:
        while not stopping.wait(POLL_S):
            with self._lock:
                followed = {run_id: list(each) for run_id, each in self._followers.items()}
            try:
                now = self._marks(followed)
            except Exception:  # noqa: BLE001 - each follower checks again, and raises
                woken = [(f, True) for each in followed.values() for f in each]
            else:
                woken = [
                    (f, False)
                    for run, each in followed.items()
                    for f in each
                    if now.get(run) != f.seen
                ]
                for follower, _ in woken:
                    follower.seen = now.get(follower.run_id)
            for follower, failed in woken:
                if stopping.is_set():
                    return
                self._hand(follower, failed)

    def _hand(self, follower: _Follower, failed: bool) -> None:
        try:
            anyio.from_thread.run_sync(follower.wake, failed, token=follower.token)
        except RuntimeError:
            self._leave(follower)  # its loop has ended
