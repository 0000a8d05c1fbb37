"""Benchmark 8: many concurrent runs of realistic shape, side by side with hand-written
floors and with peers, in one process or in several sharing one database.

Each cell (store, backend, number of runs, workers) runs in child processes of its own,
so that its memory, descriptors and CPU time are its own. The workload, the floors, the
peers and what each column means: ``bench/README.md``, benchmark 8.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import os
import pstats
import resource
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio

from bench import peers
from bench._children import ChildFailed, Children, child_command, meet
from bench._common import each, new_store, postgres_conninfo, postgres_schema
from bench._sampling import (
    beside_ticker,
    cpu_seconds,
    lateness_ms,
    open_descriptors,
    resident_kib,
    source_name,
)
from bench.hand_durable import hand_durable, rows_written
from bench.report import THROUGHPUT_COLUMNS, print_table, profile_table
from bench.workload import Driver, HandWorkload, Workload, warm

TITLE = "8. Throughput: concurrent runs of realistic shape"
OUTPUT = Path(__file__).resolve().parent / "results" / "throughput.json"


@dataclass(frozen=True)
class Kind:
    """What a ``--stores`` entry runs, and where it can run."""

    name: str  # as the table shows it
    postgres: bool = False  # needs the server, and a schema of its own
    shared: bool = False  # several worker processes can share it (``--workers``)
    asyncio_only: bool = False
    missing: Callable[[], str | None] | None = None  # why it cannot run, if it cannot


KINDS = {
    "hand": Kind("hand-written"),
    "hand-novalidate": Kind("hand-written, no validation"),
    "hand-trajectory": Kind("hand-written, trajectory"),
    "hand-sqlite": Kind("hand-written, trajectory, SQLite"),
    "hand-postgres": Kind("hand-written, trajectory, PostgreSQL", postgres=True),
    "memory": Kind("MemoryStore"),
    "jsonl": Kind("JsonlStore"),
    "sqlite": Kind("SqliteStore", shared=True),
    "postgres": Kind("PostgresStore", postgres=True, shared=True),
    "langgraph-sqlite": Kind(
        "LangGraph + AsyncSqliteSaver", asyncio_only=True, missing=peers.langgraph_sqlite_missing
    ),
    "langgraph-postgres": Kind(
        "LangGraph + AsyncPostgresSaver",
        postgres=True,
        asyncio_only=True,
        missing=peers.langgraph_postgres_missing,
    ),
    "pydantic-ai": Kind(
        "Pydantic AI (in memory)", asyncio_only=True, missing=peers.pydantic_ai_missing
    ),
}
STORES = ("memory", "jsonl", "sqlite", "postgres")  # the default: PolyLoop's stores
DURABLE_FLOORS = ("hand-sqlite", "hand-postgres")  # they count the rows they commit
TOOL_S = 0.010
TICK_S = 0.010
PROFILE_ROWS = 15


@dataclass(frozen=True)
class Cell:
    """What one child process measures: its share of a cell's runs, and how (the spec a
    parent sends its child)."""

    store: str
    backend: str
    runs: int
    where: str  # the store's directory, or ``conninfo#schema``
    steps: int = 10
    latency_ms: float = 200.0
    nofile: int = 0
    lease_s: float = 15.0
    gc_threshold: int = 0
    profile: bool = False
    worker: int = 0
    meeting: str | None = None

    @property
    def ideal_s(self) -> float:
        return self.steps * (self.latency_ms / 1000 + TOOL_S)


def options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--runs", default="100,1000", help="numbers of concurrent runs")
    parser.add_argument("--stores", default=",".join(STORES), help=f"any of {', '.join(KINDS)}")
    parser.add_argument("--backends", default="asyncio,trio")
    parser.add_argument(
        "--workers",
        default="1",
        help="numbers of worker processes sharing the runs and one database (1,2: both)",
    )
    parser.add_argument("--latency-ms", type=float, default=200.0, help="model latency")
    parser.add_argument("--steps", type=int, default=10, help="steps (tool calls) per run")
    parser.add_argument(
        "--nofile", type=int, default=0, help="the children's open-file limit (0: unchanged)"
    )
    parser.add_argument(
        "--lease-s",
        type=float,
        default=15.0,
        help="the lease of PostgresStore (its default: 15 s)",
    )
    parser.add_argument(
        "--gc-threshold",
        type=int,
        default=0,
        help="the children's first-generation garbage-collection threshold (0: Python's)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile each cell's event-loop thread (cProfile) and print its shares per file",
    )
    parser.add_argument("--workdir", default=None, help="where the durable stores write")


# -- the parent: one child per cell, or one per worker -----------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    stores = [store for store in args.stores.split(",") if store]
    unknown = sorted(set(stores) - set(KINDS))
    if unknown:
        raise SystemExit(f"unknown --stores {', '.join(unknown)} (known: {', '.join(KINDS)})")
    conninfo, pg_note = postgres_conninfo()
    worker_counts = _numbers(args.workers)
    if any(workers > 1 for workers in worker_counts) and any(
        not KINDS[store].shared for store in stores
    ):
        print("note: more than one worker applies to sqlite and postgres only", flush=True)
    # What every cell of the command shares; each fills in its store, backend and runs.
    settings = Cell(
        store="",
        backend="",
        runs=0,
        where="",
        steps=args.steps,
        latency_ms=args.latency_ms,
        nofile=args.nofile,
        lease_s=args.lease_s,
        gc_threshold=args.gc_threshold,
        profile=args.profile,
    )
    rows: list[dict[str, Any]] = []
    began = datetime.datetime.now(datetime.UTC)
    for count in _numbers(args.runs):
        for store in stores:
            kind = KINDS[store]
            for backend in args.backends.split(","):
                reason = _why_not(kind, backend, conninfo, pg_note)
                for workers in worker_counts if kind.shared else [1]:
                    row: dict[str, Any] = {
                        "name": f"{backend} / {kind.name}",
                        "store": store,
                        "backend": backend,
                        "runs": count,
                        "workers": workers,
                    }
                    if reason is None and workers > count:
                        row["skipped"] = "fewer runs than worker processes"
                    elif reason is None:
                        cell = replace(settings, store=store, backend=backend, runs=count)
                        row.update(_cell(cell, workers, conninfo, args.workdir))
                    else:
                        row["skipped"] = reason
                    rows.append(row)
                    print_table(TITLE, THROUGHPUT_COLUMNS, rows[-1:])
                    if row.get("profile"):
                        print_table(
                            f"{row['name']}, {count:,} runs: the event-loop thread's own time",
                            *profile_table([row]),
                        )
                    if reason is not None:
                        break  # the same reason for every number of workers
    return {
        "title": TITLE,
        "date": began.isoformat(timespec="seconds"),
        "command": args.command,
        "latency_ms": args.latency_ms,
        "steps": args.steps,
        "ideal_s": settings.ideal_s,
        "nofile": args.nofile,
        "lease_s": args.lease_s,
        "gc_threshold": args.gc_threshold or None,
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }


def _why_not(kind: Kind, backend: str, conninfo: str | None, pg_note: str | None) -> str | None:
    """Why a store's cells cannot run here, or ``None``."""
    if kind.asyncio_only and backend != "asyncio":
        return "LangGraph and Pydantic AI run on asyncio only"
    problem = kind.missing() if kind.missing else None
    if problem is not None:
        return problem
    if kind.postgres and conninfo is None:
        return pg_note
    return None


