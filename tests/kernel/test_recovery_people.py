"""The log grammar around a person's answers (issue 19): proposals, verdicts and
settlements, and the in-doubt and awaiting-approval ends they reopen. Pure: plain
records in, a plan or ``CorruptLog`` out, for every sequence."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit import record as record_kit
from polyloop._recovery import (
    RecoveryState,
    model_call_again_id,
    model_result_id,
    read_plan,
    settled_model_call,
    status,
    unrecorded_reply_error,
)
from polyloop.ports import StoredRun
from polyloop.types import (
    CorruptLog,
    IntentKind,
    Proposal,
    Record,
    Replay,
    RunEnded,
    RunLog,
    RunStarted,
    RunState,
    Settlement,
    StopReason,
    Verdict,
)

RUN = "r"
ACTION = f"{RUN}:0:action"
PAYLOAD = {"name": "deploy", "arguments": {"env": "prod"}}

START = RunStarted(run_id=RUN, snapshot={})
MODEL_INTENT = record_kit.intent(RUN, 0, IntentKind.MODEL_CALL, {}, replay=Replay.ALLOWED)
MODEL_RESULT = record_kit.result(RUN, 0, IntentKind.MODEL_CALL, {"content": "x"})
PROPOSAL = Proposal(
    run_id=RUN,
    result_id=ACTION,
    step=0,
    replay=Replay.NEVER,
    payload=PAYLOAD,
    action_text="deploy(prod)",
    history_text="x",
    description="Deploy.",
)
APPROVED = Verdict(
    run_id=RUN, result_id=ACTION, approved=True, by="alice", payload=PAYLOAD, reason=None
)
REJECTED = Verdict(
    run_id=RUN, result_id=ACTION, approved=False, by="bob", payload=None, reason="no"
)
ACTION_INTENT = record_kit.intent(RUN, 0, IntentKind.ACTION, PAYLOAD)
SETTLED = Settlement(run_id=RUN, result_id=ACTION, ran=True, observation="ok", by="carol")
ACTION_RESULT = record_kit.result(RUN, 0, IntentKind.ACTION, {"status": "executed"})
STEP = record_kit.step(RUN, 0, action_text="deploy(prod)", observation="ok")


def end(reason: StopReason, steps: int = 0) -> RunEnded:
    return RunEnded(
        run_id=RUN, stop_reason=reason, final_answer=None, steps=steps, valid_steps=0, detail=None
    )


AWAITING = end(StopReason.AWAITING_APPROVAL)
IN_DOUBT = end(StopReason.IN_DOUBT)
CANCELLED = end(StopReason.CANCELLED)
BEFORE_ACTION = [START, MODEL_INTENT, MODEL_RESULT]


def plan_of(records: list[Record]) -> Any:
    return read_plan(RunLog(run_id=RUN, records=tuple(records)))


@pytest.mark.parametrize(
    ("records", "state"),
    [
        pytest.param([*BEFORE_ACTION, PROPOSAL], RecoveryState.AWAITING_APPROVAL, id="proposed"),
        pytest.param([*BEFORE_ACTION, PROPOSAL, AWAITING], RecoveryState.AWAITING_APPROVAL),
        pytest.param([*BEFORE_ACTION, PROPOSAL, CANCELLED], RecoveryState.AWAITING_APPROVAL),
        pytest.param([*BEFORE_ACTION, PROPOSAL, AWAITING, APPROVED], RecoveryState.RESUMABLE),
        pytest.param([*BEFORE_ACTION, PROPOSAL, APPROVED], RecoveryState.RESUMABLE),
        pytest.param([*BEFORE_ACTION, PROPOSAL, AWAITING, REJECTED], RecoveryState.RESUMABLE),
        pytest.param([*BEFORE_ACTION, PROPOSAL, APPROVED, ACTION_INTENT], RecoveryState.IN_DOUBT),
        pytest.param(
            [*BEFORE_ACTION, PROPOSAL, APPROVED, ACTION_INTENT, ACTION_RESULT, STEP],
            RecoveryState.RESUMABLE,
        ),
        pytest.param([*BEFORE_ACTION, PROPOSAL, REJECTED, STEP], RecoveryState.RESUMABLE),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT], RecoveryState.IN_DOUBT),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, SETTLED], RecoveryState.RESUMABLE),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, SETTLED], RecoveryState.RESUMABLE),
        pytest.param(
            [*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, SETTLED, CANCELLED],
            RecoveryState.RESUMABLE,
        ),
        pytest.param(
            [*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, SETTLED, ACTION_RESULT, STEP],
            RecoveryState.RESUMABLE,
        ),
        pytest.param(
            [
                *BEFORE_ACTION,
                ACTION_INTENT,
                IN_DOUBT,
                SETTLED,
                ACTION_RESULT,
                STEP,
                end(StopReason.FINAL_ANSWER, 1),
            ],
            RecoveryState.FINISHED,
        ),
    ],
)
def test_valid_logs_with_a_person_in_them(records: list[Record], state: RecoveryState) -> None:
    assert plan_of(records).state is state


def test_the_plan_names_the_proposal_verdict_and_settlement() -> None:
    plan = plan_of([*BEFORE_ACTION, PROPOSAL, AWAITING, APPROVED])
    assert (plan.proposal, plan.verdict, plan.ended) == (PROPOSAL, APPROVED, None)
    plan = plan_of([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, SETTLED])
    assert (plan.open_intent, plan.settlement) == (ACTION_INTENT, SETTLED)
    plan = plan_of([*BEFORE_ACTION, PROPOSAL, REJECTED, STEP])
    assert (plan.proposal, plan.verdict, plan.settlement) == (None, None, None)


def test_status_of_a_paused_run_shows_its_proposal_even_while_claimed() -> None:
    plan = plan_of([*BEFORE_ACTION, PROPOSAL, AWAITING])
    stored = StoredRun(run_id=RUN, finished=False, claimed=True, updated_at=None)
    shown = status(plan, stored)
    assert shown.state is RunState.AWAITING_APPROVAL
    assert shown.proposal == PROPOSAL
    unanswered = status(plan_of([*BEFORE_ACTION, PROPOSAL]), stored)
    assert unanswered.state is RunState.RUNNING  # a worker is writing its end record
    assert status(plan_of([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT]), None).state is (
        RunState.IN_DOUBT
    )


@pytest.mark.parametrize(
    ("records", "bad_index"),
    [
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, SETTLED, SETTLED], 6, id="twice"),
        pytest.param(
            [*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, dataclasses.replace(SETTLED, result_id="x")],
            5,
            id="settles-another-intent",
        ),
        pytest.param([*BEFORE_ACTION, SETTLED], 3, id="settles-nothing-open"),
        pytest.param([START, MODEL_INTENT, SETTLED], 2, id="settles-a-replayable-model-call"),
        pytest.param(
            [*BEFORE_ACTION, dataclasses.replace(ACTION_INTENT, replay=Replay.ALLOWED), SETTLED],
            4,
            id="settles-a-replayable-action",
        ),
        pytest.param(
            [*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, ACTION_RESULT], 5, id="result-after-doubt"
        ),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, IN_DOUBT], 5, id="doubt-twice"),
        pytest.param([*BEFORE_ACTION, IN_DOUBT], 3, id="doubt-about-nothing"),
        pytest.param([*BEFORE_ACTION, PROPOSAL, AWAITING, STEP], 5, id="step-after-pause"),
        pytest.param([*BEFORE_ACTION, PROPOSAL, STEP], 4, id="step-without-verdict"),
        pytest.param([*BEFORE_ACTION, PROPOSAL, ACTION_INTENT], 4, id="intent-without-verdict"),
        pytest.param(
            [*BEFORE_ACTION, PROPOSAL, REJECTED, ACTION_INTENT], 5, id="intent-after-rejection"
        ),
        pytest.param([*BEFORE_ACTION, PROPOSAL, APPROVED, APPROVED], 5, id="verdict-twice"),
        pytest.param([*BEFORE_ACTION, APPROVED], 3, id="verdict-without-proposal"),
        pytest.param([*BEFORE_ACTION, PROPOSAL, PROPOSAL], 4, id="proposal-twice"),
        pytest.param([START, MODEL_INTENT, PROPOSAL], 2, id="proposal-before-model-result"),
        pytest.param(
            [*BEFORE_ACTION, dataclasses.replace(PROPOSAL, step=1)], 3, id="proposal-wrong-step"
        ),
        pytest.param(
            [*BEFORE_ACTION, dataclasses.replace(PROPOSAL, result_id="x")], 3, id="proposal-id"
        ),
        pytest.param([*BEFORE_ACTION, AWAITING], 3, id="pause-without-proposal"),
        pytest.param([*BEFORE_ACTION, PROPOSAL, APPROVED, AWAITING], 5, id="pause-after-verdict"),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, PROPOSAL], 4, id="proposal-after-intent"),
    ],
)
def test_what_a_person_may_not_write_is_corrupt(records: list[Record], bad_index: int) -> None:
    with pytest.raises(CorruptLog) as caught:
        plan_of(records)
    assert caught.value.location == f"record {bad_index}"
    plan_of(records[:bad_index])  # everything before the bad record reads


POOL: list[Record] = [
    START,
    MODEL_INTENT,
    MODEL_RESULT,
    PROPOSAL,
    APPROVED,
    REJECTED,
    ACTION_INTENT,
    ACTION_RESULT,
    SETTLED,
    STEP,
    AWAITING,
    IN_DOUBT,
    CANCELLED,
    end(StopReason.FINAL_ANSWER, 1),
]


@given(st.lists(st.sampled_from(POOL), max_size=12))
def test_classification_is_total(records: list[Record]) -> None:
    """Any sequence reads to a plan or is refused as corrupt: nothing else escapes."""
    try:
        plan = plan_of(records)
    except CorruptLog:
        return
    if plan.state is RecoveryState.AWAITING_APPROVAL:
        assert plan.proposal is not None and plan.verdict is None
    if plan.state is RecoveryState.IN_DOUBT:
        assert plan.open_intent is not None and plan.settlement is None


# -- who settled a step: a person, or the tool's own probe --------------------------------

PROBED = dataclasses.replace(SETTLED, by="reconcile:deploy", duration_s=0.25)


def _second_step(first: Settlement, second: Settlement | None) -> list[Record]:
    """Step 0's action settled by ``first``; step 1's in doubt, settled by ``second``."""
    intent = record_kit.intent(RUN, 1, IntentKind.ACTION, PAYLOAD)
    records: list[Record] = [
        *BEFORE_ACTION,
        ACTION_INTENT,
        IN_DOUBT,
        first,
        ACTION_RESULT,
        dataclasses.replace(STEP, settled_by=first.by),
        record_kit.intent(RUN, 1, IntentKind.MODEL_CALL, {}, replay=Replay.ALLOWED),
        record_kit.result(RUN, 1, IntentKind.MODEL_CALL, {"content": "x"}),
        intent,
    ]
    if second is not None:
        records.append(dataclasses.replace(second, result_id=intent.result_id))
    return records


@pytest.mark.parametrize(
    ("records", "reconciled"),
    [
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT], (), id="in-doubt"),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, SETTLED], (), id="person-pending"),
        pytest.param([*BEFORE_ACTION, ACTION_INTENT, PROBED], (0,), id="probe-pending"),
        pytest.param(
            [*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, PROBED], (0,), id="probe-after-doubt"
        ),
        pytest.param(
            [
                *BEFORE_ACTION,
                ACTION_INTENT,
                PROBED,
                ACTION_RESULT,
                dataclasses.replace(STEP, settled_by=PROBED.by),
            ],
            (0,),
            id="probe-step",
        ),
        pytest.param(
            [
                *BEFORE_ACTION,
                ACTION_INTENT,
                SETTLED,
                ACTION_RESULT,
                dataclasses.replace(STEP, settled_by=SETTLED.by),
            ],
            (),
            id="person-step",
        ),
        pytest.param(_second_step(SETTLED, PROBED), (1,), id="person-then-probe-pending"),
        pytest.param(_second_step(PROBED, SETTLED), (0,), id="probe-then-person-pending"),
        pytest.param(_second_step(PROBED, PROBED), (0, 1), id="probe-twice"),
        pytest.param(_second_step(PROBED, None), (0,), id="probe-then-open"),
    ],
)
def test_status_names_the_steps_a_probe_settled(
    records: list[Record], reconciled: tuple[int, ...]
) -> None:
    """Only a settlement whose ``by`` is a probe's counts, a pending one included."""
    assert status(plan_of(records), None).reconciled_steps == reconciled


