"""Draining: a host's way to stop the runs it drives at their next step boundary.

A host that stops gracefully (``polyloop worker`` on SIGTERM) must not cut a running
tool in half, and must not leave its runs for a hard cancellation to end. It sets one
:class:`Drain` for the runs it drives (:func:`watching`, a context variable, so the
loop needs no new argument); the loop asks :func:`stopped_at_boundary` where it would
start its next model call, and a run whose host drains ends there with a ``CANCELLED``
end record: the end a cancelled process writes, so any host may resume it.

:func:`claimed` tells the host when the kernel holds a run's claim and goes on with
it, so that it says "driving" only about a run it really drives (a lost race for the
claim, or a run another host finished or left waiting meanwhile, says nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

from polyloop.types import StopReason

if TYPE_CHECKING:
    from polyloop.session._loop import Loop

DETAIL = "the worker stopped at a step boundary; any worker may resume the run"


@dataclass(slots=True, kw_only=True)
class Drain:
    """Whether a host drains: shared by every run it drives."""

    requested: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class _Watch:
    drain: Drain
    on_claimed: Callable[[str], None]


_current: ContextVar[_Watch | None] = ContextVar("polyloop_drain", default=None)


@contextmanager
def watching(drain: Drain, on_claimed: Callable[[str], None]) -> Iterator[None]:
    """Drive the run started in this block under ``drain``; ``on_claimed(run_id)`` is
    called once the kernel holds the run's claim and goes on with it (not for a run
    whose log says it finished or waits for a person)."""
    token = _current.set(_Watch(drain=drain, on_claimed=on_claimed))
    try:
        yield
    finally:
        _current.reset(token)


def claimed(run_id: str) -> None:
    """The kernel holds ``run_id``'s claim and goes on with it: tell the host driving
    it, if one does."""
    watch = _current.get()
    if watch is not None:
        watch.on_claimed(run_id)


async def stopped_at_boundary(loop: Loop) -> bool:
    """End ``loop``'s run here, resumable, if its host drains; whether it did.

    Called where no effect is running (before a model call), so nothing is cut short.
    """
    watch = _current.get()
    if watch is None or not watch.drain.requested:
        return False
    await loop.finish(StopReason.CANCELLED, DETAIL)
    return True
