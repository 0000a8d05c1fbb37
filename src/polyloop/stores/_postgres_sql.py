"""The SQL the PostgreSQL store sends, and the values it derives from a run id.

:class:`Queries` holds every statement of one schema, with the schema quoted as an
identifier and every value left to a bound parameter. The helpers compute what the store
puts in a row (:func:`run_key`, :func:`run_id_column`, :func:`record_row`), the advisory
lock keys (:func:`run_lock_key`, :func:`ddl_lock_key`), and how an id appears in an
error (:func:`shown`). The store's module documentation describes the schema these
serve.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from polyloop import serialization
from polyloop.types import Intent, Record, Result, RunEnded, RunStarted, StepRecord

__all__ = (
    "KIND",
    "Queries",
    "Row",
    "ddl_lock_key",
    "lock_halves",
    "lock_key_of",
    "record_row",
    "run_id_column",
    "run_key",
    "run_lock_key",
    "shown",
)

# One row to insert: (kind, body).
Row = tuple[str, str]

KIND: dict[type[Any], str] = {
    RunStarted: "run_started",
    Intent: "intent",
    Result: "result",
    StepRecord: "step",
    RunEnded: "run_ended",
}
_SHOWN_ID_CHARS = 60


def run_lock_key(schema: str, run_id: str) -> int:
    """The 64-bit advisory lock key of ``run_id`` in ``schema`` (a signed bigint).

    Advisory locks are per database, so the schema is part of the key: two schemas in one
    database never lock each other's runs.
    """
    return _key(b"polyloop run", schema, run_id)


def ddl_lock_key(schema: str) -> int:
    """The advisory lock key that keeps processes from running the DDL at the same time."""
    return _key(b"polyloop ddl", schema, "")


def _key(purpose: bytes, schema: str, run_id: str) -> int:
    digest = hashlib.sha256(
        b"\x00".join((purpose, schema.encode(), run_id.encode("utf-8", "surrogatepass")))
    ).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def run_key(run_id: str) -> bytes:
    """The ``run_key`` column value: the sha256 of the run id."""
    return hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).digest()


def run_id_column(run_id: str) -> str:
    """The ``run_id`` column value: the id with JSON string escaping (injective)."""
    text = json.dumps(run_id, ensure_ascii=False)[1:-1]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape everything outside ASCII
        text = json.dumps(run_id)[1:-1]
    return text


def shown(run_id: str) -> str:
    """``run_id`` quoted and cut short, for error locations."""
    text = repr(run_id)
    return text if len(text) <= _SHOWN_ID_CHARS else text[: _SHOWN_ID_CHARS - 3] + "..."


def record_row(record: Record) -> Row:
    """The (kind, body) row that holds ``record``."""
    body = serialization.dumps(record)  # refuses anything that is not a record
    return KIND[type(record)], body


# The rows of a batch, one array per column, and its runs, one array per column: one
# statement text for any batch, so that the server plans it once per connection.
_FENCED_WRITE = """
WITH w AS (
    SELECT * FROM unnest(%(run_keys)s::bytea[], %(run_ids)s::text[], %(epochs)s::bigint[],
                         %(first_seqs)s::bigint[], %(next_seqs)s::bigint[],
                         %(finals)s::boolean[], %(starts)s::boolean[])
        AS w(run_key, run_id, epoch, first_seq, next_seq, final, start)
){lazy},
started AS (
    INSERT INTO {runs} AS r (run_key, run_id, next_seq, finished, epoch)
    SELECT w.run_key, w.run_id, w.next_seq, w.final, w.epoch FROM w{lazy_join} WHERE w.start
    ON CONFLICT (run_key) DO NOTHING
    RETURNING r.run_key
),
advanced AS (
    UPDATE {runs} AS r
    SET next_seq = w.next_seq, finished = w.final, updated_at = now()
    FROM w{lazy_join}
    WHERE NOT w.start AND r.run_key = w.run_key AND r.epoch = w.epoch
      AND r.next_seq = w.first_seq AND NOT r.finished
    RETURNING r.run_key
),
admitted AS (SELECT run_key FROM started UNION ALL SELECT run_key FROM advanced),
inserted AS (
    INSERT INTO {records} (run_key, seq, run_id, kind, body)
    SELECT x.run_key, x.seq, x.run_id, x.kind, x.body
    FROM unnest(%(row_keys)s::bytea[], %(seqs)s::bigint[], %(row_ids)s::text[],
                %(kinds)s::text[], %(bodies)s::text[]) AS x(run_key, seq, run_id, kind, body)
    JOIN admitted USING (run_key)
)
SELECT run_key FROM admitted
"""
# Without a barrier a batch commits without waiting for the flush: ``set_config(...,
# true)`` is ``SET LOCAL`` for the statement's own transaction (the session keeps its
# setting), evaluated once, before any row is written, by the joins that need it.
_LAZY = ",\nlazy AS (SELECT set_config('synchronous_commit', 'off', true) AS setting)"
_LAZY_JOIN = " CROSS JOIN lazy"

# Take the run's advisory lock; once held, move the run's claim epoch on (if the run
# has a row), so that a writer still holding an older epoch can write nothing.
_CLAIM = """
WITH lock AS (SELECT pg_try_advisory_lock(%(key)s) AS got),
bumped AS (
    UPDATE {runs} AS r SET epoch = r.epoch + 1 FROM lock
    WHERE lock.got AND r.run_key = %(run_key)s
    RETURNING r.epoch, r.next_seq, r.finished
)
SELECT lock.got, bumped.epoch, bumped.next_seq, bumped.finished FROM lock LEFT JOIN bumped ON true
"""

# A schema from before the runs table: one row per run from its records, finished when
# its last record is a final end record. Bodies are canonical JSON, in which this key
# and value can only appear as themselves (a quote inside a string is escaped).
_FILL_RUNS = """
INSERT INTO {runs} (run_key, run_id, next_seq, finished, epoch, started_at, updated_at)
SELECT l.run_key, l.run_id, l.seq + 1,
       l.kind = 'run_ended' AND strpos(l.body, '"stop_reason":"cancelled"') = 0,
       0, f.written_at, l.written_at
