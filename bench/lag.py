"""Benchmark 7: how late a 1 ms ticker wakes while concurrent durable runs write.

No blocking call of a store runs on the event loop, so what is left is the kernel's
Python work between awaits. What is measured, and the targets: ``bench/README.md``,
benchmark 7.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import uuid
from contextlib import AsyncExitStack
from typing import Any

import anyio

from bench._common import Context, Row, each, skipped, target
from bench._sampling import beside_ticker, lateness_ms
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
    runs, steps = ctx.sizes.pick((100, 30), (100, 10), (3, 2))  # concurrent runs, steps
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
        problem = ctx.unavailable(store)
        if problem is not None:
            rows.append(skipped(row, problem))
            continue
        async with AsyncExitStack() as stack:
            opened = None if store == "idle" else await ctx.open_store(stack, store)
            gc.collect()
            gc.freeze()
            try:
                lateness = await _measure(opened, runs, steps)
            finally:
                gc.unfreeze()
        rows.append({**row, "samples": len(lateness), **lateness_ms(lateness)})
        ctx.say(
            f"    {row['name']}: p99 {rows[-1]['p99_ms']:.2f} ms, max {rows[-1]['max_ms']:.2f} ms"
        )
    return rows


async def _measure(store: Any, runs: int, steps: int) -> list[float]:
    """Lateness (ms) of each 1 ms tick while the runs go (or for a while, with no store)."""

    async def work() -> None:
        if store is None:
            await anyio.sleep(0.5)
            return
        agent = Agent(store, steps=steps)
        agent.model = SlowModel(steps, seed=7)
        agent.definition = dataclasses.replace(agent.definition, model=agent.model)
        await each(runs, lambda _: agent.run(f"lag-{uuid.uuid4().hex[:12]}", steps))

    _, ticker = await beside_ticker(work, TICK_S)
    return [late * 1000 for late in ticker.lateness_s]
