"""Benchmarks 1-7 and 10 in one process run, written to one results file.

    python -m bench suite                 # everything, full sizes
    python -m bench suite --quick         # everything, smaller sizes (under two minutes)
    python -m bench suite --only overhead,durable
    python -m bench overhead --profile    # one of them: the same options

Each of them is a module with ``run(ctx)``, which measures and returns its table. See
``bench/README.md`` for what each measures and how to read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import concurrency, console, durable, lag, listing, overhead, recovery, scale
from bench._common import (
    FULL,
    QUICK,
    TINY,
    Context,
    collect_between_measurements,
    postgres_conninfo,
    versions,
)
from bench.report import print_table, target_line, write_results

BENCHMARKS = {
    "overhead": overhead,
    "durable": durable,
    "concurrency": concurrency,
    "recovery": recovery,
    "scale": scale,
    "listing": listing,
    "lag": lag,
    "console": console,
}
OUTPUT = Path(__file__).resolve().parent / "results" / "latest.json"


def options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repeats (under two minutes)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="next to no work: runs every code path in seconds, measures "
        "nothing meaningful (the smoke test uses it)",
    )
    if name == "suite":
        parser.add_argument(
            "--only", default="", help=f"comma-separated benchmarks to run: {','.join(BENCHMARKS)}"
        )
        parser.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    parser.add_argument(
        "--workdir",
        default=None,
        help="directory for the scratch files (default: the system's "
        "temporary directory); the fsync floor is measured there too",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile PolyLoop's step (cProfile) and print the hot spots",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmarks chosen, rewriting the results file after each."""
    selected = _selected(args) if args.benchmark == "suite" else [args.benchmark]
    sizes = TINY if args.tiny else QUICK if args.quick else FULL
    collect_between_measurements(not args.tiny)
    workdir = Path(tempfile.mkdtemp(prefix="polyloop-bench-", dir=args.workdir))
    conninfo, pg_note = postgres_conninfo()
    ctx = Context(sizes=sizes, workdir=workdir, postgres=conninfo, postgres_note=pg_note)
    if pg_note:
        ctx.note(f"PostgresStore rows are skipped: {pg_note}")
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "mode": "tiny" if args.tiny else "quick" if args.quick else "full",
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "versions": versions(),
            "sizes": sizes.describe(),
        },
        "benchmarks": {},
        "notes": ctx.notes,
    }
    began = time.perf_counter()
    try:
        for name in selected:
            ctx.say(f"\n=== {name} ===")
            started = time.perf_counter()
            result = BENCHMARKS[name].run(ctx)
            result["seconds"] = round(time.perf_counter() - started, 1)
            results["benchmarks"][name] = result
            for table in (result, *result.get("tables", ())):
                print_table(table["title"], table["columns"], table["rows"])
            for item in result.get("targets", ()):
                print(target_line(item))
            results["meta"]["seconds"] = round(time.perf_counter() - began, 1)
            write_results(Path(args.output), results)
        if args.profile:
            from bench import hotspots

            results["profile"] = hotspots.run(ctx)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _selected(args: argparse.Namespace) -> list[str]:
    def names(text: str) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in BENCHMARKS]
        if unknown:
            raise SystemExit(
                f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}"
            )
        return chosen

    only, skip = names(args.only), names(args.skip)
    return [n for n in BENCHMARKS if (not only or n in only) and n not in skip]
