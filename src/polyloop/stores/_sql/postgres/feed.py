"""A PostgreSQL store object's change feed: one ``LISTEN`` connection, in a thread of its
own while anyone waits, that wakes each waiter's event loop when the store's writes that
may let a run go on commit (docs/stores.md#change-notifications), and each follower of a
run when a batch that wrote the run commits (docs/following.md)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from psycopg import sql

from polyloop._shared import exception_text
from polyloop.stores._sql.postgres.connection import Settings, Watched, shut
from polyloop.stores._writes import store_closed

logger = logging.getLogger("polyloop")

# How long leaving the feed waits for its thread: at once, unless it is connecting to a
# server that does not answer (the attempt then ends on its own, within ``timeout``).
LEAVE_WAIT_S = 1.0
# Pauses between attempts to listen again after a loss, the last one repeated.
RETRY_S = (0.05, 0.25, 1.0, 2.0, 5.0)


@dataclass(eq=False)
class _Waiter:
    """One ``changes()`` block, on its own event loop. Its events are set and replaced on
    that loop only; ``signalled`` (a wake is on its way) is set by the thread, cleared on
    the loop."""

    token: anyio.lowlevel.EventLoopToken
    run: str | None  # a followed run's ``run_id`` column; None: the change feed's waiter
    ready: anyio.Event = field(default_factory=anyio.Event)  # the block may begin
    changed: anyio.Event = field(default_factory=anyio.Event)
    signalled: bool = False

    def wake(self, changed: bool) -> None:
        """On the loop: the block may begin, and (``changed``) the caller should list."""
        self.ready.set()
        if changed:
            self.changed.set()

    def reset(self) -> None:
        """On the loop: everything so far has been seen (the caller lists next)."""
        self.signalled = False
        self.changed = anyio.Event()

    async def wait(self) -> None:
        """Return once a change may have committed since the last return (or the block began)."""
        await self.changed.wait()
        self.reset()


@dataclass(eq=False)
class _Session:
    """One thread listening, from its start until it is told to stop (its ``conn`` and
    ``tried`` change under the listener's lock)."""

    thread: threading.Thread | None = None
    conn: Watched | None = None
    # Its first attempt ended: a new waiter begins at once (woken later, if it failed).
    tried: bool = False
    stopping: threading.Event = field(default_factory=threading.Event)


class Listener:
    """Wakes the waiters of one store object on every notification of its channel.

    The thread runs while there is a waiter: it connects, listens, and hands each
    notification to the waiters' loops. A lost connection is opened again, and since
    notifications may have been missed meanwhile, every waiter is then woken once."""

    def __init__(self, settings: Settings, listen: sql.Composed, appended_channel: str) -> None:
        self._settings = settings
        self._listen = listen  # both channels: the change feed's and the appended records'
        self._appended = appended_channel
        self._lock = threading.Lock()  # everything below, and each session's conn and state
        # Waiters by what they wait for: a followed run's column, or None (the feed's),
        # so that a notification finds its waiters without looking at the others.
        self._waiters: dict[str | None, list[_Waiter]] = {}
        self._session: _Session | None = None
        self._closed = False

    def changes(self) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Listen while the block runs; the function it yields waits for a change."""
        return self._watching(None)

    def appended(self, run: str) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Listen while the block runs; the function it yields waits for a committed batch
        that wrote the run whose ``run_id`` column is ``run``."""
        return self._watching(run)

    @asynccontextmanager
    async def _watching(self, run: str | None) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        waiter = _Waiter(token=anyio.lowlevel.current_token(), run=run)
        self._join(waiter)
        try:
            await waiter.ready.wait()
            waiter.reset()  # the caller lists after this: nothing before it is news
            yield waiter.wait
        finally:
            session = self._leave(waiter)
            if session is not None and session.thread is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(session.thread.join, LEAVE_WAIT_S)

    def close(self) -> None:
        """Stop listening for good (blocking: waits for the thread, within ``timeout``)."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            self._stop(session)
            if session.thread is not None:
                session.thread.join(self._settings.timeout)

    def _join(self, waiter: _Waiter) -> None:
        """On the loop: count ``waiter`` in, starting a thread if none runs."""
        with self._lock:
            if self._closed:
                raise store_closed()
            self._waiters.setdefault(waiter.run, []).append(waiter)
            session = self._session
            if session is not None:
                if session.tried:
                    waiter.ready.set()
                return
            session = self._session = _Session()
            session.thread = threading.Thread(
                target=self._listen_until_stopped,
                args=(session,),
                name="polyloop-listener",
                daemon=True,
            )
        session.thread.start()

    def _leave(self, waiter: _Waiter) -> _Session | None:
        """Count ``waiter`` out; the session told to stop, if it was the last."""
        with self._lock:
            self._forget(waiter)
            if self._waiters or self._session is None:
                return None
            session, self._session = self._session, None
        self._stop(session)
        return session

    def _stop(self, session: _Session) -> None:
        """Tell ``session`` to stop; the connection it waits on is shut, so it wakes at once
        (under the lock: the thread closes the connection only after letting go of it)."""
        with self._lock:
            session.stopping.set()
            if session.conn is not None:
                shut(session.conn)

    # -- the thread ----------------------------------------------------------------------

    def _listen_until_stopped(self, session: _Session) -> None:
        failures = 0
        while not session.stopping.is_set():
            conn = None
            try:
                conn = self._settings.connect("polyloop-listener")
                with self._lock:
                    if session.stopping.is_set():
                        break
                    session.conn = conn
                conn.execute(self._listen)
                conn.deadline_s = math.inf  # waiting is all it does: keepalives watch the peer
                with self._lock:
                    session.tried = True
                if failures:
                    logger.info("listening for the store's changes again")
                failures = 0
                self._wake(session)  # whatever committed while not listening
                for note in conn.notifies():
                    self._wake(session, self._woken(note.channel, note.payload))
            except Exception as exc:  # noqa: BLE001 - said once, and tried again
                if not session.stopping.is_set():
                    failures = self._failed(session, failures, exc)
            finally:
                if conn is not None:
                    with self._lock:
                        session.conn = None
                    conn.close()

    def _failed(self, session: _Session, failures: int, exc: Exception) -> int:
        """Say so once a streak, let every waiter begin (a new one waits for this), and pause."""
        if not failures:
            text = exception_text(exc)
            logger.warning("could not listen for the store's changes (%s); trying again", text)
        with self._lock:
            session.tried = True
            waiters = [waiter for each in self._waiters.values() for waiter in each]
        for waiter in waiters:
            self._hand(waiter, changed=False)
        session.stopping.wait(RETRY_S[min(failures, len(RETRY_S) - 1)])
        return failures + 1

    def _woken(self, channel: str, payload: str) -> Callable[[], list[_Waiter]]:
        """Which waiters a notification is for (under the lock): the change feed's, or the
        followers of the runs it names, one a line (all of them if it names none: too many
        for its payload)."""
        if channel != self._appended:
            runs: Iterable[str | None] = (None,)
        elif payload:
            runs = set(payload.split("\n"))
        else:
            return lambda: [w for run, each in self._waiters.items() if run for w in each]
        return lambda: [waiter for run in runs for waiter in self._waiters.get(run, ())]

    def _wake(self, session: _Session, woken: Callable[[], list[_Waiter]] | None = None) -> None:
        """Hand a change to the loop of every waiter it is for, unless one is on its way
        already; ``None``, after a loss: to every waiter, always (the one on its way may
        have been taken before the loss)."""
        missed = woken is None
        with self._lock:
            if woken is None:
                waiters = [waiter for each in self._waiters.values() for waiter in each]
            else:
                waiters = woken()
        for waiter in waiters:
            if session.stopping.is_set():
                return
            if waiter.signalled and not missed:
                continue  # its loop has not taken the last wake yet: this change is in it
            waiter.signalled = True
            self._hand(waiter, changed=True)

    def _hand(self, waiter: _Waiter, *, changed: bool) -> None:
        try:
            anyio.from_thread.run_sync(waiter.wake, changed, token=waiter.token)
        except RuntimeError:
            with self._lock, contextlib.suppress(ValueError):
                self._forget(waiter)  # its loop has ended

    def _forget(self, waiter: _Waiter) -> None:
        """Count ``waiter`` out (under the lock); ``ValueError`` if it was not in."""
        each = self._waiters.get(waiter.run, [])
        each.remove(waiter)
        if not each:
            del self._waiters[waiter.run]
