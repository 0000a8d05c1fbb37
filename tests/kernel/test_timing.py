"""Every record says when it was written; results and steps say how long their calls took.

A slow model and a slow tool make the durations measurable: each must be at least the
time its call slept, and the step's at least the sum. Times are aware UTC, in write order.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import (
    Ledger,
    crash_and_resume,
    definition,
    five_step_script,
    make_tools,
    request,
    same_outcome,
    uninterrupted,
)
from polyloop import run
from polyloop.ports import EventKind, ModelCall, ModelReply
from polyloop.stores import MemoryStore, SqliteStore
from polyloop.testing import RecordingSink, ScriptedModelClient
from polyloop.types import Intent, IntentKind, Replay, Result, StepRecord

pytestmark = pytest.mark.anyio

MODEL_S = 0.05
TOOL_S = 0.03


class SlowModel:
    """Answers from a script after sleeping ``MODEL_S``."""

    def __init__(self, script: list[str]) -> None:
        self.scripted = ScriptedModelClient(script)

    def parameters(self) -> Any:
        return self.scripted.parameters()

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.sleep(MODEL_S)
        return await self.scripted.call(call)


async def test_every_record_carries_its_time_and_each_call_its_duration() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger(), delay=TOOL_S)
    before = datetime.now(UTC)
    result = await run(definition(store, model=SlowModel(five_step_script())), request("r", tools))
    after = datetime.now(UTC)
    records = (await store.read_log("r")).records

    times = [record.at for record in records]
    assert all(at is not None and at.tzinfo is UTC for at in times)
    assert times == sorted(times)  # type: ignore[type-var]
    assert before <= times[0] and times[-1] <= after  # type: ignore[operator]

    model_results = [
        r for r in records if isinstance(r, Result) and r.kind is IntentKind.MODEL_CALL
    ]
    action_results = [r for r in records if isinstance(r, Result) and r.kind is IntentKind.ACTION]
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert len(model_results) == len(steps) == 5
    assert all(r.duration_s is not None and r.duration_s >= MODEL_S for r in model_results)
    assert [s.model_duration_s for s in steps] == [r.duration_s for r in model_results]

    acted = [s for s in steps if s.action_duration_s is not None]
    # Every announced action has a duration, the one the schema refused included; only
    # the reply that is not JSON announced none.
    assert [s.step for s in acted] == [0, 1, 3, 4]
    assert [s.action_duration_s for s in acted] == [r.duration_s for r in action_results]
    slept = [acted[0], acted[2]]  # the two doublings that ran
    assert all(s.action_duration_s >= TOOL_S for s in slept)  # type: ignore[operator]
    for step in steps:
        inner = (step.model_duration_s or 0.0) + (step.action_duration_s or 0.0)
        assert step.duration_s is not None and step.duration_s >= inner
    assert result.steps == tuple(steps)


async def test_a_finished_step_event_names_the_intent_of_its_action() -> None:
    sink = RecordingSink()
    tools = make_tools(Ledger())
    await run(
        definition(MemoryStore(), script=five_step_script(), events=sink), request("r", tools)
    )
    finished = [e for e in sink.events if e.kind is EventKind.STEP_FINISHED]
    intents = [e.intent for e in finished]
    assert [i.result_id if i else None for i in intents] == [
        "r:0:action",
        "r:1:action",  # announced, then refused by the tool's schema
        None,  # not JSON: no action
        "r:3:action",
        "r:4:action",
    ]
    assert all(isinstance(i, Intent) and i.kind is IntentKind.ACTION for i in intents if i)
    assert intents[4] is not None and intents[4].payload == {
        "name": "submit",
        "arguments": {"answer": "6"},
    }
    others = [e for e in sink.events if e.kind is not EventKind.STEP_FINISHED]
    assert others and all(e.intent is None for e in others)


async def test_steps_written_after_a_resume_say_so_and_earlier_ones_do_not(
    tmp_path: Path,
) -> None:
    def open_store() -> SqliteStore:
        return SqliteStore(tmp_path / "runs.db")

    # Writes: the start, then per step a model intent, its result, an action intent and
    # the step: the crash lands after the second step is written.
    resumed, _, store = await crash_and_resume(open_store, 9, Replay.ALLOWED, five_step_script())
    steps = [r for r in (await store.read_log("r")).records if isinstance(r, StepRecord)]
    await store.aclose()  # type: ignore[attr-defined]
    assert [s.resumed for s in steps] == [None, None, True, True, True]
    assert resumed.steps == tuple(steps)
    plain = await uninterrupted(MemoryStore, Replay.ALLOWED, five_step_script())
    assert all(s.resumed is None for s in plain.steps)
    assert same_outcome(resumed, plain)  # the fields that differ are the timing ones
