"""``run`` and ``resume``: the two coroutines that drive a run, and what they take.

A :class:`Definition` holds what stays the same across runs (model client, interpreter,
store, event sink, the texts the library shows the model); a :class:`Request` holds what
one run needs (id, budget, executor, tools, context, injection, binding and policies).
:func:`start_or_resume` is the one call a worker needs; an :class:`Agent` pairs a
definition with the way to build a run's request from its input, so that any host can
drive a run another process started, and :func:`serve_agents` is such a host.
:func:`run_status` and :func:`recover` serve the programs that watch and sweep a store;
:func:`approve`, :func:`reject`, :func:`settle` and :func:`cancel` are a person's answers.

Before anything is read, the store object claims the run: it becomes the run's one
writer, and keeps the claim until the run's end record is written or the call returns.

One step, as the library performs it::

    stop check (steps, valid steps, context size)
    1. write the model-call intent      (durable before the model is called)
       call the model
    2. write the model result
       interpret the reply
    3. write the action intent          (durable before the action runs; actions only)
       run the action
    4. write the step record together with the action result
    stop check (model failure, environment fault, done, submitted, final answer)

Every return is preceded by an end record in the store; a cancelled run writes one too,
under a shielded and time-bounded scope, and then lets the cancellation go on.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import anyio

from polyloop.ports import ManagedStore, Store
from polyloop.session import _cancelling, _review
from polyloop.session._agents import Agent
from polyloop.session._driving import Mode, drive, status
from polyloop.session._driving import recover as recover_runs
from polyloop.session._following import follow
from polyloop.session._forking import check_fork, read_inheritance
from polyloop.session._hosting import Agents, Host, hosted_stores, watching
from polyloop.session._values import Definition, ObservationTexts, Request
from polyloop.types import (
    Amendment,
    InvalidRequest,
    JSONValue,
    RecoveredRun,
    RunResult,
    RunStatus,
    Settlement,
    Verdict,
)

__all__ = (
    "Agent",
    "Definition",
    "ObservationTexts",
    "Request",
    "approve",
    "cancel",
    "follow",
    "fork",
    "recover",
    "reject",
    "resume",
    "run",
    "run_status",
    "serve_agents",
    "settle",
    "start_or_resume",
)


def _claim_public_home() -> None:
    # The values are defined in a private module so that the loop can import them; their
    # public home is here, and reprs, pickles and docs should say so.
    for cls in (Agent, Definition, ObservationTexts, Request):
        cls.__module__ = __name__


_claim_public_home()


async def run(definition: Definition, request: Request) -> RunResult:
    """Start the run ``request.run_id`` and drive it until it stops.

    The store object becomes the run's one writer before anything is read or written:
    :class:`~polyloop.types.RunLocked` if another writer holds the run. Raises
    :class:`~polyloop.types.InvalidRequest` before any I/O for a request that cannot
    run, :class:`~polyloop.types.RunAlreadyExists` if the store has any record of the
    run, :class:`~polyloop.types.StoreError` if the store fails (nothing more is written
    then). Every other outcome, failures of the model or the environment included, is a
    :class:`~polyloop.types.RunResult` with its stop reason, and the store holds the
    run's end record before this returns. The claim is given up on every way out.

    Cancellation: the run's end record (``CANCELLED``) is written under a shielded scope
    bounded by ``request.cancel_grace_s``, then the cancellation propagates. What is on
    disk is every record written before the cancellation plus, if the grace sufficed,
    that end record; an intent whose effect was interrupted stays open, and ``resume``
    treats it by its replay policy. A run cancelled before the store took its start
    record leaves nothing at all (no end record either), and ``resume`` raises
    :class:`~polyloop.types.RunNotFound` for it.
    """
    return await drive(definition, request, Mode.START)


async def resume(
    definition: Definition, request: Request, *, amend: Amendment | None = None
) -> RunResult:
    """Continue the run ``request.run_id`` from its log, or return how it ended.

    The store object becomes the run's one writer first (:class:`~polyloop.types.RunLocked`
    if a live writer holds it: nothing is read, decided or executed then), and every
    decision comes from the log read under that claim. The request must build the same
    snapshot as the one the run started with (:class:`~polyloop.types.RunIdentityMismatch`
    lists every differing key, and nothing is written). A finished run returns its
    recorded result and writes nothing. A run whose interrupted effect may not be
    repeated ends ``IN_DOUBT``, unless its tool's probe settles it first
    (:attr:`ToolSpec.reconcile <polyloop.tools.ToolSpec>`). Otherwise finished steps
    are read from the log, never recomputed, and the run goes on.

    ``amend`` (an :class:`~polyloop.types.Amendment`) lets the run go on under a
    snapshot that differs from the one it holds, when every difference is one it
    accepts: before anything else, one :class:`~polyloop.types.Amended` record is
    written (who, why, at which step, each key's recorded and new value), and a later
    resume compares with the amended snapshot. A key that may never change, or a change
    to the tool of an open intent or of a waiting proposal, is refused with
    :class:`~polyloop.types.AmendmentRefused` (nothing written); a difference it does
    not accept, with ``RunIdentityMismatch`` as without it. Where nothing differs, or
    the run has finished, nothing is written.

    Cancellation: as for :func:`run`: a ``CANCELLED`` end record is written within the
    grace, and the run can be resumed again later. The amendment record landed whole
    or not at all.
    """
    return await drive(definition, request, Mode.RESUME, amend=amend)


async def start_or_resume(
    definition: Definition, request: Request, *, amend: Amendment | None = None
) -> RunResult:
    """Start the run if the store has no record of it, else resume it.

    One claim and one read decide which, so a worker needs no
    ``RunAlreadyExists``/``RunNotFound`` juggling. ``RunResult.resumed`` says which it
    was. Raises what :func:`run` and :func:`resume` raise, except those two. ``amend``
    is as for :func:`resume` (a new run has nothing to amend).

    Cancellation: as for :func:`run`.
    """
    return await drive(definition, request, Mode.EITHER, amend=amend)


async def fork(
    definition: Definition, request: Request, *, source_run_id: str, at_step: int
) -> RunResult:
    """Start the run ``request.run_id`` from the first ``at_step`` completed steps of the
    run ``source_run_id`` in ``definition.store``, and drive it until it stops.

    The fork is a run of its own: its own start record and snapshot (its model,
    injection, budgets and tools may differ from the source's), which also names the
    source, the step and the SHA-256 of what it took over, and holds copies of the
    inherited steps, so that it needs nothing of the source afterwards. Nothing of the
    inherited steps runs again: no model call, no action, whatever its replay policy.
    The first model call sends what this request would have sent after those steps
    (the same messages as the source's call at ``at_step`` when the definition and the
    request are the ones the source held there: before an amendment of the source, the
    ones it was started with; after it, the amended ones). Budgets count the inherited
    steps as the fork's own. The source is read, never claimed, and may be running,
    finished, in doubt or waiting: only its completed steps can be inherited.

    The start record of a fork that inherits steps also holds the snapshot the source
    held at ``at_step`` (``inherited_snapshot``: its start record's with its amendments
    up to that step applied), so that ``show`` says how the fork differs from it. The
    fork may differ from it in anything but what says how its inherited steps read back
    to the model (``observation_template``, ``tool_style``):
    :class:`~polyloop.types.RunIdentityMismatch` naming those keys, nothing written.

    Raises :class:`~polyloop.types.InvalidRequest` before any I/O for a bad request or
    ``at_step``, and naming both numbers when the source has fewer completed steps than
    ``at_step``; :class:`~polyloop.types.RunNotFound` (naming the source) if the store
    has no record of the source; ``RunIdentityMismatch`` as above; then what :func:`run` raises
    (:class:`~polyloop.types.RunAlreadyExists` if ``request.run_id`` has records).
    After a crash, :func:`resume` continues a fork like any run.

    Cancellation: as for :func:`run`. A fork cancelled before its start record landed
    leaves nothing; once it has, the start record holds every inherited step.
    """
    check_fork(request.run_id, source_run_id, at_step)
    return await drive(
        definition,
        request,
        Mode.START,
        lambda: read_inheritance(definition.store, request.run_id, source_run_id, at_step),
    )


async def run_status(store: ManagedStore, run_id: str) -> RunStatus:
    """Where the run ``run_id`` of ``store`` stands, without driving it.

    ``RUNNING`` means a live writer holds the run's claim now; a run nobody holds is
    ``RESUMABLE``, ``IN_DOUBT`` or ``FINISHED`` by its log. Raises
    :class:`~polyloop.types.RunNotFound` if the store has no record of the run and
    :class:`~polyloop.types.CorruptLog` if its records cannot follow each other.

    Cancellation: nothing is written; a cancelled call leaves the store as it was.
    """
    return await status(store, run_id)


async def recover(
    definition: Definition,
    store: ManagedStore,
    request_for: Callable[[str], Request | Awaitable[Request]],
    *,
    max_concurrent: int,
    amend: Amendment | None = None,
) -> tuple[RecoveredRun, ...]:
    """Resume every unfinished run of ``store`` that no live writer holds.

    Meant for a worker process at start-up or on a timer. The runs without a final end
    record are listed; those a live writer holds are left alone (their outcome is a
    :class:`~polyloop.types.RunLocked`); each other one gets its request from
    ``request_for(run_id)`` (a function or a coroutine function) and is resumed through
    ``definition``, at most ``max_concurrent`` at once. A run claimed by another worker
    in the meantime is refused ``RunLocked`` before anything is read or run, so two
    workers recovering at once never drive the same run. ``store`` is the store
    ``definition.store`` writes to (usually the same object).

    Returns one :class:`~polyloop.types.RecoveredRun` per listed run, in listing order:
    its result, or the exception that building its request or resuming it raised.
    ``amend`` is given to each resume, as for :func:`resume`.

    Cancellation: the runs being resumed are cancelled as :func:`resume` describes
    (each writes its ``CANCELLED`` end record within its grace); the cancellation then
    propagates and no report is returned.
    """
    return await recover_runs(
        definition, store, request_for, max_concurrent=max_concurrent, amend=amend
    )


async def approve(
    store: Store,
    run_id: str,
    *,
    by: str,
    arguments: JSONValue = None,
    result_id: str | None = None,
) -> Verdict:
    """Approve the action the run ``run_id`` waits on; ``resume`` then runs it.

    ``by`` names the person approving. ``arguments``, if given, replace the arguments
    the model proposed; they are checked against the tool's schema as the run's snapshot
    recorded it (:class:`~polyloop.types.InvalidRequest` if they do not fit). The run's
    claim is taken first (:class:`~polyloop.types.RunLocked` if a worker or another
    person holds it) and the :class:`~polyloop.types.Verdict` is written durably under
    it. :class:`~polyloop.types.NotAwaitingApproval` if the run waits for no approval
    (never asked for one, or was already answered), :class:`~polyloop.types.RunNotFound`
    if the store has no record of it. ``result_id``, if given, must name the open
    proposal: it is checked under the claim, in the same step as the write, so an answer
    never lands on a proposal the person did not see (``NotAwaitingApproval`` if that
    proposal is no longer open). Surfaces that show a proposal to a person always pass
    it. A refused call writes nothing. Returns the verdict.

    Cancellation: the verdict landed whole or not at all (``run_status`` tells which);
    the claim is given up under a shielded, time-bounded scope either way.
    """
    return await _review.approve(store, run_id, by=by, arguments=arguments, result_id=result_id)


async def reject(
    store: Store, run_id: str, *, by: str, reason: str, result_id: str | None = None
) -> Verdict:
    """Reject the action the run ``run_id`` waits on; ``resume`` then goes on without it.

    The model is told the action was not executed, with ``reason`` (through the
    definition's ``texts.not_executed``); the step does not count as a valid step. The
    rest, ``result_id`` included, is as for :func:`approve`.

    Cancellation: as for :func:`approve`.
    """
    return await _review.reject(store, run_id, by=by, reason=reason, result_id=result_id)


async def settle(
    store: Store,
    run_id: str,
    *,
    by: str,
    ran: bool,
    observation: str,
    result_id: str | None = None,
) -> Settlement:
    """Say what became of the action or model call the run ``run_id`` is in doubt about.

    For an action: with ``ran=True`` the action ran and ``observation`` is what the
    model is shown as its output (a valid step); with ``ran=False`` it did not run and
    ``observation`` is the reason the model is told (through ``texts.not_executed``).
    ``resume`` then goes on exactly as if the action had ended that way, and the step
    record names ``by``.

    For a model call (its replay is ``NEVER``): ``ran=False`` says it may be made again
    (it never reached the model, or a second charge is acceptable); ``resume`` then
    calls the model again as a new call, with an intent and a result id of its own
    (``<run_id>:<step>:model2`` for the second), and goes on. ``ran=True`` says it ran
    but its reply is not on record: the run can neither go on from it nor call again,
    so ``resume`` ends it ``MODEL_FAILURE``, the detail naming the call and ``by``.
    ``observation`` is kept in the settlement (and, for ``ran=True``, in that detail).

    ``result_id``, if given, must name the intent in doubt: it is checked under the
    claim, in the same step as the write. The run's claim is taken first
    (:class:`~polyloop.types.RunLocked` if anyone holds it) and the
    :class:`~polyloop.types.Settlement` is written durably under it.
    :class:`~polyloop.types.NotInDoubt` if the run is not in doubt (already settled,
    never in doubt, or ``result_id`` names another intent, one no longer open),
    :class:`~polyloop.types.RunNotFound` if the store has no record of it. A refused call
    writes nothing. Returns the settlement.

    Cancellation: the settlement landed whole or not at all (``run_status`` tells
    which); the claim is given up under a shielded, time-bounded scope either way.
    """
    return await _review.settle(
        store, run_id, by=by, ran=ran, observation=observation, result_id=result_id
    )


async def cancel(
    store: ManagedStore, run_id: str, *, by: str, reason: str, result_id: str | None = None
) -> RunStatus:
    """Ask the run ``run_id`` to stop for good: nothing it has not announced yet runs.

    ``by`` names who asks and ``reason`` says why (non-empty strings, else
    :class:`~polyloop.types.InvalidRequest` before any I/O);
    :class:`~polyloop.types.RunNotFound` if the store has no record of the run. A
    finished run is left as it is and its status returned: nothing is written.

    Otherwise a :class:`~polyloop.types.CancelRequest` is kept beside the run's log,
    durably and without the run's claim. From then on the store refuses every intent and
    proposal of the run, in this process and every other, so no model call, action or
    proposal starts; an effect already running finishes and its step is recorded. The
    run then ends ``CANCELLED_BY_REQUEST``, its end record naming ``by``
    (``cancelled_by``) and ``reason`` (``detail``), and that end is final: no worker and
    no ``resume`` drives it again, and ``run_status`` says ``FINISHED``. If nobody drives
    the run (it waits for a person, was left by a stopped process, or is idle), this
    takes its claim and writes that end record itself; if a live writer drives it, the
    writer ends it at its next intent or proposal, and a run left unended (its writer
    stopped before another intent) ends when a host or ``resume`` next claims it, before
    any probe or effect. A second request changes nothing: a run keeps its first.
    ``approve``, ``reject`` and ``settle`` refuse an answer for the run
    (:class:`~polyloop.types.CancelRequested`) from then on; a tool's probe may still
    settle an effect in doubt.

    ``result_id``, if given, must name what the person saw the run wait on: its open
    proposal or its open intent. It is checked under the run's claim before anything is
    written; a cancel naming one that is no longer open is refused and writes nothing
    (:class:`~polyloop.types.NotAwaitingApproval` or
    :class:`~polyloop.types.NotInDoubt`), and so is one for a run a live writer drives
    (:class:`~polyloop.types.RunLocked`): it no longer waits on what the person saw.

    Returns the run's status once the request is kept: ``FINISHED`` with stop reason
    ``CANCELLED_BY_REQUEST`` if the run ended here, or its current state (``RUNNING``,
    say) if its writer will end it.

    Cancellation: the request and the end record each landed whole or not at all, the
    request first; a request without its end is ended by the run's next writer. The
    claim, if taken, is given up under a shielded, time-bounded scope.
    """
    await _cancelling.cancel(store, run_id, by=by, reason=reason, result_id=result_id)
    return await status(store, run_id)


async def serve_agents(
    agents: Agents,
    *,
    concurrency: int,
    poll_s: float = 0.5,
    stop: Callable[[], Awaitable[object]] | None = None,
    drain_grace_s: float = 30.0,
) -> None:
    """Host ``agents``: drive every run of theirs that can go on, until ``stop()`` returns.

    ``agents`` is an :class:`Agent`, a sequence of them or a mapping whose values they
    are (names must differ). Each agent's store (its ``status_store``, else its
    definition's) is listed every ``poll_s`` seconds, unfinished runs only; a run's log
    is read only when the listing says it changed. When every such store is a
    :class:`~polyloop.ports.ChangeFeed` (``PostgresStore`` is), they are listed as soon
    as one says a run may go on, and every 5 seconds (or ``poll_s``, if longer) besides,
    for the leases that run out. A run is driven when its start record
    names a hosted agent and nothing but a host is missing: it was started
    (:meth:`Agent.start`) and never driven, a person approved, rejected or settled what
    it waited on, its tool's probe can settle its doubt, it was cancelled, or the
    process driving it stopped (a run whose claim a live writer holds is left to it).
    Runs of other agents, runs started without an agent and runs waiting for a person
    are never claimed. At most ``concurrency`` runs are driven at once, each through
    the kernel's claim, so no run is driven by two hosts.

    A run whose identity no longer matches its agent's request, or whose request cannot
    be built, is reported once and left alone until its log changes. Every run it starts
    driving, that stops, or that it leaves waiting gets one log record on the
    ``polyloop.worker`` logger; its ``polyloop_worker`` attribute holds the facts as a
    dictionary (``event``, ``run_id``, ``message`` and more).

    When ``stop()`` returns (``stop=event.wait``, say), nothing new is claimed, each run
    being driven stops at its next step boundary, before its next model call, with a
    ``CANCELLED`` end record (a running tool finishes and its step is recorded), and
    this returns once they have; whatever still runs after ``drain_grace_s`` seconds is
    cancelled. Without ``stop``, it serves until cancelled. Raises
    :class:`~polyloop.types.InvalidRequest` for arguments it cannot serve with.

    Cancellation: every run being driven is cancelled as :func:`run` describes: its
    ``CANCELLED`` end record is written within its request's ``cancel_grace_s`` and its
    claim is given up; what a tool had not finished stays an open intent. On disk, each
    run is then resumable by any host (or in doubt, for an interrupted tool whose replay
    is never allowed); runs not yet claimed are untouched.
    """
    hosted = hosted_stores(agents)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidRequest(
            f"concurrency must be a whole number of at least 1, not {concurrency!r}"
        )
    for name, value in (("poll_s", poll_s), ("drain_grace_s", drain_grace_s)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidRequest(f"{name} must be a number of seconds, not {value!r}")
    if poll_s <= 0:
        raise InvalidRequest(f"poll_s must be more than 0, not {poll_s!r}")

    async with watching(hosted, poll_s=poll_s) as wait_for_change:
        host = Host(
            hosted,
            concurrency=concurrency,
            wait_for_change=wait_for_change,
            drain_grace_s=drain_grace_s,
        )
        await host.serve(stop if stop is not None else anyio.sleep_forever)
