"""Tests for polyloop._recovery.next_move: what a resumed run does first.

Pure synchronous code, tested as a table the way test_stopping tests the stop order:
each row is a plan as read_plan leaves it, and the move it must lead to.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit import record
from kit.plans import CALL, PROPOSAL
from polyloop._recovery import Move, Plan, RecoveryState, next_move
from polyloop.types import (
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Replay,
    Result,
    RunStarted,
    Settlement,
    StepRecord,
    Verdict,
)

RUN = "r"


def _step(index: int) -> StepRecord:
    """An invalid step: a model output that was no decision, and no action."""
    return record.step(
        RUN,
        index,
        model_output="",
        decision=DecisionKind.INVALID,
        history_text="",
        action_text=None,
        observation=None,
        action_status=None,
    )


def _started(inherited: int = 0) -> RunStarted:
    if not inherited:
        return RunStarted(run_id=RUN, snapshot={})
    steps = tuple(_step(i) for i in range(inherited))
    return RunStarted(
        run_id=RUN,
        snapshot={},
        forked_from="source",
        forked_at_step=inherited,
        inherited_sha256="0" * 64,
        inherited=steps,
    )


def _intent(kind: IntentKind, replay: Replay) -> Intent:
    return Intent(
        run_id=RUN,
        result_id=f"{RUN}:0:{kind.value}",
        kind=kind,
        step=0,
        call_index=0,
        replay=replay,
        payload=CALL if kind is IntentKind.ACTION else {"messages_sha256": "0"},
    )


def _reply(error: bool = False) -> Result:
    payload: Any = {"error": "ConnectionError: gone"} if error else {"content": "{}"}
    return Result(
        run_id=RUN, result_id=f"{RUN}:0:model", kind=IntentKind.MODEL_CALL, payload=payload
    )


def _verdict(approved: bool, payload: Any = CALL) -> Verdict:
    reason = None if approved else "too much"
    return Verdict(
        run_id=RUN,
        result_id=PROPOSAL.result_id,
        approved=approved,
        by="ann",
        payload=payload,
        reason=reason,
    )


def _settlement(ran: bool, kind: IntentKind = IntentKind.ACTION) -> Settlement:
    return Settlement(
        run_id=RUN, result_id=f"{RUN}:0:{kind.value}", ran=ran, observation="", by="ann"
    )


MODEL_NEVER = _intent(IntentKind.MODEL_CALL, Replay.NEVER)
MODEL_ALLOWED = _intent(IntentKind.MODEL_CALL, Replay.ALLOWED)
ACTION_NEVER = _intent(IntentKind.ACTION, Replay.NEVER)
ACTION_ALLOWED = _intent(IntentKind.ACTION, Replay.ALLOWED)
EDITED: JSONValue = {"name": "pay", "arguments": {"amount": 2}}


def _plan(state: RecoveryState = RecoveryState.RESUMABLE, **fields: Any) -> Plan:
    fields.setdefault("started", _started())
    return Plan(state=state, **fields)


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        pytest.param(_plan(), Move.NEXT_STEP, id="nothing-done-yet"),
        pytest.param(_plan(steps=(_step(0),)), Move.CHECK_STOP, id="last-step-landed"),
        pytest.param(
            _plan(started=_started(1), steps=(_step(0),)),
            Move.NEXT_STEP,
            id="fork-goes-on-after-inherited-steps",
        ),
        pytest.param(
            _plan(started=_started(1), steps=(_step(0), _step(1))),
            Move.CHECK_STOP,
            id="fork-with-a-step-of-its-own",
        ),
        pytest.param(
            _plan(RecoveryState.IN_DOUBT, open_intent=ACTION_NEVER, model_result=_reply()),
            Move.END_IN_DOUBT,
            id="action-in-doubt",
        ),
        pytest.param(
            _plan(RecoveryState.IN_DOUBT, open_intent=MODEL_NEVER),
            Move.END_IN_DOUBT,
            id="model-call-in-doubt",
        ),
        pytest.param(
            _plan(RecoveryState.AWAITING_APPROVAL, model_result=_reply(), proposal=PROPOSAL),
            Move.WAIT_FOR_APPROVAL,
            id="proposal-waits",
        ),
        pytest.param(
            _plan(open_intent=MODEL_ALLOWED), Move.CALL_MODEL, id="model-result-lost-replayable"
        ),
        pytest.param(
            _plan(
                open_intent=MODEL_NEVER,
                settlement=_settlement(ran=False, kind=IntentKind.MODEL_CALL),
            ),
            Move.CALL_MODEL_AGAIN,
            id="model-call-settled-not-run",
        ),
        pytest.param(
            _plan(
                open_intent=MODEL_NEVER,
                settlement=_settlement(ran=True, kind=IntentKind.MODEL_CALL),
            ),
            Move.LOSE_REPLY,
            id="model-call-settled-run",
        ),
        pytest.param(
            _plan(model_result=_reply(error=True)),
            Move.RECORD_MODEL_FAILURE,
            id="model-call-failed-before-crash",
        ),
        pytest.param(_plan(model_result=_reply()), Move.INTERPRET, id="reply-landed"),
        pytest.param(
            _plan(model_result=_reply(), proposal=PROPOSAL, verdict=_verdict(True)),
            Move.RUN_APPROVED,
            id="approved",
        ),
        pytest.param(
            _plan(model_result=_reply(), proposal=PROPOSAL, verdict=_verdict(True, EDITED)),
            Move.RUN_EDITED,
            id="approved-with-other-arguments",
        ),
        pytest.param(
            _plan(model_result=_reply(), proposal=PROPOSAL, verdict=_verdict(False)),
            Move.RECORD_REJECTED,
            id="rejected",
        ),
        pytest.param(
            _plan(open_intent=ACTION_ALLOWED, model_result=_reply()),
            Move.RUN_ACTION,
            id="action-replayable",
        ),
        pytest.param(
            _plan(
                open_intent=ACTION_ALLOWED,
                model_result=_reply(),
                proposal=PROPOSAL,
                verdict=_verdict(True),
            ),
            Move.RUN_ACTION,
            id="approved-action-announced-then-crash",
        ),
        pytest.param(
            _plan(open_intent=ACTION_NEVER, model_result=_reply(), settlement=_settlement(True)),
            Move.CLOSE_SETTLED,
            id="action-settled-ran",
        ),
        pytest.param(
            _plan(open_intent=ACTION_NEVER, model_result=_reply(), settlement=_settlement(False)),
            Move.CLOSE_SETTLED,
            id="action-settled-not-run",
        ),
        pytest.param(
            _plan(
                open_intent=MODEL_NEVER,
                model_result=_reply(error=True),
                settlement=_settlement(ran=False, kind=IntentKind.MODEL_CALL),
            ),
            Move.CALL_MODEL_AGAIN,
            id="order-model-settlement-before-landed-result",
        ),
    ],
)
def test_next_move(plan: Plan, expected: Move) -> None:
    assert next_move(plan) is expected


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(Plan(state=RecoveryState.FRESH), id="fresh"),
        pytest.param(_plan(RecoveryState.FINISHED), id="finished"),
    ],
)
def test_a_fresh_or_finished_plan_has_no_next_move(plan: Plan) -> None:
    with pytest.raises(ValueError, match="only a started, unfinished run"):
        next_move(plan)


# -- properties over every combination of what an interrupted step left ---------------

_REDO = {Move.CALL_MODEL: IntentKind.MODEL_CALL, Move.RUN_ACTION: IntentKind.ACTION}


_UNFINISHED = [RecoveryState.RESUMABLE, RecoveryState.IN_DOUBT, RecoveryState.AWAITING_APPROVAL]


@st.composite
def _plans(draw: st.DrawFn) -> Plan:
    """Plans as read_plan can leave them: an open intent of the step's own stage, a
    verdict only on a proposal, a settlement only of an open intent in doubt."""
    inherited = draw(st.integers(0, 2))
    steps = tuple(_step(i) for i in range(inherited + draw(st.integers(0, 2))))
    reply = draw(st.sampled_from([None, _reply(), _reply(error=True)]))
    intents = [MODEL_NEVER, MODEL_ALLOWED] if reply is None else [ACTION_NEVER, ACTION_ALLOWED]
    intent = draw(st.sampled_from([None, *intents]))
    settled = intent if intent is not None and intent.replay is Replay.NEVER else None
    if not draw(st.booleans()):
        settled = None
    proposal = PROPOSAL if reply is not None and draw(st.booleans()) else None
    verdicts = [None, _verdict(True), _verdict(True, EDITED), _verdict(False)]
    return _plan(
        draw(st.sampled_from(_UNFINISHED)),
        started=_started(inherited),
        steps=steps,
        open_intent=intent,
        model_result=reply,
        proposal=proposal,
        verdict=draw(st.sampled_from(verdicts)) if proposal is not None else None,
        settlement=None if settled is None else _settlement(draw(st.booleans()), settled.kind),
    )


@given(_plans())
def test_a_waiting_state_is_decided_before_the_interrupted_step(plan: Plan) -> None:
    move = next_move(plan)
    assert (move is Move.END_IN_DOUBT) == (plan.state is RecoveryState.IN_DOUBT)
    assert (move is Move.WAIT_FOR_APPROVAL) == (plan.state is RecoveryState.AWAITING_APPROVAL)


@given(_plans())
def test_only_an_open_unsettled_intent_is_run_again(plan: Plan) -> None:
    move = next_move(plan)
    if move in _REDO:
        intent = plan.open_intent
        assert intent is not None and intent.kind is _REDO[move]
        assert plan.settlement is None


@given(_plans())
def test_a_run_between_steps_only_checks_its_stop_or_goes_on(plan: Plan) -> None:
    move = next_move(plan)
    between = plan.model_result is None and plan.open_intent is None
    if plan.state is RecoveryState.RESUMABLE and between:
        assert plan.started is not None
        fresh = len(plan.steps) == len(plan.started.inherited_steps)
        assert move is (Move.NEXT_STEP if fresh else Move.CHECK_STOP)
