"""Reading a log back: its recovery state, what is left to do, and the identity check.

A log is one of four things:

* ``FRESH``: no records at all;
* ``FINISHED``: it ends with an end record whose reason is not ``CANCELLED``;
* ``IN_DOUBT``: an intent has no result and its replay is ``NEVER``: the effect may or
  may not have happened, and only a person can tell;
* ``RESUMABLE``: anything else; :class:`Plan` says exactly where the run stopped.

Finished steps are taken from their step records and never recomputed. The step that
was interrupted is described by what landed of it: an open model-call intent, a model
result with no action intent yet, or an open action intent.

:func:`read_plan` also checks that the records can follow each other the way the
library writes them, and raises :class:`~polyloop.types.CorruptLog` naming the record
index when they cannot: a log is never resumed on a guess.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from polyloop._shared import canonical_json
from polyloop.ports import StoredRun
from polyloop.types import (
    ActionStatus,
    CorruptLog,
    Intent,
    IntentKind,
    JSONValue,
    Record,
    Replay,
    Result,
    RunEnded,
    RunLog,
    RunResult,
    RunStarted,
    RunState,
    RunStatus,
    StepRecord,
    StopReason,
    Usage,
)


class RecoveryState(enum.StrEnum):
    FRESH = "fresh"
    FINISHED = "finished"
    RESUMABLE = "resumable"
    IN_DOUBT = "in_doubt"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What a log says about its run.

    ``open_intent`` is an intent without its result (a model call or an action of the
    interrupted step); ``model_result`` is the interrupted step's model result when it
    landed; ``ended`` is the last end record, if the log ends with one;
    ``last_action`` is the action intent of the last finished step, if it had one.
    """

    state: RecoveryState
    started: RunStarted | None = None
    steps: tuple[StepRecord, ...] = ()
    open_intent: Intent | None = None
    model_result: Result | None = None
    ended: RunEnded | None = None
    last_action: Intent | None = None


def model_result_id(run_id: str, step: int) -> str:
    """The result id the library allocates for step ``step``'s model call."""
    return f"{run_id}:{step}:model"


def action_result_id(run_id: str, step: int) -> str:
    """The result id the library allocates for step ``step``'s action."""
    return f"{run_id}:{step}:action"


@dataclass(slots=True)
class _Walk:
    """The state of a walk through a log, one record at a time."""

    run_id: str
    started: RunStarted | None = None
    steps: list[StepRecord] = field(default_factory=list)
    open_intent: Intent | None = None
    model_result: Result | None = None
    action_result: Result | None = None
    ended: RunEnded | None = None
    step_action: Intent | None = None
    last_action: Intent | None = None


def read_plan(log: RunLog) -> Plan:
    """Classify ``log`` and describe where its run stopped. Raises ``CorruptLog``."""
    walk = _Walk(run_id=log.run_id)
    for index, record in enumerate(log.records):
        problem = _accept(walk, record, index)
        if problem is not None:
            raise CorruptLog(problem, run_id=log.run_id, location=f"record {index}")
    if walk.started is None:
        return Plan(state=RecoveryState.FRESH)
    if walk.action_result is not None:
        raise CorruptLog(
            "an action result is not followed by its step record",
            run_id=log.run_id,
            location=f"record {len(log.records) - 1}",
        )
    return Plan(
        state=_state(walk),
        started=walk.started,
        steps=tuple(walk.steps),
        open_intent=walk.open_intent,
        model_result=walk.model_result,
        ended=walk.ended,
        last_action=walk.last_action if walk.steps else None,
    )


def _state(walk: _Walk) -> RecoveryState:
    if walk.ended is not None and walk.ended.is_final:
        return RecoveryState.FINISHED
    if walk.open_intent is not None and walk.open_intent.replay is Replay.NEVER:
        return RecoveryState.IN_DOUBT
    return RecoveryState.RESUMABLE


def _accept(walk: _Walk, record: Record, index: int) -> str | None:
    """Fold one record into the walk; a description of the problem if it cannot follow."""
    if record.run_id != walk.run_id:
        return f"record belongs to run {record.run_id!r}"
    if isinstance(record, RunStarted):
        if index != 0:
            return "a second start record"
        walk.started = record
        return None
    if walk.started is None:
        return "the first record is not a start record"
    if walk.ended is not None:
        if walk.ended.is_final:
            return "a record after the end record"
        walk.ended = None  # a cancelled run was resumed
    if isinstance(record, Intent):
        return _accept_intent(walk, record)
    if isinstance(record, Result):
        return _accept_result(walk, record)
    if isinstance(record, StepRecord):
        return _accept_step(walk, record)
    return _accept_end(walk, record)


def _accept_intent(walk: _Walk, intent: Intent) -> str | None:
    step = len(walk.steps)
    if intent.step != step or intent.call_index != step:
        return f"intent for step {intent.step} where step {step} was expected"
    if walk.open_intent is not None:
        return f"intent {intent.result_id!r} while {walk.open_intent.result_id!r} is open"
    if intent.kind is IntentKind.MODEL_CALL:
        if walk.model_result is not None:
            return "a second model call in one step"
        expected = model_result_id(walk.run_id, step)
    else:
        if walk.model_result is None:
            return "an action intent before the step's model result"
        expected = action_result_id(walk.run_id, step)
    if intent.result_id != expected:
        return f"intent result id {intent.result_id!r}, expected {expected!r}"
    walk.open_intent = intent
    return None


