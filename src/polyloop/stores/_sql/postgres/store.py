"""The PostgreSQL store: one database shared by workers on many hosts, claimed through
``owner``, written through ``batch`` (docs/stores.md#postgresstore)."""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, suppress
from datetime import datetime
from typing import Any

from polyloop._shared import needs_extra

with needs_extra("PostgresStore", "postgres"):
    import psycopg
    from psycopg import sql
    from psycopg.rows import TupleRow
    from psycopg_pool import ConnectionPool

from polyloop._paging import PageRequest
from polyloop.ports import RunPage, StoredRun
from polyloop.stores._engine import Archive, EngineStore, Watch
from polyloop.stores._sql.paging import page_sql, run_page
from polyloop.stores._sql.postgres.connection import Settings, Watched, open_pool
from polyloop.stores._sql.postgres.feed import Listener
from polyloop.stores._sql.postgres.owner import SharedClaims
from polyloop.stores._sql.postgres.sql import PAGED, appended_channel, run_id_column, run_key
from polyloop.stores._sql.rows import read_rows, read_rows_after, shown
from polyloop.stores._writes import kept_cancel
from polyloop.types import CancelRequest, CorruptLog, Record, StoreError


class PostgresStore(EngineStore):
    """Keeps runs in a PostgreSQL database that many workers on many hosts can share
    (docs/stores.md#postgresstore says what each option bounds). Needs the ``postgres`` extra.

    ``conninfo``, a libpq connection string or URL, is never reported (not by
    :meth:`parameters`, not by ``repr``). Any worker on the database resumes any run; a
    second writer of a run gets ``RunLocked``; a claim holds ``lease_s`` without renewal.

    Cancellation, for every method: a write cancelled before its batch started writes
    nothing; once it started, the call waits for its commit, shielded, for a second at
    most (``CANCELLED_WRITE_WAIT_S``), then gives the write up with its outcome unknown and
    writes nothing more of the run. A cancelled ``read_log`` returns at once; the other
    calls finish their thread first; closing completes even in a cancelled scope.
    """

    __slots__ = ("_listener", "_schema")

    def __init__(
        self,
        conninfo: str,
        *,
        schema: str = "polyloop",
        pool_size: int = 4,
        max_writer_connections: int = 8,
        timeout: float = 30.0,
        lease_s: float = 15.0,
        statement_timeout_s: float = 30.0,
        create: bool = True,
    ) -> None:
        settings = Settings(
            conninfo=conninfo,
            schema=schema,
            pool_size=pool_size,
            max_writers=max_writer_connections,
            timeout=timeout,
            lease_s=lease_s,
            statement_timeout_s=statement_timeout_s,
            create=create,
        )
        self._schema = schema
        backend = Postgres(settings)
        self._listener = backend.listener
        super().__init__(backend)

    def changes(self) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Listen for the writes that may let a run go on while the block runs; it yields
        ``wait``, which returns once one may have committed since the block began or
        ``wait`` last returned (a :class:`~polyloop.ports.ChangeFeed`; which writes, and
        how a lost connection is handled: docs/stores.md#change-notifications).
        ``StoreError`` once the store is closed."""
        return self._listener.changes()

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self._schema!r})"


class Postgres(SharedClaims):
    """PostgreSQL's dialect: a reader pool beside the claims and writers of ``owner``."""

    kind = "postgresql"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, ready=self._ready_pool)
        self._lock = threading.Lock()  # opens the reader pool and the schema once
        self._pool: ConnectionPool[Watched] | None = None
        self.listener = Listener(settings, self._queries.channel)

    def read(self, run_id: str) -> tuple[Record, ...]:
        rows = self._select(run_id, self._queries.select_run, (run_key(run_id),))
        prefix = f"{self._settings.schema}.records run {shown(run_id)} seq"
        column = run_id_column(run_id)
        return read_rows(rows, run_id, column=column, where=lambda seq: f"{prefix} {seq}")

    def read_after(self, run_id: str, after: int) -> tuple[Record, ...]:
        key, queries = run_key(run_id), self._queries
        prefix = f"{self._settings.schema}.records run {shown(run_id)} seq"
        return read_rows_after(
            lambda seq: self._select(run_id, queries.select_after, (key, seq)),
            lambda: bool(self._select(run_id, queries.run_started, (key,))),
            run_id,
            after,
            where=lambda seq: f"{prefix} {seq}",
            column=run_id_column(run_id),
        )

    def appended(self, run_id: str) -> Watch:
        return self.listener.appended(appended_channel(self._settings.schema, run_id))

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        query = self._queries.list_unfinished if unfinished_only else self._queries.list_runs
        return tuple(self._stored(row) for row in self._select(None, query, ()))

    def page(self, request: PageRequest) -> RunPage:
        text, params = page_sql(PAGED, request)
        rows = self._select(None, self._queries.listed + sql.SQL(text), params)
        return run_page(rows, request, self._stored)

    def describe(self, run_id: str) -> StoredRun | None:
        rows = self._select(run_id, self._queries.describe_run, (run_key(run_id),))
        return self._stored(rows[0]) if rows else None

    def prunable(self, cutoff: datetime, archive: Archive) -> list[str]:
        rows = self._select(None, self._queries.prunable, (cutoff,))
        return [self._run_id_of(column) for (column,) in rows]

    def request_cancel(self, request: CancelRequest) -> bool:
        """Keep the first request in the run's row (a synchronous commit); whether the
        run has a record."""
        asked = {"by": request.by, "reason": request.reason, "at": request.at}
        params = {"run_key": run_key(request.run_id), **asked}
        return bool(self._select(request.run_id, self._queries.request_cancel, params, "write"))

    def read_cancel(self, run_id: str) -> CancelRequest | None:
        rows = self._select(run_id, self._queries.read_cancel, (run_key(run_id),))
        return kept_cancel(run_id, *rows[0]) if rows else None

    def _select(
        self, run_id: str | None, query: sql.Composed, params: Any, what: str = "read"
    ) -> list[TupleRow]:
        """The rows of ``query`` on a reader connection, or a ``StoreError``."""
        pool = self._ready_pool(run_id)
        try:
            with pool.connection(timeout=self._settings.timeout) as conn:
                return conn.execute(query, params).fetchall()
        except psycopg.Error as exc:
            reason = f"{what} failed: {type(exc).__name__}: {exc}"
            raise StoreError(reason, run_id=run_id) from exc

    def _stored(self, row: TupleRow) -> StoredRun:
        column, finished, updated_at, owner, lease_until, claimed, cancel_requested = row
        return StoredRun(
            run_id=self._run_id_of(column),
            finished=bool(finished),
            claimed=bool(claimed),
            updated_at=updated_at,
            owner=owner,
            lease_expires_at=lease_until,
            cancel_requested=bool(cancel_requested),
        )

    def _run_id_of(self, column: str) -> str:
        """The run id whose ``run_id`` column is ``column`` (undoes :func:`run_id_column`)."""
        with suppress(ValueError):  # JSON text in quotes is a string, if it parses
            return str(json.loads(f'"{column}"'))
        where = f"{self._settings.schema}.records"
        raise CorruptLog(f"unreadable run_id column {shown(column)}", location=where)

    def open(self) -> None:
        self._ready_pool(None)

    def close(self) -> None:
        """Stop listening, give every claim up and close the writers, then the pool."""
        self.listener.close()
        self.close_claims()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _ready_pool(self, run_id: str | None) -> ConnectionPool[Watched]:
        """The reader pool (its only write is a cancel request, which needs no claim),
        opened with the schema made current."""
        with self._lock:
            self._state.check_open(run_id)
            if self._pool is None:
                self._pool = open_pool(self._settings, self._queries.layout, run_id)
            return self._pool
