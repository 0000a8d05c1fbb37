"""``python -m bench``: the one way to run PolyLoop's benchmarks.

    python -m bench --help            # every benchmark, one line each
    python -m bench NAME [options]    # run one (NAME --help: its options)
    python -m bench render FILE...    # results files as the Markdown of the docs

A benchmark is a module of ``bench/`` and one line of :data:`REGISTRY`. The module's
``options(parser, name)`` adds its options to the parser made here, and ``run(args)``
measures and returns the results, which are printed as ``bench/report.py`` renders them
and written to ``--output``. One that measures in child processes also has
``child(spec)``: what a child does with the spec its parent sent (``bench/_children.py``).
What each measures and how to read it: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Benchmark:
    """One entry of the registry: its name, what it measures, and the module that runs it."""

    name: str
    summary: str
    module: str


# name, the module of bench/ that runs it, and what it measures
ENTRIES = (
    (
        "suite",
        "suite",
        "benchmarks 1-7 and 10 in one run, one results file (the performance page's)",
    ),
    ("overhead", "suite", "1. kernel overhead per step against a hand-written loop and peers"),
    ("durable", "suite", "2. a durable step on each store against fsync and hand-written floors"),
    ("concurrency", "suite", "3. concurrent runs: speed, memory, against sequential, group commit"),
    ("recovery", "suite", "4. resume time against the length of the log"),
    ("scale", "suite", "5. the cost of a step early and late in one long run"),
    ("listing", "suite", "6. listing and statuses against the number of finished runs"),
    ("lag", "suite", "7. event-loop lag beside concurrent durable runs"),
    (
        "throughput",
        "throughput",
        "8. many runs of realistic shape in child processes, with floors, peers",
    ),
    ("temporal", "temporal", "9. the same runs driven by Temporal workers and by PolyLoop's own"),
    ("console", "suite", "10. the web console's pages on a store with a long history"),
    ("codec", "codec", "11. the record codec on benchmark 8's records"),
    (
        "hosting",
        "hosting",
        "12. a worker process: from a start or an answer to the run going on, idle CPU",
    ),
    (
        "following",
        "following",
        "13. a writer beside 1,000 idle followers; from a write to a follower's sight",
    ),
    ("render", "report", "results files (bench/results/) as the Markdown tables of the docs"),
)
REGISTRY = {name: Benchmark(name, summary, module) for name, module, summary in ENTRIES}


def usage() -> str:
    width = max(map(len, REGISTRY))
    lines = [
        "usage: python -m bench NAME [options]   (python -m bench NAME --help: its options)",
        "",
        "benchmarks:",
    ]
    lines += [f"  {entry.name.ljust(width)}  {entry.summary}" for entry in REGISTRY.values()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    entry = REGISTRY.get(args[0])
    if entry is None:
        print(f"unknown benchmark {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{entry.module}")
    parser = argparse.ArgumentParser(
        prog=f"python -m bench {entry.name}", description=entry.summary
    )
    parser.set_defaults(benchmark=entry.name, command=" ".join(["python -m bench", *args]))
    module.options(parser, entry.name)
    if hasattr(module, "OUTPUT"):
        parser.add_argument(
            "--output", default=module.OUTPUT, help="where to write the results as JSON"
        )
    if hasattr(module, "child"):
        parser.add_argument("--child", help=argparse.SUPPRESS)
    chosen = parser.parse_args(args[1:])
    if getattr(chosen, "child", None):
        from bench._children import report

        report(module.child(json.loads(chosen.child)))
        return 0
    results = module.run(chosen)
    if results is not None:
        from bench.report import render, write_results

        print("\n" + render(results))
        if chosen.output:
            write_results(Path(chosen.output), results)
            print(f"\nresults written to {chosen.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
