"""A plain script: one run on the SQLite store, driven by ``anyio.run(run, ...)``.

What it shows
    * the smallest durable set-up: a :class:`~polyloop.stores.SqliteStore` file, a tool
      registry whose ``submit`` tool completes the task, a scripted model and the JSON
      tool-call interpreter from :mod:`polyloop.interpreters`;
    * driving a run from synchronous code with ``anyio.run(run, definition, request)``,
      no ``async def main`` needed;
    * "start or continue": when the store already holds the run,
      :class:`~polyloop.RunAlreadyExists` tells the script to call ``resume`` instead, so
      running the script again after a crash finishes the run, and running it after the
      run finished hands back the recorded result without executing anything;
    * a side effect that happens once: ``submit`` appends a line to a text file next to
      the database, and that file holds one line however often the script runs.

How to run it::

    python examples/sqlite_script.py                          # a new run
    python examples/sqlite_script.py                          # the recorded result
    python examples/sqlite_script.py --run-id r2 --crash-after-writes 6   # dies mid-run
    python examples/sqlite_script.py --run-id r2              # resumes and finishes it

``--db`` picks the database file (default ``polyloop-example.db`` in the system's
temporary directory, so that running the example leaves nothing in the checkout).
``--crash-after-writes N`` ends the process with status 3 right after the N-th store
write, as if it had been killed there.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import anyio

from polyloop import (
    Budget,
    Definition,
    Injection,
    JSONValue,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunAlreadyExists,
    RunResult,
    StepRecord,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    resume,
    run,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.ports import Store
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

CRASH_STATUS = 3


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


# The replies a model would give, call by call: three multiplications, then the answer.
SCRIPT = [
    _call("multiply", a=7, b=24),
    _call("multiply", a=168, b=60),
    _call("multiply", a=10080, b=3),
    _call("submit", answer=30240),
]


def make_tools(submissions: Path) -> ToolRegistry:
    """A calculator and a ``submit`` tool whose call ends the run as ``SUBMITTED``."""

    async def multiply(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        a, b = arguments["a"], arguments["b"]
        assert isinstance(a, int) and isinstance(b, int)  # the schema guarantees it
        return str(a * b)

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        # A real side effect. Its replay policy is NEVER (the default): if the process
        # died after announcing it, resume would stop IN_DOUBT rather than submit twice.
        with submissions.open("a", encoding="utf-8") as out:
            out.write(f"{result_id} {arguments['answer']}\n")
        return f"accepted {arguments['answer']}"

    integer: JSONValue = {"type": "integer"}
    return ToolRegistry(
        [
            ToolSpec(
                name="multiply",
                description="Multiply two integers.",
                parameters={
                    "type": "object",
                    "properties": {"a": integer, "b": integer},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
                handler=multiply,
                replay=Replay.ALLOWED,  # no side effect: safe to run again
            ),
            ToolSpec(
                name="submit",
                description="Submit the final answer. Ends the task.",
                parameters={
                    "type": "object",
                    "properties": {"answer": integer},
                    "required": ["answer"],
                    "additionalProperties": False,
                },
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


def build(store: Store, run_id: str, submissions: Path) -> tuple[Definition, Request]:
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, name="sqlite-script"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(
            not_executed="Refused: {reason}", env_fault="Environment failure: {detail}"
        ),
    )
    tools = make_tools(submissions)
    request = Request(
        run_id=run_id,
        budget=Budget(max_steps=8, max_valid_steps=6, max_context_chars=20_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "You are a careful calculator. Use the tools."),),
        goal_context=(Message.text(Role.USER, "How many minutes are there in three weeks?"),),
        injection=Injection(entries={}),
        binding={},
        model_replay=Replay.ALLOWED,
        observation_template="Result: {observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )
    return definition, request


def show(result: RunResult, submissions: Path) -> None:
    for step in result.steps:
        print(f"  step {step.step}: {step.action_text} -> {step.observation}")
    how = "continued from the log" if result.resumed else "new run"
    print(f"stop reason: {result.stop_reason.value} after {result.step_count} steps ({how})")
    lines = submissions.read_text(encoding="utf-8").splitlines() if submissions.exists() else []
    mine = [line for line in lines if line.startswith(f"{result.run_id}:")]
    print(f"submissions of this run on file: {len(mine)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_db = str(Path(tempfile.gettempdir()) / "polyloop-example.db")
    parser.add_argument("--db", default=default_db, help="the SQLite database file")
    parser.add_argument("--run-id", default="minutes-in-three-weeks")
    parser.add_argument("--crash-after-writes", type=int, default=0, metavar="N")
    args = parser.parse_args()
    submissions = Path(f"{args.db}.submissions.txt")

    store = SqliteStore(args.db)
    writer: Store = store
    if args.crash_after_writes:
        writer = FaultyStore(store, fail_after_writes=args.crash_after_writes)
    definition, request = build(writer, args.run_id, submissions)
    print(f"run {args.run_id!r} in {args.db}")
    try:
        try:
            result = anyio.run(run, definition, request)
        except RunAlreadyExists:
            # The store has this run: continue it (or get its recorded result).
            log = anyio.run(store.read_log, args.run_id)
            done = sum(isinstance(record, StepRecord) for record in log.records)
            print(f"the store already holds this run (steps on record: {done}); resuming")
            result = anyio.run(resume, definition, request)
    except SimulatedCrash:
        print(f"the process dies after store write {args.crash_after_writes}", flush=True)
        os._exit(CRASH_STATUS)  # no clean-up at all, like a kill
    finally:
        anyio.run(store.aclose)
    show(result, submissions)


if __name__ == "__main__":
    main()
