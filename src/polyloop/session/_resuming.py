"""Resuming: where a run read back from its log picks up.

:func:`continue_run` drives a resumed :class:`~polyloop.session._loop.Loop`. It asks the
probe about an action in doubt (if there is one to ask), then does what
:func:`polyloop._recovery.next_move` says a crash, a verdict or a settlement left to
do: end again, finish the interrupted step, or take the next one. Every write goes
through the loop, in the order of an uninterrupted step.
"""

from __future__ import annotations

import dataclasses

from polyloop import _recovery
from polyloop._recovery import Move
from polyloop.ports import EventKind, ModelReply
from polyloop.session import _cancelling, _probes, _proposals
from polyloop.session._checks import (
    action_name,
    action_name_of,
    refusal,
    reply_from,
)
from polyloop.session._loop import Loop, Stepped
from polyloop.session._steps import StepTimes, action_of, settled_outcome
from polyloop.types import (
    Record,
    Settlement,
    StopReason,
)


async def continue_run(
    loop: Loop, plan: _recovery.Plan, logged: tuple[Record, ...], probe: _probes.Probe | None
) -> None:
    """Go on from where ``plan`` says the run stopped, once ``probe`` (if any) was asked
    about its action in doubt. ``logged`` is the log the plan was read from, handed to
    the event sink as it is (no copy, no second read)."""
    started = plan.started
    assert started is not None
    for step in plan.steps:
        loop.remember(step)
    unsettled: str | None = None
    if probe is not None:
        answer = await _reconcile(loop, plan, probe)
        if isinstance(answer, Settlement):
            plan, logged = _recovery.settled(plan, answer), (*logged, answer)
        elif loop.end is not None:
            return
        else:
            unsettled = answer
    await loop.relay.emit(EventKind.RUN_RESUMED, None, started, logged=logged)
    move = _recovery.next_move(plan)
    if move is Move.END_IN_DOUBT:
        assert plan.open_intent is not None
        detail = _recovery.in_doubt_detail(plan.open_intent)
        await loop.finish(StopReason.IN_DOUBT, _probes.noted(detail, unsettled))
    elif move is Move.WAIT_FOR_APPROVAL:
        assert plan.proposal is not None
        await loop.pause(plan.proposal)
    elif move is Move.NEXT_STEP:
        await loop.until_stopped()
    elif move is Move.CHECK_STOP:
        await loop.go_on_after(loop.steps[-1], action_name(plan.last_action))
    elif (stepped := await _finish_interrupted(loop, move, plan)) is not None:
        await loop.go_on_after(*stepped)


async def _reconcile(loop: Loop, plan: _recovery.Plan, probe: _probes.Probe) -> Settlement | str:
    """Ask the probe what became of the action in doubt, and record its answer: the
    settlement written, or what to add to the in-doubt detail.

    The probe is an effect like any other: it starts only once the claim is checked.
    A log that already ends in doubt keeps that end unless a settlement follows it: if
    the probe cannot settle the action, ``loop.end`` is that end (its detail saying what
    the probe said), and nothing is written, not even on cancellation.
    """
    loop.end_stands = _recovery.waits_for_person(plan)
    if probe.refused is None:
        await loop.before_effect()
    answer = await _probes.ask(probe)
    if isinstance(answer, Settlement):
        await loop.store.write_review(answer)
    else:
        loop.reconcile_failures += int(answer.failed)
        if loop.end_stands:
            assert plan.ended is not None
            detail = _probes.noted(plan.ended.detail, answer.note)
            loop.end = dataclasses.replace(plan.ended, detail=detail)
    loop.end_stands = False
    return answer if isinstance(answer, Settlement) else answer.note


async def _finish_interrupted(loop: Loop, move: Move, plan: _recovery.Plan) -> Stepped:
    """Finish the step a crash, a verdict or a settlement left, as ``move`` says."""
    index, times, intent = len(loop.steps), StepTimes(), plan.open_intent
    if move is Move.CALL_MODEL_AGAIN:
        return await loop.step(_recovery.model_call_again_id(plan))
    if move is Move.LOSE_REPLY:
        assert plan.settlement is not None
        error = _recovery.unrecorded_reply_error(plan.settlement)
        await loop.write_model_result(plan.settlement.result_id, {"error": error}, None)
        return await loop.model_failed(index, error, times), None
    if move is Move.CALL_MODEL:
        # The model call's result was lost and its replay is allowed: it reuses the
        # intent on disk rather than writing a second one.
        assert intent is not None
        await _cancelling.check_before_replay(loop)
        return await loop.call_model(index, times, intent.result_id)
    return await _after_reply(loop, move, plan, index, times)


async def _after_reply(
    loop: Loop, move: Move, plan: _recovery.Plan, index: int, times: StepTimes
) -> Stepped:
    """Go on from the model reply that landed before the step was interrupted."""
    landed, intent = plan.model_result, plan.open_intent
    assert landed is not None
    if move is Move.RECORD_MODEL_FAILURE:
        error = _recovery.model_call_error(landed)
        assert error is not None
        return await loop.model_failed(index, error, times), None
    reply = reply_from(landed.payload, loop.run_id, landed.result_id)
    if move is Move.INTERPRET:
        # No action was announced, so nothing has happened yet: interpret again.
        return await loop.decide(index, reply, times)
    if intent is None:
        return await _after_verdict(loop, move, index, reply, plan, times)
    # The action was announced: replay exactly the recorded action, whatever the
    # interpreter would say today (or close it the way its settlement says).
    action, tool = action_of(intent), action_name(intent)
    if move is Move.CLOSE_SETTLED:
        settlement = plan.settlement
        assert settlement is not None
        outcome = settled_outcome(settlement)
        return await loop.close(index, reply, intent, outcome, times, settlement), tool
    await _cancelling.check_before_replay(loop)
    return await loop.act(index, reply, action, times, intent), tool


async def _after_verdict(
    loop: Loop, move: Move, index: int, reply: ModelReply, plan: _recovery.Plan, times: StepTimes
) -> Stepped:
    """Announce and run the approved action (with the arguments as approved), or
    record the rejected one as not executed."""
    verdict, proposal = plan.verdict, plan.proposal
    assert verdict is not None and proposal is not None  # a verdict answers a proposal
    if move is Move.RUN_EDITED:
        action, edit = _proposals.edited(verdict, proposal)
        return await loop.announce_and_act(index, reply, action, times, edit=edit)
    action = action_of(proposal)
    if move is Move.RUN_APPROVED:
        return await loop.announce_and_act(index, reply, action, times, approved=True)
    rejected = refusal(verdict.reason or "")
    step = loop.build.acted(index, reply, action, rejected, times)
    return await loop.record(step, None), action_name_of(proposal.payload)
