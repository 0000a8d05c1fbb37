"""The event relay: what the loop tells its event sink, at a few fixed points.

The loop calls :meth:`Relay.emit` when a run starts, resumes, finishes a step and ends,
and runs each model call and action inside :meth:`Relay.scope`; ``_deltas`` hands it the
pieces of a streamed reply for :meth:`Relay.emit_delta`. A sink is code the
library does not own: whatever it raises is counted and logged here, and never fails
the run, the call, or hides the call's own exception.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager

from polyloop.ports import DeltaSink, Event, EventKind, EventSink, TextDelta, TracingSink
from polyloop.types import Intent, IntentKind, Record, Settlement

logger = logging.getLogger("polyloop")

# What a call runs inside when the event sink wraps none: reusable, and free to enter.
_NO_SCOPE: AbstractContextManager[object] = contextlib.nullcontext()


class Relay:
    """Hands one run's events to its sink and counts the sink's failures."""

    __slots__ = ("_around", "_deltas", "_events", "_run_id", "failures")

    def __init__(self, events: EventSink, run_id: str) -> None:
        self._events = events
        self._run_id = run_id
        self.failures = 0
        # Looked up once per run, so a sink that wraps no calls adds nothing to a step.
        self._around = events.around_call if isinstance(events, TracingSink) else None
        self._deltas: Callable[[TextDelta], Awaitable[None]] | None = (
            events.emit_delta if isinstance(events, DeltaSink) else None
        )

    @property
    def takes_deltas(self) -> bool:
        """Whether the sink hears a model's text as it arrives."""
        return self._deltas is not None

    async def emit(
        self,
        kind: EventKind,
        step: int | None,
        record: Record,
        intent: Intent | None = None,
        *,
        logged: tuple[Record, ...] = (),
        settlement: Settlement | None = None,
    ) -> None:
        """Hand the sink one event; count and log it if the sink raises.

        Cancellation: propagates from the sink's ``emit``; nothing is left half done.
        """
        event = Event(
            kind=kind,
            run_id=self._run_id,
            step=step,
            record=record,
            intent=intent,
            logged=logged,
            settlement=settlement,
        )
        try:
            await self._events.emit(event)
        except Exception:
            # Counted and logged, never reported through the sink that just failed.
            self.failures += 1
            logger.exception("run %r: the event sink failed on %s", self._run_id, kind.value)

    async def emit_delta(self, delta: TextDelta) -> None:
        """Hand the sink one piece of a model's text; count and log it if the sink raises.

        Cancellation: propagates from the sink's ``emit_delta``.
        """
        assert self._deltas is not None  # only called when the sink takes deltas
        try:
            await self._deltas(delta)
        except Exception:
            self.failures += 1
            logger.exception(
                "run %r: the event sink failed on text delta %d of step %d",
                self._run_id,
                delta.index,
                delta.step,
            )

    def scope(self, kind: IntentKind, index: int) -> AbstractContextManager[object]:
        """What the model call or action of step ``index`` runs inside: the event
        sink's wrapper (a span made current, say), or nothing."""
        if self._around is None:
            return _NO_SCOPE
        return self._sink_scope(kind, index)

    @contextlib.contextmanager
    def _sink_scope(self, kind: IntentKind, index: int) -> Iterator[None]:
        """The sink's wrapper, failing as its ``emit`` may: counted and logged, never
        failing the call, never hiding the call's own exception or cancellation."""
        assert self._around is not None
        scope: AbstractContextManager[object] = _NO_SCOPE
        try:
            scope = self._around(run_id=self._run_id, step=index, kind=kind)
            scope.__enter__()
        except Exception:  # noqa: BLE001 - a failing sink never fails the call
            self._failed(kind, "entering")
            scope = _NO_SCOPE
        try:
            yield
        except BaseException as exc:
            try:
                scope.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as failure:  # noqa: BLE001 - a failing sink never fails the call
                if failure is not exc:
                    self._failed(kind, "leaving")
            raise  # whatever the sink's __exit__ says: the call's outcome is not the sink's
        try:
            scope.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - a failing sink never fails the call
            self._failed(kind, "leaving")

    def _failed(self, kind: IntentKind, doing: str) -> None:
        self.failures += 1
        logger.exception("run %r: the event sink failed %s a %s", self._run_id, doing, kind.value)