def test_a_person_named_like_no_probe_is_a_person() -> None:
    """Only the exact prefix marks a probe: a person may be called anything else."""
    for by in ("reconcile", "Reconcile:deploy", "carol (reconcile:deploy)"):
        settled = dataclasses.replace(SETTLED, by=by)
        assert not settled.by_probe
        plan = plan_of([*BEFORE_ACTION, ACTION_INTENT, IN_DOUBT, settled])
        assert status(plan, None).reconciled_steps == ()
    assert PROBED.by_probe


# -- a model call in doubt, settled by a person -------------------------------------------

MODEL = f"{RUN}:0:model"
NEVER_MODEL = record_kit.intent(RUN, 0, IntentKind.MODEL_CALL, {})
MODEL_NOT_RUN = Settlement(run_id=RUN, result_id=MODEL, ran=False, observation="no", by="carol")
MODEL_RAN = dataclasses.replace(MODEL_NOT_RUN, ran=True, observation="billed")
MODEL_AGAIN = dataclasses.replace(NEVER_MODEL, result_id=f"{RUN}:0:model2")
MODEL_THIRD = dataclasses.replace(NEVER_MODEL, result_id=f"{RUN}:0:model3")
AGAIN_RESULT = dataclasses.replace(MODEL_RESULT, result_id=MODEL_AGAIN.result_id)
LOST_REPLY = record_kit.result(RUN, 0, IntentKind.MODEL_CALL, {"error": "lost"})
MODEL_DOUBT = [START, NEVER_MODEL, IN_DOUBT]