def _accept_result(walk: _Walk, result: Result) -> str | None:
    intent = walk.open_intent
    if intent is None or intent.result_id != result.result_id or intent.kind is not result.kind:
        return f"result {result.result_id!r} has no open intent"
    walk.open_intent = None
    if result.kind is IntentKind.MODEL_CALL:
        walk.model_result = result
    else:
        walk.action_result = result
        walk.step_action = intent
    return None


def _accept_step(walk: _Walk, step: StepRecord) -> str | None:
    expected = len(walk.steps)
    if step.step != expected:
        return f"step record {step.step} where step {expected} was expected"
    if walk.model_result is None:
        return f"step record {step.step} without a model result"
    if walk.open_intent is not None:
        return f"step record {step.step} while {walk.open_intent.result_id!r} is open"
    walk.steps.append(step)
    walk.last_action = walk.step_action
    walk.model_result = None
    walk.action_result = None
    walk.step_action = None
    return None


def _accept_end(walk: _Walk, end: RunEnded) -> str | None:
    if walk.action_result is not None:
        return "an end record between an action result and its step record"
    # A cancelled end may be written while a step write of unknown fate was in flight,
    # so only the counts of a final end are held to the log.
    if end.is_final and end.steps != len(walk.steps):
        return f"end record counts {end.steps} steps, the log holds {len(walk.steps)}"
    walk.ended = end
    return None


def valid_step_count(steps: tuple[StepRecord, ...]) -> int:
    """How many of ``steps`` used up a valid step (their action ran)."""
    return sum(1 for step in steps if step.action_status is ActionStatus.EXECUTED)


def recorded_result(plan: Plan) -> RunResult:
    """The result of a finished run, read from its log (returned by ``resume``)."""
    end = plan.ended
    if end is None:
        raise ValueError("the plan has no end record")
    return RunResult(
        run_id=end.run_id,
        stop_reason=end.stop_reason,
        final_answer=end.final_answer,
        steps=plan.steps,
        step_count=end.steps,
        valid_step_count=end.valid_steps,
        resumed=True,
        detail=end.detail,
        usage=Usage.of_steps(plan.steps),
    )


def status(plan: Plan, stored: StoredRun | None) -> RunStatus:
    """The public status of a started run, from its plan and what its store says of it.

    A claimed run that has not finished is ``RUNNING``: an open intent then means an
    effect in flight, not one in doubt. A run that ended ``IN_DOUBT`` stays ``IN_DOUBT``.
    """
    if plan.started is None:
        raise ValueError("the plan has no start record")
    ended = plan.ended
    if plan.state is RecoveryState.FINISHED:
        assert ended is not None
        finished = ended.stop_reason is not StopReason.IN_DOUBT
        state = RunState.FINISHED if finished else RunState.IN_DOUBT
    elif stored is not None and stored.claimed:
        state = RunState.RUNNING
    elif plan.state is RecoveryState.IN_DOUBT:
        state = RunState.IN_DOUBT
    else:
        state = RunState.RESUMABLE
    return RunStatus(
        run_id=plan.started.run_id,
        state=state,
        stop_reason=ended.stop_reason if ended is not None else None,
        detail=ended.detail if ended is not None else None,
        steps=len(plan.steps),
        valid_steps=valid_step_count(plan.steps),
        open_intent=plan.open_intent,
        last_record_at=stored.updated_at if stored is not None else None,
        owner=stored.owner if stored is not None else None,
        lease_expires_at=stored.lease_expires_at if stored is not None else None,
    )


def in_doubt_detail(intent: Intent) -> str:
    """What an ``IN_DOUBT`` end says: the intent's kind and result id."""
    return (
        f"{intent.kind.value} intent {intent.result_id!r} has no result and its replay "
        f"is never: it may or may not have happened"
    )


# Snapshot keys of the event sink: kept in the start record, left out of the identity.
OBSERVING_PREFIX = "events."


def identity_differences(
    recorded: Mapping[str, JSONValue], current: Mapping[str, JSONValue]
) -> tuple[tuple[str, JSONValue, JSONValue], ...]:
    """Every key whose value differs between two snapshots, as sorted triples.

    Values are compared as canonical JSON, so a tuple equals the list it was written
    as, while ``1``, ``1.0`` and ``true`` stay different. A missing key reads ``None``.
    The event sink's keys (``events.``) are recorded but not compared: events are never
    persisted and change nothing a run does, so a run may be resumed with another sink
    (tracing added to a fleet, say).
    """
    differences = []
    for key in sorted(set(recorded) | set(current)):
        if key.startswith(OBSERVING_PREFIX):
            continue
        before, after = recorded.get(key), current.get(key)
        if key not in recorded or key not in current or not _same(before, after):
            differences.append((key, before, after))
    return tuple(differences)


def _same(before: Any, after: Any) -> bool:
    try:
        return canonical_json(before) == canonical_json(after)
    except (TypeError, ValueError, RecursionError):
        # Not plain JSON, so not what the library records: a store handed back something
        # else than was written, and it matches nothing current.
        return False
