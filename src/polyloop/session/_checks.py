"""Checks on what the seams hand the loop, and the payloads it records of them.

A model client, interpreter or executor is code the library does not own: what each
returns is checked here before the loop trusts it, and replies and outcomes
are turned into the plain payloads the store keeps (and back, for a reply).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from polyloop._shared import exception_text, plain_copy
from polyloop.ports import (
    Action,
    ActionExecutor,
    ActionOutcome,
    FinalAnswer,
    InvalidDecision,
    ModelReply,
)
from polyloop.serialization import plain
from polyloop.serialization._schema import (
    plain_tool_call,
    plain_usage,
    tool_call_from,
    usage_from,
)
from polyloop.types import (
    ActionStatus,
    CorruptLog,
    FinishReason,
    Intent,
    JSONValue,
    Replay,
    ToolCallBlock,
    UnloggableValue,
    Usage,
)


def fault(detail: str) -> ActionOutcome:
    """The outcome of an action the environment failed: ``detail`` says how."""
    return ActionOutcome(
        status=ActionStatus.ENV_FAULT, observation=detail, synthesized=True, done=False
    )


def refusal(reason: str) -> ActionOutcome:
    """The outcome of an action that did not run: ``reason`` says why."""
    return ActionOutcome(
        status=ActionStatus.NOT_EXECUTED, observation=reason, synthesized=True, done=False
    )


def checked_reply(reply: object) -> ModelReply:
    if not isinstance(reply, ModelReply):
        raise TypeError(f"the model client returned {type(reply).__name__}, not ModelReply")
    if not isinstance(reply.content, str):
        raise TypeError(f"the model reply content is {type(reply.content).__name__}, not str")
    if reply.reasoning is not None and not isinstance(reply.reasoning, str):
        raise TypeError("the model reply reasoning is not a string")
    if reply.call_id is not None and not isinstance(reply.call_id, str):
        raise TypeError("the model reply call_id is not a string")
    for name in ("model", "refusal"):
        if getattr(reply, name) is not None and not isinstance(getattr(reply, name), str):
            raise TypeError(f"the model reply {name} is not a string")
    if reply.finish is not None and not isinstance(reply.finish, FinishReason):
        raise TypeError("the model reply finish is not a FinishReason")
    if reply.usage is not None and not isinstance(reply.usage, Usage):
        raise TypeError(f"the model reply usage is {type(reply.usage).__name__}, not Usage")
    _check_tool_calls(reply.tool_calls)
    if reply.call_id == "":
        # An empty id looks like a valid join key and silently matches nothing.
        return dataclasses.replace(reply, call_id=None)
    return reply


def _check_tool_calls(calls: object) -> None:
    if not isinstance(calls, tuple) or not all(isinstance(c, ToolCallBlock) for c in calls):
        raise TypeError("the model reply tool_calls is not a tuple of ToolCallBlock")
    for call in calls:
        if not isinstance(call.call_id, str) or not call.call_id:
            raise TypeError("a tool call of the model reply has no call_id string")
        if not isinstance(call.name, str):
            raise TypeError("a tool call of the model reply has no name string")
        # The arguments go into records: refuse what the log could not carry back.
        plain_copy(call.arguments, root=f"tool call {call.call_id!r} arguments")


def outcome_problem(outcome: object) -> str | None:
    """Why an executor's return value cannot be recorded as an outcome, if it cannot."""
    if not isinstance(outcome, ActionOutcome):
        return f"the executor returned {type(outcome).__name__}, not ActionOutcome"
    wrong = []
    if not isinstance(outcome.status, ActionStatus):
        wrong.append("status")
    if not isinstance(outcome.observation, str):
        wrong.append("observation")
    if not isinstance(outcome.synthesized, bool):
        wrong.append("synthesized")
    if not isinstance(outcome.done, bool):
        wrong.append("done")
    cut = outcome.truncated_chars
    if not isinstance(cut, int) or isinstance(cut, bool) or cut < 0:
        wrong.append("truncated_chars")
    if wrong:
        return f"the executor's outcome has ill-typed fields: {', '.join(wrong)}"
    return None


_DECISION_TEXTS: dict[type, tuple[str, ...]] = {
    Action: ("action_text", "history_text"),
    FinalAnswer: ("answer", "history_text"),
    InvalidDecision: ("feedback", "history_text"),
}


