"""The run of realistic shape of benchmark 8 (``python -m bench throughput``): a shared
model client with latency, a search tool with checked arguments and a 3 KB observation.

The script (:func:`decision`), the observation and the schemas are shared with the
hand-written floor (:class:`HandWorkload`) and the peers (``bench/peers.py``), so every
cell does the same work; every driver counts its model decisions and tool executions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from jsonschema import Draft202012Validator

from bench._common import each
from bench.agents import definition, object_schema, request
from polyloop import Replay, Store, ToolRegistry, ToolSpec, run
from polyloop.ports import ModelCall, ModelReply
from polyloop.testing import JsonActionInterpreter
from polyloop.types import JSONValue

OBSERVATION_CHARS = 3_000
SEARCH_SCHEMA = object_schema(
    query={"type": "string", "minLength": 1}, page={"type": "integer", "minimum": 0}
)
SUBMIT_SCHEMA = object_schema(summary={"type": "string"})
SUBMITTED = "submitted"
SYSTEM_PROMPT = "You are a research agent."
GOAL = "Search the corpus, then submit a summary."
_TEXT = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "


def decision(index: int, steps: int) -> dict[str, Any]:
    """The tool call the model asks for at step ``index``: search, and submit on the last."""
    if index >= steps - 1:
        return {"tool": "submit", "arguments": {"summary": f"done after {index + 1} steps"}}
    return {"tool": "search", "arguments": {"query": f"topic {index}", "page": index}}


def observation(arguments: Mapping[str, Any]) -> str:
    """The search tool's result: about 3 KB, different on every page."""
    head = f"results for {arguments['query']!r}, page {arguments['page']}: "
    body = (_TEXT * (OBSERVATION_CHARS // len(_TEXT) + 1))[: OBSERVATION_CHARS - len(head)]
    return head + body


@dataclass
class Counts:
    """Model decisions and tool executions, counted where they happen."""

    decisions: int = 0
    executions: int = 0
    rows: int = 0  # rows committed, by the hand-written durable floors only


class Driver(Protocol):
    """What a benchmark cell drives: one run at a time, many at once, counted."""

    counts: Counts

    async def run(self, run_id: str) -> None: ...


async def warm(driver: Driver, prefix: str = "warm", runs: int = 4) -> None:
    """A few short runs first, so connections and files exist before timing; their
    decisions and tool executions are not counted. ``prefix`` keeps the run ids of
    processes that share a database apart."""
    await each(runs, lambda index: driver.run(f"{prefix}-{index}"))
    driver.counts.decisions = driver.counts.executions = driver.counts.rows = 0


class LatencyModel:
    """A model client shared by all runs: waits, then asks for the step's tool."""

    def __init__(self, steps: int, latency_s: float, counts: Counts) -> None:
        self.steps = steps
        self.latency_s = latency_s
        self.counts = counts

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "bench-latency", "steps": self.steps, "latency_s": self.latency_s}

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.sleep(self.latency_s)
        self.counts.decisions += 1
        reply = decision(call.call_index, self.steps)
        return ModelReply(call_id=None, content=json.dumps(reply), reasoning=None)


class Workload:
    """One definition and tool set, shared by every run of a cell."""

    def __init__(self, store: Store, *, steps: int, latency_s: float, tool_s: float) -> None:
        self.steps = steps
        self.tool_s = tool_s
        self.counts = Counts()
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
        model = LatencyModel(steps, latency_s, self.counts)
        self.definition = definition(model, JsonActionInterpreter(), store)

    async def _search(self, arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.sleep(self.tool_s)
        self.counts.executions += 1
        return observation(arguments)

    async def _submit(self, arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.sleep(self.tool_s)
        self.counts.executions += 1
        return SUBMITTED

    async def run(self, run_id: str) -> None:
        asked = request(
            run_id,
            self.tools,
            self.executor,
            max_steps=self.steps + 1,
            max_context_chars=10**9,
            system=SYSTEM_PROMPT,
            goal=GOAL,
            model_replay=Replay.ALLOWED,
        )
        result = await run(self.definition, asked)
        if result.step_count != self.steps or result.stop_reason.value != "submitted":
            raise AssertionError(
                f"run {run_id!r} ended {result.stop_reason} after {result.step_count} steps"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class HandStep:
    """One step of a hand-written run's trajectory, as small as a row of it can be: the
    model's output, the action and the observation the tool returned (that very object,
    not a copy), and a few scalars."""

    step: int
    model_output: str
    action_text: str
    observation: str
    done: bool
    model_duration_s: float
    action_duration_s: float


def action_text(tool: str, arguments: Mapping[str, Any]) -> str:
    """The action as a trajectory names it: ``search({"page": 0, "query": "topic 0"})``."""
    return f"{tool}({json.dumps(arguments, sort_keys=True)})"


class HandWorkload:
    """The same work written by hand: no kernel, no store, nothing durable (the floor).

    Each step encodes and decodes the tool call as a model client and a JSON interpreter
    do, and checks its arguments with a validator built once (unless ``validate`` is
    false). With ``trajectory`` the run also keeps one :class:`HandStep` a step, as
    ``RunResult.steps`` does (:meth:`trajectory_of`): the memory floor of a loop that
    returns its trajectory."""

    def __init__(
        self,
        *,
        steps: int,
        latency_s: float,
        tool_s: float,
        validate: bool = True,
        trajectory: bool = False,
    ) -> None:
        self.steps = steps
        self.latency_s = latency_s
        self.tool_s = tool_s
        self.trajectory = trajectory
        self.counts = Counts()
        self.validators = (
            {
                "search": Draft202012Validator(SEARCH_SCHEMA),
                "submit": Draft202012Validator(SUBMIT_SCHEMA),
            }
            if validate
            else {}
        )

    async def run(self, run_id: str) -> None:
        if self.trajectory:
            await self.trajectory_of(run_id)
            return
        transcript = [SYSTEM_PROMPT, GOAL]
        for index in range(self.steps):
            await anyio.sleep(self.latency_s)
            content, tool, arguments = self._decided(index)
            result = await self._acted(tool, arguments)
            transcript += (content, f"Observation: {result}")
        if tool != "submit":
            raise AssertionError(f"run {run_id!r} ended without submitting")

    async def trajectory_of(self, run_id: str) -> list[HandStep]:
        """Run ``run_id`` as :meth:`run` does, keeping and returning its trajectory."""
        transcript = [SYSTEM_PROMPT, GOAL]
        trajectory: list[HandStep] = []
        for index in range(self.steps):
            asked = time.monotonic()
            await anyio.sleep(self.latency_s)
            content, tool, arguments = self._decided(index)
            started = time.monotonic()
            result = await self._acted(tool, arguments)
            ended = time.monotonic()
            transcript += (content, f"Observation: {result}")
            trajectory.append(
                HandStep(
                    step=index,
                    model_output=content,
                    action_text=action_text(tool, arguments),
                    observation=result,
                    done=tool == "submit",
                    model_duration_s=started - asked,
                    action_duration_s=ended - started,
                )
            )
        if not trajectory[-1].done:
            raise AssertionError(f"run {run_id!r} ended without submitting")
        return trajectory

    def _decided(self, index: int) -> tuple[str, str, dict[str, Any]]:
        """The model's reply at step ``index`` as a client and a JSON interpreter see it:
        encoded, decoded, its arguments checked."""
        self.counts.decisions += 1
        content = json.dumps(decision(index, self.steps))
        reply = json.loads(content)
        tool, arguments = reply["tool"], reply["arguments"]
        validator = self.validators.get(tool)
        if validator is not None:
            validator.validate(arguments)
        return content, tool, arguments

    async def _acted(self, tool: str, arguments: dict[str, Any]) -> str:
        """The tool's work and its observation."""
        await anyio.sleep(self.tool_s)
        self.counts.executions += 1
        return observation(arguments) if tool == "search" else SUBMITTED
