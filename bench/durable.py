"""Benchmark 2: what one step costs when the run is durable, beside the disk's fsync floor
and hand-written durable loops.

What each row is, and the targets: ``bench/README.md``, benchmark 2.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import anyio

from bench import peers
from bench._common import (
    STORE_NAMES,
    Context,
    Row,
    Variant,
    add_ratio,
    by_key,
    interleave,
    summary_row,
    target,
)
from bench.agents import (
    Agent,
    HandSqlite,
    fsync_floor_run,
    handwritten_durable,
    polyloop_line_sizes,
)

TITLE = "2. Durable step cost"
COLUMNS = [
    ("name", "loop"),
    ("us_per_step", "us/step"),
    ("ratio_to_floor", "x 2-fsync loop", 2),
    ("ratio_to_threaded", "x threaded loop", 2),
    ("ratio_to_same_bytes", "x same-bytes loop", 2),
    ("ratio_to_same_threaded", "x same-bytes loop, threaded", 2),
    ("fsyncs_per_step", "fsync floors/step", 2),
    ("ratio_to_sqlite_floor", "x SQLite loop", 2),
    ("us_per_step_min", "min"),
    ("us_per_step_max", "max"),
    ("decisions", "decisions"),
    ("tool_executions", "tool calls"),
    ("repeats", "runs"),
]
FSYNC = "fsync-floor"
FLOOR = "floor-two-fsyncs"
THREADED = "floor-two-fsyncs-thread"
SQLITE_FLOOR = "floor-sqlite"
SQLITE_FRESH = "floor-sqlite-fresh"
SAME_BYTES = "floor-same-bytes"
SAME_BYTES_THREADED = "floor-same-bytes-thread"
TWO_FSYNC_LIMIT = 2.0  # a step's syncs in a worker thread, as SPEC asks (issue 14)


def run(ctx: Context) -> dict[str, Any]:
    steps, repeats = ctx.sizes.durable_steps, ctx.sizes.durable_repeats
    directory = ctx.scratch("durable")
    rows: list[Row] = anyio.run(_measure, ctx, directory, steps, repeats)
    fsync = by_key(rows, FSYNC)
    assert fsync is not None
    # The floor's "steps" are its calls; it has no decisions or tool calls to show.
    fsync.update(unit="us per append+fsync", calls=fsync.pop("decisions"))
    fsync.pop("tool_executions")
    fsync_us = fsync["us_per_step"]
    add_ratio(rows, FLOOR)
    add_ratio(rows, THREADED, "ratio_to_threaded")
    add_ratio(rows, SAME_BYTES, "ratio_to_same_bytes")
    add_ratio(rows, SAME_BYTES_THREADED, "ratio_to_same_threaded")
    sqlite_floor = by_key(rows, SQLITE_FLOOR) or {}
    for row in rows:
        if row.get("skipped"):
            continue
        row["fsyncs_per_step"] = row["us_per_step"] / fsync_us
        if "sqlite" in row["key"] and sqlite_floor.get("us_per_step"):
            row["ratio_to_sqlite_floor"] = row["us_per_step"] / sqlite_floor["us_per_step"]
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "targets": targets(rows),
        "steps": steps,
        "fsync_floor_us": fsync_us,
    }


def targets(rows: list[Row]) -> list[Row]:
    """The targets, from the measured rows alone (so a saved run can be re-judged)."""
    found = []
    for key, name in (("polyloop-jsonl", "JsonlStore"), ("polyloop-sqlite", "SqliteStore")):
        fsyncs = (by_key(rows, key) or {}).get("fsyncs_per_step")
        found.append(
            target(
                f"durable step on {name} within {TWO_FSYNC_LIMIT:g}x two fsync floors",
                None if fsyncs is None else fsyncs / 2,
                TWO_FSYNC_LIMIT,
                what=f"PolyLoop {name} us/step / (2 x append+fsync floor)",
            )
        )
    return found


async def _measure(ctx: Context, directory: Path, steps: int, repeats: int) -> list[Row]:
    sizes = await polyloop_line_sizes(steps)
    variants = [
        Variant(
            FSYNC,
            "fsync floor (append + fsync, per call)",
            "floor",
            lambda rid: fsync_floor_run(ctx.sizes.fsync_samples, directory / f"{rid}.log"),
        ),
        Variant(
            FLOOR,
            "hand-written loop, 2 fsync'd appends/step (floor)",
            "floor",
            lambda rid: handwritten_durable(steps, directory / f"{rid}.log"),
        ),
        Variant(
            THREADED,
            "hand-written loop, 2 fsync'd appends/step in a worker thread",
            "reference",
            lambda rid: handwritten_durable(steps, directory / f"{rid}.log", threaded=True),
        ),
        Variant(
            SAME_BYTES,
            "hand-written loop, PolyLoop's bytes/step (2 of 4 lines fsync'd)",
            "reference",
            lambda rid: handwritten_durable(steps, directory / f"{rid}.log", sizes=sizes),
        ),
        Variant(
            SAME_BYTES_THREADED,
            "the same, every write in a worker thread (4 thread round trips/step)",
            "reference",
            lambda rid: handwritten_durable(
                steps, directory / f"{rid}.log", sizes=sizes, threaded=True
            ),
        ),
    ]
    async with contextlib.AsyncExitStack() as stack:
        # One database for every run of the SQLite floor, open as long as the store's.
        hand_sqlite = stack.enter_context(
            contextlib.closing(HandSqlite(directory / "hand.sqlite", sizes))
        )
        variants.append(
            Variant(
                SQLITE_FLOOR,
                "hand-written loop on SQLite, SqliteStore's 4 commits/step",
                "reference",
                lambda rid: hand_sqlite.run(rid, steps),
            )
        )
        variants.append(
            Variant(
                SQLITE_FRESH,
                "the same, on a new database per run (its log only grows)",
                "reference",
                lambda rid: HandSqlite.fresh_run(directory / f"{rid}.sqlite", sizes, rid, steps),
            )
        )
        for kind in ("jsonl", "sqlite", "postgres"):
            key, name = f"polyloop-{kind}", f"PolyLoop, {STORE_NAMES[kind]}"
            problem = ctx.unavailable(kind)
            if problem is not None:
                variants.append(Variant(key, name, "polyloop", skip=problem))
                continue
            agent = Agent(await ctx.open_store(stack, kind), steps=steps)
            timed = functools.partial(agent.timed_run, steps=steps)
            variants.append(Variant(key, name, "polyloop", timed))
        variants += peers.langgraph_variants(
            stack,
            steps,
            [
                (
                    key,
                    f"LangGraph, SqliteSaver{label}",
                    "sqlite",
                    {"path": directory / f"{key}.sqlite", "durability": durability},
                )
                for key, label, durability in (
                    ("langgraph-sqlite", " (default durability)", None),
                    ("langgraph-sqlite-sync", ", durability='sync'", "sync"),
                )
            ],
            peers.langgraph_sqlite_missing,
        )
        results = await interleave(ctx, variants, repeats)
    return [summary_row(v, results.get(v.key), steps) for v in variants]
