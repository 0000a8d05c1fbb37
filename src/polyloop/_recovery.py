"""Reading a log back: its recovery state, what is left to do, and the identity check.

A log is one of five things:

* ``FRESH``: no records at all;
* ``FINISHED``: it ends with a final end record (any reason but ``CANCELLED``,
  ``IN_DOUBT`` and ``AWAITING_APPROVAL``);
* ``IN_DOUBT``: an action or model-call intent has no result, its replay is ``NEVER``
  and no settlement says what became of it: only a person can tell (a model call
  settled as not run is announced again by a new intent with the same result id, the
  settlement between the two answering the first);
* ``AWAITING_APPROVAL``: an action was proposed and no verdict on it is recorded;
* ``RESUMABLE``: anything else; :class:`Plan` says exactly where the run stopped.

Finished steps are taken from their step records and never recomputed. The step that
was interrupted is described by what landed of it: an open model-call intent, a model
result with no action intent yet, or an open action intent.

:func:`read_plan` also checks that the records can follow each other the way the
library writes them, and raises :class:`~polyloop.types.CorruptLog` naming the record
index when they cannot: a log is never resumed on a guess.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from polyloop._shared import RECONCILE_PREFIX, canonical_json
from polyloop.ports import StoredRun
from polyloop.types import (
    ActionStatus,
    Amended,
    CorruptLog,
    Intent,
    IntentKind,
    JSONValue,
    Proposal,
    Ready,
    Record,
    Replay,
    Result,
    RunEnded,
    RunLog,
    RunResult,
    RunStarted,
    RunState,
    RunStatus,
    Settlement,
    StepRecord,
    StopReason,
    Usage,
    Verdict,
)


class RecoveryState(enum.StrEnum):
    FRESH = "fresh"
    FINISHED = "finished"
    RESUMABLE = "resumable"
    IN_DOUBT = "in_doubt"
    AWAITING_APPROVAL = "awaiting_approval"


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What a log says about its run.

    ``open_intent`` is an intent without its result (a model call or an action of the
    interrupted step); ``model_result`` is the interrupted step's model result when it
    landed; ``ended`` is the last end record, if the log ends with one;
    ``last_action`` is the action intent of the last finished step, if it had one.
    ``proposal``, ``verdict`` and ``settlement`` belong to the interrupted step: the
    action proposed for approval and the verdict on it, and the settlement of its
    intent in doubt (an action, or a model call). ``model_calls_again`` counts the
    model calls of that step a person settled as not run (see :func:`model_result_id`).
    ``snapshot`` is the snapshot the run goes on under: its start record's, with every
    amendment (``amendments``, in log order) applied.
    """

    state: RecoveryState
    started: RunStarted | None = None
    steps: tuple[StepRecord, ...] = ()
    open_intent: Intent | None = None
    model_result: Result | None = None
    ended: RunEnded | None = None
    last_action: Intent | None = None
    proposal: Proposal | None = None
    verdict: Verdict | None = None
    settlement: Settlement | None = None
    model_calls_again: int = 0
    snapshot: Mapping[str, JSONValue] = field(default_factory=dict)
    amendments: tuple[Amended, ...] = ()


def model_result_id(run_id: str, step: int, again: int = 0) -> str:
    """The result id the library allocates for step ``step``'s model call.

    ``again`` counts the model calls of the step that a person settled as not run: each
    call made again is a new effect with an id of its own (``<run_id>:<step>:model2``
    for the second), so an answer about one can never be taken for an answer about
    another, and a model client keying on the id sees a new call.
    """
    return f"{run_id}:{step}:model" if again == 0 else f"{run_id}:{step}:model{again + 1}"


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
    proposal: Proposal | None = None
    verdict: Verdict | None = None
    settlement: Settlement | None = None
    model_calls_again: int = 0
    snapshot: Mapping[str, JSONValue] = field(default_factory=dict)
    amendments: list[Amended] = field(default_factory=list)


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
        proposal=walk.proposal,
        verdict=walk.verdict,
        settlement=walk.settlement,
        model_calls_again=walk.model_calls_again,
        snapshot=walk.snapshot,
        amendments=tuple(walk.amendments),
    )


