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

import functools
import hashlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from polyloop import _assembly, _recovery, _stopping, serialization
from polyloop.ports import (
    Action,
    ActionExecutor,
    ActionOutcome,
    Event,
    EventKind,
    EventSink,
    FinalAnswer,
    Interpreter,
    InvalidDecision,
    ModelCall,
    ModelClient,
    ModelReply,
    NullSink,
    Store,
)
from polyloop.tools import ToolRegistry
from polyloop.types import (
    ActionStatus,
    Budget,
    CorruptLog,
    DecisionKind,
    Injection,
    Intent,
    IntentKind,
    InvalidRequest,
    JSONValue,
    Message,
    Record,
    Replay,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunIdentityMismatch,
    RunLocked,
    RunNotFound,
    RunResult,
    RunStarted,
    StepRecord,
    StopReason,
    ToolStyle,
    UnloggableValue,
)

__all__ = ("Definition", "ObservationTexts", "Request", "resume", "run")

logger = logging.getLogger("polyloop")

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


class _Loop:
    """The state of one run while it is driven: its steps, counters and transcript."""

    def __init__(self, definition: Definition, request: Request, *, resumed: bool) -> None:
        self.definition = definition
        self.request = request
        self.store = definition.store
        self.run_id = request.run_id
        self.resumed = resumed
        self.steps: list[StepRecord] = []
        self.used = _stopping.Counters()
        self.event_failures = 0
        self.end: RunEnded | None = None
        # False until the store confirms the run's start record: a cancellation before
        # then may leave no record of the run, and so nothing for an end record to end.
        self.start_confirmed = resumed
        self.transcript = _assembly.Transcript(_prefix(request))
        self.silent = _discards(definition.events)

    # -- driving ------------------------------------------------------------------------

    async def guarded(self, body: Any) -> RunResult:
        """Await ``body``; on cancellation write the end record, then re-raise."""
        try:
            await body
        except anyio.get_cancelled_exc_class():
            with anyio.move_on_after(self.request.cancel_grace_s, shield=True):
                await self._end_after_cancel()
            raise
        return self._result()

    async def start(self, started: RunStarted) -> None:
        await self.store.start_run(started)
        self.start_confirmed = True
        await self._emit(EventKind.RUN_STARTED, None, started)
        await self._until_stopped()

    async def continue_from(self, plan: _recovery.Plan) -> None:
        assert plan.started is not None
        for step in plan.steps:
            self._remember(step)
        await self._emit(EventKind.RUN_RESUMED, None, plan.started)
        if plan.state is _recovery.RecoveryState.IN_DOUBT:
            assert plan.open_intent is not None
            await self._finish(StopReason.IN_DOUBT, _recovery.in_doubt_detail(plan.open_intent))
            return
        if plan.model_result is not None or plan.open_intent is not None:
            step, tool = await self._finish_interrupted(plan)
        elif self.steps:
            # The last step landed but the run may not have been ended: decide again.
            step, tool = self.steps[-1], _action_name(plan.last_action)
        else:
            await self._until_stopped()
            return
        reason = self._stop_reason(step, tool)
        if reason is None:
            await self._until_stopped()
        else:
            await self._stop_after(step, reason)

    async def _until_stopped(self) -> None:
        while True:
            reason = _stopping.before_model_call(
                self.request.budget, self.used, self.transcript.size
            )
            if reason is not None:
                await self._finish(reason, self._limit_detail(reason))
                return
            step, tool = await self._step()
            if (reason := self._stop_reason(step, tool)) is not None:
                await self._stop_after(step, reason)
                return

    def _stop_reason(self, step: StepRecord, tool: str | None) -> StopReason | None:
        """Why the run stops after ``step`` (``tool`` names its action's tool), if it does."""
        facts = (
            step.decision,
            step.error is not None,
            step.action_status,
            step.observation_synthesized,
            step.done,
            tool is not None and self.request.tools.marks_completion(tool),
        )
        try:
            return _after_step(*facts)
        except TypeError:  # an unhashable field, in a record some store handed back
            return _after_step.__wrapped__(*facts)

    async def _stop_after(self, step: StepRecord, reason: StopReason) -> None:
        detail = step.error if reason is StopReason.MODEL_FAILURE else None
        if reason is StopReason.ENV_FAILURE:
            detail = step.observation
        await self._finish(reason, detail, final_answer=step.final_answer)

    # -- one step -----------------------------------------------------------------------

    async def _step(self) -> tuple[StepRecord, str | None]:
        index = self.used.steps
        await self.store.write_intent(
            Intent(
                run_id=self.run_id,
                result_id=_recovery.model_result_id(self.run_id, index),
                kind=IntentKind.MODEL_CALL,
                step=index,
                call_index=index,
                replay=self.request.model_replay,
                payload={"messages_sha256": self.transcript.sha256()},
            )
        )
        return await self._call_model(index, time.perf_counter())

    async def _call_model(self, index: int, began: float) -> tuple[StepRecord, str | None]:
        result_id = _recovery.model_result_id(self.run_id, index)
        call = ModelCall(
            messages=self.transcript.messages,
            call_index=index,
            run_id=self.run_id,
            result_id=result_id,
            binding=self.request.binding,
        )
        try:
            reply = _checked_reply(await self.definition.model.call(call))
        except Exception as exc:  # noqa: BLE001 - a failing model ends the run, by contract
            error = _describe(exc)
            await self._write_model_result(result_id, {"error": error})
            return await self._model_failed(index, error, began), None
        await self._write_model_result(result_id, _reply_payload(reply))
        return await self._decide(index, reply, began)

    async def _write_model_result(self, result_id: str, payload: JSONValue) -> None:
        await self.store.write_result(
            Result(
                run_id=self.run_id,
                result_id=result_id,
                kind=IntentKind.MODEL_CALL,
                payload=payload,
            )
        )

    async def _model_failed(self, index: int, error: str, began: float) -> StepRecord:
        step = self._step_record(
            index, None, began, decision=DecisionKind.INVALID, history_text="", error=error
        )
        return await self._record(step, None)

    async def _decide(
        self, index: int, reply: ModelReply, began: float
    ) -> tuple[StepRecord, str | None]:
        decision = self.definition.interpreter.interpret(reply)
        problem = _decision_problem(decision)
        if problem is not None:
            # An interpreter bug, not a model error: stop here, leaving the run resumable
            # (the reply is on record and is interpreted again by a fixed interpreter).
            raise TypeError(f"run {self.run_id!r}: {problem}")
        if isinstance(decision, FinalAnswer):
            step = self._step_record(
                index, reply, began, decision=DecisionKind.FINAL,
                history_text=decision.history_text, final_answer=decision.answer,
            )
            return await self._record(step, None), None
        if isinstance(decision, InvalidDecision):
            step = self._step_record(
                index, reply, began, decision=DecisionKind.INVALID,
                history_text=decision.history_text, observation=decision.feedback,
                observation_synthesized=True,
            )
            return await self._record(step, None), None
        assert isinstance(decision, Action)
        return await self._announce_and_act(index, reply, decision, began)

    async def _announce_and_act(
        self, index: int, reply: ModelReply, action: Action, began: float
    ) -> tuple[StepRecord, str | None]:
        replay = self._replay_policy(action)
        if not isinstance(replay, Replay):
            # The executor could not say whether the action may be repeated, so it cannot
            # be announced: an environment fault, with nothing run and no intent written.
            step = self._acted(index, reply, action, _fault(replay), began)
            return await self._record(step, None), None
        intent = Intent(
            run_id=self.run_id,
            result_id=_recovery.action_result_id(self.run_id, index),
            kind=IntentKind.ACTION,
            step=index,
            call_index=index,
            replay=replay,
            payload=action.payload,
            action_text=action.action_text,
            history_text=action.history_text,
        )
        try:
            # Only the payload can be unloggable: the texts were checked as strings.
            serialization.plain(action.payload, owner="Intent", field="payload",
                                run_id=self.run_id)
        except UnloggableValue as exc:
            # Nothing may run that its intent cannot record; refuse it like a bad call.
            outcome = ActionOutcome(
                status=ActionStatus.NOT_EXECUTED, observation=exc.reason,
                synthesized=True, done=False,
            )
            return await self._record(self._acted(index, reply, action, outcome, began),
                                      None), None
        await self.store.write_intent(intent)
        return await self._act(index, reply, action, began), _action_name(intent)

    def _replay_policy(self, action: Action) -> Replay | str:
        """The executor's replay policy for ``action``, or why there is none."""
        try:
            replay = self.request.executor.replay(action)
        except Exception as exc:  # noqa: BLE001 - the executor's fault, reported as one
            return _describe(exc)
        if not isinstance(replay, Replay):
            kind = type(replay).__name__
            return f"TypeError: the executor's replay() returned {kind}, not Replay"
        return replay

    async def _act(
        self, index: int, reply: ModelReply, action: Action, began: float
    ) -> StepRecord:
        result_id = _recovery.action_result_id(self.run_id, index)
        outcome = await self._execute(action, result_id)
        step = self._acted(index, reply, action, outcome, began)
        result = Result(
            run_id=self.run_id, result_id=result_id, kind=IntentKind.ACTION,
            payload=_outcome_payload(outcome),
        )
        return await self._record(step, result)

    async def _execute(self, action: Action, result_id: str) -> ActionOutcome:
        try:
            outcome = await self.request.executor.execute(action, result_id=result_id)
        except Exception as exc:  # noqa: BLE001 - an escaping exception is an env fault
            return _fault(_describe(exc))
        problem = _outcome_problem(outcome)
        return outcome if problem is None else _fault(f"TypeError: {problem}")

    def _acted(
        self, index: int, reply: ModelReply, action: Action, outcome: ActionOutcome,
        began: float,
    ) -> StepRecord:
        texts = self.definition.texts
        observation, synthesized = outcome.observation, outcome.synthesized
        if outcome.status is ActionStatus.NOT_EXECUTED:
            observation, synthesized = texts.not_executed.format(reason=observation), True
        elif outcome.status is ActionStatus.ENV_FAULT:
            observation, synthesized = texts.env_fault.format(detail=observation), True
        return self._step_record(
            index, reply, began, decision=DecisionKind.ACTION,
            history_text=action.history_text, action_text=action.action_text,
            observation=observation, observation_synthesized=synthesized,
            action_status=outcome.status, done=outcome.done,
            truncated_chars=outcome.truncated_chars,
        )

    def _step_record(
        self, index: int, reply: ModelReply | None, began: float, *,
        decision: DecisionKind, history_text: str, action_text: str | None = None,
        observation: str | None = None, observation_synthesized: bool = False,
        action_status: ActionStatus | None = None, done: bool = False,
        truncated_chars: int = 0, error: str | None = None, final_answer: str | None = None,
    ) -> StepRecord:
        return StepRecord(
            run_id=self.run_id,
            step=index,
            call_id=reply.call_id if reply else None,
            model_output=reply.content if reply else "",
            reasoning=reply.reasoning if reply else None,
            decision=decision,
            history_text=history_text,
            action_text=action_text,
            observation=observation,
            observation_synthesized=observation_synthesized,
            action_status=action_status,
            done=done,
            truncated_chars=truncated_chars,
            error=error,
            final_answer=final_answer,
            duration_s=time.perf_counter() - began,
        )

    async def _record(self, step: StepRecord, action_result: Result | None) -> StepRecord:
        await self.store.write_step(step, action_result)
        self._remember(step)
        await self._emit(EventKind.STEP_FINISHED, step.step, step)
        return step

    def _remember(self, step: StepRecord) -> None:
        self.steps.append(step)
        self.used = _stopping.settle(self.used, step.action_status)
        self.transcript.extend(
            _assembly.step_messages(
                step.history_text, step.observation, self.request.observation_template
            )
        )

    # -- the step a crash interrupted ---------------------------------------------------

    async def _finish_interrupted(self, plan: _recovery.Plan) -> tuple[StepRecord, str | None]:
        index, began = len(self.steps), time.perf_counter()
        intent = plan.open_intent
        if plan.model_result is None:
            # The model call was announced and its result lost; its replay is allowed,
            # and it reuses the intent on disk rather than writing a second one.
            return await self._call_model(index, began)
        payload = plan.model_result.payload
        if isinstance(payload, dict) and "error" in payload:
            return await self._model_failed(index, str(payload["error"]), began), None
        reply = _reply_from(payload, self.run_id, plan.model_result.result_id)
        if intent is None:
            # No action was announced, so nothing has happened yet: interpret again.
            return await self._decide(index, reply, began)
        # The action was announced: replay exactly the recorded action, whatever the
        # interpreter would say today.
        action = Action(
            payload=intent.payload,
            action_text=intent.action_text or "",
            history_text=intent.history_text or "",
        )
        return await self._act(index, reply, action, began), _action_name(intent)

    # -- ending ------------------------------------------------------------------------

    async def _finish(
        self, reason: StopReason, detail: str | None, *, final_answer: str | None = None
    ) -> None:
        end = RunEnded(
            run_id=self.run_id,
            stop_reason=reason,
            final_answer=final_answer if reason is StopReason.FINAL_ANSWER else None,
            steps=self.used.steps,
            valid_steps=self.used.valid_steps,
            detail=detail,
        )
        await self.store.end_run(end)
        self.end = end
        await self._emit(EventKind.RUN_ENDED, None, end)

    async def _end_after_cancel(self) -> None:
        try:
            if not self.start_confirmed and not await self._start_landed():
                # Cancelled before the start record landed: the store holds nothing of
                # the run, so there is nothing to end (and resume says RunNotFound).
                return
            await self._finish(StopReason.CANCELLED, "the run was cancelled")
        except Exception:
            # The cancellation must go on whatever the store says; the log then ends
            # without an end record, which resume handles like a crash.
            logger.exception("run %r: could not write the cancelled end record", self.run_id)

    async def _start_landed(self) -> bool:
        """Whether the store holds the run's start, after a cancelled ``start_run``.

        A store may finish a start it had begun before delivering the cancellation (the
        durable stores do), so only the log can tell.
        """
        log = await self.store.read_log(self.run_id)
        return bool(log.records)

    def _limit_detail(self, reason: StopReason) -> str | None:
        budget = self.request.budget
        if reason is StopReason.CONTEXT_LIMIT:
            return (f"the context holds {self.transcript.size} characters, more than "
                    f"max_context_chars={budget.max_context_chars}")
        if reason is StopReason.STEP_LIMIT:
            return f"max_steps={budget.max_steps} reached"
        return f"max_valid_steps={budget.max_valid_steps} reached"

    def _result(self) -> RunResult:
        end = self.end
        if end is None:  # pragma: no cover - every path through the loop ends the run
            raise AssertionError(f"run {self.run_id!r} returned without an end record")
        return RunResult(
            run_id=self.run_id,
            stop_reason=end.stop_reason,
            final_answer=end.final_answer,
            steps=tuple(self.steps),
            step_count=self.used.steps,
            valid_step_count=self.used.valid_steps,
            resumed=self.resumed,
            event_failures=self.event_failures,
            detail=end.detail,
        )

    async def _emit(self, kind: EventKind, step: int | None, record: Record) -> None:
        if self.silent:
            return
        event = Event(kind=kind, run_id=self.run_id, step=step, record=record)
        try:
            await self.definition.events.emit(event)
        except Exception:
            # Counted and logged, never reported through the sink that just failed.
            self.event_failures += 1
            logger.exception("run %r: the event sink failed on %s", self.run_id, kind.value)


