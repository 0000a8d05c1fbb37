"""Claiming a run, reading it under the claim, and handing it to the loop.

``run``, ``resume`` and ``start_or_resume`` differ only in what they accept to find in
the log, so they share :func:`drive`. The claim comes first: the log is read only once
this store object is the run's one writer, so nothing decided from it can be made stale
by another writer, and a second claimant learns ``RunLocked`` before it reads, decides or
executes anything. The claim is given up on every way out (``end_run`` gives it up on
the normal one). A run someone asked to cancel ends right after the read
(:mod:`~polyloop.session._cancelling`), before any probe or effect.

:func:`status` and :func:`recover` serve the programs that watch and sweep a store.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from polyloop import _recovery
from polyloop.ports import ManagedStore, Store, StoredRun
from polyloop.session import _amending, _cancelling, _draining
from polyloop.session._forking import Inheritance
from polyloop.session._loop import Loop
from polyloop.session._probes import probe_for
from polyloop.session._request import Prepared, prepare
from polyloop.session._resuming import continue_run
from polyloop.session._steps import now
from polyloop.session._values import Definition, Request
from polyloop.types import (
    Amended,
    Amendment,
    InvalidRequest,
    JSONValue,
    RecoveredRun,
    RunAlreadyExists,
    RunIdentityMismatch,
    RunLocked,
    RunLog,
    RunNotFound,
    RunResult,
    RunStarted,
    RunStatus,
)

logger = logging.getLogger("polyloop")

RequestFor = Callable[[str], Request | Awaitable[Request]]


class Mode(enum.Enum):
    """What the caller accepts to find in the log."""

    START = "start"  # nothing: the run is new
    RESUME = "resume"  # a started run
    EITHER = "either"


@dataclass(frozen=True, slots=True, kw_only=True)
class Origin:
    """The agent a run is started through and its input (as the log holds it)."""

    agent: str
    input: JSONValue

    def stamp(self, started: RunStarted) -> RunStarted:
        return dataclasses.replace(started, agent=self.agent, input=self.input)

    def differences(self, started: RunStarted) -> tuple[tuple[str, JSONValue, JSONValue], ...]:
        """How the start record's agent and input differ from these, as identity keys."""
        return _recovery.identity_differences(
            {"agent.name": started.agent, "agent.input": started.input},
            {"agent.name": self.agent, "agent.input": self.input},
        )


async def drive(
    definition: Definition,
    request: Request,
    mode: Mode,
    inherit: Callable[[], Awaitable[Inheritance]] | None = None,
    *,
    origin: Origin | None = None,
    amend: Amendment | None = None,
) -> RunResult:
    """Check the request, claim the run, read its log, and start or continue it.

    ``inherit`` reads what a fork takes over from its source (``mode`` is then START);
    it is awaited once the request is checked, before the claim. ``origin`` is the agent
    a new run is recorded under and an existing one must have been started through.
    ``amend`` lets an existing run go on under the differences it accepts.
    """
    prepared = prepare(definition, request)
    if amend is not None:
        _amending.checked(amend, request.run_id)
    inheritance = None if inherit is None else await inherit()
    if inheritance is not None:
        inheritance.check(request.run_id, prepared.snapshot)
    store = definition.store
    await store.claim_run(request.run_id)
    try:
        return await _drive_claimed(definition, request, prepared, mode, inheritance, origin, amend)
    finally:
        await _release(store, request)


async def register(
    definition: Definition, request: Request, origin: Origin, amend: Amendment | None = None
) -> None:
    """Write the run's start record under ``origin`` and drive nothing; a run already
    started the same way, or differing only as ``amend`` accepts, is left as it is (a
    retried start is safe; the resume that drives it on writes the amendment)."""
    prepared = prepare(definition, request)
    store = definition.store
    try:
        await store.claim_run(request.run_id)
    except RunLocked:
        # Its writer may be driving it already: the log answers without the claim.
        if not (await store.read_log(request.run_id)).records:
            raise
        await _check_existing(store, request, prepared, origin, amend)
        return
    try:
        if not await _check_existing(store, request, prepared, origin, amend):
            started = origin.stamp(_started(request, prepared))
            await store.start_run(started)
    finally:
        await _release(store, request)


async def _check_existing(
    store: Store, request: Request, prepared: Prepared, origin: Origin, amend: Amendment | None
) -> bool:
    """Whether the run exists, refusing one started with another identity than
    ``amend`` (if any) accepts."""
    log = await store.read_log(request.run_id)
    if not log.records:
        return False
    _identity_plan(log, request, prepared, origin, amend)
    return True


