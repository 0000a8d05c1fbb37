"""The SQLite store: every run in one database file, committed in shared transactions.

Tables ``meta`` (the record format), ``records`` (one row per record, its body the line
:func:`polyloop.serialization.dumps` writes) and ``runs`` (one row per run: where its
log stands, whether it finished, its writer and claim epoch); ``docs/stores.md``
describes them for users. The database runs in WAL mode: starts and intents commit with
``synchronous=FULL``, every other write with ``NORMAL`` unless a barrier shares its
commit. Each write moves its run's row on in the same transaction, under the writer's
claim epoch, or is rolled back whole. SQLite is a store for one host: a claim is a lock
the operating system keeps for a living process, with no lease. Research records 0010
(durability), 0017 (claims), 0019 (one write path, off the event loop) and 0032 (claims
by locks) say why.

Every blocking call runs in a worker thread, on one connection guarded by the store
mutex: the writes waiting at the same moment share one ``BEGIN IMMEDIATE`` ... ``COMMIT``
(:class:`~polyloop.stores._batching.GroupCommit`), one savepoint per write, so a refused
write rolls back alone. The public methods are the database stores' shared engine
(:class:`~polyloop.stores._engine.EngineStore`); this module is SQLite's dialect of it:
:mod:`~polyloop.stores._sql.sqlite.commit` commits, :mod:`~polyloop.stores._sql.sqlite.claims`
keeps the claims, and :mod:`~polyloop.stores._sql.sqlite.sql` holds the statements and
opens the database.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from anyio.lowlevel import EventLoopToken

from polyloop.ports import StoredRun
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import Write, WriterState
from polyloop.stores._engine import EngineStore
from polyloop.stores._sql.sqlite.claims import Claims
from polyloop.stores._sql.sqlite.commit import Committer
from polyloop.stores._sql.sqlite.sql import (
    DESCRIBE_RUN,
    LIST_RUNS,
    LIST_UNFINISHED,
    SELECT_RUN,
    Database,
    decode_rows,
    run_id_of,
    run_key,
)
from polyloop.types import Record

__all__ = ("SqliteStore",)


class SqliteStore(EngineStore):
    """Keeps runs in one SQLite database file (WAL; intents and starts fsync'd).

    ``path`` names the database file; missing parent directories are created, each
    synced into its parent, and one that cannot be made is a ``StoreError`` naming it.
    Runs survive the store object, the process and the machine: a new store object on
    the same file (or a copy moved elsewhere) reads and resumes them. It is a store for
    one host: a claim is a lock on one byte of a lock file in the sibling directory
    ``<path>.claims``, which the operating system keeps for the living process that
    took it. A killed process's runs are free at once; a hung one keeps them until it
    is killed. Starts, intents and reviews are fsync'd before their call returns; other
    writes are committed, and flushed by the next barrier. The store is an async context
    manager; :meth:`aclose` gives up every claim and closes its connection.

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its shared commit started
    writes nothing; once the commit started, the call waits for it, shielded, then lets
    the cancellation go on (its rows are committed, or it failed). Reads change nothing;
    closing completes even in a cancelled scope.
    """

    __slots__ = ("_path",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(os.fspath(path))
        super().__init__(self._DIALECT(self._path))

    def __repr__(self) -> str:
        return f"SqliteStore({os.fspath(self._path)!r})"

    # The dialect the store runs on; a benchmark baseline swaps in a variant.
    _DIALECT: ClassVar[type[Sqlite]]


class Sqlite:
    """SQLite's dialect: one connection under the store mutex, shared commits, claims
    by locked bytes. Every method but the two coroutines and :meth:`holds` runs in a
    worker thread."""

    kind = "sqlite"

    __slots__ = ("_claims", "_database", "_group", "_state")

    def __init__(self, path: Path) -> None:
        self._state = WriterState()
        self._database = Database(path, self._state)  # opened at first use
        self._claims = Claims(self._database)
        self._group = GroupCommit(Committer(self._database, self._claims).commit)

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        self._claims.claim(run_id)

    def release(self, run_id: str) -> None:
        self._claims.unclaim(run_id)

    def holds(self, run_id: str) -> bool:
        return run_id in self._claims.claims

    async def confirm(self, run_id: str) -> None:
        # A lock with no lease, held as long as this process lives.
        self._claims.held(run_id)

    async def submit(self, write: Write) -> None:
        await self._group.submit(write)

    def read(self, run_id: str) -> tuple[Record, ...]:
        """Query under the store mutex, decode after releasing it."""
        return decode_rows(self._database.path.name, run_id, self._select(SELECT_RUN, run_id))

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        return self._stored(self._select(LIST_UNFINISHED if unfinished_only else LIST_RUNS))

    def describe(self, run_id: str) -> StoredRun | None:
        rows = self._select(DESCRIBE_RUN, run_id)
        return self._stored(rows)[0] if rows else None

    def prunable(self, cutoff: datetime) -> list[str]:
        return self._claims.prunable(cutoff.timestamp())

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        return self._claims.delete(run_id, cutoff.timestamp())

    def open(self) -> None:
        with self._state.mutex, self._database.reading(None):
            self._database.connection(None)

    def close(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            self._claims.close()  # every claim given up before the connection goes
            self._database.close()

    def _select(self, query: str, run_id: str | None = None) -> list[tuple[Any, ...]]:
        """The rows of ``query`` (about ``run_id``, if given), under the store mutex."""
        parameters = () if run_id is None else (run_key(run_id),)
        with self._state.mutex, self._database.reading(run_id):
            return self._database.connection(run_id).conn.execute(query, parameters).fetchall()

    def _stored(self, rows: list[tuple[Any, ...]]) -> tuple[StoredRun, ...]:
        """Rows of the runs table; a run whose row names a writer is asked of its lock."""
        named = [run_id_of(key) for key, _, _, owner in rows if owner is not None]
        claimed = dict(zip(named, self._claims.claimed(named), strict=True))
        return tuple(
            StoredRun(
                run_id=run_id_of(key),
                finished=bool(finished),
                claimed=claimed.get(run_id_of(key), False),
                updated_at=datetime.fromtimestamp(updated_at, UTC),
                owner=owner,
            )
            for key, finished, updated_at, owner in rows
        )


SqliteStore._DIALECT = Sqlite
