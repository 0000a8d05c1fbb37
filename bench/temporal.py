"""Benchmark 9: the same runs driven by Temporal workers and by PolyLoop's own workers.

Both ways run in one invocation, one after the other, on one PostgreSQL schema; only
their ratios carry over to another machine. What is measured: ``bench/README.md``,
benchmark 9.
"""

from __future__ import annotations

import argparse
import json
import signal
import sysconfig
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio

from bench._children import ChildFailed, Children, child_command, meet
from bench._common import each, postgres_conninfo, postgres_schema
from bench._sampling import children_named, cpu_seconds

AGENT = "bench"
OUTPUT = None


@dataclass(frozen=True)
class Workers:
    """How the runs are driven: by ``count`` worker processes on one schema, each of them
    told its ``slot`` (the spec a parent sends its child)."""

    kind: str  # "polyloop" or "temporal"
    runs: int
    count: int
    steps: int
    latency_ms: float
    conninfo: str
    schema: str
    meeting: str = ""
    slot: int = 0
    address: str = ""  # the Temporal server's, and the task queue the workers serve
    queue: str = ""

    @property
    def ideal_s(self) -> float:
        return self.steps * self.latency_ms / 1000


def options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--tiny", action="store_true", help="next to no work (smoke test)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs, steps, latency_ms = (
        (4, 2, 10.0) if args.tiny else (args.runs, args.steps, args.latency_ms)
    )
    conninfo, problem = postgres_conninfo()
    if conninfo is None:
        raise SystemExit(f"this benchmark needs PostgreSQL: {problem}")
    with postgres_schema(conninfo) as schema, tempfile.TemporaryDirectory() as scratch:
        workers = Workers("polyloop", runs, args.workers, steps, latency_ms, conninfo, schema)
        polyloop = _polyloop(workers, Path(scratch))
        temporal = anyio.run(_temporal, replace(workers, kind="temporal"), Path(scratch))
    return {
        "command": args.command,
        "runs": runs,
        "workers": args.workers,
        "steps": steps,
        "latency_ms": latency_ms,
        "polyloop": {**polyloop, "wall_over_ideal": polyloop["wall_s"] / workers.ideal_s},
        "temporal": {**temporal, "wall_over_ideal": temporal["wall_s"] / workers.ideal_s},
        "temporal_over_polyloop": {
            "wall": temporal["wall_s"] / polyloop["wall_s"],
            "worker_cpu_per_step": temporal["cpu_per_step_ms"] / polyloop["cpu_per_step_ms"],
        },
    }


def _children(workers: Workers, scratch: Path) -> Children:
    """One worker process per slot, meeting in a directory of their own."""
    meeting = scratch / workers.kind
    specs = [replace(workers, meeting=str(meeting), slot=slot) for slot in range(workers.count)]
    return Children(meeting, [child_command("temporal", spec) for spec in specs])


def _reports(children: Children) -> list[dict[str, Any]]:
    try:
        return children.reports(timeout=3600)
    except ChildFailed as failure:
        raise SystemExit(f"a worker failed: {failure}") from None


def _polyloop(workers: Workers, scratch: Path) -> dict[str, Any]:
    with _children(workers, scratch) as children:
        reports = _reports(children)
    steps = sum(report["steps"] for report in reports)
    wall = max(r["ended"] for r in reports) - min(r["began"] for r in reports)
    return {
        "wall_s": wall,
        "steps": steps,
        "cpu_per_step_ms": 1000 * sum(r["cpu"] for r in reports) / steps,
    }


