"""Checks on what the seams hand the loop, and the payloads it records of them.

A model client, interpreter or executor is code the library does not own: what each
returns is checked here before the loop trusts it, and replies and outcomes
are turned into the plain payloads the store keeps (and back, for a reply).
"""

from __future__ import annotations

from polyloop.ports import Action, ActionOutcome, FinalAnswer, InvalidDecision, ModelReply
from polyloop.types import ActionStatus, CorruptLog, Intent, JSONValue


def fault(detail: str) -> ActionOutcome:
    return ActionOutcome(
        status=ActionStatus.ENV_FAULT, observation=detail, synthesized=True, done=False
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
    if reply.call_id == "":
        # An empty id looks like a valid join key and silently matches nothing.
        return ModelReply(call_id=None, content=reply.content, reasoning=reply.reasoning)
    return reply


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
    return None


def reply_payload(reply: ModelReply) -> JSONValue:
    return {"call_id": reply.call_id, "content": reply.content, "reasoning": reply.reasoning}


def reply_from(payload: JSONValue, run_id: str, result_id: str) -> ModelReply:
    if (
        isinstance(payload, dict)
        and isinstance(payload.get("content"), str)
        and isinstance(payload.get("call_id"), (str, type(None)))
        and isinstance(payload.get("reasoning"), (str, type(None)))
    ):
        return ModelReply(
            call_id=payload["call_id"],  # type: ignore[arg-type]
            content=payload["content"],  # type: ignore[arg-type]
            reasoning=payload["reasoning"],  # type: ignore[arg-type]
        )
    raise CorruptLog(f"model result {result_id!r} holds no reply", run_id=run_id)


def outcome_payload(outcome: ActionOutcome) -> JSONValue:
    return {
        "status": outcome.status.value,
        "observation": outcome.observation,
        "synthesized": outcome.synthesized,
        "done": outcome.done,
        "truncated_chars": outcome.truncated_chars,
    }


def action_name(intent: Intent | None) -> str | None:
    if intent is None or not isinstance(intent.payload, dict):
        return None
    name = intent.payload.get("name")
    return name if isinstance(name, str) else None
