"""``run`` and ``resume``: the two coroutines that drive a run, and what they take.

A :class:`Definition` holds what stays the same across runs (model client, interpreter,
store, event sink, the texts the library shows the model); a :class:`Request` holds what
one run needs (id, budget, executor, tools, context, injection, binding and policies).

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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyloop import _recovery
from polyloop.ports import ActionExecutor, EventSink, Interpreter, ModelClient, Store
from polyloop.session._claims import _driving
from polyloop.session._loop import _Loop
from polyloop.session._request import _prepare
from polyloop.tools import ToolRegistry
from polyloop.types import (
    Budget,
    Injection,
    JSONValue,
    Message,
    Replay,
    RunAlreadyExists,
    RunIdentityMismatch,
    RunNotFound,
    RunResult,
    RunStarted,
    ToolStyle,
)

__all__ = ("Definition", "ObservationTexts", "Request", "resume", "run")


@dataclass(frozen=True, slots=True, kw_only=True)
class ObservationTexts:
    """The texts the library feeds back when an action was refused or the environment failed.

    ``not_executed`` must contain ``{reason}`` and ``env_fault`` must contain ``{detail}``.
    The model sees them, so they are part of every run's snapshot.
    """

    not_executed: str
    env_fault: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Definition:
    """What stays the same across runs; safe to share between concurrent runs."""

    model: ModelClient
    interpreter: Interpreter
    store: Store
    events: EventSink
    texts: ObservationTexts

    def parameters(self) -> dict[str, JSONValue]:
        """The reproducibility parameters of the four seams and the texts, namespaced."""
        merged: dict[str, JSONValue] = {}
        seams: tuple[tuple[str, Any], ...] = (
            ("model", self.model),
            ("interpreter", self.interpreter),
            ("store", self.store),
            ("events", self.events),
        )
        for prefix, seam in seams:
            for key, value in seam.parameters().items():
                merged[f"{prefix}.{key}"] = value
        merged["texts.not_executed"] = self.texts.not_executed
        merged["texts.env_fault"] = self.texts.env_fault
        return merged


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """Everything one run needs. No field has a default; building one does no work."""

    run_id: str
    budget: Budget
    executor: ActionExecutor
    tools: ToolRegistry
    run_context: tuple[Message, ...]
    goal_context: tuple[Message, ...]
    injection: Injection
    binding: Mapping[str, str]
    model_replay: Replay
    observation_template: str
    tool_style: ToolStyle
    cancel_grace_s: float


async def run(definition: Definition, request: Request) -> RunResult:
    """Start the run ``request.run_id`` and drive it until it stops.

    Raises :class:`~polyloop.types.InvalidRequest` before any I/O for a request that
    cannot run, :class:`~polyloop.types.RunAlreadyExists` if the store has any record
    of the run, :class:`~polyloop.types.StoreError` if the store fails (nothing more is
    written then). Every other outcome, failures of the model or the environment
    included, is a :class:`~polyloop.types.RunResult` with its stop reason, and the
    store holds the run's end record before this returns.

    Cancellation: the run's end record (``CANCELLED``) is written under a shielded scope
    bounded by ``request.cancel_grace_s``, then the cancellation propagates. What is on
    disk is every record written before the cancellation plus, if the grace sufficed,
    that end record; an intent whose effect was interrupted stays open, and ``resume``
    treats it by its replay policy. A run cancelled before the store took its start
    record leaves nothing at all (no end record either), and ``resume`` raises
    :class:`~polyloop.types.RunNotFound` for it.
    """
    snapshot = _prepare(definition, request)
    with _driving(definition.store, request.run_id):
        log = await definition.store.read_log(request.run_id)
        if log.records:
            raise RunAlreadyExists(
                "the store already holds records for this run; use resume",
                run_id=request.run_id,
            )
        loop = _Loop(definition, request, resumed=False)
        return await loop.guarded(loop.start(RunStarted(run_id=request.run_id,
                                                        snapshot=snapshot)))


async def resume(definition: Definition, request: Request) -> RunResult:
    """Continue the run ``request.run_id`` from its log, or return how it ended.

    The request must build the same snapshot as the one the run started with
    (:class:`~polyloop.types.RunIdentityMismatch` lists every differing key, and nothing
    is written). A finished run returns its recorded result and writes nothing. A run
    whose interrupted effect may not be repeated ends ``IN_DOUBT``. Otherwise finished
    steps are read from the log, never recomputed, and the run goes on.

    Cancellation: as for :func:`run`: a ``CANCELLED`` end record is written within the
    grace, and the run can be resumed again later.
    """
    snapshot = _prepare(definition, request)
    with _driving(definition.store, request.run_id):
        log = await definition.store.read_log(request.run_id)
        plan = _recovery.read_plan(log)
        if plan.started is None:
            raise RunNotFound("the store holds no record of this run", run_id=request.run_id)
        differences = _recovery.identity_differences(plan.started.snapshot, snapshot)
        if differences:
            raise RunIdentityMismatch(run_id=request.run_id, differences=differences)
        if plan.state is _recovery.RecoveryState.FINISHED:
            return _recovery.recorded_result(plan)
        loop = _Loop(definition, request, resumed=True)
        return await loop.guarded(loop.continue_from(plan))
