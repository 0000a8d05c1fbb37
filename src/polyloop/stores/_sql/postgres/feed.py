"""A PostgreSQL store object's change feed: one ``LISTEN`` connection, in a thread of its
own while anyone waits, that wakes each waiter's event loop when the store's writes that
may let a run go on commit (docs/stores.md#change-notifications), and each follower of a
run when a batch that wrote the run commits (docs/following.md)."""

from __future__ import annotations

import contextlib
import logging
import math
import selectors
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
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
    """One ``changes()`` or ``appended()`` block, on its own event loop. Its events are set
    and replaced on that loop only; ``signalled`` (a wake is on its way) is set by the
    thread, cleared on the loop."""

    token: anyio.lowlevel.EventLoopToken
    channel: str | None  # a followed run's channel; None: the change feed's waiter
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
    """One thread listening, from its start until it is told to stop (its ``conn``,
    ``listening`` and ``failing`` change under the listener's lock)."""

    thread: threading.Thread | None = None
    conn: Watched | None = None
    # The channels listened on now (None: the change feed's): a waiter on one begins at once.
    listening: set[str | None] = field(default_factory=set)
    # The last attempt failed: a new waiter begins at once (woken once listening again).
    failing: bool = False
    stopping: threading.Event = field(default_factory=threading.Event)
    # Written to from a loop to wake the thread: a run's followers came or all went.
    poke: tuple[socket.socket, socket.socket] = field(default_factory=lambda: _pair())


class Listener:
    """Wakes the waiters of one store object on every notification of their channels.

    The thread runs while there is a waiter: it connects, listens on the change feed's
    channel and on the channel of each followed run, and hands each notification to the
    waiters' loops. A lost connection is opened again, and since notifications may have
    been missed meanwhile, every waiter is then woken once."""

    def __init__(self, settings: Settings, channel: str) -> None:
        self._settings = settings
        self._channel = channel
        self._lock = threading.Lock()  # everything below, and each session's state
        # Waiters by their channel (None: the change feed's), so that a notification finds
        # its waiters without looking at the others.
        self._waiters: dict[str | None, list[_Waiter]] = {}
        self._session: _Session | None = None
        self._closed = False

    def changes(self) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Listen while the block runs; the function it yields waits for a change."""
        return self._watching(None)

    def appended(self, channel: str) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Listen while the block runs; the function it yields waits for a committed batch
        that wrote the run whose followers' channel is ``channel``."""
        return self._watching(channel)

    @asynccontextmanager
    async def _watching(self, channel: str | None) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        waiter = _Waiter(token=anyio.lowlevel.current_token(), channel=channel)
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
        """On the loop: count ``waiter`` in, starting a thread if none runs, or asking the
        one that runs to listen on its channel."""
        with self._lock:
            if self._closed:
                raise store_closed()
            self._waiters.setdefault(waiter.channel, []).append(waiter)
            session = self._session
            if session is not None:
                if session.failing or waiter.channel in session.listening:
                    waiter.ready.set()
                else:
                    _poke(session)
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
            gone = waiter.channel is not None and waiter.channel not in self._waiters
            if gone and self._session is not None:
                _poke(self._session)  # its channel is listened on for nobody now
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
            _poke(session)
            if session.conn is not None:
                shut(session.conn)

    # -- the thread ----------------------------------------------------------------------

    def _listen_until_stopped(self, session: _Session) -> None:
        failures = 0
        try:
            while not session.stopping.is_set():
                failures = self._listen_once(session, failures)
        finally:
            for end in session.poke:
                end.close()

    def _listen_once(self, session: _Session, failures: int) -> int:
        """Connect, listen, and hand notifications on until the connection is lost or the
        session stops; the number of failures in a row after it."""
        conn = None
        try:
            conn = self._settings.connect("polyloop-listener")
            with self._lock:
                if session.stopping.is_set():
                    return failures
                session.conn = conn
            conn.deadline_s = math.inf  # waiting is all it does: keepalives watch the peer
            self._follow_waiters(session, conn, hand=False)  # the wake below lets them begin
            if failures:
                logger.info("listening for the store's changes again")
            self._wake(session)  # whatever committed while not listening
            self._hand_on(session, conn)
            return 0
        except Exception as exc:  # noqa: BLE001 - said once, and tried again
            if session.stopping.is_set():
                return failures
            return self._failed(session, failures, exc)
        finally:
            if conn is not None:
                with self._lock:
                    session.conn = None
                    session.listening = set()
                conn.close()

    def _hand_on(self, session: _Session, conn: Watched) -> None:
        """Wait on the connection and on pokes; hand each notification to its waiters."""
        poked = session.poke[0]
        with selectors.DefaultSelector() as selector:
            selector.register(poked, selectors.EVENT_READ)
            selector.register(conn.pgconn.socket, selectors.EVENT_READ)
            while not session.stopping.is_set():
                ready = {key.fileobj for key, _ in selector.select()}
                if poked in ready:
                    with contextlib.suppress(BlockingIOError):
                        poked.recv(4096)
                    self._follow_waiters(session, conn)
                if conn.pgconn.socket in ready:
                    for note in conn.notifies(timeout=0):
                        self._wake(session, self._channel_waiters(note.channel))

    def _follow_waiters(self, session: _Session, conn: Watched, *, hand: bool = True) -> None:
        """Listen on the change feed's channel and on each waiter's, and on no other; then
        (``hand``) let the waiters of the channels newly listened on begin."""
        with self._lock:
            wanted = {None, *self._waiters}
            now = set(session.listening)
        verbs = [("LISTEN", c) for c in wanted - now] + [("UNLISTEN", c) for c in now - wanted]
        if verbs:
            named = (
                sql.SQL(f"{verb} {{}}").format(sql.Identifier(c or self._channel))
                for verb, c in verbs
            )
            conn.execute(sql.SQL("; ").join(named))
        with self._lock:
            began = wanted - session.listening
            session.listening = wanted
            session.failing = False
            waiters = [w for channel in began for w in self._waiters.get(channel, ())]
        for waiter in waiters if hand else ():
            self._hand(waiter, changed=False)

    def _failed(self, session: _Session, failures: int, exc: Exception) -> int:
        """Say so once a streak, let every waiter begin (a new one waits for this), and pause."""
        if not failures:
            text = exception_text(exc)
            logger.warning("could not listen for the store's changes (%s); trying again", text)
        with self._lock:
            session.failing = True
            waiters = [waiter for each in self._waiters.values() for waiter in each]
        for waiter in waiters:
            self._hand(waiter, changed=False)
        session.stopping.wait(RETRY_S[min(failures, len(RETRY_S) - 1)])
        return failures + 1

    def _channel_waiters(self, channel: str) -> Callable[[], list[_Waiter]]:
        """The waiters a notification on ``channel`` is for (under the lock)."""
        key = None if channel == self._channel else channel
        return lambda: list(self._waiters.get(key, ()))

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
        each = self._waiters.get(waiter.channel, [])
        each.remove(waiter)
        if not each:
            del self._waiters[waiter.channel]


def _poke(session: _Session) -> None:
    """Wake the session's thread (a poke already on its way is enough)."""
    with contextlib.suppress(OSError):
        session.poke[1].send(b"\0")


def _pair() -> tuple[socket.socket, socket.socket]:
    pair = socket.socketpair()
    for end in pair:
        end.setblocking(False)
    return pair
