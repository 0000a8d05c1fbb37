"""Recovery plans built by hand, for the table tests of what a log's reading decides
(``_recovery.ready``, ``session._picking.choose``): run ``r`` of agent ``payer``, one
``pay`` call at step 0, in each of the shapes a log can leave it."""

from __future__ import annotations

import dataclasses
from typing import Any

from kit import record
from polyloop._recovery import Plan, RecoveryState
from polyloop.ports import StoredRun
from polyloop.types import (
    IntentKind,
    JSONValue,
    Proposal,
    Replay,
    RunEnded,
    RunStarted,
    Settlement,
    StepRecord,
    StopReason,
    Verdict,
)

RUN = "r"
CALL: JSONValue = {"name": "pay", "arguments": {"amount": 1}}


def stored(*, claimed: bool = False, finished: bool = False) -> StoredRun:
    """What a store lists of the run."""
    return StoredRun(run_id=RUN, finished=finished, claimed=claimed, updated_at=None)


def started(agent: str | None = "payer", inherited: int = 0) -> RunStarted:
    """The start record, of a fork that took over ``inherited`` steps if that is not 0."""
    if not inherited:
        return RunStarted(run_id=RUN, snapshot={}, agent=agent, input={} if agent else None)
    return RunStarted(
        run_id=RUN,
        snapshot={},
        agent=agent,
        input={},
        forked_from="source",
        forked_at_step=inherited,
        inherited_sha256="0" * 64,
        inherited=tuple(step(i) for i in range(inherited)),
    )


def step(index: int) -> StepRecord:
    return record.step(RUN, index)


def end(reason: StopReason) -> RunEnded:
    return RunEnded(
        run_id=RUN, stop_reason=reason, final_answer=None, steps=0, valid_steps=0, detail=None
    )


ACTION = record.intent(RUN, 0, IntentKind.ACTION, CALL)
# The same action, announced by an executor that said its probe could settle it.
PROBED_ACTION = dataclasses.replace(ACTION, reconciles=True)
MODEL = record.intent(
    RUN, 0, IntentKind.MODEL_CALL, {"messages_sha256": "0"}, replay=Replay.ALLOWED
)
REPLY = record.result(RUN, 0, IntentKind.MODEL_CALL, {"content": ""})
PROPOSAL = Proposal(
    run_id=RUN,
    result_id=f"{RUN}:0:action",
    step=0,
    replay=Replay.NEVER,
    payload=CALL,
    action_text="pay(amount=1)",
    history_text="",
    description="",
)
SETTLED = Settlement(run_id=RUN, result_id=ACTION.result_id, ran=True, observation="", by="ann")


def verdict(approved: bool) -> Verdict:
    return Verdict(
        run_id=RUN,
        result_id=PROPOSAL.result_id,
        approved=approved,
        by="ann",
        payload=CALL,
        reason=None if approved else "no",
    )


def plan(state: RecoveryState = RecoveryState.RESUMABLE, **fields: Any) -> Plan:
    """A started run's plan (of agent ``payer`` unless ``started`` says otherwise)."""
    fields.setdefault("started", started())
    return Plan(state=state, **fields)


WAITING_FOR_APPROVAL = plan(
    RecoveryState.AWAITING_APPROVAL,
    model_result=REPLY,
    proposal=PROPOSAL,
    ended=end(StopReason.AWAITING_APPROVAL),
)
IN_DOUBT_ENDED = plan(
    RecoveryState.IN_DOUBT, model_result=REPLY, open_intent=ACTION, ended=end(StopReason.IN_DOUBT)
)
IN_DOUBT_CRASHED = plan(RecoveryState.IN_DOUBT, model_result=REPLY, open_intent=ACTION)