@pytest.mark.parametrize(
    ("records", "state", "again"),
    [
        pytest.param(MODEL_DOUBT, RecoveryState.IN_DOUBT, 0, id="in-doubt"),
        pytest.param([*MODEL_DOUBT, MODEL_NOT_RUN], RecoveryState.RESUMABLE, 0, id="not-run"),
        pytest.param([*MODEL_DOUBT, MODEL_RAN], RecoveryState.RESUMABLE, 0, id="ran"),
        pytest.param(
            [*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_AGAIN], RecoveryState.IN_DOUBT, 1, id="again"
        ),
        pytest.param(
            [*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_AGAIN, AGAIN_RESULT],
            RecoveryState.RESUMABLE,
            1,
            id="again-answered",
        ),
        pytest.param(
            [
                *MODEL_DOUBT,
                MODEL_NOT_RUN,
                MODEL_AGAIN,
                IN_DOUBT,
                dataclasses.replace(MODEL_NOT_RUN, result_id=MODEL_AGAIN.result_id),
                MODEL_THIRD,
            ],
            RecoveryState.IN_DOUBT,
            2,
            id="third-call",
        ),
        pytest.param(
            [*MODEL_DOUBT, MODEL_RAN, LOST_REPLY, record_kit.step(RUN, 0, error="lost")],
            RecoveryState.RESUMABLE,
            0,
            id="ran-step",
        ),
        pytest.param(
            [
                *MODEL_DOUBT,
                MODEL_NOT_RUN,
                MODEL_AGAIN,
                AGAIN_RESULT,
                STEP,
                record_kit.intent(RUN, 1, IntentKind.MODEL_CALL, {}),
            ],
            RecoveryState.IN_DOUBT,
            0,
            id="next-step-counts-afresh",
        ),
    ],
)
def test_a_settled_model_call_reads(
    records: list[Record], state: RecoveryState, again: int
) -> None:
    plan = plan_of(records)
    assert (plan.state, plan.model_calls_again) == (state, again)