# -- request checks, snapshot and small helpers --------------------------------------------


@functools.lru_cache(maxsize=512, typed=True)
def _after_step(
    decision: DecisionKind, model_failed: bool, action_status: ActionStatus | None,
    synthesized: bool, done: bool, completes: bool,
) -> StopReason | None:
    """:func:`_stopping.after_step` over the facts of a step, memoized.

    A pure function of a few enums and flags, so every step but the first few finds its
    answer here instead of building a StepFacts value. ``typed`` keeps apart arguments
    that are equal but not the same (``1`` and ``True``, a string and its enum member).
    """
    return _stopping.after_step(_stopping.StepFacts(
        decision=decision, model_failed=model_failed, action_status=action_status,
        synthesized=synthesized, done=done, completes=completes,
    ))


def _prepare(definition: Definition, request: Request) -> dict[str, JSONValue]:
    """Check the request and build its snapshot; raise ``InvalidRequest`` on any problem."""
    run_id = request.run_id if isinstance(request.run_id, str) else None
    problems = _problems(definition, request)
    if problems:
        raise InvalidRequest("; ".join(problems), run_id=run_id)
    snapshot = {**definition.parameters(), **_request_parameters(request)}
    try:
        encoded = serialization.encode(RunStarted(run_id=request.run_id, snapshot=snapshot))
    except UnloggableValue as exc:
        raise InvalidRequest(f"the snapshot cannot be recorded: {exc.reason}",
                             run_id=run_id) from exc
    plain = encoded["snapshot"]
    assert isinstance(plain, dict)
    return plain


