"""The SQL the PostgreSQL store sends, and the values it derives from a run id.

:class:`Queries` holds every statement of one schema, with the schema quoted as an
identifier and every value left to a bound parameter. The helpers compute what the store
puts in a row (:func:`run_key`, :func:`run_id_column`) and the advisory lock keys
(:func:`owner_lock_key`, :func:`ddl_lock_key`). The store's module documentation
describes the schema these serve.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from psycopg import sql

__all__ = (
    "LAYOUT",
    "Queries",
    "Row",
    "ddl_lock_key",
    "lock_halves",
    "owner_lock_key",
    "run_id_column",
    "run_key",
)

# One row to insert: (kind, body).
Row = tuple[str, str]


def owner_lock_key(schema: str, owner_id: str) -> int:
    """The 64-bit advisory lock key an owner holds while it lives (a signed bigint).

    Advisory locks are per database, so the schema is part of the key: two schemas in one
    database never share a lock.
    """
    return _key(b"polyloop owner", schema, owner_id)


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


# The rows of a batch, one array per column, and its runs, one array per column: one
# statement text for any batch, so that the server plans it once per connection. The
# claim created each run's row (next_seq 0 until the run starts); a write moves it on.
_FENCED_WRITE = """
WITH w AS (
    SELECT * FROM unnest(%(run_keys)s::bytea[], %(epochs)s::bigint[],
                         %(first_seqs)s::bigint[], %(next_seqs)s::bigint[],
                         %(finals)s::boolean[], %(ends)s::boolean[], %(reasons)s::text[])
        AS w(run_key, epoch, first_seq, next_seq, final, ends, reason)
){lazy},
admitted AS (
    UPDATE {runs} AS r
    SET next_seq = w.next_seq, finished = w.final, stop_reason = w.reason,
        owner = CASE WHEN w.ends THEN NULL ELSE r.owner END,
        started_at = CASE WHEN w.first_seq = 0 THEN now() ELSE r.started_at END,
        updated_at = now()
    FROM w{lazy_join}
    WHERE r.run_key = w.run_key AND r.epoch = w.epoch AND r.next_seq = w.first_seq
      AND NOT r.finished
    RETURNING r.run_key
),
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
# setting), evaluated once, before any row is written, by the join that needs it.
_LAZY = ",\nlazy AS (SELECT set_config('synchronous_commit', 'off', true) AS setting)"
_LAZY_JOIN = " CROSS JOIN lazy"

# The owners whose claims still hold: lease not ended, and the owner's lock held by a
# live session (a dead process's sessions, and their locks, end with it).
_LIVE_OWNERS = """
held AS MATERIALIZED (
    SELECT classid::bigint AS hi, objid::bigint AS lo FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND database =
        (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
),
live AS (
    SELECT o.owner_id FROM {owners} AS o JOIN held ON held.hi = o.lock_hi AND held.lo = o.lock_lo
    WHERE o.lease_until > now()
)"""

# Claim a run: create its row (a new id), or take it over if nobody holds it, its owner
# is dead or its owner's lease has ended; either way move the claim epoch on, so that a
# former owner's writes are refused.
_CLAIM = """
WITH {live_owners}
INSERT INTO {runs} AS r (run_key, run_id, next_seq, finished, epoch, owner)
VALUES (%(run_key)s, %(run_id)s, 0, false, 1, %(owner)s)
ON CONFLICT (run_key) DO UPDATE SET epoch = r.epoch + 1, owner = EXCLUDED.owner
WHERE r.owner IS NULL OR r.owner NOT IN (SELECT owner_id FROM live)
RETURNING r.epoch, r.next_seq, r.finished
"""

# Give a claim up: the row of a run that never started goes, any other loses its owner.
_RELEASE = """
WITH gone AS (
    DELETE FROM {runs} WHERE run_key = %(run_key)s AND epoch = %(epoch)s AND next_seq = 0
)
UPDATE {runs} SET owner = NULL
WHERE run_key = %(run_key)s AND epoch = %(epoch)s AND next_seq > 0
"""