async def _temporal(workers: Workers, scratch: Path) -> dict[str, Any]:
    from temporalio.testing import WorkflowEnvironment

    cli = Path(sysconfig.get_path("scripts")) / "temporal"
    before = children_named("temporal")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(cli), ip="127.0.0.1", dev_server_log_level="error"
    )
    try:
        # The server this benchmark started: the one Temporal child that was not there
        # before (another, such as a test session's own, must not be measured).
        started = children_named("temporal") - before
        server = started.pop() if len(started) == 1 else None
        address = env.client.service_client.config.target_host
        served = replace(workers, address=address, queue=f"bench-{uuid.uuid4().hex[:8]}")
        with _children(served, scratch) as children:
            if not await anyio.to_thread.run_sync(children.all_ready):
                raise SystemExit("a Temporal worker did not start")
            figures, handles = await _drive(env.client, served, server)
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
    client: Any, workers: Workers, server: int | None
) -> tuple[dict[str, Any], list[Any]]:
    """Start one workflow per run, all at once, and wait for every result."""
    from polyloop.temporal import RunInput, start_agent_run

    server_cpu = cpu_seconds(server) if server is not None else 0.0
    began = time.time()
    handles = []
    outcomes: list[dict[str, Any]] = []

    async def start(i: int) -> None:
        run_id = f"t-{workers.queue}-{i}"
        handles.append(
            await start_agent_run(
                client, RunInput(agent=AGENT, run_id=run_id), task_queue=workers.queue
            )
        )
        outcomes.append(await handles[-1].result())

    await each(workers.runs, start)
    wall = time.time() - began
    server_spent = cpu_seconds(server) - server_cpu if server is not None else None
    steps = sum(outcome["steps"] for outcome in outcomes)
    figures = {
        "wall_s": wall,
        "steps": steps,
        "server_cpu_per_step_ms": 1000 * server_spent / steps if server_spent else None,
    }
    return figures, handles


# -- the children: the workers -------------------------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    workers = Workers(**spec)
    work = _serve_polyloop if workers.kind == "polyloop" else _serve_temporal
    result: dict[str, Any] = anyio.run(work, workers)
    return result


def _agent_parts(workers: Workers) -> tuple[Any, Any]:
    """The definition and ``request_for`` every worker uses, either way."""
    from bench.agents import Counter, definition, noop_tools, request
    from polyloop import Replay
    from polyloop.stores import PostgresStore
    from polyloop.testing import JsonActionInterpreter, ScriptedModelClient

    script = [json.dumps({"tool": "noop", "arguments": {}})] * (workers.steps - 1)
    script.append(json.dumps({"answer": "done"}))
    model = ScriptedModelClient(script, delay=workers.latency_ms / 1000, name="bench")
    store = PostgresStore(workers.conninfo, schema=workers.schema)
    tools = noop_tools(Counter())  # the benchmarks' one tool that does nothing

    def request_for(run_id: str, input: Any) -> Any:
        max_steps, executor = workers.steps + 1, tools.executor()
        return request(
            run_id,
            tools,
            executor,
            max_steps=max_steps,
            max_context_chars=1_000_000,
            model_replay=Replay.ALLOWED,
        )

    return definition(model, JsonActionInterpreter(), store), request_for


async def _serve_polyloop(workers: Workers) -> dict[str, Any]:
    from polyloop import start_or_resume

    definition, request_for = _agent_parts(workers)
    mine = range(workers.slot, workers.runs, workers.count)
    steps = 0
    async with definition.store:
        await definition.store.describe_run("warm-up")  # connect before the clock starts
        began, cpu = time.time(), cpu_seconds()

        async def one(index: int) -> None:
            nonlocal steps
            result = await start_or_resume(definition, request_for(f"pl-{mine[index]}", None))
            steps += result.step_count  # after the await: no other task's sum is lost

        await each(len(mine), one)
        ended = time.time()
    return {"began": began, "ended": ended, "cpu": cpu_seconds() - cpu, "steps": steps}


async def _serve_temporal(workers: Workers) -> dict[str, Any]:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from polyloop.temporal import Agent, PolyLoopPlugin

    definition, request_for = _agent_parts(workers)
    client = await Client.connect(workers.address)
    plugin = PolyLoopPlugin(
        [Agent(name=AGENT, definition=definition, request_for=request_for)],
        max_concurrent_runs=workers.runs,
    )
    async with definition.store:
        await definition.store.describe_run("warm-up")
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with Worker(
                client,
                task_queue=workers.queue,
                plugins=[plugin],
                max_concurrent_workflow_tasks=100,
            ):
                cpu = cpu_seconds()
                await meet(workers.meeting, workers.slot, wait_for_go=False)
                async for _ in signals:
                    break
            # Only the time serving runs: shutting down is not per step.
            spent = cpu_seconds() - cpu
    return {"cpu": spent}
