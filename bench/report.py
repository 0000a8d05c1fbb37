"""Render a benchmark results file as the Markdown tables of ``docs/performance.md``.

    python bench/report.py bench/results/reference.json

prints, for every benchmark in the file, its tables (medians, the spread of the repeated
runs where a row has one, the ratios) and its targets, then the machine and the package
versions the run used. The performance page holds this output for the reference run,
and a test checks that it still matches ``bench/results/reference.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ORDER = ("overhead", "durable", "concurrency", "recovery", "scale", "listing", "lag", "console")


def render(results: dict[str, Any]) -> str:
    """The Markdown for ``results`` (the JSON that ``bench/run.py`` writes)."""
    parts: list[str] = []
    benchmarks = results["benchmarks"]
    for name in (*ORDER, *sorted(set(benchmarks) - set(ORDER))):
        if name in benchmarks:
            parts.append(_benchmark(benchmarks[name]))
    parts.append(_machine(results["meta"]))
    return "\n".join(parts)


def _benchmark(bench: dict[str, Any]) -> str:
    lines = [f"### {bench['title']}", ""]
    lines += _table(bench["columns"], bench["rows"])
    for extra in bench.get("tables", ()):
        lines += ["", f"**{extra['title']}**", ""]
        lines += _table(extra["columns"], extra["rows"])
    targets = bench.get("targets") or ()
    if targets:
        lines += ["", "| target | measured | bound | met |", "|---|---:|---:|---|"]
        lines += [_target(item) for item in targets]
    lines.append("")
    return "\n".join(lines)


def _table(columns: Sequence[Sequence[Any]], rows: Sequence[dict[str, Any]]) -> list[str]:
    keys = [column[0] for column in columns]
    # "<x>_min" and "<x>_max" columns become one spread column, "low-high"
    spreads = [
        key[: -len("_min")]
        for key in keys
        if key.endswith("_min") and key[: -len("_min")] + "_max" in keys
    ]
    hidden = {f"{base}_{end}" for base in spreads for end in ("min", "max")}
    shown = [column for column in columns if column[0] not in hidden]
    headers = [str(column[1]) for column in shown] + ["spread (min-max)"] * len(spreads)
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    for row in rows:
        if row.get("skipped"):
            lines.append(
                f"| {row.get('name', '')} | skipped: {row['skipped']} |" + " |" * (len(headers) - 2)
            )
            continue
        cells = [
            _cell(row.get(column[0]), column[2] if len(column) > 2 else None) for column in shown
        ]
        for base in spreads:
            low, high = row.get(f"{base}_min"), row.get(f"{base}_max")
            digits = 2 if base == "wall_s" else None
            cells.append(
                "" if low is None or high is None else f"{_cell(low, digits)}-{_cell(high, digits)}"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cell(value: Any, digits: int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if digits is not None:
        return f"{value:,.{digits}f}"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def _target(item: dict[str, Any]) -> str:
    measured, unit = item.get("measured"), item.get("unit", "x")
    shown = "not measured" if measured is None else f"{measured:.2f}{unit}"
    bound = ("at least " if item.get("at_least") else "at most ") + f"{item['limit']:g}{unit}"
    return f"| {item['target']} | {shown} | {bound} | {'yes' if item['met'] else 'no'} |"


def _machine(meta: dict[str, Any]) -> str:
    versions = ", ".join(
        f"{name} {version}" for name, version in meta["versions"].items() if version
    )
    return "\n".join(
        [
            "### The run",
            "",
            f"- date: {meta['date']}; mode: {meta['mode']}; "
            f"wall time {meta.get('seconds', 0):.0f} s",
            f"- machine: {meta['platform']}, {meta['cpus']} CPUs",
            f"- versions: {versions}",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results file written by bench/run.py")
    args = parser.parse_args(argv)
    sys.stdout.write(render(json.loads(args.results.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