_LISTED = """
WITH {live_owners}
SELECT r.run_id, r.finished, r.updated_at, o.description, o.lease_until,
       live.owner_id IS NOT NULL
FROM {runs} AS r
LEFT JOIN {owners} AS o ON o.owner_id = r.owner
LEFT JOIN live ON live.owner_id = r.owner
WHERE r.next_seq > 0 """

# A schema from before the runs table: one row per run from its records, finished when
# its last record is a final end record. Bodies are canonical JSON, in which this key
# can only appear as itself (a quote inside a string is escaped).
_FILL_RUNS = """
INSERT INTO {runs} (run_key, run_id, next_seq, finished, stop_reason, epoch, started_at,
                    updated_at)
SELECT l.run_key, l.run_id, l.seq + 1,
       l.kind = 'run_ended' AND strpos(l.body, '"stop_reason":"cancelled"') = 0
         AND strpos(l.body, '"stop_reason":"in_doubt"') = 0,
       CASE WHEN l.kind = 'run_ended'
            THEN substring(l.body from '"stop_reason":"([a-z_]+)"') END,
       0, f.written_at, l.written_at
FROM (SELECT DISTINCT ON (run_key) run_key, run_id, seq, kind, body, written_at
      FROM {records} ORDER BY run_key, seq DESC) AS l
JOIN {records} AS f ON f.run_key = l.run_key AND f.seq = 0
ON CONFLICT (run_key) DO NOTHING
"""

# The tables, and what a schema made by an earlier release lacks; idempotent.
_DDL = (
    "CREATE SCHEMA IF NOT EXISTS {schema}",
    "CREATE TABLE IF NOT EXISTS {meta} (key text PRIMARY KEY, value text NOT NULL)",
    "CREATE TABLE IF NOT EXISTS {records} (run_key bytea NOT NULL, seq bigint NOT NULL, "
    "run_id text NOT NULL, kind text NOT NULL, body text NOT NULL, "
    "written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (run_key, seq))",
    "CREATE TABLE IF NOT EXISTS {runs} (run_key bytea PRIMARY KEY, run_id text NOT NULL, "
    "next_seq bigint NOT NULL, finished boolean NOT NULL, epoch bigint NOT NULL, "
    "started_at timestamptz NOT NULL DEFAULT now(), "
    "updated_at timestamptz NOT NULL DEFAULT now())",
    "ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS owner text",
    "ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS stop_reason text",
    # run_key, not the id: an index entry must fit in a third of a page.
    "CREATE INDEX IF NOT EXISTS runs_unfinished ON {runs} (started_at, run_key) WHERE NOT finished",
    "CREATE INDEX IF NOT EXISTS runs_owned ON {runs} (owner) WHERE owner IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS runs_finished ON {runs} (updated_at) WHERE finished",
    "CREATE TABLE IF NOT EXISTS {owners} (owner_id text PRIMARY KEY, "
    "description text NOT NULL, lock_hi bigint NOT NULL, lock_lo bigint NOT NULL, "
    "lease_until timestamptz NOT NULL, started_at timestamptz NOT NULL DEFAULT now())",
    # Layouts before 4 marked a run that ended in doubt finished; a settlement reopens
    # such a run, so their rows are reopened (a no-op once done).
    "UPDATE {runs} AS r SET finished = false FROM (SELECT DISTINCT ON (run_key) run_key,"
    " kind, body FROM {records} ORDER BY run_key, seq DESC) AS l WHERE r.finished"
    " AND l.run_key = r.run_key AND l.kind = 'run_ended'"
    ' AND strpos(l.body, \'"stop_reason":"in_doubt"\') > 0',
)
# The layout the DDL above makes; a schema with another (older) layout runs the DDL.
LAYOUT = "4"


