"""Benchmark 3: many runs at once, sharing one model client, in one task group; against
the same runs one after another (3b), and group commit against one commit per write (3c).

What is measured, and the targets: ``bench/README.md``, benchmark 3.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio

from bench._common import (
    Context,
    Row,
    RunStats,
    each,
    median,
    now,
    rounds,
    settle,
    skipped,
    target,
)
from bench._sampling import python_peak_bytes
from bench.agents import Agent, handwritten_concurrent

TITLE = "3. Concurrent runs (one task group, one shared model client)"
COLUMNS = [
    ("name", "backend / store"),
    ("runs", "runs"),
    ("steps_per_run", "steps/run"),
    ("wall_s", "wall s", 2),
    ("wall_s_min", "min", 2),
    ("wall_s_max", "max", 2),
    ("steps_per_s", "steps/s"),
    ("us_per_step", "wall us/step"),
    ("peak_kib_per_run", "peak KiB/run"),
    ("repeats", "repeats"),
]
SPEEDUP_TITLE = "3b. Speed-up of concurrent durable runs over sequential ones"
SPEEDUP_COLUMNS = [
    ("name", "backend / store"),
    ("runs", "runs"),
    ("sequential_s", "sequential s", 2),
    ("concurrent_s", "concurrent s", 2),
    ("speedup", "speed-up", 2),
    ("speedup_vs_handwritten", "x hand-written speed-up", 2),
]
GROUP_TITLE = "3c. Group commit: concurrent runs, steps per second with and without it"
GROUP_COLUMNS = [
    ("name", "backend / store"),
    ("runs", "runs"),
    ("single_steps_per_s", "one commit per write, steps/s"),
    ("group_steps_per_s", "group commit, steps/s"),
    ("gain", "gain", 2),
]
STORES = ("memory", "jsonl", "sqlite", "postgres", "handwritten")
STORE_NAMES = {
    "memory": "PolyLoop, MemoryStore",
    "jsonl": "PolyLoop, JsonlStore",
    "sqlite": "PolyLoop, SqliteStore",
    "postgres": "PolyLoop, PostgresStore",
    "handwritten": "hand-written durable loop",
    "sqlite-single": "PolyLoop, SqliteStore, one commit per write",
    "postgres-single": "PolyLoop, PostgresStore, one commit per write",
}
GROUP_LIMIT = 3.0


def run(ctx: Context) -> dict[str, Any]:
    rows: list[Row] = []
    speedups: list[Row] = []
    groups: list[Row] = []
    for backend in ctx.sizes.backends:
        ctx.say(f"  backend {backend}")
        cells, ups, gains = anyio.run(_backend, ctx, backend, backend=backend)
        rows += cells
        speedups += ups
        groups += gains
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "tables": [
            {"title": SPEEDUP_TITLE, "columns": SPEEDUP_COLUMNS, "rows": speedups},
            {"title": GROUP_TITLE, "columns": GROUP_COLUMNS, "rows": groups},
        ],
        "speedups": speedups,
        "group_commit": groups,
        "targets": _targets(ctx, rows, speedups, groups),
    }


def _targets(ctx: Context, rows: list[Row], speedups: list[Row], groups: list[Row]) -> list[Row]:
    runs = ctx.sizes.sequential_runs
    found: list[Row] = []
    for backend in ctx.sizes.backends:
        for row in speedups:
            if row["backend"] == backend and row["store"] != "handwritten":
                found.append(
                    target(
                        f"{backend}: {runs} concurrent runs on {row['store']} not slower than "
                        f"sequential",
                        row.get("speedup"),
                        1.0,
                        at_least=True,
                        what="sequential wall s / concurrent wall s",
                    )
                )
        for row in groups:
            if row["backend"] == backend:
                found.append(
                    target(
                        f"{backend}: group commit on {row['store']} >= {GROUP_LIMIT}x the steps/s "
                        f"of one commit per write",
                        row.get("gain"),
                        GROUP_LIMIT,
                        at_least=True,
                        what="group-commit steps/s / one-commit-per-write steps/s",
                    )
                )
    return found


class _Stores:
    """Opens each store kind once per backend and builds a fresh one where it must."""

    def __init__(self, ctx: Context, exit_stack: AsyncExitStack) -> None:
        self.ctx = ctx
        self.stack = exit_stack
        self.opened: dict[str, Any] = {}

    async def get(self, kind: str) -> Any:
        if kind == "memory":  # a new one per pass: it keeps every record it is given
            return await self.ctx.open_store(self.stack, kind)
        if kind not in self.opened:
            self.opened[kind] = await self.ctx.open_store(self.stack, kind)
            await self._warm(self.opened[kind])
        return self.opened[kind]

    async def _warm(self, store: Any) -> None:
        """A few small runs at once, so connections and files exist before timing."""
        agent = Agent(store, steps=2)
        await each(8, lambda _: agent.run(f"warm-{uuid.uuid4().hex[:8]}", 2))


async def _backend(ctx: Context, backend: str) -> tuple[list[Row], list[Row], list[Row]]:
    sizes = ctx.sizes
    largest = max(sizes.concurrency_runs)
    rows: list[Row] = []
    async with AsyncExitStack() as stack:
        stores = _Stores(ctx, stack)
        for kind in STORES:
            for runs in sizes.concurrency_runs:
                steps = (
                    sizes.concurrency_steps_largest if runs == largest else sizes.concurrency_steps
                )
                row = _head(ctx, backend, kind, f"{backend}-{kind}-{runs}", runs, steps)
                if row.get("skipped"):
                    rows.append(row)
                    continue
                pass_ = await _pass_for(ctx, stores, kind, runs, steps)
                walls = []
                repeats = (
                    sizes.concurrency_repeats_largest
                    if runs == largest
                    else sizes.concurrency_repeats
                )
                for _ in range(repeats):
                    settle()
                    stats = await pass_()
                    walls.append(stats.seconds)
                peak = await python_peak_bytes(pass_)
                wall = median(walls)
                row.update(
                    repeats=len(walls),
                    wall_s=wall,
                    wall_s_min=min(walls),
                    wall_s_max=max(walls),
                    steps_per_s=runs * steps / wall,
                    us_per_step=wall / (runs * steps) * 1e6,
                    peak_kib_per_run=peak / runs / 1024,
                    decisions=stats.decisions,
                    tool_executions=stats.tool_executions,
                )
                rows.append(row)
                ctx.say(f"    {row['name']}: {runs} runs x {steps} steps in {wall:.2f} s")
        speedups = await _speedups(ctx, stores, backend)
        gains = await _group_gains(ctx, stores, backend)
    return rows, speedups, gains


async def _pass_for(
    ctx: Context, stores: _Stores, kind: str, runs: int, steps: int, *, sequential: bool = False
) -> Callable[[], Awaitable[RunStats]]:
    """A coroutine function performing one pass: ``runs`` runs of ``steps`` decisions."""
    if kind == "handwritten":

        async def hand() -> RunStats:
            directory = ctx.scratch("concurrency-hand")
            return await handwritten_concurrent(runs, steps, directory, sequential=sequential)

        return hand

    async def polyloop() -> RunStats:
        store = await stores.get(kind)
        agent = Agent(store, steps=steps)  # one model client shared by every run of the pass
        prefix = uuid.uuid4().hex[:8]
        began = now()
        await each(runs, lambda index: agent.run(f"{prefix}-{index}", steps), sequential=sequential)
        seconds = now() - began
        stats = RunStats(seconds, agent.model.decisions.n, agent.executions.n)
        if stats.decisions != runs * steps or stats.tool_executions != runs * (steps - 1):
            raise AssertionError(f"{kind}: {stats} for {runs} runs of {steps} steps")
        return stats

    return polyloop


async def _speedups(ctx: Context, stores: _Stores, backend: str) -> list[Row]:
    runs, steps = ctx.sizes.sequential_runs, ctx.sizes.concurrency_steps
    rows: list[Row] = []
    for kind in ("jsonl", "sqlite", "postgres", "handwritten"):
        row = _paired_row(ctx, backend, kind, "speedup")
        if row.get("skipped"):
            rows.append(row)
            continue
        one_by_one = await _pass_for(ctx, stores, kind, runs, steps, sequential=True)
        at_once = await _pass_for(ctx, stores, kind, runs, steps)
        walls, concurrent_walls = await _paired_walls(
            [one_by_one, at_once], ctx.sizes.concurrency_repeats
        )
        sequential, concurrent = median(walls), median(concurrent_walls)
        row.update(
            sequential_s=sequential,
            concurrent_s=concurrent,
            speedup=sequential / concurrent,
            repeats=len(walls),
        )
        rows.append(row)
    hand = next((r for r in rows if r["store"] == "handwritten" and "speedup" in r), None)
    for row in rows:
        if hand is not None and "speedup" in row:
            row["speedup_vs_handwritten"] = row["speedup"] / hand["speedup"]
    return rows


async def _group_gains(ctx: Context, stores: _Stores, backend: str) -> list[Row]:
    """Group commit against one commit per write, same runs at once, same backend."""
    runs, steps = ctx.sizes.sequential_runs, ctx.sizes.concurrency_steps
    rows: list[Row] = []
    for kind in ("sqlite", "postgres"):
        row = _paired_row(ctx, backend, kind, "group")
        if row.get("skipped"):
            rows.append(row)
            continue
        single = await _pass_for(ctx, stores, f"{kind}-single", runs, steps)
        group = await _pass_for(ctx, stores, kind, runs, steps)
        walls, group_walls = await _paired_walls([single, group], ctx.sizes.concurrency_repeats)
        grouped = median(group_walls)
        total = runs * steps
        row.update(
            single_steps_per_s=total / median(walls),
            group_steps_per_s=total / grouped,
            gain=median(walls) / grouped,
            repeats=len(walls),
        )
        rows.append(row)
    return rows


def _paired_row(ctx: Context, backend: str, kind: str, table: str) -> Row:
    """The head of a row of tables 3b/3c."""
    runs, steps = ctx.sizes.sequential_runs, ctx.sizes.concurrency_steps
    return _head(ctx, backend, kind, f"{backend}-{kind}-{table}", runs, steps)


def _head(ctx: Context, backend: str, kind: str, key: str, runs: int, steps: int) -> Row:
    """The head of a row, already marked skipped where the store cannot run here."""
    row: Row = {
        "key": key,
        "backend": backend,
        "store": kind,
        "name": f"{backend}: {STORE_NAMES[kind]}",
        "runs": runs,
        "steps_per_run": steps,
    }
    problem = ctx.unavailable(kind)
    return row if problem is None else skipped(row, problem)


async def _paired_walls(
    passes: list[Callable[[], Awaitable[RunStats]]], repeats: int
) -> list[list[float]]:
    """Wall seconds of ``repeats`` passes of each, side by side (:func:`rounds`), so
    that a slow spell of the machine weighs on both sides of a ratio alike."""
    return [[stats.seconds for stats in side] for side in await rounds(passes, repeats)]
