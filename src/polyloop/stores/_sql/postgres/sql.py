"""The SQL the PostgreSQL store sends, its migration steps, and the keys it derives from a
run id (docs/stores.md#postgresstore)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow

from polyloop.stores._sql.paging import Dialect
from polyloop.stores._sql.schema import Layout

Connection = psycopg.Connection[TupleRow]


def owner_lock(schema: str, owner_id: str) -> tuple[int, int, int]:
    """The advisory lock key an owner holds while it lives (the schema is part of it:
    advisory locks are per database), and the two halves ``pg_locks`` shows of it."""
    key = _key(b"polyloop owner", schema, owner_id)
    unsigned = key & ((1 << 64) - 1)
    return key, unsigned >> 32, unsigned & 0xFFFFFFFF


def _key(purpose: bytes, schema: str, name: str) -> int:
    parts = (purpose, schema.encode(), name.encode("utf-8", "surrogatepass"))
    return int.from_bytes(hashlib.sha256(b"\x00".join(parts)).digest()[:8], "big", signed=True)


def channel(schema: str) -> str:
    """The channel the store in ``schema`` notifies: a plain identifier of 25 bytes,
    whatever the schema's name (a channel name has at most 63 bytes)."""
    digest = hashlib.sha256(b"polyloop changes\x00" + schema.encode("utf-8", "surrogatepass"))
    return f"polyloop_{digest.hexdigest()[:16]}"


def appended_channel(schema: str, run_id: str) -> str:
    """The channel a committed batch that wrote the run notifies, for the run's followers:
    a channel a run (a hash's first 8 bytes), so that a listener hears only of the runs it
    follows. The SQL spells it from the ``run_key`` column (``_APPENDED_TO``)."""
    return f"{channel(schema)}_{run_key(run_id)[:8].hex()}"


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


# A batch as one array per run column, and its rows as two texts (kinds and bodies, one
# a line: canonical JSON holds no raw newline), so that nothing is dumped row by row
# (record 0067). A row's run key, run id and seq come from its run's row, by position.
# Binary (``%(...)b``): as text, psycopg escapes each JSON quote slowly (record 0049).
_FENCED_WRITE = """
WITH w AS (
    SELECT * FROM unnest(%(run_keys)b::bytea[], %(epochs)b::bigint[], %(first_seqs)b::bigint[],
                         %(next_seqs)b::bigint[], %(finals)b::boolean[], %(ends)b::boolean[],
                         %(reasons)b::text[], %(fenceds)b::boolean[], %(announces)b::boolean[],
                         %(first_rows)b::bigint[])
        AS w(run_key, epoch, first_seq, next_seq, final, ends, reason, fenced, announce, first_row)
){lazy},
admitted AS (
    UPDATE {runs} AS r SET next_seq = w.next_seq, finished = w.final, stop_reason = w.reason,
        owner = CASE WHEN w.ends THEN NULL ELSE r.owner END, updated_at = now(),
        started_at = CASE WHEN w.first_seq = 0 THEN now() ELSE r.started_at END
    FROM w{lazy_join}
    WHERE r.run_key = w.run_key AND r.epoch = w.epoch AND r.next_seq = w.first_seq
      AND NOT r.finished AND (NOT w.fenced OR r.cancel_at IS NULL)
    RETURNING r.run_key, r.run_id, w.first_seq, w.next_seq, w.first_row,
        CASE WHEN w.announce THEN {notify_run} END AS announced, {notify_appended} AS appended
),
inserted AS (
    INSERT INTO {records} (run_key, seq, run_id, kind, body)
    SELECT a.run_key, a.first_seq + g.n - a.first_row, a.run_id, x.kind, x.body
    FROM admitted AS a
    CROSS JOIN LATERAL generate_series(a.first_row, a.first_row + a.next_seq - a.first_seq - 1)
        AS g(n)
    JOIN unnest(string_to_array(%(kinds)b::text, E'\\n'),
                string_to_array(%(bodies)b::text, E'\\n')) WITH ORDINALITY AS x(kind, body, n)
        ON x.n = g.n
)
SELECT run_key, announced, appended FROM admitted
"""
# A notification on the store's channel, sent when the transaction commits; its payload
# is the run id as the ``run_id`` column spells it, or empty past NOTIFY's 8000 bytes.
_NOTIFY = "pg_notify({channel}, CASE WHEN octet_length({column}) < 8000 THEN {column} ELSE '' END)"
# Each run a batch wrote also notifies its followers' channel (``appended_channel``),
# empty: a process that follows other runs is not woken at all (record 0072).
_APPENDED_TO = "pg_notify({prefix} || encode(substr({key}, 1, 8), 'hex'), '')"
# Without a barrier, no wait for the flush: ``SET LOCAL``, before any row is written.
_LAZY = ",\nlazy AS (SELECT set_config('synchronous_commit', 'off', true) AS setting)"
_LAZY_JOIN = " CROSS JOIN lazy"

