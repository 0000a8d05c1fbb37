"""What a stored run looks like from outside: its status, its end, its steps.

Everything here comes through the public API: :func:`polyloop.run_status` for where a
run stands, and the store's own ``read_log`` and ``list_runs`` for the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime

from polyloop import serialization
from polyloop.cli._common import CliError
from polyloop.cli._stores import StoreSpec
from polyloop.ports import ManagedStore
from polyloop.session import run_status
from polyloop.types import (
    Amended,
    CorruptLog,
    FinishReason,
    Intent,
    IntentKind,
    JSONValue,
    Proposal,
    Ready,
    Result,
    Review,
    RunEnded,
    RunLog,
    RunStarted,
    RunState,
    RunStatus,
    SchemaMajorMismatch,
    Settlement,
    StepRecord,
    Usage,
    Verdict,
)

STATE_WORDS = {
    RunState.RUNNING: "running",
    RunState.RESUMABLE: "resumable",
    RunState.IN_DOUBT: "in doubt",
    RunState.AWAITING_APPROVAL: "awaiting approval",
    RunState.FINISHED: "finished",
}
CORRUPT = "corrupt"
READY_WORDS = {
    Ready.NEW: "not yet driven",
    Ready.APPROVED: "approved",
    Ready.REJECTED: "rejected",
    Ready.SETTLED: "settled",
    Ready.PROBE: "its tool's probe will settle it",
    Ready.INTERRUPTED: "interrupted",
    Ready.CANCEL_REQUESTED: "cancel requested",
}


def state_detail(status: RunStatus) -> str | None:
    """What the state's word leaves out, for a person: why a run nobody drives goes on,
    and who takes it (a worker hosting its agent, or whoever resumes a run started
    without one); or that a run in doubt waits for a person. ``None`` if the word says
    it all (running, finished, awaiting approval)."""
    if status.ready is Ready.CANCEL_REQUESTED and status.state is RunState.RUNNING:
        return "cancel requested: its writer ends it before its next effect"
    if status.ready is not None:
        who = "waiting for a worker" if status.agent is not None else "resume it to go on"
        return f"{READY_WORDS[status.ready]}, {who}"
    if status.state is RunState.IN_DOUBT:
        return "waiting for a person"
    return None


def state_line(status: RunStatus) -> str:
    """The state's word, then its detail in brackets: ``resumable (approved, waiting for
    a worker)``. The word comes first, so a script that reads it keeps working."""
    detail = state_detail(status)
    word = STATE_WORDS[status.state]
    return word if detail is None else f"{word} ({detail})"


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One line of ``polyloop runs``: a run's status, or why it could not be read."""

    run_id: str
    status: RunStatus | None
    problem: str | None = None

    @property
    def state(self) -> str:
        """``running``, ``resumable``, ``in doubt``, ``awaiting approval``, ``finished``
        or ``corrupt``."""
        return CORRUPT if self.status is None else STATE_WORDS[self.status.state]

    @property
    def state_line(self) -> str:
        """The state with its detail, as ``polyloop runs`` prints it."""
        return CORRUPT if self.status is None else state_line(self.status)

    @property
    def stop_reason(self) -> str | None:
        status = self.status
        return status.stop_reason.value if status and status.stop_reason else None

    @property
    def step_count(self) -> int | None:
        return self.status.steps if self.status is not None else None

    @property
    def valid_steps(self) -> int | None:
        return self.status.valid_steps if self.status is not None else None

    @property
    def detail(self) -> str | None:
        return self.status.detail if self.status is not None else self.problem

    def age_s(self, now: datetime) -> float | None:
        """How long ago the run started, at ``now``."""
        return span_s(self.status.started_at, now) if self.status is not None else None

    @property
    def duration_s(self) -> float | None:
        """From the start record to the end record; ``None`` while the run goes on."""
        return duration_s(self.status) if self.status is not None else None


def span_s(start: datetime | None, end: datetime | None) -> float | None:
    """The seconds from ``start`` to ``end``; ``None`` if either is unknown."""
    return None if start is None or end is None else max(0.0, (end - start).total_seconds())


def duration_s(status: RunStatus) -> float | None:
    return span_s(status.started_at, status.ended_at)