FROM (SELECT DISTINCT ON (run_key) run_key, run_id, seq, kind, body, written_at
      FROM {records} ORDER BY run_key, seq DESC) AS l
JOIN {records} AS f ON f.run_key = l.run_key AND f.seq = 0
ON CONFLICT (run_key) DO NOTHING
"""


@dataclass(frozen=True, slots=True)
class Queries:
    """Every statement the store sends, with the schema quoted as an identifier."""

    tables: sql.SQL
    create_schema: sql.Composed
    create_meta: sql.Composed
    create_records: sql.Composed
    create_runs: sql.Composed
    create_unfinished_index: sql.Composed
    fill_runs: sql.Composed
    set_format: sql.Composed
    get_format: sql.Composed
    claim: sql.Composed
    write: sql.Composed
    lazy_write: sql.Composed
    explain_refusal: sql.Composed
    unlock: sql.SQL
    unlock_all_of: sql.SQL
    select_run: sql.Composed
    list_runs: sql.Composed
    list_unfinished: sql.Composed
    describe_run: sql.Composed
    advisory_locks: sql.SQL
    advisory_lock_held: sql.SQL

    @classmethod
    def for_schema(cls, schema: str) -> Queries:
        name = sql.Identifier(schema)
        meta = sql.Identifier(schema, "meta")
        records = sql.Identifier(schema, "records")
        runs = sql.Identifier(schema, "runs")

        def write(lazy: bool) -> sql.Composed:
            return sql.SQL(_FENCED_WRITE).format(
                runs=runs, records=records,
                lazy=sql.SQL(_LAZY if lazy else ""),
                lazy_join=sql.SQL(_LAZY_JOIN if lazy else ""),
            )

        listed = sql.SQL("SELECT run_id, finished, updated_at FROM {} ").format(runs)
        return cls(
            tables=sql.SQL(
                "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = %s "
                "AND tablename IN ('meta', 'records', 'runs')"
            ),
            create_schema=sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(name),
            create_meta=sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (key text PRIMARY KEY, value text NOT NULL)"
            ).format(meta),
            create_records=sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (run_key bytea NOT NULL, seq bigint NOT NULL, "
                "run_id text NOT NULL, kind text NOT NULL, body text NOT NULL, "
                "written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (run_key, seq))"
            ).format(records),
            create_runs=sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (run_key bytea PRIMARY KEY, run_id text NOT NULL, "
                "next_seq bigint NOT NULL, finished boolean NOT NULL, epoch bigint NOT NULL, "
                "started_at timestamptz NOT NULL DEFAULT now(), "
                "updated_at timestamptz NOT NULL DEFAULT now())"
            ).format(runs),
            create_unfinished_index=sql.SQL(
                # run_key, not the id: an index entry must fit in a third of a page
                "CREATE INDEX IF NOT EXISTS {} ON {} (started_at, run_key) WHERE NOT finished"
            ).format(sql.Identifier("runs_unfinished"), runs),
            fill_runs=sql.SQL(_FILL_RUNS).format(runs=runs, records=records),
            set_format=sql.SQL(
                "INSERT INTO {} (key, value) VALUES ('format', %s) ON CONFLICT (key) DO NOTHING"
            ).format(meta),
            get_format=sql.SQL("SELECT value FROM {} WHERE key = 'format'").format(meta),
            claim=sql.SQL(_CLAIM).format(runs=runs),
            write=write(lazy=False),
            lazy_write=write(lazy=True),
            explain_refusal=sql.SQL(
                "SELECT epoch, next_seq, finished FROM {} WHERE run_key = %s"
            ).format(runs),
            unlock=sql.SQL("SELECT pg_advisory_unlock(%s)"),
            unlock_all_of=sql.SQL("SELECT pg_advisory_unlock(k) FROM unnest(%s::bigint[]) AS k"),
            select_run=sql.SQL(
                "SELECT seq, run_id, kind, body FROM {} WHERE run_key = %s ORDER BY seq"
            ).format(records),
            list_runs=listed + sql.SQL("ORDER BY started_at, run_key"),
            list_unfinished=listed + sql.SQL("WHERE NOT finished ORDER BY started_at, run_key"),
            describe_run=listed + sql.SQL("WHERE run_key = %s"),
            advisory_locks=sql.SQL(
                "SELECT classid::bigint, objid::bigint FROM pg_catalog.pg_locks "
                "WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND database = "
                "(SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())"
            ),
            advisory_lock_held=sql.SQL(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks "
                "WHERE locktype = 'advisory' AND objsubid = 1 AND granted "
                "AND classid::bigint = %s AND objid::bigint = %s AND database = "
                "(SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()))"
            ),
        )


def lock_halves(key: int) -> tuple[int, int]:
    """The two halves ``pg_locks`` shows of a bigint advisory lock key."""
    unsigned = key & ((1 << 64) - 1)
    return unsigned >> 32, unsigned & 0xFFFFFFFF


def lock_key_of(classid: int, objid: int) -> int:
    """The bigint key of an advisory lock, from the two halves ``pg_locks`` shows."""
    key = (classid << 32) | objid
    return key - (1 << 64) if key >= 1 << 63 else key