def _state(walk: _Walk) -> RecoveryState:
    if walk.ended is not None and walk.ended.is_final:
        return RecoveryState.FINISHED
    if _in_doubt(walk.open_intent, walk.settlement):
        return RecoveryState.IN_DOUBT
    if walk.proposal is not None and walk.verdict is None:
        return RecoveryState.AWAITING_APPROVAL
    return RecoveryState.RESUMABLE


def _in_doubt(intent: Intent | None, settlement: Settlement | None) -> bool:
    return intent is not None and intent.replay is Replay.NEVER and settlement is None


def _accept(walk: _Walk, record: Record, index: int) -> str | None:
    """Fold one record into the walk; a description of the problem if it cannot follow."""
    if record.run_id != walk.run_id:
        return f"record belongs to run {record.run_id!r}"
    if isinstance(record, RunStarted):
        if index != 0:
            return "a second start record"
        walk.started = record
        walk.snapshot = record.snapshot  # copied only if an amendment changes it
        return _accept_inherited(walk, record)
    if walk.started is None:
        return "the first record is not a start record"
    if isinstance(record, Amended):
        return _accept_amended(walk, record)  # an open end still stands after it
    if walk.ended is not None:
        problem = _after_end(walk.ended, record)
        if problem is not None:
            return problem
        walk.ended = None  # a cancelled run was resumed, or a person answered
    if isinstance(record, Intent):
        return _accept_intent(walk, record)
    if isinstance(record, Result):
        return _accept_result(walk, record)
    if isinstance(record, StepRecord):
        return _accept_step(walk, record)
    if isinstance(record, RunEnded):
        return _accept_end(walk, record)
    return _accept_review(walk, record)


def _accept_amended(walk: _Walk, amended: Amended) -> str | None:
    if walk.ended is not None and walk.ended.is_final:
        return "a record after the end record"
    step = len(walk.steps)
    if amended.step != step:
        return f"amendment at step {amended.step} where step {step} was expected"
    if walk.action_result is not None:
        return "an amendment between an action result and its step record"
    problem = unchained_change(walk.snapshot, amended.changes)
    if problem is not None:
        return problem
    walk.snapshot = amended_snapshot(walk.snapshot, amended.changes)
    walk.amendments.append(amended)
    return None


_CHANGE_SIDES = frozenset({"recorded", "amended"})


def unchained_change(
    snapshot: Mapping[str, JSONValue], changes: Mapping[str, JSONValue]
) -> str | None:
    """Why ``changes`` cannot be an amendment of ``snapshot``, if it cannot: each change
    must start from the value the snapshot holds (no ``recorded`` for a key it lacks)
    and change it."""
    if not changes:
        return "an amendment that changes nothing"
    for key in sorted(changes):
        change = changes[key]
        if not isinstance(change, dict) or not change or not set(change) <= _CHANGE_SIDES:
            return f"amendment of {key!r} is not an object of 'recorded' and 'amended'"
        if ("recorded" in change) != (key in snapshot) or (
            key in snapshot and not _same(change["recorded"], snapshot[key])
        ):
            return f"amendment of {key!r} does not start from the value the run held"
        both = "amended" in change and "recorded" in change
        if both and _same(change["recorded"], change["amended"]):
            return f"amendment of {key!r} does not change it"
    return None


def amended_snapshot(
    snapshot: Mapping[str, JSONValue], changes: Mapping[str, JSONValue]
) -> dict[str, JSONValue]:
    """``snapshot`` with ``changes`` (an amendment's, already checked) applied."""
    amended = dict(snapshot)
    for key, change in changes.items():
        assert isinstance(change, dict)
        if "amended" in change:
            amended[key] = change["amended"]
        else:
            amended.pop(key, None)
    return amended


def changes_between(
    recorded: Mapping[str, JSONValue], current: Mapping[str, JSONValue], keys: Iterable[str]
) -> dict[str, JSONValue]:
    """The ``changes`` of an amendment from ``recorded`` to ``current`` at ``keys``."""
    changes: dict[str, JSONValue] = {}
    for key in keys:
        change: dict[str, JSONValue] = {}
        if key in recorded:
            change["recorded"] = recorded[key]
        if key in current:
            change["amended"] = current[key]
        changes[key] = change
    return changes


