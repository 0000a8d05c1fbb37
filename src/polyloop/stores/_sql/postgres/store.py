"""The PostgreSQL store: one database shared by many workers on many hosts.

A claim is the run's row naming this store object's owner (a row of ``owners`` with a
lease) and a claim epoch that fences every write (tables in ``docs/stores.md``). Research
records 0011, 0017, 0018, 0019, 0033, 0034 and 0035 say why.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, ClassVar

from anyio.lowlevel import EventLoopToken

from polyloop._shared import needs_extra

with needs_extra("PostgresStore", "postgres"):
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.rows import TupleRow
    from psycopg_pool import ConnectionPool

from polyloop.ports import StoredRun
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import Claim, Write, WriterState, decode_row, open_files_error, shown
from polyloop.stores._engine import EngineStore
from polyloop.stores._lease import Lease, check_lease_s, effect_margin
from polyloop.stores._refusals import claimed_already, not_claimed, store_closed
from polyloop.stores._sql.postgres.batch import Committer, Link, Probe, Writer
from polyloop.stores._sql.postgres.deadline import Watched, deadline_s
from polyloop.stores._sql.postgres.sql import Queries, owner_lock, run_id_column, run_key
from polyloop.stores._sql.schema import prepare, require_store
from polyloop.types import CorruptLog, InvalidRequest, Record, RunLocked, StoreError

logger = logging.getLogger("polyloop")

# How long a cancelled caller still waits for a write whose commit has started: enough for
# a server that answers; past it the write is given up (its outcome unknown), so that a
# silent path adds no more than this to a cancelled run's grace.
CANCELLED_WRITE_WAIT_S = 1.0
_GIVEN_UP = "its caller was cancelled and stopped waiting for its commit, whose outcome is unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The options of a :class:`PostgresStore`, checked (``InvalidRequest`` names the
    first that is wrong). ``options`` are added to ``conninfo`` for every connection;
    ``conninfo`` stays out of ``repr``, since it may hold a password. ``create``: may
    opening create the schema and its tables."""

    conninfo: str = field(repr=False)
    schema: str
    pool_size: int
    max_writers: int
    timeout: float
    lease_s: float
    statement_timeout_s: float
    create: bool = True
    options: Mapping[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        schema = self.schema
        name = schema.encode("utf-8", "surrogatepass") if isinstance(schema, str) else b""
        if not 0 < len(name) <= 63 or b"\x00" in name:  # a PostgreSQL name has 63 bytes
            raise InvalidRequest(
                f"schema must be a PostgreSQL name of 1 to 63 bytes without NUL, not {schema!r:.80}"
            )
        if self.pool_size < 1 or self.max_writers < 1:
            raise InvalidRequest("pool_size and max_writer_connections must be at least 1")
        if not self.timeout > 0:
            raise InvalidRequest("timeout must be a positive number of seconds")
        check_lease_s(self.lease_s)
        if not self.statement_timeout_s > 0:
            raise InvalidRequest("statement_timeout_s must be a positive number of seconds")
        object.__setattr__(self, "statement_timeout_s", float(self.statement_timeout_s))
        try:
            given = conninfo_to_dict(self.conninfo)
        except psycopg.Error:
            # The message would quote the string, which may hold a password.
            raise InvalidRequest("conninfo is not a valid libpq connection string or URL") from None
        # A connect timeout; how long sent data may go unacknowledged; keepalives, which
        # find a dead peer on an idle connection (a pooled one, the owner's between
        # renewals), where no statement waits for its deadline. ``conninfo`` may set each.
        idle = max(1, math.ceil(self.statement_timeout_s / 2))
        defaults = {
            "connect_timeout": max(1, math.ceil(self.timeout)),
            "tcp_user_timeout": max(1, math.ceil(self.statement_timeout_s * 1000)),
            "keepalives": 1,
            "keepalives_idle": idle,
            "keepalives_interval": idle,
            "keepalives_count": 3,
        }
        options = {name: value for name, value in defaults.items() if name not in given}
        object.__setattr__(self, "options", options)

    def connect(self, name: str, deadline_s: float = math.inf) -> Watched:
        """A new connection of the store object's own, named ``name`` on the server,
        with the statement deadline or ``deadline_s`` if that is shorter."""
        conn = open_connection(self.conninfo, self.statement_timeout_s, name=name, **self.options)
        conn.deadline_s = min(conn.deadline_s, deadline_s)
        return conn


def open_connection(
    conninfo: str, statement_timeout_s: float, *, name: str, **options: Any
) -> Watched:
    """An autocommit connection, its statement timeout and deadline set, and
    ``synchronous_commit`` on."""
    try:
        conn = Watched.connect(conninfo, autocommit=True, fallback_application_name=name, **options)
    except psycopg.OperationalError as exc:
        limit = open_files_error(exc, None)  # a socket is a file too
        if limit is not None:
            raise limit from exc
        raise
    try:
        _set_statement_timeout(conn, seconds=statement_timeout_s)
        row = conn.execute("SHOW synchronous_commit").fetchone()
        if row is not None and row[0] == "off":
            conn.execute("SET synchronous_commit = on")
    except BaseException:
        conn.close()
        raise
    return conn


def _set_statement_timeout(conn: Watched, *, seconds: float) -> None:
    conn.deadline_s = deadline_s(seconds)
    milliseconds = sql.Literal(max(1, math.ceil(seconds * 1000)))
    conn.execute(sql.SQL("SET statement_timeout = {}").format(milliseconds))


class PostgresStore(EngineStore):
    """Keeps runs in a PostgreSQL database that many workers on many hosts can share.

    ``conninfo`` is a libpq connection string or URL (it is never reported: not by
    :meth:`parameters`, not by ``repr``). ``schema`` names the PostgreSQL schema that
    holds the tables; it is created on first use. With ``create=False`` the store only
    opens a schema that already holds PolyLoop tables: a missing schema, or one without
    them, is a ``StoreError`` naming the schema, and nothing is created (a reader that
    must not turn a mistyped name into a new, empty store); an existing schema of an
    earlier release is still brought up to date. ``pool_size`` bounds the connections
    used for reads and the DDL; ``max_writer_connections`` bounds the connections that
    hold writer locks (see the module documentation). ``timeout`` is how many seconds to
    wait for the pool to open or to lend a connection, and the connect timeout of every
    connection unless ``conninfo`` sets ``connect_timeout`` itself. ``lease_s`` is how
    long this store object's claims hold without a renewal (renewed every third of it
    while its event loop runs); another worker may take over the runs of an owner whose
    lease has ended, or whose process died. ``statement_timeout_s`` bounds every
    statement on the server (``statement_timeout``), and the client gives a statement up
    at its deadline, that and half of it again (at least a second more): a server or a
    path that goes silent becomes a ``StoreError`` within the deadline plus the connect
    timeout (``docs/stores.md`` states each bound).

    The store is an async context manager; :meth:`aclose` gives up every claim it holds
    and closes every connection. Any worker connected to the same database resumes any
    run; a second writer of a run gets ``RunLocked``. Needs the ``postgres`` extra
    (psycopg 3 and psycopg-pool).

    Cancellation, for every method: a write cancelled before its batch started writes
    nothing; once the batch started, the call waits for its commit, shielded, then lets
    the cancellation go on (its rows are committed, or it failed), but for one second at most
    (``CANCELLED_WRITE_WAIT_S``): past that the write is given up with its outcome
    unknown, its commit ends on its own in its thread, and this store object writes
    nothing more of the run (it gives the claim up, and another store object resumes the
    run). A cancelled ``read_log`` returns at once (it changes nothing); the other calls
    finish their thread first (a failed run's claim is given up in a thread of its own);
    closing completes even in a cancelled scope.
    """

    __slots__ = ("_schema",)

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
        _probe: Probe | None = None,
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
        super().__init__(self._DIALECT(settings, _probe))

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self._schema!r})"

    # The dialect the store runs on; a benchmark baseline swaps in a variant.
    _DIALECT: ClassVar[type[Postgres]]