def _cell(cell: Cell, workers: int, conninfo: str | None, workdir: str | None) -> dict[str, Any]:
    """Start one child per worker, each with its share of the runs; once every child has
    opened its store and warmed up, signal them all to start; combine what they report."""
    shares = [cell.runs // workers + (index < cell.runs % workers) for index in range(workers)]
    with (
        tempfile.TemporaryDirectory(prefix="polyloop-throughput-", dir=workdir) as scratch,
        contextlib.ExitStack() as stack,
    ):
        if KINDS[cell.store].postgres:
            assert conninfo is not None
            where = f"{conninfo}#{stack.enter_context(postgres_schema(conninfo))}"
        else:
            where = str(Path(scratch) / "store")
            Path(where).mkdir()
        meeting = Path(scratch) / "meeting"
        parts = [
            replace(cell, runs=share, where=where, worker=index, meeting=str(meeting))
            for index, share in enumerate(shares)
        ]
        try:
            with Children(meeting, [child_command("throughput", p) for p in parts]) as children:
                if children.all_ready():
                    children.go()
                reports = children.reports()
        except ChildFailed as failure:
            return {"skipped": f"the child failed: {failure}"}
    return _combine(reports, cell)


def _combine(parts: list[dict[str, Any]], cell: Cell) -> dict[str, Any]:
    """One row from the workers' reports: wall time from the first start to the last end,
    CPU summed over the processes, lag quantiles over every worker's samples."""
    runs = sum(part["runs"] for part in parts)
    steps = sum(part["tool_executions"] for part in parts)
    first = min(part["began"] for part in parts)
    wall = max(part["ended"] for part in parts) - first
    cpu = sum(part["cpu_s"] for part in parts)
    return {
        "runs": runs,
        "workers": len(parts),
        "steps_per_run": cell.steps,
        "wall_s": wall,
        "wall_over_ideal": wall / cell.ideal_s,
        "steps_per_s": steps / wall,
        "cpu_us_per_step": cpu / max(steps, 1) * 1e6,
        **lateness_ms([late for part in parts for late in part["lateness_ms"]], "lag_"),
        "peak_kib_per_run": sum(part["peak_kib"] for part in parts) / max(runs, 1),
        "peak_fds": max(part["peak_fds"] for part in parts),
        "nofile": parts[0]["nofile"],
        "gc_threshold": parts[0]["gc_threshold"],
        "decisions": sum(part["decisions"] for part in parts),
        "tool_executions": steps,
        "rows": sum(part.get("rows", 0) for part in parts),
        "errors": sum(part["errors"] for part in parts),
        "first_errors": sorted({e for part in parts for e in part["first_errors"]})[:3],
        # The first worker's profile, if one was asked for (--profile).
        **({"profile": parts[0]["profile"]} if "profile" in parts[0] else {}),
        # Each worker's own window and CPU, to see whether they overlapped.
        "per_worker": [
            {
                "runs": part["runs"],
                "start_s": part["began"] - first,
                "wall_s": part["ended"] - part["began"],
                "cpu_s": part["cpu_s"],
            }
            for part in parts
        ],
    }


def _numbers(text: str) -> list[int]:
    return [int(part.replace("_", "")) for part in text.split(",") if part]


# -- the child: one worker of a cell -----------------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    cell = Cell(**spec)
    if cell.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (cell.nofile, cell.nofile))
    if cell.gc_threshold:
        # A process holding thousands of runs collects its young objects often; a
        # larger threshold is the application's choice, measured here, never the
        # library's (it would change the whole process).
        gc.set_threshold(cell.gc_threshold, *gc.get_threshold()[1:])
    result: dict[str, Any] = anyio.run(measure, cell, backend=cell.backend)
    return result


