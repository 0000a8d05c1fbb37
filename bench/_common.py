"""What every benchmark shares: sizes, the run context, timing helpers and result tables."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

POSTGRES_ENV = "POLYLOOP_TEST_POSTGRES"
POSTGRES_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"

Row = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    """How much work each benchmark does. ``FULL``, ``QUICK`` and ``TINY`` below."""

    # 1 and 2: one run of this many model decisions, repeated.
    overhead_steps: int
    overhead_repeats: int
    durable_steps: int
    durable_repeats: int
    fsync_samples: int
    # 3: concurrent runs (each count), steps per run, and the steps for the largest count.
    concurrency_runs: tuple[int, ...]
    concurrency_steps: int
    concurrency_steps_largest: int
    concurrency_repeats: int
    concurrency_repeats_largest: int
    sequential_runs: int
    backends: tuple[str, ...]
    # 4: logged steps per log, and repeats of each resume.
    recovery_sizes: tuple[int, ...]
    recovery_repeats: int
    # 5: the steps compared, the half-width of the window around each, and repeats.
    scale_points: tuple[int, ...]
    scale_window: int
    scale_repeats: int

    def describe(self) -> dict[str, Any]:
        return asdict(self)


FULL = Sizes(
    overhead_steps=200,
    overhead_repeats=11,
    durable_steps=200,
    durable_repeats=9,
    fsync_samples=400,
    concurrency_runs=(100, 1000),
    concurrency_steps=20,
    concurrency_steps_largest=5,
    concurrency_repeats=3,
    concurrency_repeats_largest=1,
    sequential_runs=100,
    backends=("asyncio", "trio"),
    recovery_sizes=(1_000, 10_000, 50_000),
    recovery_repeats=3,
    scale_points=(10, 1_000),
    scale_window=5,
    scale_repeats=7,
)

QUICK = Sizes(
    overhead_steps=200,
    overhead_repeats=3,
    durable_steps=50,
    durable_repeats=3,
    fsync_samples=100,
    concurrency_runs=(50, 200),
    concurrency_steps=5,
    concurrency_steps_largest=5,
    concurrency_repeats=1,
    concurrency_repeats_largest=1,
    sequential_runs=50,
    backends=("asyncio", "trio"),
    recovery_sizes=(500, 2_000, 5_000),
    recovery_repeats=1,
    scale_points=(10, 1_000),
    scale_window=5,
    scale_repeats=3,
)

# For the smoke test: every code path, next to no work, no meaningful timing.
TINY = Sizes(
    overhead_steps=4,
    overhead_repeats=1,
    durable_steps=3,
    durable_repeats=1,
    fsync_samples=3,
    concurrency_runs=(2, 3),
    concurrency_steps=3,
    concurrency_steps_largest=2,
    concurrency_repeats=1,
    concurrency_repeats_largest=1,
    sequential_runs=2,
    backends=("asyncio", "trio"),
    recovery_sizes=(3, 6, 12),
    recovery_repeats=1,
    scale_points=(2, 6),
    scale_window=1,
    scale_repeats=1,
)


@dataclass
class Context:
    """Where a benchmark may write, which optional pieces exist, and what to print."""

    sizes: Sizes
    workdir: Path
    postgres: str | None = None
    postgres_note: str | None = None
    quiet: bool = False
    notes: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def note(self, text: str) -> None:
        """A remark that also goes into the results (a skipped row, a changed size)."""
        self.notes.append(text)
        self.say(f"  note: {text}")

    def scratch(self, name: str) -> Path:
        """A new, empty directory under the work directory."""
        path = self.workdir / f"{name}-{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path


@dataclass(frozen=True)
class RunStats:
    """One measured run: wall time and what it really did."""

    seconds: float
    decisions: int
    tool_executions: int

    @property
    def us_per_step(self) -> float:
        return self.seconds / max(self.decisions, 1) * 1e6


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


_SETTLE = [True]


def settle() -> None:
    """Start a measurement from a clean heap, so one run's garbage is not another's cost."""
    if _SETTLE[0]:
        gc.collect()


def collect_between_measurements(enabled: bool) -> None:
    """Turn :func:`settle` on (the default) or off (tiny runs, where nothing is timed)."""
    _SETTLE[0] = enabled


def now() -> float:
    return time.perf_counter()


def missing(module: str) -> str | None:
    """Why ``module`` cannot be imported, or ``None`` if it can."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e '.[bench]')"
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the row is skipped
        return f"{module} does not import: {type(exc).__name__}: {exc}"
    return None


