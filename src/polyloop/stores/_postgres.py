"""The PostgreSQL store: one database shared by many worker processes on many hosts.

Schema. Everything lives in one PostgreSQL schema (``polyloop`` unless told otherwise),
created on first use with idempotent DDL::

    meta(key text PRIMARY KEY, value text NOT NULL)
        ('format', 'polyloop/1'): the record format the schema was created with.
    records(run_key bytea NOT NULL, seq bigint NOT NULL, run_id text NOT NULL,
            kind text NOT NULL, body text NOT NULL,
            written_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (run_key, seq))

A row is one record. ``run_key`` is the sha256 of the run id (its UTF-8 bytes), so the
primary key stays small however long an id is (a btree entry must fit in a third of a
page, which a long id would not). ``run_id`` is the id for people and plain SQL:
PostgreSQL text cannot hold NUL or a lone surrogate, so it holds the id with JSON string
escaping (quote, backslash, control characters and lone surrogates escaped), which leaves
ordinary ids unchanged and never maps two ids to one value. ``seq`` counts the records of
one run from 0 in write order, ``kind`` is the record kind (``run_started``, ``intent``,
``result``, ``step``, ``run_ended``), and ``body`` is the record exactly as
:func:`polyloop.serialization.dumps` writes it. The body is ``text``, not ``jsonb``:
``jsonb`` refuses ``\\u0000`` and reorders keys, and a log must read back byte for byte.
The body is the truth; readers check that it agrees with its row (same run id, same
kind, no gap in ``seq``). Every value is a bound parameter; the schema name is quoted as
an identifier. The DDL runs once per store object, inside a transaction that holds
``pg_advisory_xact_lock`` so that many processes starting at once do not race; a schema
whose tables already exist needs no DDL privilege at all. A schema recorded with another
major of the format raises ``SchemaMajorMismatch``.

Durability. Each write is one ``INSERT`` statement on an autocommit connection, so one
transaction: ``write_step`` inserts the action result and the step record (in that
order) in one statement, so both land or neither does. A commit returns once PostgreSQL
has flushed its write-ahead log; a writer session whose ``synchronous_commit`` is
``off`` is switched back to ``on``, because an intent must survive a crash of the server
before its side effect runs.

Writers. A run has one writer: a store object takes the run's lock at its first write
with ``pg_try_advisory_lock(key)``, where the 64-bit key is the start of the sha256 of
the schema and the run id (``False`` means another session holds it: ``RunLocked``).
The lock is a session-level lock, so it lives on one connection; that connection is a
*writer connection*, opened by this store object for writing only. It is never taken
from or returned to the reader pool, so a lock can never travel to an unrelated user of
a pooled connection. The lock is released by ``pg_advisory_unlock`` after the run's
``end_run``, by ``aclose()`` (``pg_advisory_unlock_all``, then the connection closes),
or by the server when the connection drops, for example because the process died. A
store object opens at most ``max_writer_connections`` writer connections: a run gets a
connection of its own while there is room, after that it shares the least busy one
(writes on one connection queue behind each other). This keeps the number of server
connections bounded however many runs a worker drives at once.

Failures. A ``psycopg.Error`` during a write raises ``StoreError`` (the cause chained)
and the store object writes nothing more for that run until it is closed and reopened.
If the error broke the writer connection, its locks are gone too, so every run whose
lock lived on that connection is refused in the same way: another worker may already
have taken it over. Nothing ever reconnects silently, which would mean writing without
the lock.

Deployment. Writer connections must reach PostgreSQL itself or a session-pooling
proxy: a proxy that pools by transaction would move the session-level lock between
clients. A lock also outlives a vanished host until the server notices the dead TCP
connection (its ``tcp_keepalives_*`` settings decide how soon). No statement timeout is
set: a server that stops answering holds the writing thread until the network gives up.

Threads. psycopg 3 is used with plain blocking connections; every call runs in a worker
thread (``anyio.to_thread.run_sync``), so the event loop never blocks and the store works
unchanged under asyncio and Trio (psycopg's own async API is tied to asyncio). Reads and
the DDL use a ``psycopg_pool.ConnectionPool``, opened lazily in a worker thread at first
use and closed by ``aclose()``. Writes of one run are ordered by a per-run
``threading.Lock``; a writer connection is used by one thread at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from polyloop import serialization
from polyloop.stores._common import FORMAT, WriterState, check_format
from polyloop.types import (
    CorruptLog,
    Intent,
    JSONValue,
    PolyLoopError,
    Record,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLocked,
    RunLog,
    RunStarted,
    StepRecord,
    StoreError,
)

__all__ = ("PostgresStore", "run_lock_key")

_T = TypeVar("_T")
_Connection = psycopg.Connection[TupleRow]
# One row to insert: (kind, body).
_Row = tuple[str, str]
# What a write does to the run: start it, append to it, or end it.
_Mode = Literal["start", "append", "end"]

_KIND: dict[type[Any], str] = {
    RunStarted: "run_started",
    Intent: "intent",
    Result: "result",
    StepRecord: "step",
    RunEnded: "run_ended",
}
_MAX_IDENTIFIER_BYTES = 63
_SHOWN_ID_CHARS = 60
_WRITER_NAME = "polyloop-writer"
_READER_NAME = "polyloop-reader"


def run_lock_key(schema: str, run_id: str) -> int:
    """The 64-bit advisory lock key of ``run_id`` in ``schema`` (a signed bigint).

    Advisory locks are per database, so the schema is part of the key: two schemas in one
    database never lock each other's runs.
    """
    return _key(b"polyloop run", schema, run_id)


def _ddl_key(schema: str) -> int:
    return _key(b"polyloop ddl", schema, "")


def _key(purpose: bytes, schema: str, run_id: str) -> int:
    digest = hashlib.sha256(
        b"\x00".join((purpose, schema.encode(), run_id.encode("utf-8", "surrogatepass")))
    ).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _run_key(run_id: str) -> bytes:
    """The ``run_key`` column value: the sha256 of the run id."""
    return hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).digest()


def _column(run_id: str) -> str:
    """The ``run_id`` column value: the id with JSON string escaping (injective)."""
    text = json.dumps(run_id, ensure_ascii=False)[1:-1]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: escape everything outside ASCII
        text = json.dumps(run_id)[1:-1]
    return text


def _shown(run_id: str) -> str:
    """``run_id`` quoted and cut short, for error locations."""
    text = repr(run_id)
    return text if len(text) <= _SHOWN_ID_CHARS else text[: _SHOWN_ID_CHARS - 3] + "..."


def _row(record: Record) -> _Row:
    body = serialization.dumps(record)  # refuses anything that is not a record
    return _KIND[type(record)], body


@dataclass(frozen=True, slots=True)
class _Queries:
    """Every statement the store sends, with the schema quoted as an identifier."""

    tables: sql.SQL
    create_schema: sql.Composed
    create_meta: sql.Composed
    create_records: sql.Composed
    set_format: sql.Composed
    get_format: sql.Composed
    next_seq: sql.Composed
    insert_one: sql.Composed
    insert_two: sql.Composed
    select_run: sql.Composed
    select_run_ids: sql.Composed

    @classmethod
    def for_schema(cls, schema: str) -> _Queries:
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
            insert_one=insert + row,
            insert_two=insert + row + sql.SQL(", ") + row,
            select_run=sql.SQL(
                "SELECT seq, run_id, kind, body FROM {} WHERE run_key = %s ORDER BY seq"
            ).format(records),
            select_run_ids=sql.SQL(
                "SELECT run_id FROM {} WHERE seq = 0 ORDER BY written_at, run_id"
            ).format(records),
        )


@dataclass(eq=False)
class _Writer:
    """A writer connection of this store object and the runs whose locks it holds."""

    connection: _Connection | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    runs: set[str] = field(default_factory=set)
    broken: bool = False


@dataclass(eq=False)
class _Claim:
    """This store object holds ``run_id``'s lock on ``writer``; ``next_seq`` is its next row."""

    run_id: str
    key: int
    writer: _Writer
    next_seq: int


