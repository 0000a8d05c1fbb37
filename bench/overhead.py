"""Benchmark 1: kernel overhead per step, in memory, beside the floor and the peers.

What each row is, and the target: ``bench/README.md``, benchmark 1.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import anyio

from bench import peers
from bench._common import (
    Context,
    Row,
    Variant,
    add_ratio,
    by_key,
    interleave,
    summary_row,
    target,
)
from bench.agents import Agent, handwritten_memory
from polyloop.stores import MemoryStore

TITLE = "1. Kernel overhead per step (instant model, no-op tool, in memory)"
COLUMNS = [
    ("name", "loop"),
    ("us_per_step", "us/step"),
    ("ratio_to_floor", "x floor", 2),
    ("us_per_step_min", "min"),
    ("us_per_step_max", "max"),
    ("decisions", "decisions"),
    ("tool_executions", "tool calls"),
    ("repeats", "runs"),
]
FLOOR = "floor-memory"
LIMIT = 15.0  # simplicity over microseconds: one path per job (issue 14)


def run(ctx: Context) -> dict[str, Any]:
    steps, repeats = ctx.sizes.overhead_steps, ctx.sizes.overhead_repeats
    rows: list[Row] = anyio.run(_measure, ctx, steps, repeats)
    add_ratio(rows, FLOOR)
    polyloop = by_key(rows, "polyloop-memory")
    targets = [
        target(
            "kernel overhead on MemoryStore <= 15x the hand-written in-memory loop",
            polyloop.get("ratio_to_floor") if polyloop else None,
            LIMIT,
            what="PolyLoop MemoryStore us/step / hand-written loop us/step",
        )
    ]
    return {"title": TITLE, "columns": COLUMNS, "rows": rows, "targets": targets, "steps": steps}


async def _measure(ctx: Context, steps: int, repeats: int) -> list[Row]:
    memory = Agent(MemoryStore(), steps=steps)
    bare = Agent(MemoryStore(), steps=steps, bare=True)
    variants = [
        Variant(
            FLOOR,
            "hand-written asyncio loop (floor)",
            "floor",
            lambda run_id: handwritten_memory(steps),
        ),
        Variant(
            "polyloop-memory",
            "PolyLoop, MemoryStore",
            "polyloop",
            functools.partial(memory.timed_run, steps=steps),
        ),
        Variant(
            "polyloop-memory-bare",
            "PolyLoop, MemoryStore, bare executor",
            "reference",
            functools.partial(bare.timed_run, steps=steps),
        ),
    ]
    async with contextlib.AsyncExitStack() as stack:
        variants += peers.langgraph_variants(
            stack,
            steps,
            [
                ("langgraph-none", "LangGraph, no checkpointer", "none", {}),
                ("langgraph-memory", "LangGraph, InMemorySaver", "memory", {}),
            ],
        )
        variants.append(peers.pydantic_ai_variant(steps))
        results = await interleave(ctx, variants, repeats)
    return [summary_row(v, results.get(v.key), steps) for v in variants]
