"""The settings of a PostgreSQL store object, and how it opens a connection of its own.

:class:`Settings` is the checked form of the store's constructor options; every part of
the store reads it. :func:`open_connection` opens the autocommit connections the store
keeps outside its reader pool (a writer's, the owner's), with the statement timeout set
and ``synchronous_commit`` on; :func:`scalar` reads a one-value answer.
``docs/stores.md`` describes the options for users; research records 0011 (durability)
and 0018 (owners, leases, timeouts) say why they are what they are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import TupleRow

from polyloop.stores._common import open_files_error
from polyloop.stores._lease import check_lease_s
from polyloop.types import InvalidRequest

__all__ = ("Connection", "Settings", "open_connection", "scalar", "set_statement_timeout")

Connection = psycopg.Connection[TupleRow]

_MAX_IDENTIFIER_BYTES = 63


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What one store object was asked for, checked; see :class:`PostgresStore`.

    ``options`` are the connection options added to ``conninfo`` for every connection;
    ``conninfo`` itself is left out of ``repr``, since it may hold a password.
    """

    conninfo: str = field(repr=False)
    schema: str
    pool_size: int
    max_writers: int
    timeout: float
    lease_s: float
    statement_timeout_s: float
    options: Mapping[str, Any]

    @classmethod
    def checked(
        cls,
        conninfo: str,
        *,
        schema: str,
        pool_size: int,
        max_writers: int,
        timeout: float,
        lease_s: float,
        statement_timeout_s: float,
    ) -> Settings:
        """The settings, or ``InvalidRequest`` naming the first option that is wrong."""
        if (
            not isinstance(schema, str)
            or not schema
            or len(schema.encode("utf-8", "surrogatepass")) > _MAX_IDENTIFIER_BYTES
            or "\x00" in schema
        ):
            raise InvalidRequest(
                f"schema must be a PostgreSQL name of 1 to {_MAX_IDENTIFIER_BYTES} bytes "
                f"without NUL, not {schema!r:.80}"
            )
        if pool_size < 1 or max_writers < 1:
            raise InvalidRequest("pool_size and max_writer_connections must be at least 1")
        if not timeout > 0:
            raise InvalidRequest("timeout must be a positive number of seconds")
        check_lease_s(lease_s)
        if not statement_timeout_s > 0:
            raise InvalidRequest("statement_timeout_s must be a positive number of seconds")
        return cls(
            conninfo=conninfo,
            schema=schema,
            pool_size=pool_size,
            max_writers=max_writers,
            timeout=timeout,
            lease_s=lease_s,
            statement_timeout_s=float(statement_timeout_s),
            options=_connect_options(conninfo, timeout, float(statement_timeout_s)),
        )

    def connect(self, name: str) -> Connection:
        """A new connection of the store object's own, named ``name`` on the server
        (blocking: call it from a worker thread)."""
        return open_connection(self.conninfo, self.statement_timeout_s, name=name, **self.options)


def _connect_options(conninfo: str, timeout: float, statement_timeout_s: float) -> dict[str, Any]:
    """Connection options added to ``conninfo`` unless it sets them itself: a connect
    timeout, and how long sent data may go unacknowledged before the connection is
    given up (so that a host or network that goes silent cannot hold a thread forever)."""
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        # The message would quote the string, which may hold a password.
        raise InvalidRequest("conninfo is not a valid libpq connection string or URL") from None
    options: dict[str, Any] = {}
    if "connect_timeout" not in given:
        options["connect_timeout"] = max(1, math.ceil(timeout))
    if "tcp_user_timeout" not in given:
        options["tcp_user_timeout"] = max(1, math.ceil(statement_timeout_s * 1000))
    return options


def open_connection(
    conninfo: str, statement_timeout_s: float, *, name: str, **options: Any
) -> Connection:
    """An autocommit connection of the store object's own (a writer's, or its owner's),
    with the statement timeout set and ``synchronous_commit`` on."""
    try:
        conn = psycopg.connect(conninfo, autocommit=True, fallback_application_name=name, **options)
    except psycopg.OperationalError as exc:
        limit = open_files_error(exc, None)  # a socket is a file too
        if limit is not None:
            raise limit from exc
        raise
    try:
        set_statement_timeout(conn, seconds=statement_timeout_s)
        row = conn.execute("SHOW synchronous_commit").fetchone()
        if row is not None and row[0] == "off":
            conn.execute("SET synchronous_commit = on")
    except BaseException:
        conn.close()
        raise
    return conn


def set_statement_timeout(conn: Connection, *, seconds: float) -> None:
    conn.execute(
        sql.SQL("SET statement_timeout = {}").format(sql.Literal(max(1, math.ceil(seconds * 1000))))
    )


def scalar(
    conn: Connection, query: sql.SQL | sql.Composed, params: Sequence[object] | Mapping[str, object]
) -> Any:
    """The first column of the first row of ``query`` (``None`` if there is no row)."""
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]