@dataclass(eq=False)
class _Slot:
    """Per-run bookkeeping: the lock that orders the run's writes, and its claim."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0
    claim: _Claim | None = None


class PostgresStore:
    """Keeps runs in a PostgreSQL database that many workers on many hosts can share.

    ``conninfo`` is a libpq connection string or URL (it is never reported: not by
    :meth:`parameters`, not by ``repr``). ``schema`` names the PostgreSQL schema that
    holds the tables; it is created on first use. ``pool_size`` bounds the connections
    used for reads and the DDL; ``max_writer_connections`` bounds the connections that
    hold writer locks (see the module documentation). ``timeout`` is how many seconds to
    wait for the pool to open or to lend a connection, and the connect timeout of every
    connection unless ``conninfo`` sets ``connect_timeout`` itself.

    The store is an async context manager; :meth:`aclose` releases every writer lock it
    holds and closes every connection. Any worker connected to the same database resumes
    any run; a second writer of a run gets ``RunLocked``. Needs the ``postgres`` extra
    (psycopg 3 and psycopg-pool).
    """

    __slots__ = (
        "_connect",
        "_conninfo",
        "_max_writers",
        "_pool",
        "_pool_size",
        "_queries",
        "_ready",
        "_ready_lock",
        "_schema",
        "_slots",
        "_state",
        "_timeout",
        "_writers",
    )

    def __init__(
        self,
        conninfo: str,
        *,
        schema: str = "polyloop",
        pool_size: int = 4,
        max_writer_connections: int = 8,
        timeout: float = 30.0,
    ) -> None:
        _check_options(schema, pool_size, max_writer_connections, timeout)
        self._conninfo = conninfo
        self._connect = _connect_options(conninfo, timeout)
        self._schema = schema
        self._pool_size = pool_size
        self._max_writers = max_writer_connections
        self._timeout = timeout
        self._queries = _Queries.for_schema(schema)
        self._state = WriterState()
        self._ready_lock = threading.Lock()
        self._ready = False
        self._pool: ConnectionPool[_Connection] | None = None
        self._writers: list[_Writer] = []
        self._slots: dict[str, _Slot] = {}

    def parameters(self) -> Mapping[str, JSONValue]:
        """The store kind and record format; never the connection string or schema."""
        return {"kind": "postgresql", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def start_run(self, record: RunStarted) -> None:
        """Take the run's writer lock and write its first record.

        Raises ``RunLocked`` if another writer holds the run and ``RunAlreadyExists`` if
        the run has any row.

        Cancellation: the worker thread finishes the statement (committed or not) before
        the cancellation is delivered.
        """
        await self._write(record.run_id, [record], "start")

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent; it is committed and flushed when this returns.

        Cancellation: the worker thread finishes the statement before the cancellation
        is delivered, so a cancelled call may still have written the intent.
        """
        await self._write(intent.run_id, [intent], "append")

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call in its own transaction.

        Cancellation: the worker thread finishes the statement before the cancellation
        is delivered.
        """
        await self._write(result.run_id, [result], "append")

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record in one transaction.

        Cancellation: the worker thread finishes the statement before the cancellation
        is delivered; both rows are there afterwards, or neither.
        """
        if action_result is None:
            await self._write(step.run_id, [step], "append")
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(step.run_id, [action_result, step], "append")

    async def end_run(self, record: RunEnded) -> None:
        """Write the run's end record, then release the run's writer lock.

        Cancellation: the worker thread finishes the statement and the release before the
        cancellation is delivered.
        """
        await self._write(record.run_id, [record], "end")

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id`` in write order; empty if the run has no row.

        Raises ``CorruptLog`` (naming the row) for a body that does not decode or does
        not belong to its row, and ``SchemaMajorMismatch`` for another record format.
        Readers never take the writer lock.

        Cancellation: the worker thread finishes the query and decoding before the
        cancellation is delivered.
        """
        records = await self._in_thread(self._read, run_id)
        return RunLog(run_id=run_id, records=records)

    async def run_ids(self) -> tuple[str, ...]:
        """The id of every run in the schema, in the order the runs started.

        Cancellation: the worker thread finishes the query before the cancellation is
        delivered.
        """
        return await self._in_thread(self._select_run_ids)

    async def aclose(self) -> None:
        """Release every writer lock and close every connection. Idempotent.

        Cancellation: closing runs shielded, so it completes even in a cancelled scope.
        """
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._close)

    async def __aenter__(self) -> PostgresStore:
        """Open the pool and check (or create) the schema now rather than at first use.

        Cancellation: a cancellation before the worker thread starts opens nothing; once
        it has started, opening finishes and the cancellation reaches the ``async with``
        body, whose exit closes the store.
        """
        await self._in_thread(self._open_now)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self._schema!r})"

    # -- writing (worker thread) ------------------------------------------------------------

    async def _write(self, run_id: str, records: Sequence[Record], mode: _Mode) -> None:
        rows = [_row(record) for record in records]
        await self._in_thread(self._write_rows, run_id, rows, mode)

    def _write_rows(self, run_id: str, rows: Sequence[_Row], mode: _Mode) -> None:
        """Claim the run if needed, check it exists (or not), insert, release at the end."""
        with self._slot(run_id) as slot:
            self._state.check_writable(run_id)
            self._ensure_ready(run_id)
            fresh = slot.claim is None
            if slot.claim is None:
                slot.claim = self._claim(run_id)
            claim = slot.claim
            try:
                _check_mode(claim, mode)
            except PolyLoopError:
                # A refusal writes nothing and leaves behind no lock that it took.
                if fresh:
                    self._release(slot)
                raise
            self._insert(claim, rows)
            if mode == "end":
                self._release(slot)

    @contextmanager
    def _slot(self, run_id: str) -> Iterator[_Slot]:
        """Hold ``run_id``'s slot lock; forget the slot when nobody uses or claims it."""
        with self._state.mutex:
            slot = self._slots.setdefault(run_id, _Slot())
            slot.users += 1
        try:
            with slot.lock:
                yield slot
        finally:
            with self._state.mutex:
                slot.users -= 1
                if slot.users == 0 and slot.claim is None:
                    self._slots.pop(run_id, None)

    def _claim(self, run_id: str) -> _Claim:
        """Take ``run_id``'s advisory lock on a writer connection, or raise ``RunLocked``."""
        writer = self._pick_writer(run_id)
        key = run_lock_key(self._schema, run_id)
        with writer.lock:
            try:
                conn = self._writer_connection(writer, run_id)
                locked = _scalar(conn, sql.SQL("SELECT pg_try_advisory_lock(%s)"), (key,))
                next_seq = _scalar(conn, self._queries.next_seq, (_run_key(run_id),))
            except BaseException as exc:
                self._forget(writer, run_id)
                if isinstance(exc, psycopg.Error):
                    raise self._failed(run_id, writer, exc) from exc
                raise
        if not locked:
            self._forget(writer, run_id)
            raise RunLocked("another writer holds this run", run_id=run_id)
        return _Claim(run_id=run_id, key=key, writer=writer, next_seq=int(next_seq))

    def _pick_writer(self, run_id: str) -> _Writer:
        """A writer connection for a new claim: an idle one, a new one, or the least busy."""
        with self._state.mutex:
            self._state.check_writable(run_id)
            writer = min(self._writers, key=lambda w: len(w.runs), default=None)
            if writer is None or (writer.runs and len(self._writers) < self._max_writers):
                writer = _Writer()
                self._writers.append(writer)
            writer.runs.add(run_id)
            return writer

    def _writer_connection(self, writer: _Writer, run_id: str) -> _Connection:
        """The writer's connection, opened on first use (called with ``writer.lock`` held)."""
        if writer.broken or self._state.closed:
            raise StoreError("the writer connection is gone", run_id=run_id)
        if writer.connection is None:
            writer.connection = _open_writer(self._conninfo, **self._connect)
        return writer.connection

    def _insert(self, claim: _Claim, rows: Sequence[_Row]) -> None:
        run_id, writer = claim.run_id, claim.writer
        query = self._queries.insert_one if len(rows) == 1 else self._queries.insert_two
        key, column = _run_key(run_id), _column(run_id)
        params: list[object] = []
        for offset, (kind, body) in enumerate(rows):
            params += [key, claim.next_seq + offset, column, kind, body]
        with writer.lock:
            try:
                self._writer_connection(writer, run_id).execute(query, params)
            except psycopg.Error as exc:
                raise self._failed(run_id, writer, exc) from exc
        claim.next_seq += len(rows)

    def _release(self, slot: _Slot) -> None:
        """Give up the slot's claim: unlock the run on its writer connection."""
        claim, slot.claim = slot.claim, None
        if claim is None:
            return
        writer = claim.writer
        with writer.lock:
            self._forget(writer, claim.run_id)
            conn = writer.connection
            if conn is None or writer.broken:
                return
            try:
                conn.execute("SELECT pg_advisory_unlock(%s)", (claim.key,))
            except psycopg.Error as exc:
                # The run's own rows are committed; only the connection's other runs
                # are affected (their locks went with the connection).
                self._drop_writer(writer, exc)

    def _forget(self, writer: _Writer, run_id: str) -> None:
        with self._state.mutex:
            writer.runs.discard(run_id)

    def _failed(self, run_id: str, writer: _Writer, exc: psycopg.Error) -> StoreError:
        """Refuse ``run_id`` from now on (and every run of a broken connection)."""
        conn = writer.connection
        with self._state.mutex:
            error = self._state.fail(run_id, exc)
        if conn is None or conn.broken or conn.closed:
            self._drop_writer(writer, exc)
        return error

    def _drop_writer(self, writer: _Writer, exc: BaseException) -> None:
        """The connection is lost and so are its locks: refuse every run it held."""
        writer.broken = True
        with self._state.mutex:
            for run_id in writer.runs:
                self._state.failed.setdefault(run_id, f"{type(exc).__name__}: {exc}")
            with suppress(ValueError):
                self._writers.remove(writer)
        conn, writer.connection = writer.connection, None
        if conn is not None:
            conn.close()

    # -- reading (worker thread) ------------------------------------------------------------

    def _read(self, run_id: str) -> tuple[Record, ...]:
        with self._reading(run_id) as pool, pool.connection(timeout=self._timeout) as conn:
            rows = conn.execute(self._queries.select_run, (_run_key(run_id),)).fetchall()
        return tuple(self._decode_row(run_id, index, row) for index, row in enumerate(rows))

    def _select_run_ids(self) -> tuple[str, ...]:
        with self._reading(None) as pool, pool.connection(timeout=self._timeout) as conn:
            rows = conn.execute(self._queries.select_run_ids).fetchall()
        return tuple(self._run_id_of(column) for (column,) in rows)

    def _run_id_of(self, column: str) -> str:
        """The run id whose ``run_id`` column value is ``column`` (undoes :func:`_column`)."""
        try:
            run_id = json.loads(f'"{column}"')
        except ValueError:
            run_id = None
        if not isinstance(run_id, str):
            raise CorruptLog(f"unreadable run_id column {_shown(column)}",
                             location=f"{self._schema}.records")
        return run_id

    @contextmanager
    def _reading(self, run_id: str | None) -> Iterator[ConnectionPool[_Connection]]:
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)
        pool = self._ensure_ready(run_id)
        try:
            yield pool
        except psycopg.Error as exc:
            raise StoreError(f"read failed: {type(exc).__name__}: {exc}", run_id=run_id) from exc

    def _decode_row(self, run_id: str, index: int, row: TupleRow) -> Record:
        seq, column, kind, body = row
        location = f"{self._schema}.records run {_shown(run_id)} seq {seq}"

        def corrupt(reason: str) -> CorruptLog:
            return CorruptLog(reason, run_id=run_id, location=location)

        if seq != index:
            raise corrupt(f"seq {index} is missing: the run's rows have a gap")
        try:
            record = serialization.loads(body, location=location)
        except CorruptLog as exc:
            if exc.run_id is not None:
                raise
            raise corrupt(exc.reason) from exc
        if record.run_id != run_id:
            raise corrupt(f"the row holds a record of run {_shown(record.run_id)}")
        if column != _column(run_id):
            raise corrupt(f"the row's run_id column says {_shown(column)}")
        if _KIND[type(record)] != kind:
            raise corrupt(f"the row says {kind!r} but holds a {_KIND[type(record)]!r} record")
        return record

    # -- opening and closing (worker thread) ------------------------------------------------

    def _open_now(self) -> None:
        with self._reading(None):
            pass

    def _ensure_ready(self, run_id: str | None) -> ConnectionPool[_Connection]:
        """The open pool, after checking (or creating) the schema once per store object."""
        with self._ready_lock:
            if self._state.closed:
                raise StoreError("the store is closed", run_id=run_id)
            pool = self._pool
            try:
                if pool is None:
                    pool = self._pool = self._open_pool()
                if not self._ready:
                    with pool.connection(timeout=self._timeout) as conn:
                        self._prepare_schema(conn, run_id)
                    self._ready = True
            except psycopg.Error as exc:
                raise StoreError(
                    f"cannot prepare the {self._schema!r} schema: {type(exc).__name__}: {exc}",
                    run_id=run_id,
                ) from exc
            return pool

    def _open_pool(self) -> ConnectionPool[_Connection]:
        pool: ConnectionPool[_Connection] = ConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=self._pool_size,
            open=False,
            timeout=self._timeout,
            kwargs={**self._connect, "autocommit": True,
                    "fallback_application_name": _READER_NAME},
            check=ConnectionPool.check_connection,
            name=f"polyloop-{self._schema}",
        )
        try:
            pool.open(wait=True, timeout=self._timeout)
        except BaseException:
            pool.close()
            raise
        return pool

    def _prepare_schema(self, conn: _Connection, run_id: str | None) -> None:
        """Create what is missing (under a transaction-level advisory lock), check the format."""
        queries = self._queries
        with conn.transaction():
            if not self._tables_exist(conn):
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ddl_key(self._schema),))
                if not self._tables_exist(conn):  # another process may have just made them
                    for statement in (queries.create_schema, queries.create_meta,
                                      queries.create_records):
                        conn.execute(statement)
                    conn.execute(queries.set_format, (FORMAT,))
            recorded = _scalar(conn, queries.get_format, ())
        self._check_format(recorded, run_id)

    def _tables_exist(self, conn: _Connection) -> bool:
        return bool(_scalar(conn, self._queries.tables, (self._schema,)) == 2)

    def _check_format(self, recorded: object, run_id: str | None) -> None:
        check_format(recorded, holder="schema", run_id=run_id,
                     location=f"{self._schema}.meta format")

    def _close(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            writers, self._writers = self._writers, []
            for slot in self._slots.values():
                slot.claim = None
        for writer in writers:
            with writer.lock:
                _close_writer(writer)
        with self._ready_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    async def _in_thread(self, func: Callable[..., _T], *args: object) -> _T:
        return await anyio.to_thread.run_sync(func, *args)


def _check_options(schema: str, pool_size: int, max_writers: int, timeout: float) -> None:
    if not schema or len(schema.encode()) > _MAX_IDENTIFIER_BYTES or "\x00" in schema:
        raise ValueError(f"schema must be 1 to {_MAX_IDENTIFIER_BYTES} bytes without NUL")
    if pool_size < 1 or max_writers < 1:
        raise ValueError("pool_size and max_writer_connections must be at least 1")
    if not timeout > 0:
        raise ValueError("timeout must be a positive number of seconds")


def _check_mode(claim: _Claim, mode: _Mode) -> None:
    if mode == "start" and claim.next_seq > 0:
        raise RunAlreadyExists("the run already has records", run_id=claim.run_id)
    if mode != "start" and claim.next_seq == 0:
        raise StoreError("the run was never started in this database", run_id=claim.run_id)


def _connect_options(conninfo: str, timeout: float) -> dict[str, Any]:
    """Connection options added to ``conninfo``: a connect timeout unless it sets one."""
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        # The message would quote the string, which may hold a password.
        raise ValueError("conninfo is not a valid libpq connection string or URL") from None
    if "connect_timeout" in given:
        return {}
    return {"connect_timeout": max(1, math.ceil(timeout))}


def _open_writer(conninfo: str, **options: Any) -> _Connection:
    """A connection of this store object's own, for writes and the locks they need."""
    conn = psycopg.connect(conninfo, autocommit=True,
                           fallback_application_name=_WRITER_NAME, **options)
    try:
        if _scalar(conn, sql.SQL("SHOW synchronous_commit"), ()) == "off":
            conn.execute("SET synchronous_commit = on")
    except BaseException:
        conn.close()
        raise
    return conn


def _close_writer(writer: _Writer) -> None:
    """Release every lock the connection holds, then close it (called with its lock)."""
    conn, writer.connection = writer.connection, None
    writer.broken = True
    writer.runs.clear()
    if conn is None:
        return
    try:
        # Closing alone would release the locks too, but only once the server has
        # noticed; unlocking first makes the run available before this returns.
        if not conn.broken:
            conn.execute("SELECT pg_advisory_unlock_all()")
    except psycopg.Error:
        pass  # the connection is gone, and its locks with it
    finally:
        conn.close()


def _scalar(conn: _Connection, query: sql.SQL | sql.Composed, params: Sequence[object]) -> Any:
    """The first column of the first row of ``query`` (``None`` if there is no row)."""
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]
