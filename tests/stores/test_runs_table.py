"""Databases written before the table of runs existed get one, filled from their records.

The SQLite and PostgreSQL stores keep one row per run (where its log stands, whether it
finished, when it was last written) in the same transaction as each record. A database
made by an earlier release has only the records; the first store object that opens it
builds the table from them, and everything then works as on a new database.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from kit import pg
from polyloop import RunEnded, StopReason, serialization
from polyloop.stores import PostgresStore, SqliteStore
from polyloop.stores._sql.postgres.sql import run_id_column, run_key
from polyloop.testing.store_contract import expected_records, sample_run

pytestmark = pytest.mark.anyio

KIND = {
    "RunStarted": "run_started",
    "Intent": "intent",
    "Result": "result",
    "StepRecord": "step",
    "RunEnded": "run_ended",
}


def _old_runs() -> dict[str, list[Any]]:
    """Records of three runs: finished, cancelled (resumable), and interrupted."""
    cancelled = expected_records(sample_run("cancelled", steps=1, ended=False))
    cancelled.append(
        RunEnded(
            run_id="cancelled",
            stop_reason=StopReason.CANCELLED,
            final_answer=None,
            steps=1,
            valid_steps=1,
            detail="stop",
        )
    )
    return {
        "finished": expected_records(sample_run("finished", steps=2)),
        "cancelled": cancelled,
        "interrupted": expected_records(sample_run("interrupted", steps=1, ended=False)),
    }


async def _check(store: Any, runs: dict[str, list[Any]]) -> None:
    listed = {run.run_id: run for run in await store.list_runs()}
    assert sorted(listed) == sorted(runs)
    assert {run_id for run_id, run in listed.items() if run.finished} == {"finished"}
    unfinished = await store.list_runs(unfinished_only=True)
    assert sorted(run.run_id for run in unfinished) == ["cancelled", "interrupted"]
    for run_id, records in runs.items():
        assert list((await store.read_log(run_id)).records) == records
    # Writing goes on where each log stands, and the finished run stays closed.
    await store.claim_run("interrupted")
    _, (intent,) = sample_run("interrupted", steps=2)[5]
    await store.write_intent(intent)
    assert (await store.read_log("interrupted")).records[-1] == intent
    await store.claim_run("finished")
    with pytest.raises(Exception, match="ended"):
        await store.write_intent(sample_run("finished", steps=3)[9][1][0])


async def test_an_old_sqlite_database_gets_its_table_of_runs(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    runs = _old_runs()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute(
            "CREATE TABLE records (run_id TEXT NOT NULL, seq INTEGER NOT NULL, "
            "kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq))"
        )
        conn.execute("INSERT INTO meta VALUES ('format', 'polyloop/1')")
        for run_id, records in runs.items():
            conn.executemany(
                "INSERT INTO records VALUES (?, ?, ?, ?)",
                [
                    (run_id, seq, KIND[type(record).__name__], serialization.dumps(record))
                    for seq, record in enumerate(records)
                ],
            )
    conn.close()
    async with SqliteStore(path) as store:
        await _check(store, runs)


async def test_an_old_postgres_schema_gets_its_table_of_runs(
    postgres_shared: str, postgres_schemas: Any
) -> None:
    schema = postgres_schemas()
    runs = _old_runs()
    with pg.admin(postgres_shared) as conn:
        name = sql.Identifier(schema)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(name))
        conn.execute(
            sql.SQL("CREATE TABLE {}.meta (key text PRIMARY KEY, value text NOT NULL)").format(name)
        )
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.records (run_key bytea NOT NULL, seq bigint NOT NULL, "
                "run_id text NOT NULL, kind text NOT NULL, body text NOT NULL, "
                "written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (run_key, seq))"
            ).format(name)
        )
        conn.execute(sql.SQL("INSERT INTO {}.meta VALUES ('format', 'polyloop/1')").format(name))
        for run_id, records in runs.items():
            for seq, record in enumerate(records):
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {}.records (run_key, seq, run_id, kind, body) "
                        "VALUES (%s, %s, %s, %s, %s)"
                    ).format(name),
                    (
                        run_key(run_id),
                        seq,
                        run_id_column(run_id),
                        KIND[type(record).__name__],
                        serialization.dumps(record),
                    ),
                )
    async with PostgresStore(postgres_shared, schema=schema) as store:
        await _check(store, runs)
