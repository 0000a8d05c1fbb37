"""How a PostgreSQL store object connects: settings, connections, the reader pool, and a
deadline on every exchange, since no server or TCP timeout ends a wait on a silent path
(docs/stores.md#postgresstore)."""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psycopg
from psycopg import sql
from psycopg.abc import PQGen
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from polyloop.stores._lease import check_seconds
from polyloop.stores._open_files import open_files_error
from polyloop.stores._sql.schema import Layout, prepare, require_store
from polyloop.stores._writes import store_closed
from polyloop.types import InvalidRequest, StoreError


def deadline_s(statement_timeout_s: float) -> float:
    """How long the client waits for an answer: the server's statement timeout and half
    of it again (at least a second), so that the server's own error normally comes first."""
    return statement_timeout_s + max(1.0, statement_timeout_s / 2)


class Silent(psycopg.OperationalError):
    """The server did not answer before the deadline, and the connection was given up."""


class Watched(psycopg.Connection[TupleRow]):
    """A connection that gives up each exchange not done within ``deadline_s``."""

    deadline_s = math.inf

    def wait(self, gen: PQGen[Any], interval: float = 0.1, timeout: float | None = None) -> Any:
        given = math.inf if timeout is None else timeout
        began, limit = time.monotonic(), min(self.deadline_s, given)
        try:
            return super().wait(gen, interval, None if limit == math.inf else limit)
        except psycopg.OperationalError as exc:
            if limit < given and time.monotonic() - began >= limit:
                # The exchange stops halfway: the connection is of no more use.
                self.pgconn.finish()
                raise Silent(f"the server did not answer within {self.deadline_s:g} s") from exc
            raise


def shut(conn: Watched) -> None:
    """Shut the connection's socket both ways: a thread waiting on it wakes, and psycopg
    marks the connection broken."""
    with (
        contextlib.suppress(OSError, psycopg.Error),
        socket.socket(fileno=socket.dup(conn.pgconn.socket)) as sock,
    ):
        sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The options of a :class:`PostgresStore`, checked; ``options`` are added to
    ``conninfo`` (kept out of ``repr``: it may hold a password) for every connection."""

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
        check_seconds("timeout", self.timeout)
        check_seconds("lease_s", self.lease_s)
        check_seconds("statement_timeout_s", self.statement_timeout_s)
        object.__setattr__(self, "statement_timeout_s", float(self.statement_timeout_s))
        try:
            given = conninfo_to_dict(self.conninfo)
        except psycopg.Error:
            # The message would quote the string, which may hold a password.
            raise InvalidRequest("conninfo is not a valid libpq connection string or URL") from None
        # Keepalives find a dead peer on an idle connection, where no deadline runs.
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
        """A new connection named ``name``, its deadline at most ``deadline_s``."""
        conn = open_connection(self.conninfo, self.statement_timeout_s, name=name, **self.options)
        conn.deadline_s = min(conn.deadline_s, deadline_s)
        return conn


def open_connection(
    conninfo: str, statement_timeout_s: float, *, name: str, **options: Any
) -> Watched:
    """An autocommit connection with its timeouts set and ``synchronous_commit`` on."""
    try:
        conn = Watched.connect(conninfo, autocommit=True, fallback_application_name=name, **options)
    except psycopg.OperationalError as exc:
        limit = open_files_error(exc, None)  # a socket is a file too
        if limit is not None:
            raise limit from exc
        raise
    try:
        _configure(conn, seconds=statement_timeout_s)
    except BaseException:
        conn.close()
        raise
    return conn


def _configure(conn: Watched, *, seconds: float) -> None:
    """Set the statement timeout, and ``synchronous_commit`` on if the server has it off."""
    conn.deadline_s = deadline_s(seconds)
    milliseconds = sql.Literal(max(1, math.ceil(seconds * 1000)))
    conn.execute(sql.SQL("SET statement_timeout = {}").format(milliseconds))
    row = conn.execute("SHOW synchronous_commit").fetchone()
    if row is not None and row[0] == "off":
        conn.execute("SET synchronous_commit = on")


@dataclass(eq=False)
class Link:
    """A connection of the store object's own, opened at first use and again after a loss
    (safe: every write is fenced by its claim's epoch)."""

    connect: Callable[[], Watched]
    connection: Watched | None = None
    closed: bool = False

    def connected(self, run_id: str | None = None) -> Watched:
        if self.closed:
            raise store_closed(run_id)
        conn = self.connection
        if conn is None or conn.broken or conn.closed:
            self.drop()
            conn = self.connection = self.connect()
        return conn

    def drop(self) -> None:
        """The connection is lost or in doubt: close it; the next use opens another."""
        conn, self.connection = self.connection, None
        if conn is not None:
            conn.close()


def open_pool(settings: Settings, layout: Layout, run_id: str | None) -> ConnectionPool[Watched]:
    """The reader pool, opened, with the schema made current (or, not ``create``, checked)."""
    schema = settings.schema
    what = "could not connect to the PostgreSQL server"
    try:
        # First one outside the pool: a refused login fails now, with the server's message.
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
            configure=partial(_configure, seconds=settings.statement_timeout_s),
            check=ConnectionPool.check_connection,
            name=f"polyloop-{schema}",
        )
        try:
            pool.open(wait=True, timeout=settings.timeout)
            with pool.connection(timeout=settings.timeout) as conn:
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
    """A ``StoreError`` naming a missing schema as such, not as one without tables."""
    row = conn.execute(
        "SELECT count(*) FROM pg_catalog.pg_namespace WHERE nspname = %s", (schema,)
    ).fetchone()
    if not row or not row[0]:
        raise StoreError(
            f"no PolyLoop store in schema {schema!r}: the schema does not exist", run_id=run_id
        )