async def _drive_claimed(
    definition: Definition,
    request: Request,
    prepared: Prepared,
    mode: Mode,
    inheritance: Inheritance | None,
    origin: Origin | None,
    amend: Amendment | None,
) -> RunResult:
    log = await definition.store.read_log(request.run_id)
    if not log.records:
        if mode is Mode.RESUME:
            raise RunNotFound("the store holds no record of this run", run_id=request.run_id)
        loop = Loop(definition, request, prepared, resumed=False)
        started = _started(request, prepared)
        if inheritance is not None:
            started = inheritance.started(started)
        if origin is not None:
            started = origin.stamp(started)
        _draining.claimed(request.run_id)
        return await loop.guarded(_cancelling.fenced(loop, loop.start(started)))
    if mode is Mode.START:
        raise RunAlreadyExists(
            "the store already holds records for this run; use resume", run_id=request.run_id
        )
    plan, amended = _identity_plan(log, request, prepared, origin, amend)
    if plan.state is _recovery.RecoveryState.FINISHED:
        return _recovery.recorded_result(plan)
    loop = Loop(definition, request, prepared, resumed=True)
    if amended is not None:
        # Before anything else: whatever happens next happens under the amended snapshot.
        await _amending.record(definition.store, loop.relay, amended)
        log = RunLog(run_id=log.run_id, records=(*log.records, amended))
    if (asked := await definition.store.read_cancel(request.run_id)) is not None:
        return await _cancelling.end_resumed(loop, plan, log.records, asked)
    probe = probe_for(request.executor, plan)
    if _recovery.waits_for_person(plan) and probe is None:
        # Nothing to do until a person answers: the recorded end stands, nothing is written.
        waiting = _recovery.recorded_result(plan)
        return dataclasses.replace(waiting, event_failures=loop.relay.failures)
    _draining.claimed(request.run_id)
    return await loop.guarded(
        _cancelling.fenced(loop, continue_run(loop, plan, log.records, probe))
    )


def _started(request: Request, prepared: Prepared) -> RunStarted:
    return RunStarted(run_id=request.run_id, snapshot=prepared.snapshot, at=now())


def _identity_plan(
    log: RunLog,
    request: Request,
    prepared: Prepared,
    origin: Origin | None,
    amend: Amendment | None,
) -> tuple[_recovery.Plan, Amended | None]:
    """The log's plan, once its snapshot (as last amended) is known to match this request
    (and agent), or to differ only as ``amend`` accepts; then also the record of the
    amendment to write before anything else (none for a finished run: nothing more
    runs, and nothing may follow its end)."""
    plan = _recovery.read_plan(log)
    assert plan.started is not None  # a log with records starts with its start record
    differences = _recovery.identity_differences(plan.snapshot, prepared.snapshot)
    if origin is not None and (agent := origin.differences(plan.started)):
        raise RunIdentityMismatch(
            run_id=request.run_id, differences=tuple(sorted(differences + agent))
        )
    amended = _amending.amended(plan, prepared.snapshot, differences, amend, request.run_id)
    if amended is None or plan.state is _recovery.RecoveryState.FINISHED:
        return plan, None
    applied = _recovery.amended_snapshot(plan.snapshot, amended.changes)
    return dataclasses.replace(
        plan, snapshot=applied, amendments=(*plan.amendments, amended)
    ), amended


async def _release(store: Store, request: Request) -> None:
    """Give up the claim, shielded and bounded by the request's grace; never raise.

    After ``end_run`` there is nothing left to give up. A failed release leaves the
    claim with this store object until it is closed, which is safe: it only keeps out
    other writers.
    """
    with anyio.move_on_after(request.cancel_grace_s, shield=True):
        try:
            await store.release_run(request.run_id)
        except Exception:
            logger.exception("run %r: could not give up the claim", request.run_id)


async def status(store: ManagedStore, run_id: str) -> RunStatus:
    """The status of ``run_id`` in ``store``; ``RunNotFound`` if it has no record."""
    stored = await store.describe_run(run_id)
    plan = _recovery.read_plan(await store.read_log(run_id))
    if plan.started is None:
        raise RunNotFound("the store holds no record of this run", run_id=run_id)
    return _recovery.status(plan, stored)


async def recover(
    definition: Definition,
    store: ManagedStore,
    request_for: RequestFor,
    *,
    max_concurrent: int,
    amend: Amendment | None = None,
) -> tuple[RecoveredRun, ...]:
    """Resume every unfinished run that no live writer holds (with ``amend``, if given);
    say what became of each."""
    if (
        isinstance(max_concurrent, bool)
        or not isinstance(max_concurrent, int)
        or max_concurrent < 1
    ):
        raise InvalidRequest(
            f"max_concurrent must be a whole number of at least 1, not {max_concurrent!r}"
        )
    listed = await store.list_runs(unfinished_only=True)
    outcomes: dict[str, RecoveredRun] = {}
    waiting = [run for run in listed if not _owned(run, outcomes)]
    waiting.reverse()  # popped from the end, so the runs are taken in listed order

    async def worker() -> None:
        while waiting:
            run_id = waiting.pop().run_id
            outcomes[run_id] = await _recover_one(definition, request_for, run_id, amend)

    async with anyio.create_task_group() as group:
        for _ in range(min(max_concurrent, len(waiting))):
            group.start_soon(worker)
    return tuple(outcomes[run.run_id] for run in listed)


def _owned(run: StoredRun, outcomes: dict[str, RecoveredRun]) -> bool:
    """Whether a live writer holds ``run``; if so its outcome says so, untouched."""
    if not run.claimed:
        return False
    outcomes[run.run_id] = RecoveredRun(
        run_id=run.run_id,
        error=RunLocked("a live writer holds this run; left alone", run_id=run.run_id),
    )
    return True


async def _recover_one(
    definition: Definition, request_for: RequestFor, run_id: str, amend: Amendment | None
) -> RecoveredRun:
    try:
        request = request_for(run_id)
        if inspect.isawaitable(request):
            request = await request
        if request.run_id != run_id:
            raise InvalidRequest(
                f"request_for returned a request for run {request.run_id!r}", run_id=run_id
            )
        result = await drive(definition, request, Mode.RESUME, amend=amend)
    except Exception as exc:  # noqa: BLE001 - each run's failure is reported, not raised
        return RecoveredRun(run_id=run_id, error=exc)
    return RecoveredRun(run_id=run_id, result=result)
