"""Offline replay: a model and an executor that answer from one recorded run's log.

Re-driving a recorded run with these two in place of the real model and environment
checks that today's code (an interpreter, a template, a release of PolyLoop) decides on
the old run as the recorded run decided, without calling a model or touching the world.
Both check what they are asked against the record before answering, and say at which
step the re-driven run first asked for something the recorded one did not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import anyio
import anyio.lowlevel

from polyloop._assembly import messages_sha256
from polyloop._shared import canonical_json, exception_text, plain_copy
from polyloop.ports import Action, ActionOutcome, ModelCall, ModelReply
from polyloop.session._checks import outcome_problem, reply_from
from polyloop.testing._divergence import first_difference, recorded_history
from polyloop.types import (
    ActionStatus,
    CorruptLog,
    Intent,
    IntentKind,
    JSONValue,
    Replay,
    Result,
    RunLog,
    RunNotFound,
    RunStarted,
    StepRecord,
    UnloggableValue,
)

__all__ = ("RecordedExecutor", "RecordedModelClient", "RecordedModelFailure", "ReplayDiverged")


class ReplayDiverged(AssertionError):
    """A re-driven run asked for something its recorded run did not, at ``step``.

    An ``AssertionError``, not a :class:`~polyloop.types.PolyLoopError`: it says that
    the code under test decided differently from the record, which is a failed
    expectation of a test, not a fault of a run, a store or a log; code that handles
    PolyLoop's errors in production must not catch it by accident, and pytest reports it
    as the failed check it is.

    The loop records whatever a model client raises as the step's model failure, so
    inside a run this error does not propagate: the run ends with
    ``StopReason.MODEL_FAILURE`` and its ``detail`` is this error's text. Each double
    also keeps the divergences it saw, and :meth:`RecordedModelClient.check` raises
    the first.
    """

    run_id: str
    recorded_run_id: str
    step: int
    reason: str

    def __init__(self, reason: str, *, run_id: str, recorded_run_id: str, step: int) -> None:
        self.reason = reason
        self.run_id = run_id
        self.recorded_run_id = recorded_run_id
        self.step = step
        super().__init__(
            f"run {run_id!r}, step {step} (re-driving run {recorded_run_id!r}): {reason}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only fields do not survive the default pickling, which replays args.
        fields = {"run_id": self.run_id, "recorded_run_id": self.recorded_run_id}
        return (_rebuild, (self.reason, fields, self.step))


def _rebuild(reason: str, fields: dict[str, str], step: int) -> ReplayDiverged:
    return ReplayDiverged(reason, step=step, **fields)


class RecordedModelFailure(Exception):
    """The base of the failures a :class:`RecordedModelClient` raises again.

    Each is raised as a subclass named as the recorded exception was, with its
    message, so that the step records the very error text the recorded step did.
    """


@functools.cache
def _failure_class(name: str) -> type[RecordedModelFailure]:
    return type(name, (RecordedModelFailure,), {"__module__": __name__})


def _failure(error: str) -> RecordedModelFailure:
    """The exception whose record text is ``error`` (``"ExceptionClass: message"``)."""
    name, _, message = error.partition(": ")
    return _failure_class(name)(message)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Called:
    """What the recorded run sent to its model at one step, and what came back."""

    step: int
    result_id: str
    messages_sha256: str | None
    payload: JSONValue


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Acted:
    """The action the recorded run performed at one step, and how it went."""

    step: int
    payload: JSONValue
    shown: str  # the payload as canonical JSON, as actions are compared with it
    replay: Replay
    outcome: ActionOutcome | None


def _started(log: RunLog) -> RunStarted:
    if not log.records:
        raise RunNotFound("the log holds no record of the run to re-drive", run_id=log.run_id)
    first = log.records[0]
    if not isinstance(first, RunStarted):
        raise CorruptLog("the log does not begin with its start record", run_id=log.run_id)
    return first


def _effects(log: RunLog, kind: IntentKind) -> list[tuple[Intent, Result | None]]:
    """Each intent of ``kind`` in the log, with its result if one was recorded.

    A step announced twice (a crash, then a resume) counts as announced last.
    """
    results = {
        record.result_id: record
        for record in log.records
        if isinstance(record, Result) and record.kind is kind
    }
    intents = {
        record.step: record
        for record in log.records
        if isinstance(record, Intent) and record.kind is kind
    }
    return [(intent, results.get(intent.result_id)) for _, intent in sorted(intents.items())]


def _step_of(result_id: str) -> int:
    """The step in a result id the library allocated (``<run_id>:<step>:<kind>``)."""
    parts = result_id.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        raise ValueError(f"{result_id!r} is not a result id of the form <run_id>:<step>:<kind>")
    return int(parts[1])


def _shown(payload: JSONValue) -> str:
    """A payload as canonical JSON, to compare and to quote (``repr`` if it is not JSON)."""
    try:
        return canonical_json(plain_copy(payload))
    except (UnloggableValue, ValueError, TypeError, RecursionError):
        return repr(payload)


class RecordedModelClient:
    """A model client that answers call ``i`` of a run as its recorded run's step ``i`` was.

    Built from the :class:`~polyloop.types.RunLog` of the recorded run
    (``await store.read_log(run_id)`` on any store) with :meth:`from_log`. Calls are
    keyed by ``call_index``, so the re-driven run may have any run id, and one client can
    serve several re-driven runs at once. Before it answers a call it checks that the
    messages are those the recorded run sent at that step: the SHA-256 the loop recorded
    in the step's model-call intent (``messages_sha256``) must be the digest of the
    messages it is sent, computed the same way.

    The answer is the recorded reply, every field as recorded; a recorded model failure
    is raised again as a :class:`RecordedModelFailure` named as the recorded exception
    was, so the re-driven step records the same error text.

    It raises :class:`ReplayDiverged`, naming the re-driven run and the step, when the
    messages differ, when the call is past the recorded steps, or when the step has no
    recorded reply (the recorded run stopped before it was answered, or, in a fork, the
    step was inherited: a fork's own calls begin at its ``forked_at_step``, so a fork is
    re-driven with :func:`polyloop.fork` at that step). Every divergence is also kept in
    :attr:`divergences`, and every call in :attr:`calls`.
    """

    def __init__(
        self,
        log: RunLog,
        *,
        delay: float = 0.0,
    ) -> None:
        started = _started(log)
        self.recorded_run_id = log.run_id
        self._forked_at = started.forked_at_step or 0
        self._forked_from = started.forked_from
        self._called = {
            intent.step: _Called(
                step=intent.step,
                result_id=intent.result_id,
                messages_sha256=_recorded_digest(intent),
                payload=None if result is None else _checked_payload(result, log.run_id),
            )
            for intent, result in _effects(log, IntentKind.MODEL_CALL)
        }
        self._steps = sorted(
            (record for record in log.records if isinstance(record, StepRecord)),
            key=lambda step: step.step,
        )
        template = started.snapshot.get("observation_template")
        self._template = template if isinstance(template, str) else None
        self._delay = delay
        self.calls: list[ModelCall] = []
        self.divergences: list[ReplayDiverged] = []

    @classmethod
    def from_log(cls, log: RunLog, *, delay: float = 0.0) -> RecordedModelClient:
        """The client answering from ``log``, a run's log as any store reads it back.

        Raises ``RunNotFound`` for an empty log, ``CorruptLog`` for a log whose start
        record is not first or whose model result holds neither a reply nor a failure.
        ``delay`` is how long each call waits before answering (to cancel one in flight).
        """
        return cls(log, delay=delay)

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "recorded", "recorded_run_id": self.recorded_run_id}

    async def call(self, call: ModelCall) -> ModelReply:
        """Answer ``call`` as the recorded run's model answered the same step.

        Cancellation: propagates from the delay (or the checkpoint), before any check.
        """
        self.calls.append(call)
        if self._delay:
            await anyio.sleep(self._delay)
        else:
            await anyio.lowlevel.checkpoint()
        called = self._recorded(call)
        sent = messages_sha256(call.messages)
        if sent != called.messages_sha256:
            raise self._diverged(
                call,
                f"the messages differ from those the recorded run sent at this step"
                f"{self._where(call)} (sha256 {sent}, recorded {called.messages_sha256})",
            )
        payload = called.payload
        if isinstance(payload, dict) and "error" in payload:
            raise _failure(str(payload["error"]))
        return reply_from(payload, self.recorded_run_id, called.result_id)

    def check(self) -> None:
        """Raise the first :class:`ReplayDiverged` this client saw, if any."""
        if self.divergences:
            raise self.divergences[0]

    def _recorded(self, call: ModelCall) -> _Called:
        step = call.call_index
        called = self._called.get(step)
        if called is not None and called.payload is not None:
            return called
        if step < self._forked_at:
            raise self._diverged(
                call,
                f"the recorded run is a fork of run {self._forked_from!r} at step "
                f"{self._forked_at}: it inherited this step and made no model call at it "
                f"(re-drive it with polyloop.fork at step {self._forked_at})",
            )
        if called is not None:
            raise self._diverged(call, "the recorded run's model call at this step has no result")
        return self._past_the_end(call)

    def _past_the_end(self, call: ModelCall) -> _Called:
        if not self._called:
            raise self._diverged(call, "the recorded run made no model call")
        first, last = min(self._called), max(self._called)
        raise self._diverged(
            call, f"the recorded run made its model calls at steps {first} to {last} only"
        )

    def _where(self, call: ModelCall) -> str:
        if self._template is None:
            return ""
        history = recorded_history(self._steps, self._template, call.call_index)
        return f": {first_difference(history, call.messages)}"

    def _diverged(self, call: ModelCall, reason: str) -> ReplayDiverged:
        diverged = ReplayDiverged(
            reason, run_id=call.run_id, recorded_run_id=self.recorded_run_id, step=call.call_index
        )
        self.divergences.append(diverged)
        return diverged


def _recorded_digest(intent: Intent) -> str | None:
    payload = intent.payload
    digest = payload.get("messages_sha256") if isinstance(payload, dict) else None
    return digest if isinstance(digest, str) else None


def _checked_payload(result: Result, run_id: str) -> JSONValue:
    """The model result's payload, checked now so that a bad record fails at once."""
    payload = result.payload
    if isinstance(payload, dict) and "error" in payload:
        error = payload["error"]
        name = error.partition(": ")[0] if isinstance(error, str) else ""
        if not (isinstance(error, str) and ": " in error and name.isidentifier()):
            raise CorruptLog(
                f"model result {result.result_id!r} holds an error that is not an "
                f"exception's text: {error!r:.80}",
                run_id=run_id,
            )
        return payload
    reply_from(payload, run_id, result.result_id)
    return payload


