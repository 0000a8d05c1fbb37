"""Run PolyLoop's benchmarks and write ``bench/results/latest.json``.

    python bench/run.py                 # everything, full sizes
    python bench/run.py --quick         # everything, smaller sizes (under two minutes)
    python bench/run.py --only overhead,durable
    python bench/run.py --skip concurrency --profile

See ``bench/README.md`` for what each benchmark measures and how to read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    # Run as a script: import the benchmarks as the package ``bench`` from the repository
    # root, never as top-level modules from this directory (their names could shadow
    # others').
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
    sys.path.insert(0, str(ROOT))

from bench import (  # noqa: E402
    concurrency,
    console,
    durable,
    lag,
    listing,
    overhead,
    recovery,
    scale,
)
from bench._common import (  # noqa: E402
    FULL,
    QUICK,
    TINY,
    Context,
    Sizes,
    collect_between_measurements,
    postgres_conninfo,
    print_table,
    versions,
)

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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    selected = _selected(args)
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Run PolyLoop's benchmarks.")
    parser.add_argument(
        "--quick", action="store_true", help="smaller sizes and fewer repeats (under two minutes)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="next to no work: runs every code path in seconds, measures "
        "nothing meaningful (the smoke test uses it)",
    )
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
        measured, unit = item["measured"], item.get("unit", "x")
        shown = "not measured" if measured is None else f"{measured:.2f}{unit}"
        verdict = "met" if item["met"] else "MISSED"
        bound = "at least" if item.get("at_least") else "limit"
        print(f"  target: {item['target']}: {shown} ({bound} {item['limit']}{unit}) -> {verdict}")


def _print_summary(results: dict[str, Any]) -> None:
    targets = [t for b in results["benchmarks"].values() for t in b.get("targets", ())]
    if not targets:
        return
    print("\nTargets (ratios measured within this run):")
    _print_targets(targets)


if __name__ == "__main__":
    raise SystemExit(main())
