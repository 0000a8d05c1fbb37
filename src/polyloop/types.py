"""Value types, enums, persisted records and errors: the contract every other module speaks.

Everything here is plain data. Values are frozen, slotted, keyword-only dataclasses whose
fields are only ever added (with defaults), never renamed or removed: a log written today
must decode with every later release of the same record-format major.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeAlias

from polyloop._errors import (
    AmendmentRefused,
    CancelRequested,
    CorruptLog,
    InvalidRequest,
    LeaseLost,
    NotAwaitingApproval,
    NotInDoubt,
    PolyLoopError,
    RunAlreadyExists,
    RunIdentityMismatch,
    RunLocked,
    RunNotFound,
    SchemaMajorMismatch,
    StoreError,
    UnloggableValue,
)
from polyloop._shared import RECONCILE_PREFIX, canonical_json, run_trace_ids

__all__ = (
    "ActionStatus",
    "Amended",
    "Amendment",
    "AmendmentRefused",
    "Budget",
    "CancelRequest",
    "CancelRequested",
    "ContentBlock",
    "CorruptLog",
    "DecisionKind",
    "FinishReason",
    "FollowedRecord",
    "Injection",
    "Intent",
    "IntentKind",
    "InvalidRequest",
    "JSONValue",
    "LeaseLost",
    "Message",
    "NotAwaitingApproval",
    "NotInDoubt",
    "PolyLoopError",
    "Proposal",
    "Ready",
    "Reconciled",
    "Record",
    "RecoveredRun",
    "Replay",
    "Result",
    "Review",
    "Role",
    "RunAlreadyExists",
    "RunEnded",
    "RunIdentityMismatch",
    "RunLocked",
    "RunLog",
    "RunNotFound",
    "RunResult",
    "RunStarted",
    "RunState",
    "RunStatus",
    "SchemaMajorMismatch",
    "Settlement",
    "StepRecord",
    "StopReason",
    "StoreError",
    "TextBlock",
    "ToolCallBlock",
    "ToolResultBlock",
    "ToolStyle",
    "UnloggableValue",
    "Usage",
    "Verdict",
    "run_trace_id",
)

# Marks a record field added after the first release of the record format: it is left
# out of a written record while it is None, so a record that uses none of the later
# fields is written byte for byte as the first release wrote it.
_WRITTEN_WHEN_SET: Mapping[str, bool] = {"written_when_set": True}
# Marks a field that says when, how long, or in which attempt: the only fields allowed
# to differ between a run and the same run resumed after a crash.
_TIMING: Mapping[str, bool] = {"timing": True}
_TIMING_WHEN_SET: Mapping[str, bool] = {**_WRITTEN_WHEN_SET, **_TIMING}

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
"""A value that JSON can carry: what snapshots, payloads and parameters are made of."""


class Role(enum.StrEnum):
    """Who speaks a message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


class Replay(enum.StrEnum):
    """Whether an effect whose outcome was lost in a crash may be performed again."""

    NEVER = "never"
    ALLOWED = "allowed"


class ActionStatus(enum.StrEnum):
    """How an action went: ran, was refused before running, or the environment failed."""

    EXECUTED = "executed"
    NOT_EXECUTED = "not_executed"
    ENV_FAULT = "env_fault"


class DecisionKind(enum.StrEnum):
    """Which branch the interpreter chose for a model reply."""

    ACTION = "action"
    FINAL = "final"
    INVALID = "invalid"


class StopReason(enum.StrEnum):
    """Why a run ended. A value, never an exception."""

    ENV_DONE = "env_done"
    SUBMITTED = "submitted"
    FINAL_ANSWER = "final_answer"
    STEP_LIMIT = "step_limit"
    VALID_STEP_LIMIT = "valid_step_limit"
    CONTEXT_LIMIT = "context_limit"
    TOKEN_LIMIT = "token_limit"
    MODEL_FAILURE = "model_failure"
    ENV_FAILURE = "env_failure"
    CANCELLED = "cancelled"
    IN_DOUBT = "in_doubt"
    AWAITING_APPROVAL = "awaiting_approval"
    CANCELLED_BY_REQUEST = "cancelled_by_request"
    """Someone asked the run to stop (:func:`polyloop.cancel`); final, unlike
    ``CANCELLED``, which a cancelled process leaves for a later resume."""


