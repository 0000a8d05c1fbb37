"""Benchmark 8: many concurrent runs of realistic shape, side by side with a hand-written
floor and with peers, in one process or in several sharing one database.

    python -m bench throughput --runs 100,1000
    python -m bench throughput --runs 10000 --stores memory,jsonl --nofile 1024
    python -m bench throughput --runs 1000 --backends asyncio \
        --stores hand,memory,pydantic-ai,sqlite,langgraph-sqlite,postgres,langgraph-postgres
    python -m bench throughput --runs 1000 --stores postgres --backends asyncio --workers 1,2
    python -m bench throughput --runs 1000 \
        --stores hand,hand-trajectory,memory,hand-sqlite,sqlite,hand-postgres,postgres

Every run makes ``--steps`` steps (10 by default); each step is a call to a model
client shared by all runs, which waits ``--latency-ms`` (200 by default, an
``anyio.sleep``, as a network call would) and answers a JSON tool call, then that
tool, which waits 10 ms and returns an observation of about 3 KB; the last step's tool
completes the run. The transcript grows with every observation (about 30 KB by the
last call). So the ideal wall time of a run, and of all runs at once, is
``steps x (latency + 10 ms)``: 2.1 s by default.

``--stores`` picks what runs the workload (``bench/workload.py``, ``bench/peers.py``):
PolyLoop on ``memory``, ``jsonl``, ``sqlite`` or ``postgres`` (the default: all four);
``hand``, the same work written by hand with no kernel and nothing durable (the floor:
what the event loop, JSON and validation cost by themselves), and ``hand-novalidate``,
the same without the JSON Schema check; ``hand-trajectory``, ``hand`` keeping the run's
trajectory as ``RunResult.steps`` does (a small object per step holding the model's
output, the action and the very observation the tool returned), the memory floor of a
loop that returns its trajectory; ``hand-sqlite`` and ``hand-postgres``,
``hand-trajectory`` made durable by hand (``bench/hand_durable.py``) in PolyLoop's write
order: per step an intent committed before the model call and one before the tool, the
model's reply, the tool's result and the step, each committed before the step goes on,
as JSON rows in one table, grouped into one transaction per moment by a worker thread
(the floor of durable work: what PolyLoop's durable stores are measured against);
``langgraph-sqlite`` and ``langgraph-postgres``,
a LangGraph graph with its async checkpointer; ``pydantic-ai``, a Pydantic AI agent (in
memory: it has no durable store). The peers run on asyncio only. Every cell counts the
model decisions and tool executions and fails if they are not runs x steps (the
durable floors also count the rows they committed, and fail if a row is missing).

Each (store, backend, number of runs, workers) cell runs in child processes of its own,
so its memory, descriptors and CPU time are its own: one child, or with ``--workers K``
K children that share the cell's database (``postgres`` or ``sqlite``), each driving its
share of the runs under run ids of its own. Every child opens its store and warms up,
then waits until all are ready, so they start together. ``--nofile`` lowers the
children's open-file limit first, and ``--lease-s`` sets the lease of the stores that
keep one (research record 0018: a process whose event loop stalls longer than its lease
loses its runs). Reported per cell:

* ``wall / ideal``: from the first ``run`` started (in any worker) to the last one
  returned, over the ideal above;
* steps per second: all workers' steps over that wall time;
* process CPU per step: user + system time of the processes (worker threads included)
  over the cell, summed over the workers, divided by the steps;
* event-loop lag: a ticker task in each process sleeps 10 ms again and again and notes
  how late it woke; p50, p99 and max over all samples;
* peak memory per run: each process's peak resident set (``VmHWM``) above its resident
  set just before the runs, summed, divided by the runs (C allocations included);
* peak open descriptors: the most entries ``/proc/self/fd`` had in one process.

Ratios and per-step figures, not absolute times, are what carry over between machines.
The goals of the throughput issue are checked against the table in
``docs/performance.md``; they are not asserted here.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from bench import peers
from bench._children import ROOT, ChildFailed, Children, child_command, meet, report
from bench._common import postgres_conninfo, postgres_schema
from bench._sampling import cpu_seconds, open_descriptors, resident_kib
from bench.hand_durable import hand_durable, rows_written
from bench.report import THROUGHPUT_COLUMNS, print_table
from bench.workload import Driver, HandWorkload, Workload, warm

TITLE = "8. Throughput: concurrent runs of realistic shape"


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
RESULTS = Path(__file__).resolve().parent / "results"


# -- the parent: one child per cell, or one per worker -----------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv_used = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv_used)
    if args.one:
        return _child(args)
    stores = [store for store in args.stores.split(",") if store]
    unknown = sorted(set(stores) - set(KINDS))
    if unknown:
        parser.error(f"unknown --stores {', '.join(unknown)} (known: {', '.join(KINDS)})")
    conninfo, pg_note = postgres_conninfo()
    worker_counts = _numbers(args.workers)
    if any(workers > 1 for workers in worker_counts) and any(
        not KINDS[store].shared for store in stores
    ):
        print("note: more than one worker applies to sqlite and postgres only", flush=True)
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
                        row.update(_cell(args, store, backend, count, workers, conninfo))
                    else:
                        row["skipped"] = reason
                    rows.append(row)
                    print_table(TITLE, THROUGHPUT_COLUMNS, rows[-1:])
                    _print_profile(row)
                    if reason is not None:
                        break  # the same reason for every number of workers
    print_table(TITLE, THROUGHPUT_COLUMNS, rows)
    output = Path(args.output) if args.output else RESULTS / "throughput.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "title": TITLE,
                "date": began.isoformat(timespec="seconds"),
                "command": " ".join(["python -m bench throughput", *argv_used]),
                "latency_ms": args.latency_ms,
                "steps": args.steps,
                "ideal_s": args.steps * (args.latency_ms / 1000 + TOOL_S),
                "nofile": args.nofile,
                "lease_s": args.lease_s,
                "gc_threshold": args.gc_threshold or None,
                "cpu_count": os.cpu_count(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten to {output}")
    return 0


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


def _cell(
    args: argparse.Namespace,
    store: str,
    backend: str,
    count: int,
    workers: int,
    conninfo: str | None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="polyloop-throughput-", dir=args.workdir) as scratch:
        if KINDS[store].postgres:
            assert conninfo is not None
            with postgres_schema(conninfo) as schema:
                where = f"{conninfo}#{schema}"
                return _spawn(args, store, backend, count, workers, where, Path(scratch))
        return _spawn(args, store, backend, count, workers, scratch, Path(scratch))


def _spawn(
    args: argparse.Namespace,
    store: str,
    backend: str,
    count: int,
    workers: int,
    where: str,
    scratch: Path,
) -> dict[str, Any]:
    """Start one child per worker, each with its share of the runs; once every child has
    opened its store and warmed up, signal them all to start; combine what they report."""
    shares = [count // workers + (index < count % workers) for index in range(workers)]
    meeting = scratch / "barrier"
    commands = [
        _child_command(args, store, backend, share, where, index, meeting)
        for index, share in enumerate(shares)
    ]
    try:
        with Children(meeting, commands) as children:
            if children.all_ready():
                children.go()
            parts = children.reports()
    except ChildFailed as failure:
        return {"skipped": f"the child failed: {failure}"}
    return _combine(parts, args)


def _child_command(
    args: argparse.Namespace,
    store: str,
    backend: str,
    count: int,
    where: str,
    worker: int,
    meeting: Path,
) -> list[str]:
    return child_command(
        "throughput",
        *("--one", store, backend, str(count), where),
        *("--worker", str(worker), "--barrier", str(meeting)),
        *("--latency-ms", str(args.latency_ms), "--steps", str(args.steps)),
        *("--nofile", str(args.nofile), "--lease-s", str(args.lease_s)),
        *("--gc-threshold", str(args.gc_threshold)),
        *(["--profile"] if args.profile else []),
    )


def _print_profile(row: dict[str, Any]) -> None:
    if row.get("profile"):
        print(f"\n{row['name']}, {row['runs']:,} runs: the event-loop thread's own time per file")
        for share, name in row["profile"]:
            print(f"  {share:5.1f}%  {name}")


def _combine(parts: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One row from the workers' reports: wall time from the first start to the last end,
    CPU summed over the processes, lag quantiles over every worker's samples."""
    runs = sum(part["runs"] for part in parts)
    steps = sum(part["tool_executions"] for part in parts)
    wall = max(part["ended"] for part in parts) - min(part["began"] for part in parts)
    cpu = sum(part["cpu_s"] for part in parts)
    lateness = sorted(sample for part in parts for sample in part["lateness_ms"])
    ideal = args.steps * (args.latency_ms / 1000 + TOOL_S)
    first = min(part["began"] for part in parts)
    return {
        "runs": runs,
        "workers": len(parts),
        "steps_per_run": args.steps,
        "wall_s": wall,
        "wall_over_ideal": wall / ideal,
        "steps_per_s": steps / wall,
        "cpu_us_per_step": cpu / max(steps, 1) * 1e6,
        "lag_p50_ms": _quantile(lateness, 0.50),
        "lag_p99_ms": _quantile(lateness, 0.99),
        "lag_max_ms": lateness[-1] if lateness else None,
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench throughput", description=__doc__.split("\n\n")[0]
    )
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
        help="lease of SqliteStore and PostgresStore (their default: 15 s)",
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
    parser.add_argument("--output", default=None, help="JSON results (bench/results/...)")
    parser.add_argument("--one", nargs=4, metavar=("STORE", "BACKEND", "RUNS", "WHERE"))
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    return parser


