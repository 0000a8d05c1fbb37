"""What a trajectory tells besides its records' content: times, tokens, resumes, doubt.

Shared by the terminal, JSON and HTML views so the three say the same thing. A log
written before a fact was recorded has ``None`` there; every function here turns that
into "not known" (``—``) or leaves the fact out, never a guess.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from polyloop.cli._snapshots import fork_snapshot_text, snapshot_index, snapshots_json
from polyloop.cli._view import (
    READY_WORDS,
    RunView,
    after_settlement,
    settled_text,
    settlement_json,
    trajectory_json,
    usage_text,
)
from polyloop.types import (
    Intent,
    IntentKind,
    JSONValue,
    Ready,
    Result,
    RunEnded,
    RunStarted,
    RunState,
    RunStatus,
    Settlement,
    StepRecord,
    StopReason,
    run_trace_id,
)

UNKNOWN = "—"


def utc_text(at: datetime | None) -> str:
    """``at`` in UTC to the millisecond, as ``2026-12-01 21:40:05.250Z``; ``—`` if unknown."""
    if at is None:
        return UNKNOWN
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def utc_iso(at: datetime | None) -> str | None:
    return None if at is None else at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return UNKNOWN
    return f"{seconds:.3f} s" if seconds < 60 else f"{seconds:.1f} s"


# -- steps -------------------------------------------------------------------------------------


def step_duration_s(step: StepRecord) -> float | None:
    """The step's wall time, ``None`` if not known.

    A settled step's record is written by the resume that reads the person's answer: its
    model call and its action ran in an earlier attempt, so the time it holds is only
    that of the resume's bookkeeping, not the step's.
    """
    return None if step.settled_by is not None else step.duration_s


def step_time_text(step: StepRecord) -> str | None:
    """The step's wall time with its model call's and tool's inside, or ``None`` if the
    log has no time for it; ``unknown`` for a settled step, whose time is never known."""
    if step.settled_by is not None:
        return "unknown"
    if step.duration_s is None:
        return None
    parts = []
    if step.model_duration_s is not None:
        parts.append(f"model {seconds_text(step.model_duration_s)}")
    if step.action_duration_s is not None:
        parts.append(f"tool {seconds_text(step.action_duration_s)}")
    inside = f" ({', '.join(parts)})" if parts else ""
    return f"{seconds_text(step.duration_s)}{inside}"


def step_facts(step: StepRecord) -> list[tuple[str, str]]:
    """When and how long, and whether a resumed process wrote it; only what is known."""
    facts = []
    if (time := step_time_text(step)) is not None:
        facts.append(("time", time))
    if step.at is not None:
        facts.append(("written", utc_text(step.at)))
    if step.resumed:
        facts.append(("resumed", "written by a process that resumed the run"))
    if step.edited_by is not None:
        facts.append(("edited", edited_text(step.edited_by, step.proposed_action_text)))
    return facts


def edited_text(by: str, proposed: str | None) -> str:
    """Who edited an approved call before it ran, and the call the model proposed."""
    return f"by {by} before it ran; the model proposed {proposed or UNKNOWN}"


def step_json(
    step: StepRecord, settlement: Settlement | None = None, *, inherited: bool = False
) -> dict[str, JSONValue]:
    """The step's timing and token facts under fixed keys, ``null`` where not known, who
    settled its action if it was in doubt (``settlement``: that record in the log), and
    whether a fork took it over from its source (``inherited``) rather than ran it."""
    usage = step.usage
    settled = settlement if step.settled_by is not None else None
    return {
        "step": step.step,
        "inherited": inherited,
        "at": utc_iso(step.at),
        "duration_s": step_duration_s(step),
        "model_duration_s": step.model_duration_s,
        "action_duration_s": step.action_duration_s,
        "resumed": bool(step.resumed),
        "total_tokens": usage.total_tokens if usage is not None else None,
        **settlement_json(settled),
    }


# -- the run -----------------------------------------------------------------------------------


def started_at(view: RunView) -> datetime | None:
    first = view.log.records[0]
    return first.at if isinstance(first, RunStarted) else None


def last_at(view: RunView) -> datetime | None:
    return view.log.records[-1].at


def wall_time_s(view: RunView) -> float | None:
    """From the start record to the last record written; ``None`` if either time is unknown."""
    start, last = started_at(view), last_at(view)
    return None if start is None or last is None else (last - start).total_seconds()


def unreported_steps(view: RunView) -> list[int]:
    """Steps whose model replied without token counts: the run's total cannot be known."""
    return [s.step for s in view.steps if s.error is None and s.usage is None]


def run_tokens_text(view: RunView) -> str | None:
    """The run's tokens, saying which steps keep the total unknown; ``None`` with no steps."""
    usage = view.usage
    if usage is None:
        return "not reported" if view.steps else None
    text = usage_text(usage)
    missing = unreported_steps(view)
    if missing:
        named = ", ".join(str(step) for step in missing)
        text += f"; unknown, as the reply of step {named} reported no counts"
    return text


