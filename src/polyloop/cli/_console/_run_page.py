"""What a run's page in the console adds to ``polyloop show``: a timeline of its steps,
and the arguments a person changed before approving them beside the proposed ones.

Pure logic over a run read whole; the template draws it, in HTML and SVG alone (the
page's content security policy allows no inline style and no script but its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from polyloop.cli._common import editable_json
from polyloop.cli._facts import step_duration_s, step_time_text
from polyloop.cli._view import RunView
from polyloop.types import JSONValue, Proposal, Verdict

# The width of the timeline in SVG user units: wide enough that a step of a tenth of a
# percent of the run still gets a visible sliver.
WIDTH = 1000.0
MIN_BAR = 2.0


@dataclass(frozen=True, slots=True)
class Bar:
    """One step on the run's timeline, in :data:`WIDTH` units from the run's start:
    the step's span, and inside it the model call's then the tool's."""

    step: int
    text: str  # the step's time in words, as polyloop show prints it
    start: float | None = None  # None: the log has no time to place the step at
    width: float = 0.0
    model_width: float = 0.0
    tool_width: float = 0.0

    @property
    def placed(self) -> bool:
        return self.start is not None

    @property
    def tool_start(self) -> float:
        return (self.start or 0.0) + self.model_width


def timeline(view: RunView) -> tuple[Bar, ...]:
    """A bar per step, each placed where its step began on a scale from the run's start
    record to its last step's end (or its end record, if later).

    A step's record is written when the step ends (``at``), so it began ``duration_s``
    before. A step without a time (an older log, a settled step, whose time is the
    resume's bookkeeping, a step a fork inherited) is listed unplaced, in words.
    """
    start = view.status.started_at
    own = [step for step in view.steps if not view.is_inherited(step)]
    ends = [step.at for step in own if step.at is not None]
    if view.status.ended_at is not None:
        ends.append(view.status.ended_at)
    span = (max(ends) - start).total_seconds() if start is not None and ends else 0.0
    bars = []
    for step in view.steps:
        text = step_time_text(step) or "no time recorded"
        seconds = step_duration_s(step)
        if view.is_inherited(step):
            bars.append(Bar(step=step.step, text=f"{text}; taken over from the run it forks"))
            continue
        if start is None or step.at is None or seconds is None or span <= 0:
            bars.append(Bar(step=step.step, text=text))
            continue
        began = step.at - timedelta(seconds=seconds)
        scale = WIDTH / span
        bars.append(
            Bar(
                step=step.step,
                text=text,
                start=_clamped(_offset_s(start, began) * scale, 0.0, WIDTH),
                width=max(MIN_BAR, seconds * scale),
                model_width=(step.model_duration_s or 0.0) * scale,
                tool_width=(step.action_duration_s or 0.0) * scale,
            )
        )
    return tuple(bars)


def _offset_s(start: datetime, at: datetime) -> float:
    return (at - start).total_seconds()


def _clamped(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


@dataclass(frozen=True, slots=True)
class Edit:
    """An approval whose person changed the arguments: what the model proposed and
    what ran (or runs next), as JSON text, and the top-level arguments that differ."""

    step: int
    tool: str | None
    by: str
    at: datetime | None
    proposed: str
    approved: str
    changed: tuple[str, ...]


def edits(view: RunView) -> tuple[Edit, ...]:
    """Every approval of the run that ran other arguments than the proposed ones."""
    found = []
    for _, reviews in sorted(view.reviews().items()):
        proposal: Proposal | None = None
        for review in reviews:
            if isinstance(review, Proposal):
                proposal = review
            elif isinstance(review, Verdict) and review.approved and proposal is not None:
                proposed, approved = _arguments(proposal.payload), _arguments(review.payload)
                if proposed != approved:
                    found.append(
                        Edit(
                            step=proposal.step,
                            tool=_tool(proposal.payload),
                            by=review.by,
                            at=review.at,
                            proposed=editable_json(proposed, indent=2),
                            approved=editable_json(approved, indent=2),
                            changed=_changed(proposed, approved),
                        )
                    )
    return tuple(found)


def _arguments(payload: JSONValue) -> JSONValue:
    return payload.get("arguments") if isinstance(payload, dict) else payload


def _tool(payload: JSONValue) -> str | None:
    name = payload.get("name") if isinstance(payload, dict) else None
    return name if isinstance(name, str) else None


def _changed(proposed: JSONValue, approved: JSONValue) -> tuple[str, ...]:
    """The top-level keys whose values differ (added and removed ones too), in order;
    empty when the arguments are not two objects."""
    if not isinstance(proposed, dict) or not isinstance(approved, dict):
        return ()
    keys = [*proposed, *(key for key in approved if key not in proposed)]
    return tuple(key for key in keys if proposed.get(key, ...) != approved.get(key, ...))
