"""The ``AgentRun`` workflow: one PolyLoop run, its waits for people, and its status.

Workflow code, so deterministic: it keeps no clock or randomness of its own, does no
I/O, and reaches the store only through activities (named, so that this module never
imports the code that drives runs). It imports the standard library, ``temporalio``,
the plain input values and reports and the kernel's types, which the sandbox can load.
Activities' results arrive as JSON and are read into frozen values at once.

The run loop: drive a segment (one activity, ``start_or_resume`` under heartbeats);
when the run stops for an approval or an effect in doubt, wait for the update that
answers it (or, for an approval, for the deadline's durable timer); drive on. Every
answer is applied by an activity through ``polyloop.approve``/``reject``/``settle``,
so PolyLoop's log records it like any other answer.
"""

from __future__ import annotations

import dataclasses
import enum
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

from polyloop.temporal._reports import Carried, SegmentOutcome, StatusSummary, Waiting
from polyloop.temporal._values import (
    DEADLINE_BY,
    AnswerInput,
    AnswerKind,
    ApproveInput,
    OnApprovalTimeout,
    RejectInput,
    RunInput,
    SegmentInput,
    SettleInput,
)
from polyloop.types import JSONValue, RunState

__all__ = (
    "ANSWER_ACTIVITY",
    "AgentRun",
    "DRIVE_ACTIVITY",
    "NOT_RETRYABLE",
    "STATUS_ACTIVITY",
    "WORKFLOW_NAME",
)

WORKFLOW_NAME = "PolyLoopAgentRun"
DRIVE_ACTIVITY = "polyloop.drive_segment"
ANSWER_ACTIVITY = "polyloop.answer"
STATUS_ACTIVITY = "polyloop.status"

NOT_RETRYABLE = (
    "AmendmentRefused",
    "CorruptLog",
    "InvalidRequest",
    "NotAwaitingApproval",
    "NotInDoubt",
    "RunIdentityMismatch",
    "RunNotFound",
    "SchemaMajorMismatch",
    "UnknownAgent",
    "UnloggableValue",
)
"""PolyLoop errors that another attempt cannot cure: the workflow fails (or the update
is refused) at once. ``RunLocked`` (and ``LeaseLost``) and ``StoreError`` are retried."""

# RunLocked while a dead worker's claim is still held is retried with back-off: the
# claim goes when the operating system frees a dead process's locks, or when a
# PostgreSQL lease ends (at most 12.5 s with the default lease).
_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=0.5),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=10),
    non_retryable_error_types=list(NOT_RETRYABLE),
)
_ANSWER_TIMEOUT = timedelta(minutes=5)


