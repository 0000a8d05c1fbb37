"""Tests for polyloop._stopping: the fixed stop order and the budget counters.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polyloop._stopping import (
    Counters,
    StepFacts,
    after_step,
    before_model_call,
    counts_as_valid,
    settle,
)
from polyloop.types import ActionStatus, Budget, DecisionKind, StopReason

BUDGET = Budget(max_steps=10, max_valid_steps=5, max_context_chars=1000)


# -- before each model call ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "valid_steps", "context_chars", "expected"),
    [
        pytest.param(0, 0, 0, None, id="fresh-run-goes-on"),
        pytest.param(3, 2, 500, None, id="under-all-limits"),
        pytest.param(10, 0, 0, StopReason.STEP_LIMIT, id="step-limit"),
        pytest.param(11, 0, 0, StopReason.STEP_LIMIT, id="step-limit-exceeded"),
        pytest.param(9, 0, 0, None, id="steps-max-minus-one-passes"),
        pytest.param(6, 5, 0, StopReason.VALID_STEP_LIMIT, id="valid-step-limit"),
        pytest.param(6, 4, 0, None, id="valid-steps-max-minus-one-passes"),
        pytest.param(0, 0, 1001, StopReason.CONTEXT_LIMIT, id="context-max-plus-one-stops"),
        pytest.param(0, 0, 1000, None, id="context-equal-to-max-passes"),
        pytest.param(0, 0, 10_000, StopReason.CONTEXT_LIMIT, id="context-far-over"),
        pytest.param(10, 5, 0, StopReason.STEP_LIMIT, id="order-steps-before-valid-steps"),
        pytest.param(10, 0, 5000, StopReason.STEP_LIMIT, id="order-steps-before-context"),
        pytest.param(
            4, 5, 5000, StopReason.VALID_STEP_LIMIT, id="order-valid-steps-before-context"
        ),
        pytest.param(10, 5, 5000, StopReason.STEP_LIMIT, id="order-all-three-hold"),
    ],
)
def test_before_model_call(
    steps: int, valid_steps: int, context_chars: int, expected: StopReason | None
) -> None:
    used = Counters(steps=steps, valid_steps=valid_steps)
    assert before_model_call(BUDGET, used, context_chars) is expected


TOKEN_BUDGET = dataclasses.replace(BUDGET, max_tokens=500)


@pytest.mark.parametrize(
    ("steps", "valid_steps", "context_chars", "tokens", "expected"),
    [
        pytest.param(0, 0, 0, 499, None, id="tokens-max-minus-one-passes"),
        pytest.param(0, 0, 0, 500, StopReason.TOKEN_LIMIT, id="token-limit"),
        pytest.param(0, 0, 0, 9_000, StopReason.TOKEN_LIMIT, id="token-limit-exceeded"),
        pytest.param(10, 0, 0, 500, StopReason.STEP_LIMIT, id="order-steps-before-tokens"),
        pytest.param(
            0, 5, 0, 500, StopReason.VALID_STEP_LIMIT, id="order-valid-steps-before-tokens"
        ),
        pytest.param(0, 0, 1001, 500, StopReason.CONTEXT_LIMIT, id="order-context-before-tokens"),
        pytest.param(10, 5, 1001, 500, StopReason.STEP_LIMIT, id="order-all-four-hold"),
    ],
)
def test_before_model_call_with_a_token_budget(
    steps: int, valid_steps: int, context_chars: int, tokens: int, expected: StopReason | None
) -> None:
    used = Counters(steps=steps, valid_steps=valid_steps, tokens=tokens)
    assert before_model_call(TOKEN_BUDGET, used, context_chars) is expected


def test_without_a_token_budget_tokens_never_stop_a_run() -> None:
    assert before_model_call(BUDGET, Counters(tokens=10**12), 0) is None


def test_settle_adds_the_step_tokens() -> None:
    assert settle(Counters(tokens=7), None, 5) == Counters(steps=1, tokens=12)


def test_before_model_call_minimal_budget() -> None:
    budget = Budget(max_steps=1, max_valid_steps=1, max_context_chars=1)
    assert before_model_call(budget, Counters(), 1) is None
    assert before_model_call(budget, Counters(), 2) is StopReason.CONTEXT_LIMIT
    assert before_model_call(budget, Counters(steps=1), 0) is StopReason.STEP_LIMIT


# -- after each step ----------------------------------------------------------------------


def facts(
    *,
    decision: DecisionKind = DecisionKind.ACTION,
    model_failed: bool = False,
    action_status: ActionStatus | None = ActionStatus.EXECUTED,
    synthesized: bool = False,
    done: bool = False,
    completes: bool = False,
) -> StepFacts:
    return StepFacts(
        decision=decision,
        model_failed=model_failed,
        action_status=action_status,
        synthesized=synthesized,
        done=done,
        completes=completes,
    )


MODEL_FAILED = facts(decision=DecisionKind.INVALID, model_failed=True, action_status=None)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        # one row per rule
        pytest.param(MODEL_FAILED, StopReason.MODEL_FAILURE, id="model-failure"),
        pytest.param(
            facts(action_status=ActionStatus.ENV_FAULT, synthesized=True),
            StopReason.ENV_FAILURE,
            id="env-fault",
        ),
        pytest.param(facts(done=True), StopReason.ENV_DONE, id="env-done"),
        pytest.param(facts(completes=True), StopReason.SUBMITTED, id="submitted"),
        pytest.param(
            facts(decision=DecisionKind.FINAL, action_status=None),
            StopReason.FINAL_ANSWER,
            id="final-answer",
        ),
        pytest.param(facts(), None, id="plain-action-goes-on"),
        pytest.param(
            facts(decision=DecisionKind.INVALID, action_status=None, synthesized=True),
            None,
            id="invalid-decision-goes-on",
        ),
        pytest.param(
            facts(action_status=ActionStatus.NOT_EXECUTED, synthesized=True),
            None,
            id="refused-action-goes-on",
        ),
        # order rows
        pytest.param(
            facts(
                decision=DecisionKind.FINAL,
                model_failed=True,
                action_status=ActionStatus.ENV_FAULT,
                synthesized=True,
                done=True,
                completes=True,
            ),
            StopReason.MODEL_FAILURE,
            id="order-model-failure-beats-everything",
        ),
        pytest.param(
            facts(action_status=ActionStatus.ENV_FAULT, synthesized=True, done=True),
            StopReason.ENV_FAILURE,
            id="order-env-fault-beats-done",
        ),
        pytest.param(
            facts(action_status=ActionStatus.ENV_FAULT, completes=True),
            StopReason.ENV_FAILURE,
            id="order-env-fault-of-completing-tool-is-not-submitted",
        ),
        pytest.param(
            facts(done=True, completes=True), StopReason.ENV_DONE, id="order-done-beats-submitted"
        ),
        pytest.param(
            facts(completes=True, synthesized=True),
            None,
            id="synthesized-executed-completing-tool-does-not-submit",
        ),
        pytest.param(
            facts(completes=True, action_status=ActionStatus.NOT_EXECUTED, synthesized=True),
            None,
            id="not-executed-completing-tool-does-not-submit",
        ),
        pytest.param(
            facts(completes=True, action_status=ActionStatus.NOT_EXECUTED, synthesized=False),
            None,
            id="not-executed-unsynthesized-completing-tool-does-not-submit",
        ),
        pytest.param(
            facts(decision=DecisionKind.FINAL, action_status=None, done=True),
            StopReason.ENV_DONE,
            id="order-done-beats-final",
        ),
        pytest.param(
            facts(decision=DecisionKind.FINAL, completes=True),
            StopReason.SUBMITTED,
            id="order-submitted-beats-final",
        ),
    ],
)
def test_after_step(step: StepFacts, expected: StopReason | None) -> None:
    assert after_step(step) is expected


def test_last_allowed_step_that_submits_ends_submitted() -> None:
    """The tie: the last allowed step both submits and exhausts the budget."""
    budget = Budget(max_steps=3, max_valid_steps=3, max_context_chars=10_000)
    used = Counters()
    # Two ordinary steps, each preceded by a passing budget check.
    for _ in range(2):
        assert before_model_call(budget, used, 100) is None
        used = settle(used, ActionStatus.EXECUTED)
        assert after_step(facts()) is None
    # The last allowed step: the check before it passes ...
    assert before_model_call(budget, used, 100) is None
    used = settle(used, ActionStatus.EXECUTED)
    # ... and afterwards both counters are exhausted.
    assert used == Counters(steps=3, valid_steps=3)
    # The step's own reason is checked first: the run ends SUBMITTED.
    assert after_step(facts(completes=True)) is StopReason.SUBMITTED
    # STEP_LIMIT would only have been the answer before a *next* step.
    assert before_model_call(budget, used, 100) is StopReason.STEP_LIMIT


# -- settle and counts_as_valid -----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "valid"),
    [
        pytest.param(ActionStatus.EXECUTED, True, id="executed"),
        pytest.param(ActionStatus.NOT_EXECUTED, False, id="not-executed"),
        pytest.param(ActionStatus.ENV_FAULT, False, id="env-fault"),
        pytest.param(None, False, id="no-action"),
    ],
)
def test_counts_as_valid_and_settle(status: ActionStatus | None, valid: bool) -> None:
    assert counts_as_valid(status) is valid
    before = Counters(steps=4, valid_steps=2)
    after = settle(before, status)
    assert after.steps == 5
    assert after.valid_steps == 2 + (1 if valid else 0)
    assert before == Counters(steps=4, valid_steps=2)  # settle does not mutate


def test_synthesized_executed_outcome_still_counts_as_valid() -> None:
    """A handler that raised still ran: EXECUTED (synthesized) uses up a valid step,
    so a model cannot loop on a broken tool for free."""
    budget = Budget(max_steps=100, max_valid_steps=2, max_context_chars=10_000)
    used = Counters()
    for _ in range(2):
        assert before_model_call(budget, used, 0) is None
        used = settle(used, ActionStatus.EXECUTED)
        assert after_step(facts(synthesized=True)) is None
    assert before_model_call(budget, used, 0) is StopReason.VALID_STEP_LIMIT


def test_counters_start_at_zero_and_are_frozen() -> None:
    assert Counters() == Counters(steps=0, valid_steps=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Counters().steps = 1  # type: ignore[misc]


@given(st.lists(st.sampled_from([*ActionStatus, None]), max_size=50))
def test_settle_counts_over_a_run(statuses: list[ActionStatus | None]) -> None:
    used = Counters()
    for status in statuses:
        used = settle(used, status)
    assert used.steps == len(statuses)
    assert used.valid_steps == statuses.count(ActionStatus.EXECUTED)
    assert used.valid_steps <= used.steps


# -- properties ---------------------------------------------------------------------------

budgets = st.builds(
    Budget,
    max_steps=st.integers(1, 50),
    max_valid_steps=st.integers(1, 50),
    max_context_chars=st.integers(1, 10_000),
    max_tokens=st.none() | st.integers(1, 5_000),
)
counters = st.builds(
    Counters,
    steps=st.integers(0, 60),
    valid_steps=st.integers(0, 60),
    tokens=st.integers(0, 6_000),
)
sizes = st.integers(0, 12_000)


@given(budgets, counters, sizes)
def test_before_model_call_none_iff_all_under_limits(
    budget: Budget, used: Counters, context_chars: int
) -> None:
    under = (
        used.steps < budget.max_steps
        and used.valid_steps < budget.max_valid_steps
        and context_chars <= budget.max_context_chars
        and (budget.max_tokens is None or used.tokens < budget.max_tokens)
    )
    assert (before_model_call(budget, used, context_chars) is None) == under


@given(budgets, counters, sizes)
def test_before_model_call_returns_first_holding_check(
    budget: Budget, used: Counters, context_chars: int
) -> None:
    ordered = [
        (used.steps >= budget.max_steps, StopReason.STEP_LIMIT),
        (used.valid_steps >= budget.max_valid_steps, StopReason.VALID_STEP_LIMIT),
        (context_chars > budget.max_context_chars, StopReason.CONTEXT_LIMIT),
        (
            budget.max_tokens is not None and used.tokens >= budget.max_tokens,
            StopReason.TOKEN_LIMIT,
        ),
    ]
    expected = next((reason for holds, reason in ordered if holds), None)
    assert before_model_call(budget, used, context_chars) is expected


step_facts = st.builds(
    StepFacts,
    decision=st.sampled_from(DecisionKind),
    model_failed=st.booleans(),
    action_status=st.sampled_from([*ActionStatus, None]),
    synthesized=st.booleans(),
    done=st.booleans(),
    completes=st.booleans(),
)


@given(step_facts)
def test_after_step_is_deterministic_and_respects_the_order(step: StepFacts) -> None:
    first = after_step(step)
    assert after_step(dataclasses.replace(step)) is first
    ordered = [
        (step.model_failed, StopReason.MODEL_FAILURE),
        (step.action_status is ActionStatus.ENV_FAULT, StopReason.ENV_FAILURE),
        (step.done, StopReason.ENV_DONE),
        (
            step.completes and step.action_status is ActionStatus.EXECUTED and not step.synthesized,
            StopReason.SUBMITTED,
        ),
        (step.decision is DecisionKind.FINAL, StopReason.FINAL_ANSWER),
    ]
    expected = next((reason for holds, reason in ordered if holds), None)
    assert first is expected


@given(step_facts)
def test_after_step_never_returns_a_budget_reason(step: StepFacts) -> None:
    assert after_step(step) not in {
        StopReason.STEP_LIMIT,
        StopReason.VALID_STEP_LIMIT,
        StopReason.CONTEXT_LIMIT,
        StopReason.TOKEN_LIMIT,
        StopReason.CANCELLED,
        StopReason.IN_DOUBT,
    }
