"""An event sink that turns a run's events into OpenTelemetry spans.

:class:`OpenTelemetrySink` follows the OpenTelemetry semantic conventions for generative
AI: one ``invoke_agent`` span per run attempt, and for every step a ``chat`` span for
its model call and, when the step ran an action, an ``execute_tool`` span. The sink is a
:class:`~polyloop.ports.TracingSink`: a step span starts when its call starts and is the
current span while the call runs, so the spans the model client or a tool starts nest
under it. It ends when the call returns, and gets the attributes of the step's record
when that arrives. A call the run did not make (a reply read back from the log, an
action a person settled) gets its span from the record alone.

A resumed attempt also rebuilds, from the log its ``RUN_RESUMED`` event carries, the
spans of every step the earlier attempts logged, marked ``polyloop.rebuilt``: no attempt
can know what an earlier one exported before its process died.

Every attempt of one run lands in one trace, in any process: the run id determines a
trace id and a span id, and without a current span in the caller's context an
attempt's span is the child of that (never exported) parent. A resumed attempt links
to it, and so does any attempt whose parent is the caller's current span.

Importing this module imports ``opentelemetry`` (the ``polyloop[otel]`` extra, the API
only); nothing else in the library does. The application chooses the SDK, the span
processors and the exporters.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio.lowlevel

from polyloop._shared import needs_extra, run_trace_ids

with needs_extra("polyloop.otel", "otel"):
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import (
        Link,
        NonRecordingSpan,
        Span,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        Tracer,
        TracerProvider,
    )
    from opentelemetry.util.types import AttributeValue

from polyloop.ports import Event, EventKind
from polyloop.types import (
    ActionStatus,
    Intent,
    IntentKind,
    JSONValue,
    Record,
    Result,
    RunEnded,
    RunStarted,
    Settlement,
    StepRecord,
    StopReason,
    ToolCallBlock,
)

__all__ = ("OpenTelemetrySink",)

logger = logging.getLogger("polyloop.otel")

_SCOPE = "polyloop"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# Stop reasons that mean the run failed to do its work, each with the low-cardinality
# value that ``error.type`` carries for it. Limits and answers are ordinary ends.
_FAILED_ENDS = {
    StopReason.MODEL_FAILURE: "model_failure",
    StopReason.ENV_FAILURE: "env_failure",
    StopReason.CANCELLED: "cancelled",
    StopReason.IN_DOUBT: "in_doubt",
}
_FAILED_ACTIONS = {
    ActionStatus.ENV_FAULT: "env_fault",
    ActionStatus.NOT_EXECUTED: "not_executed",
}
# A recorded failure reads "ExceptionClass: message"; the class is the error type.
_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][\w.]*):")
# Logged steps rebuilt between two checkpoints: a long log must not hold the event loop.
_REBUILT_PER_CHECKPOINT = 200


def _run_span_context(run_id: str) -> SpanContext:
    """The span context every attempt of ``run_id`` descends from or links to: its trace
    id is :func:`polyloop.run_trace_id`'s, computed by the same function."""
    trace_id, span_id = run_trace_ids(run_id)
    return SpanContext(
        trace_id=trace_id,
        span_id=span_id,
        is_remote=True,
        # Asks a parent-based sampler to keep the run, as a caller's sampled span would.
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )


def _ns(at: datetime | None) -> int:
    """Nanoseconds since the epoch, exactly (no float rounding); now when unknown."""
    if at is None:
        return time.time_ns()
    if at.tzinfo is None:  # records are aware UTC; a naive one is read as UTC
        at = at.replace(tzinfo=UTC)
    return (at - _EPOCH) // timedelta(microseconds=1) * 1000


def _seconds_ns(seconds: float | None) -> int:
    return max(0, round(seconds * 1e9)) if seconds is not None else 0


def _version() -> str | None:
    try:
        return importlib.metadata.version("polyloop")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return None


def _error_type(text: str) -> str:
    found = _EXCEPTION_NAME.match(text)
    return found.group(1) if found else "_OTHER"


@dataclass(slots=True, kw_only=True)
class _Attempt:
    """The open span of one run attempt, and the latest moment it is known to reach."""

    span: Span
    context: Context
    start_ns: int
    last_ns: int


@dataclass(slots=True, kw_only=True)
class _Call:
    """The span of a model call or an action the run made, and when the call returned
    (``None`` while it runs). It stays open until the step's record brings its
    attributes."""

    span: Span
    end_ns: int | None = None