@dataclass(frozen=True, slots=True)
class Queries:
    """Every statement the store sends, with the schema quoted as an identifier."""

    ddl: tuple[sql.Composed, ...]
    fill_runs: sql.Composed
    get_meta: sql.Composed
    set_meta: sql.Composed
    claim: sql.Composed
    release: sql.Composed
    holder: sql.Composed
    write: sql.Composed
    lazy_write: sql.Composed
    explain_refusal: sql.Composed
    select_run: sql.Composed
    list_runs: sql.Composed
    list_unfinished: sql.Composed
    describe_run: sql.Composed
    register_owner: sql.Composed
    renew_owner: sql.Composed
    drop_owner: sql.Composed
    forget_owners: sql.Composed
    prunable: sql.Composed
    prune_run: sql.Composed

    @classmethod
    def for_schema(cls, schema: str) -> Queries:
        names = {
            "schema": sql.Identifier(schema),
            "meta": sql.Identifier(schema, "meta"),
            "records": sql.Identifier(schema, "records"),
            "runs": sql.Identifier(schema, "runs"),
            "owners": sql.Identifier(schema, "owners"),
        }

        def q(text: str, **extra: sql.Composable) -> sql.Composed:
            return sql.SQL(text).format(**names, **extra)

        live_owners = q(_LIVE_OWNERS)
        listed = q(_LISTED, live_owners=live_owners)
        return cls(
            ddl=tuple(q(text) for text in _DDL),
            fill_runs=q(_FILL_RUNS),
            get_meta=q("SELECT key, value FROM {meta} WHERE key IN ('format', 'layout')"),
            set_meta=q(
                "INSERT INTO {meta} (key, value) VALUES (%s, %s) "
                "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value "
                "WHERE {meta}.key = 'layout'"
            ),
            claim=q(_CLAIM, live_owners=live_owners),
            release=q(_RELEASE),
            holder=q(
                "SELECT o.description, o.lease_until FROM {runs} AS r "
                "JOIN {owners} AS o ON o.owner_id = r.owner WHERE r.run_key = %s"
            ),
            write=q(_FENCED_WRITE, lazy=sql.SQL(""), lazy_join=sql.SQL("")),
            lazy_write=q(_FENCED_WRITE, lazy=sql.SQL(_LAZY), lazy_join=sql.SQL(_LAZY_JOIN)),
            explain_refusal=q("SELECT epoch, finished FROM {runs} WHERE run_key = %s"),
            select_run=q(
                "SELECT seq, run_id, kind, body FROM {records} WHERE run_key = %s ORDER BY seq"
            ),
            list_runs=listed + sql.SQL("ORDER BY r.started_at, r.run_key"),
            list_unfinished=listed + sql.SQL("AND NOT r.finished ORDER BY r.started_at, r.run_key"),
            describe_run=listed + sql.SQL("AND r.run_key = %s"),
            register_owner=q(
                "INSERT INTO {owners} (owner_id, description, lock_hi, lock_lo, lease_until) "
                "VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s))"
            ),
            # Only a lease that has not ended is renewed: once it has, others may have
            # taken its runs over, and the owner must know it lost them.
            renew_owner=q(
                "UPDATE {owners} SET lease_until = now() + make_interval(secs => %s) "
                "WHERE owner_id = %s AND lease_until > now()"
            ),
            drop_owner=q(
                "WITH freed AS (UPDATE {runs} SET owner = NULL WHERE owner = %s) "
                "DELETE FROM {owners} WHERE owner_id = %s"
            ),
            forget_owners=q(
                "DELETE FROM {owners} AS o WHERE o.lease_until < now() - interval '1 day' "
                "AND NOT EXISTS (SELECT 1 FROM {runs} AS r WHERE r.owner = o.owner_id)"
            ),
            prunable=q(
                "SELECT run_id FROM {runs} WHERE finished AND updated_at < %s "
                "AND owner IS NULL AND stop_reason IS DISTINCT FROM 'in_doubt' "
                "ORDER BY updated_at"
            ),
            # One run the pruner holds the claim of, checked again as it goes.
            prune_run=q(
                "WITH gone AS (DELETE FROM {runs} WHERE run_key = %(run_key)s "
                "AND epoch = %(epoch)s AND finished AND updated_at < %(before)s "
                "AND stop_reason IS DISTINCT FROM 'in_doubt' RETURNING run_key), "
                "wiped AS (DELETE FROM {records} WHERE run_key IN (SELECT run_key FROM gone)) "
                "SELECT count(*) FROM gone"
            ),
        )


def lock_halves(key: int) -> tuple[int, int]:
    """The two halves ``pg_locks`` shows of a bigint advisory lock key."""
    unsigned = key & ((1 << 64) - 1)
    return unsigned >> 32, unsigned & 0xFFFFFFFF