def _problems(definition: Definition, request: Request) -> list[str]:
    problems: list[str] = []
    if not isinstance(request.run_id, str) or not request.run_id:
        problems.append("run_id must be a non-empty string")
    problems += _budget_problems(request.budget)
    problems += _template_problems("observation_template", request.observation_template,
                                   "observation")
    problems += _template_problems("texts.not_executed", definition.texts.not_executed, "reason")
    problems += _template_problems("texts.env_fault", definition.texts.env_fault, "detail")
    problems += _shape_problems(request)
    return problems


def _budget_problems(budget: Budget) -> list[str]:
    if not isinstance(budget, Budget):
        return [f"budget must be a Budget, not {type(budget).__name__}"]
    return [
        f"budget.{name} must be an integer of at least 1, not {value!r}"
        for name in ("max_steps", "max_valid_steps", "max_context_chars")
        if not _positive_int(value := getattr(budget, name))
    ]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _template_problems(name: str, template: object, placeholder: str) -> list[str]:
    if not isinstance(template, str) or f"{{{placeholder}}}" not in template:
        return [f"{name} must be a string containing {{{placeholder}}}"]
    try:
        template.format(**{placeholder: ""})
    except (KeyError, IndexError, ValueError) as exc:
        return [f"{name} cannot be filled with only {{{placeholder}}}: {exc!r}"]
    return []


