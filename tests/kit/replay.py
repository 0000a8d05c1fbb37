"""Runs to record and re-drive offline, and how two logs of different run ids compare."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from polyloop import (
    Action,
    Decision,
    FinishReason,
    Intent,
    Interpreter,
    ModelReply,
    Replay,
    Result,
    RunEnded,
    RunLog,
    RunResult,
    RunStarted,
    StepRecord,
    Store,
    ToolRegistry,
    ToolSpec,
    Usage,
    run,
)
from polyloop.stores import MemoryStore
from polyloop.testing import (
    JsonActionInterpreter,
    RecordedExecutor,
    RecordedModelClient,
    ScriptedModelClient,
    without_timing,
)

# Actions, a call the tool's schema refuses, a model's refusal, an invalid reply, a
# reply that reports its usage, and a submit: every kind of step a recorded run holds.
SCRIPT: list[Any] = [
    tool_call("double", n=1),
    tool_call("double", n="two"),
    ModelReply(
        call_id="refusal-2",
        content="",
        reasoning="not this one",
        finish=FinishReason.REFUSAL,
        refusal="I will not double that.",
    ),
    "this is not JSON",
    ModelReply(
        call_id="reply-4",
        content=tool_call("double", n=3),
        reasoning=None,
        finish=FinishReason.STOP,
        usage=Usage(input_tokens=40, output_tokens=7),
        model="model-1",
    ),
    tool_call("submit", answer="6"),
]
ANSWERED = [tool_call("double", n=1), "not JSON", answer("2")]


async def record(store: Store, run_id: str = "src", script: Sequence[Any] = SCRIPT) -> RunResult:
    """A run recorded on ``store`` with the scripted model and real tools."""
    return await run(definition(store, script=script), request(run_id, make_tools(Ledger())))


def offline(log: RunLog, **overrides: Any) -> tuple[Any, RecordedModelClient, RecordedExecutor]:
    """The definition and request that re-drive ``log`` under run id ``again`` on a new
    memory store: the recorded request's settings, the two recorded doubles in place of
    the model and the tools' executor. ``interpreter`` and request fields may be overridden.
    """
    model, executor = RecordedModelClient.from_log(log), RecordedExecutor.from_log(log)
    interpreter = overrides.pop("interpreter", None)
    store = overrides.pop("store", None) or MemoryStore()
    redriven = request(
        overrides.pop("run_id", "again"),
        make_tools(Ledger()),
        **{"executor": executor, **overrides},
    )
    return (definition(store, model=model, interpreter=interpreter), redriven), model, executor


def without_run(records: Sequence[Any], run_id: str) -> list[Any]:
    """Records after the start record, without timing and without the run id (which
    is every record's ``run_id`` and the head of every ``result_id``)."""

    def plain(record: Any) -> Any:
        record = without_timing(record)
        changes: dict[str, Any] = {"run_id": ""}
        if isinstance(record, (Intent, Result)):
            assert record.result_id.startswith(f"{run_id}:")
            changes["result_id"] = record.result_id[len(run_id) :]
        return dataclasses.replace(record, **changes)

    assert isinstance(records[0], RunStarted)
    return [plain(record) for record in records[1:]]


def plain_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    return [dataclasses.replace(without_timing(step), run_id="") for step in steps]


async def copied(log: RunLog) -> MemoryStore:
    """A new memory store holding ``log``'s run, record for record."""
    store = MemoryStore()
    await store.claim_run(log.run_id)
    for record in log.records:
        if isinstance(record, RunStarted):
            await store.start_run(record)
        elif isinstance(record, Intent):
            await store.write_intent(record)
        elif isinstance(record, Result):
            await store.write_result(record)
        elif isinstance(record, StepRecord):
            await store.write_step(record, None)
        elif isinstance(record, RunEnded):
            await store.end_run(record)
    await store.release_run(log.run_id)
    return store


class ThreeIsFour:
    """An interpreter that decides as the JSON one does, except that it doubles 4 where
    the model asked for 3: a new interpreter that decides differently on old runs."""

    def __init__(self) -> None:
        self._inner: Interpreter = JsonActionInterpreter()

    def parameters(self) -> Any:
        return {"kind": "three-is-four"}

    def interpret(self, reply: ModelReply) -> Decision:
        decision = self._inner.interpret(reply)
        if isinstance(decision, Action) and decision.payload == {
            "name": "double",
            "arguments": {"n": 3},
        }:
            return dataclasses.replace(decision, payload={"name": "double", "arguments": {"n": 4}})
        return decision


async def echo_log(actions: int) -> tuple[RunLog, ScriptedModelClient]:
    """The log of a run that says ``echo(text="hello")`` ``actions`` times, then answers,
    and the scripted model it was recorded with (its calls hold the messages sent)."""

    async def echo(arguments: dict[str, Any], *, result_id: str) -> str:
        return str(arguments["text"])

    schema: dict[str, Any] = {"type": "object", "properties": {"text": {"type": "string"}}}
    spec = ToolSpec(
        name="echo",
        description="Say the text back.",
        parameters=schema,
        handler=echo,
        replay=Replay.ALLOWED,
    )
    tools = ToolRegistry([spec], max_observation_chars=1000)
    model = ScriptedModelClient([tool_call("echo", text="hello")] * actions + [answer("done")])
    store = MemoryStore()
    await run(definition(store, model=model), request("recorded", tools))
    return await store.read_log("recorded"), model
