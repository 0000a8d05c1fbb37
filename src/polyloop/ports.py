"""The five seams a downstream project fills in, and the values that cross them.

Every seam is a :class:`typing.Protocol`: an object satisfies it by shape, without
inheriting from anything here. Definition-level seams (model client, interpreter, store,
event sink) report ``parameters()``, the reproducibility facts that go into a run's
snapshot; the action executor belongs to one request and reports none.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from polyloop.types import (
    ActionStatus,
    Intent,
    JSONValue,
    Message,
    Record,
    Replay,
    Result,
    RunEnded,
    RunLog,
    RunStarted,
    StepRecord,
)

__all__ = (
    "Action",
    "ActionExecutor",
    "ActionOutcome",
    "Decision",
    "Event",
    "EventKind",
    "EventSink",
    "FinalAnswer",
    "Interpreter",
    "InvalidDecision",
    "ModelCall",
    "ModelClient",
    "ModelReply",
    "NullSink",
    "Store",
)

@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCall:
    """One call to the model: the assembled messages and where the call belongs.

    ``call_index`` counts model calls within the run from 0; ``result_id`` is the id the
    library allocated for this call's result before making it; ``binding`` is the
    request's binding, passed through untouched.
    """

    messages: tuple[Message, ...]
    call_index: int
    run_id: str
    result_id: str
    binding: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelReply:
    """What the model answered. ``call_id`` is the caller's ledger key; never ``""``."""

    call_id: str | None
    content: str
    reasoning: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """Run this action. ``payload`` goes to the executor; the texts go to the trajectory."""

    payload: JSONValue
    action_text: str
    history_text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalAnswer:
    """The model answered; the run ends with ``FINAL_ANSWER``."""

    answer: str
    history_text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidDecision:
    """The reply could not be used; ``feedback`` is fed back to the model verbatim."""

    feedback: str
    history_text: str


Decision: TypeAlias = Action | FinalAnswer | InvalidDecision
"""The three branches an interpreter can choose."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionOutcome:
    """How an action went.

    ``observation`` is what the model will see; for ``NOT_EXECUTED`` it is the refusal
    reason and for ``ENV_FAULT`` the fault detail, which the library wraps in its
    templates. ``done`` is the environment's own done signal (``False`` where the
    environment has none).
    """

    status: ActionStatus
    observation: str
    synthesized: bool
    done: bool
    truncated_chars: int = 0


@runtime_checkable
class ModelClient(Protocol):
    """Calls a model. Failure is an exception; the library never retries."""

    def parameters(self) -> Mapping[str, JSONValue]:
        """The reproducibility parameters of this client (model identity, sampling)."""
        ...

    async def call(self, call: ModelCall) -> ModelReply:
        """Make one model call.

        Cancellation: the library cancels this call when the run is cancelled; it must
        let the cancellation propagate. The model-call intent is already durable, so a
        later ``resume`` replays the call only if the request's model replay allows it.
        """
        ...


@runtime_checkable
class Interpreter(Protocol):
    """Turns a model reply into a decision. Pure and synchronous."""

    def parameters(self) -> Mapping[str, JSONValue]:
        """The reproducibility parameters of this interpreter."""
        ...

    def interpret(self, reply: ModelReply) -> Decision:
        """Choose one of the three branches for ``reply``."""
        ...


@runtime_checkable
class ActionExecutor(Protocol):
    """Performs actions for one run. Discrimination is by status, never by exception."""

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Perform ``action``; ``result_id`` is stable across a replay after a crash.

        Cancellation: must propagate. The action intent is already durable; ``resume``
        performs the action again (same ``result_id``) only if ``replay`` allowed it.
        """
        ...

    def replay(self, action: Action) -> Replay:
        """Whether ``action`` may be performed again if its outcome was lost."""
        ...


@runtime_checkable
class Store(Protocol):
    """Persists the records of runs. Every method names its run explicitly.

    ``write_intent`` is a durable barrier: when it returns, the intent survives a crash
    of the process (and, for stores that promise it, of the machine). ``write_step``
    lands the step and its action result together or not at all.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        """What changes the meaning of the log (kind, record format), never a path."""
        ...

    async def start_run(self, record: RunStarted) -> None:
        """Write the first record of a run; ``RunAlreadyExists`` if it has records.

        Cancellation: either the record landed whole or not at all.
        """
        ...

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent and make it durable before returning.

        Cancellation: either the intent landed whole or not at all; a cancelled caller
        cannot tell which, and recovery does not need to.
        """
        ...

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call.

        Cancellation: either the result landed whole or not at all.
        """
        ...

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write a step record and its action's result atomically.

        ``read_log`` returns the action result immediately before the step record.

        Cancellation: both records landed or neither did.
        """
        ...

    async def read_log(self, run_id: str) -> RunLog:
        """Read every record of ``run_id`` in write order (empty if there is none).

        Cancellation: reading changes nothing on disk.
        """
        ...

    async def end_run(self, record: RunEnded) -> None:
        """Write the end record of a run and release the run's writer lock.

        Cancellation: either the record landed whole or not at all.
        """
        ...


class EventKind(enum.StrEnum):
    """What an event reports."""

    RUN_STARTED = "run_started"
    RUN_RESUMED = "run_resumed"
    STEP_FINISHED = "step_finished"
    RUN_ENDED = "run_ended"


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A progress notification; ``record`` is the record the event is about."""

    kind: EventKind
    run_id: str
    step: int | None
    record: Record


@runtime_checkable
class EventSink(Protocol):
    """Receives progress events. A failing sink is counted, logged and never re-entered."""

    def parameters(self) -> Mapping[str, JSONValue]:
        """The reproducibility parameters of this sink (usually none)."""
        ...

    async def emit(self, event: Event) -> None:
        """Deliver one event.

        Cancellation: must propagate; events are not persisted, so nothing is on disk
        on the sink's account.
        """
        ...


class NullSink:
    """An event sink that discards every event: the explicit way to say "no events"."""

    __slots__ = ()

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "null"}

    async def emit(self, event: Event) -> None:
        """Discard ``event``.

        Cancellation: nothing happens, so nothing is left behind.
        """
        return

    def __repr__(self) -> str:
        return "NullSink()"

