"""Tests for which listed runs a host drives, and why (``session._picking.choose``).

Pure synchronous code, tested as a table as test_next_move is: each row is what a
store lists of a run and what its log reads as, and the host's choice.
"""

from __future__ import annotations

from typing import Any

import pytest

from kit import record
from polyloop._recovery import Plan, RecoveryState
from polyloop.ports import StoredRun
from polyloop.session._picking import Choice, choose
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
HOSTED = frozenset({"payer"})
CALL: JSONValue = {"name": "pay", "arguments": {"amount": 1}}


def _stored(*, claimed: bool = False, finished: bool = False) -> StoredRun:
    return StoredRun(run_id=RUN, finished=finished, claimed=claimed, updated_at=None)


def _started(agent: str | None = "payer", inherited: int = 0) -> RunStarted:
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
        inherited=tuple(_step(i) for i in range(inherited)),
    )


def _step(index: int) -> StepRecord:
    return record.step(RUN, index)


def _end(reason: StopReason) -> RunEnded:
    return RunEnded(
        run_id=RUN, stop_reason=reason, final_answer=None, steps=0, valid_steps=0, detail=None
    )


ACTION = record.intent(RUN, 0, IntentKind.ACTION, CALL)
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


def _verdict(approved: bool) -> Verdict:
    return Verdict(
        run_id=RUN,
        result_id=PROPOSAL.result_id,
        approved=approved,
        by="ann",
        payload=CALL,
        reason=None if approved else "no",
    )


def _plan(state: RecoveryState = RecoveryState.RESUMABLE, **fields: Any) -> Plan:
    fields.setdefault("started", _started())
    return Plan(state=state, **fields)


WAITING_FOR_APPROVAL = _plan(
    RecoveryState.AWAITING_APPROVAL,
    model_result=REPLY,
    proposal=PROPOSAL,
    ended=_end(StopReason.AWAITING_APPROVAL),
)
IN_DOUBT_ENDED = _plan(
    RecoveryState.IN_DOUBT, model_result=REPLY, open_intent=ACTION, ended=_end(StopReason.IN_DOUBT)
)
IN_DOUBT_CRASHED = _plan(RecoveryState.IN_DOUBT, model_result=REPLY, open_intent=ACTION)

ROWS = [
    # (stored, plan, has_probe, driven_here, choice)
    pytest.param(_stored(), _plan(), False, False, Choice.NEW, id="started-never-driven"),
    pytest.param(
        _stored(),
        _plan(started=_started(inherited=2), steps=(_step(0), _step(1))),
        False,
        False,
        Choice.NEW,
        id="fork-started-never-driven",
    ),
    pytest.param(
        _stored(),
        _plan(model_result=REPLY, proposal=PROPOSAL, verdict=_verdict(True)),
        False,
        False,
        Choice.APPROVED,
        id="approved",
    ),
    pytest.param(
        _stored(),
        _plan(model_result=REPLY, proposal=PROPOSAL, verdict=_verdict(False)),
        False,
        False,
        Choice.REJECTED,
        id="rejected",
    ),
    pytest.param(
        _stored(),
        _plan(model_result=REPLY, open_intent=ACTION, settlement=SETTLED),
        False,
        False,
        Choice.SETTLED,
        id="settled",
    ),
    pytest.param(_stored(), IN_DOUBT_ENDED, True, False, Choice.PROBE, id="doubt-with-a-probe"),
    pytest.param(
        _stored(), IN_DOUBT_CRASHED, True, False, Choice.PROBE, id="crashed-doubt-with-a-probe"
    ),
    pytest.param(
        _stored(),
        _plan(steps=(_step(0),), ended=_end(StopReason.CANCELLED)),
        False,
        False,
        Choice.CANCELLED,
        id="cancelled",
    ),
    pytest.param(
        _stored(), _plan(steps=(_step(0),)), False, False, Choice.LEFT, id="left-after-a-step"
    ),
    pytest.param(
        _stored(), _plan(open_intent=MODEL), False, False, Choice.LEFT, id="left-in-a-model-call"
    ),
    pytest.param(
        _stored(),
        _plan(model_result=REPLY, proposal=PROPOSAL, verdict=_verdict(True), open_intent=ACTION),
        False,
        False,
        Choice.LEFT,
        id="left-in-an-approved-action",
    ),
    pytest.param(
        _stored(),
        IN_DOUBT_CRASHED,
        False,
        False,
        Choice.LEFT,
        id="left-in-doubt-without-its-end-record",
    ),
    pytest.param(
        _stored(),
        _plan(
            RecoveryState.IN_DOUBT,
            model_result=REPLY,
            open_intent=ACTION,
            ended=_end(StopReason.CANCELLED),
        ),
        False,
        False,
        Choice.LEFT,
        id="cancelled-in-doubt-records-the-doubt",
    ),
    pytest.param(
        _stored(),
        _plan(RecoveryState.AWAITING_APPROVAL, model_result=REPLY, proposal=PROPOSAL),
        False,
        False,
        Choice.LEFT,
        id="proposal-without-its-end-record",
    ),
    pytest.param(
        _stored(), WAITING_FOR_APPROVAL, False, False, Choice.AWAITS_APPROVAL, id="awaits-approval"
    ),
    pytest.param(
        _stored(), IN_DOUBT_ENDED, False, False, Choice.AWAITS_SETTLEMENT, id="awaits-settlement"
    ),
    pytest.param(_stored(), _plan(), False, True, Choice.DRIVEN_HERE, id="driven-here"),
    pytest.param(_stored(claimed=True), _plan(), False, False, Choice.CLAIMED, id="claimed"),
    pytest.param(
        _stored(claimed=True), IN_DOUBT_ENDED, True, False, Choice.CLAIMED, id="claimed-in-doubt"
    ),
    pytest.param(
        _stored(finished=True), _plan(), False, False, Choice.FINISHED, id="listed-finished"
    ),
    pytest.param(
        _stored(),
        _plan(RecoveryState.FINISHED, ended=_end(StopReason.FINAL_ANSWER)),
        False,
        False,
        Choice.FINISHED,
        id="log-finished",
    ),
    pytest.param(
        _stored(), Plan(state=RecoveryState.FRESH), False, False, Choice.NOT_STARTED, id="fresh"
    ),
    pytest.param(
        _stored(), _plan(started=_started(None)), False, False, Choice.NO_AGENT, id="plain-run"
    ),
    pytest.param(
        _stored(), _plan(started=_started("other")), False, False, Choice.NOT_HOSTED, id="foreign"
    ),
    pytest.param(
        _stored(),
        _plan(
            RecoveryState.IN_DOUBT,
            started=_started("other"),
            open_intent=ACTION,
            model_result=REPLY,
        ),
        True,
        False,
        Choice.NOT_HOSTED,
        id="foreign-in-doubt",
    ),
]


