"""Benchmark 8: many concurrent runs of realistic shape, in one process.

    python bench/throughput.py --runs 100,1000
    python bench/throughput.py --runs 10000 --stores memory,jsonl --nofile 1024

Every run makes ``--steps`` steps (10 by default); each step is a call to a model
client shared by all runs, which waits ``--latency-ms`` (200 by default, an
``anyio.sleep``, as a network call would) and answers a JSON tool call, then that
tool, which waits 10 ms and returns an observation of about 3 KB; the last step's tool
completes the run. The transcript grows with every observation (about 30 KB by the
last call). So the ideal wall time of a run, and of all runs at once, is
``steps x (latency + 10 ms)``: 2.1 s by default.

Each (store, backend, number of runs) cell runs in a child process of its own, so its
memory, descriptors and CPU time are its own; ``--nofile`` lowers the child's open-file
limit first, and ``--lease-s`` sets the lease of the stores that keep one (research
record 0018: a process whose event loop stalls longer than its lease loses its runs).
Reported per cell:

* ``wall / ideal``: from the first ``run`` started to the last one returned, over the
  ideal above;
* steps per second;
* process CPU per step: user + system time of the whole process (worker threads
  included) over the cell, divided by the steps;
* event-loop lag: a ticker task sleeps 10 ms again and again and notes how late it
  woke; p50, p99 and max;
* peak memory per run: the process's peak resident set (``VmHWM``) above its resident
  set just before the runs, divided by the runs (C allocations included);
* peak open descriptors: the most entries ``/proc/self/fd`` had during the cell.

Ratios and per-step figures, not absolute times, are what carry over between machines.
The goals of the throughput issue are checked against the table in
``docs/performance.md``; they are not asserted here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    # Run as a script: import the benchmarks as the package ``bench`` (see run.py).
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from bench._common import postgres_conninfo, postgres_schema, print_table  # noqa: E402

TITLE = "8. Throughput: concurrent runs of realistic shape in one process"
COLUMNS = [
    ("name", "backend / store"),
    ("runs", "runs"),
    ("wall_s", "wall s", 2),
    ("wall_over_ideal", "wall / ideal", 2),
    ("steps_per_s", "steps/s"),
    ("cpu_us_per_step", "CPU us/step"),
    ("lag_p50_ms", "lag p50 ms", 1),
    ("lag_p99_ms", "lag p99 ms", 1),
    ("lag_max_ms", "lag max ms", 1),
    ("peak_kib_per_run", "peak KiB/run"),
    ("peak_fds", "peak fds"),
    ("errors", "errors"),
]
STORES = ("memory", "jsonl", "sqlite", "postgres")
STORE_NAMES = {
    "memory": "MemoryStore",
    "jsonl": "JsonlStore",
    "sqlite": "SqliteStore",
    "postgres": "PostgresStore",
}
TOOL_S = 0.010
TICK_S = 0.010
OBSERVATION_CHARS = 3_000
RESULTS = Path(__file__).resolve().parent / "results"


# -- the parent: one child per cell ------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.one:
        return _child(args)
    conninfo, pg_note = postgres_conninfo()
    rows: list[dict[str, Any]] = []
    began = datetime.datetime.now(datetime.UTC)
    for count in _numbers(args.runs):
        for store in args.stores.split(","):
            for backend in args.backends.split(","):
                name = f"{backend} / {STORE_NAMES[store]}"
                if store == "postgres" and conninfo is None:
                    rows.append({"name": name, "runs": count, "skipped": pg_note})
                    continue
                row = _cell(args, store, backend, count, conninfo)
                rows.append({"name": name, **row})
                print_table(TITLE, COLUMNS, rows[-1:])
    print_table(TITLE, COLUMNS, rows)
    output = Path(args.output) if args.output else RESULTS / "throughput.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "title": TITLE,
                "date": began.isoformat(timespec="seconds"),
                "command": " ".join(["python", "bench/throughput.py", *sys.argv[1:]]),
                "latency_ms": args.latency_ms,
                "steps": args.steps,
                "ideal_s": args.steps * (args.latency_ms / 1000 + TOOL_S),
                "nofile": args.nofile,
                "lease_s": args.lease_s,
                "cpu_count": os.cpu_count(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten to {output}")
    return 0


def _cell(
    args: argparse.Namespace, store: str, backend: str, count: int, conninfo: str | None
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="polyloop-throughput-", dir=args.workdir) as scratch:
        if store == "postgres":
            assert conninfo is not None
            with postgres_schema(conninfo) as schema:
                return _spawn(args, store, backend, count, f"{conninfo}#{schema}")
        return _spawn(args, store, backend, count, scratch)


def _spawn(
    args: argparse.Namespace, store: str, backend: str, count: int, where: str
) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        store,
        backend,
        str(count),
        where,
        "--latency-ms",
        str(args.latency_ms),
        "--steps",
        str(args.steps),
        "--nofile",
        str(args.nofile),
        "--lease-s",
        str(args.lease_s),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"runs": count, "skipped": f"the child failed: {last}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _numbers(text: str) -> list[int]:
    return [int(part.replace("_", "")) for part in text.split(",") if part]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="100,1000", help="numbers of concurrent runs")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--backends", default="asyncio,trio")
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
    parser.add_argument("--workdir", default=None, help="where the durable stores write")
    parser.add_argument("--output", default=None, help="JSON results (bench/results/...)")
    parser.add_argument("--one", nargs=4, metavar=("STORE", "BACKEND", "RUNS", "WHERE"))
    return parser


# -- the child: one cell -----------------------------------------------------------------


def _child(args: argparse.Namespace) -> int:
    store, backend, count, where = args.one
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    row = anyio.run(_measure, store, int(count), where, args, backend=backend)
    print(json.dumps(row), flush=True)
    return 0


def _open_store(kind: str, where: str, lease_s: float) -> Any:
    from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore

    if kind == "memory":
        return MemoryStore()
    if kind == "jsonl":
        return JsonlStore(Path(where) / "runs")
    if kind == "sqlite":
        return SqliteStore(Path(where) / "runs.sqlite", lease_s=lease_s)
    conninfo, _, schema = where.partition("#")
    return PostgresStore(conninfo, schema=schema, lease_s=lease_s)


async def _measure(kind: str, count: int, where: str, args: argparse.Namespace) -> dict[str, Any]:
    from bench.workload import Workload

    steps, latency_s = args.steps, args.latency_ms / 1000
    ideal = steps * (latency_s + TOOL_S)
    lateness: list[float] = []
    peak_fds = 0
    errors: list[str] = []
    async with _open_store(kind, where, args.lease_s) as store:
        workload = Workload(store, steps=steps, latency_s=latency_s, tool_s=TOOL_S)
        await workload.warm()

        async def one(index: int) -> None:
            try:
                await workload.run(f"run-{index}")
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{type(exc).__name__}: {exc}")

        async def ticker() -> None:
            nonlocal peak_fds
            while True:
                asked = time.perf_counter()
                await anyio.sleep(TICK_S)
                lateness.append(time.perf_counter() - asked - TICK_S)
                peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")) - 1)

        base_rss = _status_kib("VmRSS")
        cpu_before = _cpu_s()
        began = time.perf_counter()
        async with anyio.create_task_group() as outer:
            outer.start_soon(ticker)
            async with anyio.create_task_group() as group:
                for index in range(count):
                    group.start_soon(one, index)
            wall = time.perf_counter() - began
            cpu = _cpu_s() - cpu_before
            outer.cancel_scope.cancel()
        peak_rss = _status_kib("VmHWM")
    done_steps = workload.steps_done
    lateness.sort()
    return {
        "runs": count,
        "steps_per_run": steps,
        "wall_s": wall,
        "wall_over_ideal": wall / ideal,
        "steps_per_s": done_steps / wall,
        "cpu_us_per_step": cpu / max(done_steps, 1) * 1e6,
        "lag_p50_ms": _quantile(lateness, 0.50) * 1000,
        "lag_p99_ms": _quantile(lateness, 0.99) * 1000,
        "lag_max_ms": lateness[-1] * 1000 if lateness else None,
        "peak_kib_per_run": max(peak_rss - base_rss, 0) / count,
        "peak_fds": peak_fds,
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "errors": len(errors),
        "first_errors": sorted(set(errors))[:3],
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1]


if __name__ == "__main__":
    raise SystemExit(main())
