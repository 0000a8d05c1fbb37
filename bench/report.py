"""The one renderer: every results file of ``bench/`` as the Markdown of the docs.

``python -m bench render FILE...`` prints it. A results file is one of four kinds, told
apart by its keys: the suite's (benchmarks 1-7 and 10, ``"benchmarks"``), one benchmark's
tables of its own (benchmarks 11 and 12, ``"columns"``), a throughput command's
(benchmark 8, ``"rows"``) or the Temporal comparison's (benchmark 9, ``"temporal"``).
The same tables are printed while a benchmark runs. ``tests/test_docs.py`` checks that
the pages still hold the rendering of the committed files in ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (row key, header) or (row key, header, decimals shown below 100)
Column = tuple[str, str] | tuple[str, str, int]
Row = dict[str, Any]

ORDER = ("overhead", "durable", "concurrency", "recovery", "scale", "listing", "lag", "console")
# Commands recorded before ``python -m bench`` was the one way in; shown as they run now.
RENAMED = {
    "python bench/throughput.py": "python -m bench throughput",
    "python bench/temporal.py": "python -m bench temporal",
}


def options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("files", nargs="+", metavar="RESULTS.json")


def run(args: argparse.Namespace) -> None:
    """``python -m bench render``: print each file's Markdown."""
    print("\n\n".join(render(json.loads(Path(name).read_text())) for name in args.files))


def render(results: dict[str, Any]) -> str:
    """The Markdown for any results file a benchmark writes."""
    if "benchmarks" in results:
        return _suite(results)
    if "columns" in results:
        return _benchmark(results)
    if "temporal" in results:
        return _temporal(results)
    return _throughput(results)


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Write ``results`` as JSON, all at once (a reader never sees half a file)."""
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


def cell(value: Any, digits: int | None = None) -> str:
    """A number as a table shows it: thousands separated, ``digits`` decimals (one by
    default) below 100, none from 100 up; nothing for a missing value."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.{1 if digits is None else digits}f}"


