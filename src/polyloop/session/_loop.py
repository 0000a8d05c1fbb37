"""The ``_Loop`` that drives one run: its steps and their writes, its stops, its end.

One is built per call of ``run`` or ``resume``, once the request is checked and the run
id claimed. It makes the writes of each step in the order the package docstring sets
out and, when cancelled, still leaves an end record where it can.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any, TypeAlias

import anyio

from polyloop import _assembly, _recovery, _stopping, serialization
from polyloop._shared import RECONCILE_PREFIX, call_text, exception_text
from polyloop.ports import (
    Action,
    ActionOutcome,
    Event,
    EventKind,
    FinalAnswer,
    InvalidDecision,
    ModelCall,
    ModelReply,
    ReconcilingExecutor,
    TracingSink,
)
from polyloop.session._checks import (
    action_name,
    action_name_of,
    checked_reply,
    decision_problem,
    fault,
    outcome_payload,
    outcome_problem,
    reply_from,
    reply_payload,
)
from polyloop.session._request import context_prefix, native_tools
from polyloop.session._values import Definition, Request
from polyloop.types import (
    ActionStatus,
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Proposal,
    Reconciled,
    Record,
    Replay,
    Result,
    RunEnded,
    RunResult,
    RunStarted,
    Settlement,
    StepRecord,
    StopReason,
    ToolCallBlock,
    UnloggableValue,
    Usage,
    Verdict,
)

logger = logging.getLogger("polyloop")

# A finished step and the tool its action called, or None when the run stopped at a
# proposal to wait for a person's approval (its end record is then written).
Stepped: TypeAlias = tuple[StepRecord, str | None] | None


# What a call runs inside when the event sink wraps none: reusable, and free to enter.
_NO_SCOPE: AbstractContextManager[object] = contextlib.nullcontext()


def now() -> datetime:
    """The time a record is written at."""
    return datetime.now(UTC)


@dataclasses.dataclass(slots=True)
class StepTimes:
    """The clock readings of the step being taken: when it began (``perf_counter``) and
    how long its model call and its action took, once they have."""

    began: float = dataclasses.field(default_factory=time.perf_counter)
    model_s: float | None = None
    action_s: float | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Edited:
    """Who edited an approved call, and the call's text as the model proposed it."""

    by: str
    proposed: str


def _edit(verdict: Verdict, proposal: Proposal) -> tuple[Action, _Edited]:
    """The call a person approved with other arguments, as it will run, and the edit.

    Its text and native tool call are rebuilt from the edited payload, so that the
    records say what ran and the model's history shows the call its result answers;
    the model's own words (``history_text``) are left as it wrote them.
    """
    payload = verdict.payload
    # approve() checked the edited payload is a tool call with an arguments object.
    assert isinstance(payload, dict) and isinstance(payload.get("name"), str)
    name, arguments = str(payload["name"]), payload.get("arguments")
    call = proposal.tool_call
    action = Action(
        payload=payload,
        action_text=call_text(name, arguments),
        history_text=proposal.history_text,
        tool_call=None if call is None else dataclasses.replace(call, arguments=arguments),
    )
    return action, _Edited(by=verdict.by, proposed=proposal.action_text)


def _as_edited(step: StepRecord, by: str | None, proposed: str | None) -> StepRecord:
    """The step of an action, saying, as its intent does, whether a person edited it."""
    if by is None:
        return step
    return dataclasses.replace(step, edited_by=by, proposed_action_text=proposed)


def reconcilable(request: Request, plan: _recovery.Plan) -> Action | None:
    """The action in doubt that the request's executor may be asked about, if any.

    Only an action can be settled, and only an executor that says it can answer for it
    is asked. One whose ``reconciles`` raises is asked anyway: the loop then counts the
    failure and says what it raised.
    """
    intent = plan.open_intent
    executor = request.executor
    if (
        plan.state is not _recovery.RecoveryState.IN_DOUBT
        or intent is None
        or intent.kind is not IntentKind.ACTION
        or not isinstance(executor, ReconcilingExecutor)
    ):
        return None
    action = Action(
        payload=intent.payload,
        action_text=intent.action_text or "",
        history_text=intent.history_text or "",
        tool_call=intent.tool_call,
    )
    try:
        return action if executor.reconciles(action) else None
    except Exception:  # noqa: BLE001 - counted where the loop asks again
        return action