# A call of one kind at one step of one run.
_CallKey = tuple[str, int, IntentKind]


@dataclass(slots=True)
class _Attributes:
    values: dict[str, AttributeValue] = field(default_factory=dict)

    def put(self, key: str, value: AttributeValue | None) -> None:
        if isinstance(value, str):
            self.values[key] = _exportable(value)
        elif isinstance(value, list | tuple) and any(isinstance(item, str) for item in value):
            self.values[key] = [_exportable(item) for item in value if isinstance(item, str)]
        elif value is not None:
            self.values[key] = value


def _exportable(text: str) -> str:
    """``text`` as OTLP can send it: a lone surrogate (half an emoji from a model, say),
    which protobuf refuses to encode and with it the whole batch, becomes its escape."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _failed(description: str) -> Status:
    return Status(StatusCode.ERROR, _exportable(description))


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
        self._calls: dict[_CallKey, _Call] = {}
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
        parent = attempt.context if attempt is not None else _run_parent(run_id)
        operation = "chat" if kind is IntentKind.MODEL_CALL else "execute_tool"
        attributes = _Attributes()
        attributes.put("gen_ai.operation.name", operation)
        attributes.put("gen_ai.conversation.id", run_id)
        attributes.put("polyloop.run.id", run_id)
        attributes.put("polyloop.step", step)
        span = self._tracer.start_span(
            operation,
            context=parent,
            kind=SpanKind.CLIENT if kind is IntentKind.MODEL_CALL else SpanKind.INTERNAL,
            attributes=attributes.values,
        )
        self._calls[key] = _Call(span=span)
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
        call.span.set_status(_failed("the call was cancelled" if cancelled else repr(failure)))
        call.span.end(end_time=call.end_ns)

    def _unrecorded(self, key: _CallKey, why: str) -> None:
        call = self._calls.pop(key)
        try:
            call.span.set_attribute("error.type", "abandoned")
            call.span.set_status(_failed(why))
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
            for count, call in enumerate(_logged_calls(logged), start=1):
                with self._lock:
                    if isinstance(call, Intent):
                        self._in_doubt(run_id, call)
                    else:
                        step, intent, settlement = call
                        self._step(run_id, step, intent, settlement, rebuilt=True)
                if count % _REBUILT_PER_CHECKPOINT == 0:
                    await anyio.lowlevel.checkpoint()
        except Exception:  # telemetry must never disturb a run
            logger.exception("run %r: could not rebuild the spans of its logged steps", run_id)

    def _in_doubt(self, run_id: str, intent: Intent) -> None:
        """The span of an action an earlier attempt announced and logged no result of.

        It may or may not have run: the status stays unset, never OK or an error, and it
        starts and ends when its intent was written, since how long it ran is unknown.
        """
        attributes, name = _tool_attributes(
            run_id, intent.step, intent.tool_call, intent, resumed=None, rebuilt=True
        )
        attributes.put("polyloop.action.in_doubt", True)
        at = _ns(intent.at)
        made = _Spanned(_run_parent(run_id), at, at)
        span, end_ns = self._span_of(made, name, SpanKind.INTERNAL, attributes)
        span.end(end_time=end_ns)

    # -- events ---------------------------------------------------------------------------

    def _take(self, event: Event) -> None:
        record = event.record
        if event.kind is EventKind.RUN_STARTED and isinstance(record, RunStarted):
            self._open(event.run_id, start_ns=_ns(record.at), resumed=False, started=record)
        elif event.kind is EventKind.RUN_RESUMED:
            started = record if isinstance(record, RunStarted) else None
            self._open(event.run_id, start_ns=time.time_ns(), resumed=True, started=started)
        elif event.kind is EventKind.STEP_FINISHED and isinstance(record, StepRecord):
            self._step(event.run_id, record, event.intent, event.settlement)
        elif event.kind is EventKind.RUN_ENDED and isinstance(record, RunEnded):
            self._end(event.run_id, record)

    def _open(
        self, run_id: str, *, start_ns: int, resumed: bool, started: RunStarted | None
    ) -> None:
        if run_id in self._attempts:
            # The previous attempt raised instead of ending; this one replaces it.
            self._abandon(run_id, "a later attempt of the run started before this one ended")
        run_context = _run_span_context(run_id)
        current = trace.get_current_span()
        if current.get_span_context().is_valid:
            parent = trace.set_span_in_context(current)
            linked = True
        else:
            parent = trace.set_span_in_context(NonRecordingSpan(run_context))
            linked = resumed
        attributes = _Attributes()
        attributes.put("gen_ai.operation.name", "invoke_agent")
        attributes.put("gen_ai.conversation.id", run_id)
        attributes.put("polyloop.run.id", run_id)
        attributes.put("polyloop.run.resumed", resumed)
        links = [Link(run_context, {"polyloop.link": "continues"})] if linked else []
        if started is not None and started.forked_from is not None:
            # A fork's spans are its own trace; the link leads to the run it came from.
            attributes.put("polyloop.run.forked_from", started.forked_from)
            attributes.put("polyloop.run.forked_at_step", started.forked_at_step)
            source = _run_span_context(started.forked_from)
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
            parent, floor = _run_parent(run_id), 0
        end_ns = max(_ns(step.at), floor)
        start_ns = max(end_ns - _seconds_ns(step.duration_s), floor)
        model_end = min(start_ns + _seconds_ns(step.model_duration_s), end_ns)
        chat = (
            None if rebuilt else self._calls.pop((run_id, step.step, IntentKind.MODEL_CALL), None)
        )
        self._chat(run_id, step, chat or _Spanned(parent, start_ns, model_end), rebuilt=rebuilt)
        if step.action_status is not None:
            tool_start = max(end_ns - _seconds_ns(step.action_duration_s), start_ns)
            key = (run_id, step.step, IntentKind.ACTION)
            tool = None if rebuilt else self._calls.pop(key, None)
            made = tool or _Spanned(parent, tool_start, end_ns)
            self._tool(run_id, step, intent, made, settlement, rebuilt=rebuilt)
        if attempt is not None:
            attempt.last_ns = max(attempt.last_ns, end_ns)

    def _chat(
        self, run_id: str, step: StepRecord, made: _Call | _Spanned, *, rebuilt: bool
    ) -> None:
        attributes = _common(run_id, step.step, "chat", resumed=step.resumed, rebuilt=rebuilt)
        attributes.put("gen_ai.response.model", step.model)
        attributes.put("gen_ai.response.id", step.call_id)
        if step.usage is not None:
            attributes.put("gen_ai.usage.input_tokens", step.usage.input_tokens)
            attributes.put("gen_ai.usage.output_tokens", step.usage.output_tokens)
        if step.finish is not None:
            attributes.put("gen_ai.response.finish_reasons", [step.finish.value])
        if step.model_duration_s is None:
            # The reply was read back from the log: an earlier attempt made the call.
            attributes.put("polyloop.model.from_log", True)
        if step.error is not None:
            attributes.put("error.type", _error_type(step.error))
        name = f"chat {_exportable(step.model)}" if step.model else "chat"
        span, end_ns = self._span_of(made, name, SpanKind.CLIENT, attributes)
        if step.error is not None:
            span.set_status(_failed(step.error))
        span.end(end_time=end_ns)

    def _tool(
        self,
        run_id: str,
        step: StepRecord,
        intent: Intent | None,
        made: _Call | _Spanned,
        settlement: Settlement | None,
        *,
        rebuilt: bool,
    ) -> None:
        assert step.action_status is not None
        attributes, span_name = _tool_attributes(
            run_id, step.step, step.tool_call, intent, resumed=step.resumed, rebuilt=rebuilt
        )
        attributes.put("polyloop.action.status", step.action_status.value)
        failure = _FAILED_ACTIONS.get(step.action_status)
        attributes.put("error.type", failure)
        span, end_ns = self._span_of(made, span_name, SpanKind.INTERNAL, attributes)
        if failure is not None:
            span.set_status(_failed(step.observation or failure))
        if settlement is not None:
            # At the step record's time, inside the span: the settlement itself may
            # predate the span, whose times are those of the record that closed it.
            span.add_event("polyloop.settled", _settled(settlement).values, timestamp=end_ns)
        span.end(end_time=end_ns)

    def _span_of(
        self, made: _Call | _Spanned, name: str, kind: SpanKind, attributes: _Attributes
    ) -> tuple[Span, int]:
        """The step's span, named and described, and the time to end it: the span of
        the call when the run made it, else one built from the record's times."""
        if isinstance(made, _Call):
            made.span.update_name(name)
            made.span.set_attributes(attributes.values)
            return made.span, made.end_ns if made.end_ns is not None else time.time_ns()
        span = self._tracer.start_span(
            name,
            context=made.parent,
            kind=kind,
            attributes=attributes.values,
            start_time=made.start_ns,
        )
        return span, made.end_ns

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
            span.set_status(_failed(end.detail or failure))
        span.end(end_time=max(_ns(end.at), attempt.last_ns))

    def _abandon(self, run_id: str, why: str) -> None:
        self._end_calls(run_id, why)
        attempt = self._attempts.pop(run_id)
        try:
            attempt.span.set_attribute("polyloop.run.abandoned", True)
            attempt.span.set_attribute("error.type", "abandoned")
            attempt.span.set_status(_failed(why))
            attempt.span.end(end_time=attempt.last_ns)
        except Exception:  # the other open spans must still be ended
            logger.exception("run %r: could not end an abandoned span", run_id)


