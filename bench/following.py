"""Benchmark 13: what idle followers of other runs cost a PostgreSQL writer, and how soon
a follower in another process sees a record after its write returned, on PostgreSQL
(notified) and SQLite (checked on a timer).

This process writes one run of many steps record by record, as a run's writer does,
with no follower, with a child process holding ``--followers`` idle followers (each of
a run of its own that nothing writes), and with one holding a follower of the written
run. The rounds alternate the two, so that the shared machine's drift falls on both
alike. What is measured and how to read it: ``bench/README.md``, benchmark 13.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import tempfile
import time
from contextlib import aclosing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from bench._children import Children, child_command, meet
from bench._common import Row, median, postgres_conninfo, postgres_schema, target, versions
from bench._sampling import cpu_seconds, quantile
from polyloop import RunNotFound, follow
from polyloop.stores import PostgresStore, SqliteStore
from polyloop.testing.store_contract import sample_run

OUTPUT = None
TITLE = "13. Following runs: the writer beside followers, and a write to a follower's sight"
COLUMNS = [
    ("name", "store, followers in another process"),
    ("writes", "writes"),
    ("write_ms", "ms a write p50", 3),
    ("write_p99_ms", "ms a write p99", 3),
    ("cpu_us", "writer CPU µs a write", 1),
    ("ratio", "x none", 3),
    ("seen_p50_ms", "write to follower p50 ms", 2),
    ("seen_p99_ms", "write to follower p99 ms", 2),
    ("followers_cpu_pct", "idle followers' CPU % of a core", 1),
]
# The bar: idle followers do not slow the writer measurably.
SLOWER_AT_MOST = 1.10


@dataclass(frozen=True)
class Sizes:
    followers: int
    steps: int  # a step is five records, in four writes
    rounds: int


FULL = Sizes(followers=1_000, steps=200, rounds=3)
TINY = Sizes(followers=5, steps=3, rounds=1)


@dataclass(frozen=True)
class FollowerSpec:
    """A child: ``idle`` followers of runs ``idle-N``, and one of ``watched`` (if not
    empty) that reports when it saw each of its positions; without it, the child stops
    on ``SIGTERM``."""

    kind: str  # "postgres" or "sqlite"
    where: str  # the conninfo, or the database file
    schema: str
    idle: int
    watched: str
    meeting: str


def child(spec: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = anyio.run(_follow_all, FollowerSpec(**spec))
    return seen


async def _follow_all(spec: FollowerSpec) -> dict[str, Any]:
    seen: dict[int, float] = {}
    started = 0
    ready = anyio.Event()

    async def idle(run_id: str) -> None:
        nonlocal started
        async with aclosing(follow(store, run_id)) as followed:
            async for _ in followed:  # the start record, then nothing: it waits
                started += 1
                if started == spec.idle:
                    ready.set()

    async with (
        _open(spec.kind, spec.where, spec.schema) as store,
        anyio.create_task_group() as group,
    ):
        for index in range(spec.idle):
            group.start_soon(idle, f"idle-{index}")
        if spec.idle:
            await ready.wait()
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:  # before saying ready
            await meet(spec.meeting, 0, wait_for_go=False)
            cpu, began = cpu_seconds(), time.perf_counter()
            if not spec.watched:  # idle followers only, until the parent has written
                async for _ in signals:
                    break
            share = (cpu_seconds() - cpu) / (time.perf_counter() - began)
        while spec.watched:
            try:
                async with aclosing(follow(store, spec.watched)) as watched:
                    async for item in watched:
                        seen[item.position] = time.time()
                break
            except RunNotFound:  # not started yet
                await anyio.sleep(0.005)
        group.cancel_scope.cancel()
    return {"seen": seen, "cpu_share": share}


async def _make_idle_runs(kind: str, where: str, schema: str, count: int) -> None:
    async with _open(kind, where, schema) as store:
        for index in range(count):
            run_id = f"idle-{index}"
            await store.claim_run(run_id)
            await store.start_run(sample_run(run_id)[0][1][0])
            await store.release_run(run_id)


def _open(kind: str, where: str, schema: str) -> PostgresStore | SqliteStore:
    return PostgresStore(where, schema=schema) if kind == "postgres" else SqliteStore(where)


async def _write(kind: str, where: str, schema: str, run_id: str, steps: int) -> dict[str, Any]:
    """Write the run write by write: each write's wall time, when it returned, and the
    writer's CPU over all of them."""
    writes = sample_run(run_id, steps=steps)
    durations, returned, positions = [], [], []
    position = 0
    async with _open(kind, where, schema) as store:
        await store.claim_run(run_id)
        cpu = cpu_seconds()
        for method, args in writes:
            began = time.perf_counter()
            await getattr(store, method)(*args)
            durations.append(time.perf_counter() - began)
            returned.append(time.time())
            position += 2 if method == "write_step" and args[1] is not None else 1
            positions.append(position)
        cpu = cpu_seconds() - cpu
    return {"durations": durations, "returned": returned, "positions": positions, "cpu": cpu}


