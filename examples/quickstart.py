"""A multi-step, tool-using agent run end to end, then crashed and resumed.

The model here is scripted (deterministic, no network), but everything around it is the
real kernel: JSON-Schema tools, the intent log, the stop order and recovery. The agent
reads two small files, adds their totals with a calculator tool, and submits the sum with
a completion-marked tool. The same run is then crashed after its ninth store write and
resumed: the finished steps are read back, not redone.

Run it with ``python examples/quickstart.py`` (add ``--backend trio`` to use Trio).
"""

from __future__ import annotations

import argparse
import json
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
    RunResult,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    resume,
    run,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

FILES = {
    "north.csv": "region,units\nnorth,120\nnorth,80\n",
    "south.csv": "region,units\nsouth,45\nsouth,55\nsouth,100\n",
}


# Every tool execution, by the result id the kernel allocated for it.
EXECUTIONS: list[str] = []


async def read_file(arguments: dict[str, Any], *, result_id: str) -> str:
    EXECUTIONS.append(result_id)
    name = arguments["name"]
    if name not in FILES:
        raise FileNotFoundError(f"no file named {name!r}; files: {sorted(FILES)}")
    return FILES[name]


async def add(arguments: dict[str, Any], *, result_id: str) -> str:
    EXECUTIONS.append(result_id)
    return str(sum(arguments["numbers"]))


async def submit(arguments: dict[str, Any], *, result_id: str) -> str:
    EXECUTIONS.append(result_id)
    return f"submitted {arguments['total']}"


TOOLS = ToolRegistry(
    [
        ToolSpec(
            name="read_file",
            description="Read one of the data files by name.",
            parameters={
                "type": "object",
                "properties": {"name": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            handler=read_file,
            replay=Replay.ALLOWED,  # reading twice is harmless
        ),
        ToolSpec(
            name="add",
            description="Add a list of numbers.",
            parameters={
                "type": "object",
                "properties": {"numbers": {"type": "array", "items": {"type": "number"}}},
                "required": ["numbers"],
                "additionalProperties": False,
            },
            handler=add,
            replay=Replay.ALLOWED,
        ),
        ToolSpec(
            name="submit",
            description="Submit the final total. Ends the task.",
            parameters={
                "type": "object",
                "properties": {"total": {"type": "integer"}},
                "required": ["total"],
                "additionalProperties": False,
            },
            handler=submit,
            completes=True,  # a successful submit ends the run as SUBMITTED
        ),
    ],
    max_observation_chars=2_000,
)


def _call(tool: str, **arguments: Any) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


# What a model would answer at each call of the run.
SCRIPT = [
    _call("read_file", name="north.csv"),
    _call("read_file", name="south.csv"),
    _call("add", numbers="120 80 45 55 100"),  # wrong type: the schema refuses it
    _call("add", numbers=[120, 80, 45, 55, 100]),
    _call("submit", total=400),
]


def build(store: Any, run_id: str) -> tuple[Definition, Request]:
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, name="quickstart-script"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(
            not_executed="Refused: {reason}", env_fault="Environment failure: {detail}"
        ),
    )
    request = Request(
        run_id=run_id,
        budget=Budget(max_steps=10, max_valid_steps=8, max_context_chars=20_000),
        executor=TOOLS.executor(),
        tools=TOOLS,
        run_context=(Message.text(Role.SYSTEM, "You are a data assistant. Use the tools."),),
        goal_context=(Message.text(Role.USER, "What is the total of units across all files?"),),
        injection=Injection(entries={}),
        binding={"example": "quickstart"},
        model_replay=Replay.ALLOWED,
        observation_template="Tool output:\n{observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )
    return definition, request


def show(result: RunResult) -> None:
    for step in result.steps:
        status = step.action_status.value if step.action_status else step.decision.value
        observation = (step.observation or "").replace("\n", " | ")
        print(f"  step {step.step}: {step.action_text or step.decision.value}")
        print(f"          -> [{status}] {observation[:90]}")
    print(
        f"  stop reason: {result.stop_reason.value}; steps {result.step_count}, "
        f"valid steps {result.valid_step_count}; resumed: {result.resumed}"
    )


async def main() -> None:
    store = MemoryStore()
    print("1. An uninterrupted run:")
    show(await run(*build(store, "quickstart-1")))

    print("\n2. The same run, crashed after its 9th store write, then resumed:")
    crashing = FaultyStore(store, fail_after_writes=9)
    try:
        await run(*build(crashing, "quickstart-2"))
    except SimulatedCrash as crash:
        done = sum(
            1
            for r in (await store.read_log("quickstart-2")).records
            if type(r).__name__ == "StepRecord"
        )
        print(f"  crashed ({crash}); {done} steps were on record")
    before = len(EXECUTIONS)
    show(await resume(*build(store, "quickstart-2")))
    print(f"  tool executions after the resume: {EXECUTIONS[before:]}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    anyio.run(main, backend=parser.parse_args().backend)