class Postgres:
    """PostgreSQL's dialect: a reader pool, writers that share commits, and the claims of
    an owner with a lease. Every method but the coroutines and :meth:`holds` blocks."""

    kind = "postgresql"

    def __init__(self, settings: Settings, probe: Probe | None) -> None:
        self._settings = settings
        self._queries = Queries(settings.schema)
        self._state = WriterState()  # the runs that failed, and whether the store is closed
        self._owner = Owner(settings, self._queries, self._state)
        # ``probe`` is a test seam: it sees each batch just before its commit.
        self._committer = Committer(self._state, self._queries, self._owner.lease, probe)
        self._writers: list[Writer] = []
        self._lock = threading.Lock()  # opens the reader pool and the schema once
        self._pool: ConnectionPool[Watched] | None = None

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        with self._state.mutex:
            self._state.check_writable(run_id)
            if self._route(run_id) is not None:
                raise claimed_already(run_id)
            writer = self._pick()
            writer.claiming += 1
        try:
            self._ready_pool(run_id)
            owner_id, generation = self._owner.registered(run_id, token)
            with writer.lock:
                claim = self._take(writer, run_id, owner_id, generation)
                with self._state.mutex:
                    writer.claims[run_id] = claim
        finally:
            with self._state.mutex:
                writer.claiming -= 1

    def release(self, run_id: str) -> None:
        """Give the claim up; for a run whose write failed or was given up, in a thread of
        its own: its path may be silent, and nothing more of it is written here anyway."""
        with self._state.mutex:
            route = self._route(run_id)
            failed = run_id in self._state.failed
        if route is None:
            return
        if failed:
            give_up = partial(self._give_up, route[0], run_id)
            threading.Thread(target=give_up, name="polyloop-release", daemon=True).start()
        else:
            self._give_up(route[0], run_id)

    def _give_up(self, writer: Writer, run_id: str) -> None:
        with writer.lock, self._state.mutex:  # after any commit of the run in flight
            claim = writer.claims.pop(run_id, None)
        if claim is not None:
            self._owner.release(run_id, claim.epoch)

    def _abandoned(self, write: Write) -> None:
        """A cancelled caller gave up waiting for ``write``'s commit (on the event loop):
        its outcome is unknown, so nothing more of its run is written here; the run stays
        resumable by a store object that claims it once this one gives it up."""
        with self._state.mutex:
            if write.run_id not in self._state.failed:
                self._state.failed[write.run_id] = _GIVEN_UP

    def holds(self, run_id: str) -> bool:
        return self._route(run_id) is not None

    async def confirm(self, run_id: str) -> None:
        # By this process's clock against the lease's last confirmed renewal, with the
        # margin to spare; a late lease is waited on while its renewal may still come.
        with self._state.mutex:
            self._state.check_writable(run_id)
            route = self._route(run_id)
        if route is None:
            raise not_claimed(run_id)
        await self._owner.lease.confirm(route[1].generation, run_id)

    async def submit(self, write: Write) -> None:
        self._owner.lease.beat()
        with self._state.mutex:
            self._state.check_writable(write.run_id)
            route = self._route(write.run_id)
            # A write of a run not claimed here is refused in its batch, like any other.
            writer = route[0] if route is not None else self._pick()
        await writer.group.submit(write)

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        with self._state.mutex:
            route = self._route(run_id)
        if route is None:
            return False
        writer, claim = route
        params = {"run_key": run_key(run_id), "epoch": claim.epoch, "before": cutoff}
        with writer.lock:
            try:
                row = writer.connected(run_id).execute(self._queries.prune_run, params).fetchone()
            except psycopg.Error as exc:
                raise writer.fail(self._state, run_id, exc) from exc
            gone = bool(row and row[0])
            if gone:
                with self._state.mutex:
                    writer.claims.pop(run_id, None)
        return gone

    def _take(self, writer: Writer, run_id: str, owner_id: str, generation: int) -> Claim:
        """Make ``owner_id`` the run's owner, or ``RunLocked`` naming its live holder."""
        key = run_key(run_id)
        params = {"run_key": key, "run_id": run_id_column(run_id), "owner": owner_id}
        try:
            conn = writer.connected(run_id)
            row = conn.execute(self._queries.claim, params).fetchone()
            holder = None if row else conn.execute(self._queries.holder, (key,)).fetchone()
        except psycopg.Error as exc:
            raise writer.fail(self._state, run_id, exc) from exc
        if row is None:
            who = "another writer"
            if holder:
                who = f"{holder[0]}, whose lease runs until {holder[1]:%Y-%m-%d %H:%M:%S %Z}"
            raise RunLocked(f"the run is held by {who}", run_id=run_id)
        epoch, next_seq, finished = row
        return Claim(run_id, int(epoch), int(next_seq), bool(finished), generation=generation)

    def _route(self, run_id: str) -> tuple[Writer, Claim] | None:
        """The writer and claim of ``run_id``, if this object holds its claim."""
        for writer in self._writers:
            claim = writer.claims.get(run_id)
            if claim is not None:
                return writer, claim
        return None

    def _pick(self) -> Writer:
        """An idle writer, a new one, or the least busy (``state.mutex`` held)."""
        writer = min(self._writers, key=lambda w: len(w.claims) + w.claiming, default=None)
        busy = writer is not None and (writer.claims or writer.claiming)
        if writer is None or (busy and len(self._writers) < self._settings.max_writers):
            writer = Writer(connect=partial(self._settings.connect, "polyloop-writer"))
            writer.group = GroupCommit(
                partial(self._committer.commit, writer),
                abandon=self._abandoned,
                cancelled_wait_s=CANCELLED_WRITE_WAIT_S,
            )
            self._writers.append(writer)
        return writer

    def read(self, run_id: str) -> tuple[Record, ...]:
        rows = self._select(run_id, self._queries.select_run, (run_key(run_id),))
        return tuple(self._record(run_id, index, row) for index, row in enumerate(rows))

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        query = self._queries.list_unfinished if unfinished_only else self._queries.list_runs
        return tuple(self._stored(row) for row in self._select(None, query, ()))

    def describe(self, run_id: str) -> StoredRun | None:
        rows = self._select(run_id, self._queries.describe_run, (run_key(run_id),))
        return self._stored(rows[0]) if rows else None

    def prunable(self, cutoff: datetime) -> list[str]:
        rows = self._select(None, self._queries.prunable, (cutoff,))
        return [self._run_id_of(column) for (column,) in rows]

    def _select(self, run_id: str | None, query: sql.Composed, params: Any) -> list[TupleRow]:
        """The rows of ``query`` on a reader connection; a failure is a ``StoreError``."""
        if self._state.closed:
            raise store_closed(run_id)
        pool = self._ready_pool(run_id)
        try:
            with pool.connection(timeout=self._settings.timeout) as conn:
                return conn.execute(query, params).fetchall()
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
        """The run id whose ``run_id`` column is ``column`` (undoes :func:`run_id_column`)."""
        with suppress(ValueError):
            run_id = json.loads(f'"{column}"')
            if isinstance(run_id, str):
                return run_id
        where = f"{self._settings.schema}.records"
        raise CorruptLog(f"unreadable run_id column {shown(column)}", location=where)

    def _record(self, run_id: str, index: int, row: TupleRow) -> Record:
        seq, column, kind, body = row
        location = f"{self._settings.schema}.records run {shown(run_id)} seq {seq}"
        if seq != index:
            reason = f"seq {index} is missing: the run's rows have a gap"
            raise CorruptLog(reason, run_id=run_id, location=location)
        if column != run_id_column(run_id):
            reason = f"the row's run_id column says {shown(column)}"
            raise CorruptLog(reason, run_id=run_id, location=location)
        return decode_row(body, run_id=run_id, kind=kind, location=location)

    def open(self) -> None:
        self._ready_pool(None)

    def close(self) -> None:
        """Refuse new work, stop the lease, close the writers, free the owner's runs,
        close the pool: in this order, so nothing is written once the runs are free."""
        with self._state.mutex:
            self._state.closed = True
            writers, self._writers = self._writers, []
            for writer in writers:
                writer.claims.clear()
        self._owner.lease.stop()
        for writer in writers:
            with writer.lock:  # after the commit in flight, if any
                writer.closed = True
                writer.drop()
        self._owner.close()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _ready_pool(self, run_id: str | None) -> ConnectionPool[Watched]:
        """The reader pool (never used for writes), opened with the schema made current."""
        with self._lock:
            if self._state.closed:
                raise store_closed(run_id)
            if self._pool is None:
                self._pool = self._open_pool(run_id)
            return self._pool

    def _open_pool(self, run_id: str | None) -> ConnectionPool[Watched]:
        settings, schema = self._settings, self._settings.schema
        what = "could not connect to the PostgreSQL server"
        try:
            # One connection first, outside the pool: a missing database or a refused
            # login fails now with the server's message, where the pool would time out.
            psycopg.connect(settings.conninfo, **settings.options).close()
            what = f"cannot prepare the {schema!r} schema"
            pool = ConnectionPool(
                settings.conninfo,
                connection_class=Watched,
                min_size=1,
                max_size=settings.pool_size,
                open=False,
                timeout=settings.timeout,
                kwargs={
                    **settings.options,
                    "autocommit": True,
                    "fallback_application_name": "polyloop-reader",
                },
                configure=partial(_set_statement_timeout, seconds=settings.statement_timeout_s),
                check=ConnectionPool.check_connection,
                name=f"polyloop-{schema}",
            )
            try:
                pool.open(wait=True, timeout=settings.timeout)
                with pool.connection(timeout=settings.timeout) as conn:
                    layout = self._queries.layout
                    if not settings.create:
                        _require_schema(conn, schema, run_id)
                        require_store(conn, layout, name=schema, run_id=run_id)
                    prepare(conn, layout, name=schema, where=f"{schema}.meta", run_id=run_id)
            except BaseException:
                pool.close()
                raise
        except psycopg.Error as exc:
            text = " ".join(str(exc).split())  # libpq's own message spans lines
            raise open_files_error(exc, run_id) or StoreError(
                f"{what}: {type(exc).__name__}: {text}", run_id=run_id
            ) from exc
        return pool


