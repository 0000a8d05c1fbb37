"""Tests for which listed runs a host drives, and why (``session._picking.choose``).

Pure synchronous code, tested as a table as test_next_move is: each row is what a
store lists of a run and what its log reads as, and the host's choice.
"""

from __future__ import annotations

import dataclasses

import pytest

from kit.plans import (
    ACTION,
    IN_DOUBT_CRASHED,
    IN_DOUBT_ENDED,
    MODEL,
    PROBED_ACTION,
    PROPOSAL,
    REPLY,
    SETTLED,
    WAITING_FOR_APPROVAL,
    end,
    plan,
    started,
    step,
    stored,
    verdict,
)
from polyloop._recovery import Plan, RecoveryState
from polyloop.ports import StoredRun
from polyloop.session._picking import Choice, choose
from polyloop.types import Ready, StopReason

HOSTED = frozenset({"payer"})

ROWS = [
    # (stored, plan, has_probe, driven_here, choice)
    pytest.param(stored(), plan(), False, False, Choice.NEW, id="started-never-driven"),
    pytest.param(
        stored(),
        plan(started=started(inherited=2), steps=(step(0), step(1))),
        False,
        False,
        Choice.NEW,
        id="fork-started-never-driven",
    ),
    pytest.param(
        stored(),
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(True)),
        False,
        False,
        Choice.APPROVED,
        id="approved",
    ),
    pytest.param(
        stored(),
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(False)),
        False,
        False,
        Choice.REJECTED,
        id="rejected",
    ),
    pytest.param(
        stored(),
        plan(model_result=REPLY, open_intent=ACTION, settlement=SETTLED),
        False,
        False,
        Choice.SETTLED,
        id="settled",
    ),
    pytest.param(stored(), IN_DOUBT_ENDED, True, False, Choice.PROBE, id="doubt-with-a-probe"),
    pytest.param(
        stored(), IN_DOUBT_CRASHED, True, False, Choice.PROBE, id="crashed-doubt-with-a-probe"
    ),
    pytest.param(
        stored(),
        plan(steps=(step(0),), ended=end(StopReason.CANCELLED)),
        False,
        False,
        Choice.INTERRUPTED,
        id="cancelled",
    ),
    pytest.param(
        stored(), plan(steps=(step(0),)), False, False, Choice.INTERRUPTED, id="left-after-a-step"
    ),
    pytest.param(
        stored(),
        plan(open_intent=MODEL),
        False,
        False,
        Choice.INTERRUPTED,
        id="left-in-a-model-call",
    ),
    pytest.param(
        stored(),
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(True), open_intent=ACTION),
        False,
        False,
        Choice.INTERRUPTED,
        id="left-in-an-approved-action",
    ),
    pytest.param(
        stored(),
        IN_DOUBT_CRASHED,
        False,
        False,
        Choice.INTERRUPTED,
        id="left-in-doubt-without-its-end-record",
    ),
    pytest.param(
        stored(),
        plan(
            RecoveryState.IN_DOUBT,
            model_result=REPLY,
            open_intent=ACTION,
            ended=end(StopReason.CANCELLED),
        ),
        False,
        False,
        Choice.INTERRUPTED,
        id="cancelled-in-doubt-records-the-doubt",
    ),
    pytest.param(
        stored(),
        plan(RecoveryState.AWAITING_APPROVAL, model_result=REPLY, proposal=PROPOSAL),
        False,
        False,
        Choice.INTERRUPTED,
        id="proposal-without-its-end-record",
    ),
    pytest.param(
        stored(),
        dataclasses.replace(IN_DOUBT_ENDED, open_intent=PROBED_ACTION),
        False,
        False,
        Choice.AWAITS_SETTLEMENT,
        id="the-hosted-executor-decides-not-the-log",
    ),
    pytest.param(
        stored(), WAITING_FOR_APPROVAL, False, False, Choice.AWAITS_APPROVAL, id="awaits-approval"
    ),
    pytest.param(
        stored(), IN_DOUBT_ENDED, False, False, Choice.AWAITS_SETTLEMENT, id="awaits-settlement"
    ),
    pytest.param(stored(), plan(), False, True, Choice.DRIVEN_HERE, id="driven-here"),
    pytest.param(stored(claimed=True), plan(), False, False, Choice.CLAIMED, id="claimed"),
    pytest.param(
        stored(claimed=True), IN_DOUBT_ENDED, True, False, Choice.CLAIMED, id="claimed-in-doubt"
    ),
    pytest.param(
        stored(finished=True), plan(), False, False, Choice.FINISHED, id="listed-finished"
    ),
    pytest.param(
        stored(),
        plan(RecoveryState.FINISHED, ended=end(StopReason.FINAL_ANSWER)),
        False,
        False,
        Choice.FINISHED,
        id="log-finished",
    ),
    pytest.param(
        stored(), Plan(state=RecoveryState.FRESH), False, False, Choice.NOT_STARTED, id="fresh"
    ),
    pytest.param(
        stored(), plan(started=started(None)), False, False, Choice.NO_AGENT, id="plain-run"
    ),
    pytest.param(
        stored(), plan(started=started("other")), False, False, Choice.NOT_HOSTED, id="foreign"
    ),
    pytest.param(
        stored(),
        plan(
            RecoveryState.IN_DOUBT,
            started=started("other"),
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
        Choice.INTERRUPTED,
        Choice.CANCEL_REQUESTED,
    }
    # A host drives a run for the reason run_status gives, under the same name.
    assert {choice.value for choice in drives} == {why.value for why in Ready}
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
    pytest.param({}, plan(), Choice.CANCEL_REQUESTED, id="never-driven"),
    pytest.param({"claimed": True}, plan(), Choice.CLAIMED, id="claimed"),
    pytest.param(
        {"finished": True},
        plan(RecoveryState.FINISHED, ended=end(StopReason.CANCELLED_BY_REQUEST)),
        Choice.FINISHED,
        id="ended-by-the-request",
    ),
    pytest.param({}, plan(started=started("other")), Choice.NOT_HOSTED, id="foreign"),
]


@pytest.mark.parametrize(("listed", "plan_", "expected"), CANCEL_ROWS)
def test_a_run_with_a_cancel_request(
    listed: dict[str, bool], plan_: Plan, expected: Choice
) -> None:
    asked = dataclasses.replace(stored(**listed), cancel_requested=True)
    assert choose(asked, plan_, hosted=HOSTED, has_probe=True) is expected