class FinishReason(enum.StrEnum):
    """How a model reply ended, as the server reported it.

    Only ``STOP`` and ``TOOL_CALLS`` are complete replies. ``LENGTH`` means the reply was
    cut off at the server's length limit, so whatever it holds may be half written;
    ``CONTENT_FILTER`` that the server withheld part of it; ``REFUSAL`` that the model
    declined. ``OTHER`` is any reason the adapter does not know.
    """

    STOP = "stop"
    LENGTH = "length"
    CONTENT_FILTER = "content_filter"
    TOOL_CALLS = "tool_calls"
    REFUSAL = "refusal"
    OTHER = "other"


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """The tokens one model call used, or a run's total; ``None`` where not reported.

    ``output_tokens`` includes ``reasoning_tokens`` where the server counts them apart
    (as OpenAI's API does), so a call's total is ``input_tokens + output_tokens``.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "reasoning_tokens"):
            count = getattr(self, name)
            if count is not None and (
                not isinstance(count, int) or isinstance(count, bool) or count < 0
            ):
                raise ValueError(f"Usage.{name} must be None or an integer >= 0, not {count!r:.40}")

    @staticmethod
    def of_steps(steps: Iterable[StepRecord]) -> Usage | None:
        """The tokens of the model calls that answered among ``steps``.

        Each count is the sum over those steps, or ``None`` if some reply did not report
        it; a step whose model call failed without a reply counts for nothing. ``None``
        when no step reported usage at all. This is :attr:`RunResult.usage`.
        """
        # A step whose model call raised had no reply to report figures.
        answered = [step.usage for step in steps if step.error is None or step.usage is not None]
        if all(usage is None for usage in answered):
            return None  # nothing reported: nothing to add up
        total: Usage | None = None
        for reported in answered:
            usage = reported or Usage()
            total = usage if total is None else total.plus(usage)
        return total

    def plus(self, other: Usage) -> Usage:
        """The sum of two usages; a count either side does not know stays unknown."""
        return Usage(
            input_tokens=_sum(self.input_tokens, other.input_tokens),
            output_tokens=_sum(self.output_tokens, other.output_tokens),
            reasoning_tokens=_sum(self.reasoning_tokens, other.reasoning_tokens),
        )

    @property
    def total_tokens(self) -> int | None:
        """``input_tokens + output_tokens``, or ``None`` if either is unknown."""
        if self.input_tokens is None or self.output_tokens is None:
            return None
        return self.input_tokens + self.output_tokens


def _sum(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


class ToolStyle(enum.StrEnum):
    """How the model is told about the tools.

    ``JSON`` and ``MARKDOWN`` render the tool list into the prompt; ``NATIVE`` renders
    nothing and hands the tools to the model client (:attr:`ModelCall.tools`), which
    sends them in its API's own form, and the calls come back as
    :class:`ToolCallBlock` values.
    """

    JSON = "json"
    MARKDOWN = "markdown"
    NATIVE = "native"


class IntentKind(enum.StrEnum):
    """The two kinds of side effect the library announces before performing them."""

    MODEL_CALL = "model_call"
    ACTION = "action"


@dataclass(frozen=True, slots=True, kw_only=True)
class TextBlock:
    """A run of text inside a message."""

    text: str

    def size(self) -> int:
        """The block's share of the context-size metric: its length in characters."""
        return len(self.text)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallBlock:
    """A native tool call the model made: the server's call id, the tool and its arguments.

    ``arguments`` is the parsed arguments object; a model client that received text it
    could not parse passes that text on as a string, for the interpreter to refuse.
    """

    call_id: str
    name: str
    arguments: JSONValue

    def size(self) -> int:
        """Its share of the context-size metric: the characters of the name and of the
        arguments as canonical JSON (what the model wrote, give or take the spacing)."""
        return len(self.name) + len(canonical_json(self.arguments))


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResultBlock:
    """What a native tool call gave back, sent with the id of the call it answers."""

    call_id: str
    text: str

    def size(self) -> int:
        """Its share of the context-size metric: the length of the text in characters."""
        return len(self.text)


