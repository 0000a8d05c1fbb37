"""Benchmark 8's durable floors: the hand-written run, made durable by hand.

``HandWorkload(trajectory=True)`` writing, in PolyLoop's order and about its sizes, the
rows a durable loop needs, each committed before the step goes on, the writes waiting
at one moment grouped into one transaction in a worker thread (``bench/README.md``,
benchmark 8: ``hand-sqlite``, ``hand-postgres``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from bench.workload import (
    GOAL,
    SEARCH_SCHEMA,
    SUBMIT_SCHEMA,
    SYSTEM_PROMPT,
    Counts,
    HandStep,
    HandWorkload,
    action_text,
)

ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
TABLE = "hand_rows"
SQLITE_FILE = "hand.sqlite"
SCHEMA = "polyloop/1"
ROWS_PER_STEP = 5  # model intent and result, tool intent and result, step
ROWS_PER_RUN = 2  # start and end

Row = tuple[str, int, str]  # run_id, seq, body
Commit = Callable[[list[Row], bool], None]  # the rows, and whether a barrier is among them


def rows_written(runs: int, steps: int) -> int:
    """How many rows ``runs`` runs of ``steps`` steps write."""
    return runs * (ROWS_PER_STEP * steps + ROWS_PER_RUN)


class _Waiter:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class GroupCommitter:
    """Commits rows in groups: a write joins the pending list; if no commit is running,
    its writer leads: it takes the whole list, commits it in a worker thread, wakes its
    writers, and goes on while writes are pending. Rows committed are counted in
    ``counts.rows``."""

    def __init__(self, commit: Commit, counts: Counts) -> None:
        self._commit = commit
        self._counts = counts
        self._pending: list[tuple[list[Row], bool, _Waiter]] = []
        self._leading = False

    async def write(self, rows: list[Row], *, barrier: bool) -> None:
        """Return once ``rows`` are committed (durable, if ``barrier``)."""
        waiter = _Waiter()
        self._pending.append((rows, barrier, waiter))
        if self._leading:
            await waiter.done.wait()
        else:
            await self._lead()
        if waiter.error is not None:
            raise RuntimeError("the group commit failed") from waiter.error

    async def _lead(self) -> None:
        self._leading = True
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                rows = [row for rows, _, _ in batch for row in rows]
                barrier = any(barrier for _, barrier, _ in batch)
                try:
                    await anyio.to_thread.run_sync(self._commit, rows, barrier)
                except Exception as exc:  # noqa: BLE001 - each writer raises it
                    for _, _, waiter in batch:
                        waiter.fail(exc)
                    continue
                except BaseException as exc:  # cancelled: nobody is left to commit
                    for _, _, waiter in batch + self._pending:
                        waiter.fail(exc)
                    self._pending = []
                    raise
                self._counts.rows += len(rows)
                for _, _, waiter in batch:
                    waiter.done.set()
        finally:
            self._leading = False


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _base(run_id: str, kind: str) -> dict[str, Any]:
    return {"at": _now(), "kind": kind, "run_id": run_id, "schema": SCHEMA}


def _intent(run_id: str, index: int, kind: str, payload: Any, **texts: Any) -> dict[str, Any]:
    role = "model" if kind == "model_call" else "action"
    return {
        **_base(run_id, "intent"),
        "action_text": texts.get("action_text"),
        "call_index": index,
        "history_text": texts.get("history_text"),
        "intent_kind": kind,
        "payload": payload,
        "replay": texts.get("replay", "allowed"),
        "result_id": f"{run_id}:{index}:{role}",
        "step": index,
    }


def _result(run_id: str, index: int, kind: str, payload: Any, duration_s: float) -> dict[str, Any]:
    role = "model" if kind == "model_call" else "action"
    return {
        **_base(run_id, "result"),
        "duration_s": duration_s,
        "intent_kind": kind,
        "payload": payload,
        "result_id": f"{run_id}:{index}:{role}",
    }


def _step_record(run_id: str, step: HandStep, duration_s: float) -> dict[str, Any]:
    return {
        **_base(run_id, "step"),
        "action_duration_s": step.action_duration_s,
        "action_status": "executed",
        "action_text": step.action_text,
        "call_id": None,
        "decision": "action",
        "done": False,
        "duration_s": duration_s,
        "error": None,
        "final_answer": None,
        "history_text": step.model_output,
        "model_duration_s": step.model_duration_s,
        "model_output": step.model_output,
        # The observation is in the action's result, written with this row (record 0063).
        "observation_of": f"{run_id}:{step.step}:action",
        "observation_synthesized": False,
        "reasoning": None,
        "step": step.step,
        "truncated_chars": 0,
    }


class DurableHandWorkload(HandWorkload):
    """``HandWorkload(trajectory=True)`` committing its run's rows with ``commit``, in
    groups."""

    def __init__(self, commit: Commit, *, steps: int, latency_s: float, tool_s: float) -> None:
        super().__init__(steps=steps, latency_s=latency_s, tool_s=tool_s, trajectory=True)
        self.journal = GroupCommitter(commit, self.counts)
        # What PolyLoop's start record keeps of the run's settings, about as large.
        self.snapshot: dict[str, Any] = {
            "budget.max_steps": steps + 1,
            "model.latency_s": latency_s,
            "model.steps": steps,
            "observation_template": "Observation: {observation}",
            "run_context.sha256": hashlib.sha256(SYSTEM_PROMPT.encode()).hexdigest(),
            "goal_context.sha256": hashlib.sha256(GOAL.encode()).hexdigest(),
            "tools": [
                {"name": "search", "parameters": SEARCH_SCHEMA, "replay": "allowed"},
                {"name": "submit", "parameters": SUBMIT_SCHEMA, "replay": "never"},
            ],
        }

    async def trajectory_of(self, run_id: str) -> list[HandStep]:
        start = {**_base(run_id, "run_started"), "snapshot": self.snapshot}
        await self.journal.write([(run_id, 0, ENCODER.encode(start))], barrier=True)
        transcript = [SYSTEM_PROMPT, GOAL]
        digest = hashlib.sha256("\n".join(transcript).encode())
        trajectory: list[HandStep] = []
        for index in range(self.steps):
            step = await self._step(run_id, index, 1 + ROWS_PER_STEP * index, digest)
            transcript += (step.model_output, f"Observation: {step.observation}")
            digest.update(step.model_output.encode())
            digest.update(transcript[-1].encode())
            trajectory.append(step)
        if not trajectory[-1].done:
            raise AssertionError(f"run {run_id!r} ended without submitting")
        end = {**_base(run_id, "run_ended"), "steps": self.steps, "stop_reason": "submitted"}
        seq = 1 + ROWS_PER_STEP * self.steps
        await self.journal.write([(run_id, seq, ENCODER.encode(end))], barrier=False)
        return trajectory

    async def _step(self, run_id: str, index: int, seq: int, digest: Any) -> HandStep:
        """One step, its rows from ``seq`` on, each write committed before it goes on."""
        write, encode = self.journal.write, ENCODER.encode
        began = time.monotonic()
        payload = {"messages_sha256": digest.hexdigest()}
        await write(
            [(run_id, seq, encode(_intent(run_id, index, "model_call", payload)))], barrier=True
        )
        asked = time.monotonic()
        await anyio.sleep(self.latency_s)
        model_s = time.monotonic() - asked
        content, tool, arguments = self._decided(index)
        reply = {"call_id": None, "content": content, "reasoning": None}
        model = _result(run_id, index, "model_call", reply, model_s)
        await write([(run_id, seq + 1, encode(model))], barrier=False)
        act = action_text(tool, arguments)
        call = {"arguments": arguments, "name": tool}
        replay = "allowed" if tool == "search" else "never"
        intent = _intent(
            run_id, index, "action", call, action_text=act, history_text=content, replay=replay
        )
        await write([(run_id, seq + 2, encode(intent))], barrier=True)
        started = time.monotonic()
        result = await self._acted(tool, arguments)
        ended = time.monotonic()
        step = HandStep(
            step=index,
            model_output=content,
            action_text=act,
            observation=result,
            done=tool == "submit",
            model_duration_s=model_s,
            action_duration_s=ended - started,
        )
        outcome = {"done": False, "observation": result, "status": "executed", "truncated_chars": 0}
        rows = [
            (run_id, seq + 3, encode(_result(run_id, index, "action", outcome, ended - started))),
            (run_id, seq + 4, encode(_step_record(run_id, step, ended - began))),
        ]
        await write(rows, barrier=False)
        return step


# -- the two databases -------------------------------------------------------------------


class SqliteRows:
    """One SQLite connection in WAL mode: ``synchronous=FULL`` for a group with a barrier
    and ``NORMAL`` for one without, as PolyLoop's SqliteStore switches them."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        if self.conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise RuntimeError(f"{path}: SQLite refused WAL journal mode")
        self.conn.execute("PRAGMA synchronous=FULL")
        self._full = True
        self.conn.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (run_id TEXT NOT NULL, seq INTEGER NOT NULL,"
            f" body TEXT NOT NULL, PRIMARY KEY (run_id, seq))"
        )

    def commit(self, rows: list[Row], barrier: bool) -> None:
        if self._full is not barrier:  # SQLite takes it only between transactions
            self.conn.execute(f"PRAGMA synchronous={'FULL' if barrier else 'NORMAL'}")
            self._full = barrier
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.executemany(f"INSERT INTO {TABLE} VALUES (?, ?, ?)", rows)
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.rollback()
            raise

    def close(self) -> None:
        self.conn.close()