def _require_schema(conn: Watched, schema: str, run_id: str | None) -> None:
    """A ``StoreError`` if ``schema`` does not exist (``create=False``): a missing schema
    is named as such, not as one without tables."""
    row = conn.execute(
        "SELECT count(*) FROM pg_catalog.pg_namespace WHERE nspname = %s", (schema,)
    ).fetchone()
    if not row or not row[0]:
        raise StoreError(
            f"no PolyLoop store in schema {schema!r}: the schema does not exist", run_id=run_id
        )


class Owner:
    """This store object as an owner of runs: a row of ``owners`` with a lease, and an
    advisory lock held while it lives on a connection of its own, used with ``_lock``
    held. Every method blocks (in a worker thread; the lease keeper's for a renewal)."""

    __slots__ = ("_link", "_lock", "_queries", "_settings", "_state", "lease")

    def __init__(self, settings: Settings, queries: Queries, state: WriterState) -> None:
        self._settings = settings
        self._queries = queries
        self._state = state
        self._lock = threading.Lock()
        self.lease = Lease(settings.lease_s, self._renew)
        # Unanswered, a renewal fails within a quarter of the lease, so the keeper tries
        # again (on a new connection) while the lease still holds.
        self._link = Link(partial(settings.connect, "polyloop-owner", settings.lease_s / 4))

    def registered(self, run_id: str, token: EventLoopToken) -> tuple[str, int]:
        """The owner id and lease generation; registers the owner (lock, row, lease) once."""
        with self._lock:
            owner_id, generation, registered = self.lease.current()
            if registered:
                return owner_id, generation
            sent_at = self.lease.clock()
            key, hi, lo = owner_lock(self._settings.schema, owner_id)
            if self._state.closed:
                raise store_closed()
            try:
                conn = self._link.connected()
                # A lapsed identity's lock goes: its lease has ended anyway.
                conn.execute("SELECT pg_advisory_unlock_all()")
                conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
                conn.execute(self._queries.forget_owners)
                conn.execute(self._queries.register_owner, self._lease_params(owner_id, hi, lo))
            except psycopg.Error as exc:
                self._link.drop()
                what = f"could not register this worker as an owner of runs: {type(exc).__name__}"
                raise StoreError(f"{what}: {exc}", run_id=run_id) from exc
            self.lease.registered(owner_id, sent_at, token)
            return owner_id, generation

    def release(self, run_id: str, epoch: int) -> None:
        """Give up a claim on the owner's connection; a failure is logged, not raised."""
        with self._lock:
            try:
                if self._state.closed:
                    raise store_closed()
                self._link.connected().execute(
                    self._queries.release, {"run_key": run_key(run_id), "epoch": epoch}
                )
            except (psycopg.Error, StoreError):
                # The row keeps this owner until the store closes or its lease ends.
                logger.warning("run %r: could not give its claim up", run_id, exc_info=True)
                self._link.drop()

    def close(self) -> None:
        """Free every run this owner still holds, drop its row, close its connection."""
        with self._lock:
            owner_id, _, registered = self.lease.current()
            # Every run this owner still holds is free before this returns; a connection
            # whose session ended fails once, then a new one is tried.
            for _ in range(2 if registered else 0):
                try:
                    self._link.connected().execute(self._queries.drop_owner, (owner_id, owner_id))
                    break
                except (psycopg.Error, StoreError):
                    self._link.drop()
            self._link.closed = True
            self._link.drop()

    def _renew(self, owner_id: str) -> bool:
        """Extend the owner's lease while more than its lock margin is left (the lease
        keeper's thread). A lost connection is opened again and the owner's lock taken
        again (unless a session of this owner the server has not yet seen end still
        holds it): the margin held every other worker off meanwhile."""
        with self._lock:
            conn = self._link.connection
            lost = conn is None or conn.broken or conn.closed
            try:
                if self._state.closed:
                    return False
                conn = self._link.connected()
                if lost:
                    key, _, _ = owner_lock(self._settings.schema, owner_id)
                    conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
                done = conn.execute(self._queries.renew_owner, self._lease_params(owner_id))
            except psycopg.Error:
                self._link.drop()
                raise
            return done.rowcount == 1

    def _lease_params(self, owner_id: str, hi: int = 0, lo: int = 0) -> dict[str, object]:
        return {
            "owner": owner_id,
            "description": self.lease.description,
            "hi": hi,
            "lo": lo,
            "lease_s": self.lease.lease_s,
            # Half the effect margin: the other half covers clock rates and the moment
            # between the effect check and the effect (research record 0034).
            "margin_s": effect_margin(self.lease.lease_s) / 2,
        }


PostgresStore._DIALECT = Postgres
