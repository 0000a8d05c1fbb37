"""What crosses Temporal about a run: small, bounded, and safe to show a person.

Everything an activity returns lands in the workflow's history, and one payload over
Temporal's limit (about 2 MB) is never accepted: the activity would be retried for
ever. So a segment returns the run's state, the result ids and a bounded summary; the
proposal or intent is shown once, as the one line ``polyloop pending`` prints, with
the same characters escaped; the full records stay in PolyLoop's log.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeVar

from temporalio.exceptions import ApplicationError

from polyloop._escaping import escape_field, payload_text
from polyloop.serialization import encode
from polyloop.temporal._reports import ShownIntent, ShownProposal, StatusSummary
from polyloop.types import Intent, IntentKind, JSONValue, Proposal, Record, RunStatus

__all__ = (
    "CALL_CHARS",
    "FINAL_ANSWER_BYTES",
    "PAYLOAD_BYTES",
    "TEXT_CHARS",
    "bounded_record",
    "brief",
    "escape_field",
    "fitting",
    "json_size",
    "status_summary",
    "summary_of",
    "when",
)

Fits = TypeVar("Fits", bound=Mapping[str, object])

CALL_CHARS = 16_384
"""How much of a proposed call the status shows; the rest is read from the log."""
TEXT_CHARS = 4_096
"""How much of a description or an end record's detail the status shows."""
FINAL_ANSWER_BYTES = 256 * 1024
"""The largest final answer (as JSON) the workflow's result carries; a larger one is
omitted there and read from the log."""
RECORD_FIELD_BYTES = 64 * 1024
"""The largest field (as JSON) of a record an answer update returns."""
PAYLOAD_BYTES = 1024 * 1024
"""What one activity result may weigh at most, well under Temporal's limit."""


def json_size(value: Any) -> int:
    """Bytes ``value`` takes as Temporal's JSON converter writes it (ASCII escapes)."""
    return len(json.dumps(value, separators=(",", ":")))


def _shown(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to ``limit`` characters, then escaped; and whether it was cut."""
    if len(text) <= limit:
        return escape_field(text), False
    return escape_field(text[:limit]) + f"... ({len(text)} characters in all)", True


def _tool(payload: JSONValue) -> str | None:
    name = payload.get("name") if isinstance(payload, dict) else None
    return escape_field(name) if isinstance(name, str) else None


def shown_proposal(proposal: Proposal) -> ShownProposal:
    """The proposal once: its result id (to answer with), tool, call and description."""
    call, cut = _shown(payload_text(proposal.payload), CALL_CHARS)
    return ShownProposal(
        result_id=proposal.result_id,
        step=proposal.step,
        tool=_tool(proposal.payload),
        call=call,
        call_truncated=cut,
        description=_shown(proposal.description, TEXT_CHARS)[0],
    )


def shown_intent(intent: Intent) -> ShownIntent:
    """The open intent: its result id, its kind (a model call or an action) and, for an
    action, its call."""
    if intent.kind is not IntentKind.ACTION:
        return ShownIntent(result_id=intent.result_id, kind=intent.kind, step=intent.step)
    call, cut = _shown(payload_text(intent.payload), CALL_CHARS)
    return ShownIntent(
        result_id=intent.result_id,
        kind=intent.kind,
        step=intent.step,
        tool=_tool(intent.payload),
        call=call,
        call_truncated=cut,
    )


def brief(text: str) -> str:
    """An error's text cut to a size a failure can carry (it lands in the history)."""
    if len(text) <= TEXT_CHARS:
        return text
    return text[:TEXT_CHARS] + f"... ({len(text)} characters in all)"


def shown_detail(detail: str | None) -> str | None:
    return None if detail is None else _shown(detail, TEXT_CHARS)[0]


def summary_of(status: RunStatus) -> StatusSummary:
    """What the workflow's status shows of a :class:`~polyloop.types.RunStatus`."""
    return StatusSummary(
        run_id=status.run_id,
        state=status.state,
        stop_reason=status.stop_reason,
        detail=shown_detail(status.detail),
        steps=status.steps,
        valid_steps=status.valid_steps,
        open_intent=shown_intent(status.open_intent) if status.open_intent else None,
        proposal=shown_proposal(status.proposal) if status.proposal else None,
        last_record_at=when(status.last_record_at),
        owner=status.owner,
        lease_expires_at=when(status.lease_expires_at),
    )


def status_summary(status: RunStatus) -> dict[str, Any]:
    """:func:`summary_of` as the JSON the workflow's status carries."""
    return summary_of(status).to_json()


def when(moment: datetime | None) -> str | None:
    """A moment as the status shows it: ISO 8601."""
    return moment.isoformat() if moment is not None else None


def bounded_record(record: Record) -> dict[str, JSONValue]:
    """A record as the log encodes it, each field over the bound left out (``None``,
    named in ``omitted``): an answer update returns it, so it lands in the history."""
    encoded = dict(encode(record))
    omitted = [key for key, value in encoded.items() if json_size(value) > RECORD_FIELD_BYTES]
    for key in omitted:
        encoded[key] = None
    named: list[JSONValue] = list(omitted)
    return {**encoded, "omitted": named}


def fitting(value: Fits, run_id: str, what: str) -> Fits:
    """``value`` if it fits one payload; a clear error, never retried, if not."""
    size = json_size(value)
    if size > PAYLOAD_BYTES:
        raise ApplicationError(
            f"run {run_id!r}: {what} takes {size} bytes, more than the {PAYLOAD_BYTES} "
            "one Temporal payload may carry here; the run's log holds it whole",
            {"run_id": run_id},
            type="PayloadTooLarge",
            non_retryable=True,
        )
    return value
