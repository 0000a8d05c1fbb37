"""A deadline on the client side of every PostgreSQL statement.

Neither the server's ``statement_timeout`` nor TCP's ``tcp_user_timeout`` ends a wait on
a path that went silent: the server's error is lost on the same path, and a middle box
(a pooler, a load balancer, a NAT) acknowledges bytes it never delivers. So one watchdog
thread per process shuts the socket of every statement still unanswered at its deadline:
the waiting thread wakes at once and the statement fails with :class:`Silent`, a lost
connection. A forked child starts a watchdog of its own at its first exchange: the
parent's thread does not come along. Research record 0035 says why, and what libpq's
keepalives add; record 0053 covers the fork.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.abc import PQGen
from psycopg.rows import TupleRow


def deadline_s(statement_timeout_s: float) -> float:
    """How long the client waits for an answer: the server's statement timeout and half
    of it again (at least a second), so that the server's own error normally comes first."""
    return statement_timeout_s + max(1.0, statement_timeout_s / 2)


class Silent(psycopg.OperationalError):
    """The server did not answer before the deadline, and the connection was given up."""


class Watched(psycopg.Connection[TupleRow]):
    """A connection that gives up each exchange with the server (a statement, a commit,
    a check) not done within ``deadline_s``: every one of them waits in :meth:`wait`."""

    deadline_s = math.inf

    def wait(self, gen: PQGen[Any], *args: Any, **kwargs: Any) -> Any:
        watch = _Watch(self, time.monotonic() + self.deadline_s)
        _start(watch)
        try:
            return super().wait(gen, *args, **kwargs)
        except psycopg.Error as exc:
            if watch.fired:
                raise Silent(f"the server did not answer within {self.deadline_s:g} s") from exc
            raise
        finally:
            with _changed:
                _watches.discard(watch)  # an answer that beat the shutdown stands


@dataclass(eq=False, slots=True)
class _Watch:
    conn: Watched
    deadline: float
    fired: bool = False


# The exchanges waiting for an answer, and when the watchdog wakes next (under _changed).
_watches: set[_Watch] = set()
_next_wake = math.inf
_changed = threading.Condition()
_watchdog_thread: threading.Thread | None = None


def _forget_the_parents_watchdog() -> None:
    """In a forked child: only the forking thread came along, so the watchdog must start
    again at the child's first exchange, and the lock may have been held at the fork."""
    global _watches, _next_wake, _changed, _watchdog_thread
    _watches, _next_wake = set(), math.inf
    _changed = threading.Condition()
    _watchdog_thread = None


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forget_the_parents_watchdog)


def _start(watch: _Watch) -> None:
    global _watchdog_thread
    with _changed:
        if _watchdog_thread is None:
            _watchdog_thread = threading.Thread(target=_watchdog, name="polyloop-deadline")
            _watchdog_thread.daemon = True
            _watchdog_thread.start()
        _watches.add(watch)
        if watch.deadline < _next_wake:  # else the watchdog wakes in time anyway
            _changed.notify()


def _watchdog() -> None:
    """Sleep until the earliest deadline; shut the socket of each exchange past its own."""
    global _next_wake
    with _changed:
        while True:
            now = time.monotonic()
            for watch in [watch for watch in _watches if watch.deadline <= now]:
                _watches.discard(watch)
                watch.fired = True
                # Both ways: the waiting thread wakes, and psycopg marks the connection broken.
                with (
                    contextlib.suppress(OSError, psycopg.Error),
                    socket.socket(fileno=socket.dup(watch.conn.pgconn.socket)) as sock,
                ):
                    sock.shutdown(socket.SHUT_RDWR)
            _next_wake = min((watch.deadline for watch in _watches), default=math.inf)
            _changed.wait(None if _next_wake == math.inf else _next_wake - now)
