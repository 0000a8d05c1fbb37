"""Benchmark 1: kernel overhead per step, in memory, beside the floor and the peers.

One run of ``overhead_steps`` decisions (a no-op tool call on each but the last) with an
instant model. Rows:

* the hand-written in-memory loop (the floor every ratio is taken against);
* PolyLoop on ``MemoryStore`` with the tool in a ``ToolRegistry`` (what a user writes);
* PolyLoop on ``MemoryStore`` with a bare executor (no registry checks), to show how
  much of a step the registry's payload and schema checks take;
* LangGraph without a checkpointer and with ``InMemorySaver``;
* Pydantic AI with a ``FunctionModel``.

Target: PolyLoop on ``MemoryStore`` at most 15x the floor.
"""

from __future__ import annotations

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
            lambda rid: handwritten_memory(steps),
        ),
        Variant(
            "polyloop-memory",
            "PolyLoop, MemoryStore",
            "polyloop",
            lambda rid: memory.timed_run(rid, steps),
        ),
        Variant(
            "polyloop-memory-bare",
            "PolyLoop, MemoryStore, bare executor",
            "reference",
            lambda rid: bare.timed_run(rid, steps),
        ),
    ]
    closers = []
    skip = peers.langgraph_missing()
    for key, name, kind in (
        ("langgraph-none", "LangGraph, no checkpointer", "none"),
        ("langgraph-memory", "LangGraph, InMemorySaver", "memory"),
    ):
        if skip:
            variants.append(Variant(key, name, "peer", skip=skip))
            continue
        graph = peers.LangGraphLoop(kind)
        closers.append(graph.close)
        variants.append(Variant(key, name, "peer", _sync(graph.run, steps)))
    skip = peers.pydantic_ai_missing()
    if skip:
        variants.append(Variant("pydantic-ai", "Pydantic AI, FunctionModel", "peer", skip=skip))
    else:
        agent = peers.PydanticAILoop()
        variants.append(
            Variant(
                "pydantic-ai", "Pydantic AI, FunctionModel", "peer", lambda rid: agent.run(steps)
            )
        )
    for variant in variants:
        if variant.skip:
            ctx.note(f"{variant.name}: skipped ({variant.skip})")
    try:
        results = await interleave(variants, repeats)
    finally:
        for close in closers:
            close()
    return [summary_row(v, results.get(v.key), steps) for v in variants]


def _sync(method: Any, steps: int) -> Any:
    """Wrap a synchronous peer run so that the interleaving loop can await it."""

    async def measure(run_id: str) -> Any:
        return method(run_id, steps)

    return measure