class PostgresRows:
    """One autocommit psycopg connection: each group is one statement, one transaction,
    its rows sent as binary arrays; ``synchronous_commit`` off for that transaction
    unless a barrier is among them, as PolyLoop's PostgresStore does."""

    def __init__(self, conninfo: str, schema: str) -> None:
        import psycopg
        from psycopg import sql

        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.table = sql.Identifier(schema, TABLE)
        self.conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        self.conn.execute(
            sql.SQL(
                "CREATE TABLE {} (run_id text NOT NULL, seq integer NOT NULL,"
                " body text NOT NULL, PRIMARY KEY (run_id, seq))"
            ).format(self.table)
        )
        self.conn.execute("SET synchronous_commit = on")
        self.insert = sql.SQL(
            "WITH lazy AS (SELECT set_config('synchronous_commit', %(sync)s, true))"
            " INSERT INTO {} (run_id, seq, body) SELECT x.run_id, x.seq, x.body"
            " FROM unnest(%(run_ids)b::text[], %(seqs)b::integer[], %(bodies)b::text[])"
            " AS x(run_id, seq, body) CROSS JOIN lazy"
        ).format(self.table)

    def commit(self, rows: list[Row], barrier: bool) -> None:
        run_ids, seqs, bodies = zip(*rows, strict=True)
        self.conn.execute(
            self.insert,
            {
                "sync": "on" if barrier else "off",
                "run_ids": list(run_ids),
                "seqs": list(seqs),
                "bodies": list(bodies),
            },
        )

    def close(self) -> None:
        from psycopg import sql

        try:
            self.conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self.table))
        finally:
            self.conn.close()


@asynccontextmanager
async def hand_durable(
    database: str, where: str, *, steps: int, latency_s: float, tool_s: float
) -> AsyncIterator[DurableHandWorkload]:
    """A :class:`DurableHandWorkload` on ``sqlite`` (a file in the directory ``where``) or
    ``postgres`` (``where`` is ``conninfo#schema``; its table is created in that schema
    and dropped at the end)."""
    rows: SqliteRows | PostgresRows
    if database == "sqlite":
        rows = await anyio.to_thread.run_sync(SqliteRows, Path(where) / SQLITE_FILE)
    elif database == "postgres":
        conninfo, _, schema = where.partition("#")
        rows = await anyio.to_thread.run_sync(PostgresRows, conninfo, schema)
    else:
        raise ValueError(f"unknown database {database!r}")
    try:
        yield DurableHandWorkload(rows.commit, steps=steps, latency_s=latency_s, tool_s=tool_s)
    finally:
        await anyio.to_thread.run_sync(rows.close)
