"""The sink itself: the spans of each run attempt and of each call while it runs.

The spans of a step are built in :mod:`polyloop.otel._steps`, their parts in
:mod:`polyloop.otel._spans`; this module keeps what is open and when it ends.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import anyio.lowlevel
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanKind, Tracer, TracerProvider

from polyloop.otel._logged import logged_calls
from polyloop.otel._spans import (
    failed,
    ns,
    run_attributes,
    run_parent,
    run_span_context,
    seconds_ns,
)
from polyloop.otel._steps import (
    Call,
    Spanned,
    amended_span,
    chat_span,
    in_doubt_span,
    step_attributes,
    tool_span,
)
from polyloop.ports import Event, EventKind
from polyloop.types import (
    Amended,
    Intent,
    IntentKind,
    JSONValue,
    Record,
    RunEnded,
    RunStarted,
    Settlement,
    StepRecord,
    StopReason,
)

logger = logging.getLogger("polyloop.otel")

_SCOPE = "polyloop"

# Stop reasons that mean the run failed to do its work, each with the low-cardinality
# value that ``error.type`` carries for it. Limits and answers are ordinary ends.
_FAILED_ENDS = {
    StopReason.MODEL_FAILURE: "model_failure",
    StopReason.ENV_FAILURE: "env_failure",
    StopReason.CANCELLED: "cancelled",
    StopReason.IN_DOUBT: "in_doubt",
}
# Logged steps rebuilt between two checkpoints: a long log must not hold the event loop.
_REBUILT_PER_CHECKPOINT = 200


def _version() -> str | None:
    try:
        return importlib.metadata.version("polyloop")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return None


@dataclass(slots=True, kw_only=True)
class _Attempt:
    """The open span of one run attempt, and the latest moment it is known to reach."""

    span: Span
    context: Context
    start_ns: int
    last_ns: int


# A call of one kind at one step of one run.
_CallKey = tuple[str, int, IntentKind]


class OpenTelemetrySink:
    """An event sink that records each run attempt, model call and tool call as a span.

    ``tracer_provider`` is the provider to take the tracer from; ``None`` means the
    global one (``opentelemetry.trace.get_tracer_provider()``), looked up when the sink
    is made. The sink never raises for a problem of OpenTelemetry's (a span processor or
    exporter that fails): it logs it on the ``polyloop.otel`` logger and goes on.

    A run attempt that never ends through the library (the run raised, for instance
    when its store failed) leaves its span open: it is ended, as abandoned, when the
    same run starts or resumes again through this sink, or by :meth:`close`, which ends
    every span still open. Call it before shutting the tracer provider down.

    ``rebuild_logged_steps`` (on by default): when a run resumes, emit again, from its
    log, the spans of every step its earlier attempts logged, each with the attribute
    ``polyloop.rebuilt`` set, and a span for an action they announced without logging
    its result, whose outcome is unknown. A killed process may have taken those spans
    with it unexported; the rebuilt ones may therefore repeat spans a backend already
    has, and the attribute is what tells them apart.
    """

    __slots__ = ("_attempts", "_calls", "_lock", "_rebuild", "_tracer")

    def __init__(
        self, tracer_provider: TracerProvider | None = None, *, rebuild_logged_steps: bool = True
    ) -> None:
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        self._tracer: Tracer = provider.get_tracer(_SCOPE, _version())
        self._rebuild = rebuild_logged_steps
        self._attempts: dict[str, _Attempt] = {}
        self._calls: dict[_CallKey, Call] = {}
        # Spans are built without awaiting; the lock only matters when event loops in
        # several threads share one sink.
        self._lock = threading.Lock()

    def parameters(self) -> Mapping[str, JSONValue]:
        # Written into the start record: nothing here may differ between processes.
        return {"kind": "opentelemetry"}

    async def emit(self, event: Event) -> None:
        """Turn ``event`` into spans: open, add to or end its run's attempt span; on a
        resume, rebuild the spans of the steps earlier attempts logged.

        Cancellation: the event's own spans are built before the first checkpoint, so a
        cancelled emit has still recorded its event; the cancellation then propagates.
        Rebuilding a long log checkpoints now and then: cancelled there, it stops with
        the steps rebuilt so far.
        """
        try:
            with self._lock:
                self._take(event)
        except Exception:  # telemetry must never disturb a run
            logger.exception("run %r: could not record %s as spans", event.run_id, event.kind)
        if self._rebuild and event.kind is EventKind.RUN_RESUMED:
            await self._rebuild_logged(event.run_id, event.logged)
        await anyio.lowlevel.checkpoint()

    @contextlib.contextmanager
    def around_call(self, *, run_id: str, step: int, kind: IntentKind) -> Iterator[None]:
        """Start the span of the call of ``kind`` at ``step`` and make it current while
        the call runs; the step's record ends it with its attributes.

        Cancellation (or any exception that is not an ``Exception``) ends the span at
        once, in error, and propagates: no record will come for that step.
        """
        key = (run_id, step, kind)
        span = self._quietly(run_id, "start the span of a call", lambda: self._begin(key))
        if span is None:
            yield
            return
        token = otel_context.attach(trace.set_span_in_context(span))
        failure: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            failure = exc
            raise
        finally:
            otel_context.detach(token)
            self._quietly(run_id, "end the span of a call", lambda: self._returned(key, failure))

    def close(self) -> None:
        """End every span still open, each as abandoned at the last moment it reached.

        Safe to call more than once; the sink stays usable afterwards.
        """
        with self._lock:
            run_ids = list(self._attempts)
            for run_id in run_ids:
                self._abandon(run_id, "the sink was closed before the run attempt ended")
            for key in list(self._calls):
                self._unrecorded(key, "the sink was closed before the call's step was recorded")

    def __repr__(self) -> str:
        return f"OpenTelemetrySink(open_runs={len(self._attempts)})"

    # -- calls while they run -----------------------------------------------------------

    def _quietly(self, run_id: str, what: str, act: Callable[[], Span | None]) -> Span | None:
        """``act()`` under the lock; what OpenTelemetry raises is logged, never passed on."""
        try:
            with self._lock:
                return act()
        except Exception:  # telemetry must never disturb a run
            logger.exception("run %r: could not %s", run_id, what)
            return None

    def _begin(self, key: _CallKey) -> Span:
        run_id, step, kind = key
        if key in self._calls:  # a call whose record never came; not expected
            self._unrecorded(key, "a later call of the same step started")
        attempt = self._attempts.get(run_id)
        parent = attempt.context if attempt is not None else run_parent(run_id)
        operation = "chat" if kind is IntentKind.MODEL_CALL else "execute_tool"
        attributes = step_attributes(run_id, step, operation)
        span = self._tracer.start_span(
            operation,
            context=parent,
            kind=SpanKind.CLIENT if kind is IntentKind.MODEL_CALL else SpanKind.INTERNAL,
            attributes=attributes.values,
        )
        self._calls[key] = Call(span=span)
        return span

    def _returned(self, key: _CallKey, failure: BaseException | None) -> None:
        call = self._calls.get(key)
        if call is None:
            return  # ended already (the sink was closed while the call ran)
        call.end_ns = time.time_ns()
        attempt = self._attempts.get(key[0])
        if attempt is not None:
            attempt.last_ns = max(attempt.last_ns, call.end_ns)
        if failure is None or isinstance(failure, Exception):
            return  # the step's record says how it went
        # Cancelled (or interrupted): no record of this step will come.
        del self._calls[key]
        cancelled = _is_cancellation(failure)
        call.span.set_attribute("error.type", "cancelled" if cancelled else type(failure).__name__)
        call.span.set_status(failed("the call was cancelled" if cancelled else repr(failure)))
        call.span.end(end_time=call.end_ns)

    def _unrecorded(self, key: _CallKey, why: str) -> None:
        call = self._calls.pop(key)
        try:
            call.span.set_attribute("error.type", "abandoned")
            call.span.set_status(failed(why))
            call.span.end(end_time=call.end_ns if call.end_ns is not None else time.time_ns())
        except Exception:  # the other open spans must still be ended
            logger.exception("run %r: could not end the span of a call", key[0])

    def _end_calls(self, run_id: str, why: str) -> None:
        """End the spans of the run's calls whose step records never came."""
        for key in [key for key in self._calls if key[0] == run_id]:
            self._unrecorded(key, why)

    # -- what earlier attempts logged ----------------------------------------------------

    async def _rebuild_logged(self, run_id: str, logged: tuple[Record, ...]) -> None:
        """Emit the spans of the calls in ``logged`` through the live code, one call at a
        time as the log is walked (nothing is gathered first), under the run's derived
        parent: the earlier attempts' own spans may never have been exported."""
        try:
            for count, call in enumerate(logged_calls(logged), start=1):
                with self._lock:
                    if isinstance(call, Intent):
                        in_doubt_span(self._tracer, run_id, call)
                    else:
                        step, intent, settlement = call
                        self._step(run_id, step, intent, settlement, rebuilt=True)
                if count % _REBUILT_PER_CHECKPOINT == 0:
                    await anyio.lowlevel.checkpoint()
        except Exception:  # telemetry must never disturb a run
            logger.exception("run %r: could not rebuild the spans of its logged steps", run_id)

    # -- events ---------------------------------------------------------------------------

    def _take(self, event: Event) -> None:
        record = event.record
        if event.kind is EventKind.RUN_STARTED and isinstance(record, RunStarted):
            self._open(event.run_id, start_ns=ns(record.at), resumed=False, started=record)
        elif event.kind is EventKind.RUN_RESUMED:
            started = record if isinstance(record, RunStarted) else None
            self._open(event.run_id, start_ns=time.time_ns(), resumed=True, started=started)
        elif event.kind is EventKind.STEP_FINISHED and isinstance(record, StepRecord):
            self._step(event.run_id, record, event.intent, event.settlement)
        elif event.kind is EventKind.RUN_ENDED and isinstance(record, RunEnded):
            self._end(event.run_id, record)
        elif event.kind is EventKind.RUN_AMENDED and isinstance(record, Amended):
            amended_span(self._tracer, record)

    def _open(
        self, run_id: str, *, start_ns: int, resumed: bool, started: RunStarted | None
    ) -> None:
        if run_id in self._attempts:
            # The previous attempt raised instead of ending; this one replaces it.
            self._abandon(run_id, "a later attempt of the run started before this one ended")
        run_context = run_span_context(run_id)
        current = trace.get_current_span()
        if current.get_span_context().is_valid:
            parent = trace.set_span_in_context(current)
            linked = True
        else:
            parent = trace.set_span_in_context(NonRecordingSpan(run_context))
            linked = resumed
        attributes = run_attributes(run_id, "invoke_agent")
        attributes.put("polyloop.run.resumed", resumed)
        links = [Link(run_context, {"polyloop.link": "continues"})] if linked else []
        if started is not None and started.forked_from is not None:
            # A fork's spans are its own trace; the link leads to the run it came from.
            attributes.put("polyloop.run.forked_from", started.forked_from)
            attributes.put("polyloop.run.forked_at_step", started.forked_at_step)
            source = run_span_context(started.forked_from)
            links.append(Link(source, {"polyloop.link": "forked_from"}))
        span = self._tracer.start_span(
            "invoke_agent",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes.values,
            links=links or None,
            start_time=start_ns,
        )
        self._attempts[run_id] = _Attempt(
            span=span,
            context=trace.set_span_in_context(span),
            start_ns=start_ns,
            last_ns=start_ns,
        )

    def _step(
        self,
        run_id: str,
        step: StepRecord,
        intent: Intent | None,
        settlement: Settlement | None = None,
        *,
        rebuilt: bool = False,
    ) -> None:
        """The spans of a step's calls; ``rebuilt`` for a step an earlier attempt logged,
        whose spans belong to no attempt this sink saw and are built from the record.
        ``settlement`` is what closed the step's action in doubt, if it was."""
        attempt = None if rebuilt else self._attempts.get(run_id)
        if attempt is not None:
            parent, floor = attempt.context, attempt.start_ns
        else:
            # No open attempt (a sink attached mid-run, or a step an earlier attempt
            # logged): keep the spans in the run's trace, at the record's own times.
            parent, floor = run_parent(run_id), 0
        end_ns = max(ns(step.at), floor)
        start_ns = max(end_ns - seconds_ns(step.duration_s), floor)
        model_end = min(start_ns + seconds_ns(step.model_duration_s), end_ns)
        chat = (
            None if rebuilt else self._calls.pop((run_id, step.step, IntentKind.MODEL_CALL), None)
        )
        made_chat = chat or Spanned(parent, start_ns, model_end)
        chat_span(self._tracer, run_id, step, made_chat, rebuilt=rebuilt)
        if step.action_status is not None:
            tool_start = max(end_ns - seconds_ns(step.action_duration_s), start_ns)
            key = (run_id, step.step, IntentKind.ACTION)
            tool = None if rebuilt else self._calls.pop(key, None)
            made = tool or Spanned(parent, tool_start, end_ns)
            tool_span(self._tracer, run_id, step, intent, made, settlement, rebuilt=rebuilt)
        if attempt is not None:
            attempt.last_ns = max(attempt.last_ns, end_ns)

    def _end(self, run_id: str, end: RunEnded) -> None:
        self._end_calls(run_id, "the run ended before the step of this call was recorded")
        attempt = self._attempts.pop(run_id, None)
        if attempt is None:
            return  # an end without a start seen here: there is no span to end
        span = attempt.span
        span.set_attribute("polyloop.run.stop_reason", end.stop_reason.value)
        span.set_attribute("polyloop.run.steps", end.steps)
        span.set_attribute("polyloop.run.valid_steps", end.valid_steps)
        failure = _FAILED_ENDS.get(end.stop_reason)
        if end.stop_reason is StopReason.IN_DOUBT:
            span.set_attribute("polyloop.run.in_doubt", True)
        if failure is not None:
            span.set_attribute("error.type", failure)
            span.set_status(failed(end.detail or failure))
        span.end(end_time=max(ns(end.at), attempt.last_ns))

    def _abandon(self, run_id: str, why: str) -> None:
        self._end_calls(run_id, why)
        attempt = self._attempts.pop(run_id)
        try:
            attempt.span.set_attribute("polyloop.run.abandoned", True)
            attempt.span.set_attribute("error.type", "abandoned")
            attempt.span.set_status(failed(why))
            attempt.span.end(end_time=attempt.last_ns)
        except Exception:  # the other open spans must still be ended
            logger.exception("run %r: could not end an abandoned span", run_id)


def _is_cancellation(failure: BaseException) -> bool:
    try:
        return isinstance(failure, anyio.get_cancelled_exc_class())
    except Exception:  # noqa: BLE001 - no async library runs in this thread
        return False
