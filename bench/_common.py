"""What every benchmark shares: sizes, the run context, the stores, timing helpers and rows."""

from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import AsyncExitStack, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

ROOT = Path(__file__).resolve().parent.parent  # the repository
POSTGRES_ENV = "POLYLOOP_TEST_POSTGRES"
POSTGRES_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"

Row = dict[str, Any]
T = TypeVar("T")
STORE_NAMES = {
    "memory": "MemoryStore",
    "jsonl": "JsonlStore",
    "sqlite": "SqliteStore",
    "postgres": "PostgresStore",
}


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

    def pick(self, full: T, quick: T, tiny: T) -> T:
        """This mode's choice among a benchmark's own sizes."""
        return tiny if self is TINY else quick if self is QUICK else full


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

    def unavailable(self, kind: str) -> str | None:
        """Why a store of ``kind`` cannot be measured here: PostgreSQL without a server."""
        if kind.startswith("postgres") and self.postgres is None:
            return self.postgres_note or "no PostgreSQL"
        return None

    def place(self, stack: ExitStack | AsyncExitStack, kind: str) -> str:
        """Where a new store of ``kind`` lives: a new scratch directory, or a schema of its
        own on the PostgreSQL server (dropped when ``stack`` closes)."""
        if kind == "memory":
            return ""
        if not kind.startswith("postgres"):
            return str(self.scratch(kind))
        assert self.postgres is not None
        return f"{self.postgres}#{stack.enter_context(postgres_schema(self.postgres))}"

    async def open_store(self, stack: AsyncExitStack, kind: str, where: str | None = None) -> Any:
        """A new, empty store of ``kind`` (at ``where``, or a new :meth:`place`), open
        until ``stack`` closes."""
        store = new_store(kind, self.place(stack, kind) if where is None else where)
        if kind == "memory":
            return store  # closing it would throw its records away
        return await stack.enter_async_context(store)


def new_store(kind: str, where: str, **options: Any) -> Any:
    """A store of ``kind``, not opened yet. ``where`` is a directory (``jsonl``; ``sqlite``
    keeps ``runs.sqlite`` in it) or ``conninfo#schema`` (``postgres``). ``sqlite-single``
    and ``postgres-single`` are those stores committing each write alone."""
    import polyloop.stores

    if kind == "memory":
        return polyloop.stores.MemoryStore()
    if kind == "jsonl":
        return polyloop.stores.JsonlStore(where)
    if kind.endswith("-single"):
        from bench import _baselines

        store = {
            "sqlite-single": _baselines.SqliteOneCommitPerWrite,
            "postgres-single": _baselines.PostgresOneCommitPerWrite,
        }[kind]
    else:
        store = getattr(polyloop.stores, STORE_NAMES[kind])
    if kind.startswith("sqlite"):
        return store(Path(where) / "runs.sqlite", **options)
    conninfo, _, schema = where.partition("#")
    return store(conninfo, schema=schema, **options)


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
    name = f"polyloop_bench_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        drop_schema(conninfo, name)


def drop_schema(conninfo: str, name: str) -> None:
    """Drop the schema ``name`` and everything in it, if it exists."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def skipped(row: Row, reason: str) -> Row:
    """A row that could not be measured, saying why."""
    return {**row, "skipped": reason}


def history(unfinished: Sequence[str], finished: int) -> list[tuple[str, str]]:
    """``(kind, run_id)`` of every run of a store that has been in use for a while, in
    start order: ``finished`` finished runs, the ``unfinished`` ones (one kind each)
    spread evenly among them. Ids number each kind from 1, the same in every copy."""
    total = len(unfinished) + finished
    marks = {i * total // max(len(unfinished), 1): kind for i, kind in enumerate(unfinished)}
    counts: Counter[str] = Counter()
    runs = []
    for n in range(total):
        kind = marks.get(n, "finished")
        counts[kind] += 1
        runs.append((kind, f"{kind}-{counts[kind]:06d}"))
    return runs


async def each(
    count: int, one: Callable[[int], Coroutine[Any, Any, Any]], *, sequential: bool = False
) -> None:
    """``one(0)`` to ``one(count - 1)``: all at once in one task group, or one by one."""
    if sequential:
        for index in range(count):
            await one(index)
        return
    async with anyio.create_task_group() as group:
        for index in range(count):
            group.start_soon(one, index)


async def at_once(jobs: Iterable[Callable[[], Awaitable[Any]]], tasks: int) -> None:
    """Every job, in order, ``tasks`` at a time: many writes at once let a store's group
    commit share its commits, as a busy store does."""
    pending = iter(jobs)

    async def worker() -> None:
        for job in pending:  # shared: each job is taken by one worker, in order
            await job()

    async with anyio.create_task_group() as group:
        for _ in range(tasks):
            group.start_soon(worker)


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


async def rounds(
    measures: Sequence[Callable[[], Awaitable[T]]], repeats: int, *, warmup: bool = False
) -> list[list[T]]:
    """Each measure ``repeats`` times, round-robin, the order reversed on every other
    round, so that a slow spell of the machine weighs on all alike; with ``warmup``, one
    unrecorded call of each first."""
    if warmup:
        for measure in measures:
            await measure()
    results: list[list[T]] = [[] for _ in measures]
    indexed = list(enumerate(measures))
    for round_ in range(repeats):
        for index, measure in indexed if round_ % 2 == 0 else indexed[::-1]:
            settle()
            results[index].append(await measure())
    return results


async def interleave(
    ctx: Context, variants: Sequence[Variant], repeats: int
) -> dict[str, list[RunStats]]:
    """Measure every variant ``repeats`` times (:func:`rounds`, after a warm-up run each);
    a skipped variant is noted."""
    for variant in variants:
        if variant.skip:
            ctx.note(f"{variant.name}: skipped ({variant.skip})")
    active = [v for v in variants if v.measure is not None and not v.skip]

    def once(variant: Variant) -> Callable[[], Awaitable[RunStats]]:
        measure = variant.measure
        assert measure is not None
        return lambda: measure(f"{variant.key}-{uuid.uuid4().hex[:8]}")

    measured = await rounds([once(v) for v in active], repeats, warmup=True)
    return {v.key: runs for v, runs in zip(active, measured, strict=True)}


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