def decision_problem(decision: object) -> str | None:
    """Why an interpreter's return value is not a usable decision, if it is not."""
    if not isinstance(decision, (Action, FinalAnswer, InvalidDecision)):
        return (
            f"the interpreter returned {type(decision).__name__}, "
            f"not Action, FinalAnswer or InvalidDecision"
        )
    wrong = [
        name
        for name in _DECISION_TEXTS[type(decision)]
        if not isinstance(getattr(decision, name), str)
    ]
    if wrong:
        return f"the interpreter's {type(decision).__name__} has non-string {', '.join(wrong)}"
    if isinstance(decision, Action) and not isinstance(decision.tool_call, ToolCallBlock | None):
        return "the interpreter's Action has a tool_call that is not a ToolCallBlock"
    return None


def reply_payload(reply: ModelReply) -> JSONValue:
    """The model result's payload. What the server reported beyond the text is written
    only when reported, so a reply that reports nothing more is recorded as before."""
    payload: dict[str, JSONValue] = {
        "call_id": reply.call_id,
        "content": reply.content,
        "reasoning": reply.reasoning,
    }
    if reply.finish is not None:
        payload["finish"] = reply.finish.value
    if reply.usage is not None:
        payload["usage"] = plain_usage(reply.usage)
    if reply.model is not None:
        payload["model"] = reply.model
    if reply.refusal is not None:
        payload["refusal"] = reply.refusal
    if reply.tool_calls:
        payload["tool_calls"] = [plain_tool_call(call) for call in reply.tool_calls]
    return payload


def reply_from(payload: JSONValue, run_id: str, result_id: str) -> ModelReply:
    """The reply a model result holds, as the client returned it."""
    if not (
        isinstance(payload, dict)
        and isinstance(payload.get("content"), str)
        and all(_str_or_none(payload.get(k)) for k in ("call_id", "reasoning", "model", "refusal"))
    ):
        raise CorruptLog(f"model result {result_id!r} holds no reply", run_id=run_id)
    try:
        finish = None if payload.get("finish") is None else FinishReason(str(payload["finish"]))
        usage = _usage_from(payload.get("usage"))
        tool_calls = _tool_calls_from(payload.get("tool_calls", []))
    except (ValueError, TypeError) as exc:
        raise CorruptLog(f"model result {result_id!r}: {exc}", run_id=run_id) from None
    return ModelReply(
        call_id=payload.get("call_id"),  # type: ignore[arg-type]
        content=payload["content"],  # type: ignore[arg-type]
        reasoning=payload.get("reasoning"),  # type: ignore[arg-type]
        finish=finish,
        usage=usage,
        model=payload.get("model"),  # type: ignore[arg-type]
        refusal=payload.get("refusal"),  # type: ignore[arg-type]
        tool_calls=tool_calls,
    )


def _tool_calls_from(value: Any) -> tuple[ToolCallBlock, ...]:
    if not isinstance(value, list):
        raise TypeError(f"tool_calls must be a list, not {value!r:.80}")
    calls = tuple(tool_call_from(item) for item in value)
    if not all(
        c is not None and isinstance(c.call_id, str) and isinstance(c.name, str) for c in calls
    ):
        raise TypeError(f"tool_calls holds something that is not a tool call: {value!r:.80}")
    return calls  # type: ignore[return-value]


def _str_or_none(value: object) -> bool:
    return value is None or isinstance(value, str)


def _usage_from(value: Any) -> Usage | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"usage must be an object, not {value!r:.80}")
    return usage_from(value)


def outcome_payload(outcome: ActionOutcome) -> JSONValue:
    return {
        "status": outcome.status.value,
        "observation": outcome.observation,
        "synthesized": outcome.synthesized,
        "done": outcome.done,
        "truncated_chars": outcome.truncated_chars,
    }


def action_name(intent: Intent | None) -> str | None:
    return None if intent is None else action_name_of(intent.payload)


def action_name_of(payload: JSONValue) -> str | None:
    """The tool a ``{"name", "arguments"}`` payload calls, if it names one."""
    if not isinstance(payload, dict):
        return None
    name = payload.get("name")
    return name if isinstance(name, str) else None


def replay_policy(executor: ActionExecutor, action: Action) -> Replay | str:
    """The executor's replay policy for ``action``, or why there is none."""
    try:
        replay = executor.replay(action)
    except Exception as exc:  # noqa: BLE001 - the executor's fault, reported as one
        return exception_text(exc)
    if not isinstance(replay, Replay):
        kind = type(replay).__name__
        return f"TypeError: the executor's replay() returned {kind}, not Replay"
    return replay


def unloggable(action: Action, run_id: str) -> ActionOutcome | None:
    """The refusal of an action whose intent could not record it, if it could not:
    nothing may run that its intent cannot record. Only the payload can be unloggable
    (the interpreter's texts were checked as strings)."""
    try:
        plain(action.payload, owner="Intent", field="payload", run_id=run_id)
    except UnloggableValue as exc:
        return refusal(exc.reason)
    return None
