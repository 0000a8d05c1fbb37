"""The spans of a step, built from its records: a ``chat`` span for the model call and,
when the step ran an action, an ``execute_tool`` span.

A call the run made already has its span (started while the call ran); the record
names it and adds its attributes. A call the run did not make (a reply read back from
the log, a step an earlier attempt logged) gets a span built at the record's own times.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer

from polyloop.otel._spans import Attributes, exportable, failed, ns, run_attributes, run_parent
from polyloop.types import ActionStatus, Amended, Intent, Settlement, StepRecord, ToolCallBlock

_FAILED_ACTIONS = {
    ActionStatus.ENV_FAULT: "env_fault",
    ActionStatus.NOT_EXECUTED: "not_executed",
}
# A recorded failure reads "ExceptionClass: message"; the class is the error type.
_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][\w.]*):")


@dataclass(slots=True, kw_only=True)
class Call:
    """The span of a model call or an action the run made, and when the call returned
    (``None`` while it runs). It stays open until the step's record brings its
    attributes."""

    span: Span
    end_ns: int | None = None


@dataclass(frozen=True, slots=True)
class Spanned:
    """Where and when to build the span of a call the run did not make itself."""

    parent: Context
    start_ns: int
    end_ns: int


def step_attributes(
    run_id: str, step: int, operation: str, *, resumed: bool | None = None, rebuilt: bool = False
) -> Attributes:
    """What every span of a step's call says."""
    attributes = run_attributes(run_id, operation)
    attributes.put("polyloop.step", step)
    attributes.put("polyloop.step.resumed", resumed)
    attributes.put("polyloop.rebuilt", True if rebuilt else None)
    return attributes


def chat_span(
    tracer: Tracer, run_id: str, step: StepRecord, made: Call | Spanned, *, rebuilt: bool
) -> None:
    """End the ``chat`` span of ``step``'s model call, with what its record says."""
    attributes = step_attributes(run_id, step.step, "chat", resumed=step.resumed, rebuilt=rebuilt)
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
    name = f"chat {exportable(step.model)}" if step.model else "chat"
    span, end_ns = _span_of(tracer, made, name, SpanKind.CLIENT, attributes)
    if step.error is not None:
        span.set_status(failed(step.error))
    span.end(end_time=end_ns)


def tool_span(
    tracer: Tracer,
    run_id: str,
    step: StepRecord,
    intent: Intent | None,
    made: Call | Spanned,
    settlement: Settlement | None,
    *,
    rebuilt: bool,
) -> None:
    """End the ``execute_tool`` span of ``step``'s action, with what its record says."""
    assert step.action_status is not None
    attributes, span_name = _tool_attributes(
        run_id, step.step, step.tool_call, intent, resumed=step.resumed, rebuilt=rebuilt
    )
    attributes.put("polyloop.action.status", step.action_status.value)
    failure = _FAILED_ACTIONS.get(step.action_status)
    attributes.put("error.type", failure)
    span, end_ns = _span_of(tracer, made, span_name, SpanKind.INTERNAL, attributes)
    if failure is not None:
        span.set_status(failed(step.observation or failure))
    if settlement is not None:
        # At the step record's time, inside the span: the settlement itself may
        # predate the span, whose times are those of the record that closed it.
        span.add_event("polyloop.settled", _settled(settlement).values, timestamp=end_ns)
    span.end(end_time=end_ns)


def in_doubt_span(tracer: Tracer, run_id: str, intent: Intent) -> None:
    """The span of an action an earlier attempt announced and logged no result of.

    It may or may not have run: the status stays unset, never OK or an error, and it
    starts and ends when its intent was written, since how long it ran is unknown.
    """
    attributes, name = _tool_attributes(
        run_id, intent.step, intent.tool_call, intent, resumed=None, rebuilt=True
    )
    attributes.put("polyloop.action.in_doubt", True)
    at = ns(intent.at)
    made = Spanned(run_parent(run_id), at, at)
    span, end_ns = _span_of(tracer, made, name, SpanKind.INTERNAL, attributes)
    span.end(end_time=end_ns)


def _span_of(
    tracer: Tracer, made: Call | Spanned, name: str, kind: SpanKind, attributes: Attributes
) -> tuple[Span, int]:
    """The step's span, named and described, and the time to end it: the span of the
    call when the run made it, else one built from the record's times."""
    if isinstance(made, Call):
        made.span.update_name(name)
        made.span.set_attributes(attributes.values)
        return made.span, made.end_ns if made.end_ns is not None else time.time_ns()
    span = tracer.start_span(
        name, context=made.parent, kind=kind, attributes=attributes.values, start_time=made.start_ns
    )
    return span, made.end_ns


def _error_type(text: str) -> str:
    found = _EXCEPTION_NAME.match(text)
    return found.group(1) if found else "_OTHER"


def _tool_attributes(
    run_id: str,
    step: int,
    tool_call: ToolCallBlock | None,
    intent: Intent | None,
    *,
    resumed: bool | None,
    rebuilt: bool,
) -> tuple[Attributes, str]:
    """What every ``execute_tool`` span says of its call, and the span's name."""
    name = _tool_name(tool_call, intent)
    attributes = step_attributes(run_id, step, "execute_tool", resumed=resumed, rebuilt=rebuilt)
    attributes.put("gen_ai.tool.name", name)
    if name is not None:
        attributes.put("gen_ai.tool.type", "function")
    if tool_call is not None:
        attributes.put("gen_ai.tool.call.id", tool_call.call_id)
    attributes.put("polyloop.action.result_id", intent.result_id if intent else None)
    return attributes, f"execute_tool {exportable(name)}" if name else "execute_tool"


def amended_span(tracer: Tracer, amended: Amended) -> None:
    """The span of an amendment: an instant in the run's trace, when it was written, that
    says who accepted which snapshot keys, and why (its record holds the values)."""
    attributes = run_attributes(amended.run_id, "amend_agent")
    attributes.put("polyloop.step", amended.step)
    attributes.put("polyloop.amended_by", amended.by)
    attributes.put("polyloop.amended.reason", amended.reason)
    attributes.put("polyloop.amended.keys", [key for key, _, _ in amended.differences])
    at = ns(amended.at)
    span = tracer.start_span(
        "amend_agent",
        context=run_parent(amended.run_id),
        kind=SpanKind.INTERNAL,
        attributes=attributes.values,
        start_time=at,
    )
    span.end(end_time=at)


def _settled(settlement: Settlement) -> Attributes:
    """What the ``polyloop.settled`` event of a settled action's span says."""
    attributes = Attributes()
    attributes.put("polyloop.settled_by", settlement.by)
    attributes.put("polyloop.settled.ran", settlement.ran)
    attributes.put("polyloop.settled.by_probe", settlement.by_probe)
    attributes.put("polyloop.probe.duration_s", settlement.duration_s)
    return attributes


def _tool_name(tool_call: ToolCallBlock | None, intent: Intent | None) -> str | None:
    if tool_call is not None:
        return tool_call.name
    payload = intent.payload if intent is not None else None
    if isinstance(payload, dict) and isinstance(payload.get("name"), str):
        name = payload["name"]
        assert isinstance(name, str)
        return name
    return None
