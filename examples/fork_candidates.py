"""Candidates from one recorded run: fork it at step k onto other models and injections.

What it shows
    * a source run recorded once: three paid weather lookups and a submission, each tool
      execution written to a ledger outside the run store (a SQLite table keyed by the
      call's ``result_id``, so an execution under a key already used would fail);
    * :func:`polyloop.fork` of that run at step ``k`` into three candidates, each under a
      run id of its own, driven at the same time in one AnyIO task group:
        - ``same``: the source's model and request (only the run id differs);
        - ``hasty``: another model, which answers at once from what it has seen;
        - ``recheck``: the source's model with another :class:`~polyloop.Injection`, a
          note that makes it look the last city up again before it answers;
    * their outcomes side by side: stop reason, answer, steps (inherited ones included),
      and the steps and tokens each candidate paid for itself;
    * from the ledger: steps ``0`` to ``k - 1`` ran once, in the source; every candidate
      executed only its own steps, from ``k`` on, under its own run id.

The models are the scripted double from :mod:`polyloop.testing`, answering each call
from the messages it is sent (and reporting a rough token count), so everything is
deterministic and offline. A candidate's first model call is call ``k``: no model is
asked again for calls ``0`` to ``k - 1``.

How to run it::

    python examples/fork_candidates.py                       # asyncio, in a temp dir
    python examples/fork_candidates.py --backend trio --at-step 1
    python examples/fork_candidates.py --dir runs/           # keep runs.db and ledger.db

``--dir`` holds the run store (``runs.db``) and the ledger (``ledger.db``); use a fresh
directory for each start (the run ids are fixed, and a run id cannot start twice).
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import tempfile
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

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
    RunStarted,
    StepRecord,
    StopReason,
    TextBlock,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    Usage,
    fork,
    run,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import SqliteStore
from polyloop.testing import ScriptedModelClient

SOURCE = "weather"
CITIES = ("Paris", "Tokyo", "Lima")
READINGS = {"Paris": 14, "Tokyo": 22, "Lima": 24}
GOAL = f"Which of {', '.join(CITIES)} is warmest right now? Look each one up, then submit it."
RECHECK = "Note: readings go stale. Look the last city up again before you submit."


# -- the ledger: every tool execution, outside the run store ----------------------------------


class Ledger:
    """Every tool execution, one row per ``result_id`` (the primary key), in its own file.

    A second execution under a key already used fails on the key, so the table itself
    says that no step ran twice. Every method blocks; the tools call it off the event
    loop, through ``anyio.to_thread``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with closing(sqlite3.connect(path)) as db, db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS executions ("
                " result_id TEXT PRIMARY KEY, run_id TEXT NOT NULL,"
                " step INTEGER NOT NULL, tool TEXT NOT NULL, arguments TEXT NOT NULL)"
            )

    def record(self, result_id: str, tool: str, arguments: dict[str, JSONValue]) -> None:
        run_id, step, _ = result_id.rsplit(":", 2)
        with closing(sqlite3.connect(self.path, timeout=10)) as db, db:
            db.execute(
                "INSERT INTO executions VALUES (?, ?, ?, ?, ?)",
                (result_id, run_id, int(step), tool, json.dumps(arguments, sort_keys=True)),
            )

    def steps_by_run(self) -> dict[str, list[int]]:
        with closing(sqlite3.connect(self.path)) as db:
            rows = db.execute("SELECT run_id, step FROM executions ORDER BY run_id, step")
            by_run: dict[str, list[int]] = {}
            for run_id, step in rows:
                by_run.setdefault(run_id, []).append(step)
            return by_run


