"""Benchmark 4: how ``resume`` (and ``polyloop verify``) scale with the length of a log.

Each log is the genuine start record of a run and the copies of one real step's
records, renumbered, written in bulk in the store's own format: writing them through
the store would cost 100,000 fsyncs for the largest. How they are built and what is
reported: ``bench/README.md``, benchmark 4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from bench._common import (
    STORE_NAMES,
    Context,
    Row,
    median,
    missing,
    new_store,
    now,
    settle,
    skipped,
)
from bench.agents import Agent
from polyloop import resume
from polyloop.ports import Store
from polyloop.serialization import dumps
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.types import Intent, Record, Result, RunEnded, RunLog, RunStarted, StepRecord

TITLE = "4. Recovery: resume time against log length"
COLUMNS = [
    ("name", "store / size"),
    ("steps", "logged steps"),
    ("records", "records"),
    ("seconds", "resume s", 3),
    ("us_per_logged_step", "us/logged step"),
    ("us_per_logged_step_gc_off", "us/logged step, gc off"),
    ("verify_s", "verify s", 3),
    ("repeats", "repeats"),
]
SLOPE_TITLE = "4b. Recovery slopes (least squares over the sizes)"
SLOPE_COLUMNS = [
    ("name", "store"),
    ("slope_us_per_step", "resume us/step"),
    ("segment_ratio", "slope ratio (late/early)", 2),
    ("gc_off_slope_us_per_step", "gc off us/step"),
    ("gc_off_segment_ratio", "gc off slope ratio", 2),
    ("verify_slope_us_per_step", "verify us/step"),
    ("verify_segment_ratio", "verify slope ratio", 2),
]
KINDS = {
    "run_started": RunStarted,
    "intent": Intent,
    "result": Result,
    "step": StepRecord,
    "run_ended": RunEnded,
}


class _RefuseWrites(FaultyStore):
    """Refuses every write (noting what it was) and counts the records read, so that a
    log can be resumed again and again and each resume shown to read it whole."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner, fail_after_writes=0)
        self.attempted: list[Any] = []
        self.records_read = 0

    async def _write(self, write: Any, *args: Any, **kwargs: Any) -> None:
        self.attempted.append(args[0])
        await super()._write(write, *args, **kwargs)

    async def read_log(self, run_id: str) -> RunLog:
        log = await super().read_log(run_id)
        self.records_read += len(log.records)
        return log


def run(ctx: Context) -> dict[str, Any]:
    rows: list[Row] = anyio.run(_measure, ctx)
    slopes = _slopes(rows)
    notes = []
    if _verify_missing():
        notes.append(f"polyloop verify not timed: {_verify_missing()}")
    elif ctx.postgres is not None:
        notes.append(
            "polyloop verify not timed on PostgresStore: the command line opens the "
            "store's default schema, and the benchmark writes to a throw-away one"
        )
    for note in notes:
        ctx.note(note)
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "tables": [{"title": SLOPE_TITLE, "columns": SLOPE_COLUMNS, "rows": slopes}],
        "slopes": slopes,
        "targets": [],
        "notes": notes,
    }


async def _measure(ctx: Context) -> list[Row]:
    sizes = ctx.sizes.recovery_sizes
    template = await _step_template()
    rows: list[Row] = []
    for kind in ("memory", "jsonl", "sqlite", "postgres"):
        for size in sizes:
            row: Row = {
                "key": f"{kind}-{size}",
                "store": kind,
                "steps": size,
                "name": f"{STORE_NAMES[kind]}, {size:,} steps",
            }
            problem = ctx.unavailable(kind)
            if problem is not None:
                rows.append(skipped(row, problem))
                continue
            rows.append(await _one(ctx, kind, size, template, row))
            ctx.say(f"    {row['name']}: resume {row['seconds']:.3f} s")
    return rows


async def _one(ctx: Context, kind: str, size: int, template: Sequence[Record], row: Row) -> Row:
    with contextlib.ExitStack() as stack:
        where = ctx.place(stack, kind)
        memory = MemoryStore() if kind == "memory" else None
        run_id = f"recovery-{kind}-{size}"

        def open_store() -> Any:
            return memory if memory is not None else new_store(kind, where)

        started = await _start(open_store, run_id, size)
        records = list(_steps(template, run_id, size))
        await _append(kind, where, memory, started, records)
        del records
        expected = 1 + 5 * size
        times = [
            await _resume_once(open_store, run_id, size, expected)
            for _ in range(ctx.sizes.recovery_repeats)
        ]
        # Once more with the cyclic garbage collector off: what is left is the kernel's
        # and the store's own work, without the collector's passes over a growing heap.
        fewer = max(1, ctx.sizes.recovery_repeats - 1)
        gc.disable()
        try:
            without_gc = median(
                [await _resume_once(open_store, run_id, size, expected) for _ in range(fewer)]
            )
        finally:
            gc.enable()
        seconds = median(times)
        row.update(
            records=expected,
            repeats=len(times),
            seconds=seconds,
            us_per_logged_step=seconds / size * 1e6,
            seconds_gc_off=without_gc,
            us_per_logged_step_gc_off=without_gc / size * 1e6,
        )
        # The command line runs its own event loop, so it is called from a worker thread.
        verify = await anyio.to_thread.run_sync(_time_verify, kind, Path(where), run_id, fewer)
        if verify is not None:
            row["verify_s"] = verify
    return row