def _shape_problems(request: Request) -> list[str]:
    problems = []
    if not isinstance(request.tools, ToolRegistry):
        problems.append("tools must be a ToolRegistry")
    for name in ("run_context", "goal_context"):
        value = getattr(request, name)
        if not isinstance(value, tuple) or not all(isinstance(m, Message) for m in value):
            problems.append(f"{name} must be a tuple of Message")
    injection = request.injection
    if not isinstance(injection, Injection):
        problems.append("injection must be an Injection")
    else:
        if unknown := _assembly.unknown_channels(injection):
            problems.append(f"injection channels {list(unknown)} are not read (only 'system')")
        if not all(isinstance(e, str) for v in injection.entries.values() for e in v):
            problems.append("injection entries must be strings")
    if not isinstance(request.binding, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in request.binding.items()
    ):
        problems.append("binding must map strings to strings")
    if not isinstance(request.model_replay, Replay):
        problems.append("model_replay must be a Replay")
    if not isinstance(request.tool_style, ToolStyle):
        problems.append("tool_style must be a ToolStyle")
    grace = request.cancel_grace_s
    if not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace < 0:
        problems.append("cancel_grace_s must be a finite number of seconds, at least 0")
    return problems


def _request_parameters(request: Request) -> dict[str, JSONValue]:
    budget = request.budget
    injection = {k: list(v) for k, v in sorted(request.injection.entries.items())}
    params: dict[str, JSONValue] = {
        "budget.max_steps": budget.max_steps,
        "budget.max_valid_steps": budget.max_valid_steps,
        "budget.max_context_chars": budget.max_context_chars,
        "tools": {
            "max_observation_chars": request.tools.max_observation_chars,
            "specs": request.tools.describe(),
        },
        "run_context.sha256": _sha256([_assembly.message_json(m) for m in request.run_context]),
        "goal_context.sha256": _sha256([_assembly.message_json(m)
                                        for m in request.goal_context]),
        "injection.sha256": _sha256(injection),  # type: ignore[arg-type]
        "model_replay": request.model_replay.value,
        "observation_template": request.observation_template,
        "tool_style": request.tool_style.value,
    }
    for key, value in request.binding.items():
        params[f"binding.{key}"] = value
    return params


