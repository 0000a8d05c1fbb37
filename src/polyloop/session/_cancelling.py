"""A person's cancel: a durable request that fences every later intent, and the run's end.

:func:`cancel` keeps a :class:`~polyloop.types.CancelRequest` beside the run's log,
without needing the run's claim. From then on the store refuses the run's intents and
proposals with :class:`~polyloop.types.CancelRequested`, in the step that would have
written them, so no effect starts after the request: an effect whose intent was
written before it may still run, and its step is recorded. Whoever drives the run then
ends it ``CANCELLED_BY_REQUEST``, naming who asked (``cancelled_by``) and why
(``detail``), and that end is final:

* the loop, at its next intent or proposal (:func:`fenced`);
* ``resume`` or a host, right after the claim and the log read, before any probe or
  effect (:func:`end_resumed`);
* :func:`cancel` itself when it gets the claim: nobody drives the run, so it ends it
  there and then.

Unlike ``CANCELLED``, the end a cancelled process writes, nothing drives such a run
again: it is finished.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from polyloop import _recovery
from polyloop.ports import EventKind, Store
from polyloop.session import _draining
from polyloop.session._review import check_result_id, check_text, described, release, waiting
from polyloop.session._steps import now
from polyloop.types import (
    CancelRequest,
    CancelRequested,
    InvalidRequest,
    NotAwaitingApproval,
    NotInDoubt,
    Record,
    RunEnded,
    RunLocked,
    RunLog,
    RunNotFound,
    RunResult,
    StopReason,
)

if TYPE_CHECKING:
    from polyloop.session._loop import Loop


async def fenced(loop: Loop, body: Awaitable[None]) -> None:
    """Await ``body``, the loop's drive; once the store refuses one of its intents or
    proposals because a cancel was requested, end the run as the request asks.

    Nothing of the refused write landed, and every step before it is on record, so the
    end counts exactly what the log holds. A stop reason, not an exception: the caller
    returns the run's result as for any other end.
    """
    try:
        await body
    except CancelRequested as refused:
        if refused.run_id != loop.run_id:
            raise
        await _end(loop, by=refused.by, why=refused.why)


async def end_resumed(
    loop: Loop, plan: _recovery.Plan, logged: tuple[Record, ...], asked: CancelRequest
) -> RunResult:
    """End the resumed run ``plan`` describes at once, as ``asked``: no probe is asked
    and no effect runs, not even one whose intent is already on disk."""
    started = plan.started
    assert started is not None
    _draining.claimed(loop.run_id)

    async def body() -> None:
        for step in plan.steps:
            loop.remember(step)
        await loop.relay.emit(EventKind.RUN_RESUMED, None, started, logged=logged)
        await _end(loop, by=asked.by, why=asked.reason)

    return await loop.guarded(body())


async def check_before_replay(loop: Loop) -> None:
    """Refuse to replay an effect of a run whose cancel was requested since it was claimed.

    A replayed effect reuses the intent on disk, so there is no write for the store to
    refuse: this read stands in for that write's check. A request that lands between
    this read and the effect lets the effect run, as one that lands just after an
    intent was written does; its step is then recorded and the next intent is refused.
    """
    asked = await loop.store.read_cancel(loop.run_id)
    if asked is not None:
        raise CancelRequested(run_id=loop.run_id, by=asked.by, why=asked.reason)


async def _end(loop: Loop, *, by: str, why: str) -> None:
    reason = StopReason.CANCELLED_BY_REQUEST
    await loop.end_with(loop.build.end(reason, why, loop.used, None, cancelled_by=by))


async def cancel(store: Store, run_id: str, *, by: str, reason: str, result_id: str | None) -> None:
    """Ask ``run_id`` to stop for good, and end it here if nobody drives it.

    With the run's claim: ``result_id`` is checked, the request kept and the end record
    written, in that order, under the claim. Without it (``RunLocked``: a live writer
    drives the run), a cancel naming what the person saw is refused, since the run no
    longer waits on it; any other is kept for the owner to end the run at its next intent.
    """
    if not isinstance(run_id, str) or not run_id:
        raise InvalidRequest(f"run_id must be a non-empty string, not {run_id!r:.40}")
    check_text("by", by, run_id)
    check_text("reason", reason, run_id)
    check_result_id(result_id, run_id)
    asked = CancelRequest(run_id=run_id, by=by, reason=reason, at=now())
    try:
        await _end_claimed(store, asked, result_id)
    except RunLocked as exc:
        if result_id is not None:
            raise RunLocked(
                f"a live writer drives the run, so it no longer waits on {result_id!r}; "
                "nothing was written",
                run_id=run_id,
            ) from exc
    else:
        return
    if _recovery.read_plan(await _read_started(store, run_id)).state is _FINISHED:
        return
    await store.request_cancel(asked)
    # The owner may have let go meanwhile (stopping to wait for a person, say): if so,
    # the run ends here rather than waiting for a host to find the request.
    with contextlib.suppress(RunLocked):
        await _end_claimed(store, asked, None)


_FINISHED = _recovery.RecoveryState.FINISHED


async def _read_started(store: Store, run_id: str) -> RunLog:
    log = await store.read_log(run_id)
    if not log.records:
        raise RunNotFound("the store holds no record of this run", run_id=run_id)
    return log


async def _end_claimed(store: Store, asked: CancelRequest, result_id: str | None) -> None:
    """Under the run's claim: refuse a stale ``result_id``, keep the request, end the run
    (a finished run is left as it is)."""
    run_id = asked.run_id
    await store.claim_run(run_id)
    try:
        plan = _recovery.read_plan(await _read_started(store, run_id))
        if plan.state is _FINISHED:
            return
        _check_open(plan, run_id, result_id)
        await store.request_cancel(asked)
        kept = await store.read_cancel(run_id) or asked  # a run keeps its first request
        await store.end_run(
            RunEnded(
                run_id=run_id,
                stop_reason=StopReason.CANCELLED_BY_REQUEST,
                final_answer=None,
                steps=len(plan.steps),
                valid_steps=_recovery.valid_step_count(plan.steps),
                detail=kept.reason,
                at=now(),
                cancelled_by=kept.by,
            )
        )
    finally:
        await release(store, run_id)


def _check_open(plan: _recovery.Plan, run_id: str, result_id: str | None) -> None:
    """Refuse a cancel naming a proposal or an intent that is no longer the run's open one:
    the person decided on what they saw, and the run has moved on from it."""
    if result_id is None:
        return
    if plan.state is _recovery.RecoveryState.AWAITING_APPROVAL:
        waiting(plan, run_id, result_id)  # NotAwaitingApproval unless it is that proposal
        return
    intent = plan.open_intent
    if intent is not None and intent.result_id == result_id:
        return
    if intent is None and plan.verdict is not None and plan.verdict.result_id == result_id:
        waiting(plan, run_id, result_id)  # says who answered it
    if intent is not None:
        raise NotInDoubt(
            f"the open intent is {intent.result_id!r}, not {result_id!r}; {result_id!r} is "
            "no longer open",
            run_id=run_id,
        )
    raise NotAwaitingApproval(
        f"the run waits on nothing named {result_id!r} (it is {described(plan)}); "
        f"{result_id!r} is no longer open",
        run_id=run_id,
    )