# -- the child: one worker of a cell -----------------------------------------------------


def _child(args: argparse.Namespace) -> int:
    store, backend, count, where = args.one
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    if args.gc_threshold:
        # A process holding thousands of runs collects its young objects often; a
        # larger threshold is the application's choice, measured here, never the
        # library's (it would change the whole process).
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    report(anyio.run(_measure, store, int(count), where, args, backend=backend))
    return 0


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


def _source_name(path: str) -> str:
    """A profiled file as the table names it: by package, never by where it lies."""
    if path == "~":
        return "built-in functions (C)"
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if path.startswith(str(ROOT) + "/"):
        return path[len(str(ROOT)) + 1 :].removeprefix("src/")
    if "/lib/python3" in path:
        return path.rsplit("/lib/python3", 1)[1].lstrip("0123456789.").lstrip("/")
    return Path(path).name


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
        name = _source_name(path)
        by_file[name] = by_file.get(name, 0.0) + row[2]
    busy = sum(by_file.values()) or 1.0
    top = sorted(by_file.items(), key=lambda item: -item[1])[:PROFILE_ROWS]
    return [[round(seconds / busy * 100, 1), name] for name, seconds in top]


def _open_store(kind: str, where: str, lease_s: float) -> Any:
    from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore

    if kind == "memory":
        return MemoryStore()
    if kind == "jsonl":
        return JsonlStore(Path(where) / "runs")
    if kind == "sqlite":
        return SqliteStore(Path(where) / "runs.sqlite")
    conninfo, _, schema = where.partition("#")
    return PostgresStore(conninfo, schema=schema, lease_s=lease_s)


