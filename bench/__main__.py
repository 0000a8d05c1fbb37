"""``python -m bench``: the one way to run PolyLoop's benchmarks.

    python -m bench --help            # every benchmark, one line each
    python -m bench NAME [options]    # run one (NAME --help: its options)
    python -m bench render FILE...    # results files as the Markdown of the docs

What each measures and how to read it: ``bench/README.md``.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Benchmark:
    """One entry of the registry: its name, what it measures, and how it runs."""

    name: str
    summary: str
    main: Callable[[list[str]], int]


def _suite(one: str | None) -> Callable[[list[str]], int]:
    def main(argv: list[str]) -> int:
        from bench import suite

        return suite.main(argv, one=one)

    return main


def _module(name: str) -> Callable[[list[str]], int]:
    def main(argv: list[str]) -> int:
        status: int = importlib.import_module(f"bench.{name}").main(argv)
        return status

    return main


def _render(argv: list[str]) -> int:
    from bench.report import render

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m bench render RESULTS.json...")
        return 0 if argv else 2
    print("\n\n".join(render(json.loads(Path(name).read_text())) for name in argv))
    return 0


# name, what it measures, and whether it is one of the suite's (run in this process)
ENTRIES = (
    ("suite", "benchmarks 1-7 and 10 in one run, one results file (the performance page's)", True),
    ("overhead", "1. kernel overhead per step against a hand-written loop and peers", True),
    ("durable", "2. a durable step on each store against fsync and hand-written floors", True),
    ("concurrency", "3. concurrent runs: speed, memory, against sequential, group commit", True),
    ("recovery", "4. resume time against the length of the log", True),
    ("scale", "5. the cost of a step early and late in one long run", True),
    ("listing", "6. listing and statuses against the number of finished runs", True),
    ("lag", "7. event-loop lag beside concurrent durable runs", True),
    ("throughput", "8. many runs of realistic shape in child processes, with floors, peers", False),
    ("temporal", "9. the same runs driven by Temporal workers and by PolyLoop's own", False),
    ("console", "10. the web console's pages on a store with a long history", True),
    ("codec", "11. the record codec on benchmark 8's records", False),
)
REGISTRY = {
    name: Benchmark(
        name, summary, _suite(None if name == "suite" else name) if in_suite else _module(name)
    )
    for name, summary, in_suite in ENTRIES
}
REGISTRY["render"] = Benchmark(
    "render", "results files (bench/results/) as the Markdown tables of the docs", _render
)


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
    return entry.main(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