class RecordedExecutor:
    """An action executor that answers each action as its recorded run's action went.

    Built from the :class:`~polyloop.types.RunLog` of the recorded run with
    :meth:`from_log`. The step comes from the result id the library allocates
    (``"<run_id>:<step>:action"``), so the re-driven run may have any run id. The
    action must be the one the recorded run performed at that step (the same payload,
    compared as canonical JSON); the answer is then the recorded outcome, exactly as the
    recorded executor returned it, and :meth:`replay` gives the recorded intent's policy.

    An action the recorded run did not perform at that step, or performed with another
    payload, is refused: the outcome is ``NOT_EXECUTED``, its observation the text of a
    :class:`ReplayDiverged` naming the re-driven run and the step, and the divergence is
    kept in :attr:`divergences`. Refusing, not raising, is what the executor contract
    asks of an action an executor will not perform; the re-driven run's next model call
    then differs from the recorded one, so a :class:`RecordedModelClient` stops the run
    one step later. Every execution's result id is kept in :attr:`executions`.
    """

    def __init__(self, log: RunLog, *, delay: float = 0.0) -> None:
        _started(log)
        self.recorded_run_id = log.run_id
        self._acted = {
            intent.step: _Acted(
                step=intent.step,
                payload=intent.payload,
                shown=_shown(intent.payload),
                replay=intent.replay,
                outcome=None if result is None else _outcome_from(result, log.run_id),
            )
            for intent, result in _effects(log, IntentKind.ACTION)
        }
        self._delay = delay
        self.executions: list[str] = []
        self.divergences: list[ReplayDiverged] = []

    @classmethod
    def from_log(cls, log: RunLog, *, delay: float = 0.0) -> RecordedExecutor:
        """The executor answering from ``log``, a run's log as any store reads it back.

        Raises ``RunNotFound`` for an empty log, ``CorruptLog`` for a log whose start
        record is not first or whose action result is not an outcome. ``delay`` is how
        long each execution waits before answering (to cancel one in flight).
        """
        return cls(log, delay=delay)

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Answer as the recorded action of the step in ``result_id`` went.

        Cancellation: propagates from the delay (or the checkpoint); the execution is
        already counted in :attr:`executions`.
        """
        self.executions.append(result_id)
        if self._delay:
            await anyio.sleep(self._delay)
        else:
            await anyio.lowlevel.checkpoint()
        step = _step_of(result_id)
        acted = self._acted.get(step)
        if acted is None:
            return self._refuse(result_id, step, "the recorded run performed no action at it")
        now, recorded = _shown(action.payload), acted.shown
        if now != recorded:
            return self._refuse(
                result_id,
                step,
                f"the recorded run performed another action at it: {recorded:.300}, not {now:.300}",
            )
        if acted.outcome is None:
            return self._refuse(result_id, step, "the recorded run's action has no result")
        return acted.outcome

    def replay(self, action: Action) -> Replay:
        """The replay policy the recorded run announced this action with.

        The first recorded action with the same payload decides; an action the recorded
        run never performed is ``Replay.NEVER`` (``execute`` refuses it anyway).
        """
        shown = _shown(action.payload)
        for acted in self._acted.values():
            if acted.shown == shown:
                return acted.replay
        return Replay.NEVER

    def check(self) -> None:
        """Raise the first :class:`ReplayDiverged` this executor saw, if any."""
        if self.divergences:
            raise self.divergences[0]

    def _refuse(self, result_id: str, step: int, reason: str) -> ActionOutcome:
        diverged = ReplayDiverged(
            reason,
            run_id=result_id.rsplit(":", 2)[0],
            recorded_run_id=self.recorded_run_id,
            step=step,
        )
        self.divergences.append(diverged)
        return ActionOutcome(
            status=ActionStatus.NOT_EXECUTED,
            observation=exception_text(diverged),
            synthesized=True,
            done=False,
        )


def _outcome_from(result: Result, run_id: str) -> ActionOutcome:
    """The outcome an action result holds (as the loop's ``outcome_payload`` wrote it)."""
    payload = result.payload
    problem: str | None = "it is not an object"
    if isinstance(payload, dict):
        try:
            outcome = ActionOutcome(
                status=ActionStatus(str(payload.get("status"))),
                observation=payload.get("observation"),  # type: ignore[arg-type]
                synthesized=payload.get("synthesized"),  # type: ignore[arg-type]
                done=payload.get("done"),  # type: ignore[arg-type]
                truncated_chars=payload.get("truncated_chars", 0),  # type: ignore[arg-type]
            )
        except ValueError as exc:
            problem = str(exc)
        else:
            problem = outcome_problem(outcome)
    if problem is not None:
        raise CorruptLog(
            f"action result {result.result_id!r} holds no outcome: {problem}", run_id=run_id
        )
    return outcome
