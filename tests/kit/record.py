"""Log records built by hand, for the tests that write, read or replay them directly.

A test names only the fields it is about; every other field keeps the plain value of an
executed action step, and a call's result id is the one the kernel gives it.
"""

from __future__ import annotations

from typing import Any

from polyloop.types import (
    ActionStatus,
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Replay,
    Result,
    StepRecord,
)


def result_id(run_id: str, k: int, kind: IntentKind) -> str:
    """The result id of step ``k``'s call of ``kind``, spelled as the kernel spells it."""
    call = "model" if kind is IntentKind.MODEL_CALL else "action"
    return f"{run_id}:{k}:{call}"


def intent(
    run_id: str,
    k: int,
    kind: IntentKind,
    payload: JSONValue,
    *,
    replay: Replay = Replay.NEVER,
    **fields: Any,
) -> Intent:
    """The intent of step ``k``'s call of ``kind``: the step and call index are both ``k``."""
    return Intent(
        run_id=run_id,
        result_id=result_id(run_id, k, kind),
        kind=kind,
        step=k,
        call_index=k,
        replay=replay,
        payload=payload,
        **fields,
    )


def result(run_id: str, k: int, kind: IntentKind, payload: JSONValue, **fields: Any) -> Result:
    """The result of step ``k``'s call of ``kind``."""
    return Result(
        run_id=run_id, result_id=result_id(run_id, k, kind), kind=kind, payload=payload, **fields
    )


def step(run_id: str = "r", k: int = 0, **fields: Any) -> StepRecord:
    """Step ``k``, which ran an action and observed it; ``fields`` change any field."""
    values: dict[str, Any] = {
        "call_id": None,
        "model_output": "x",
        "reasoning": None,
        "decision": DecisionKind.ACTION,
        "history_text": "x",
        "action_text": "t()",
        "observation": "o",
        "observation_synthesized": False,
        "action_status": ActionStatus.EXECUTED,
        "done": False,
        "truncated_chars": 0,
        "error": None,
    }
    values.update(fields)
    return StepRecord(run_id=run_id, step=k, **values)
