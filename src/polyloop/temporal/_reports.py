"""What the activities report to the workflow about a run, as frozen values.

The worker builds them (``_shown``, ``_worker``) and the workflow reads them; between
the two they travel as the JSON objects ``docs/temporal.md`` describes. ``to_json`` and
``from_json`` are the only places that know those keys. Reading takes a missing
optional key as its default, so that a history an older worker wrote still replays.

Standard library and ``polyloop.types`` only: the workflow imports this module inside
Temporal's sandbox.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyloop.types import IntentKind, JSONValue, RunState, StopReason

__all__ = (
    "Carried",
    "SegmentOutcome",
    "ShownIntent",
    "ShownProposal",
    "StatusSummary",
    "Waiting",
)

Json = Mapping[str, Any]
"""A JSON object as Temporal's converter decoded it."""


class Waiting(enum.StrEnum):
    """What a stopped run waits for a person to give."""

    APPROVAL = "approval"
    SETTLEMENT = "settlement"

    @property
    def state(self) -> RunState:
        """The run's state while it waits for this."""
        return RunState.AWAITING_APPROVAL if self is Waiting.APPROVAL else RunState.IN_DOUBT

    @property
    def refusal(self) -> str:
        """The error type of an answer this wait cannot take."""
        return "NotAwaitingApproval" if self is Waiting.APPROVAL else "NotInDoubt"

    @property
    def words(self) -> str:
        return "an approval" if self is Waiting.APPROVAL else "a settlement"

    @classmethod
    def after(cls, stop: StopReason) -> Waiting | None:
        """What a run that stopped for ``stop`` waits for; ``None``: it ended."""
        return _WAITS_AFTER.get(stop)