def span_text(seconds: float | None) -> str:
    """A span as a column shows it: ``0.4s``, ``42s``, ``3m12s``, ``2h05m``, ``4d03h``."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


@dataclass(frozen=True, slots=True)
class RunView:
    """One run read back whole: its status and its log, and when they were read
    (``read_at``: what an effect in progress is timed against)."""

    status: RunStatus
    log: RunLog
    read_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def run_id(self) -> str:
        return self.status.run_id

    @property
    def state(self) -> str:
        return STATE_WORDS[self.status.state]

    @property
    def records(self) -> int:
        return len(self.log.records)

    @property
    def started(self) -> RunStarted | None:
        first = self.log.records[0]
        return first if isinstance(first, RunStarted) else None

    @property
    def inherited(self) -> tuple[StepRecord, ...]:
        """The steps a fork took over from its source (held in its start record); empty
        for any other run."""
        started = self.started
        return started.inherited_steps if started is not None else ()

    @property
    def forked_from(self) -> str | None:
        started = self.started
        return started.forked_from if started is not None else None

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        """Every step of the run, a fork's inherited ones first."""
        own = (record for record in self.log.records if isinstance(record, StepRecord))
        return (*self.inherited, *own)

    def is_inherited(self, step: StepRecord) -> bool:
        return step.step < len(self.inherited)

    def reviews(self) -> dict[int, list[Review]]:
        """The proposals, verdicts, settlements and amendments of the log, by the step they
        belong to (an amendment: the first step run under it)."""
        by_step: dict[int, list[Review]] = {}
        step = len(self.inherited)  # a fork's own steps start after its inherited ones
        for record in self.log.records:
            if isinstance(record, StepRecord):
                step = record.step + 1
            elif isinstance(record, Proposal | Verdict | Settlement | Amended):
                by_step.setdefault(step, []).append(record)
        return by_step

    def settlements(self) -> dict[int, Settlement]:
        """The settlement of each step whose action was in doubt, by step; a settlement
        the run has not yet turned into a step record is under the next step's number."""
        return {
            step: review
            for step, reviews in self.reviews().items()
            for review in reviews
            if isinstance(review, Settlement)
        }

    def pending_settlement(self) -> Settlement | None:
        """A settlement of the open action that no step record has followed yet."""
        return self.settlements().get(len(self.steps))

    @property
    def stop_reason(self) -> str | None:
        """The reason of the end record the log ends with, if it ends with one."""
        reason = self.status.stop_reason
        return reason.value if reason is not None else None

    @property
    def valid_steps(self) -> int:
        return self.status.valid_steps

    @property
    def final_answer(self) -> str | None:
        last = self.log.records[-1]
        return last.final_answer if isinstance(last, RunEnded) else None

    @property
    def cancelled_by(self) -> str | None:
        """Who asked for the run to be cancelled, if a person's cancel ended it."""
        last = self.log.records[-1]
        return last.cancelled_by if isinstance(last, RunEnded) else None

    @property
    def detail(self) -> str | None:
        return self.status.detail

    @property
    def usage(self) -> Usage | None:
        """The tokens of the run's model calls, as ``RunResult.usage`` sums them."""
        return Usage.of_steps(self.steps)

    @property
    def snapshot(self) -> dict[str, JSONValue]:
        started = self.started
        return dict(started.snapshot) if started is not None else {}

    def in_progress(self) -> Intent | None:
        """The effect a live writer is performing now (its intent), if there is one."""
        if self.status.state is not RunState.RUNNING or self.status.open_intent is None:
            return None
        return self.status.open_intent

    def in_progress_s(self) -> float | None:
        """How long the effect in progress has been going on, when its intent has a time."""
        intent = self.in_progress()
        return None if intent is None else span_s(intent.at, self.read_at)

    def where_it_stands(self) -> tuple[str, str] | None:
        """``("in progress", ...)`` while a live writer performs an effect, else
        ``("interrupted", ...)`` for where an unfinished run stopped; ``None`` once it ended."""
        intent = self.in_progress()
        if intent is None or isinstance(self.log.records[-1], RunEnded):
            interruption = self.interruption()
            return None if interruption is None else ("interrupted", interruption)
        what = "model call" if intent.kind is IntentKind.MODEL_CALL else "action"
        seconds = self.in_progress_s()
        since = "" if seconds is None else f" for {span_text(seconds)}, since {_utc(intent.at)}"
        return (
            "in progress",
            f"step {self.status.steps}: the {what} {intent.result_id!r} has been in "
            f"progress{since} (a live writer is on it now)",
        )

    def interruption(self) -> str | None:
        """Where an unfinished run stopped, in words; ``None`` if it has an end record."""
        if isinstance(self.log.records[-1], RunEnded):
            return None
        step = self.status.steps
        intent = self.status.open_intent
        if intent is not None:
            doing = " (a live writer is on it now)" if self.status.state is RunState.RUNNING else ""
            if (settled := self.pending_settlement()) is not None:
                doing += f"; settled {settled_text(settled)}: {after_settlement(intent, settled)}"
            return (
                f"step {step}: the {intent.kind.value} intent {intent.result_id!r} has no "
                f"result (replay {intent.replay.value}){doing}"
            )
        last = self.log.records[-1]
        if isinstance(last, Result) and last.kind is IntentKind.MODEL_CALL:
            return f"step {step}: the model replied; no action was announced yet"
        return f"after step {step - 1}: no end record" if step else "before the first step"