def _sha256(value: JSONValue) -> str:
    return hashlib.sha256(_assembly.canonical(value)).hexdigest()


def _prefix(request: Request) -> tuple[Message, ...]:
    return _assembly.prefix(
        run_context=request.run_context,
        injection_text=_assembly.render_injection(request.injection),
        tools_text=_assembly.render_tools(_tool_list(request.tools), request.tool_style),
        goal_context=request.goal_context,
    )


def _tool_list(tools: ToolRegistry) -> list[dict[str, Any]]:
    described = tools.describe()
    assert isinstance(described, list)
    return [tool for tool in described if isinstance(tool, dict)]


# The method a NullSink discards events with, as defined (a patched class is not trusted).
_NULL_EMIT = NullSink.emit


def _discards(sink: EventSink) -> bool:
    """Whether ``sink`` is a plain :class:`NullSink`, so that an event would be wasted work.

    Its ``emit`` neither suspends nor fails, so skipping the call is unobservable.
    """
    return type(sink) is NullSink and NullSink.emit is _NULL_EMIT


_ACTIVE: dict[int, set[str]] = {}


@contextmanager
def _driving(store: Store, run_id: str) -> Iterator[None]:
    """Refuse a second concurrent run/resume of one run id through one store object."""
    active = _ACTIVE.setdefault(id(store), set())
    if run_id in active:
        raise RunLocked(
            "another run or resume call is already driving this run through this store",
            run_id=run_id,
        )
    active.add(run_id)
    try:
        yield
    finally:
        active.discard(run_id)
        if not active:
            _ACTIVE.pop(id(store), None)


