"""Building the records of a step: one way to make each value the loop writes.

Nothing here does I/O: the loop decides and writes, these only assemble values (and
read the clock they are stamped with). An :class:`~polyloop.ports.Action` is made from
a record by :func:`action_of` alone, so an action replayed after a crash, run once a
person approved it or asked about by a probe is the action that was announced.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime

from polyloop._stopping import Counters
from polyloop.ports import Action, ActionOutcome, FinalAnswer, InvalidDecision, ModelReply
from polyloop.types import (
    ActionStatus,
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Proposal,
    Replay,
    Result,
    RunEnded,
    Settlement,
    StepRecord,
    StopReason,
    ToolCallBlock,
)


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


def action_of(record: Intent | Proposal) -> Action:
    """The action an action intent announced, or a proposal put to a person."""
    return Action(
        payload=record.payload,
        action_text=record.action_text or "",
        history_text=record.history_text or "",
        tool_call=record.tool_call,
    )


def settled_outcome(settlement: Settlement) -> ActionOutcome:
    """The outcome a person's (or a probe's) settlement says an action in doubt had."""
    ran = settlement.ran
    return ActionOutcome(
        status=ActionStatus.EXECUTED if ran else ActionStatus.NOT_EXECUTED,
        observation=settlement.observation,
        synthesized=not ran,
        done=False,
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepBuilder:
    """The records of one run's steps, each stamped with the run and its clock.

    ``not_executed`` and ``env_fault`` are the texts an observation is wrapped in when
    the action did not run or the environment failed (the definition's texts).
    """

    run_id: str
    resumed: bool
    not_executed: str
    env_fault: str

    def model_intent(self, index: int, result_id: str, replay: Replay, sha256: str) -> Intent:
        """The intent that announces step ``index``'s model call."""
        return Intent(
            run_id=self.run_id,
            result_id=result_id,
            kind=IntentKind.MODEL_CALL,
            step=index,
            call_index=index,
            replay=replay,
            payload={"messages_sha256": sha256},
            at=now(),
        )

    def action_intent(
        self,
        index: int,
        result_id: str,
        action: Action,
        replay: Replay,
        *,
        edited_by: str | None,
        proposed: str | None,
        settles: bool | None,
    ) -> Intent:
        """The intent that announces ``action``; ``edited_by`` names the person who edited
        its arguments, if one did, and ``proposed`` is the call's text before the edit.
        ``settles`` says whether the tool's probe could settle it were it left in doubt
        (``None`` unless its replay is ``NEVER``)."""
        return Intent(
            run_id=self.run_id,
            result_id=result_id,
            kind=IntentKind.ACTION,
            step=index,
            call_index=index,
            replay=replay,
            payload=action.payload,
            action_text=action.action_text,
            history_text=action.history_text,
            tool_call=action.tool_call,
            at=now(),
            edited_by=edited_by,
            proposed_action_text=proposed,
            reconciles=settles,
        )

    def result(
        self,
        result_id: str,
        kind: IntentKind,
        payload: JSONValue,
        *,
        at: datetime | None = None,
        duration_s: float | None = None,
    ) -> Result:
        """The result of an effect, at ``at`` (now, if not given)."""
        return Result(
            run_id=self.run_id,
            result_id=result_id,
            kind=kind,
            payload=payload,
            at=at or now(),
            duration_s=duration_s,
        )

    def acted(
        self,
        index: int,
        reply: ModelReply,
        action: Action,
        outcome: ActionOutcome,
        times: StepTimes,
        *,
        edited_by: str | None = None,
        proposed: str | None = None,
        settled_by: str | None = None,
    ) -> StepRecord:
        """The step record of an action, its observation wrapped in the text that says
        why, if the action did not run or the environment failed. ``edited_by`` and
        ``proposed`` are as on the action's intent; ``settled_by`` names who settled it."""
        observation, synthesized = outcome.observation, outcome.synthesized
        if outcome.status is ActionStatus.NOT_EXECUTED:
            observation, synthesized = self.not_executed.format(reason=observation), True
        elif outcome.status is ActionStatus.ENV_FAULT:
            observation, synthesized = self.env_fault.format(detail=observation), True
        return self.step(
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
            edited_by=edited_by,
            proposed=proposed,
            settled_by=settled_by,
        )

    def decided(
        self,
        index: int,
        reply: ModelReply,
        times: StepTimes,
        decision: FinalAnswer | InvalidDecision,
    ) -> StepRecord:
        """The step record of a reply the interpreter took as an answer or found invalid."""
        if isinstance(decision, FinalAnswer):
            return self.step(
                index,
                reply,
                times,
                decision=DecisionKind.FINAL,
                history_text=decision.history_text,
                final_answer=decision.answer,
            )
        return self.step(
            index,
            reply,
            times,
            decision=DecisionKind.INVALID,
            history_text=decision.history_text,
            observation=decision.feedback,
            observation_synthesized=True,
        )

    def step(
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
        edited_by: str | None = None,
        proposed: str | None = None,
        settled_by: str | None = None,
    ) -> StepRecord:
        """A step record; its duration runs from ``times.began`` to now."""
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
            edited_by=edited_by,
            proposed_action_text=proposed,
            settled_by=settled_by,
        )

    def end(
        self,
        reason: StopReason,
        detail: str | None,
        used: Counters,
        final_answer: str | None,
        *,
        cancelled_by: str | None = None,
    ) -> RunEnded:
        """The end record; only a final answer's end carries the answer, and only the
        end a person's cancel asked for names who (``cancelled_by``)."""
        return RunEnded(
            run_id=self.run_id,
            stop_reason=reason,
            final_answer=final_answer if reason is StopReason.FINAL_ANSWER else None,
            steps=used.steps,
            valid_steps=used.valid_steps,
            detail=detail,
            at=now(),
            cancelled_by=cancelled_by if reason is StopReason.CANCELLED_BY_REQUEST else None,
        )