@asynccontextmanager
async def _open_driver(kind: str, where: str, args: argparse.Namespace) -> AsyncIterator[Driver]:
    """The cell's runs: PolyLoop on a store, the hand-written floor, or a peer."""
    sizes: dict[str, Any] = {
        "steps": args.steps,
        "latency_s": args.latency_ms / 1000,
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
        async with _open_store(kind, where, args.lease_s) as store:
            yield Workload(store, **sizes)


async def _measure(kind: str, count: int, where: str, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps
    lateness: list[float] = []
    peak_fds = 0
    errors: list[str] = []
    prefix = f"w{args.worker}"  # run ids of their own for workers sharing a database
    async with _open_driver(kind, where, args) as driver:
        await warm(driver, f"warm-{prefix}")
        await meet(args.barrier, args.worker)

        async def one(index: int) -> None:
            try:
                await driver.run(f"run-{prefix}-{index}")
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

        async def ticker() -> None:
            nonlocal peak_fds
            while True:
                asked = time.perf_counter()
                await anyio.sleep(TICK_S)
                lateness.append(time.perf_counter() - asked - TICK_S)
                peak_fds = max(peak_fds, open_descriptors())

        base_rss = resident_kib("VmRSS")
        cpu_before = cpu_seconds()
        # The monotonic clock is the system's, so workers' times compare.
        began = time.monotonic()
        profiler = cProfile.Profile() if args.profile else None
        async with anyio.create_task_group() as outer:
            outer.start_soon(ticker)
            if profiler is not None:
                profiler.enable()
            async with anyio.create_task_group() as group:
                for index in range(count):
                    group.start_soon(one, index)
            if profiler is not None:
                profiler.disable()
            ended = time.monotonic()
            cpu = cpu_seconds() - cpu_before
            outer.cancel_scope.cancel()
        peak_rss = resident_kib("VmHWM")
    counts = driver.counts
    if not errors and (counts.decisions, counts.executions) != (count * steps, count * steps):
        raise AssertionError(
            f"{kind}: {counts.decisions} model decisions and {counts.executions} tool "
            f"executions for {count} runs of {steps} steps"
        )
    if not errors and kind in DURABLE_FLOORS and counts.rows != rows_written(count, steps):
        raise AssertionError(
            f"{kind}: {counts.rows} rows committed for {count} runs of {steps} steps"
        )
    return {
        "runs": count,
        "began": began,
        "ended": ended,
        "cpu_s": cpu,
        "decisions": counts.decisions,
        "tool_executions": counts.executions,
        "rows": counts.rows,
        "lateness_ms": [round(late * 1000, 3) for late in lateness],
        "peak_kib": max(peak_rss - base_rss, 0),
        "peak_fds": peak_fds,
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "gc_threshold": gc.get_threshold()[0],
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
        **({"profile": _shares(pstats.Stats(profiler))} if profiler is not None else {}),
    }


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1]