# Waiting for something to do, and the profiler's own switch (the time from enabling
# it to disabling it is booked to that call): not work of the loop.
_NOT_WORK = frozenset(
    (
        "<method 'poll' of 'select.epoll' objects>",
        "<built-in method select.select>",
        "<method 'enable' of '_lsprof.Profiler' objects>",
        "<method 'disable' of '_lsprof.Profiler' objects>",
    )
)


def _shares(stats: pstats.Stats) -> list[list[Any]]:
    """The event-loop thread's own time per source file, as shares of its busy time.

    cProfile sees only the thread it runs in (worker threads are not in it) and slows
    every Python call, so these are shares of the loop's work, not durations. Time
    waiting in ``epoll``/``select`` for something to do is left out; a built-in that
    lets go of the interpreter lock (a socket read, a directory listing) is charged
    the wait to take it back while worker threads run Python code.
    """
    by_file: dict[str, float] = {}
    for (path, _, function), row in stats.stats.items():  # type: ignore[attr-defined]
        if function in _NOT_WORK:
            continue
        name = source_name(path)
        by_file[name] = by_file.get(name, 0.0) + row[2]
    busy = sum(by_file.values()) or 1.0
    top = sorted(by_file.items(), key=lambda item: -item[1])[:PROFILE_ROWS]
    return [[round(seconds / busy * 100, 1), name] for name, seconds in top]