def table(columns: Sequence[Sequence[Any]], rows: Sequence[Row]) -> list[str]:
    """A Markdown table. A row that could not be measured shows why; ``<x>_min`` and
    ``<x>_max`` columns become one spread column, ``low-high``."""
    keys = [column[0] for column in columns]
    spreads = [
        key[: -len("_min")] for key in keys if key.endswith("_min") and key[:-4] + "_max" in keys
    ]
    hidden = {f"{base}_{end}" for base in spreads for end in ("min", "max")}
    shown = [column for column in columns if column[0] not in hidden]
    headers = [str(column[1]) for column in shown] + ["spread (min-max)"] * len(spreads)
    lines = [
        _line(headers),
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    for row in rows:
        if row.get("skipped"):
            lines.append(
                _line(
                    [row.get("name", ""), f"skipped: {row['skipped']}"] + [""] * (len(headers) - 2)
                )
            )
            continue
        cells = [
            cell(row.get(column[0]), column[2] if len(column) > 2 else None) for column in shown
        ]
        for base in spreads:
            low, high = row.get(f"{base}_min"), row.get(f"{base}_max")
            digits = 2 if base == "wall_s" else None
            cells.append(
                "" if low is None or high is None else f"{cell(low, digits)}-{cell(high, digits)}"
            )
        lines.append(_line(cells))
    return lines


def print_table(title: str, columns: Sequence[Sequence[Any]], rows: Sequence[Row]) -> None:
    """A table as it is measured: the same Markdown, under its title."""
    print("\n".join(["", title, "", *table(columns, rows)]), flush=True)


def command_of(results: dict[str, Any]) -> str:
    """The command that made a results file, without ``--output FILE`` (where a file went
    is not how it was made), in today's spelling."""
    words = results["command"].split()
    kept = [w for i, w in enumerate(words) if w != "--output" and words[i - 1 : i] != ["--output"]]
    command = " ".join(kept)
    for old, new in RENAMED.items():
        if command.startswith(old):
            command = new + command[len(old) :]
    return command


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# -- the suite: benchmarks 1-7 and 10 -----------------------------------------------------


def _suite(results: dict[str, Any]) -> str:
    parts: list[str] = []
    benchmarks = results["benchmarks"]
    for name in (*ORDER, *sorted(set(benchmarks) - set(ORDER))):
        if name in benchmarks:
            parts.append(_benchmark(benchmarks[name]))
    parts.append(_machine(results["meta"]))
    return "\n".join(parts)


def _benchmark(bench: dict[str, Any]) -> str:
    lines = [f"### {bench['title']}", ""]
    if "command" in bench:  # a benchmark run alone says how, when and on what
        lines += [f"`{command_of(bench)}` ({bench['date'][:10]}; {bench['cpus']} CPUs)", ""]
    lines += table(bench["columns"], bench["rows"])
    for extra in bench.get("tables", ()):
        lines += ["", f"**{extra['title']}**", ""]
        lines += table(extra["columns"], extra["rows"])
    targets = bench.get("targets") or ()
    if targets:
        lines += ["", "| target | measured | bound | met |", "|---|---:|---:|---|"]
        lines += [_target(item) for item in targets]
    lines.append("")
    return "\n".join(lines)


def target_line(item: dict[str, Any]) -> str:
    """A target as the console shows it while the benchmarks run."""
    verdict = "met" if item["met"] else "MISSED"
    return f"  target: {item['target']}: {_measured(item)} ({_bound(item)}) -> {verdict}"


def _target(item: dict[str, Any]) -> str:
    met = "yes" if item["met"] else "no"
    return f"| {item['target']} | {_measured(item)} | {_bound(item)} | {met} |"


def _measured(item: dict[str, Any]) -> str:
    measured = item.get("measured")
    return "not measured" if measured is None else f"{measured:.2f}{item.get('unit', 'x')}"


def _bound(item: dict[str, Any]) -> str:
    return (
        "at least " if item.get("at_least") else "at most "
    ) + f"{item['limit']:g}{item.get('unit', 'x')}"


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


# -- benchmark 8: throughput ----------------------------------------------------------------

THROUGHPUT_COLUMNS: list[Column] = [
    ("name", "backend / store"),
    ("runs", "runs"),
    ("workers", "workers"),
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


def _throughput(results: dict[str, Any]) -> str:
    """The command that made the file, then its table, then its profile if it has one."""
    shown = [column for column in THROUGHPUT_COLUMNS if column[0] != "wall_s"]
    gc_threshold = results.get("gc_threshold")
    lines = [
        f"`{command_of(results)}` ({results['date'][:10]}; lease {results['lease_s']:g} s"
        + (f", GC threshold {gc_threshold:,}" if gc_threshold else "")
        + ")",
        "",
        *table(shown, results["rows"]),
    ]
    profiled = [row for row in results["rows"] if row.get("profile")]
    if profiled:
        lines += ["", *table(*profile_table(profiled))]
    return "\n".join(lines)


def profile_table(profiled: Sequence[Row]) -> tuple[list[Column], list[Row]]:
    """The columns and rows of a table of profiles: one column per profiled row (its
    ``"profile"``: ``[share, file]`` pairs), one row per source file, its shares."""
    columns: list[Column] = [
        ("file", "file"),
        *((str(index), row["name"]) for index, row in enumerate(profiled)),
    ]
    shares = [{name: share for share, name in row["profile"]} for row in profiled]
    # Ties by name: a set's order changes from one process to the next.
    names = sorted(
        {name for row in shares for name in row},
        key=lambda n: (-max(row.get(n, 0.0) for row in shares), n),
    )
    rows = [
        {
            "file": name,
            **{str(i): f"{row[name]:.1f}%" for i, row in enumerate(shares) if name in row},
        }
        for name in names
    ]
    return columns, rows


# -- benchmark 9: Temporal workers beside PolyLoop's own ----------------------------------

TEMPORAL_COLUMNS: list[Column] = [
    ("name", "driven by"),
    ("wall_over_ideal", "wall / ideal", 2),
    ("cpu_per_step_ms", "worker CPU ms/step", 2),
    ("server_cpu_per_step_ms", "server CPU ms/step", 2),
    ("history_events_per_run", "history events per run", 0),
]


def _temporal(results: dict[str, Any]) -> str:
    rows = [
        {**results["polyloop"], "name": "PolyLoop workers (`start_or_resume`)"},
        {**results["temporal"], "name": "Temporal workers (`PolyLoopPlugin`)"},
    ]
    ratios = results["temporal_over_polyloop"]
    return "\n".join(
        [
            f"`{command_of(results)}`",
            "",
            *table(TEMPORAL_COLUMNS, rows),
            "",
            f"Temporal / PolyLoop: wall x{ratios['wall']:.2f}, "
            f"worker CPU per step x{ratios['worker_cpu_per_step']:.2f}.",
        ]
    )