ContentBlock: TypeAlias = TextBlock | ToolCallBlock | ToolResultBlock
"""One block of a message. The union grows; code must handle blocks one by one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One message of a model call: a role and a sequence of content blocks."""

    role: Role
    content: tuple[ContentBlock, ...]

    @classmethod
    def text(cls, role: Role, text: str) -> Message:
        """A message holding a single text block."""
        return cls(role=role, content=(TextBlock(text=text),))


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """The limits of one run. Every run states the first three; the rest are optional.

    ``max_tokens`` limits the tokens the run's model calls use, input and output
    together, as the replies report them (:attr:`Usage.total_tokens`); with it set, a
    reply that does not report both counts ends the run as a model failure.
    """

    max_steps: int
    max_valid_steps: int
    max_context_chars: int
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    """Skill entries to place in the context, by channel (only ``"system"`` exists today)."""

    entries: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted:
    """The first record of every run: the frozen reproducibility snapshot.

    ``at``, on this and every other record, is the aware UTC time the record was
    written (``None`` in records written before the field existed).

    A fork (:func:`polyloop.fork`) says where it came from: ``forked_from`` is the
    source run, ``forked_at_step`` how many of its completed steps the fork took over,
    ``inherited`` copies of those steps (with the fork's run id; they are the fork's
    steps ``0`` to ``forked_at_step - 1``) and ``inherited_sha256`` the SHA-256 of the
    source's step records as they were read (their canonical JSON, as a list), so that
    a copy can be checked against its source. All four are ``None`` for any other run.
    ``inherited_snapshot`` is the snapshot the source held at ``forked_at_step`` (its
    start record's with its amendments up to that step applied), where the fork goes on
    from. It is ``None`` for a fork that inherited nothing,
    for any other run, and in forks written before the field existed.

    A run started through an :class:`~polyloop.Agent` names it: ``agent`` is the agent's
    name and ``input`` the JSON value its request was built from, so that any process
    hosting the same agent can build the request again. ``agent`` is ``None`` for any
    other run (and ``input`` then too).
    """

    run_id: str
    snapshot: Mapping[str, JSONValue]
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)
    forked_from: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    forked_at_step: int | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    inherited_sha256: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    inherited: tuple[StepRecord, ...] | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    agent: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    input: JSONValue = field(default=None, metadata=_WRITTEN_WHEN_SET)
    inherited_snapshot: Mapping[str, JSONValue] | None = field(
        default=None, metadata=_WRITTEN_WHEN_SET
    )

    @property
    def inherited_steps(self) -> tuple[StepRecord, ...]:
        """The steps a fork took over from its source; empty for any other run."""
        return self.inherited or ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Intent:
    """Written, and made durable, before a side effect is performed.

    ``action_text``, ``history_text`` and, for a native tool call, ``tool_call`` are set
    on action intents only: they let a run
    resumed after a crash replay an interrupted action without interpreting the model
    reply again.

    ``edited_by`` names the person whose :class:`Verdict` changed the arguments of the
    proposed call before it ran; the payload, ``action_text`` and ``tool_call`` are then
    the call as edited, and ``proposed_action_text`` keeps the call as the model
    proposed it. Both are ``None`` for a call that ran as the model made it.

    ``reconciles`` is set on an action intent whose replay is ``NEVER``: ``True`` when
    the executor said, as the action was announced, that its probe can settle the action
    if it is left in doubt (:meth:`ReconcilingExecutor.reconciles
    <polyloop.ports.ReconcilingExecutor.reconciles>`), ``False`` when it could not.
    ``None`` on every other intent, and on intents written before the field existed.
    """

    run_id: str
    result_id: str
    kind: IntentKind
    step: int
    call_index: int
    replay: Replay
    payload: JSONValue
    action_text: str | None = None
    history_text: str | None = None
    tool_call: ToolCallBlock | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)
    edited_by: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    proposed_action_text: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    reconciles: bool | None = field(default=None, metadata=_WRITTEN_WHEN_SET)


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """The outcome of the effect announced by the intent with the same ``result_id``.

    ``duration_s`` is how long the model call or the action took, wall-clock time.
    """

    run_id: str
    result_id: str
    kind: IntentKind
    payload: JSONValue
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)
    duration_s: float | None = field(default=None, metadata=_TIMING_WHEN_SET)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One decision round: the row of the trajectory.

    ``duration_s`` is the step's wall-clock time, ``model_duration_s`` and
    ``action_duration_s`` those of its model call and of its action (``None`` where the
    step had none, or the call ran in an earlier attempt of the run), ``at`` when the
    record was written, and ``resumed`` is ``True`` when a process that resumed the run
    wrote it: these fields are the only ones that differ between a run and the same run
    resumed after a crash. ``finish``, ``usage``, ``model`` and ``refusal``
    say how the model's reply ended, what the call cost and which model the server says
    answered, as the model client reported them (``None`` where it did not).
    ``tool_call`` is the native tool call the step's action came from, if it came from
    one: the history holds it as structured content, and the observation answers it.
    ``settled_by`` names the person whose :class:`Settlement` says how the step's action
    ended: the action's outcome was then not observed by the library but told by them.
    ``edited_by`` and ``proposed_action_text`` are set, as on the step's :class:`Intent`,
    when a person edited the arguments of the call before it ran: ``action_text`` and
    ``tool_call`` are then the call that ran, ``proposed_action_text`` the one proposed.
    """

    run_id: str
    step: int
    call_id: str | None
    model_output: str
    reasoning: str | None
    decision: DecisionKind
    history_text: str
    action_text: str | None
    observation: str | None
    observation_synthesized: bool
    action_status: ActionStatus | None
    done: bool
    truncated_chars: int
    error: str | None
    final_answer: str | None = None
    duration_s: float | None = field(default=None, metadata=_TIMING)
    finish: FinishReason | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    usage: Usage | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    model: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    refusal: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    tool_call: ToolCallBlock | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)
    model_duration_s: float | None = field(default=None, metadata=_TIMING_WHEN_SET)
    action_duration_s: float | None = field(default=None, metadata=_TIMING_WHEN_SET)
    resumed: bool | None = field(default=None, metadata=_TIMING_WHEN_SET)
    settled_by: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    edited_by: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    proposed_action_text: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEnded:
    """The last record of a run, or of one attempt of it.

    A ``CANCELLED`` end may be followed by a resumed run; an ``IN_DOUBT`` end by the
    :class:`Settlement` of the effect in doubt; an ``AWAITING_APPROVAL`` end by the
    :class:`Verdict` on the proposed action. Every other end is final.

    ``cancelled_by`` names who asked for a ``CANCELLED_BY_REQUEST`` end (its reason is
    in ``detail``); ``None`` on every other end.
    """

    run_id: str
    stop_reason: StopReason
    final_answer: str | None
    steps: int
    valid_steps: int
    detail: str | None
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)
    cancelled_by: str | None = field(default=None, metadata=_WRITTEN_WHEN_SET)

    @property
    def is_final(self) -> bool:
        """Whether nothing may follow this record: true for every reason but
        ``CANCELLED``, ``IN_DOUBT`` and ``AWAITING_APPROVAL``."""
        return self.stop_reason not in _REOPENABLE


_REOPENABLE = frozenset({StopReason.CANCELLED, StopReason.IN_DOUBT, StopReason.AWAITING_APPROVAL})


@dataclass(frozen=True, slots=True, kw_only=True)
class Proposal:
    """An action that waits for a person's approval before it may run.

    Written, durably, in place of the action's intent when the model chose a tool that
    needs approval; the run then stops ``AWAITING_APPROVAL``. It holds what the intent
    would have held, and what a person needs to judge it: the tool's ``description``.
    ``result_id`` is the id the action's intent and result get once approved.
    """

    run_id: str
    result_id: str
    step: int
    replay: Replay
    payload: JSONValue
    action_text: str
    history_text: str
    description: str
    tool_call: ToolCallBlock | None = field(default=None, metadata=_WRITTEN_WHEN_SET)
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """A person's answer to a :class:`Proposal`: approved, or rejected with a reason.

    ``payload`` is what runs once approved: the proposed payload, with the arguments
    the person edited if they did (``None`` when rejected). ``reason`` is set when
    rejected; the model is told it as the reason the action was not executed.
    """

    run_id: str
    result_id: str
    approved: bool
    by: str
    payload: JSONValue
    reason: str | None
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settlement:
    """What became of an effect in doubt, as a person or the tool's own probe says: it
    ran, or it did not.

    ``result_id`` names the open intent: an action, or a model call (only a person
    settles one). For an action, with ``ran``, ``observation`` is what the model is
    shown as the action's output; without, it is the reason the model is told the
    action was not executed. For a model call, ``ran=False`` lets the run call the
    model again, as a new call, and ``ran=True`` ends it ``MODEL_FAILURE`` (the reply
    is lost); ``observation`` is the person's note. ``by`` names who settled it: a person, or
    ``"reconcile:<tool name>"`` for a tool's probe (:attr:`ToolSpec.reconcile
    <polyloop.tools.ToolSpec>`), whose run time is ``duration_s``.
    """

    run_id: str
    result_id: str
    ran: bool
    observation: str
    by: str
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)
    duration_s: float | None = field(default=None, metadata=_TIMING_WHEN_SET)

    @property
    def by_probe(self) -> bool:
        """Whether a tool's probe settled the effect, rather than a person."""
        return self.by.startswith(RECONCILE_PREFIX)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconciled:
    """A tool probe's answer about an action in doubt, keyed by its result id.

    ``ran=True`` says the effect with that result id happened; ``observation`` is then
    recorded as the action's output. ``ran=False`` is a promise that the effect has not
    happened **and never will**: the system behind the tool has voided the key, or the
    probe recorded a tombstone that makes a late attempt with that key fail.
    ``observation`` is then the reason the model is told the action did not run. A
    probe that can promise neither returns ``None`` instead, and the run ends
    ``IN_DOUBT`` for a person to settle.
    """

    ran: bool
    observation: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Amendment:
    """A person's decision that a run may go on under a changed definition or request.

    ``accept`` names the snapshot keys (as :attr:`RunIdentityMismatch.differences
    <polyloop.types.RunIdentityMismatch>` names them) whose change ``by`` accepts, for
    ``reason``. Given to :func:`~polyloop.resume`, it lets the run go on when every
    difference is one it accepts, and the run's log records it (:class:`Amended`).
    """

    by: str
    reason: str
    accept: frozenset[str] | tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Amended:
    """The record of an amendment: from step ``step`` on, the run goes on under a changed
    snapshot, because ``by`` accepted the change for ``reason``.

    ``changes`` maps each changed snapshot key to an object holding its ``recorded``
    value (the one the run held until now) and its ``amended`` value (the one it holds
    from now on); a key the snapshot did not hold has no ``recorded``, a key it holds no
    more has no ``amended``. The run's snapshot at any point is its start record's with
    every amendment before that point applied in order.
    """

    run_id: str
    step: int
    by: str
    reason: str
    changes: Mapping[str, JSONValue]
    at: datetime | None = field(default=None, metadata=_TIMING_WHEN_SET)

    @property
    def differences(self) -> tuple[tuple[str, JSONValue, JSONValue], ...]:
        """Each change as a ``(key, recorded, amended)`` triple, sorted by key, a missing
        side read as ``None`` (the shape of :attr:`RunIdentityMismatch.differences`)."""
        triples = []
        for key in sorted(self.changes):
            change = self.changes[key]
            held = change if isinstance(change, dict) else {}
            triples.append((key, held.get("recorded"), held.get("amended")))
        return tuple(triples)


Review: TypeAlias = Proposal | Verdict | Settlement | Amended
"""The records a person's decision writes, or that ask a person something: a proposal
and its verdict, a settlement, an amendment."""

Record: TypeAlias = (
    RunStarted | Intent | Result | StepRecord | RunEnded | Proposal | Verdict | Settlement | Amended
)
"""Anything a store persists."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLog:
    """Every record a store read back for one run, in write order."""

    run_id: str
    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FollowedRecord:
    """One record of a followed run (:func:`polyloop.follow`) and its position in the log.

    ``position`` counts the run's records from 1, the start record's, in write order; the
    record at a position never changes, so a reader that kept the last position it saw
    asks for the records after it and misses none (research-wiki/0072). ``record`` is the
    record as :meth:`~polyloop.ports.Store.read_log` returns it.
    """

    position: int
    record: Record


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What ``run`` and ``resume`` return.

    ``usage`` sums the tokens of the run's steps, those of earlier attempts included
    (:meth:`Usage.of_steps`): a count is ``None`` if some reply of the run did not report
    it, since a total that left calls out would understate the cost.

    ``event_failures`` counts the event sink's failures; ``reconcile_failures`` the tool
    probes that raised, answered something other than ``Reconciled`` or ``None``, or did
    not answer within their tool's ``reconcile_timeout_s`` (each then counts as "cannot
    tell", and ``detail`` says what it raised, or after how long it was cancelled).
    """

    run_id: str
    stop_reason: StopReason
    final_answer: str | None
    steps: tuple[StepRecord, ...]
    step_count: int
    valid_step_count: int
    resumed: bool = False
    event_failures: int = 0
    detail: str | None = None
    usage: Usage | None = None
    reconcile_failures: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelRequest:
    """Someone's request that a run stop for good, kept by the store beside the run's log.

    Written without the run's claim (:func:`polyloop.cancel`); from then on the store
    refuses the run's intents and proposals with :class:`CancelRequested`, and its owner
    ends it ``CANCELLED_BY_REQUEST``. ``by`` names who asked and ``reason`` says why;
    ``at`` is when the store took the request (aware UTC).
    """

    run_id: str
    by: str
    reason: str
    at: datetime | None = None


class RunState(enum.StrEnum):
    """Where a stored run stands, as :func:`polyloop.run_status` reports it."""

    RUNNING = "running"
    """A live writer holds the run's claim right now and the run has not finished."""
    RESUMABLE = "resumable"
    """Nobody drives the run and it has not finished: ``resume`` continues it."""
    IN_DOUBT = "in_doubt"
    """An effect whose replay is never allowed may or may not have happened.

    The log holds an intent without its result whose replay is ``NEVER``; the run's
    ``IN_DOUBT`` end record may already be written, or ``resume`` writes it.
    """
    AWAITING_APPROVAL = "awaiting_approval"
    """The run stopped at a proposed action that a person must approve or reject first."""
    FINISHED = "finished"
    """The log ends with a final end record (any stop reason but ``CANCELLED``,
    ``IN_DOUBT`` and ``AWAITING_APPROVAL``)."""


class Ready(enum.StrEnum):
    """Why a run that nobody drives goes on as soon as a host drives it, with no
    person's answer needed first: what :attr:`RunStatus.ready` says.

    A host of the run's agent (``polyloop worker``, :func:`polyloop.serve_agents`)
    drives such a run within about a second; a run started without an agent goes on
    when its program resumes it. Members may be added.
    """

    NEW = "new"
    """Started (:meth:`polyloop.Agent.start`) and not yet driven."""
    APPROVED = "approved"
    """A person approved the action it waited on: the action runs next."""
    REJECTED = "rejected"
    """A person rejected the action it waited on: the model is told why next."""
    SETTLED = "settled"
    """A person, or a tool's probe, said what became of the effect in doubt."""
    PROBE = "probe"
    """In doubt, and its tool's probe will settle it: the action's intent says the
    executor could answer for it (:attr:`Intent.reconciles`), and no attempt since has
    ended in doubt."""
    INTERRUPTED = "interrupted"
    """Left unfinished by a process that stopped: it crashed, was killed, lost its
    lease, or was cancelled."""
    CANCEL_REQUESTED = "cancel_requested"
    """Someone asked the run to stop for good (:func:`polyloop.cancel`), and its log does
    not end yet: whoever drives it next ends it ``CANCELLED_BY_REQUEST``, before any
    effect, even if it waited for a person. Set for a ``RUNNING`` run too: its writer
    ends it at its next intent."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStatus:
    """What a store's records and its claims say about one run, read without driving it.

    ``stop_reason`` and ``detail`` come from the end record the log ends with, if it
    ends with one (``CANCELLED`` for a cancelled run that can be resumed). ``steps`` and
    ``valid_steps`` count the step records. ``open_intent`` is the intent of the
    interrupted step that has no result yet, if there is one; for an ``IN_DOUBT`` run it
    names the effect in doubt. ``last_record_at`` is when the store took the run's last
    record (UTC), when the store knows it.

    On stores whose claims have leases, ``owner`` names the worker whose claim the run
    is under (or was, if that worker's lease ended or its process died without giving
    the claim up) and ``lease_expires_at`` when that lease ends or ended: a run that is
    not ``RUNNING`` but has an owner was left by a worker that stopped.

    ``proposal`` is, for a run ``AWAITING_APPROVAL``, the action waiting for a verdict:
    its tool, arguments and the tool's description.

    ``reconciled_steps`` lists, in order, the steps whose action in doubt was settled by
    the tool's own probe rather than by a person (a settlement the run has not yet
    turned into a step record included).

    ``ready`` says why a run that is neither ``RUNNING`` nor ``FINISHED`` goes on as soon
    as anything drives it (:class:`Ready`); it is ``None`` for a run that is running,
    finished, or waiting for a person (to approve, reject or settle). A cancel request
    comes first: ``CANCEL_REQUESTED`` for any run that has not finished, running or
    waiting, since its next writer ends it. ``agent`` names
    the agent the run was started through (:attr:`RunStarted.agent`): a host of that
    agent drives a ready run by itself, while a run with no agent waits for its program
    to resume it.

    ``started_at`` is the time on the run's start record, and ``ended_at`` the time on
    its end record when the log ends with one (``None`` while it goes on, and for
    records written before records carried times).
    """

    run_id: str
    state: RunState
    stop_reason: StopReason | None
    detail: str | None
    steps: int
    valid_steps: int
    open_intent: Intent | None
    last_record_at: datetime | None
    owner: str | None = None
    lease_expires_at: datetime | None = None
    proposal: Proposal | None = None
    reconciled_steps: tuple[int, ...] = ()
    ready: Ready | None = None
    agent: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredRun:
    """What :func:`polyloop.recover` did with one unfinished run.

    ``result`` is set when the run was resumed to its end (or to an ``IN_DOUBT`` end);
    ``error`` is set when it was not: :class:`RunLocked` for a run that a live writer
    drives, or whatever building its request or resuming it raised.
    """

    run_id: str
    result: RunResult | None = None
    error: Exception | None = None


def run_trace_id(run_id: str) -> str:
    """The OpenTelemetry trace id that holds every attempt of ``run_id``, as the 32
    lowercase hex digits tracing tools show and search for.

    :class:`polyloop.otel.OpenTelemetrySink` puts each attempt of the run in this trace
    (unless the caller's own span is current: then the attempt links to it). Computed
    from the run id alone, without OpenTelemetry installed, so any process, and
    ``polyloop show``, can name the trace of a run that ran anywhere.
    """
    trace_id, _ = run_trace_ids(run_id)
    return f"{trace_id:032x}"


def _claim_public_home() -> None:
    # The errors are defined in a private module so that one file holds the whole
    # hierarchy; their public home is here, and reprs, pickles and docs should say so.
    for name in __all__:
        value = globals()[name]
        if isinstance(value, type) and issubclass(value, PolyLoopError):
            value.__module__ = __name__


_claim_public_home()
