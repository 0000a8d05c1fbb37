"""Benchmark 7: how responsive the event loop stays while PolyLoop writes.

A program that drives agents usually does other things on the same event loop: serves
requests, streams tokens, runs other tasks. What it feels is how late its own tasks
wake while runs write. A ticker task sleeps 1 ms again and again beside ``runs``
concurrent durable runs of the benchmark agent (a no-op tool), whose model answers after
a latency drawn between 20 and 80 ms (seeded; a real model takes longer still, so the
runs' own work, and the stores' writes, are spread out as they would be); each
wake-up's lateness (how much longer than 1 ms the sleep took) is one sample. Reported per backend
and store: the median, the 99th percentile and the largest lateness, and the same for
the ticker alone on an idle loop (the floor: what the machine and the event loop cost
anyway).

Before each measurement the process's existing objects are collected and frozen
(``gc.freeze``): the earlier benchmarks of a full run leave a large heap behind, and a
full garbage collection walking it would stall the loop for a time that says nothing
about PolyLoop. Collections of what the runs themselves allocate still count.

Targets, per backend and durable store: p99 lateness under 5 ms and the largest under
20 ms, with 100 concurrent runs. No blocking call of a store runs on the loop, so what
is left is the kernel's Python work between awaits.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import uuid
from contextlib import AsyncExitStack
from typing import Any

import anyio

from bench._common import QUICK, TINY, Context, Row, now, postgres_schema, skipped, target
from bench.agents import Agent, InstantModel
from polyloop import ModelCall, ModelReply

TITLE = "7. Event-loop lag beside concurrent durable runs (a 1 ms ticker)"
COLUMNS = [
    ("name", "backend / store"),
    ("runs", "runs"),
    ("steps_per_run", "steps/run"),
    ("samples", "ticks"),
    ("p50_ms", "p50 late ms", 2),
    ("p99_ms", "p99 late ms", 2),
    ("max_ms", "max late ms", 2),
]
STORES = ("idle", "memory", "jsonl", "sqlite", "postgres")
STORE_NAMES = {
    "idle": "ticker alone (floor)",
    "memory": "PolyLoop, MemoryStore",
    "jsonl": "PolyLoop, JsonlStore",
    "sqlite": "PolyLoop, SqliteStore",
    "postgres": "PolyLoop, PostgresStore",
}
P99_LIMIT_MS = 5.0
MAX_LIMIT_MS = 20.0
TICK_S = 0.001
LATENCY_S = (0.020, 0.080)


class SlowModel(InstantModel):
    """The benchmark agent's model, answering after a seeded random latency."""

    def __init__(self, steps: int, seed: int) -> None:
        super().__init__(steps)
        self.random = random.Random(seed)

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.sleep(self.random.uniform(*LATENCY_S))
        return await super().call(call)


def _sizes(ctx: Context) -> tuple[int, int]:
    """(concurrent runs, steps per run)."""
    if ctx.sizes is TINY:
        return 3, 2
    if ctx.sizes is QUICK:
        return 100, 10
    return 100, 30


def run(ctx: Context) -> dict[str, Any]:
    rows: list[Row] = []
    for backend in ctx.sizes.backends:
        ctx.say(f"  backend {backend}")
        rows += anyio.run(_backend, ctx, backend, backend=backend)
    return {"title": TITLE, "columns": COLUMNS, "rows": rows, "targets": _targets(rows)}


def _targets(rows: list[Row]) -> list[Row]:
    found = []
    for row in rows:
        if row.get("skipped") or row["store"] in ("idle", "memory"):
            continue
        found.append(
            target(
                f"{row['name']}: p99 event-loop lag under {P99_LIMIT_MS:g} ms",
                row["p99_ms"],
                P99_LIMIT_MS,
                unit=" ms",
                what="99th percentile of how late a 1 ms sleep woke",
            )
        )
        found.append(
            target(
                f"{row['name']}: largest event-loop lag under {MAX_LIMIT_MS:g} ms",
                row["max_ms"],
                MAX_LIMIT_MS,
                unit=" ms",
                what="the latest a 1 ms sleep woke",
            )
        )
    return found


async def _backend(ctx: Context, backend: str) -> list[Row]:
    runs, steps = _sizes(ctx)
    rows = []
    for store in STORES:
        row: Row = {
            "key": f"{backend}-{store}",
            "name": f"{backend}: {STORE_NAMES[store]}",
            "backend": backend,
            "store": store,
            "runs": runs,
            "steps_per_run": steps,
        }
        if store == "postgres" and ctx.postgres is None:
            rows.append(skipped(row, ctx.postgres_note or "no PostgreSQL"))
            continue
        async with AsyncExitStack() as stack:
            opened = None if store == "idle" else await _open(ctx, stack, store)
            gc.collect()
            gc.freeze()
            try:
                lateness = await _measure(opened, runs, steps)
            finally:
                gc.unfreeze()
        rows.append({**row, **_summary(lateness)})
        ctx.say(
            f"    {row['name']}: p99 {rows[-1]['p99_ms']:.2f} ms, max {rows[-1]['max_ms']:.2f} ms"
        )
    return rows


async def _open(ctx: Context, stack: AsyncExitStack, store: str) -> Any:
    from polyloop.stores import JsonlStore, MemoryStore, SqliteStore

    if store == "memory":
        return MemoryStore()
    if store == "jsonl":
        return await stack.enter_async_context(JsonlStore(ctx.scratch("lag-jsonl")))
    if store == "sqlite":
        return await stack.enter_async_context(
            SqliteStore(ctx.scratch("lag-sqlite") / "runs.sqlite")
        )
    from polyloop.stores import PostgresStore

    assert ctx.postgres is not None
    schema = stack.enter_context(postgres_schema(ctx.postgres))
    return await stack.enter_async_context(PostgresStore(ctx.postgres, schema=schema))


async def _measure(store: Any, runs: int, steps: int) -> list[float]:
    """Lateness of each 1 ms tick while the runs go (or for a while, with no store)."""
    lateness: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            began = now()
            await anyio.sleep(TICK_S)
            lateness.append(max(0.0, now() - began - TICK_S))

    async def work() -> None:
        if store is None:
            await anyio.sleep(0.5)
        else:
            agent = Agent(store, steps=steps)
            agent.model = SlowModel(steps, seed=7)
            agent.definition = dataclasses.replace(agent.definition, model=agent.model)
            async with anyio.create_task_group() as group:
                for _ in range(runs):
                    group.start_soon(agent.run, f"lag-{uuid.uuid4().hex[:12]}", steps)
        done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        await work()
    return lateness


def _summary(lateness: list[float]) -> Row:
    ordered = sorted(lateness) or [0.0]

    def at(share: float) -> float:
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))] * 1000

    return {
        "samples": len(lateness),
        "p50_ms": at(0.5),
        "p99_ms": at(0.99),
        "max_ms": ordered[-1] * 1000,
    }
