"""What a client sends to an ``AgentRun`` workflow: its input and the people's answers.

Plain frozen dataclasses of JSON types, so that Temporal's default data converter
carries them as JSON and the workflow module can import them inside the sandbox.
``input`` and ``arguments`` are typed ``Any`` on purpose: they are whatever JSON the
caller sent, and the converter must not try to coerce them into a narrower type.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = (
    "ApproveInput",
    "RejectInput",
    "RunInput",
    "SettleInput",
    "SegmentInput",
    "AnswerInput",
    "AnswerKind",
    "OnApprovalTimeout",
)

DEADLINE_BY = "temporal:deadline"
"""Who the log names as having rejected a proposal whose approval deadline passed."""


class OnApprovalTimeout(enum.StrEnum):
    """What the workflow does when an approval's deadline passes."""

    REJECT = "reject"
    WAIT = "wait"


class AnswerKind(enum.StrEnum):
    """Which answer an :class:`AnswerInput` writes."""

    APPROVE = "approve"
    REJECT = "reject"
    SETTLE = "settle"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInput:
    """One PolyLoop run, driven by an ``AgentRun`` workflow whose id is ``run_id``.

    ``agent`` names an :class:`~polyloop.temporal.Agent` of the worker's
    :class:`~polyloop.temporal.PolyLoopPlugin`; its ``request_for(run_id, input)`` builds
    the run's request on whichever worker drives it, so ``input`` must say everything the
    request depends on.

    ``approval_timeout`` (seconds), if set, starts a durable timer whenever the run
    stops for an approval; when it fires, ``on_approval_timeout="reject"`` rejects the
    proposal in PolyLoop's log (by ``"temporal:deadline"``, with
    ``approval_timeout_reason``) and the run goes on; ``"wait"`` marks the status
    ``deadline_passed`` and keeps waiting.

    ``heartbeat_timeout`` (seconds) is how long a worker that drives the run may stay
    silent before Temporal gives the run segment to another worker; it also bounds how
    long a cancellation takes to reach the run. ``segment_timeout`` bounds one segment.

    The workflow continues as new, between two segments, when Temporal suggests it (its
    history grew long) or, if ``continue_as_new_after_events`` is set, once the history
    has that many events; the next workflow run resumes the run from its log.
    ``carried`` is set by the workflow for that next run; a client leaves it unset.
    """

    agent: str
    run_id: str
    input: Any = None
    approval_timeout: float | None = None
    # A plain str, not a Literal: the data converter would refuse another value while
    # decoding, failing workflow tasks over and over instead of the workflow once.
    on_approval_timeout: str = "reject"
    approval_timeout_reason: str = "no approval before the deadline"
    heartbeat_timeout: float = 30.0
    segment_timeout: float = 86_400.0
    continue_as_new_after_events: int | None = None
    # What a workflow run hands the next when it continues as new (counts and the last
    # status); a client leaves it unset.
    carried: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ApproveInput:
    """Approve the proposed action (``arguments``, if given, replace the proposed ones).

    ``by`` names who approves. ``result_id`` names the proposal approved
    (``status()["proposal"]["result_id"]``); send it. An answer naming a proposal that is
    no longer open is refused, and nothing is written. Without it the answer is for the
    proposal the workflow waits on when the update is accepted (or, sent while the run is
    driven, the next one); the workflow names that one to PolyLoop, which checks it under
    the run's claim. It stays optional so that answers from clients written before it
    keep working; see :class:`RejectInput`.
    """

    by: str
    arguments: Any = None
    result_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectInput:
    """Reject the proposed action; the model is told ``reason``.

    ``by`` and ``result_id`` as for :class:`ApproveInput`.
    """

    by: str
    reason: str
    result_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SettleInput:
    """Say whether the effect in doubt ran (``observation`` is its output) or not (the reason).

    ``result_id`` names the intent in doubt (``status()["open_intent"]["result_id"]``),
    an action or a model call, as :class:`ApproveInput` names a proposal.
    """

    by: str
    ran: bool
    observation: str
    result_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentInput:
    """What the workflow hands the activity that drives one segment of a run."""

    agent: str
    run_id: str
    input: Any = None
    heartbeat_timeout: float = 30.0


@dataclass(frozen=True, slots=True, kw_only=True)
class AnswerInput:
    """What the workflow hands the activity that writes a person's answer to the log."""

    agent: str
    run_id: str
    kind: AnswerKind
    by: str
    arguments: Any = None
    reason: str | None = None
    ran: bool | None = None
    observation: str | None = None
    result_id: str | None = None
