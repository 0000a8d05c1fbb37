"""Benchmarks 1-7 and 10 in one process run, written to one results file.

    python -m bench suite                 # everything, full sizes
    python -m bench suite --quick         # everything, smaller sizes (under two minutes)
    python -m bench suite --only overhead,durable
    python -m bench overhead --profile    # one of them: the same options

See ``bench/README.md`` for what each benchmark measures and how to read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import (
    concurrency,
    console,
    durable,
    lag,
    listing,
    overhead,
    recovery,
    scale,
)
from bench._common import (
    FULL,
    QUICK,
    TINY,
    Context,
    Sizes,
    collect_between_measurements,
    postgres_conninfo,
    versions,
)
from bench.report import print_table, target_line

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
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None, *, one: str | None = None) -> int:
    """Run the benchmarks chosen (``one`` of them, when given) and write their results."""
    args = _parser(one).parse_args(argv)
    selected = [one] if one else _selected(args)
    sizes = TINY if args.tiny else QUICK if args.quick else FULL
    collect_between_measurements(not args.tiny)
    workdir = Path(tempfile.mkdtemp(prefix="polyloop-bench-", dir=args.workdir))
    conninfo, pg_note = postgres_conninfo()
    ctx = Context(sizes=sizes, workdir=workdir, postgres=conninfo, postgres_note=pg_note)
    if pg_note:
        ctx.note(f"PostgresStore rows are skipped: {pg_note}")
    output = Path(args.output) if args.output else RESULTS / "latest.json"
    results: dict[str, Any] = {
        "meta": _meta(args, sizes),
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
            print_table(result["title"], result["columns"], result["rows"])
            for extra in result.get("tables", ()):
                print_table(extra["title"], extra["columns"], extra["rows"])
            _print_targets(result.get("targets", ()))
            results["meta"]["seconds"] = round(time.perf_counter() - began, 1)
            _write(output, results)
        if args.profile:
            from bench import hotspots

            results["profile"] = hotspots.run(ctx)
            _write(output, results)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _print_summary(results)
    ctx.say(f"\nresults written to {os.path.relpath(output)}")
    return 0


def _parser(one: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m bench {one or 'suite'}",
        description=f"Run benchmark {one}." if one else "Run benchmarks 1-7 and 10.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repeats (under two minutes)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="next to no work: runs every code path in seconds, measures "
        "nothing meaningful (the smoke test uses it)",
    )
    if one is None:
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
        "--output",
        default=None,
        help="where to write the JSON results (default: bench/results/latest.json)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile PolyLoop's step (cProfile) and print the hot spots",
    )
    return parser


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


def _meta(args: argparse.Namespace, sizes: Sizes) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "tiny" if args.tiny else "quick" if args.quick else "full",
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "versions": versions(),
        "sizes": sizes.describe(),
    }


def _write(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=_plain) + "\n")
    tmp.replace(path)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and value != value:
        return None
    return str(value)


def _print_targets(targets: Any) -> None:
    for item in targets:
        print(target_line(item))


def _print_summary(results: dict[str, Any]) -> None:
    targets = [t for b in results["benchmarks"].values() for t in b.get("targets", ())]
    if not targets:
        return
    print("\nTargets (ratios measured within this run):")
    _print_targets(targets)
