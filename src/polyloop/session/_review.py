"""A person's answers: approving or rejecting a proposed action, settling one in doubt.

Each answer is one record, written under the run's claim like any other write: the
claim comes first, so two people answering at once cannot both write (the second gets
``RunLocked``, or, once the first let go, the error that says the run no longer waits),
and a worker cannot be driving the run meanwhile. Everything is checked against the log
read under the claim before the record is written; a refused answer writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

import anyio

from polyloop import _recovery
from polyloop.ports import Store
from polyloop.serialization import plain
from polyloop.tools import described_call_refusal
from polyloop.types import (
    CancelRequested,
    Intent,
    IntentKind,
    InvalidRequest,
    JSONValue,
    NotAwaitingApproval,
    NotInDoubt,
    Proposal,
    RunNotFound,
    Settlement,
    UnloggableValue,
    Verdict,
)

logger = logging.getLogger("polyloop")

# How long giving up the claim may take once the answer is written or refused.
_RELEASE_GRACE_S = 10.0


async def approve(
    store: Store, run_id: str, *, by: str, arguments: JSONValue, result_id: str | None
) -> Verdict:
    check_text("by", by, run_id)
    check_result_id(result_id, run_id)

    def verdict(plan: _recovery.Plan) -> Verdict:
        proposal = waiting(plan, run_id, result_id)
        payload = proposal.payload
        if arguments is not None:
            payload = _edited(plan, payload, arguments, run_id)
        return _verdict(proposal, by=by, payload=payload, reason=None)

    return await _answer(store, run_id, verdict)


async def reject(
    store: Store, run_id: str, *, by: str, reason: str, result_id: str | None
) -> Verdict:
    check_text("by", by, run_id)
    check_text("reason", reason, run_id)
    check_result_id(result_id, run_id)

    def verdict(plan: _recovery.Plan) -> Verdict:
        return _verdict(waiting(plan, run_id, result_id), by=by, payload=None, reason=reason)

    return await _answer(store, run_id, verdict)


async def settle(
    store: Store, run_id: str, *, by: str, ran: bool, observation: str, result_id: str | None
) -> Settlement:
    check_text("by", by, run_id)
    if not isinstance(ran, bool):
        raise InvalidRequest(f"ran must be True or False, not {ran!r:.40}", run_id=run_id)
    if not isinstance(observation, str):
        raise InvalidRequest("observation must be a string", run_id=run_id)
    check_result_id(result_id, run_id)

    def settlement(plan: _recovery.Plan) -> Settlement:
        intent = _in_doubt(plan, run_id)
        if result_id is not None and result_id != intent.result_id:
            raise NotInDoubt(
                f"the effect in doubt is {intent.result_id!r}, not {result_id!r}; "
                f"{result_id!r} is no longer open",
                run_id=run_id,
            )
        return Settlement(
            run_id=run_id,
            result_id=intent.result_id,
            ran=ran,
            observation=observation,
            by=by,
            at=datetime.now(UTC),
        )

    return await _answer(store, run_id, settlement)


_R = TypeVar("_R", Verdict, Settlement)


async def _answer(store: Store, run_id: str, build: Callable[[_recovery.Plan], _R]) -> _R:
    """Claim the run, build the answer from the log read under the claim, write it.

    A run someone asked to cancel takes no answer (``CancelRequested``): it ends for good.
    """
    if not isinstance(run_id, str) or not run_id:
        raise InvalidRequest(f"run_id must be a non-empty string, not {run_id!r:.40}")
    await store.claim_run(run_id)
    try:
        plan = _recovery.read_plan(await store.read_log(run_id))
        if plan.started is None:
            raise RunNotFound("the store holds no record of this run", run_id=run_id)
        if (asked := await store.read_cancel(run_id)) is not None:
            # The run ends for good: an answer would be for something that never runs.
            raise CancelRequested(run_id=run_id, by=asked.by, why=asked.reason)
        record = build(plan)
        await store.write_review(record)
        return record
    finally:
        await release(store, run_id)


async def release(store: Store, run_id: str) -> None:
    """Give up the claim an answer took, shielded and bounded in time; never raise."""
    with anyio.move_on_after(_RELEASE_GRACE_S, shield=True):
        try:
            await store.release_run(run_id)
        except Exception:
            logger.exception("run %r: could not give up the claim", run_id)


def _verdict(proposal: Proposal, *, by: str, payload: JSONValue, reason: str | None) -> Verdict:
    """The verdict on ``proposal``: approved with ``payload`` to run, or, with a
    ``reason``, rejected."""
    return Verdict(
        run_id=proposal.run_id,
        result_id=proposal.result_id,
        approved=reason is None,
        by=by,
        payload=payload,
        reason=reason,
        at=datetime.now(UTC),
    )


def check_text(name: str, value: object, run_id: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{name} must be a non-empty string, not {value!r:.40}", run_id=run_id)


def check_result_id(result_id: object, run_id: str) -> None:
    if result_id is not None and (not isinstance(result_id, str) or not result_id):
        raise InvalidRequest(
            f"result_id must be a non-empty string or None, not {result_id!r:.40}", run_id=run_id
        )


def waiting(plan: _recovery.Plan, run_id: str, result_id: str | None) -> Proposal:
    """The proposal waiting for a verdict, or why there is none.

    ``result_id``, when given, must be the open proposal's: an answer written for a
    proposal the person never saw would run what they did not read.
    """
    if plan.state is _recovery.RecoveryState.AWAITING_APPROVAL and plan.proposal is not None:
        if result_id is not None and result_id != plan.proposal.result_id:
            raise NotAwaitingApproval(
                f"the open proposal is {plan.proposal.result_id!r}, not {result_id!r}; "
                f"proposal {result_id!r} is no longer open",
                run_id=run_id,
            )
        return plan.proposal
    if plan.verdict is not None:
        done = "approved" if plan.verdict.approved else "rejected"
        raise NotAwaitingApproval(
            f"action {plan.verdict.result_id!r} was already {done} by {plan.verdict.by!r}",
            run_id=run_id,
        )
    raise NotAwaitingApproval(
        f"the run waits for no approval (it is {described(plan)})", run_id=run_id
    )


def _in_doubt(plan: _recovery.Plan, run_id: str) -> Intent:
    """The intent in doubt (an action or a model call), or why there is none to settle."""
    intent = plan.open_intent
    if plan.settlement is not None:
        raise NotInDoubt(
            f"{_kind(plan.open_intent)} {plan.settlement.result_id!r} was already settled by "
            f"{plan.settlement.by!r}",
            run_id=run_id,
        )
    if plan.state is not _recovery.RecoveryState.IN_DOUBT or intent is None:
        raise NotInDoubt(f"the run has no effect in doubt (it is {described(plan)})", run_id=run_id)
    return intent


def _kind(intent: Intent | None) -> str:
    return "model call" if intent is not None and intent.kind is IntentKind.MODEL_CALL else "action"


def described(plan: _recovery.Plan) -> str:
    if plan.state is _recovery.RecoveryState.FINISHED and plan.ended is not None:
        return f"finished: {plan.ended.stop_reason.value}"
    return plan.state.value.replace("_", " ")


def _edited(
    plan: _recovery.Plan, payload: JSONValue, arguments: JSONValue, run_id: str
) -> JSONValue:
    """The proposed payload with the person's arguments, checked against the tool's schema
    as the run's snapshot holds it (as last amended)."""
    assert plan.started is not None
    name = payload.get("name") if isinstance(payload, dict) else None
    if not isinstance(payload, dict) or not isinstance(name, str):
        raise InvalidRequest(
            "the proposed action is not a tool call, so its arguments cannot be edited",
            run_id=run_id,
        )
    tools = plan.snapshot.get("tools")
    specs = tools.get("specs") if isinstance(tools, dict) else None
    refusal = described_call_refusal(specs, name, arguments)
    if refusal is not None:
        raise InvalidRequest(refusal, run_id=run_id)
    try:
        copied = plain(arguments, owner="Verdict", field="arguments", run_id=run_id)
    except UnloggableValue as exc:  # pragma: no cover - the schema check refuses it first
        raise InvalidRequest(exc.reason, run_id=run_id) from None
    return {**payload, "arguments": copied}