def snapshot_at(plan: Plan, step: int) -> Mapping[str, JSONValue]:
    """The snapshot step ``step`` ran (or runs) under: the start record's, with the
    amendments written before that step applied. A fork's inherited step ran in its
    source, under the snapshot the source held where the fork was made."""
    assert plan.started is not None
    inherited = plan.started.inherited_snapshot
    if inherited is not None and step < len(plan.started.inherited_steps):
        return inherited
    snapshot: Mapping[str, JSONValue] = plan.started.snapshot
    for amended in plan.amendments:
        if amended.step <= step:
            snapshot = amended_snapshot(snapshot, amended.changes)
    return snapshot


def _accept_inherited(walk: _Walk, started: RunStarted) -> str | None:
    """Take a fork's inherited steps as its first steps, if they say what they claim."""
    inherited = started.inherited_steps
    if started.inherited_snapshot is not None and not inherited:
        return "a start record holding an inherited snapshot but no inherited steps"
    fork_fields = (started.forked_from, started.forked_at_step, started.inherited_sha256)
    if all(value is None for value in fork_fields) and not inherited:
        return None
    if any(value is None for value in fork_fields):
        return "a fork's start record must name its source, its step and its digest"
    if started.forked_at_step != len(inherited):
        return (
            f"a fork at step {started.forked_at_step} whose start record holds "
            f"{len(inherited)} inherited steps"
        )
    for index, step in enumerate(inherited):
        if step.step != index or step.run_id != walk.run_id:
            return f"inherited step {index} is step {step.step} of run {step.run_id!r}"
    walk.steps.extend(inherited)
    return None


def _after_end(ended: RunEnded, record: Record) -> str | None:
    """Why ``record`` may not follow the end record ``ended``, if it may not.

    An in-doubt end is reopened only by a settlement, a paused run only by a verdict:
    a person's answer is what lets either go on. A person's cancel ends either for good.
    """
    reason = ended.stop_reason
    if ended.is_final:
        return "a record after the end record"
    if isinstance(record, RunEnded) and record.stop_reason is StopReason.CANCELLED_BY_REQUEST:
        return None
    if reason is StopReason.IN_DOUBT and not isinstance(record, Settlement):
        return "a record after an in-doubt end that is not a settlement"
    if reason is StopReason.AWAITING_APPROVAL and not isinstance(record, Verdict):
        return "a record after an awaiting-approval end that is not a verdict"
    return None


def _accept_review(walk: _Walk, record: Proposal | Verdict | Settlement) -> str | None:
    if isinstance(record, Proposal):
        return _accept_proposal(walk, record)
    if isinstance(record, Verdict):
        return _accept_verdict(walk, record)
    return _accept_settlement(walk, record)


def _accept_proposal(walk: _Walk, proposal: Proposal) -> str | None:
    step = len(walk.steps)
    if proposal.step != step:
        return f"proposal for step {proposal.step} where step {step} was expected"
    if walk.model_result is None or walk.open_intent is not None:
        return "a proposal where no action could be announced"
    if walk.proposal is not None:
        return "a second proposal in one step"
    expected = action_result_id(walk.run_id, step)
    if proposal.result_id != expected:
        return f"proposal result id {proposal.result_id!r}, expected {expected!r}"
    walk.proposal = proposal
    return None


def _accept_verdict(walk: _Walk, verdict: Verdict) -> str | None:
    proposal = walk.proposal
    if proposal is None or proposal.result_id != verdict.result_id:
        return f"verdict on {verdict.result_id!r} with no such proposal waiting"
    if walk.verdict is not None:
        return f"a second verdict on {verdict.result_id!r}"
    walk.verdict = verdict
    return None


def _accept_settlement(walk: _Walk, settlement: Settlement) -> str | None:
    intent = walk.open_intent
    if intent is None or intent.result_id != settlement.result_id:
        return f"settlement of {settlement.result_id!r}, which is not the open intent"
    if intent.replay is not Replay.NEVER:
        return f"settlement of {settlement.result_id!r}, which is not an effect in doubt"
    if walk.settlement is not None:
        return f"a second settlement of {settlement.result_id!r}"
    walk.settlement = settlement
    return None