async def _step_template() -> list[Record]:
    """The five records the kernel writes for one tool step of the benchmark agent."""
    store = MemoryStore()
    agent = Agent(store, steps=None)
    await agent.run("template", 2)  # two tool steps, then the step limit
    records = (await store.read_log("template")).records
    step = list(records[6:11])  # records[0] is the start, 1..5 step 0, 6..10 step 1
    kinds = [type(r).__name__ for r in step]
    if kinds != ["Intent", "Result", "Intent", "Result", "StepRecord"]:
        raise AssertionError(f"unexpected records for one step: {kinds}")
    return step


def _steps(template: Sequence[Record], run_id: str, size: int) -> Iterator[Record]:
    """The template renumbered for steps 0 .. size-1 of ``run_id`` (ids as the spec pins)."""
    model_intent, model_result, action_intent, action_result, step = template
    assert isinstance(model_intent, Intent) and isinstance(action_intent, Intent)
    assert isinstance(model_result, Result) and isinstance(action_result, Result)
    assert isinstance(step, StepRecord)
    for k in range(size):
        model_id, action_id = f"{run_id}:{k}:model", f"{run_id}:{k}:action"
        digest = hashlib.sha256(f"{run_id}/{k}".encode()).hexdigest()
        yield dataclasses.replace(
            model_intent,
            run_id=run_id,
            result_id=model_id,
            step=k,
            call_index=k,
            payload={"messages_sha256": digest},
        )
        yield dataclasses.replace(model_result, run_id=run_id, result_id=model_id)
        yield dataclasses.replace(
            action_intent, run_id=run_id, result_id=action_id, step=k, call_index=k
        )
        yield dataclasses.replace(action_result, run_id=run_id, result_id=action_id)
        yield dataclasses.replace(step, run_id=run_id, step=k)


async def _start(open_store: Any, run_id: str, size: int) -> RunStarted:
    """Write the genuine start record of the run, and nothing else."""
    store = open_store()
    agent = Agent(FaultyStore(store, fail_after_writes=1), steps=None)
    try:
        with contextlib.suppress(SimulatedCrash):
            await agent.run(run_id, size - 1)  # max_steps = size
            raise AssertionError("the first write after the start record should have failed")
        log = await store.read_log(run_id)
    finally:
        await _close(store)
    started = log.records[0]
    assert len(log.records) == 1 and isinstance(started, RunStarted)
    return started


async def _append(
    kind: str,
    where: str,
    memory: MemoryStore | None,
    started: RunStarted,
    records: list[Record],
) -> None:
    if memory is not None:
        await memory.claim_run(started.run_id)
        try:
            for index in range(0, len(records), 5):
                model_intent, model_result, action_intent, action_result, step = records[
                    index : index + 5
                ]
                await memory.write_intent(model_intent)  # type: ignore[arg-type]
                await memory.write_result(model_result)  # type: ignore[arg-type]
                await memory.write_intent(action_intent)  # type: ignore[arg-type]
                await memory.write_step(step, action_result)  # type: ignore[arg-type]
        finally:
            await memory.release_run(started.run_id)
    elif kind == "jsonl":
        _append_jsonl(Path(where), records)
    elif kind == "sqlite":
        _append_sqlite(Path(where) / "runs.sqlite", started.run_id, records)
    else:
        conninfo, _, schema = where.partition("#")
        _append_postgres(conninfo, schema, started.run_id, records)