def resumed_after(view: RunView) -> list[int]:
    """Each step ``N`` after which a resumed process went on (``-1``: before step 0).

    A step record says whether a resumed process wrote it; an ``in_doubt`` end is only
    ever written by a resume. Two resumes in a row without a step between cannot be
    told apart in the log, so these are the resumes the log shows, at least.
    """
    points = []
    previous = False
    # A fork's inherited steps were written by its source's processes, not by its own.
    for step in view.steps[len(view.inherited) :]:
        if step.resumed and not previous:
            points.append(step.step - 1)
        previous = bool(step.resumed)
    last = view.log.records[-1]
    ended_in_doubt = isinstance(last, RunEnded) and last.stop_reason is StopReason.IN_DOUBT
    if ended_in_doubt and not previous:
        points.append(len(view.steps) - 1)
    return points


def resumed_text(view: RunView) -> str | None:
    points = resumed_after(view)
    if not points:
        return None
    where = ", ".join("before any step record" if n < 0 else f"after step {n}" for n in points)
    return f"{where} (at least {len(points) + 1} attempts)"


def run_facts(view: RunView) -> list[tuple[str, str]]:
    """When the run started and last wrote, its wall time, tokens, resumes and the
    OpenTelemetry trace id its spans are under when it is traced."""
    facts = [("started", utc_text(started_at(view)))]
    if (forked := fork_text(view)) is not None:
        facts.append(("forked from", forked))
    if (differs := fork_snapshot_text(view)) is not None:
        facts.append(("snapshot", differs))
    ended = isinstance(view.log.records[-1], RunEnded)
    facts.append(("ended" if ended else "last record", utc_text(last_at(view))))
    facts.append(("wall time", seconds_text(wall_time_s(view))))
    if (tokens := run_tokens_text(view)) is not None:
        facts.append(("tokens", tokens))
    if (resumed := resumed_text(view)) is not None:
        facts.append(("resumed", resumed))
    # Where OpenTelemetry puts the run, whether or not it was traced: the id is derived.
    facts.append(("trace id", run_trace_id(view.run_id)))
    return facts


def fork_text(view: RunView) -> str | None:
    """Where a fork came from and what it took over, in words; ``None`` for any other run."""
    started = view.started
    if started is None or started.forked_from is None:
        return None
    at_step = started.forked_at_step
    taken = (
        "nothing inherited"
        if not at_step
        else f"steps 0 to {at_step - 1} inherited: copies of its steps, not run again here"
    )
    return (
        f"run {started.forked_from!r} at step {at_step} ({taken}; "
        f"inherited sha256 {started.inherited_sha256})"
    )


def step_inherited_text(view: RunView, step: StepRecord) -> str | None:
    """For a step a fork took over: where it ran; ``None`` for a step of the run's own."""
    if not view.is_inherited(step):
        return None
    return f"from run {view.forked_from!r}, where it ran; not run again in this run"


def fork_json(view: RunView) -> dict[str, JSONValue]:
    """Where a fork came from, under fixed keys (``null`` for any other run)."""
    started = view.started
    return {
        "forked_from": started.forked_from if started is not None else None,
        "forked_at_step": started.forked_at_step if started is not None else None,
        "inherited_sha256": started.inherited_sha256 if started is not None else None,
    }


def show_json(view: RunView) -> dict[str, JSONValue]:
    """``show --json``: the trajectory document, with these facts added under new keys."""
    return {**trajectory_json(view), **run_json(view)}


def run_json(view: RunView) -> dict[str, JSONValue]:
    """The run's facts as fields added to ``show --json``."""
    usage = view.usage
    doubt = in_doubt(view)
    unreported: list[JSONValue] = [*unreported_steps(view)]
    resumes: list[JSONValue] = [*resumed_after(view)]
    settlements = view.settlements()
    return {
        "state_text": state_text(view),
        "in_doubt": doubt.json() if doubt is not None else None,
        "started_at": utc_iso(started_at(view)),
        "last_record_at_in_log": utc_iso(last_at(view)),
        "wall_time_s": wall_time_s(view),
        "total_tokens": usage.total_tokens if usage is not None else None,
        "tokens_unreported_steps": unreported,
        "resumed_after_steps": resumes,
        "trace_id": run_trace_id(view.run_id),
        **fork_json(view),
        **snapshots_json(view),
        "reconciled_steps": [*view.status.reconciled_steps],
        "pending_settlement": _pending_json(view),
        "timeline": [
            {
                **step_json(step, settlements.get(step.step), inherited=view.is_inherited(step)),
                "snapshot_index": snapshot_index(view, step),
            }
            for step in view.steps
        ],
    }


def _pending_json(view: RunView) -> dict[str, JSONValue] | None:
    pending = view.pending_settlement()
    if pending is None:
        return None
    return {"result_id": pending.result_id, "ran": pending.ran, **settlement_json(pending)}