def make_tools(ledger: Ledger) -> ToolRegistry:
    """A paid lookup and a submission; both write their execution to the ledger."""

    async def weather(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        await anyio.to_thread.run_sync(ledger.record, result_id, "weather", arguments)
        city = str(arguments["city"])
        return f"{city}: {READINGS[city]} C"

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        await anyio.to_thread.run_sync(ledger.record, result_id, "submit", arguments)
        return f"submitted {arguments['answer']}"

    def one_string(name: str) -> dict[str, JSONValue]:
        return {
            "type": "object",
            "properties": {name: {"type": "string"}},
            "required": [name],
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            # Replay never: each lookup is paid for, and must not be paid twice.
            ToolSpec(
                name="weather",
                description="The temperature in a city now (a paid lookup).",
                parameters=one_string("city"),
                handler=weather,
            ),
            ToolSpec(
                name="submit",
                description="Submit the warmest city. Ends the task.",
                parameters=one_string("answer"),
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


# -- the models: scripted, with a token count on each reply -----------------------------------


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


LOOKUPS = [_call("weather", city=city) for city in CITIES]
# What the source's model answers, call by call; with the note, it looks Lima up again.
PLAN = [*LOOKUPS, _call("submit", answer="Lima")]
PLAN_WITH_NOTE = [*LOOKUPS, _call("weather", city="Lima"), _call("submit", answer="Lima")]
READING = re.compile(r"Reading: (\w+): (\d+) C")


def _text(messages: tuple[Message, ...]) -> str:
    return "\n".join(
        block.text
        for message in messages
        for block in message.content
        if isinstance(block, TextBlock)
    )


def _reply(call: ModelCall, content: str) -> ModelReply:
    # A rough token count, so that candidates can be compared on what they cost.
    usage = Usage(input_tokens=len(_text(call.messages)) // 4, output_tokens=len(content) // 4)
    return ModelReply(
        call_id=f"{call.run_id}/{call.call_index}", content=content, reasoning=None, usage=usage
    )


def follows_notes(call: ModelCall) -> ModelReply:
    """The source's model: its plan, or the longer one when a note asks for a recheck."""
    plan = PLAN_WITH_NOTE if RECHECK in _text(call.messages) else PLAN
    return _reply(call, plan[call.call_index])


def hasty(call: ModelCall) -> ModelReply:
    """Another model: it submits the warmest city it has seen, as soon as it is asked."""
    seen = {city: int(degrees) for city, degrees in READING.findall(_text(call.messages))}
    if not seen:
        return _reply(call, LOOKUPS[0])
    return _reply(call, _call("submit", answer=max(seen, key=seen.__getitem__)))


# -- the runs ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One branch of the experiment: its model and the injection its request carries."""

    name: str
    model: Callable[[ModelCall], ModelReply]
    model_name: str
    notes: tuple[str, ...] = ()


CANDIDATES = (
    Candidate(name="same", model=follows_notes, model_name="notes-model"),
    Candidate(name="hasty", model=hasty, model_name="hasty-model"),
    Candidate(name="recheck", model=follows_notes, model_name="notes-model", notes=(RECHECK,)),
)


def make_definition(store: SqliteStore, candidate: Candidate) -> Definition:
    return Definition(
        model=ScriptedModelClient(candidate.model, name=candidate.model_name),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Refused: {reason}", env_fault="Failure: {detail}"),
    )


def make_request(run_id: str, tools: ToolRegistry, notes: tuple[str, ...]) -> Request:
    return Request(
        run_id=run_id,
        budget=Budget(max_steps=10, max_valid_steps=8, max_context_chars=20_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "You answer with the tools."),),
        goal_context=(Message.text(Role.USER, GOAL),),
        injection=Injection(entries={"system": notes} if notes else {}),
        binding={},
        model_replay=Replay.NEVER,
        observation_template="Reading: {observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )


def answer(result: RunResult) -> str:
    """What the run submitted, as its ``submit`` tool answered it; ``-`` if it did not."""
    if result.stop_reason is not StopReason.SUBMITTED:
        return "-"
    return (result.steps[-1].observation or "").removeprefix("submitted ")


def tokens(steps: tuple[StepRecord, ...]) -> int:
    usage = Usage.of_steps(steps)
    assert usage is not None and usage.input_tokens is not None
    return usage.input_tokens + (usage.output_tokens or 0)


async def experiment(directory: Path, backend: str, at_step: int) -> None:
    ledger = Ledger(directory / "ledger.db")
    tools = make_tools(ledger)
    results: dict[str, RunResult] = {}
    async with SqliteStore(directory / "runs.db") as store:
        source = await run(make_definition(store, CANDIDATES[0]), make_request(SOURCE, tools, ()))

        async def branch(candidate: Candidate) -> None:
            results[candidate.name] = await fork(
                make_definition(store, candidate),
                make_request(f"{SOURCE}/{candidate.name}", tools, candidate.notes),
                source_run_id=SOURCE,
                at_step=at_step,
            )

        async with anyio.create_task_group() as group:
            for candidate in CANDIDATES:
                group.start_soon(branch, candidate)
        records = {await fork_record(store, f"{SOURCE}/{c.name}") for c in CANDIDATES}

    print(
        f"source {SOURCE!r}: {source.stop_reason.value} {answer(source)} "
        f"after {source.step_count} steps, {tokens(source.steps)} tokens"
    )
    print(f"forked at step {at_step} into {len(CANDIDATES)} candidates, one task group, {backend}")
    print("  candidate stop reason  answer  steps  own steps  own tokens")
    for candidate in CANDIDATES:
        result = results[candidate.name]
        own = result.steps[at_step:]
        print(
            f"  {candidate.name:<10}{result.stop_reason.value:<13}{answer(result):<8}"
            f"{result.step_count:>5}{len(own):>11}{tokens(own):>12}"
        )
    for forked_from, forked_at, copies in sorted(records):
        print(
            f"each candidate's start record: forked from {forked_from!r} at step {forked_at}, "
            f"with copies of {copies} steps"
        )
    report_ledger(ledger.steps_by_run(), source, at_step)


async def fork_record(store: SqliteStore, run_id: str) -> tuple[str, int, int]:
    """What a fork's own start record says: its source, its step, how many copies it holds."""
    started = (await store.read_log(run_id)).records[0]
    assert isinstance(started, RunStarted)
    assert started.forked_from is not None and started.forked_at_step is not None
    return started.forked_from, started.forked_at_step, len(started.inherited_steps)


def report_ledger(by_run: dict[str, list[int]], source: RunResult, at_step: int) -> None:
    """What the ledger says ran, run by run, and that the inherited steps ran once."""
    print("ledger, steps executed by run:")
    for run_id, steps in by_run.items():
        print(f"  {run_id:<16}{' '.join(map(str, steps))}")
    once = by_run[SOURCE] == list(range(source.step_count))
    own_only = all(
        steps and min(steps) >= at_step for run_id, steps in by_run.items() if run_id != SOURCE
    )
    inherited = "step 0" if at_step == 1 else f"steps 0 to {at_step - 1}"
    if not (once and own_only):
        raise SystemExit(f"the ledger shows {inherited} executed again")
    print(f"{inherited}: ran once, in the source; each candidate ran its own steps only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="keep runs.db and ledger.db here")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--at-step", type=int, default=2, help="fork here (1 to 3; default 2)")
    args = parser.parse_args()
    if not 1 <= args.at_step <= len(CITIES):
        parser.error(f"--at-step must be 1 to {len(CITIES)}: a candidate must have a step to take")
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        anyio.run(experiment, args.dir, args.backend, args.at_step, backend=args.backend)
        return
    with tempfile.TemporaryDirectory() as directory:
        anyio.run(experiment, Path(directory), args.backend, args.at_step, backend=args.backend)


if __name__ == "__main__":
    main()
