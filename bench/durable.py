"""Benchmark 2: what one step costs when the run is durable.

The same run as benchmark 1 on each durable store, beside:

* the disk's fsync floor: appends of a small record, each followed by ``fsync``, timed
  like the runs (wall time over calls) and measured in the same round-robin, between
  them, so that it sees the disk as they do;
* the hand-written loop with its two fsync'd appends per step (the floor the targets
  use), and the same loop with each barrier in a worker thread (a reference: that is
  where an AnyIO store has to do its blocking I/O);
* the hand-written loop writing, per step, lines as long as PolyLoop's JSON-lines log
  (its two intents synced, its model result and step appended): what the disk charges
  for the bytes a durable step records, which grows with the bytes an fsync carries;
  and the same with all four writes in a worker thread, as ``JsonlStore`` makes them
  (the loop that keeps the event loop free and writes what PolyLoop writes);
* the hand-written loop making, per step, the four SQLite commits ``SqliteStore`` makes
  (two under ``synchronous=FULL``, two under ``NORMAL``): what SQLite itself charges;
* LangGraph with its SQLite checkpointer on a file, with its default (background)
  durability and with ``durability="sync"``.

Every file lives in one scratch directory, so the floors and the stores share a disk.
The PostgreSQL server syncs its own write-ahead log, on whatever disk it uses.

Target: JsonlStore and SqliteStore within 2x of two fsync floors per step: each store
does every blocking call in a worker thread (research record 0019), so the loop with its
barriers in a worker thread is the row to compare with, and a column says how far
each store is from it.
"""

from __future__ import annotations

from pathlib import Path
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
    postgres_schema,
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
    from polyloop.stores import JsonlStore, SqliteStore

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
    async with (
        JsonlStore(directory / "jsonl") as jsonl,
        SqliteStore(directory / "runs.sqlite") as sqlite_store,
    ):
        # One database for every run of the SQLite floor, open as long as the store's.
        hand_sqlite = HandSqlite(directory / "hand.sqlite", sizes)
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
        for key, name, store in (
            ("polyloop-jsonl", "PolyLoop, JsonlStore", jsonl),
            ("polyloop-sqlite", "PolyLoop, SqliteStore", sqlite_store),
        ):
            agent = Agent(store, steps=steps)
            variants.append(Variant(key, name, "polyloop", _timed(agent, steps)))
        closers = [hand_sqlite.close]
        skip = peers.langgraph_sqlite_missing()
        for key, name, durability in (
            ("langgraph-sqlite", "LangGraph, SqliteSaver (default durability)", None),
            ("langgraph-sqlite-sync", "LangGraph, SqliteSaver, durability='sync'", "sync"),
        ):
            if skip:
                variants.append(Variant(key, name, "peer", skip=skip))
                continue
            graph = peers.LangGraphLoop(
                "sqlite", path=directory / f"{key}.sqlite", durability=durability
            )
            closers.append(graph.close)
            variants.append(Variant(key, name, "peer", _sync(graph.run, steps)))
        try:
            if ctx.postgres is None:
                variants.insert(
                    _after_sqlite(variants),
                    Variant(
                        "polyloop-postgres",
                        "PolyLoop, PostgresStore",
                        "polyloop",
                        skip=ctx.postgres_note,
                    ),
                )
                results = await _interleave_noted(ctx, variants, repeats)
            else:
                results = await _with_postgres(ctx, variants, steps, repeats)
        finally:
            for close in closers:
                close()
    return [summary_row(v, results.get(v.key), steps) for v in variants]


async def _with_postgres(ctx: Context, variants: list[Variant], steps: int, repeats: int) -> Any:
    from polyloop.stores import PostgresStore

    assert ctx.postgres is not None
    with postgres_schema(ctx.postgres) as schema:
        async with PostgresStore(ctx.postgres, schema=schema) as store:
            agent = Agent(store, steps=steps)
            variants.insert(
                _after_sqlite(variants),
                Variant(
                    "polyloop-postgres", "PolyLoop, PostgresStore", "polyloop", _timed(agent, steps)
                ),
            )
            return await _interleave_noted(ctx, variants, repeats)


async def _interleave_noted(ctx: Context, variants: list[Variant], repeats: int) -> Any:
    for variant in variants:
        if variant.skip:
            ctx.note(f"{variant.name}: skipped ({variant.skip})")
    return await interleave(variants, repeats)


def _after_sqlite(variants: list[Variant]) -> int:
    """Where the PostgreSQL row goes: right after PolyLoop's SQLite row."""
    return next(i for i, v in enumerate(variants) if v.key == "polyloop-sqlite") + 1


def _timed(agent: Agent, steps: int) -> Any:
    async def measure(run_id: str) -> Any:
        return await agent.timed_run(run_id, steps)

    return measure


def _sync(method: Any, steps: int) -> Any:
    async def measure(run_id: str) -> Any:
        return method(run_id, steps)

    return measure