@dataclass(frozen=True, slots=True)
class _Spanned:
    """Where and when to build the span of a call the run did not make itself."""

    parent: Context
    start_ns: int
    end_ns: int


def _is_cancellation(failure: BaseException) -> bool:
    try:
        return isinstance(failure, anyio.get_cancelled_exc_class())
    except Exception:  # noqa: BLE001 - no async library runs in this thread
        return False


def _run_parent(run_id: str) -> Context:
    """A context whose span is the run's derived, never exported, parent."""
    return trace.set_span_in_context(NonRecordingSpan(_run_span_context(run_id)))


def _common(
    run_id: str, step: int, operation: str, *, resumed: bool | None, rebuilt: bool
) -> _Attributes:
    attributes = _Attributes()
    attributes.put("gen_ai.operation.name", operation)
    attributes.put("gen_ai.conversation.id", run_id)
    attributes.put("polyloop.run.id", run_id)
    attributes.put("polyloop.step", step)
    attributes.put("polyloop.step.resumed", resumed)
    attributes.put("polyloop.rebuilt", True if rebuilt else None)
    return attributes


def _tool_attributes(
    run_id: str,
    step: int,
    tool_call: ToolCallBlock | None,
    intent: Intent | None,
    *,
    resumed: bool | None,
    rebuilt: bool,
) -> tuple[_Attributes, str]:
    """What every ``execute_tool`` span says of its call, and the span's name."""
    name = _tool_name(tool_call, intent)
    attributes = _common(run_id, step, "execute_tool", resumed=resumed, rebuilt=rebuilt)
    attributes.put("gen_ai.tool.name", name)
    if name is not None:
        attributes.put("gen_ai.tool.type", "function")
    if tool_call is not None:
        attributes.put("gen_ai.tool.call.id", tool_call.call_id)
    attributes.put("polyloop.action.result_id", intent.result_id if intent else None)
    return attributes, f"execute_tool {_exportable(name)}" if name else "execute_tool"


