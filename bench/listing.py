"""Benchmark 6: do listing and status cost the same with many finished runs in the store?

A program that watches a store (or calls ``recover`` on start-up) asks for the unfinished
runs and the status of each. Finished runs pile up over a store's life, so those two
questions should cost what the unfinished runs cost, whatever the history holds.

For each store two copies are built, through the store's own API (``run``, many runs at
once): one holding ``unfinished`` runs only, one holding the same unfinished runs spread
evenly among ``finished`` finished ones, as in a store that has been in use for a while.
A finished run is a whole run of one decision (a final answer). An unfinished run did
one tool step and then its process "died": a :class:`~polyloop.testing.FaultyStore`
refuses every write after the step, so no end record is written and the claim is given
up, which leaves the run resumable and unclaimed.

Measured on each copy, the two copies interleaved round-robin (the order reversed every
other round, one unrecorded pass each first): ``list_runs(unfinished_only=True)``,
``run_status`` of every unfinished run one after the other (total, and per run), and
``list_runs()`` of everything. Every pass checks what it got: the number of runs listed,
and that every status says resumable after one step.

Reported per store: the times, and each time with finished runs divided by the time
without (flat is about 1.0). The query plan each SQL store uses for the unfinished
listing is noted, since it decides whether finished rows are read at all.

Targets: on SQLite and PostgreSQL, the unfinished listing and the statuses stay within
1.5x of the store without finished runs. JSONL reads every file of the directory to list
(and MemoryStore walks every run it holds), so their listings are expected to grow; the
ratios say by how much.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from bench._common import (
    QUICK,
    TINY,
    Context,
    Row,
    median,
    now,
    postgres_schema,
    settle,
    skipped,
    target,
)
from bench.agents import Agent
from polyloop import RunState, run_status
from polyloop.stores import JsonlStore, MemoryStore, SqliteStore
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
STORE_NAMES = {
    "memory": "MemoryStore",
    "jsonl": "JsonlStore",
    "sqlite": "SqliteStore",
    "postgres": "PostgresStore",
}
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


def sizes_for(ctx: Context) -> ListingSizes:
    # The shared Sizes say which mode this is; this benchmark's own sizes stay here.
    if ctx.sizes == TINY:
        return TINY_SIZES
    return QUICK_SIZES if ctx.sizes == QUICK else FULL_SIZES


def run(ctx: Context) -> dict[str, Any]:
    sizes = sizes_for(ctx)
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
        if kind == "postgres" and ctx.postgres is None:
            for f, name in zip(sizes.finished, names, strict=True):
                rows.append(
                    skipped(
                        {"key": f"{kind}-{f}", "store": kind, "finished": f, "name": name},
                        ctx.postgres_note or "no PostgreSQL",
                    )
                )
            continue
        with contextlib.ExitStack() as schemas:
            async with contextlib.AsyncExitStack() as stack:
                copies = []
                for f in sizes.finished:
                    store, explain = await _open(ctx, kind, stack, schemas)
                    began = now()
                    await _fill(store, sizes.unfinished, f)
                    ctx.say(
                        f"    {STORE_NAMES[kind]}: built {sizes.unfinished:,} unfinished "
                        f"+ {f:,} finished runs in {now() - began:.1f} s"
                    )
                    copies.append((store, explain, f))
                measured = await _interleave(
                    [(s, f) for s, _, f in copies], sizes.unfinished, sizes.repeats
                )
                for (_, _, f), times, name in zip(copies, measured, names, strict=True):
                    rows.append(_row(kind, f, name, sizes.unfinished, times))
                _, explain, f = copies[-1]
                plan = explain()
                if plan is not None:
                    notes.append(
                        f"{STORE_NAMES[kind]} plans the unfinished listing "
                        f"({f:,} finished runs) as: {plan}"
                    )
    _ratios(rows)
    return rows, notes


async def _open(
    ctx: Context, kind: str, stack: contextlib.AsyncExitStack, schemas: contextlib.ExitStack
) -> tuple[Any, Callable[[], str | None]]:
    """A new, empty store of ``kind``, and how to ask its planner about the listing."""
    if kind == "memory":
        return MemoryStore(), lambda: None  # closing it would throw its runs away
    if kind == "jsonl":
        return await stack.enter_async_context(
            JsonlStore(ctx.scratch("listing-jsonl"))
        ), lambda: None
    if kind == "sqlite":
        path = ctx.scratch("listing-sqlite") / "runs.sqlite"
        return await stack.enter_async_context(SqliteStore(path)), lambda: _sqlite_plan(path)
    from polyloop.stores import PostgresStore

    assert ctx.postgres is not None
    conninfo = ctx.postgres
    schema = schemas.enter_context(postgres_schema(conninfo))
    store = await stack.enter_async_context(PostgresStore(conninfo, schema=schema))
    return store, lambda: _postgres_plan(conninfo, schema)


# -- building a store ---------------------------------------------------------------------


async def _fill(store: Any, unfinished: int, finished: int) -> None:
    """Write the runs through the store's own API, ``BUILDERS`` at a time.

    The unfinished runs are spread evenly among the finished ones, in start order.
    """
    total = unfinished + finished
    marks = {i * total // unfinished for i in range(unfinished)}
    jobs: list[Callable[[], Awaitable[None]]] = []
    counts = {"unfinished": 0, "finished": 0}  # the same ids in every copy of a store
    for n in range(total):
        kind = "unfinished" if n in marks else "finished"
        run_id = f"{kind}-{counts[kind]:06d}"
        counts[kind] += 1
        jobs.append(_unfinished_job(store, run_id) if n in marks else _finished_job(store, run_id))
    pending = iter(jobs)

    async def builder() -> None:
        for job in pending:  # shared: each job is taken by one builder, in order
            await job()

    async with anyio.create_task_group() as group:
        for _ in range(min(BUILDERS, total)):
            group.start_soon(builder)


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
    """Time each copy ``repeats`` times, round-robin, after one unrecorded pass each."""
    times = [_Times([], [], []) for _ in copies]
    for store, finished in copies:
        await _pass(store, unfinished, finished)  # warm-up
    indexed = list(enumerate(copies))
    for round_ in range(repeats):
        for index, (store, finished) in indexed if round_ % 2 == 0 else indexed[::-1]:
            one = await _pass(store, unfinished, finished)
            times[index].list_unfinished.append(one[0])
            times[index].statuses.append(one[1])
            times[index].list_all.append(one[2])
    return times


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


def _sqlite_plan(path: Path) -> str | None:
    """SQLite's plan for the store's own unfinished listing, on a read-only connection."""
    from polyloop.stores._sql.sqlite.sql import LIST_UNFINISHED

    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
            found = conn.execute(f"EXPLAIN QUERY PLAN {LIST_UNFINISHED}").fetchall()
    except sqlite3.Error as exc:
        return f"not known ({exc})"
    return "; ".join(str(step[-1]) for step in found)


def _postgres_plan(conninfo: str, schema: str) -> str | None:
    """PostgreSQL's plan for the store's own unfinished listing, as the planner sees it now."""
    import psycopg
    from psycopg import sql

    from polyloop.stores._sql.postgres.sql import Queries

    query = sql.SQL("EXPLAIN ") + Queries(schema).list_unfinished
    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            found = conn.execute(query).fetchall()
    except psycopg.Error as exc:
        return f"not known ({exc})"
    # Each line without its cost estimate: the plan's shape is what matters here.
    return "; ".join(str(line[0]).split("  (cost")[0].strip() for line in found)
