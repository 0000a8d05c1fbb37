"""An experiment: several candidate runs of one task, concurrently, under Trio.

What it shows
    * N runs of the *same* task that differ only in their :class:`~polyloop.Injection`
      (one "skill" text per candidate, or none), started in one task group (a Trio
      nursery) and driven at the same time;
    * one model client object shared by every run: the definition is built once and
      reused, only the request changes;
    * the kernel stops at the run: scoring the candidates and choosing the best one is
      the caller's job, done here from the returned :class:`~polyloop.RunResult` values
      and from what each candidate's ``submit`` tool received;
    * a :class:`~polyloop.stores.JsonlStore` keeping one log file per candidate.

The model is an example class, deterministic and offline: it reads the skill from the
injected system message and follows the plan that skill leads to. One skill makes it
batch its tool calls, one makes it verify its sum, one makes it guess without tools.

How to run it::

    python examples/trio_experiment.py                 # logs in a temporary directory
    python examples/trio_experiment.py --dir runs/     # keep the JSON-lines logs
    python examples/trio_experiment.py --backend asyncio

Needs Trio (``pip install "polyloop[trio]"``) for the default backend.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio

from polyloop import (
    Budget,
    Definition,
    Injection,
    JSONValue,
    Message,
    ModelCall,
    ModelReply,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunResult,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    run,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import JsonlStore

NUMBERS = [3, 4, 12]
EXPECTED = sum(n * n for n in NUMBERS)  # 169
GOAL = f"What is the sum of the squares of {NUMBERS}? Submit the number."

# The candidates: a name and the skill entries injected into the system channel.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "batch": ("Skill: batch\nThe square tool takes a list: square every number in one call.",),
    "double-check": (
        "Skill: double-check\nBatch your calls, and repeat the addition "
        "once to verify it before you submit.",
    ),
    "guess": ("Skill: guess\nYou are good at mental arithmetic: submit right away.",),
}


def _call(tool: str, **arguments: object) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


SQUARES = [n * n for n in NUMBERS]
# What the model answers at each call, depending on the skill it was given.
PLANS: dict[str, list[str]] = {
    "baseline": [
        *(_call("square", numbers=[n]) for n in NUMBERS),
        _call("add", numbers=SQUARES),
        _call("submit", answer=EXPECTED),
    ],
    "batch": [
        _call("square", numbers=NUMBERS),
        _call("add", numbers=SQUARES),
        _call("submit", answer=EXPECTED),
    ],
    "double-check": [
        _call("square", numbers=NUMBERS),
        _call("add", numbers=SQUARES),
        _call("add", numbers=SQUARES),
        _call("submit", answer=EXPECTED),
    ],
    "guess": [_call("submit", answer=361)],
}


class SkillFollowingModel:
    """A deterministic stand-in for a model whose behaviour depends on the injected skill.

    It also counts the calls it serves and how many were in flight at once, which shows
    that the candidates really ran concurrently through this one object.
    """

    def __init__(self, *, latency_s: float) -> None:
        self.latency_s = latency_s
        self.calls = 0
        self.in_flight = 0
        self.peak_in_flight = 0

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "example-skill-following", "version": 1}

    async def call(self, call: ModelCall) -> ModelReply:
        self.calls += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            await anyio.sleep(self.latency_s)  # where a real model would think
        finally:
            self.in_flight -= 1
        plan = PLANS[_skill(call.messages)]
        return ModelReply(
            call_id=f"{call.run_id}/{call.call_index}",
            content=plan[call.call_index],
            reasoning=None,
        )


def _skill(messages: tuple[Message, ...]) -> str:
    for message in messages:
        if message.role is Role.SYSTEM:
            for block in message.content:
                if block.text.startswith("Skill: "):
                    return block.text.split("\n", 1)[0].removeprefix("Skill: ")
    return "baseline"


@dataclass
class Candidate:
    """One candidate run and what its ``submit`` tool received."""

    name: str
    submissions: list[int] = field(default_factory=list)
    result: RunResult | None = None


def make_tools(candidate: Candidate) -> ToolRegistry:
    """The same tools for every candidate; ``submit`` records into this candidate."""

    async def square(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        numbers = arguments["numbers"]
        assert isinstance(numbers, list)
        return json.dumps([n * n for n in numbers if isinstance(n, int)])

    async def add(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        numbers = arguments["numbers"]
        assert isinstance(numbers, list)
        return str(sum(n for n in numbers if isinstance(n, int)))

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        answer = arguments["answer"]
        assert isinstance(answer, int)
        candidate.submissions.append(answer)
        return "received"

    integers: JSONValue = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
    numbers_schema: dict[str, JSONValue] = {
        "type": "object",
        "properties": {"numbers": integers},
        "required": ["numbers"],
        "additionalProperties": False,
    }
    return ToolRegistry(
        [
            ToolSpec(
                name="square",
                description="Square each integer of a list.",
                parameters=numbers_schema,
                handler=square,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="add",
                description="Add a list of integers.",
                parameters=numbers_schema,
                handler=add,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="submit",
                description="Submit the answer. Ends the task.",
                parameters={
                    "type": "object",
                    "properties": {"answer": {"type": "integer"}},
                    "required": ["answer"],
                    "additionalProperties": False,
                },
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


def make_request(run_id: str, candidate: Candidate) -> Request:
    tools = make_tools(candidate)
    skills = CANDIDATES[candidate.name]
    return Request(
        run_id=run_id,
        budget=Budget(max_steps=10, max_valid_steps=8, max_context_chars=20_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "Solve the task with the tools."),),
        goal_context=(Message.text(Role.USER, GOAL),),
        injection=Injection(entries={"system": skills} if skills else {}),
        binding={"candidate": candidate.name},
        model_replay=Replay.ALLOWED,
        observation_template="Tool result: {observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )


def score(candidate: Candidate) -> tuple[bool, int]:
    """The caller's own ranking: a correct submission first, then fewer steps."""
    assert candidate.result is not None
    correct = candidate.submissions == [EXPECTED]
    return correct, -candidate.result.step_count


