"""An asyncio application that uses PolyLoop unchanged, on the PostgreSQL store.

What it shows
    * PolyLoop inside an ordinary asyncio program: ``asyncio.run``, an ``asyncio.Queue``
      of jobs and worker tasks in an ``asyncio.TaskGroup``. Nothing in the program is
      AnyIO-specific; ``run`` and ``resume`` are plain coroutines awaited from asyncio;
    * a :class:`~polyloop.stores.PostgresStore` shared by every run of the process (one
      store object, one connection pool), with a fresh run id per job, so the program
      can run again and again against the same database;
    * a worker that dies in the middle of a run, and a different store object taking
      the run over: ``run_status`` tells that nobody drives the run any more (it is
      ``resumable``, not ``running``), and ``resume`` continues from the last durable
      record without repeating the finished step.

The model is the scripted double from :mod:`polyloop.testing` (deterministic, offline);
it looks up the country named in the run's binding, then submits what the tool said.

How to run it::

    python examples/asyncio_postgres_app.py --conninfo postgresql://user@host:5432/db

Without ``--conninfo`` the connection string comes from the environment variable
``POLYLOOP_TEST_POSTGRES``, else ``postgresql://postgres@127.0.0.1:5432/test``. The
tables are created in the schema ``polyloop`` on first use. Needs the ``postgres`` extra
(``pip install "polyloop[postgres]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections import Counter

from polyloop import (
    Budget,
    Definition,
    Injection,
    JSONValue,
    Message,
    ModelCall,
    NullSink,
    ObservationTexts,
    PolyLoopError,
    Replay,
    Request,
    Role,
    RunResult,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    resume,
    run,
    run_status,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.ports import Store
from polyloop.stores import PostgresStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

DEFAULT_CONNINFO = "postgresql://postgres@127.0.0.1:5432/test"
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima"}
JOBS = ("France", "Japan", "Kenya")
CRASHING_JOB = "Peru"
CRASH_AFTER_WRITES = 5  # the run's start and its whole first step are on record

OBSERVATION_PREFIX = "Observation: "
# Side effects of the tools, by run id, so the output can show what ran how often.
LOOKUPS: Counter[str] = Counter()
SUBMITTED: dict[str, str] = {}


def script(call: ModelCall) -> str:
    """The scripted model: look the country up, then submit the tool's answer."""
    if call.call_index == 0:
        return json.dumps(
            {"tool": "lookup_capital", "arguments": {"country": call.binding["country"]}}
        )
    last = call.messages[-1].content[0].text.removeprefix(OBSERVATION_PREFIX)
    return json.dumps({"tool": "submit", "arguments": {"capital": last}})


def _run_of(result_id: str) -> str:
    # Result ids are "<run id>:<step>:action"; the run id itself may contain ':'.
    return result_id.rsplit(":", 2)[0]


async def lookup_capital(arguments: dict[str, JSONValue], *, result_id: str) -> str:
    LOOKUPS[_run_of(result_id)] += 1
    await asyncio.sleep(0.01)  # a plain asyncio call inside a tool is fine
    return CAPITALS.get(str(arguments["country"]), "unknown")


async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
    SUBMITTED[_run_of(result_id)] = str(arguments["capital"])
    return "thank you"


def _object(**properties: JSONValue) -> dict[str, JSONValue]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


TOOLS = ToolRegistry(
    [
        ToolSpec(
            name="lookup_capital",
            description="The capital of a country.",
            parameters=_object(country={"type": "string"}),
            handler=lookup_capital,
            replay=Replay.ALLOWED,
        ),
        ToolSpec(
            name="submit",
            description="Submit the capital. Ends the task.",
            parameters=_object(capital={"type": "string"}),
            handler=submit,
            completes=True,
        ),
    ],
    max_observation_chars=500,
)


def make_definition(store: Store) -> Definition:
    return Definition(
        model=ScriptedModelClient(script, name="capitals"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(
            not_executed="Refused: {reason}", env_fault="Environment failure: {detail}"
        ),
    )


def make_request(run_id: str, country: str) -> Request:
    return Request(
        run_id=run_id,
        budget=Budget(max_steps=5, max_valid_steps=4, max_context_chars=10_000),
        executor=TOOLS.executor(),
        tools=TOOLS,
        run_context=(Message.text(Role.SYSTEM, "Use the tools; submit the capital."),),
        goal_context=(Message.text(Role.USER, f"What is the capital of {country}?"),),
        injection=Injection(entries={}),
        binding={"country": country},
        model_replay=Replay.ALLOWED,
        observation_template=OBSERVATION_PREFIX + "{observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )


def describe(result: RunResult) -> str:
    return (
        f"{result.stop_reason.value} {SUBMITTED.get(result.run_id)!r} in "
        f"{result.step_count} steps, lookups {LOOKUPS[result.run_id]}, "
        f"resumed {result.resumed}"
    )


async def serve_jobs(definition: Definition, batch: str) -> dict[str, RunResult]:
    """Two asyncio workers take jobs from a queue; every job is one PolyLoop run."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for country in JOBS:
        queue.put_nowait(country)
    results: dict[str, RunResult] = {}

    async def worker() -> None:
        while not queue.empty():
            country = queue.get_nowait()
            results[country] = await run(definition, make_request(f"{batch}/{country}", country))

    async with asyncio.TaskGroup() as group:
        for _ in range(2):
            group.create_task(worker())
    return results


async def crash_and_take_over(conninfo: str, store: PostgresStore, batch: str) -> None:
    run_id = f"{batch}/{CRASHING_JOB}"
    request = make_request(run_id, CRASHING_JOB)
    # The dying worker has its own store object, hence its own database connections.
    dying = PostgresStore(conninfo)
    try:
        await run(
            make_definition(FaultyStore(dying, fail_after_writes=CRASH_AFTER_WRITES)), request
        )
    except SimulatedCrash:
        print(f"  {CRASHING_JOB}: the worker died after store write {CRASH_AFTER_WRITES}")
    await dying.aclose()
    status = await run_status(store, run_id)
    print(
        f"  {CRASHING_JOB}: {status.state.value}, {status.steps} step on record, nobody drives it"
    )
    print(
        f"  {CRASHING_JOB}: taken over by another store object: "
        f"{describe(await resume(make_definition(store), request))}"
    )


async def main_async(conninfo: str) -> None:
    batch = f"capitals-{uuid.uuid4().hex[:8]}"  # a new id every time: runs never collide
    print(f"batch {batch}: asyncio workers, PostgreSQL store")
    async with PostgresStore(conninfo) as store:
        definition = make_definition(store)
        results = await serve_jobs(definition, batch)
        for country in JOBS:
            print(f"  {country}: {describe(results[country])}")
        await crash_and_take_over(conninfo, store, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conninfo",
        default=os.environ.get("POLYLOOP_TEST_POSTGRES") or DEFAULT_CONNINFO,
        help="libpq connection string or URL of the database",
    )
    args = parser.parse_args()
    try:
        asyncio.run(main_async(args.conninfo))
    except PolyLoopError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