# Owners whose claims hold: lease not ended, and their lock held by a live session or
# more than the lock margin left (a lost session's owner may still act; record 0034).
_LIVE_OWNERS = """
held AS MATERIALIZED (
    SELECT classid::bigint AS hi, objid::bigint AS lo FROM pg_catalog.pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND database =
        (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
),
live AS (
    SELECT o.owner_id FROM {owners} AS o
    LEFT JOIN held ON held.hi = o.lock_hi AND held.lo = o.lock_lo
    WHERE o.lease_until > now() AND (held.hi IS NOT NULL
        OR o.lease_until > now() + make_interval(secs => o.lock_margin_s))
)"""

# Create the run's row or take it over from no live owner; the new epoch fences the old.
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
),
freed AS (
    UPDATE {runs} SET owner = NULL
    WHERE run_key = %(run_key)s AND epoch = %(epoch)s AND next_seq > 0 RETURNING run_id
)
SELECT {notify_freed} FROM freed
"""

_LISTED = """
WITH {live_owners}
SELECT r.run_id, r.finished, r.updated_at, o.description, o.lease_until,
       live.owner_id IS NOT NULL, r.cancel_at IS NOT NULL
FROM {runs} AS r LEFT JOIN {owners} AS o ON o.owner_id = r.owner
LEFT JOIN live ON live.owner_id = r.owner
WHERE r.next_seq > 0 """

# Migration steps; each statement is safe to run again (an older release may reset layout).
_STEPS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE SCHEMA IF NOT EXISTS {schema}",
        "CREATE TABLE IF NOT EXISTS {meta} (key text PRIMARY KEY, value text NOT NULL)",
        "CREATE TABLE IF NOT EXISTS {records} (run_key bytea NOT NULL, seq bigint NOT NULL,"
        " run_id text NOT NULL, kind text NOT NULL, body text NOT NULL,"
        " written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (run_key, seq))",
    ),
    2: (
        "CREATE TABLE IF NOT EXISTS {runs} (run_key bytea PRIMARY KEY, run_id text NOT NULL,"
        " next_seq bigint NOT NULL, finished boolean NOT NULL, epoch bigint NOT NULL,"
        " started_at timestamptz NOT NULL DEFAULT now(),"
        " updated_at timestamptz NOT NULL DEFAULT now(), owner text, stop_reason text)",
        # run_key, not the id: an index entry must fit in a third of a page.
        "CREATE INDEX IF NOT EXISTS runs_unfinished ON {runs} (started_at, run_key)"
        " WHERE NOT finished",
        # One row per run of the records, finished if its last record is a final end
        # record. Bodies are canonical JSON, where this key can only be itself.
        "INSERT INTO {runs} (run_key, run_id, next_seq, finished, stop_reason, epoch, started_at,"
        " updated_at) SELECT l.run_key, l.run_id, l.seq + 1, l.kind = 'run_ended'"
        """ AND strpos(l.body, '"stop_reason":"cancelled"') = 0"""
        """ AND strpos(l.body, '"stop_reason":"in_doubt"') = 0, CASE WHEN l.kind = 'run_ended'"""
        """ THEN substring(l.body from '"stop_reason":"([a-z_]+)"') END, 0, f.written_at,"""
        " l.written_at FROM (SELECT DISTINCT ON (run_key) run_key, run_id, seq, kind, body,"
        " written_at FROM {records} ORDER BY run_key, seq DESC) AS l"
        " JOIN {records} AS f ON f.run_key = l.run_key AND f.seq = 0"
        " ON CONFLICT (run_key) DO NOTHING",
    ),
    3: (
        "ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS owner text",
        "ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS stop_reason text",
        "CREATE INDEX IF NOT EXISTS runs_owned ON {runs} (owner) WHERE owner IS NOT NULL",
        "CREATE INDEX IF NOT EXISTS runs_finished ON {runs} (updated_at) WHERE finished",
        "CREATE TABLE IF NOT EXISTS {owners} (owner_id text PRIMARY KEY,"
        " description text NOT NULL, lock_hi bigint NOT NULL, lock_lo bigint NOT NULL,"
        " lease_until timestamptz NOT NULL, started_at timestamptz NOT NULL DEFAULT now())",
    ),
    # Releases before settlements marked a run that ended in doubt finished; a
    # settlement reopens such a run.
    4: (
        "UPDATE {runs} AS r SET finished = false FROM (SELECT DISTINCT ON (run_key) run_key,"
        " kind, body FROM {records} ORDER BY run_key, seq DESC) AS l WHERE r.finished"
        " AND l.run_key = r.run_key AND l.kind = 'run_ended'"
        ' AND strpos(l.body, \'"stop_reason":"in_doubt"\') > 0',
    ),
    5: ("ALTER TABLE {owners} ADD COLUMN IF NOT EXISTS lock_margin_s double precision",),
    # A run's cancel request, kept in its row: later intents and proposals yield to it.
    6: (
        "ALTER TABLE {runs} ADD COLUMN IF NOT EXISTS cancel_by text,"
        " ADD COLUMN IF NOT EXISTS cancel_reason text,"
        " ADD COLUMN IF NOT EXISTS cancel_at timestamptz",
    ),
    # A page of runs, most recent first, read in order from the index (record 0076);
    # the id is left out, as an index entry must fit in a third of a page: runs of one
    # time are few, and sorted by id as they are read.
    7: ("CREATE INDEX IF NOT EXISTS runs_recent ON {runs} (updated_at DESC)",),
}


PAGED = Dialect(
    mark="%({})s".format,
    finished=("r.finished", "NOT r.finished"),
    tie='r.run_id COLLATE "C"',
    stamp=datetime,
    time=lambda at: at,
    key=run_id_column,
)


class Queries:
    """Every statement the store sends, with the schema quoted as an identifier."""

    def __init__(self, schema: str) -> None:
        names = {
            name: sql.Identifier(schema, name) for name in ("meta", "records", "runs", "owners")
        }

        self.channel = channel(schema)

        def notify(column: str) -> sql.Composed:
            return sql.SQL(_NOTIFY).format(
                channel=sql.Literal(self.channel), column=sql.SQL(column)
            )

        def notify_appended(key: str) -> sql.Composed:
            prefix = sql.Literal(f"{self.channel}_")
            return sql.SQL(_APPENDED_TO).format(prefix=prefix, key=sql.SQL(key))

        def q(text: str, **extra: sql.Composable) -> sql.Composed:
            return sql.SQL(text).format(schema=sql.Identifier(schema), **names, **extra)

        self.layout = Layout(
            steps=_STEPS,
            compose=q,
            exists=q(
                "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = {name}"
                " AND tablename = %s",
                name=sql.Literal(schema),
            ),
            locked=partial(_locked, key=_key(b"polyloop ddl", schema, "")),
            holder="schema",
        )
        live_owners = q(_LIVE_OWNERS)
        listed = q(_LISTED, live_owners=live_owners)
        self.claim = q(_CLAIM, live_owners=live_owners)
        self.release = q(_RELEASE, notify_freed=notify("freed.run_id"))
        self.holder = q(
            "SELECT o.description, o.lease_until FROM {runs} AS r"
            " JOIN {owners} AS o ON o.owner_id = r.owner WHERE r.run_key = %s"
        )
        notified = {
            "notify_run": notify("r.run_id"),
            "notify_appended": notify_appended("r.run_key"),
        }
        self.write = q(_FENCED_WRITE, lazy=sql.SQL(""), lazy_join=sql.SQL(""), **notified)
        self.lazy_write = q(
            _FENCED_WRITE, lazy=sql.SQL(_LAZY), lazy_join=sql.SQL(_LAZY_JOIN), **notified
        )
        self.rows_now = q(
            "SELECT run_key, epoch, finished, next_seq, cancel_by, cancel_reason, cancel_at"
            " FROM {runs} WHERE run_key = ANY(%s)"
        )
        # The run's row keeps the first request; its lock orders a request and an intent.
        self.request_cancel = q(
            "WITH asked AS (UPDATE {runs} SET cancel_by = coalesce(cancel_by, %(by)s),"
            " cancel_reason = coalesce(cancel_reason, %(reason)s),"
            " updated_at = CASE WHEN cancel_at IS NULL THEN now() ELSE updated_at END,"
            " cancel_at = coalesce(cancel_at, %(at)s)"
            " WHERE run_key = %(run_key)s AND next_seq > 0 RETURNING run_id)"
            " SELECT {notify_asked} FROM asked",
            notify_asked=notify("asked.run_id"),
        )
        self.read_cancel = q(
            "SELECT cancel_by, cancel_reason, cancel_at FROM {runs}"
            " WHERE run_key = %s AND cancel_at IS NOT NULL"
        )
        self.select_run = q(
            "SELECT seq, kind, body, run_id FROM {records} WHERE run_key = %s ORDER BY seq"
        )
        self.select_after = q(
            "SELECT seq, kind, body, run_id FROM {records} WHERE run_key = %s AND seq >= %s"
            " ORDER BY seq"
        )
        self.run_started = q("SELECT 1 FROM {runs} WHERE run_key = %s AND next_seq > 0")
        order = "ORDER BY r.started_at, r.run_key"
        self.list_runs = listed + sql.SQL(order)
        self.list_unfinished = listed + sql.SQL("AND NOT r.finished " + order)
        self.describe_run = listed + sql.SQL("AND r.run_key = %s")
        self.listed = listed
        self.register_owner = q(
            "INSERT INTO {owners} (owner_id, description, lock_hi, lock_lo, lease_until,"
            " lock_margin_s) VALUES (%(owner)s, %(description)s, %(hi)s, %(lo)s,"
            " now() + make_interval(secs => %(lease_s)s), %(margin_s)s)"
        )
        # Past the lock margin a worker may have taken a run over: no renewal then.
        self.renew_owner = q(
            "UPDATE {owners} SET lease_until = now() + make_interval(secs => %(lease_s)s)"
            " WHERE owner_id = %(owner)s"
            " AND lease_until > now() + make_interval(secs => lock_margin_s)"
        )
        # The runs it frees are told about: another host may go on with them now.
        self.drop_owner = q(
            "WITH freed AS (UPDATE {runs} SET owner = NULL WHERE owner = %s"
            " RETURNING run_id, next_seq), gone AS (DELETE FROM {owners} WHERE owner_id = %s)"
            " SELECT {notify_freed} FROM freed WHERE next_seq > 0",
            notify_freed=notify("freed.run_id"),
        )
        self.forget_owners = q(
            "DELETE FROM {owners} AS o WHERE o.lease_until < now() - interval '1 day'"
            " AND NOT EXISTS (SELECT 1 FROM {runs} AS r WHERE r.owner = o.owner_id)"
        )
        self.prunable = q(
            "SELECT run_id FROM {runs} WHERE finished AND updated_at < %s AND owner IS NULL"
            " AND stop_reason IS DISTINCT FROM 'in_doubt' ORDER BY updated_at"
        )
        # One run the pruner holds the claim of, checked again as it goes; its followers
        # are told, so that they end.
        self.prune_run = q(
            "WITH gone AS (DELETE FROM {runs} WHERE run_key = %(run_key)s"
            " AND epoch = %(epoch)s AND finished AND updated_at < %(before)s"
            " AND stop_reason IS DISTINCT FROM 'in_doubt' RETURNING run_key, run_id),"
            " wiped AS (DELETE FROM {records} WHERE run_key IN (SELECT run_key FROM gone))"
            " SELECT count(*), (SELECT {notify_gone} FROM gone) FROM gone",
            notify_gone=notify_appended("gone.run_key"),
        )


@contextmanager
def _locked(conn: Any, *, key: int) -> Iterator[None]:
    """A transaction holding the schema's advisory lock, so one process upgrades it."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
        yield