class Ended(enum.StrEnum):
    """How a workflow run ended, as its status says."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    CONTINUED = "continued"


@workflow.defn(name=WORKFLOW_NAME)
class AgentRun:
    """A PolyLoop run as a Temporal workflow; start it with the run id as workflow id."""

    def __init__(self) -> None:
        self._input: RunInput | None = None
        self._status = StatusSummary(run_id="", state=RunState.RUNNING)
        self._waiting: Waiting | None = None
        self._waiting_for: str | None = None  # the result id of the proposal or intent
        self._answering = False
        self._answers_awaiting_a_stop = 0
        self._finished = False
        self._segments = 0
        self._continued = 0
        self._deadline: str | None = None
        self._deadline_passed = False
        self._ended: Ended | None = None
        self._error: str | None = None

    @workflow.run
    async def run(self, input: RunInput) -> dict[str, Any]:
        """Drive the run to its end; the outcome has ``stop_reason`` and ``final_answer``.

        Cancellation: cancelling the workflow cancels the segment that drives the run;
        PolyLoop writes the run's ``cancelled`` end record within its grace, the log keeps
        every record written before it, and the workflow then ends cancelled, its status
        saying so.
        """
        self._status = dataclasses.replace(self._status, run_id=input.run_id)
        try:
            _check_workflow_id(input)
            _check_input(input)
            self._input = input
            self._carry_on(input)
            outcome = await self._drive(input)
        except BaseException as err:
            self._end_with(err)
            raise
        self._ended = Ended.COMPLETED
        return outcome.result_json()

    async def _drive(self, input: RunInput) -> SegmentOutcome:
        while True:
            outcome = await self._segment(input)
            waiting = Waiting.after(outcome.stop_reason)
            if waiting is None:
                self._finished = True
                # Updates still waiting learn that the run ended before they return.
                await workflow.wait_condition(workflow.all_handlers_finished)
                return outcome
            await self._wait(waiting, input)
            await self._continue_as_new_if_due(input)

    @workflow.query
    def status(self) -> dict[str, Any]:
        """Where the run stands, as ``polyloop.run_status`` said after the last segment.

        While a segment runs, ``state`` is ``"running"`` and the counts are those of the
        segment's start. ``waiting_for`` is ``"approval"``, ``"settlement"`` or ``None``;
        ``deadline`` is when the approval deadline fires (ISO 8601, UTC). ``proposal``
        and ``open_intent`` show what waits once, bounded and escaped; ``ended`` is
        ``None`` until the workflow ends ``"completed"``, ``"failed"`` (``error`` says
        why), ``"cancelled"`` or ``"continued"`` (as new).
        """
        return {
            **self._status.to_json(),
            "waiting_for": self._waiting.value if self._waiting is not None else None,
            "deadline": self._deadline,
            "deadline_passed": self._deadline_passed,
            "segments": self._segments,
            "continued_as_new": self._continued,
            "ended": self._ended.value if self._ended is not None else None,
            "error": self._error,
        }

    @workflow.update
    async def approve(self, answer: ApproveInput) -> dict[str, Any]:
        """Approve the proposed action; returns the verdict as PolyLoop logged it.

        Cancellation: the verdict is one record, in the log whole or not at all; a
        workflow cancelled meanwhile leaves the run awaiting approval or approved.
        """
        return await self._apply(
            Waiting.APPROVAL,
            answer.result_id,
            AnswerKind.APPROVE,
            by=answer.by,
            arguments=answer.arguments,
        )

    @approve.validator
    def _approve_checked(self, answer: ApproveInput) -> None:
        _text("by", answer.by)
        self._open_for(Waiting.APPROVAL, answer.result_id)

    @workflow.update
    async def reject(self, answer: RejectInput) -> dict[str, Any]:
        """Reject the proposed action; returns the verdict as PolyLoop logged it.

        Cancellation: the verdict is one record, in the log whole or not at all; a
        workflow cancelled meanwhile leaves the run awaiting approval or rejected.
        """
        return await self._apply(
            Waiting.APPROVAL,
            answer.result_id,
            AnswerKind.REJECT,
            by=answer.by,
            reason=answer.reason,
        )

    @reject.validator
    def _reject_checked(self, answer: RejectInput) -> None:
        _text("by", answer.by)
        _text("reason", answer.reason)
        self._open_for(Waiting.APPROVAL, answer.result_id)

    @workflow.update
    async def settle(self, answer: SettleInput) -> dict[str, Any]:
        """Settle the action in doubt; returns the settlement as PolyLoop logged it.

        Cancellation: the settlement is one record, in the log whole or not at all; a
        workflow cancelled meanwhile leaves the run in doubt or settled.
        """
        return await self._apply(
            Waiting.SETTLEMENT,
            answer.result_id,
            AnswerKind.SETTLE,
            by=answer.by,
            ran=answer.ran,
            observation=answer.observation,
        )

    @settle.validator
    def _settle_checked(self, answer: SettleInput) -> None:
        _text("by", answer.by)
        if not isinstance(answer.ran, bool):
            raise ApplicationError("ran must be true or false", type="InvalidRequest")
        if not isinstance(answer.observation, str):
            raise ApplicationError("observation must be a string", type="InvalidRequest")
        self._open_for(Waiting.SETTLEMENT, answer.result_id)

    @workflow.update
    async def redrive(self) -> dict[str, Any]:
        """Read the run's status from the store and drive on if it no longer waits.

        For an answer given outside Temporal (``polyloop approve``, ``reject`` or
        ``settle`` on the command line, or the functions): the log has it, the workflow
        does not. If the run still waits for what the workflow waits for, nothing
        changes. Returns the status read, with ``redriven`` saying whether the run goes on.

        Cancellation: it only reads; a workflow cancelled meanwhile leaves the log as it was.
        """
        await workflow.wait_condition(lambda: not self._answering)
        if self._waiting is None:
            return {**self.status(), "redriven": False}
        waiting = self._waiting
        self._answering = True
        try:
            read = await self._read_status()
        finally:
            self._answering = False
        # A run answered outside Temporal and driven on to its next stop no longer
        # waits on the very proposal or intent this workflow does.
        if self._waiting != waiting or read.still_waits(waiting, self._waiting_for):
            return {**read.to_json(), "redriven": False}
        self._waiting = None
        return {**read.to_json(), "redriven": True}

    @redrive.validator
    def _redrive_checked(self) -> None:
        if self._finished:
            raise ApplicationError(f"run {self._run_id()!r} has finished", type="RunFinished")

    async def _read_status(self) -> StatusSummary:
        read: dict[str, JSONValue] = await workflow.execute_activity(
            STATUS_ACTIVITY,
            SegmentInput(agent=self._agent(), run_id=self._run_id()),
            result_type=dict,
            start_to_close_timeout=_ANSWER_TIMEOUT,
            retry_policy=_RETRY,
        )
        return StatusSummary.from_json(read)

    # -- the run loop ---------------------------------------------------------------------

    def _carry_on(self, input: RunInput) -> None:
        """Take over what the workflow run before this one, if any, handed on."""
        if not input.carried:
            return
        carried = Carried.from_json(input.carried)
        self._segments, self._continued = carried.segments, carried.continued_as_new
        if carried.status is not None:
            self._status = carried.status

    async def _continue_as_new_if_due(self, input: RunInput) -> None:
        """Continue as new between segments when the history has grown long enough.

        Only the run's input and a few counts go on: the run is in PolyLoop's log. An
        answer sent while the run is driven waits, as a running handler, for the next
        stop; with one pending the workflow drives on and continues as new later.
        """
        info = workflow.info()
        limit = input.continue_as_new_after_events
        due = info.is_continue_as_new_suggested() or (
            limit is not None and info.get_current_history_length() >= limit
        )
        if not due:
            return
        await workflow.wait_condition(
            lambda: workflow.all_handlers_finished() or self._answers_awaiting_a_stop > 0
        )
        if self._answers_awaiting_a_stop > 0:
            return
        carried = Carried(
            segments=self._segments, continued_as_new=self._continued + 1, status=self._status
        )
        workflow.continue_as_new(dataclasses.replace(input, carried=carried.to_json()))

    def _end_with(self, err: BaseException) -> None:
        """The status a workflow that ends by ``err`` leaves for queries to read."""
        self._waiting = None
        if isinstance(err, workflow.ContinueAsNewError):
            self._ended = Ended.CONTINUED
        elif is_cancelled_exception(err):
            self._ended = Ended.CANCELLED
            # A cancelled segment: the run's log ends with its cancelled record.
            self._status = self._status.cancelled()
        else:
            self._ended = Ended.FAILED
            self._error = _failure_text(err)

    async def _segment(self, input: RunInput) -> SegmentOutcome:
        self._segments += 1
        self._status = self._status.driven()
        outcome: dict[str, JSONValue] = await workflow.execute_activity(
            DRIVE_ACTIVITY,
            SegmentInput(
                agent=input.agent,
                run_id=input.run_id,
                input=input.input,
                heartbeat_timeout=input.heartbeat_timeout,
            ),
            result_type=dict,
            start_to_close_timeout=timedelta(seconds=input.segment_timeout),
            heartbeat_timeout=timedelta(seconds=input.heartbeat_timeout),
            retry_policy=_RETRY,
            # A cancelled workflow waits for the run's CANCELLED end record.
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        segment = SegmentOutcome.from_json(outcome)
        self._status = segment.status
        return segment

    async def _wait(self, waiting: Waiting, input: RunInput) -> None:
        self._waiting, self._waiting_for = waiting, self._status.open_for(waiting)
        self._deadline, self._deadline_passed = None, False
        timeout = input.approval_timeout if waiting is Waiting.APPROVAL else None
        if timeout is None:
            await workflow.wait_condition(lambda: self._waiting is None)
            return
        self._deadline = (workflow.now() + timedelta(seconds=timeout)).isoformat()
        try:
            await workflow.wait_condition(lambda: self._waiting is None, timeout=timeout)
            return
        except TimeoutError:
            self._deadline_passed = True
        if OnApprovalTimeout(input.on_approval_timeout) is OnApprovalTimeout.REJECT:
            await self._reject_at_deadline(input)
        await workflow.wait_condition(lambda: self._waiting is None)

    async def _reject_at_deadline(self, input: RunInput) -> None:
        # An answer under way goes first; if it lands, the deadline has nothing to do.
        await workflow.wait_condition(lambda: not self._answering)
        if self._waiting is None:
            return
        self._answering = True
        try:
            await self._answer(
                AnswerInput(
                    agent=input.agent,
                    run_id=input.run_id,
                    kind=AnswerKind.REJECT,
                    by=DEADLINE_BY,
                    reason=input.approval_timeout_reason,
                    result_id=self._waiting_for,
                )
            )
        except ApplicationError as err:
            # Answered outside Temporal meanwhile: the next segment reads it.
            if err.type != Waiting.APPROVAL.refusal:
                raise
        finally:
            self._answering = False
        self._waiting = None

    # -- answers ----------------------------------------------------------------------------

    def _open_for(self, kind: Waiting, result_id: str | None) -> None:
        """Refuse, before it is accepted, an answer the run can no longer take."""
        if self._finished:
            raise self._refused(kind, "has finished")
        if self._waiting is not None and self._waiting is not kind:
            raise self._refused(kind, f"waits for {self._waiting.words}, not {kind.words}")
        if self._waiting is kind and result_id is not None and result_id != self._waiting_for:
            raise self._refused(kind, f"waits on {self._waiting_for!r}, not {result_id!r}")

    def _refused(self, kind: Waiting, why: str) -> ApplicationError:
        return ApplicationError(
            f"run {self._run_id()!r} {why}", type=kind.refusal, non_retryable=True
        )

    async def _apply(
        self, kind: Waiting, result_id: str | None, answer: AnswerKind, **fields: Any
    ) -> dict[str, JSONValue]:
        """Write a person's ``answer`` (with its ``fields``) for what the run waits on,
        once the run has stopped and only if it still waits on ``result_id``."""
        # An answer sent while the run is driven waits for the run to stop; it answers
        # the first stop it sees, and only that one.
        self._answers_awaiting_a_stop += 1
        try:
            await workflow.wait_condition(lambda: self._waiting is not None or self._finished)
        finally:
            self._answers_awaiting_a_stop -= 1
        target = result_id if result_id is not None else self._waiting_for
        await workflow.wait_condition(lambda: not self._answering)
        if self._finished or self._waiting is not kind or self._waiting_for != target:
            now = f"; it waits on {self._waiting_for!r}" if self._waiting is kind else ""
            named = f" ({target!r})" if target else ""
            raise self._refused(kind, f"no longer waits for this {kind.words}{named}{now}")
        self._answering = True
        try:
            logged = await self._answer(
                AnswerInput(
                    agent=self._agent(),
                    run_id=self._run_id(),
                    kind=answer,
                    result_id=self._waiting_for,
                    **fields,
                )
            )
        finally:
            self._answering = False
        self._waiting = None
        return logged

    async def _answer(self, answer: AnswerInput) -> dict[str, JSONValue]:
        """Write ``answer`` through the answer activity; the record as the log has it."""
        try:
            logged: dict[str, JSONValue] = await workflow.execute_activity(
                ANSWER_ACTIVITY,
                answer,
                result_type=dict,
                start_to_close_timeout=_ANSWER_TIMEOUT,
                retry_policy=_RETRY,
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                # The update fails with PolyLoop's own error; the workflow goes on.
                raise ApplicationError(
                    cause.message, *cause.details, type=cause.type, non_retryable=True
                ) from err
            raise
        return logged

    def _agent(self) -> str:
        assert self._input is not None
        return self._input.agent

    def _run_id(self) -> str:
        return self._input.run_id if self._input is not None else "?"


def _check_workflow_id(input: RunInput) -> None:
    if workflow.info().workflow_id != input.run_id:
        # The workflow id is what keeps a run to one workflow: refuse any other.
        raise ApplicationError(
            f"run {input.run_id!r}: the workflow id must be the run id, not "
            f"{workflow.info().workflow_id!r}",
            type="InvalidRequest",
            non_retryable=True,
        )


def _check_input(input: RunInput) -> None:
    """Refuse, before anything runs, settings no segment or deadline could work with."""
    problems = []
    if not input.heartbeat_timeout > 0:
        problems.append(f"heartbeat_timeout must be positive, not {input.heartbeat_timeout!r}")
    if not input.segment_timeout > 0:
        problems.append(f"segment_timeout must be positive, not {input.segment_timeout!r}")
    if input.approval_timeout is not None and not input.approval_timeout > 0:
        problems.append(f"approval_timeout must be positive, not {input.approval_timeout!r}")
    limit = input.continue_as_new_after_events
    if limit is not None and not limit > 0:
        problems.append(f"continue_as_new_after_events must be positive, not {limit!r}")
    if input.on_approval_timeout not in [choice.value for choice in OnApprovalTimeout]:
        problems.append(
            f"on_approval_timeout must be 'reject' or 'wait', not {input.on_approval_timeout!r}"
        )
    if problems:
        raise ApplicationError(
            f"run {input.run_id!r}: " + "; ".join(problems),
            type="InvalidRequest",
            non_retryable=True,
        )


def _failure_text(err: BaseException) -> str:
    """What the status's ``error`` says of the failure that ended the workflow."""
    cause = err.cause if isinstance(err, ActivityError) and err.cause else err
    kind = cause.type if isinstance(cause, ApplicationError) else None
    message = cause.message if isinstance(cause, ApplicationError) else str(cause)
    return f"{kind or type(cause).__name__}: {message}"[:4096]


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ApplicationError(f"{name} must be a non-empty string", type="InvalidRequest")