@pytest.mark.parametrize(
    ("records", "bad_index"),
    [
        pytest.param([*MODEL_DOUBT, MODEL_NOT_RUN, NEVER_MODEL], 4, id="again-under-the-old-id"),
        pytest.param([*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_THIRD], 4, id="again-skips-a-number"),
        pytest.param([*MODEL_DOUBT, MODEL_RAN, MODEL_AGAIN], 4, id="again-after-it-ran"),
        pytest.param([*MODEL_DOUBT, MODEL_NOT_RUN, LOST_REPLY], 4, id="result-after-not-run"),
        pytest.param([*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_NOT_RUN], 4, id="settled-twice"),
        pytest.param([*MODEL_DOUBT, MODEL_NOT_RUN, ACTION_INTENT], 4, id="action-instead"),
        pytest.param([START, MODEL_AGAIN], 1, id="again-without-settlement"),
        pytest.param(
            [*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_AGAIN, MODEL_NOT_RUN], 5, id="settles-the-old-call"
        ),
    ],
)
def test_what_may_not_follow_a_settled_model_call_is_corrupt(
    records: list[Record], bad_index: int
) -> None:
    with pytest.raises(CorruptLog) as caught:
        plan_of(records)
    assert caught.value.location == f"record {bad_index}"
    plan_of(records[:bad_index])


