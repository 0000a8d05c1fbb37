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
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from polyloop import serialization
from polyloop.types import Intent, Record, Result, RunEnded, RunStarted, StepRecord

__all__ = (
    "KIND",
    "Queries",
    "Row",
    "ddl_lock_key",
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


@dataclass(frozen=True, slots=True)
class Queries:
    """Every statement the store sends, with the schema quoted as an identifier."""

    tables: sql.SQL
    create_schema: sql.Composed
    create_meta: sql.Composed
    create_records: sql.Composed
    set_format: sql.Composed
    get_format: sql.Composed
    next_seq: sql.Composed
    insert: sql.Composed
    row: sql.SQL
    lazy_insert: sql.Composed
    lazy_row: sql.SQL
    lazy_commit: sql.SQL
    unlock: sql.SQL
    unlock_all_of: sql.SQL
    select_run: sql.Composed
    select_run_ids: sql.Composed
    inserts: dict[tuple[int, bool], sql.Composed] = field(default_factory=dict)

    def insert_rows(self, count: int, *, lazy: bool = False) -> sql.Composed:
        """An ``INSERT`` of ``count`` rows (built once per shape, then reused).

        A ``lazy`` one also calls ``set_config('synchronous_commit', 'off', true)``, the
        function form of ``SET LOCAL``: run alone on an autocommit connection, it is a
        transaction that commits without waiting for the flush, and the session keeps
        its own setting. (PostgreSQL never drops a volatile call from a subquery.)
        """
        query = self.inserts.get((count, lazy))
        if query is None:
            if lazy:
                rows = sql.SQL(", ").join([self.lazy_row] * count)
                query = self.lazy_insert + rows + self.lazy_commit
            else:
                query = self.insert + sql.SQL(", ").join([self.row] * count)
            self.inserts[count, lazy] = query
        return query

    @classmethod
    def for_schema(cls, schema: str) -> Queries:
        name = sql.Identifier(schema)
        meta, records = sql.Identifier(schema, "meta"), sql.Identifier(schema, "records")
        insert = sql.SQL("INSERT INTO {} (run_key, seq, run_id, kind, body) VALUES ").format(
            records
        )
        row = sql.SQL("(%s, %s, %s, %s, %s)")
        return cls(
            tables=sql.SQL(
                "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = %s "
                "AND tablename IN ('meta', 'records')"
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
            set_format=sql.SQL(
                "INSERT INTO {} (key, value) VALUES ('format', %s) ON CONFLICT (key) DO NOTHING"
            ).format(meta),
            get_format=sql.SQL("SELECT value FROM {} WHERE key = 'format'").format(meta),
            next_seq=sql.SQL(
                "SELECT coalesce(max(seq) + 1, 0) FROM {} WHERE run_key = %s"
            ).format(records),
            insert=insert,
            row=row,
            lazy_insert=sql.SQL(
                "INSERT INTO {} (run_key, seq, run_id, kind, body) SELECT v.* FROM (VALUES "
            ).format(records),
            lazy_row=sql.SQL("(%s::bytea, %s::bigint, %s::text, %s::text, %s::text)"),
            lazy_commit=sql.SQL(
                ") AS v CROSS JOIN (SELECT set_config('synchronous_commit', 'off', true)) AS lazy"
            ),
            unlock=sql.SQL("SELECT pg_advisory_unlock(%s)"),
            unlock_all_of=sql.SQL("SELECT pg_advisory_unlock(k) FROM unnest(%s::bigint[]) AS k"),
            select_run=sql.SQL(
                "SELECT seq, run_id, kind, body FROM {} WHERE run_key = %s ORDER BY seq"
            ).format(records),
            select_run_ids=sql.SQL(
                "SELECT run_id FROM {} WHERE seq = 0 ORDER BY written_at, run_id"
            ).format(records),
        )