def state_text(view: RunView) -> str:
    """The run's state from its recovery plan, with what it means and who goes on."""
    status = view.status
    state = status.state
    if state is RunState.FINISHED:
        return f"finished ({view.stop_reason})"
    if status.ready is Ready.CANCEL_REQUESTED:
        return f"{view.state}: a cancel was requested; {_ends(status)}"
    if state is RunState.IN_DOUBT and status.ready is Ready.PROBE:
        return (
            "in doubt: an effect may or may not have happened, and its tool's probe will "
            f"settle it; {goes_on(status)}"
        )
    if state is RunState.IN_DOUBT:
        return (
            "IN DOUBT: an effect may or may not have happened; resume will not replay it "
            "(polyloop settle says what happened)"
        )
    if state is RunState.AWAITING_APPROVAL:
        then = "resume" if status.agent is None else f"a worker hosting agent {status.agent!r}"
        return f"awaiting approval: nothing ran; polyloop approve or reject, then {then}"
    if state is RunState.RUNNING:
        owner = f" ({status.owner})" if status.owner else ""
        return f"running: a live worker{owner} holds the run now"
    settled = view.pending_settlement()
    intent = status.open_intent
    if settled is not None and intent is not None and intent.kind is IntentKind.MODEL_CALL:
        after = after_settlement(intent, settled)
        return f"resumable: the open model call was settled {settled_text(settled)}; {after}"
    return f"resumable: {_why_resumable(view)}; {goes_on(status)}"


def _why_resumable(view: RunView) -> str:
    if (settled := view.pending_settlement()) is not None:
        return f"the open action was settled {settled_text(settled)}"
    if view.stop_reason == StopReason.CANCELLED.value:
        return "cancelled"
    ready = view.status.ready
    if ready is None or ready is Ready.INTERRUPTED:
        return "not finished"
    return READY_WORDS[ready]


def _ends(status: RunStatus) -> str:
    """Who ends a run with a cancel request: its writer, a host of its agent, or resume."""
    if status.state is RunState.RUNNING:
        return "the writer driving it ends it before its next effect"
    who = "resume" if status.agent is None else f"a worker hosting agent {status.agent!r}"
    return f"{who} ends it, before any effect"


def goes_on(status: RunStatus) -> str:
    """Who takes a run that can go on: a host of its agent, or whoever resumes it."""
    if status.agent is None:
        return "resume goes on"
    return f"a worker hosting agent {status.agent!r} goes on (or resume)"


# -- the effect in doubt -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Doubt:
    """The intent of an in-doubt run, and when it was announced; ``probe`` says whether
    its tool's probe will settle it (``RunStatus.ready``)."""

    intent: Intent
    probe: bool = False

    @property
    def tool(self) -> str | None:
        if self.intent.tool_call is not None:
            return self.intent.tool_call.name
        payload = self.intent.payload
        name = payload.get("name") if isinstance(payload, dict) else None
        return name if isinstance(name, str) else None

    @property
    def arguments(self) -> JSONValue:
        if self.intent.tool_call is not None:
            return self.intent.tool_call.arguments
        payload = self.intent.payload
        return payload.get("arguments", payload) if isinstance(payload, dict) else payload

    def headline(self) -> str:
        intent = self.intent
        what = "model call" if intent.kind is IntentKind.MODEL_CALL else f"action {self.tool or ''}"
        then = (
            "its tool's probe will settle it when the run is driven"
            if self.probe
            else "check it by hand"
        )
        return (
            f"IN DOUBT: step {intent.step}'s {what.rstrip()} was announced and has no result; "
            f"it may or may not have happened, and is never replayed: {then}"
        )

    def fields(self) -> list[tuple[str, str]]:
        rows = [("step", str(self.intent.step)), ("kind", self.intent.kind.value)]
        if self.intent.kind is IntentKind.ACTION:
            rows.append(("tool", self.tool or UNKNOWN))
            rows.append(("arguments", json.dumps(self.arguments, ensure_ascii=False)))
        if self.intent.action_text is not None:
            rows.append(("action", self.intent.action_text))
        if self.intent.edited_by is not None:
            edited = edited_text(self.intent.edited_by, self.intent.proposed_action_text)
            rows.append(("edited", edited))
        rows.append(("result id", self.intent.result_id))
        rows.append(("announced", utc_text(self.intent.at)))
        return rows

    def json(self) -> dict[str, JSONValue]:
        return {
            "step": self.intent.step,
            "kind": self.intent.kind.value,
            "tool": self.tool,
            "arguments": self.arguments,
            "action_text": self.intent.action_text,
            "edited_by": self.intent.edited_by,
            "proposed_action_text": self.intent.proposed_action_text,
            "result_id": self.intent.result_id,
            "replay": self.intent.replay.value,
            "announced_at": utc_iso(self.intent.at),
            "probe_will_settle": self.probe,
        }


def in_doubt(view: RunView) -> Doubt | None:
    """The effect in doubt of an in-doubt run: its last intent that has no result."""
    if view.status.state is not RunState.IN_DOUBT:
        return None
    probe = view.status.ready is Ready.PROBE
    if view.status.open_intent is not None:
        return Doubt(view.status.open_intent, probe)
    answered = {r.result_id for r in view.log.records if isinstance(r, Result)}
    open_ = [r for r in view.log.records if isinstance(r, Intent) and r.result_id not in answered]
    return Doubt(open_[-1], probe) if open_ else None