@pytest.mark.parametrize(("stored", "plan", "has_probe", "driven_here", "expected"), ROWS)
def test_choice(
    stored: StoredRun, plan: Plan, has_probe: bool, driven_here: bool, expected: Choice
) -> None:
    choice = choose(stored, plan, hosted=HOSTED, has_probe=has_probe, driven_here=driven_here)
    assert choice is expected


def test_only_runs_that_can_go_on_are_driven() -> None:
    drives = {choice for choice in Choice if choice.drives}
    assert drives == {
        Choice.NEW,
        Choice.APPROVED,
        Choice.REJECTED,
        Choice.SETTLED,
        Choice.PROBE,
        Choice.CANCELLED,
        Choice.LEFT,
        Choice.CANCEL_REQUESTED,
    }
    waits = {choice for choice in Choice if choice.waits_for_person}
    assert waits == {Choice.AWAITS_APPROVAL, Choice.AWAITS_SETTLEMENT}
    assert not drives & waits
    assert all(choice.text for choice in Choice)


# issue 44, part 3: a run someone asked to cancel is driven to its end at once, even one
# that waits for a person; one that finished, one a live writer holds and one of an agent
# hosted elsewhere are not.
CANCEL_ROWS = [
    pytest.param({}, WAITING_FOR_APPROVAL, Choice.CANCEL_REQUESTED, id="waiting-for-approval"),
    pytest.param({}, IN_DOUBT_ENDED, Choice.CANCEL_REQUESTED, id="in-doubt"),
    pytest.param({}, _plan(), Choice.CANCEL_REQUESTED, id="never-driven"),
    pytest.param({"claimed": True}, _plan(), Choice.CLAIMED, id="claimed"),
    pytest.param(
        {"finished": True},
        _plan(RecoveryState.FINISHED, ended=_end(StopReason.CANCELLED_BY_REQUEST)),
        Choice.FINISHED,
        id="ended-by-the-request",
    ),
    pytest.param({}, _plan(started=_started("other")), Choice.NOT_HOSTED, id="foreign"),
]


@pytest.mark.parametrize(("listed", "plan", "expected"), CANCEL_ROWS)
def test_a_run_with_a_cancel_request(listed: dict[str, bool], plan: Plan, expected: Choice) -> None:
    stored = StoredRun(run_id=RUN, updated_at=None, cancel_requested=True, **_listed(listed))
    assert choose(stored, plan, hosted=HOSTED, has_probe=True) is expected


def _listed(listed: dict[str, bool]) -> dict[str, bool]:
    return {"claimed": False, "finished": False, **listed}