def _accept_intent(walk: _Walk, intent: Intent) -> str | None:
    step = len(walk.steps)
    if intent.step != step or intent.call_index != step:
        return f"intent for step {intent.step} where step {step} was expected"
    if walk.open_intent is not None and not _may_call_again(walk, intent):
        return f"intent {intent.result_id!r} while {walk.open_intent.result_id!r} is open"
    if walk.open_intent is not None:
        walk.model_calls_again += 1
    walk.settlement = None  # a settlement answers the intent before it, never this one
    if intent.kind is IntentKind.MODEL_CALL:
        if walk.model_result is not None:
            return "a second model call in one step"
        expected = model_result_id(walk.run_id, step, walk.model_calls_again)
    else:
        if walk.model_result is None:
            return "an action intent before the step's model result"
        if walk.proposal is not None and (walk.verdict is None or not walk.verdict.approved):
            return "an action intent for a proposal that was not approved"
        expected = action_result_id(walk.run_id, step)
    if intent.result_id != expected:
        return f"intent result id {intent.result_id!r}, expected {expected!r}"
    walk.open_intent = intent
    return None


def _may_call_again(walk: _Walk, intent: Intent) -> bool:
    """Whether ``intent`` announces the model call a person said may be made again: the
    open model call was settled as not run, so a new call (a new intent) replaces it."""
    settlement = walk.settlement
    return (
        settlement is not None
        and not settlement.ran
        and walk.open_intent is not None
        and walk.open_intent.kind is IntentKind.MODEL_CALL
        and intent.kind is IntentKind.MODEL_CALL
    )


def _accept_result(walk: _Walk, result: Result) -> str | None:
    intent = walk.open_intent
    if intent is None or intent.result_id != result.result_id or intent.kind is not result.kind:
        return f"result {result.result_id!r} has no open intent"
    if _may_call_again(walk, intent):
        return f"a result for model call {result.result_id!r}, which was settled as not run"
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
    if walk.proposal is not None and walk.verdict is None:
        return f"step record {step.step} while its proposal waits for a verdict"
    walk.steps.append(step)
    walk.last_action = walk.step_action
    walk.model_result = None
    walk.action_result = None
    walk.step_action = None
    walk.proposal = walk.verdict = walk.settlement = None
    walk.model_calls_again = 0
    return None


def _accept_end(walk: _Walk, end: RunEnded) -> str | None:
    if walk.action_result is not None:
        return "an end record between an action result and its step record"
    # A cancelled end may be written while a step write of unknown fate was in flight,
    # so only the counts of a final end are held to the log.
    if end.is_final and end.steps != len(walk.steps):
        return f"end record counts {end.steps} steps, the log holds {len(walk.steps)}"
    if end.stop_reason is StopReason.IN_DOUBT and not _in_doubt(walk.open_intent, walk.settlement):
        return "an in-doubt end with no effect in doubt"
    if end.stop_reason is StopReason.AWAITING_APPROVAL and (
        walk.proposal is None or walk.verdict is not None
    ):
        return "an awaiting-approval end with no proposal waiting"
    walk.ended = end
    return None


def settled(plan: Plan, settlement: Settlement) -> Plan:
    """``plan`` once ``settlement``, just written, closes its action in doubt."""
    return dataclasses.replace(
        plan, state=RecoveryState.RESUMABLE, settlement=settlement, ended=None
    )


def settled_model_call(plan: Plan) -> Settlement | None:
    """The settlement of the interrupted step's model call in doubt, if a person wrote one.

    ``ran=False``: the call may be made again, as a new call; ``ran=True``: it ran, but
    its reply is not on record, so the run can neither go on from it nor call again.
    """
    intent, settlement = plan.open_intent, plan.settlement
    if intent is None or settlement is None or intent.kind is not IntentKind.MODEL_CALL:
        return None
    return settlement