def _well_formed(answer: object) -> bool:
    return (
        isinstance(answer, Reconciled)
        and isinstance(answer.ran, bool)
        and isinstance(answer.observation, str)
    )


def _noted(detail: str | None, note: str | None) -> str | None:
    """An in-doubt detail with what the probe said, if it was asked."""
    if note is None:
        return detail
    return note if detail is None else f"{detail}; {note}"


class Loop:
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
        self.reconcile_failures = 0
        self.end: RunEnded | None = None
        # False until the store confirms the run's start record: a cancellation before
        # then may leave no record of the run, and so nothing for an end record to end.
        self.start_confirmed = resumed
        # True while the log ends in doubt and a probe is asked: only a settlement may
        # follow that end, so a cancellation then writes no end record of its own.
        self.end_stands = False
        self.transcript = _assembly.Transcript(context_prefix(request))
        self.native_tools = native_tools(request)
        # Looked up once per run, so a sink that wraps no calls adds nothing to a step.
        events = definition.events
        self._around = events.around_call if isinstance(events, TracingSink) else None

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
        for step in started.inherited_steps:
            self._remember(step)
        await self.store.start_run(started)
        self.start_confirmed = True
        await self._emit(EventKind.RUN_STARTED, None, started)
        await self._until_stopped()

    async def continue_from(self, plan: _recovery.Plan, logged: tuple[Record, ...]) -> None:
        """Go on from where ``plan`` says the run stopped; ``logged`` is the log the plan
        was read from, handed to the event sink as it is (no copy, no second read)."""
        started = plan.started
        assert started is not None
        for step in plan.steps:
            self._remember(step)
        unsettled: str | None = None
        if plan.state is _recovery.RecoveryState.IN_DOUBT:
            answer = await self._reconciled(plan)
            if isinstance(answer, Settlement):
                plan, logged = _recovery.settled(plan, answer), (*logged, answer)
            elif self.end is not None:
                return
            else:
                unsettled = answer
        await self._emit(EventKind.RUN_RESUMED, None, started, logged=logged)
        if plan.state is _recovery.RecoveryState.IN_DOUBT:
            assert plan.open_intent is not None
            detail = _recovery.in_doubt_detail(plan.open_intent)
            await self._finish(StopReason.IN_DOUBT, _noted(detail, unsettled))
            return
        if plan.state is _recovery.RecoveryState.AWAITING_APPROVAL:
            assert plan.proposal is not None
            await self._pause(plan.proposal)
            return
        if plan.model_result is not None or plan.open_intent is not None:
            stepped = await self._finish_interrupted(plan)
            if stepped is None:
                return
            step, tool = stepped
        elif len(self.steps) > len(started.inherited_steps):
            # The last step landed but the run may not have been ended: decide again.
            # (A fork's inherited steps are never decided again: it goes on after them.)
            step, tool = self.steps[-1], action_name(plan.last_action)
        else:
            await self._until_stopped()
            return
        reason = self._stop_reason(step, tool)
        if reason is None:
            await self._until_stopped()
        else:
            await self._stop_after(step, reason)

    async def _reconciled(self, plan: _recovery.Plan) -> Settlement | str | None:
        """:meth:`_reconcile`, for a log that may already end in doubt.

        Such an end stands unless a settlement follows it: if the probe cannot settle
        the action, ``self.end`` is that end (the detail saying what the probe said),
        and nothing is written, not even on cancellation.
        """
        self.end_stands = _recovery.waits_for_person(plan)
        answer = await self._reconcile(plan)
        if self.end_stands and not isinstance(answer, Settlement):
            assert plan.ended is not None
            self.end = dataclasses.replace(plan.ended, detail=_noted(plan.ended.detail, answer))
        self.end_stands = False
        return answer

    async def _reconcile(self, plan: _recovery.Plan) -> Settlement | str | None:
        """Ask the tool's probe what became of the action in doubt, and record its answer.

        The settlement written, or what to add to the in-doubt detail (the probe could
        not tell, or failed), or ``None`` when there was no probe to ask. The probe is an
        effect like any other: it starts only once the claim is checked.
        """
        intent = plan.open_intent
        assert intent is not None
        action = reconcilable(self.request, plan)
        if action is None:
            return None
        executor = self.request.executor
        assert isinstance(executor, ReconcilingExecutor)
        name = action_name(intent) or type(executor).__name__
        probe = f"the probe of tool {name!r}"
        try:
            if not executor.reconciles(action):
                return None
        except Exception as exc:  # noqa: BLE001 - the executor's fault, counted as "cannot tell"
            return self._reconcile_failed(probe, exc)
        await self._before_effect()
        began = time.perf_counter()
        try:
            answer = await executor.reconcile(action, result_id=intent.result_id)
            if answer is not None and not _well_formed(answer):
                raise TypeError(f"it returned {answer!r:.80}, not Reconciled or None")
        except Exception as exc:  # noqa: BLE001 - a failing probe cannot tell, by contract
            return self._reconcile_failed(probe, exc)
        if answer is None:
            return f"{probe} could not tell"
        settlement = Settlement(
            run_id=self.run_id,
            result_id=intent.result_id,
            ran=answer.ran,
            observation=answer.observation,
            by=f"{RECONCILE_PREFIX}{name}",
            at=now(),
            duration_s=time.perf_counter() - began,
        )
        await self.store.write_review(settlement)
        return settlement

    def _reconcile_failed(self, probe: str, exc: Exception) -> str:
        self.reconcile_failures += 1
        logger.warning("run %r: %s failed", self.run_id, probe, exc_info=exc)
        return f"{probe} failed: {exception_text(exc)}"

    async def _until_stopped(self) -> None:
        while True:
            reason = _stopping.before_model_call(
                self.request.budget, self.used, self.transcript.size
            )
            if reason is not None:
                await self._finish(reason, self._limit_detail(reason))
                return
            stepped = await self._step()
            if stepped is None:
                return
            step, tool = stepped
            if (reason := self._stop_reason(step, tool)) is not None:
                await self._stop_after(step, reason)
                return

    def _stop_reason(self, step: StepRecord, tool: str | None) -> StopReason | None:
        """Why the run stops after ``step`` (``tool`` names its action's tool), if it does."""
        return _stopping.after_step(
            _stopping.StepFacts(
                decision=step.decision,
                model_failed=step.error is not None,
                action_status=step.action_status,
                synthesized=step.observation_synthesized,
                done=step.done,
                completes=tool is not None and self.request.tools.marks_completion(tool),
            )
        )

    async def _stop_after(self, step: StepRecord, reason: StopReason) -> None:
        detail = step.error if reason is StopReason.MODEL_FAILURE else None
        if reason is StopReason.ENV_FAILURE:
            detail = step.observation
        await self._finish(reason, detail, final_answer=step.final_answer)

    # -- one step -----------------------------------------------------------------------

    async def _step(self, result_id: str | None = None) -> Stepped:
        index = self.used.steps
        result_id = result_id or _recovery.model_result_id(self.run_id, index)
        await self.store.write_intent(
            Intent(
                run_id=self.run_id,
                result_id=result_id,
                kind=IntentKind.MODEL_CALL,
                step=index,
                call_index=index,
                replay=self.request.model_replay,
                payload={"messages_sha256": self.transcript.sha256()},
                at=now(),
            )
        )
        return await self._call_model(index, StepTimes(), result_id)

    async def _call_model(self, index: int, times: StepTimes, result_id: str) -> Stepped:
        call = ModelCall(
            messages=self.transcript.messages,
            call_index=index,
            run_id=self.run_id,
            result_id=result_id,
            binding=self.request.binding,
            tools=self.native_tools,
        )
        await self._before_effect()
        began = time.perf_counter()
        try:
            with self._call_scope(IntentKind.MODEL_CALL, index):
                reply = checked_reply(await self.definition.model.call(call))
        except Exception as exc:  # noqa: BLE001 - a failing model ends the run, by contract
            times.model_s = time.perf_counter() - began
            error = exception_text(exc)
            await self._write_model_result(result_id, {"error": error}, times.model_s)
            return await self._model_failed(index, error, times), None
        times.model_s = time.perf_counter() - began
        await self._write_model_result(result_id, reply_payload(reply), times.model_s)
        return await self._decide(index, reply, times)

    async def _write_model_result(
        self, result_id: str, payload: JSONValue, duration_s: float | None
    ) -> None:
        await self.store.write_result(
            Result(
                run_id=self.run_id,
                result_id=result_id,
                kind=IntentKind.MODEL_CALL,
                payload=payload,
                at=now(),
                duration_s=duration_s,
            )
        )

    async def _model_failed(
        self, index: int, error: str, times: StepTimes, reply: ModelReply | None = None
    ) -> StepRecord:
        step = self._step_record(
            index, reply, times, decision=DecisionKind.INVALID, history_text="", error=error
        )
        return await self._record(step, None)

    async def _decide(self, index: int, reply: ModelReply, times: StepTimes) -> Stepped:
        if (unmetered := self._unmetered(reply)) is not None:
            # Recorded with unknown counts, so the run's total says it is incomplete.
            counted = dataclasses.replace(reply, usage=reply.usage or Usage())
            return await self._model_failed(index, unmetered, times, counted), None
        decision = self.definition.interpreter.interpret(reply)
        problem = decision_problem(decision)
        if problem is not None:
            # An interpreter bug, not a model error: stop here, leaving the run resumable
            # (the reply is on record and is interpreted again by a fixed interpreter).
            raise TypeError(f"run {self.run_id!r}: {problem}")
        if isinstance(decision, FinalAnswer):
            step = self._step_record(
                index,
                reply,
                times,
                decision=DecisionKind.FINAL,
                history_text=decision.history_text,
                final_answer=decision.answer,
            )
            return await self._record(step, None), None
        if isinstance(decision, InvalidDecision):
            step = self._step_record(
                index,
                reply,
                times,
                decision=DecisionKind.INVALID,
                history_text=decision.history_text,
                observation=decision.feedback,
                observation_synthesized=True,
            )
            return await self._record(step, None), None
        assert isinstance(decision, Action)
        return await self._announce_and_act(index, reply, decision, times)

    async def _announce_and_act(
        self,
        index: int,
        reply: ModelReply,
        action: Action,
        times: StepTimes,
        *,
        approved: bool = False,
        edit: _Edited | None = None,
    ) -> Stepped:
        """Write the action's intent and run it, or propose it for approval first.

        ``edit`` is set for a call a person approved with other arguments: it is
        approved, and its intent says who edited it and what was proposed.
        """
        by, proposed = (edit.by, edit.proposed) if edit is not None else (None, None)
        replay = self._replay_policy(action)
        if not isinstance(replay, Replay):
            # The executor could not say whether the action may be repeated, so it cannot
            # be announced: an environment fault, with nothing run and no intent written.
            step = _as_edited(self._acted(index, reply, action, fault(replay), times), by, proposed)
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
            tool_call=action.tool_call,
            at=now(),
            edited_by=by,
            proposed_action_text=proposed,
        )
        try:
            # Only the payload can be unloggable: the texts were checked as strings.
            serialization.plain(action.payload, owner="Intent", field="payload", run_id=self.run_id)
        except UnloggableValue as exc:
            # Nothing may run that its intent cannot record; refuse it like a bad call.
            outcome = ActionOutcome(
                status=ActionStatus.NOT_EXECUTED,
                observation=exc.reason,
                synthesized=True,
                done=False,
            )
            step = _as_edited(self._acted(index, reply, action, outcome, times), by, proposed)
            return await self._record(step, None), None
        name = action_name(intent)
        approved = approved or edit is not None
        if not approved and name is not None and self.request.tools.needs_approval(name):
            await self._propose(intent, name)
            return None
        await self.store.write_intent(intent)
        return await self._act(index, reply, action, times, intent), action_name(intent)

    async def _propose(self, intent: Intent, name: str) -> None:
        """Record the action for a person to judge, durably, and stop the run to wait."""
        spec = self.request.tools.get(name)
        proposal = Proposal(
            run_id=self.run_id,
            result_id=intent.result_id,
            step=intent.step,
            replay=intent.replay,
            payload=intent.payload,
            action_text=intent.action_text or "",
            history_text=intent.history_text or "",
            description=spec.description if spec is not None else "",
            tool_call=intent.tool_call,
            at=now(),
        )
        await self.store.write_review(proposal)
        await self._pause(proposal)

    async def _pause(self, proposal: Proposal) -> None:
        await self._finish(StopReason.AWAITING_APPROVAL, _recovery.awaiting_detail(proposal))

    def _unmetered(self, reply: ModelReply) -> str | None:
        """Why a reply cannot be counted against the token budget, if it cannot.

        A budget that a reply could slip past unseen would not be a budget, so a reply
        that does not say what it cost ends the run rather than going uncounted.
        """
        limit = self.request.budget.max_tokens
        if limit is None or (reply.usage is not None and reply.usage.total_tokens is not None):
            return None
        return (
            f"the model reply does not report its input and output tokens, and the run "
            f"has a token budget (max_tokens={limit}) that cannot be kept without them"
        )

    def _replay_policy(self, action: Action) -> Replay | str:
        """The executor's replay policy for ``action``, or why there is none."""
        try:
            replay = self.request.executor.replay(action)
        except Exception as exc:  # noqa: BLE001 - the executor's fault, reported as one
            return exception_text(exc)
        if not isinstance(replay, Replay):
            kind = type(replay).__name__
            return f"TypeError: the executor's replay() returned {kind}, not Replay"
        return replay

    async def _act(
        self, index: int, reply: ModelReply, action: Action, times: StepTimes, intent: Intent
    ) -> StepRecord:
        await self._before_effect()
        began = time.perf_counter()
        outcome = await self._execute(action, intent)
        times.action_s = time.perf_counter() - began
        step = _as_edited(
            self._acted(index, reply, action, outcome, times),
            intent.edited_by,
            intent.proposed_action_text,
        )
        result = Result(
            run_id=self.run_id,
            result_id=intent.result_id,
            kind=IntentKind.ACTION,
            payload=outcome_payload(outcome),
            at=step.at,
            duration_s=times.action_s,
        )
        return await self._record(step, result, intent)

    async def _before_effect(self) -> None:
        """The last thing before an effect starts: its intent is durable, and the store
        must still hold the run's claim with time to spare. If it does not (a lease
        lost while this process was paused, say), nothing starts and nothing more is
        written: ``LeaseLost`` goes up to the caller, past the end-record paths."""
        await self.store.check_claim(self.run_id)

    def _call_scope(self, kind: IntentKind, index: int) -> AbstractContextManager[object]:
        """What the model call or action of step ``index`` runs inside: the event
        sink's wrapper (a span made current, say), or nothing."""
        if self._around is None:
            return _NO_SCOPE
        return self._sink_scope(kind, index)

    @contextlib.contextmanager
    def _sink_scope(self, kind: IntentKind, index: int) -> Iterator[None]:
        """The sink's wrapper, failing as its ``emit`` may: counted and logged, never
        failing the call, never hiding the call's own exception or cancellation."""
        assert self._around is not None
        scope: AbstractContextManager[object] = _NO_SCOPE
        try:
            scope = self._around(run_id=self.run_id, step=index, kind=kind)
            scope.__enter__()
        except Exception:  # noqa: BLE001 - a failing sink never fails the call
            self._sink_failed(kind, "entering")
            scope = _NO_SCOPE
        try:
            yield
        except BaseException as exc:
            try:
                scope.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as failure:  # noqa: BLE001 - a failing sink never fails the call
                if failure is not exc:
                    self._sink_failed(kind, "leaving")
            raise  # whatever the sink's __exit__ says: the call's outcome is not the sink's
        try:
            scope.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - a failing sink never fails the call
            self._sink_failed(kind, "leaving")

    def _sink_failed(self, kind: IntentKind, doing: str) -> None:
        self.event_failures += 1
        logger.exception("run %r: the event sink failed %s a %s", self.run_id, doing, kind.value)

    async def _execute(self, action: Action, intent: Intent) -> ActionOutcome:
        try:
            with self._call_scope(IntentKind.ACTION, intent.step):
                outcome = await self.request.executor.execute(action, result_id=intent.result_id)
        except Exception as exc:  # noqa: BLE001 - an escaping exception is an env fault
            return fault(exception_text(exc))
        problem = outcome_problem(outcome)
        return outcome if problem is None else fault(f"TypeError: {problem}")

    def _acted(
        self,
        index: int,
        reply: ModelReply,
        action: Action,
        outcome: ActionOutcome,
        times: StepTimes,
    ) -> StepRecord:
        texts = self.definition.texts
        observation, synthesized = outcome.observation, outcome.synthesized
        if outcome.status is ActionStatus.NOT_EXECUTED:
            observation, synthesized = texts.not_executed.format(reason=observation), True
        elif outcome.status is ActionStatus.ENV_FAULT:
            observation, synthesized = texts.env_fault.format(detail=observation), True
        return self._step_record(
            index,
            reply,
            times,
            decision=DecisionKind.ACTION,
            history_text=action.history_text,
            action_text=action.action_text,
            observation=observation,
            observation_synthesized=synthesized,
            action_status=outcome.status,
            done=outcome.done,
            truncated_chars=outcome.truncated_chars,
            tool_call=action.tool_call,
        )

    def _step_record(
        self,
        index: int,
        reply: ModelReply | None,
        times: StepTimes,
        *,
        decision: DecisionKind,
        history_text: str,
        action_text: str | None = None,
        observation: str | None = None,
        observation_synthesized: bool = False,
        action_status: ActionStatus | None = None,
        done: bool = False,
        truncated_chars: int = 0,
        error: str | None = None,
        final_answer: str | None = None,
        tool_call: ToolCallBlock | None = None,
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
            duration_s=time.perf_counter() - times.began,
            finish=reply.finish if reply else None,
            usage=reply.usage if reply else None,
            model=reply.model if reply else None,
            refusal=reply.refusal if reply else None,
            tool_call=tool_call,
            at=now(),
            model_duration_s=times.model_s,
            action_duration_s=times.action_s,
            resumed=True if self.resumed else None,
        )

    async def _record(
        self,
        step: StepRecord,
        action_result: Result | None,
        intent: Intent | None = None,
        settlement: Settlement | None = None,
    ) -> StepRecord:
        await self.store.write_step(step, action_result)
        self._remember(step)
        await self._emit(EventKind.STEP_FINISHED, step.step, step, intent, settlement=settlement)
        return step

    def _remember(self, step: StepRecord) -> None:
        self.steps.append(step)
        tokens = step.usage.total_tokens if step.usage is not None else None
        self.used = _stopping.settle(self.used, step.action_status, tokens or 0)
        self.transcript.extend(
            _assembly.step_messages(
                step.history_text,
                step.observation,
                self.request.observation_template,
                step.tool_call,
            )
        )

    # -- the step a crash interrupted ---------------------------------------------------

    async def _finish_interrupted(self, plan: _recovery.Plan) -> Stepped:
        index, times = len(self.steps), StepTimes()
        intent = plan.open_intent
        if (settlement := _recovery.settled_model_call(plan)) is not None:
            return await self._after_model_settlement(index, plan, settlement, times)
        if plan.model_result is None:
            # The model call was announced and its result lost; its replay is allowed,
            # and it reuses the intent on disk rather than writing a second one.
            assert intent is not None  # no model result: the model call is the open intent
            return await self._call_model(index, times, intent.result_id)
        payload = plan.model_result.payload
        if isinstance(payload, dict) and "error" in payload:
            return await self._model_failed(index, str(payload["error"]), times), None
        reply = reply_from(payload, self.run_id, plan.model_result.result_id)
        if intent is None and plan.verdict is not None:
            return await self._after_verdict(index, reply, plan, times)
        if intent is None:
            # No action was announced, so nothing has happened yet: interpret again.
            return await self._decide(index, reply, times)
        # The action was announced: replay exactly the recorded action, whatever the
        # interpreter would say today.
        action = Action(
            payload=intent.payload,
            action_text=intent.action_text or "",
            history_text=intent.history_text or "",
            tool_call=intent.tool_call,
        )
        tool = action_name(intent)
        if plan.settlement is not None:
            return await self._settled(index, reply, action, plan.settlement, times, intent), tool
        return await self._act(index, reply, action, times, intent), tool

    async def _after_model_settlement(
        self, index: int, plan: _recovery.Plan, settlement: Settlement, times: StepTimes
    ) -> Stepped:
        """Go on from a person's answer about the model call in doubt: call again, as a
        new call with an intent of its own, or end on the reply that was lost."""
        if not settlement.ran:
            return await self._step(_recovery.model_call_again_id(plan))
        error = _recovery.unrecorded_reply_error(settlement)
        await self._write_model_result(settlement.result_id, {"error": error}, None)
        return await self._model_failed(index, error, times), None

    async def _after_verdict(
        self, index: int, reply: ModelReply, plan: _recovery.Plan, times: StepTimes
    ) -> Stepped:
        """Go on from a person's verdict: announce and run the approved action (with the
        arguments as approved), or record the rejected one as not executed."""
        verdict, proposal = plan.verdict, plan.proposal
        assert verdict is not None and proposal is not None  # a verdict answers a proposal
        action = Action(
            payload=proposal.payload,
            action_text=proposal.action_text,
            history_text=proposal.history_text,
            tool_call=proposal.tool_call,
        )
        if verdict.approved and verdict.payload != proposal.payload:
            edit = _edit(verdict, proposal)
            return await self._announce_and_act(index, reply, edit[0], times, edit=edit[1])
        if verdict.approved:
            return await self._announce_and_act(index, reply, action, times, approved=True)
        outcome = ActionOutcome(
            status=ActionStatus.NOT_EXECUTED,
            observation=verdict.reason or "",
            synthesized=True,
            done=False,
        )
        step = self._acted(index, reply, action, outcome, times)
        return await self._record(step, None), action_name_of(proposal.payload)

    async def _settled(
        self,
        index: int,
        reply: ModelReply,
        action: Action,
        settlement: Settlement,
        times: StepTimes,
        intent: Intent,
    ) -> StepRecord:
        """Close the action in doubt the way the person who settled it says it ended."""
        outcome = ActionOutcome(
            status=ActionStatus.EXECUTED if settlement.ran else ActionStatus.NOT_EXECUTED,
            observation=settlement.observation,
            synthesized=not settlement.ran,
            done=False,
        )
        step = _as_edited(
            self._acted(index, reply, action, outcome, times),
            intent.edited_by,
            intent.proposed_action_text,
        )
        result = Result(
            run_id=self.run_id,
            result_id=settlement.result_id,
            kind=IntentKind.ACTION,
            payload=outcome_payload(outcome),
            at=step.at,
        )
        return await self._record(
            dataclasses.replace(step, settled_by=settlement.by), result, intent, settlement
        )

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
            at=now(),
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
            if self.end_stands:
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
            return (
                f"the context holds {self.transcript.size} characters, more than "
                f"max_context_chars={budget.max_context_chars}"
            )
        if reason is StopReason.STEP_LIMIT:
            return f"max_steps={budget.max_steps} reached"
        if reason is StopReason.TOKEN_LIMIT:
            return f"{self.used.tokens} tokens used, max_tokens={budget.max_tokens} reached"
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
            usage=Usage.of_steps(self.steps),
            reconcile_failures=self.reconcile_failures,
        )

    async def _emit(
        self,
        kind: EventKind,
        step: int | None,
        record: Record,
        intent: Intent | None = None,
        *,
        logged: tuple[Record, ...] = (),
        settlement: Settlement | None = None,
    ) -> None:
        event = Event(
            kind=kind,
            run_id=self.run_id,
            step=step,
            record=record,
            intent=intent,
            logged=logged,
            settlement=settlement,
        )
        try:
            await self.definition.events.emit(event)
        except Exception:
            # Counted and logged, never reported through the sink that just failed.
            self.event_failures += 1
            logger.exception("run %r: the event sink failed on %s", self.run_id, kind.value)