def _utc(at: datetime | None) -> str:
    return "-" if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


_FINISH_WORDS = {
    FinishReason.STOP: "stop",
    FinishReason.TOOL_CALLS: "tool calls",
    FinishReason.LENGTH: "cut off at the length limit",
    FinishReason.CONTENT_FILTER: "withheld by the content filter",
    FinishReason.REFUSAL: "refused",
    FinishReason.OTHER: "other (the server gave a reason the adapter does not know)",
}


def usage_text(usage: Usage) -> str:
    """Token counts in words with their total, ``?`` for a count the server did not report."""

    def count(value: int | None) -> str:
        return "?" if value is None else f"{value:,}"

    text = f"{count(usage.input_tokens)} in, {count(usage.output_tokens)} out"
    if usage.reasoning_tokens is not None:
        text += f" ({count(usage.reasoning_tokens)} reasoning)"
    return f"{text}, {count(usage.total_tokens)} total"


def review_facts(reviews: list[Review]) -> list[tuple[str, str]]:
    """What people were asked and answered in a step, as labelled lines of text."""
    facts = []
    proposed: JSONValue = None
    for review in reviews:
        when = f" at {review.at.isoformat()}" if review.at is not None else ""
        if isinstance(review, Proposal):
            proposed = review.payload
            facts.append(("proposed", f"waits for approval{when}: {review.description}"))
        elif isinstance(review, Verdict):
            if review.approved:
                # Only an edit is worth a word: an approval as proposed runs the proposal.
                edited = ""
                if isinstance(review.payload, dict) and review.payload != proposed:
                    arguments = json.dumps(review.payload.get("arguments"), ensure_ascii=False)
                    edited = f" with arguments {arguments}"
                facts.append(("approved", f"by {review.by}{when}{edited}"))
            else:
                facts.append(("rejected", f"by {review.by}{when}: {review.reason}"))
        elif isinstance(review, Amended):
            keys = ", ".join(key for key, _, _ in review.differences)
            facts.append(("amended", f"by {review.by}{when}: {review.reason} (changed {keys})"))
        elif review.by_probe:
            facts.append(("settled", f"{settled_text(review)}{when}{probe_time_text(review)}"))
        else:
            how = "ran" if review.ran else "did not run"
            facts.append(("settled", f"by {review.by}{when}: {how}"))
    return facts


def settler_text(settlement: Settlement) -> str:
    """Who settled an action: ``the probe of tool 'pay'``, or the person's name."""
    if settlement.by_probe:
        tool = settlement.by.split(":", 1)[1]
        return f"the probe of tool {tool!r}"
    return settlement.by


def settled_text(settlement: Settlement) -> str:
    """``by the probe of tool 'pay' (it ran)``; a person's, ``by carol (it ran)``."""
    how = "it ran" if settlement.ran else "it did not run"
    return f"by {settler_text(settlement)} ({how})"


def after_settlement(intent: Intent | None, settlement: Settlement) -> str:
    """What ``resume`` makes of a settlement it has not acted on yet."""
    if intent is None or intent.kind is not IntentKind.MODEL_CALL:
        return "resume records it and goes on"
    if settlement.ran:
        return "resume ends the run model_failure (the reply is lost) and calls no model"
    return "resume calls the model again, as a new call"


