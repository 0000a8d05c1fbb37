"""Benchmark 6: do listing and status cost the same with many finished runs in the store?

How the stores are built, what is timed, and the targets: ``bench/README.md``, benchmark 6.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from bench._common import (
    STORE_NAMES,
    Context,
    Row,
    at_once,
    history,
    median,
    now,
    rounds,
    settle,
    skipped,
    target,
)
from bench.agents import Agent
from polyloop import RunState, run_status
from polyloop.testing import FaultyStore, SimulatedCrash

TITLE = "6. Listing and status against the number of finished runs"
COLUMNS = [
    ("name", "store / finished runs"),
    ("unfinished", "unfinished"),
    ("finished", "finished"),
    ("list_unfinished_ms", "list unfinished ms", 2),
    ("list_unfinished_ratio", "x none", 2),
    ("status_total_ms", "all statuses ms"),
    ("status_us_per_run", "us/status"),
    ("status_ratio", "x none", 2),
    ("list_all_ms", "list all ms"),
    ("list_all_ratio", "x none", 2),
    ("repeats", "repeats"),
]
# The stores whose listing of unfinished runs is meant not to read finished ones.
FLAT = ("sqlite", "postgres")
LIMIT = 1.5
# Runs written at once while a store is built: enough for group commit to share fsyncs.
BUILDERS = 100
# The writes of an unfinished run: its start and one tool step (model intent, model
# result, action intent, step record); the next write (the next intent) never lands.
UNFINISHED_WRITES = 5


@dataclass(frozen=True)
class ListingSizes:
    """Unfinished runs per store, the numbers of finished runs compared, and repeats."""

    unfinished: int
    finished: tuple[int, ...]  # the first is 0: the baseline each ratio divides by
    repeats: int


FULL_SIZES = ListingSizes(unfinished=1_000, finished=(0, 10_000), repeats=5)
QUICK_SIZES = ListingSizes(unfinished=500, finished=(0, 5_000), repeats=3)
TINY_SIZES = ListingSizes(unfinished=3, finished=(0, 6), repeats=1)


def run(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes.pick(FULL_SIZES, QUICK_SIZES, TINY_SIZES)
    rows, notes = anyio.run(_measure, ctx, sizes)
    for note in notes:
        ctx.note(note)
    targets = []
    for row in rows:
        if row.get("store") not in FLAT or row.get("finished", 0) == 0:
            continue
        name = f"{STORE_NAMES[row['store']]} with {row['finished']:,} finished runs"
        targets.append(
            target(
                f"{name}: unfinished listing <= {LIMIT}x none finished",
                row.get("list_unfinished_ratio"),
                LIMIT,
                what="list_runs(unfinished_only=True) time / same without finished runs",
            )
        )
        targets.append(
            target(
                f"{name}: statuses of unfinished runs <= {LIMIT}x none finished",
                row.get("status_ratio"),
                LIMIT,
                what="run_status of every unfinished run / same without finished runs",
            )
        )
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "targets": targets,
        "notes": notes,
        "sizes": asdict(sizes),
    }


async def _measure(ctx: Context, sizes: ListingSizes) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    for kind in STORE_NAMES:
        names = [f"{STORE_NAMES[kind]}, {f:,} finished" for f in sizes.finished]
        problem = ctx.unavailable(kind)
        if problem is not None:
            for f, name in zip(sizes.finished, names, strict=True):
                row = {"key": f"{kind}-{f}", "store": kind, "finished": f, "name": name}
                rows.append(skipped(row, problem))
            continue
        async with contextlib.AsyncExitStack() as stack:
            copies = []
            for f in sizes.finished:
                where = ctx.place(stack, kind)
                store = await ctx.open_store(stack, kind, where)
                began = now()
                await _fill(store, sizes.unfinished, f)
                ctx.say(
                    f"    {STORE_NAMES[kind]}: built {sizes.unfinished:,} unfinished "
                    f"+ {f:,} finished runs in {now() - began:.1f} s"
                )
                copies.append((store, f))
            measured = await _interleave(copies, sizes.unfinished, sizes.repeats)
            for f, times, name in zip(sizes.finished, measured, names, strict=True):
                rows.append(_row(kind, f, name, sizes.unfinished, times))
            plan = _plan(kind, where)
            if plan is not None:
                notes.append(
                    f"{STORE_NAMES[kind]} plans the unfinished listing "
                    f"({sizes.finished[-1]:,} finished runs) as: {plan}"
                )
    _ratios(rows)
    return rows, notes


# -- building a store ---------------------------------------------------------------------


async def _fill(store: Any, unfinished: int, finished: int) -> None:
    """Write the runs through the store's own API, ``BUILDERS`` at a time, the unfinished
    ones spread evenly among the finished ones."""
    jobs = (
        (_unfinished_job if kind == "unfinished" else _finished_job)(store, run_id)
        for kind, run_id in history(["unfinished"] * unfinished, finished)
    )
    await at_once(jobs, min(BUILDERS, unfinished + finished))


def _finished_job(store: Any, run_id: str) -> Callable[[], Awaitable[None]]:
    async def job() -> None:
        result = await Agent(store, steps=1).run(run_id, 1)
        if result.final_answer != "done":
            raise AssertionError(f"{run_id} ended {result.stop_reason}, not with its answer")

    return job


def _unfinished_job(store: Any, run_id: str) -> Callable[[], Awaitable[None]]:
    async def job() -> None:
        agent = Agent(FaultyStore(store, fail_after_writes=UNFINISHED_WRITES), steps=None)
        try:
            await agent.run(run_id, 2)
        except SimulatedCrash:
            return
        raise AssertionError(f"{run_id} was meant to stop at its second step")

    return job


# -- measuring ----------------------------------------------------------------------------


@dataclass
class _Times:
    list_unfinished: list[float]
    statuses: list[float]
    list_all: list[float]


async def _interleave(copies: list[tuple[Any, int]], unfinished: int, repeats: int) -> list[_Times]:
    """Time each copy ``repeats`` times (:func:`rounds`, after one unrecorded pass each)."""
    measured = await rounds(
        [functools.partial(_pass, store, unfinished, finished) for store, finished in copies],
        repeats,
        warmup=True,
    )
    return [_Times(*map(list, zip(*passes, strict=True))) for passes in measured]


async def _pass(store: Any, unfinished: int, finished: int) -> tuple[float, float, float]:
    """Seconds of: the unfinished listing, every unfinished run's status, the full listing."""
    settle()
    began = now()
    listed = await store.list_runs(unfinished_only=True)
    list_unfinished = now() - began
    settle()
    began = now()
    statuses = [await run_status(store, item.run_id) for item in listed]
    status_total = now() - began
    settle()
    began = now()
    everything = await store.list_runs()
    list_all = now() - began
    if len(listed) != unfinished or len(everything) != unfinished + finished:
        raise AssertionError(
            f"listed {len(listed)} unfinished and {len(everything)} runs, "
            f"not {unfinished} and {unfinished + finished}"
        )
    wrong = [s for s in statuses if s.state is not RunState.RESUMABLE or s.steps != 1]
    if wrong:
        raise AssertionError(
            f"{len(wrong)} unfinished runs are not resumable after one step: {wrong[0]}"
        )
    return list_unfinished, status_total, list_all