def model_call_again_id(plan: Plan) -> str:
    """The result id of the model call made again after ``plan``'s was settled as not run."""
    assert plan.started is not None
    return model_result_id(plan.started.run_id, len(plan.steps), plan.model_calls_again + 1)


def unrecorded_reply_error(settlement: Settlement) -> str:
    """The model failure a run ends with when a person settled its model call as run:
    the reply is lost, and calling again could cost twice."""
    said = f": {settlement.observation}" if settlement.observation.strip() else ""
    return (
        f"model call {settlement.result_id!r} ran but its reply is not on record; "
        f"settled by {settlement.by!r}{said}"
    )


class Move(enum.Enum):
    """What resuming a run does first, once any probe has answered (see :func:`next_move`)."""

    END_IN_DOUBT = "end_in_doubt"  # an effect may or may not have happened: a person must say
    WAIT_FOR_APPROVAL = "wait_for_approval"  # a proposal still waits for its verdict
    CALL_MODEL = "call_model"  # the model call's result was lost: call again under its intent
    CALL_MODEL_AGAIN = "call_model_again"  # settled as not run: a new call, a new intent
    LOSE_REPLY = "lose_reply"  # settled as run: its reply is lost, the step fails
    RECORD_MODEL_FAILURE = "record_model_failure"  # the model call failed before the crash
    INTERPRET = "interpret"  # the reply landed and nothing was announced: interpret it again
    RUN_APPROVED = "run_approved"  # a person approved the proposal: announce and run it
    RUN_EDITED = "run_edited"  # approved with other arguments: run the call as edited
    RECORD_REJECTED = "record_rejected"  # rejected: the step records it as not executed
    CLOSE_SETTLED = "close_settled"  # a settlement says how the action in doubt ended
    RUN_ACTION = "run_action"  # the announced action may be replayed: run it, same result id
    CHECK_STOP = "check_stop"  # the last step landed, the run may not have ended: decide
    NEXT_STEP = "next_step"  # nothing was interrupted: take the next step


def next_move(plan: Plan) -> Move:
    """What a crash, a verdict or a settlement leaves to do in a started, unfinished run.

    The order is the order of the checks: a step in doubt or waiting first, then the
    interrupted step by how far it got (its model call, its reply, its action), then
    the run's own last step. Raises ``ValueError`` for a fresh or finished plan.
    """
    if plan.started is None or plan.state is RecoveryState.FINISHED:
        raise ValueError("only a started, unfinished run has a next move")
    if plan.state is RecoveryState.IN_DOUBT:
        return Move.END_IN_DOUBT
    if plan.state is RecoveryState.AWAITING_APPROVAL:
        return Move.WAIT_FOR_APPROVAL
    if plan.model_result is not None or plan.open_intent is not None:
        return _interrupted_move(plan)
    if len(plan.steps) > len(plan.started.inherited_steps):
        # A fork's inherited steps are never decided again: it goes on after them.
        return Move.CHECK_STOP
    return Move.NEXT_STEP


def _interrupted_move(plan: Plan) -> Move:
    intent, verdict = plan.open_intent, plan.verdict
    if (settlement := settled_model_call(plan)) is not None:
        return Move.LOSE_REPLY if settlement.ran else Move.CALL_MODEL_AGAIN
    if plan.model_result is None:
        return Move.CALL_MODEL
    if model_call_error(plan.model_result) is not None:
        return Move.RECORD_MODEL_FAILURE
    if intent is None and verdict is not None:
        if not verdict.approved:
            return Move.RECORD_REJECTED
        assert plan.proposal is not None  # a verdict answers a proposal
        return Move.RUN_EDITED if verdict.payload != plan.proposal.payload else Move.RUN_APPROVED
    if intent is None:
        return Move.INTERPRET
    return Move.CLOSE_SETTLED if plan.settlement is not None else Move.RUN_ACTION


def model_call_error(result: Result) -> str | None:
    """What a model result says went wrong with its call, if the call failed."""
    payload = result.payload
    if isinstance(payload, dict) and "error" in payload:
        return str(payload["error"])
    return None