def _append_jsonl(place: Path, records: list[Record]) -> None:
    """One line per record; an action result and its step share one line, as an array."""
    (path,) = place.glob("*.jsonl")
    lines = []
    for index in range(0, len(records), 5):
        model_intent, model_result, action_intent, action_result, step = records[index : index + 5]
        lines += [
            dumps(model_intent),
            dumps(model_result),
            dumps(action_intent),
            f"[{dumps(action_result)},{dumps(step)}]",
        ]
    with path.open("a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def _kind(record: Record) -> str:
    return next(name for name, cls in KINDS.items() if isinstance(record, cls))


def _append_sqlite(path: Path, run_id: str, records: list[Record]) -> None:
    """Rows of the ``records`` table: (run_id, seq, kind, body), seq 0 being the start;
    the run's row of ``runs`` moves on past them, in the same transaction."""
    rows = [
        (run_id, seq, _kind(record), dumps(record)) for seq, record in enumerate(records, start=1)
    ]
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany("INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)", rows)
        moved = conn.execute(
            "UPDATE runs SET next_seq = ?, updated_at = ? WHERE run_id = ? AND next_seq = 1",
            (len(records) + 1, time.time(), run_id),
        ).rowcount
        if moved != 1:
            raise AssertionError(f"the runs table has no row of {run_id!r} at seq 1")


def _append_postgres(conninfo: str, schema: str, run_id: str, records: list[Record]) -> None:
    """Rows of ``records``: (run_key = sha256 of the id, seq, run_id, kind, body)."""
    import psycopg
    from psycopg import sql

    assert run_id.isascii() and json.dumps(run_id)[1:-1] == run_id  # stored as it is
    key = hashlib.sha256(run_id.encode()).digest()
    table = sql.Identifier(schema, "records")
    copy = sql.SQL("COPY {} (run_key, seq, run_id, kind, body) FROM STDIN").format(table)
    advance = sql.SQL(
        "UPDATE {} SET next_seq = %s, updated_at = now() WHERE run_key = %s AND next_seq = 1"
    ).format(sql.Identifier(schema, "runs"))
    # One transaction: the rows, and the run's row of ``runs`` moved on past them.
    with psycopg.connect(conninfo) as conn, conn.cursor() as cursor:
        with cursor.copy(copy) as writer:
            for seq, record in enumerate(records, start=1):
                writer.write_row((key, seq, run_id, _kind(record), dumps(record)))
        if cursor.execute(advance, (len(records) + 1, key)).rowcount != 1:
            raise AssertionError(f"the runs table has no row of {run_id!r} at seq 1")


async def _resume_once(open_store: Any, run_id: str, size: int, expected: int) -> float:
    """Time one resume on a new store object; check that it read ``expected`` records."""
    store = open_store()
    try:
        settle()
        seconds, read = await _timed_resume(store, run_id, size)
    finally:
        await _close(store)
    if read != expected:
        raise AssertionError(f"resume read {read} records, the log holds {expected}")
    return seconds


async def _timed_resume(store: Any, run_id: str, size: int) -> tuple[float, int]:
    """Seconds for ``resume`` to read the whole log and decide to stop; records it read."""
    refusing = _RefuseWrites(store)
    agent = Agent(refusing, steps=None)
    began = now()
    try:
        await resume(agent.definition, agent.request(run_id, max_steps=size))
    except SimulatedCrash:
        seconds = now() - began
    else:
        raise AssertionError("resume wrote nothing: the log was not resumable")
    (end,) = refusing.attempted
    if not isinstance(end, RunEnded) or end.steps != size:
        raise AssertionError(f"resume tried to write {end!r}, not the end of {size} steps")
    return seconds, refusing.records_read


async def _close(store: Any) -> None:
    if isinstance(store, MemoryStore):
        return  # closing it would throw its records away
    aclose = getattr(store, "aclose", None)
    if aclose is not None:
        await aclose()


# -- polyloop verify ----------------------------------------------------------------------


def _verify_missing() -> str | None:
    problem = missing("rich")
    return None if problem is None else f"the command line needs the cli extra ({problem})"


def _time_verify(kind: str, place: Path, run_id: str, repeats: int) -> float | None:
    """Median seconds of ``polyloop verify STORE RUN_ID`` run in this process."""
    if kind not in ("jsonl", "sqlite") or _verify_missing():
        return None
    from polyloop.cli import main

    spec = f"jsonl:{place}" if kind == "jsonl" else f"sqlite:{place / 'runs.sqlite'}"
    times = []
    for _ in range(repeats):
        settle()
        output = io.StringIO()
        began = now()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            status = main(["verify", spec, run_id])
        times.append(now() - began)
        if status != 0:
            raise AssertionError(
                f"polyloop verify exited with {status} on a valid log: {output.getvalue()[-2000:]}"
            )
    return median(times)


# -- slopes -------------------------------------------------------------------------------


def _slopes(rows: list[Row]) -> list[Row]:
    result = []
    for kind, name in STORE_NAMES.items():
        points = [r for r in rows if r.get("store") == kind and not r.get("skipped")]
        row: Row = {"key": f"{kind}-slope", "store": kind, "name": name}
        if len(points) < 2:
            result.append(skipped(row, "not measured"))
            continue
        xs = [float(p["steps"]) for p in points]
        row.update(_fit("", xs, [p["seconds"] for p in points]))
        row.update(_fit("gc_off_", xs, [p["seconds_gc_off"] for p in points]))
        verify = [p.get("verify_s") for p in points]
        if all(v is not None for v in verify):
            row.update(_fit("verify_", xs, verify))  # type: ignore[arg-type]
        result.append(row)
    return result


def _fit(prefix: str, xs: list[float], ys: list[float]) -> Row:
    """Least-squares slope (us per step) and the ratio of the last to the first segment."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    first = (ys[1] - ys[0]) / (xs[1] - xs[0])
    last = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return {
        f"{prefix}slope_us_per_step": slope * 1e6,
        f"{prefix}intercept_ms": (mean_y - slope * mean_x) * 1e3,
        f"{prefix}segment_ratio": last / first if first > 0 else None,
    }
