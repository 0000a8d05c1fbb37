"""A deadline on the client side of every PostgreSQL statement.

Neither the server's ``statement_timeout`` nor TCP's ``tcp_user_timeout`` ends a wait on
a path that went silent: the server's error is lost on the same path, and a middle box
(a pooler, a load balancer, a NAT) acknowledges the bytes it never delivers. A
:class:`Watchdog` shuts the socket of every statement still unanswered at its deadline;
the thread waiting in psycopg then fails at once, with an error that says the server did
not answer. Research record 0035 says why this and not keepalives alone.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psycopg

__all__ = ("Silent", "Watchdog")


class Silent(psycopg.OperationalError):
    """The server did not answer a statement before its deadline: its connection was
    given up (a ``psycopg`` error, so every caller treats it as a lost connection)."""


@dataclass(order=True)
class _Watch:
    deadline: float
    number: int
    conn: psycopg.Connection[object] = field(compare=False)
    fired: bool = field(default=False, compare=False)


class Watchdog:
    """Gives up the connections whose statement outlives ``seconds`` (thread-safe).

    One thread per store object, started with the first watch and left when the store
    closes; ``clock`` is read for every deadline (a test passes its own).
    """

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._watches: list[_Watch] = []
        self._numbers = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @contextlib.contextmanager
    def watching(self, conn: psycopg.Connection[object]) -> Iterator[None]:
        """Watch ``conn`` while the block sends a statement and waits for its answer;
        past the deadline the connection is shut and the block raises :class:`Silent`."""
        watch = _Watch(self._clock() + self.seconds, next(self._numbers), conn)
        with self._changed:
            heapq.heappush(self._watches, watch)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="polyloop-deadline", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        try:
            yield
        except psycopg.Error as exc:
            if watch.fired:
                raise Silent(
                    f"the server did not answer within {self.seconds:g} s; "
                    f"the connection was given up"
                ) from exc
            raise
        finally:
            with self._changed:
                watch.conn = None  # type: ignore[assignment]  # answered: never fire
        if watch.fired:  # the answer won the race against the shutdown; the socket is gone
            raise Silent(f"the connection was given up after {self.seconds:g} s")

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify()

    def _run(self) -> None:
        with self._changed:
            while not self._stopping:
                while self._watches and self._watches[0].conn is None:
                    heapq.heappop(self._watches)
                if not self._watches:
                    self._changed.wait()
                    continue
                left = self._watches[0].deadline - self._clock()
                if left > 0:
                    self._changed.wait(left)
                    continue
                watch = heapq.heappop(self._watches)
                watch.fired = True
                _shut(watch.conn)


def _shut(conn: psycopg.Connection[object]) -> None:
    """Shut the connection's socket both ways: a thread waiting on it wakes at once."""
    with contextlib.suppress(OSError, psycopg.Error):
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=socket.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