def probe_time_text(settlement: Settlement) -> str:
    """How long the probe took, as ``; the probe took 0.004 s``; empty if unknown."""
    seconds = settlement.duration_s
    if seconds is None:
        return ""
    # A probe is often a single lookup: milliseconds say more than "0.000 s".
    took = f"{seconds * 1000:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"
    return f"; the probe took {took}"


def settlement_json(settlement: Settlement | None) -> dict[str, JSONValue]:
    """Who settled an action in doubt, under keys shared by a step and a pending answer."""
    return {
        "settled_by": settlement.by if settlement is not None else None,
        "settled_by_probe": settlement is not None and settlement.by_probe,
        "probe_duration_s": settlement.duration_s if settlement is not None else None,
    }


def reply_facts(step: StepRecord) -> list[tuple[str, str]]:
    """What the server reported about a step's reply, as labelled lines of text."""
    facts = []
    if step.finish is not None:
        facts.append(("finish", _FINISH_WORDS[step.finish]))
    if step.refusal is not None:
        facts.append(("refusal", step.refusal))
    if step.usage is not None:
        facts.append(("tokens", usage_text(step.usage)))
    if step.model is not None:
        facts.append(("model", step.model))
    return facts


async def summaries(store: ManagedStore) -> list[RunSummary]:
    """Every run of the store; a run whose log cannot be read is marked, not fatal."""
    listed = []
    for run in await store.list_runs():
        try:
            listed.append(RunSummary(run.run_id, await run_status(store, run.run_id)))
        except (CorruptLog, SchemaMajorMismatch) as exc:
            listed.append(RunSummary(run.run_id, None, str(exc)))
    return listed


async def read_view(store: ManagedStore, spec: StoreSpec, run_id: str) -> RunView:
    """The run ``run_id`` of the store, or ``CliError`` if the store has no such run."""
    log = await store.read_log(run_id)
    if not log.records:
        raise CliError(f"unknown run id {run_id!r} in {spec.shown}")
    return RunView(status=await run_status(store, run_id), log=log)


def summary_json(run: RunSummary | RunView) -> dict[str, JSONValue]:
    """The one-line description ``runs --json`` prints for a run."""
    if isinstance(run, RunView):
        steps: int | None = run.status.steps
        valid: int | None = run.valid_steps
    else:
        steps, valid = run.step_count, run.valid_steps
    status = run.status
    return {
        "run_id": run.run_id,
        "state": run.state,
        "stop_reason": run.stop_reason,
        "step_count": steps,
        "valid_step_count": valid,
        "detail": run.detail,
        "ready": status.ready.value if status is not None and status.ready else None,
        "agent": status.agent if status is not None else None,
        "last_record_at": (
            status.last_record_at.isoformat()
            if status is not None and status.last_record_at
            else None
        ),
        "started_at": _iso(status.started_at if status is not None else None),
        "ended_at": _iso(status.ended_at if status is not None else None),
        "duration_s": duration_s(status) if status is not None else None,
    }


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def trajectory_json(view: RunView) -> dict[str, JSONValue]:
    """The whole run for machines: summary, snapshot, encoded step records, open intent."""
    intent = view.status.open_intent
    return {
        **summary_json(view),
        "final_answer": view.final_answer,
        "records": view.records,
        "interrupted": view.interruption(),
        "in_progress": _in_progress_json(view),
        "snapshot": view.snapshot,
        "open_intent": serialization.encode(intent) if intent is not None else None,
        "proposal": (
            serialization.encode(view.status.proposal) if view.status.proposal is not None else None
        ),
        "reviews": [
            serialization.encode(review)
            for reviews in view.reviews().values()
            for review in reviews
        ],
        "usage": None if (usage := view.usage) is None else _usage_json(usage),
        "steps": [serialization.encode(step) for step in view.steps],
    }


def _in_progress_json(view: RunView) -> dict[str, JSONValue] | None:
    intent = view.in_progress()
    if intent is None:
        return None
    return {
        "result_id": intent.result_id,
        "kind": intent.kind.value,
        "since": _iso(intent.at),
        "for_s": view.in_progress_s(),
    }


def _usage_json(usage: Usage) -> dict[str, JSONValue]:
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "reasoning_tokens": usage.reasoning_tokens,
    }