def reconciled_steps(plan: Plan) -> tuple[int, ...]:
    """The steps whose action in doubt a tool's probe settled, in order."""
    steps = [step.step for step in plan.steps if _by_probe(step.settled_by)]
    if plan.settlement is not None and plan.settlement.by_probe:
        steps.append(len(plan.steps))
    return tuple(steps)


def _by_probe(by: str | None) -> bool:
    return by is not None and by.startswith(RECONCILE_PREFIX)


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
    effect in flight, not one in doubt. A run whose log ends ``IN_DOUBT`` or
    ``AWAITING_APPROVAL`` says so even while claimed (someone reads or answers it).
    """
    if plan.started is None:
        raise ValueError("the plan has no start record")
    ended = plan.ended
    state = _run_state(plan, stored is not None and stored.claimed)
    why = None if state is RunState.RUNNING else ready(plan, probe=probe_recorded(plan))
    if stored is not None and stored.cancel_requested and state is not RunState.FINISHED:
        why = Ready.CANCEL_REQUESTED  # whatever it waited for, its next writer ends it
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
        proposal=plan.proposal if state is RunState.AWAITING_APPROVAL else None,
        reconciled_steps=reconciled_steps(plan),
        ready=why,
        agent=plan.started.agent,
        started_at=plan.started.at,
        ended_at=ended.at if ended is not None else None,
    )


def ready(plan: Plan, *, probe: bool) -> Ready | None:
    """Why the run ``plan`` describes goes on as soon as anything drives it, with no
    person's answer first; ``None`` if it finished or waits for a person.

    ``probe`` says whether its tool's probe can settle its action in doubt. A run whose
    wait is not on record yet (a process stopped right after the proposal, or inside a
    tool with no probe) waits for a person too: driving it only records the wait.
    """
    if plan.started is None or plan.state is RecoveryState.FINISHED:
        return None
    if plan.state is RecoveryState.IN_DOUBT:
        return Ready.PROBE if probe else None
    if plan.state is RecoveryState.AWAITING_APPROVAL:
        return None
    if plan.ended is not None:
        return Ready.INTERRUPTED  # a cancelled end: the one end that is neither final nor a wait
    if plan.verdict is not None and plan.open_intent is None:
        return Ready.APPROVED if plan.verdict.approved else Ready.REJECTED
    if plan.settlement is not None:
        return Ready.SETTLED
    untouched = plan.open_intent is None and plan.model_result is None
    if untouched and len(plan.steps) == len(plan.started.inherited_steps):
        return Ready.NEW
    return Ready.INTERRUPTED


def probe_recorded(plan: Plan) -> bool:
    """Whether the log says the tool's probe can settle ``plan``'s action in doubt: its
    intent says so, and no attempt since ended in doubt (as one does when the probe
    could not tell, or was not there any more)."""
    intent = plan.open_intent
    return intent is not None and intent.reconciles is True and not waits_for_person(plan)


_STATES = {
    RecoveryState.FINISHED: RunState.FINISHED,
    RecoveryState.IN_DOUBT: RunState.IN_DOUBT,
    RecoveryState.AWAITING_APPROVAL: RunState.AWAITING_APPROVAL,
    RecoveryState.RESUMABLE: RunState.RESUMABLE,
}


def _run_state(plan: Plan, claimed: bool) -> RunState:
    stopped = plan.ended is not None and plan.ended.stop_reason is not StopReason.CANCELLED
    if claimed and not stopped:
        return RunState.RUNNING
    return _STATES[plan.state]


def waits_for_person(plan: Plan) -> bool:
    """Whether the log ends with an in-doubt or awaiting-approval end that no person has
    answered yet: resuming it then has nothing to do and nothing to write."""
    ended = plan.ended
    return ended is not None and ended.stop_reason in (
        StopReason.IN_DOUBT,
        StopReason.AWAITING_APPROVAL,
    )


def awaiting_detail(proposal: Proposal) -> str:
    """What an ``AWAITING_APPROVAL`` end says: the tool and the result id it waits on."""
    payload = proposal.payload
    name = payload.get("name") if isinstance(payload, dict) else None
    return (
        f"action {proposal.result_id!r} (tool {name!r}) waits for a person to approve or reject it"
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