def _describe(exc: BaseException) -> str:
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure itself
        message = "<the exception's message could not be rendered>"
    return f"{type(exc).__name__}: {message}"


def _fault(detail: str) -> ActionOutcome:
    return ActionOutcome(
        status=ActionStatus.ENV_FAULT, observation=detail, synthesized=True, done=False
    )


def _checked_reply(reply: object) -> ModelReply:
    if not isinstance(reply, ModelReply):
        raise TypeError(f"the model client returned {type(reply).__name__}, not ModelReply")
    if not isinstance(reply.content, str):
        raise TypeError(f"the model reply content is {type(reply.content).__name__}, not str")
    if reply.reasoning is not None and not isinstance(reply.reasoning, str):
        raise TypeError("the model reply reasoning is not a string")
    if reply.call_id is not None and not isinstance(reply.call_id, str):
        raise TypeError("the model reply call_id is not a string")
    if reply.call_id == "":
        # An empty id looks like a valid join key and silently matches nothing.
        return ModelReply(call_id=None, content=reply.content, reasoning=reply.reasoning)
    return reply


def _outcome_problem(outcome: object) -> str | None:
    """Why an executor's return value cannot be recorded as an outcome, if it cannot."""
    if (
        type(outcome) is ActionOutcome
        and type(outcome.status) is ActionStatus
        and type(outcome.observation) is str
        and type(outcome.synthesized) is bool
        and type(outcome.done) is bool
        and type(outcome.truncated_chars) is int
        and outcome.truncated_chars >= 0
    ):
        return None  # every step's case, without building the list of checks below
    if not isinstance(outcome, ActionOutcome):
        return f"the executor returned {type(outcome).__name__}, not ActionOutcome"
    wrong = [
        name
        for name, ok in (
            ("status", isinstance(outcome.status, ActionStatus)),
            ("observation", isinstance(outcome.observation, str)),
            ("synthesized", isinstance(outcome.synthesized, bool)),
            ("done", isinstance(outcome.done, bool)),
            ("truncated_chars", isinstance(outcome.truncated_chars, int)
             and not isinstance(outcome.truncated_chars, bool)
             and outcome.truncated_chars >= 0),
        )
        if not ok
    ]
    if wrong:
        return f"the executor's outcome has ill-typed fields: {', '.join(wrong)}"
    return None


_DECISION_TEXTS: dict[type, tuple[str, ...]] = {
    Action: ("action_text", "history_text"),
    FinalAnswer: ("answer", "history_text"),
    InvalidDecision: ("feedback", "history_text"),
}


def _decision_problem(decision: object) -> str | None:
    """Why an interpreter's return value is not a usable decision, if it is not."""
    if not isinstance(decision, (Action, FinalAnswer, InvalidDecision)):
        return (f"the interpreter returned {type(decision).__name__}, "
                f"not Action, FinalAnswer or InvalidDecision")
    wrong = [name for name in _DECISION_TEXTS[type(decision)]
             if not isinstance(getattr(decision, name), str)]
    if wrong:
        return f"the interpreter's {type(decision).__name__} has non-string {', '.join(wrong)}"
    return None


def _reply_payload(reply: ModelReply) -> JSONValue:
    return {"call_id": reply.call_id, "content": reply.content, "reasoning": reply.reasoning}


def _reply_from(payload: JSONValue, run_id: str, result_id: str) -> ModelReply:
    if (
        isinstance(payload, dict)
        and isinstance(payload.get("content"), str)
        and isinstance(payload.get("call_id"), (str, type(None)))
        and isinstance(payload.get("reasoning"), (str, type(None)))
    ):
        return ModelReply(
            call_id=payload["call_id"],  # type: ignore[arg-type]
            content=payload["content"],  # type: ignore[arg-type]
            reasoning=payload["reasoning"],  # type: ignore[arg-type]
        )
    raise CorruptLog(f"model result {result_id!r} holds no reply", run_id=run_id)


def _outcome_payload(outcome: ActionOutcome) -> JSONValue:
    return {
        "status": outcome.status.value,
        "observation": outcome.observation,
        "synthesized": outcome.synthesized,
        "done": outcome.done,
        "truncated_chars": outcome.truncated_chars,
    }


def _action_name(intent: Intent | None) -> str | None:
    if intent is None or not isinstance(intent.payload, dict):
        return None
    name = intent.payload.get("name")
    return name if isinstance(name, str) else None
