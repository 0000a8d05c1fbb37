"""The PostgreSQL store: one database shared by many worker processes on many hosts.

Tables in one schema: ``meta`` (the record format and the layout), ``records`` (one row
per record, keyed by the sha256 of the run id and the record's seq, its body the line
:func:`polyloop.serialization.dumps` writes), ``runs`` (one row per run: where its log
stands, whether it finished, its owner and claim epoch) and ``owners`` (the store
objects that claim runs, with their leases); ``docs/stores.md`` describes them for
users. Starts and intents commit with ``synchronous_commit`` on; a batch without them
commits with it off for its own transaction. Research records 0011 (durability), 0017
(claims), 0018 (owners, leases, timeouts) and 0019 (one write path) say why.

A claim is the run's row naming this store object's owner id, with a claim epoch; the
owner holds a session-level advisory lock on a connection of its own while it lives, and
a lease that :mod:`polyloop.stores._lease` keeps. Writes go through *writer connections*
(at most ``max_writer_connections``, never lent to the reader pool): the writes that wait
on a connection at the same moment are one batch, one statement, which moves each run's
row on under its epoch and inserts its records, or refuses the run. Every call runs in a
worker thread on plain blocking psycopg connections (psycopg's async API is tied to
asyncio), so the store serves asyncio and Trio alike; a store object must be used from
one event loop at a time.

The public methods are the database stores' shared engine
(:class:`~polyloop.stores._engine.EngineStore`); this module is PostgreSQL's dialect of
it, which only delegates. Its collaborators each hold one job:
:mod:`~polyloop.stores._sql.postgres.connect` (the checked options, opening a connection),
:mod:`~polyloop.stores._sql.postgres.read` (the reader pool, the schema, reading),
:mod:`~polyloop.stores._sql.postgres.owners` (the owner, its lease, its claims),
:mod:`~polyloop.stores._sql.postgres.writers` (which writer connection a run uses),
:mod:`~polyloop.stores._sql.postgres.batch` (committing a batch) and
:mod:`~polyloop.stores._sql.postgres.sql` (the statements).
"""

from __future__ import annotations

from datetime import datetime
from typing import ClassVar

from anyio.lowlevel import EventLoopToken

from polyloop.ports import StoredRun
from polyloop.stores._common import Write, WriterState
from polyloop.stores._engine import EngineStore
from polyloop.stores._sql.postgres.batch import Committer, Item, Probe
from polyloop.stores._sql.postgres.connect import Settings
from polyloop.stores._sql.postgres.owners import Claims, Owner
from polyloop.stores._sql.postgres.read import Reader
from polyloop.stores._sql.postgres.sql import Queries
from polyloop.stores._sql.postgres.writers import Writers
from polyloop.types import Record

__all__ = ("PostgresStore",)


class PostgresStore(EngineStore):
    """Keeps runs in a PostgreSQL database that many workers on many hosts can share.

    ``conninfo`` is a libpq connection string or URL (it is never reported: not by
    :meth:`parameters`, not by ``repr``). ``schema`` names the PostgreSQL schema that
    holds the tables; it is created on first use. ``pool_size`` bounds the connections
    used for reads and the DDL; ``max_writer_connections`` bounds the connections that
    hold writer locks (see the module documentation). ``timeout`` is how many seconds to
    wait for the pool to open or to lend a connection, and the connect timeout of every
    connection unless ``conninfo`` sets ``connect_timeout`` itself. ``lease_s`` is how
    long this store object's claims hold without a renewal (renewed every third of it
    while its event loop runs); another worker may take over the runs of an owner whose
    lease has ended, or whose process died. ``statement_timeout_s`` bounds every
    statement on the server (``statement_timeout``) and how long sent data may go
    unacknowledged (``tcp_user_timeout``, unless ``conninfo`` sets it), so a server that
    stops answering becomes a ``StoreError`` within about that time.

    The store is an async context manager; :meth:`aclose` gives up every claim it holds
    and closes every connection. Any worker connected to the same database resumes any
    run; a second writer of a run gets ``RunLocked``. Needs the ``postgres`` extra
    (psycopg 3 and psycopg-pool).

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its batch started writes
    nothing; once the batch started, the call waits for its commit, shielded, then lets
    the cancellation go on (its rows are committed, or it failed). Reads change nothing;
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
        _probe: Probe | None = None,
    ) -> None:
        settings = Settings.checked(
            conninfo,
            schema=schema,
            pool_size=pool_size,
            max_writers=max_writer_connections,
            timeout=timeout,
            lease_s=lease_s,
            statement_timeout_s=statement_timeout_s,
        )
        self._schema = schema
        super().__init__(self._DIALECT(settings, _probe))

    def __repr__(self) -> str:
        return f"PostgresStore(schema={self._schema!r})"

    # The dialect the store runs on; a benchmark baseline swaps in a variant.
    _DIALECT: ClassVar[type[Postgres]]


class Postgres:
    """PostgreSQL's dialect: a reader pool, writer connections that share commits, and
    owners with leases. Every method but the two coroutines and :meth:`holds` runs in a
    worker thread."""

    kind = "postgresql"

    __slots__ = ("_claims", "_owner", "_reader", "_writers")

    def __init__(self, settings: Settings, probe: Probe | None) -> None:
        queries = Queries.for_schema(settings.schema)
        state = WriterState()  # the runs that failed, and whether the store is closed
        self._reader = Reader(settings, queries, state)
        self._owner = Owner(settings, queries, state)
        # ``probe`` is a test seam: it sees each batch just before its commit.
        committer = Committer(state, queries, self._owner.lease, probe)
        self._writers = Writers(settings, state, committer)
        self._claims = Claims(self._owner, self._writers, self._reader, queries, state)

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        self._claims.claim(run_id, token)

    def release(self, run_id: str) -> None:
        self._claims.release(run_id)

    def holds(self, run_id: str) -> bool:
        return self._claims.held(run_id)

    async def confirm(self, run_id: str) -> None:
        # By this process's clock against the lease's last confirmed renewal, with the
        # margin to spare; a late lease is waited on while its renewal may still come.
        claim = self._claims.claim_of(run_id)
        await self._owner.lease.confirm(claim.generation, run_id)

    async def submit(self, write: Write) -> None:
        self._owner.lease.beat()
        with self._writers.used(write.run_id) as slot:
            await slot.writer.group.submit(Item(slot, write))

    def read(self, run_id: str) -> tuple[Record, ...]:
        return self._reader.read(run_id)

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        return self._reader.runs(unfinished_only)

    def describe(self, run_id: str) -> StoredRun | None:
        return self._reader.describe(run_id)

    def prunable(self, cutoff: datetime) -> list[str]:
        return self._reader.prunable(cutoff)

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        return self._claims.delete(run_id, cutoff)

    def open(self) -> None:
        self._reader.open()

    def close(self) -> None:
        """Refuse new work, stop the lease, close the writers, free the owner's runs,
        close the pool: in this order, so that nothing is written once the runs are free."""
        writers = self._writers.close()
        self._owner.lease.stop()
        for writer in writers:
            with writer.lock:
                writer.close()
        self._owner.close()
        self._reader.close()


PostgresStore._DIALECT = Postgres
