"""What a stored run looks like from outside: its state, its end, its steps."""

from __future__ import annotations

from dataclasses import dataclass

from polyloop import serialization
from polyloop._recovery import Plan, RecoveryState, read_plan, valid_step_count
from polyloop.cli._common import CliError
from polyloop.cli._stores import BrowsableStore, StoreSpec
from polyloop.types import JSONValue, RunLog, StepRecord

STATE_WORDS = {
    RecoveryState.FINISHED: "finished",
    RecoveryState.RESUMABLE: "resumable",
    RecoveryState.IN_DOUBT: "in doubt",
}


@dataclass(frozen=True, slots=True)
class RunView:
    """One run read back from its log."""

    run_id: str
    plan: Plan
    records: int

    @property
    def state(self) -> str:
        """``finished``, ``resumable`` or ``in doubt``."""
        return STATE_WORDS[self.plan.state]

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        return self.plan.steps

    @property
    def stop_reason(self) -> str | None:
        """The reason of the end record the log ends with, if it ends with one."""
        return self.plan.ended.stop_reason.value if self.plan.ended is not None else None

    @property
    def valid_steps(self) -> int:
        return valid_step_count(self.plan.steps)

    @property
    def final_answer(self) -> str | None:
        return self.plan.ended.final_answer if self.plan.ended is not None else None

    @property
    def detail(self) -> str | None:
        return self.plan.ended.detail if self.plan.ended is not None else None

    def interruption(self) -> str | None:
        """Where an unfinished run stopped, in words; ``None`` if it has an end record."""
        if self.plan.ended is not None:
            return None
        step = len(self.plan.steps)
        intent = self.plan.open_intent
        if intent is not None:
            return (f"step {step}: the {intent.kind.value} intent {intent.result_id!r} has no "
                    f"result (replay {intent.replay.value})")
        if self.plan.model_result is not None:
            return f"step {step}: the model replied; no action was announced yet"
        return f"after step {step - 1}: no end record" if step else "before the first step"


def view_of(log: RunLog) -> RunView:
    """Classify ``log``; raises ``CorruptLog`` for records that cannot follow each other."""
    return RunView(run_id=log.run_id, plan=read_plan(log), records=len(log.records))


async def read_view(store: BrowsableStore, spec: StoreSpec, run_id: str) -> RunView:
    """The run ``run_id`` of the store, or ``CliError`` if the store has no such run."""
    log = await store.read_log(run_id)
    if not log.records:
        raise CliError(f"unknown run id {run_id!r} in {spec.shown}")
    return view_of(log)


def summary_json(view: RunView) -> dict[str, JSONValue]:
    """The one-line description ``runs --json`` prints for a run."""
    return {
        "run_id": view.run_id,
        "state": view.state,
        "stop_reason": view.stop_reason,
        "step_count": len(view.steps),
        "valid_step_count": view.valid_steps,
        "detail": view.detail,
    }


def trajectory_json(view: RunView) -> dict[str, JSONValue]:
    """The whole run for machines: summary, snapshot, encoded step records, open intent."""
    plan = view.plan
    return {
        **summary_json(view),
        "final_answer": view.final_answer,
        "records": view.records,
        "interrupted": view.interruption(),
        "snapshot": dict(plan.started.snapshot) if plan.started is not None else None,
        "open_intent": (serialization.encode(plan.open_intent)
                        if plan.open_intent is not None else None),
        "steps": [serialization.encode(step) for step in plan.steps],
    }