@asynccontextmanager
async def _open_driver(cell: Cell) -> AsyncIterator[Driver]:
    """The cell's runs: PolyLoop on a store, the hand-written floor, or a peer."""
    kind, where = cell.store, cell.where
    sizes: dict[str, Any] = {
        "steps": cell.steps,
        "latency_s": cell.latency_ms / 1000,
        "tool_s": TOOL_S,
    }
    if kind in ("hand", "hand-novalidate", "hand-trajectory"):
        yield HandWorkload(
            **sizes, validate=kind != "hand-novalidate", trajectory=kind == "hand-trajectory"
        )
    elif kind in DURABLE_FLOORS:
        async with hand_durable(kind.removeprefix("hand-"), where, **sizes) as driver:
            yield driver
    elif kind == "pydantic-ai":
        yield peers.PydanticAIWorkload(**sizes)
    elif kind.startswith("langgraph-"):
        checkpointer = kind.removeprefix("langgraph-")
        async with peers.langgraph_workload(checkpointer, where, **sizes) as driver:
            yield driver
    else:
        leased = {"lease_s": cell.lease_s} if kind == "postgres" else {}
        async with new_store(kind, where, **leased) as store:
            yield Workload(store, **sizes)


async def measure(cell: Cell) -> dict[str, Any]:
    """Drive the cell's runs once every worker is ready; what this process measured."""
    errors: list[str] = []
    peak_fds = 0
    prefix = f"w{cell.worker}"  # run ids of their own for workers sharing a database
    async with _open_driver(cell) as driver:
        await warm(driver, f"warm-{prefix}")
        await meet(cell.meeting, cell.worker)

        async def one(index: int) -> None:
            try:
                await driver.run(f"run-{prefix}-{index}")
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

        def count_descriptors() -> None:
            nonlocal peak_fds
            peak_fds = max(peak_fds, open_descriptors())

        async def runs() -> tuple[float, float, float]:
            cpu_before = cpu_seconds()
            # The monotonic clock is the system's, so workers' times compare.
            began = time.monotonic()
            if profiler is not None:
                profiler.enable()
            await each(cell.runs, one)
            if profiler is not None:
                profiler.disable()
            return began, time.monotonic(), cpu_seconds() - cpu_before

        base_rss = resident_kib("VmRSS")
        profiler = cProfile.Profile() if cell.profile else None
        (began, ended, cpu), ticker = await beside_ticker(runs, TICK_S, count_descriptors)
        peak_rss = resident_kib("VmHWM")
    counts, steps, count = driver.counts, cell.steps, cell.runs
    if not errors and (counts.decisions, counts.executions) != (count * steps, count * steps):
        raise AssertionError(
            f"{cell.store}: {counts.decisions} model decisions and {counts.executions} tool "
            f"executions for {count} runs of {steps} steps"
        )
    if not errors and cell.store in DURABLE_FLOORS and counts.rows != rows_written(count, steps):
        raise AssertionError(
            f"{cell.store}: {counts.rows} rows committed for {count} runs of {steps} steps"
        )
    return {
        "runs": count,
        "began": began,
        "ended": ended,
        "cpu_s": cpu,
        "decisions": counts.decisions,
        "tool_executions": counts.executions,
        "rows": counts.rows,
        "lateness_ms": [round(late * 1000, 3) for late in ticker.lateness_s],
        "peak_kib": max(peak_rss - base_rss, 0),
        "peak_fds": peak_fds,
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "gc_threshold": gc.get_threshold()[0],
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        **({"profile": _shares(pstats.Stats(profiler))} if profiler is not None else {}),
    }
