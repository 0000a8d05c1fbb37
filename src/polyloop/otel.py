"""An event sink that turns a run's events into OpenTelemetry spans.

:class:`OpenTelemetrySink` follows the OpenTelemetry semantic conventions for generative
AI: one ``invoke_agent`` span per run attempt, and for every step a ``chat`` span for
its model call and, when the step ran an action, an ``execute_tool`` span. The step
spans are built when the step's record arrives, with the start and end times the record
states, so they are exact but never current: nothing the model client or a tool does
while it runs can nest under them.

Every attempt of one run lands in one trace, in any process: the run id determines a
trace id and a span id, and without a current span in the caller's context an
attempt's span is the child of that (never exported) parent. A resumed attempt links
to it, and so does any attempt whose parent is the caller's current span.

Importing this module imports ``opentelemetry`` (the ``polyloop[otel]`` extra, the API
only); nothing else in the library does. The application chooses the SDK, the span
processors and the exporters.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio.lowlevel
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
    JSONValue,
    RunEnded,
    RunStarted,
    StepRecord,
    StopReason,
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


def _run_span_context(run_id: str) -> SpanContext:
    """The span context every attempt of ``run_id`` descends from or links to.

    Derived from the run id alone, so each process computes the same one: a trace id
    from the first 16 bytes of a SHA-256, a span id from the next 8.
    """
    digest = hashlib.sha256(f"polyloop run\x00{run_id}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
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


@dataclass(slots=True)
class _Attributes:
    values: dict[str, AttributeValue] = field(default_factory=dict)

    def put(self, key: str, value: AttributeValue | None) -> None:
        if value is not None:
            self.values[key] = value


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
    """

    __slots__ = ("_attempts", "_lock", "_tracer")

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
        self._tracer: Tracer = provider.get_tracer(_SCOPE, _version())
        self._attempts: dict[str, _Attempt] = {}
        # Spans are built without awaiting; the lock only matters when event loops in
        # several threads share one sink.
        self._lock = threading.Lock()

    def parameters(self) -> Mapping[str, JSONValue]:
        # Written into the start record: nothing here may differ between processes.
        return {"kind": "opentelemetry"}

    async def emit(self, event: Event) -> None:
        """Turn ``event`` into spans: open, add to or end its run's attempt span.

        Cancellation: the spans are built before the one checkpoint, so a cancelled emit
        has still recorded its event; the cancellation then propagates.
        """
        try:
            with self._lock:
                self._take(event)
        except Exception:  # telemetry must never disturb a run
            logger.exception("run %r: could not record %s as spans", event.run_id, event.kind)
        await anyio.lowlevel.checkpoint()

    def close(self) -> None:
        """End every span still open, each as abandoned at the last moment it reached.

        Safe to call more than once; the sink stays usable afterwards.
        """
        with self._lock:
            run_ids = list(self._attempts)
            for run_id in run_ids:
                self._abandon(run_id, "the sink was closed before the run attempt ended")

    def __repr__(self) -> str:
        return f"OpenTelemetrySink(open_runs={len(self._attempts)})"

    # -- events ---------------------------------------------------------------------------

    def _take(self, event: Event) -> None:
        record = event.record
        if event.kind is EventKind.RUN_STARTED and isinstance(record, RunStarted):
            self._open(event.run_id, start_ns=_ns(record.at), resumed=False)
        elif event.kind is EventKind.RUN_RESUMED:
            self._open(event.run_id, start_ns=time.time_ns(), resumed=True)
        elif event.kind is EventKind.STEP_FINISHED and isinstance(record, StepRecord):
            self._step(event.run_id, record, event.intent)
        elif event.kind is EventKind.RUN_ENDED and isinstance(record, RunEnded):
            self._end(event.run_id, record)

    def _open(self, run_id: str, *, start_ns: int, resumed: bool) -> None:
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
        links = [Link(run_context, {"polyloop.link": "continues"})] if linked else None
        span = self._tracer.start_span(
            "invoke_agent",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes.values,
            links=links,
            start_time=start_ns,
        )
        self._attempts[run_id] = _Attempt(
            span=span,
            context=trace.set_span_in_context(span),
            start_ns=start_ns,
            last_ns=start_ns,
        )

    def _step(self, run_id: str, step: StepRecord, intent: Intent | None) -> None:
        attempt = self._attempts.get(run_id)
        if attempt is not None:
            parent, floor = attempt.context, attempt.start_ns
        else:
            # No open attempt (a sink attached mid-run): keep the spans in the run's trace.
            parent, floor = (
                trace.set_span_in_context(NonRecordingSpan(_run_span_context(run_id))),
                0,
            )
        end_ns = max(_ns(step.at), floor)
        start_ns = max(end_ns - _seconds_ns(step.duration_s), floor)
        model_end = min(start_ns + _seconds_ns(step.model_duration_s), end_ns)
        self._chat(run_id, step, parent, start_ns, model_end)
        if step.action_status is not None:
            tool_start = max(end_ns - _seconds_ns(step.action_duration_s), start_ns)
            self._tool(run_id, step, intent, parent, tool_start, end_ns)
        if attempt is not None:
            attempt.last_ns = max(attempt.last_ns, end_ns)

    def _chat(
        self, run_id: str, step: StepRecord, parent: Context, start_ns: int, end_ns: int
    ) -> None:
        attributes = _common(run_id, step, "chat")
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
        name = f"chat {step.model}" if step.model else "chat"
        span = self._tracer.start_span(
            name,
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=attributes.values,
            start_time=start_ns,
        )
        if step.error is not None:
            span.set_status(Status(StatusCode.ERROR, step.error))
        span.end(end_time=end_ns)

    def _tool(
        self,
        run_id: str,
        step: StepRecord,
        intent: Intent | None,
        parent: Context,
        start_ns: int,
        end_ns: int,
    ) -> None:
        assert step.action_status is not None
        name = _tool_name(step, intent)
        attributes = _common(run_id, step, "execute_tool")
        attributes.put("gen_ai.tool.name", name)
        if name is not None:
            attributes.put("gen_ai.tool.type", "function")
        if step.tool_call is not None:
            attributes.put("gen_ai.tool.call.id", step.tool_call.call_id)
        attributes.put("polyloop.action.status", step.action_status.value)
        attributes.put("polyloop.action.result_id", intent.result_id if intent else None)
        failure = _FAILED_ACTIONS.get(step.action_status)
        attributes.put("error.type", failure)
        span = self._tracer.start_span(
            f"execute_tool {name}" if name else "execute_tool",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attributes.values,
            start_time=start_ns,
        )
        if failure is not None:
            span.set_status(Status(StatusCode.ERROR, step.observation or failure))
        span.end(end_time=end_ns)

    def _end(self, run_id: str, end: RunEnded) -> None:
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
            span.set_status(Status(StatusCode.ERROR, end.detail or failure))
        span.end(end_time=max(_ns(end.at), attempt.last_ns))

    def _abandon(self, run_id: str, why: str) -> None:
        attempt = self._attempts.pop(run_id)
        try:
            attempt.span.set_attribute("polyloop.run.abandoned", True)
            attempt.span.set_attribute("error.type", "abandoned")
            attempt.span.set_status(Status(StatusCode.ERROR, why))
            attempt.span.end(end_time=attempt.last_ns)
        except Exception:  # the other open spans must still be ended
            logger.exception("run %r: could not end an abandoned span", run_id)


def _common(run_id: str, step: StepRecord, operation: str) -> _Attributes:
    attributes = _Attributes()
    attributes.put("gen_ai.operation.name", operation)
    attributes.put("gen_ai.conversation.id", run_id)
    attributes.put("polyloop.run.id", run_id)
    attributes.put("polyloop.step", step.step)
    attributes.put("polyloop.step.resumed", step.resumed)
    return attributes


def _tool_name(step: StepRecord, intent: Intent | None) -> str | None:
    if step.tool_call is not None:
        return step.tool_call.name
    payload = intent.payload if intent is not None else None
    if isinstance(payload, dict) and isinstance(payload.get("name"), str):
        name = payload["name"]
        assert isinstance(name, str)
        return name
    return None