def _measure(
    kind: str, where: str, schema: str, idle: int, sizes: Sizes, folder: Path
) -> list[Row]:
    """The rows of one store: its writer alone, beside ``idle`` followers of other runs
    (if any), and beside one follower of the written run, which times what it sees."""
    cases = [(0, False), *([(idle, False)] if idle else []), (0, True)]
    samples: dict[tuple[int, bool], list[dict[str, Any]]] = {case: [] for case in cases}
    lags: list[float] = []
    idle_shares: list[float] = []  # of a core, the idle followers' process while written
    for round_ in range(sizes.rounds):
        for case in cases:
            run_id = f"written-{round_}-{case[0]}-{int(case[1])}"
            if case == (0, False):
                samples[case].append(anyio.run(_write, kind, where, schema, run_id, sizes.steps))
                continue
            meeting = str(folder / f"meet-{kind}-{round_}-{case[0]}")
            watched = run_id if case[1] else ""
            spec = FollowerSpec(kind, where, schema, case[0], watched, meeting)
            with Children(Path(meeting), [child_command("following", spec)]) as children:
                if not children.all_ready():
                    children.reports(timeout=10)  # raises with the child's last words
                written = anyio.run(_write, kind, where, schema, run_id, sizes.steps)
                if not watched:
                    children.terminate()
                (report,) = children.reports(timeout=120)
            samples[case].append(written)
            if not watched:
                idle_shares.append(report["cpu_share"])
            seen = {int(position): at for position, at in report["seen"].items()}
            for position, returned in zip(written["positions"], written["returned"], strict=True):
                if watched:
                    lags.append(max(seen[position] - returned, 0.0))
    lags.sort()
    name = "PostgreSQL" if kind == "postgres" else "SQLite"
    rows = [_row(f"{name}, none ({sizes.steps} steps)", samples[(0, False)], None, None)]
    if idle:
        rows.append(_row(f"{name}, {idle:,} idle", samples[(idle, False)], rows[0], None))
        rows[-1]["followers_cpu_pct"] = median(idle_shares) * 100
    rows.append(_row(f"{name}, 1 of the run", samples[(0, True)], rows[0], lags))
    return rows


def _row(name: str, runs: list[dict[str, Any]], base: Row | None, lags: list[float] | None) -> Row:
    durations = sorted(d for run in runs for d in run["durations"])
    writes = len(durations)
    cpu_us = sum(run["cpu"] for run in runs) / writes * 1e6
    wall = median([median(run["durations"]) for run in runs]) * 1e3
    row: Row = {
        "name": name,
        "writes": writes,
        "write_ms": wall,
        "write_p99_ms": quantile(durations, 0.99) * 1e3,
        "cpu_us": cpu_us,
        "ratio": wall / base["write_ms"] if base else 1.0,
    }
    if lags:
        row.update(seen_p50_ms=quantile(lags, 0.5) * 1e3, seen_p99_ms=quantile(lags, 0.99) * 1e3)
    return row


def options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--followers", type=int, default=FULL.followers, help="idle followers")
    parser.add_argument("--steps", type=int, default=FULL.steps, help="steps of a written run")
    parser.add_argument("--rounds", type=int, default=FULL.rounds, help="rounds of each case")
    parser.add_argument("--workdir", default=None, help="where the children meet")
    parser.add_argument("--tiny", action="store_true", help="next to no work (smoke test)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = TINY if args.tiny else Sizes(args.followers, args.steps, args.rounds)
    conninfo, problem = postgres_conninfo()
    if conninfo is None:
        raise SystemExit(f"benchmark 13 needs PostgreSQL: {problem}")
    began = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(dir=args.workdir) as folder,
        postgres_schema(conninfo) as schema,
    ):
        anyio.run(_make_idle_runs, "postgres", conninfo, schema, sizes.followers)
        rows = _measure("postgres", conninfo, schema, sizes.followers, sizes, Path(folder))
        database = str(Path(folder) / "runs.db")
        anyio.run(_make_idle_runs, "sqlite", database, "", sizes.followers)
        rows += _measure("sqlite", database, "", sizes.followers, sizes, Path(folder))
    idle = [row for row in rows if row["name"].endswith(" idle")]
    what = f"a write's p50 beside {sizes.followers:,} idle followers, against none"
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "targets": [
            target(
                f"{row['name'].split(',')[0]}: idle followers",
                row["ratio"],
                SLOWER_AT_MOST,
                what=what,
            )
            for row in idle
        ],
        "command": args.command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "mode": "tiny" if args.tiny else "full",
        "sizes": asdict(sizes),
        "seconds": time.perf_counter() - began,
        "versions": versions(),
    }