async def experiment(directory: str, backend: str) -> None:
    model = SkillFollowingModel(latency_s=0.05)
    experiment_id = f"squares-{uuid.uuid4().hex[:8]}"
    candidates = [Candidate(name) for name in CANDIDATES]
    async with JsonlStore(directory) as store:
        definition = Definition(  # built once, shared by every candidate run
            model=model,
            interpreter=JsonToolCallInterpreter(),
            store=store,
            events=NullSink(),
            texts=ObservationTexts(
                not_executed="Refused: {reason}", env_fault="Environment failure: {detail}"
            ),
        )

        async def drive(candidate: Candidate) -> None:
            request = make_request(f"{experiment_id}/{candidate.name}", candidate)
            candidate.result = await run(definition, request)

        async with anyio.create_task_group() as nursery:
            for candidate in candidates:
                nursery.start_soon(drive, candidate)

    print(
        f"{len(candidates)} candidate runs under {backend}, one shared model client: "
        f"{model.calls} calls, "
        f"up to {model.peak_in_flight} in flight at once"
    )
    print(f"  {'candidate':<14}{'stop reason':<13}{'steps':>5}  {'submitted':<11}correct")
    for candidate in candidates:
        assert candidate.result is not None
        correct, _ = score(candidate)
        submitted = ", ".join(map(str, candidate.submissions)) or "-"
        print(
            f"  {candidate.name:<14}{candidate.result.stop_reason.value:<13}"
            f"{candidate.result.step_count:>5}  {submitted:<11}{'yes' if correct else 'no'}"
        )
    best = max(candidates, key=score)
    assert best.result is not None
    print(f"best: {best.name} (correct in {best.result.step_count} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="keep the run logs here (default: a temporary directory)")
    parser.add_argument("--backend", choices=["trio", "asyncio"], default="trio")
    args = parser.parse_args()
    if args.dir:
        anyio.run(experiment, args.dir, args.backend, backend=args.backend)
        return
    with tempfile.TemporaryDirectory() as directory:
        anyio.run(experiment, directory, args.backend, backend=args.backend)


if __name__ == "__main__":
    main()
