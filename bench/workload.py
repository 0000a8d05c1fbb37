"""A run of realistic shape for the throughput benchmark (``bench/throughput.py``).

One model client serves every run: it waits ``latency_s`` (``anyio.sleep``, as a
client awaiting a server does) and answers a JSON tool call with arguments. Each step's
tool validates those arguments against a JSON Schema, waits ``tool_s`` and returns an
observation of about 3 KB that differs from step to step, so the transcript the model
is shown grows by that much each step. The last step calls a tool that completes the
run. Nothing here is PolyLoop's own code but the run itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import anyio

from polyloop import (
    Budget,
    Definition,
    Injection,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    Store,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    run,
)
from polyloop.ports import ModelCall, ModelReply
from polyloop.testing import JsonActionInterpreter
from polyloop.types import JSONValue

OBSERVATION_CHARS = 3_000
SEARCH_SCHEMA: dict[str, JSONValue] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 1},
        "page": {"type": "integer", "minimum": 0},
    },
    "required": ["query", "page"],
    "additionalProperties": False,
}
SUBMIT_SCHEMA: dict[str, JSONValue] = {
    "type": "object",
    "properties": {"summary": {"type": "string"}},
    "required": ["summary"],
    "additionalProperties": False,
}
_TEXT = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "


class LatencyModel:
    """A model client shared by all runs: waits, then asks for the step's tool."""

    def __init__(self, steps: int, latency_s: float) -> None:
        self.steps = steps
        self.latency_s = latency_s

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "bench-latency", "steps": self.steps, "latency_s": self.latency_s}

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.sleep(self.latency_s)
        index = call.call_index
        if index >= self.steps - 1:
            reply = {"tool": "submit", "arguments": {"summary": f"done after {index + 1} steps"}}
        else:
            reply = {"tool": "search", "arguments": {"query": f"topic {index}", "page": index}}
        return ModelReply(call_id=None, content=json.dumps(reply), reasoning=None)


class Workload:
    """One definition and tool set, shared by every run of a cell; counts steps done."""

    def __init__(self, store: Store, *, steps: int, latency_s: float, tool_s: float) -> None:
        self.steps = steps
        self.tool_s = tool_s
        self.steps_done = 0
        self.tools = ToolRegistry(
            [
                ToolSpec(
                    name="search",
                    description="Search the corpus; one page of results.",
                    parameters=SEARCH_SCHEMA,
                    handler=self._search,
                    replay=Replay.ALLOWED,
                ),
                ToolSpec(
                    name="submit",
                    description="Submit the summary; ends the task.",
                    parameters=SUBMIT_SCHEMA,
                    handler=self._submit,
                    replay=Replay.NEVER,
                    completes=True,
                ),
            ],
            max_observation_chars=OBSERVATION_CHARS + 1_000,
        )
        self.executor = self.tools.executor()
        self.definition = Definition(
            model=LatencyModel(steps, latency_s),
            interpreter=JsonActionInterpreter(),
            store=store,
            events=NullSink(),
            texts=ObservationTexts(not_executed="Refused: {reason}", env_fault="Fault: {detail}"),
        )

    async def _search(self, arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.sleep(self.tool_s)
        self.steps_done += 1
        head = f"results for {arguments['query']!r}, page {arguments['page']}: "
        body = (_TEXT * (OBSERVATION_CHARS // len(_TEXT) + 1))[: OBSERVATION_CHARS - len(head)]
        return head + body

    async def _submit(self, arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.sleep(self.tool_s)
        self.steps_done += 1
        return "submitted"

    def request(self, run_id: str) -> Request:
        return Request(
            run_id=run_id,
            budget=Budget(
                max_steps=self.steps + 1,
                max_valid_steps=self.steps + 1,
                max_context_chars=10**9,
            ),
            executor=self.executor,
            tools=self.tools,
            run_context=(Message.text(Role.SYSTEM, "You are a research agent."),),
            goal_context=(Message.text(Role.USER, "Search the corpus, then submit a summary."),),
            injection=Injection(entries={}),
            binding={},
            model_replay=Replay.ALLOWED,
            observation_template="Observation: {observation}",
            tool_style=ToolStyle.JSON,
            cancel_grace_s=5.0,
        )

    async def run(self, run_id: str) -> None:
        result = await run(self.definition, self.request(run_id))
        if result.step_count != self.steps or result.stop_reason.value != "submitted":
            raise AssertionError(
                f"run {run_id!r} ended {result.stop_reason} after {result.step_count} steps"
            )

    async def warm(self) -> None:
        """A few short runs first, so connections and files exist before timing."""
        done = self.steps_done
        async with anyio.create_task_group() as group:
            for index in range(4):
                group.start_soon(self.run, f"warm-{index}")
        self.steps_done = done