def test_what_resume_makes_of_a_settled_model_call() -> None:
    not_run = plan_of([*MODEL_DOUBT, MODEL_NOT_RUN])
    assert settled_model_call(not_run) == MODEL_NOT_RUN
    assert model_call_again_id(not_run) == f"{RUN}:0:model2"
    third = plan_of([*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_AGAIN, IN_DOUBT])
    assert settled_model_call(third) is None
    answered = dataclasses.replace(MODEL_NOT_RUN, result_id=MODEL_AGAIN.result_id)
    assert model_call_again_id(
        plan_of([*MODEL_DOUBT, MODEL_NOT_RUN, MODEL_AGAIN, IN_DOUBT, answered])
    ) == (f"{RUN}:0:model3")
    # An action's settlement is no model call's.
    assert settled_model_call(plan_of([*BEFORE_ACTION, ACTION_INTENT, SETTLED])) is None
    assert settled_model_call(plan_of([*MODEL_DOUBT, MODEL_RAN])) == MODEL_RAN
    assert unrecorded_reply_error(MODEL_RAN) == (
        "model call 'r:0:model' ran but its reply is not on record; settled by 'carol': billed"
    )
    assert unrecorded_reply_error(dataclasses.replace(MODEL_RAN, observation=" ")) == (
        "model call 'r:0:model' ran but its reply is not on record; settled by 'carol'"
    )


def test_model_result_ids_of_calls_made_again() -> None:
    assert [model_result_id("a:b", 3, again) for again in range(3)] == [
        "a:b:3:model",
        "a:b:3:model2",
        "a:b:3:model3",
    ]


@given(
    st.lists(
        st.sampled_from(
            [
                *(START, NEVER_MODEL, MODEL_NOT_RUN, MODEL_RAN, MODEL_AGAIN, AGAIN_RESULT),
                *(LOST_REPLY, MODEL_RESULT, IN_DOUBT, CANCELLED, STEP, ACTION_INTENT, SETTLED),
            ]
        ),
        max_size=12,
    )
)
def test_classification_with_model_settlements_is_total(records: list[Record]) -> None:
    try:
        plan = plan_of(records)
    except CorruptLog:
        return
    if plan.state is RecoveryState.IN_DOUBT:
        assert plan.open_intent is not None and plan.settlement is None
    if settled_model_call(plan) is not None and not plan.settlement.ran:  # type: ignore[union-attr]
        assert plan.model_result is None
