"""The ``Loop`` that drives one run: decide, announce, act, record, and end.

One is built per call of ``run`` or ``resume``, once the request is checked and the run
id claimed. Each step makes the writes the package docstring sets out, in its order;
every return is preceded by an end record and, when cancelled, the loop still leaves
one where it can. Its side jobs live beside it: ``_steps`` builds the records,
``_relay`` tells the event sink, ``_deltas`` calls the model (streaming
its text to the sink where both can), ``_proposals`` puts a call to a person and turns a
verdict into the call to run, and ``_resuming`` carries a resumed run on from where
``_recovery.next_move`` says (asking ``_probes`` about an action in doubt first).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, TypeAlias

import anyio

from polyloop import _recovery, _stopping
from polyloop._assembly import Transcript, step_messages
from polyloop._shared import exception_text
from polyloop.ports import (
    Action,
    ActionOutcome,
    EventKind,
    ModelCall,
    ModelReply,
)
from polyloop.session import _deltas, _draining, _proposals
from polyloop.session._checks import (
    action_name,
    checked_reply,
    decision_problem,
    fault,
    outcome_payload,
    outcome_problem,
    replay_policy,
    reply_payload,
    unloggable,
)
from polyloop.session._probes import can_settle
from polyloop.session._relay import Relay
from polyloop.session._request import Prepared
from polyloop.session._steps import StepBuilder, StepTimes, action_of, now
from polyloop.session._values import Definition, Request
from polyloop.types import (
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Proposal,
    Replay,
    Result,
    RunEnded,
    RunResult,
    RunStarted,
    Settlement,
    StepRecord,
    StopReason,
    Usage,
)

logger = logging.getLogger("polyloop")

# A finished step and the tool its action called, or None when the run stopped at a
# proposal to wait for a person's approval (its end record is then written).
Stepped: TypeAlias = tuple[StepRecord, str | None] | None


class Loop:
    """The state of one run while it is driven: its steps, counters and transcript."""

    def __init__(
        self, definition: Definition, request: Request, prepared: Prepared, *, resumed: bool
    ) -> None:
        self.definition = definition
        self.request = request
        self.store = definition.store
        self.run_id = request.run_id
        self.resumed = resumed
        self.steps: list[StepRecord] = []
        self.used = _stopping.Counters()
        self.reconcile_failures = 0
        self.end: RunEnded | None = None
        # False until the store confirms the run's start record: a cancellation before
        # then may leave no record of the run, and so nothing for an end record to end.
        self.start_confirmed = resumed
        # True while the log ends in doubt and a probe is asked: only a settlement may
        # follow that end, so a cancellation then writes no end record of its own.
        self.end_stands = False
        self.transcript = Transcript(prepared.prefix)
        self.native_tools = prepared.tools
        self.relay = Relay(definition.events, request.run_id)
        self.call_the_model = _deltas.model_caller(definition.model, self.relay)
        self.build = StepBuilder(
            run_id=request.run_id,
            resumed=resumed,
            not_executed=definition.texts.not_executed,
            env_fault=definition.texts.env_fault,
        )

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
            self.remember(step)
        await self.store.start_run(started)
        self.start_confirmed = True
        await self.relay.emit(EventKind.RUN_STARTED, None, started)
        await self.until_stopped()

    async def until_stopped(self) -> None:
        while True:
            size = self.transcript.size
            reason = _stopping.before_model_call(self.request.budget, self.used, size)
            if reason is not None:
                detail = _stopping.limit_detail(self.request.budget, reason, self.used, size)
                await self.finish(reason, detail)
                return
            if await _draining.stopped_at_boundary(self):
                return
            stepped = await self.step()
            if stepped is None:
                return
            step, tool = stepped
            if (reason := self._stop_reason(step, tool)) is not None:
                await self._stop_after(step, reason)
                return

    async def go_on_after(self, step: StepRecord, tool: str | None) -> None:
        reason = self._stop_reason(step, tool)
        if reason is None:
            await self.until_stopped()
        else:
            await self._stop_after(step, reason)

    def _stop_reason(self, step: StepRecord, tool: str | None) -> StopReason | None:
        """Why the run stops after ``step`` (``tool`` names its action's tool), if it does."""
        completes = tool is not None and self.request.tools.marks_completion(tool)
        return _stopping.after_step(_stopping.facts_of(step, completes))

    async def _stop_after(self, step: StepRecord, reason: StopReason) -> None:
        detail = step.error if reason is StopReason.MODEL_FAILURE else None
        if reason is StopReason.ENV_FAILURE:
            detail = step.observation
        await self.finish(reason, detail, final_answer=step.final_answer)

    # -- one step: decide --------------------------------------------------------------

    async def step(self, result_id: str | None = None) -> Stepped:
        index = self.used.steps
        result_id = result_id or _recovery.model_result_id(self.run_id, index)
        sha256 = self.transcript.sha256()
        replay = self.request.model_replay
        await self.store.write_intent(self.build.model_intent(index, result_id, replay, sha256))
        return await self.call_model(index, StepTimes(), result_id)

    async def call_model(self, index: int, times: StepTimes, result_id: str) -> Stepped:
        call = ModelCall(
            messages=self.transcript.messages,
            call_index=index,
            run_id=self.run_id,
            result_id=result_id,
            binding=self.request.binding,
            tools=self.native_tools,
        )
        await self.before_effect()
        began = time.perf_counter()
        try:
            with self.relay.scope(IntentKind.MODEL_CALL, index):
                reply = checked_reply(await self.call_the_model(call))
        except Exception as exc:  # noqa: BLE001 - a failing model ends the run, by contract
            times.model_s = time.perf_counter() - began
            error = exception_text(exc)
            await self.write_model_result(result_id, {"error": error}, times.model_s)
            return await self.model_failed(index, error, times), None
        times.model_s = time.perf_counter() - began
        await self.write_model_result(result_id, reply_payload(reply), times.model_s)
        return await self.decide(index, reply, times)

    async def write_model_result(
        self, result_id: str, payload: JSONValue, duration_s: float | None
    ) -> None:
        result = self.build.result(result_id, IntentKind.MODEL_CALL, payload, duration_s=duration_s)
        await self.store.write_result(result)

    async def model_failed(
        self, index: int, error: str, times: StepTimes, reply: ModelReply | None = None
    ) -> StepRecord:
        invalid = DecisionKind.INVALID
        step = self.build.step(index, reply, times, decision=invalid, history_text="", error=error)
        return await self.record(step, None)

    async def decide(self, index: int, reply: ModelReply, times: StepTimes) -> Stepped:
        if (unmetered := _stopping.unmetered(self.request.budget, reply.usage)) is not None:
            # Recorded with unknown counts, so the run's total says it is incomplete.
            counted = dataclasses.replace(reply, usage=reply.usage or Usage())
            return await self.model_failed(index, unmetered, times, counted), None
        decision = self.definition.interpreter.interpret(reply)
        if (problem := decision_problem(decision)) is not None:
            # An interpreter bug, not a model error: stop here, leaving the run resumable
            # (the reply is on record and is interpreted again by a fixed interpreter).
            raise TypeError(f"run {self.run_id!r}: {problem}")
        if isinstance(decision, Action):
            return await self.announce_and_act(index, reply, decision, times)
        return await self.record(self.build.decided(index, reply, times, decision), None), None

    # -- one step: announce and act -----------------------------------------------------

    async def announce_and_act(
        self,
        index: int,
        reply: ModelReply,
        action: Action,
        times: StepTimes,
        *,
        approved: bool = False,
        edit: _proposals.Edit | None = None,
    ) -> Stepped:
        """Write the action's intent and run it, or propose it for approval first.

        ``edit`` is set for a call a person approved with other arguments: it is
        approved, and its intent says who edited it and what was proposed.
        """
        by, proposed = (edit.by, edit.proposed) if edit is not None else (None, None)
        replay = replay_policy(self.request.executor, action)
        # Not announced, nothing run: the executor could not say whether the action may
        # be repeated (an environment fault), or its intent could not record it.
        refused = unloggable(action, self.run_id) if isinstance(replay, Replay) else fault(replay)
        if refused is not None:
            step = self.build.acted(
                index, reply, action, refused, times, edited_by=by, proposed=proposed
            )
            return await self.record(step, None), None
        assert isinstance(replay, Replay)  # nothing is refused: the executor named a policy
        result_id = _recovery.action_result_id(self.run_id, index)
        settles = can_settle(self.request.executor, action, replay)
        intent = self.build.action_intent(
            index, result_id, action, replay, edited_by=by, proposed=proposed, settles=settles
        )
        name = action_name(intent)
        approved = approved or edit is not None
        if not approved and name is not None and self.request.tools.needs_approval(name):
            await self._propose(intent, name)
            return None
        await self.store.write_intent(intent)
        return await self.act(index, reply, action, times, intent), name

    async def _propose(self, intent: Intent, name: str) -> None:
        """Record the action for a person to judge, durably, and stop the run to wait."""
        spec = self.request.tools.get(name)
        description = spec.description if spec is not None else ""
        proposal = _proposals.proposal_of(intent, description, now())
        await self.store.write_review(proposal)
        await self.pause(proposal)

    async def pause(self, proposal: Proposal) -> None:
        await self.finish(StopReason.AWAITING_APPROVAL, _recovery.awaiting_detail(proposal))

    async def act(
        self, index: int, reply: ModelReply, action: Action, times: StepTimes, intent: Intent
    ) -> StepRecord:
        await self.before_effect()
        began = time.perf_counter()
        outcome = await self._execute(action, intent)
        times.action_s = time.perf_counter() - began
        return await self.close(index, reply, intent, outcome, times)

    async def close(
        self,
        index: int,
        reply: ModelReply,
        intent: Intent,
        outcome: ActionOutcome,
        times: StepTimes,
        settlement: Settlement | None = None,
    ) -> StepRecord:
        """Record how the action ``intent`` announced ended: its step and its result,
        with the ``settlement`` that says so when a person or a probe settled it."""
        step = self.build.acted(
            index,
            reply,
            action_of(intent),
            outcome,
            times,
            edited_by=intent.edited_by,
            proposed=intent.proposed_action_text,
            settled_by=settlement.by if settlement is not None else None,
        )
        result = self.build.result(
            intent.result_id,
            IntentKind.ACTION,
            outcome_payload(outcome),
            at=step.at,
            duration_s=times.action_s,
        )
        return await self.record(step, result, intent, settlement)

    async def before_effect(self) -> None:
        """The last thing before an effect starts: its intent is durable, and the store
        must still hold the run's claim with time to spare. If it does not (a lease
        lost while this process was paused, say), nothing starts and nothing more is
        written: ``LeaseLost`` goes up to the caller, past the end-record paths."""
        await self.store.check_claim(self.run_id)

    async def _execute(self, action: Action, intent: Intent) -> ActionOutcome:
        try:
            with self.relay.scope(IntentKind.ACTION, intent.step):
                outcome = await self.request.executor.execute(action, result_id=intent.result_id)
        except Exception as exc:  # noqa: BLE001 - an escaping exception is an env fault
            return fault(exception_text(exc))
        problem = outcome_problem(outcome)
        return outcome if problem is None else fault(f"TypeError: {problem}")

    # -- one step: record ----------------------------------------------------------------

    async def record(
        self,
        step: StepRecord,
        action_result: Result | None,
        intent: Intent | None = None,
        settlement: Settlement | None = None,
    ) -> StepRecord:
        await self.store.write_step(step, action_result)
        self.remember(step)
        await self.relay.emit(
            EventKind.STEP_FINISHED, step.step, step, intent, settlement=settlement
        )
        return step

    def remember(self, step: StepRecord) -> None:
        self.steps.append(step)
        tokens = step.usage.total_tokens if step.usage is not None else None
        self.used = _stopping.settle(self.used, step.action_status, tokens or 0)
        self.transcript.extend(
            step_messages(
                step.history_text,
                step.observation,
                self.request.observation_template,
                step.tool_call,
            )
        )

    # -- ending ------------------------------------------------------------------------

    async def finish(
        self, reason: StopReason, detail: str | None, *, final_answer: str | None = None
    ) -> None:
        await self.end_with(self.build.end(reason, detail, self.used, final_answer))

    async def end_with(self, end: RunEnded) -> None:
        await self.store.end_run(end)
        self.end = end
        await self.relay.emit(EventKind.RUN_ENDED, None, end)

    async def _end_after_cancel(self) -> None:
        try:
            if not self.start_confirmed and not await self._start_landed():
                # Cancelled before the start record landed: the store holds nothing of
                # the run, so there is nothing to end (and resume says RunNotFound).
                return
            if self.end_stands:
                return
            await self.finish(StopReason.CANCELLED, "the run was cancelled")
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
            event_failures=self.relay.failures,
            detail=end.detail,
            usage=Usage.of_steps(self.steps),
            reconcile_failures=self.reconcile_failures,
        )
