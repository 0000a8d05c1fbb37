"""The reading side of a PostgreSQL store object: its pool, its schema, its reads.

:class:`Reader` opens the pool of reader connections (never used for writes), creates or
upgrades the schema's tables once per store object under an advisory lock, checks the
record format, and turns rows back into records and :class:`~polyloop.ports.StoredRun`
values, refusing any row that does not belong where it is. Readers take no writer lock
and no claim. ``docs/stores.md`` describes the tables; research record 0011 (durability)
says why they are laid out so.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._common import (
    WriterState,
    check_format,
    decode_row,
    open_files_error,
    shown,
)
from polyloop.stores._refusals import store_closed
from polyloop.stores._sql.postgres.connect import (
    Connection,
    Settings,
    scalar,
    set_statement_timeout,
)
from polyloop.stores._sql.postgres.sql import (
    LAYOUT,
    Queries,
    ddl_lock_key,
    run_id_column,
    run_key,
)
from polyloop.types import CorruptLog, Record, StoreError

__all__ = ("Reader",)

_READER_NAME = "polyloop-reader"


class Reader:
    """The reader pool of one store object, opened and checked on first use.

    Every method blocks: call it from a worker thread, where it runs to its end once
    started (a cancellation waits for it). ``state`` says whether the store is closed.
    """

    __slots__ = ("_lock", "_pool", "_queries", "_ready", "_settings", "_state")

    def __init__(self, settings: Settings, queries: Queries, state: WriterState) -> None:
        self._settings = settings
        self._queries = queries
        self._state = state
        self._lock = threading.Lock()
        self._ready = False
        self._pool: ConnectionPool[Connection] | None = None

    def read(self, run_id: str) -> tuple[Record, ...]:
        """Every record of ``run_id`` in write order, each checked against its row."""
        with self._reading(run_id) as conn:
            rows = conn.execute(self._queries.select_run, (run_key(run_id),)).fetchall()
        return tuple(self._decode_row(run_id, index, row) for index, row in enumerate(rows))

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        """Every started run (only unfinished ones if asked), in the order they started."""
        query = self._queries.list_unfinished if unfinished_only else self._queries.list_runs
        with self._reading(None) as conn:
            rows = conn.execute(query).fetchall()
        return tuple(self._stored(row) for row in rows)

    def describe(self, run_id: str) -> StoredRun | None:
        with self._reading(run_id) as conn:
            row = conn.execute(self._queries.describe_run, (run_key(run_id),)).fetchone()
        return None if row is None else self._stored(row)

    def prunable(self, cutoff: datetime) -> list[str]:
        """The runs that finished before ``cutoff``, unclaimed and not in doubt, oldest first."""
        with self._reading(None) as conn:
            rows = conn.execute(self._queries.prunable, (cutoff,)).fetchall()
        return [self._run_id_of(column) for (column,) in rows]

    def open(self) -> None:
        """Open the pool and prepare the schema now rather than at first use."""
        self.ready(None)

    def ready(self, run_id: str | None) -> ConnectionPool[Connection]:
        """The open pool, after checking (or creating) the schema once per store object."""
        with self._lock:
            if self._state.closed:
                raise store_closed(run_id)
            pool = self._pool
            try:
                if pool is None:
                    pool = self._pool = self._open_pool()
                if not self._ready:
                    with pool.connection(timeout=self._settings.timeout) as conn:
                        self._prepare_schema(conn, run_id)
                    self._ready = True
            except psycopg.Error as exc:
                raise open_files_error(exc, run_id) or StoreError(
                    f"cannot prepare the {self._settings.schema!r} schema: "
                    f"{type(exc).__name__}: {exc}",
                    run_id=run_id,
                ) from exc
            return pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    @contextmanager
    def _reading(self, run_id: str | None) -> Iterator[Connection]:
        """A connection of the pool; a failed query becomes a ``StoreError``."""
        if self._state.closed:
            raise store_closed(run_id)
        pool = self.ready(run_id)
        try:
            with pool.connection(timeout=self._settings.timeout) as conn:
                yield conn
        except psycopg.Error as exc:
            raise StoreError(f"read failed: {type(exc).__name__}: {exc}", run_id=run_id) from exc

    def _stored(self, row: TupleRow) -> StoredRun:
        column, finished, updated_at, owner, lease_until, claimed = row
        return StoredRun(
            run_id=self._run_id_of(column),
            finished=bool(finished),
            claimed=bool(claimed),
            updated_at=updated_at,
            owner=owner,
            lease_expires_at=lease_until,
        )

    def _run_id_of(self, column: str) -> str:
        """The run id whose ``run_id`` column value is ``column`` (undoes :func:`run_id_column`)."""
        try:
            run_id = json.loads(f'"{column}"')
        except ValueError:
            run_id = None
        if not isinstance(run_id, str):
            raise CorruptLog(
                f"unreadable run_id column {shown(column)}",
                location=f"{self._settings.schema}.records",
            )
        return run_id

    def _decode_row(self, run_id: str, index: int, row: TupleRow) -> Record:
        seq, column, kind, body = row
        location = f"{self._settings.schema}.records run {shown(run_id)} seq {seq}"
        if seq != index:
            raise CorruptLog(
                f"seq {index} is missing: the run's rows have a gap",
                run_id=run_id,
                location=location,
            )
        if column != run_id_column(run_id):
            raise CorruptLog(
                f"the row's run_id column says {shown(column)}", run_id=run_id, location=location
            )
        return decode_row(body, run_id=run_id, kind=kind, location=location)

    # -- the pool and the schema ------------------------------------------------------------

    def _open_pool(self) -> ConnectionPool[Connection]:
        settings = self._settings
        # One connection first, outside the pool: a missing database, a closed port or a
        # refused login fails now with the server's own message, where the pool would
        # retry in the background until its timeout and report only that it timed out.
        psycopg.connect(settings.conninfo, **settings.options).close()
        pool: ConnectionPool[Connection] = ConnectionPool(
            settings.conninfo,
            min_size=1,
            max_size=settings.pool_size,
            open=False,
            timeout=settings.timeout,
            kwargs={
                **settings.options,
                "autocommit": True,
                "fallback_application_name": _READER_NAME,
            },
            configure=partial(set_statement_timeout, seconds=settings.statement_timeout_s),
            check=ConnectionPool.check_connection,
            name=f"polyloop-{settings.schema}",
        )
        try:
            pool.open(wait=True, timeout=settings.timeout)
        except BaseException:
            pool.close()
            raise
        return pool

    def _prepare_schema(self, conn: Connection, run_id: str | None) -> None:
        """Create or upgrade what is missing (under a transaction-level advisory lock), then
        check the record format."""
        with conn.transaction():
            meta = self._meta(conn)
            if meta.get("layout") != LAYOUT:
                conn.execute(
                    "SELECT pg_advisory_xact_lock(%s)", (ddl_lock_key(self._settings.schema),)
                )
                meta = self._meta(conn)
                if meta.get("layout") != LAYOUT:  # another process may have just made them
                    self._create_tables(conn)
                    meta = self._meta(conn)
        check_format(
            meta.get("format"),
            holder="schema",
            run_id=run_id,
            location=f"{self._settings.schema}.meta format",
        )

    def _create_tables(self, conn: Connection) -> None:
        """Create what is missing; a schema from before the runs table gets one, filled."""
        queries = self._queries
        for statement in (*queries.ddl, queries.fill_runs):
            conn.execute(statement)
        conn.execute(queries.set_meta, ("format", FORMAT))
        conn.execute(queries.set_meta, ("layout", LAYOUT))

    def _meta(self, conn: Connection) -> dict[str, str]:
        """The schema's meta rows (none if it has no tables yet)."""
        exists = scalar(
            conn,
            sql.SQL("SELECT to_regclass(%s) IS NOT NULL"),
            (sql.Identifier(self._settings.schema, "meta").as_string(conn),),
        )
        if not exists:
            return {}
        return dict(conn.execute(self._queries.get_meta).fetchall())