_WAITS_AFTER = {
    StopReason.AWAITING_APPROVAL: Waiting.APPROVAL,
    StopReason.IN_DOUBT: Waiting.SETTLEMENT,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ShownProposal:
    """A proposal once, bounded and escaped: its result id (to answer with) and call."""

    result_id: str
    step: int
    tool: str | None
    call: str
    call_truncated: bool
    description: str

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "result_id": self.result_id,
            "step": self.step,
            "tool": self.tool,
            "call": self.call,
            "call_truncated": self.call_truncated,
            "description": self.description,
        }

    @classmethod
    def from_json(cls, data: Json) -> ShownProposal:
        return cls(
            result_id=data["result_id"],
            step=data["step"],
            tool=data.get("tool"),
            call=data.get("call", ""),
            call_truncated=data.get("call_truncated", False),
            description=data.get("description", ""),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ShownIntent:
    """The open intent: its result id, its kind and, for an action, its call."""

    result_id: str
    kind: IntentKind
    step: int
    tool: str | None = None
    call: str | None = None
    call_truncated: bool = False

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "result_id": self.result_id,
            "kind": self.kind.value,
            "step": self.step,
            "tool": self.tool,
            "call": self.call,
            "call_truncated": self.call_truncated,
        }

    @classmethod
    def from_json(cls, data: Json) -> ShownIntent:
        return cls(
            result_id=data["result_id"],
            kind=IntentKind(data["kind"]),
            step=data["step"],
            tool=data.get("tool"),
            call=data.get("call"),
            call_truncated=data.get("call_truncated", False),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusSummary:
    """What the workflow shows of a run's :class:`~polyloop.types.RunStatus`.

    Times are ISO 8601 text, as they are shown.
    """

    run_id: str
    state: RunState
    stop_reason: StopReason | None = None
    detail: str | None = None
    steps: int = 0
    valid_steps: int = 0
    open_intent: ShownIntent | None = None
    proposal: ShownProposal | None = None
    last_record_at: str | None = None
    owner: str | None = None
    lease_expires_at: str | None = None

    def driven(self) -> StatusSummary:
        """This status while a segment drives the run: the counts it started with."""
        return dataclasses.replace(
            self,
            state=RunState.RUNNING,
            stop_reason=None,
            detail=None,
            proposal=None,
            open_intent=None,
        )

    def cancelled(self) -> StatusSummary:
        """This status once a cancelled workflow's segment wrote the run's end record."""
        if self.state is not RunState.RUNNING:
            return self
        return dataclasses.replace(self, state=RunState.RESUMABLE, stop_reason=StopReason.CANCELLED)

    def open_for(self, waiting: Waiting) -> str | None:
        """The result id of what the run waits on for ``waiting``, if shown."""
        shown = self.proposal if waiting is Waiting.APPROVAL else self.open_intent
        return shown.result_id if shown is not None else None

    def still_waits(self, waiting: Waiting, result_id: str | None) -> bool:
        """Whether the run still waits, for ``waiting``, on the very ``result_id``."""
        return self.state is waiting.state and self.open_for(waiting) == result_id

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "run_id": self.run_id,
            "state": self.state.value,
            "stop_reason": self.stop_reason.value if self.stop_reason is not None else None,
            "detail": self.detail,
            "steps": self.steps,
            "valid_steps": self.valid_steps,
            "open_intent": self.open_intent.to_json() if self.open_intent else None,
            "proposal": self.proposal.to_json() if self.proposal else None,
            "last_record_at": self.last_record_at,
            "owner": self.owner,
            "lease_expires_at": self.lease_expires_at,
        }

    @classmethod
    def from_json(cls, data: Json) -> StatusSummary:
        intent, proposal = data.get("open_intent"), data.get("proposal")
        stop = data.get("stop_reason")
        return cls(
            run_id=data["run_id"],
            state=RunState(data["state"]),
            stop_reason=StopReason(stop) if stop is not None else None,
            detail=data.get("detail"),
            steps=data.get("steps", 0),
            valid_steps=data.get("valid_steps", 0),
            open_intent=ShownIntent.from_json(intent) if intent else None,
            proposal=ShownProposal.from_json(proposal) if proposal else None,
            last_record_at=data.get("last_record_at"),
            owner=data.get("owner"),
            lease_expires_at=data.get("lease_expires_at"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentOutcome:
    """What one segment reports: the stop, the counts and the run's status after it.

    ``final_answer`` is ``None`` with ``final_answer_omitted`` when it was too large to
    carry; the run's end record holds it.
    """

    run_id: str
    stop_reason: StopReason
    final_answer: JSONValue = None
    final_answer_omitted: bool = False
    steps: int = 0
    valid_steps: int = 0
    detail: str | None = None
    resumed: bool = False
    status: StatusSummary

    def result_json(self) -> dict[str, JSONValue]:
        """The workflow's result: everything but the status."""
        return {
            "run_id": self.run_id,
            "stop_reason": self.stop_reason.value,
            "final_answer": self.final_answer,
            "final_answer_omitted": self.final_answer_omitted,
            "steps": self.steps,
            "valid_steps": self.valid_steps,
            "detail": self.detail,
            "resumed": self.resumed,
        }

    def to_json(self) -> dict[str, JSONValue]:
        return {**self.result_json(), "status": self.status.to_json()}

    @classmethod
    def from_json(cls, data: Json) -> SegmentOutcome:
        return cls(
            run_id=data["run_id"],
            stop_reason=StopReason(data["stop_reason"]),
            final_answer=data.get("final_answer"),
            final_answer_omitted=data.get("final_answer_omitted", False),
            steps=data.get("steps", 0),
            valid_steps=data.get("valid_steps", 0),
            detail=data.get("detail"),
            resumed=data.get("resumed", False),
            status=StatusSummary.from_json(data["status"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Carried:
    """What a workflow run hands the next when it continues as new
    (``RunInput.carried``): its counts and the run's last status."""

    segments: int
    continued_as_new: int
    status: StatusSummary | None = None

    def to_json(self) -> dict[str, JSONValue]:
        status = self.status.to_json() if self.status is not None else None
        return {
            "segments": self.segments,
            "continued_as_new": self.continued_as_new,
            "status": status,
        }

    @classmethod
    def from_json(cls, data: Json) -> Carried:
        status = data.get("status")
        return cls(
            segments=int(data.get("segments", 0)),
            continued_as_new=int(data.get("continued_as_new", 0)),
            status=StatusSummary.from_json(status) if status else None,
        )
