"""The parts every span of a run is made of: its trace, its times, its attributes.

Every attempt of one run lands in one trace: the run id determines a trace id and a
span id (:func:`polyloop.run_trace_id` computes the same), and the span they name is
the parent, never exported, of an attempt with no current span in the caller's context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.util.types import AttributeValue

from polyloop._shared import run_trace_ids

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def run_span_context(run_id: str) -> SpanContext:
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


def run_parent(run_id: str) -> Context:
    """A context whose span is the run's derived, never exported, parent."""
    return trace.set_span_in_context(NonRecordingSpan(run_span_context(run_id)))


def ns(at: datetime | None) -> int:
    """Nanoseconds since the epoch, exactly (no float rounding); now when unknown."""
    if at is None:
        return time.time_ns()
    if at.tzinfo is None:  # records are aware UTC; a naive one is read as UTC
        at = at.replace(tzinfo=UTC)
    return (at - _EPOCH) // timedelta(microseconds=1) * 1000


def seconds_ns(seconds: float | None) -> int:
    """A recorded duration in nanoseconds; 0 when the record has none."""
    return max(0, round(seconds * 1e9)) if seconds is not None else 0


@dataclass(slots=True)
class Attributes:
    """A span's attributes as they are gathered: ``None`` is left out, text made exportable."""

    values: dict[str, AttributeValue] = field(default_factory=dict)

    def put(self, key: str, value: AttributeValue | None) -> None:
        if isinstance(value, str):
            self.values[key] = exportable(value)
        elif isinstance(value, list | tuple) and any(isinstance(item, str) for item in value):
            self.values[key] = [exportable(item) for item in value if isinstance(item, str)]
        elif value is not None:
            self.values[key] = value


def run_attributes(run_id: str, operation: str) -> Attributes:
    """What every span of a run says: its operation and the run it belongs to."""
    attributes = Attributes()
    attributes.put("gen_ai.operation.name", operation)
    attributes.put("gen_ai.conversation.id", run_id)
    attributes.put("polyloop.run.id", run_id)
    return attributes


def exportable(text: str) -> str:
    """``text`` as OTLP can send it: a lone surrogate (half an emoji from a model, say),
    which protobuf refuses to encode and with it the whole batch, becomes its escape."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def failed(description: str) -> Status:
    """The error status of a span, its description exportable."""
    return Status(StatusCode.ERROR, exportable(description))