def postgres_conninfo() -> tuple[str | None, str | None]:
    """``(conninfo, None)`` if PostgresStore imports and the server answers, else why not."""
    problem = missing("polyloop.stores._sql.postgres.store")
    if problem is not None:
        return None, f"PostgresStore is not available ({problem})"
    import psycopg

    conninfo = os.environ.get(POSTGRES_ENV) or POSTGRES_DEFAULT
    try:
        with psycopg.connect(conninfo, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        first = next(iter(str(exc).strip().splitlines()), "")
        return None, (
            f"no PostgreSQL server answers at ${POSTGRES_ENV} ({type(exc).__name__}: {first})"
        )
    return conninfo, None


@contextmanager
def postgres_schema(conninfo: str) -> Iterator[str]:
    """A fresh schema name for the store to create; dropped with everything in it afterwards."""
    import psycopg
    from psycopg import sql

    name = f"polyloop_bench_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def skipped(row: Row, reason: str) -> Row:
    """A row that could not be measured, saying why."""
    return {**row, "skipped": reason}


def target(
    name: str,
    measured: float | None,
    limit: float,
    *,
    what: str,
    at_least: bool = False,
    unit: str = "x",
) -> Row:
    """One target from the issue: a measured value (a ratio, unless ``unit`` says
    otherwise) against its upper (or lower) limit."""
    met = False
    if measured is not None and measured == measured:  # NaN is never met
        met = measured >= limit if at_least else measured <= limit
    return {
        "target": name,
        "what": what,
        "measured": measured,
        "limit": limit,
        "met": met,
        "at_least": at_least,
        "unit": unit,
    }


def versions() -> dict[str, str | None]:
    """Versions of the packages whose speed is measured."""
    from importlib import metadata

    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in (
        "polyloop",
        "anyio",
        "trio",
        "psycopg",
        "langgraph",
        "langgraph-checkpoint-sqlite",
        "langgraph-checkpoint-postgres",
        "pydantic-ai-slim",
    ):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


# -- repeated, interleaved measurements --------------------------------------------------------


@dataclass
class Variant:
    """One loop to measure. ``measure(run_id)`` performs and times one run."""

    key: str
    name: str
    role: str  # "floor", "polyloop", "peer" or "reference"
    measure: Callable[[str], Any] | None = None  # async (run_id) -> RunStats
    skip: str | None = None


async def interleave(
    variants: Sequence[Variant], repeats: int, *, warmup: bool = True
) -> dict[str, list[RunStats]]:
    """Measure every variant ``repeats`` times, round-robin, so drift hits all alike.

    The order is reversed on every other round; one unrecorded warm-up run each first.
    """
    active = [v for v in variants if v.measure is not None and not v.skip]
    results: dict[str, list[RunStats]] = {v.key: [] for v in active}
    if warmup:
        for variant in active:
            assert variant.measure is not None
            await variant.measure(f"{variant.key}-warmup-{uuid.uuid4().hex[:6]}")
    for round_ in range(repeats):
        for variant in active if round_ % 2 == 0 else active[::-1]:
            assert variant.measure is not None
            settle()
            stats = await variant.measure(f"{variant.key}-{round_}-{uuid.uuid4().hex[:6]}")
            results[variant.key].append(stats)
    return results


def summary_row(variant: Variant, runs: Sequence[RunStats] | None, steps: int) -> Row:
    """The median of a variant's runs, with the counts every run must agree on."""
    row: Row = {"key": variant.key, "name": variant.name, "role": variant.role, "steps": steps}
    if variant.skip or not runs:
        return skipped(row, variant.skip or "not measured")
    decisions = {r.decisions for r in runs}
    executions = {r.tool_executions for r in runs}
    if len(decisions) != 1 or len(executions) != 1:
        raise AssertionError(
            f"{variant.name}: runs disagree on their work "
            f"(decisions {decisions}, tool calls {executions})"
        )
    per_step = [r.us_per_step for r in runs]
    row.update(
        repeats=len(runs),
        decisions=runs[0].decisions,
        tool_executions=runs[0].tool_executions,
        us_per_step=median(per_step),
        us_per_step_min=min(per_step),
        us_per_step_max=max(per_step),
    )
    return row


def add_ratio(
    rows: Sequence[Row],
    floor_key: str,
    field_name: str = "ratio_to_floor",
    value_key: str = "us_per_step",
) -> float | None:
    """Divide every measured row's ``value_key`` by the floor row's; return the floor."""
    floor = next((r.get(value_key) for r in rows if r.get("key") == floor_key), None)
    for row in rows:
        if row.get("skipped") or floor in (None, 0) or row.get(value_key) is None:
            continue
        row[field_name] = row[value_key] / floor
    return floor


def by_key(rows: Sequence[Row], key: str) -> Row | None:
    return next((r for r in rows if r.get("key") == key), None)