def _settled(settlement: Settlement) -> _Attributes:
    """What the ``polyloop.settled`` event of a settled action's span says."""
    attributes = _Attributes()
    attributes.put("polyloop.settled_by", settlement.by)
    attributes.put("polyloop.settled.ran", settlement.ran)
    attributes.put("polyloop.settled.by_probe", settlement.by_probe)
    attributes.put("polyloop.probe.duration_s", settlement.duration_s)
    return attributes


_LoggedStep = tuple[StepRecord, Intent | None, Settlement | None]


def _logged_calls(records: Iterable[Record]) -> Iterator[_LoggedStep | Intent]:
    """The calls a log holds, in order, as the live sink would have seen them: each step
    record with its action's intent and the settlement that closed it, then an action
    intent with no result after it (in doubt) if the log ends with one that no
    settlement closed. Walks the log once and keeps nothing of it."""
    action: Intent | None = None  # the action intent of the step being walked
    open_intent: Intent | None = None
    settlement: Settlement | None = None
    for record in records:
        if isinstance(record, Intent):
            open_intent = record
            if record.kind is IntentKind.ACTION:
                action = record
        elif isinstance(record, Result):
            open_intent = None
        elif isinstance(record, Settlement):
            settlement = record
        elif isinstance(record, StepRecord):
            intent = action if action is not None and action.step == record.step else None
            settled = settlement if record.settled_by is not None else None
            yield record, intent, settled
            action = open_intent = settlement = None
    # A settled action is no longer in doubt: the attempt that resumes records its step.
    if open_intent is not None and open_intent.kind is IntentKind.ACTION and settlement is None:
        yield open_intent


def _tool_name(tool_call: ToolCallBlock | None, intent: Intent | None) -> str | None:
    if tool_call is not None:
        return tool_call.name
    payload = intent.payload if intent is not None else None
    if isinstance(payload, dict) and isinstance(payload.get("name"), str):
        name = payload["name"]
        assert isinstance(name, str)
        return name
    return None
