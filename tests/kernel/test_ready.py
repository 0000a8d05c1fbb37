"""Tests for why a run nobody drives goes on (``_recovery.ready``, ``RunStatus.ready``).

Pure synchronous code, tested as tables as test_picking is: each row is what a log
reads as, and what a person is told of it. ``session._picking.choose`` builds on the
same function, so a host drives exactly the runs ``run_status`` calls ready.
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
from polyloop._recovery import Plan, RecoveryState, probe_recorded, ready, status
from polyloop.ports import StoredRun
from polyloop.types import Ready, RunState, StopReason

PROBED_CRASHED = dataclasses.replace(IN_DOUBT_CRASHED, open_intent=PROBED_ACTION)
PROBED_CANCELLED = dataclasses.replace(PROBED_CRASHED, ended=end(StopReason.CANCELLED))
PROBED_ENDED = dataclasses.replace(IN_DOUBT_ENDED, open_intent=PROBED_ACTION)
FINISHED = plan(RecoveryState.FINISHED, steps=(step(0),), ended=end(StopReason.FINAL_ANSWER))

READY_ROWS = [
    # (plan, probe, why)
    pytest.param(plan(), False, Ready.NEW, id="started-never-driven"),
    pytest.param(
        plan(started=started(inherited=2), steps=(step(0), step(1))),
        False,
        Ready.NEW,
        id="fork-started-never-driven",
    ),
    pytest.param(
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(True)),
        False,
        Ready.APPROVED,
        id="approved",
    ),
    pytest.param(
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(False)),
        False,
        Ready.REJECTED,
        id="rejected",
    ),
    pytest.param(
        plan(model_result=REPLY, open_intent=ACTION, settlement=SETTLED),
        False,
        Ready.SETTLED,
        id="settled",
    ),
    pytest.param(IN_DOUBT_CRASHED, True, Ready.PROBE, id="in-doubt-with-a-probe"),
    pytest.param(IN_DOUBT_ENDED, True, Ready.PROBE, id="ended-in-doubt-with-a-probe"),
    pytest.param(plan(steps=(step(0),)), False, Ready.INTERRUPTED, id="crashed-after-a-step"),
    pytest.param(plan(open_intent=MODEL), False, Ready.INTERRUPTED, id="crashed-in-a-model-call"),
    pytest.param(
        plan(steps=(step(0),), ended=end(StopReason.CANCELLED)),
        False,
        Ready.INTERRUPTED,
        id="cancelled",
    ),
    pytest.param(
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(True), open_intent=ACTION),
        False,
        Ready.INTERRUPTED,
        id="crashed-in-an-approved-action",
    ),
    pytest.param(IN_DOUBT_ENDED, False, None, id="in-doubt-for-a-person"),
    pytest.param(IN_DOUBT_CRASHED, False, None, id="in-doubt-its-end-not-written-yet"),
    pytest.param(WAITING_FOR_APPROVAL, False, None, id="awaiting-approval"),
    pytest.param(
        plan(RecoveryState.AWAITING_APPROVAL, model_result=REPLY, proposal=PROPOSAL),
        False,
        None,
        id="proposal-its-end-not-written-yet",
    ),
    pytest.param(FINISHED, False, None, id="finished"),
    pytest.param(Plan(state=RecoveryState.FRESH), False, None, id="fresh"),
]


@pytest.mark.parametrize(("plan_", "probe", "expected"), READY_ROWS)
def test_why_a_run_goes_on(plan_: Plan, probe: bool, expected: Ready | None) -> None:
    assert ready(plan_, probe=probe) is expected


PROBE_ROWS = [
    # (plan, whether the log says the tool's probe will settle the doubt)
    pytest.param(PROBED_CRASHED, True, id="announced-with-a-probe-then-crashed"),
    pytest.param(PROBED_CANCELLED, True, id="announced-with-a-probe-then-cancelled"),
    pytest.param(PROBED_ENDED, False, id="the-probe-could-not-tell"),
    pytest.param(IN_DOUBT_CRASHED, False, id="an-intent-that-says-nothing"),
    pytest.param(
        dataclasses.replace(
            IN_DOUBT_CRASHED, open_intent=dataclasses.replace(ACTION, reconciles=False)
        ),
        False,
        id="announced-without-a-probe",
    ),
    pytest.param(plan(open_intent=MODEL), False, id="a-model-call"),
]


@pytest.mark.parametrize(("plan_", "expected"), PROBE_ROWS)
def test_the_log_says_whether_a_probe_will_settle_the_doubt(plan_: Plan, expected: bool) -> None:
    assert probe_recorded(plan_) is expected


STATUS_ROWS = [
    # (plan, stored, state, ready)
    pytest.param(plan(), stored(), RunState.RESUMABLE, Ready.NEW, id="new"),
    pytest.param(plan(), stored(claimed=True), RunState.RUNNING, None, id="running"),
    pytest.param(
        plan(model_result=REPLY, proposal=PROPOSAL, verdict=verdict(True)),
        stored(),
        RunState.RESUMABLE,
        Ready.APPROVED,
        id="approved",
    ),
    pytest.param(PROBED_CRASHED, stored(), RunState.IN_DOUBT, Ready.PROBE, id="probe"),
    pytest.param(PROBED_CRASHED, None, RunState.IN_DOUBT, Ready.PROBE, id="probe-unlisted"),
    pytest.param(PROBED_ENDED, stored(), RunState.IN_DOUBT, None, id="probe-could-not-tell"),
    pytest.param(IN_DOUBT_CRASHED, stored(), RunState.IN_DOUBT, None, id="doubt-for-a-person"),
    pytest.param(
        WAITING_FOR_APPROVAL, stored(), RunState.AWAITING_APPROVAL, None, id="awaiting-approval"
    ),
    pytest.param(FINISHED, stored(finished=True), RunState.FINISHED, None, id="finished"),
]


@pytest.mark.parametrize(("plan_", "stored_", "state", "expected"), STATUS_ROWS)
def test_the_status_says_why_a_run_goes_on_and_names_its_agent(
    plan_: Plan, stored_: StoredRun | None, state: RunState, expected: Ready | None
) -> None:
    found = status(plan_, stored_)
    assert (found.state, found.ready) == (state, expected)
    assert found.agent == "payer"


def test_a_run_started_without_an_agent_names_none() -> None:
    found = status(plan(started=started(None)), stored())
    assert (found.ready, found.agent) == (Ready.NEW, None)