def _row(kind: str, finished: int, name: str, unfinished: int, times: _Times) -> Row:
    statuses = median(times.statuses)
    return {
        "key": f"{kind}-{finished}",
        "store": kind,
        "name": name,
        "unfinished": unfinished,
        "finished": finished,
        "repeats": len(times.statuses),
        "list_unfinished_ms": median(times.list_unfinished) * 1e3,
        "status_total_ms": statuses * 1e3,
        "status_us_per_run": statuses / max(unfinished, 1) * 1e6,
        "list_all_ms": median(times.list_all) * 1e3,
    }


def _ratios(rows: list[Row]) -> None:
    """Divide each row's times by those of the same store without finished runs."""
    base = {r["store"]: r for r in rows if r.get("finished") == 0 and not r.get("skipped")}
    for row in rows:
        first = base.get(row["store"])
        if row.get("skipped") or first is None:
            continue
        for field, ratio in (
            ("list_unfinished_ms", "list_unfinished_ratio"),
            ("status_total_ms", "status_ratio"),
            ("list_all_ms", "list_all_ratio"),
        ):
            if first[field] > 0:
                row[ratio] = row[field] / first[field]


# -- query plans --------------------------------------------------------------------------


def _plan(kind: str, where: str) -> str | None:
    """How the SQL store at ``where`` plans its own unfinished listing, as its planner
    sees it now (each step without its cost estimate: the plan's shape is what matters)."""
    if kind == "sqlite":
        from polyloop.stores._sql.sqlite.sql import LIST_UNFINISHED

        uri = f"{(Path(where) / 'runs.sqlite').as_uri()}?mode=ro"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
                found = conn.execute(f"EXPLAIN QUERY PLAN {LIST_UNFINISHED}").fetchall()
        except sqlite3.Error as exc:
            return f"not known ({exc})"
        return "; ".join(str(step[-1]) for step in found)
    if kind != "postgres":
        return None
    import psycopg
    from psycopg import sql

    from polyloop.stores._sql.postgres.sql import Queries

    conninfo, _, schema = where.partition("#")
    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            found = conn.execute(sql.SQL("EXPLAIN ") + Queries(schema).list_unfinished).fetchall()
    except psycopg.Error as exc:
        return f"not known ({exc})"
    return "; ".join(str(line[0]).split("  (cost")[0].strip() for line in found)
