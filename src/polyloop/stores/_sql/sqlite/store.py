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

import logging
import os
import socket
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from anyio.lowlevel import EventLoopToken

from polyloop.ports import StoredRun
from polyloop.stores._batching import GroupCommit
from polyloop.stores._byte_locks import HostClaims, OneHost
from polyloop.stores._common import Claim, WriterState
from polyloop.stores._engine import EngineStore
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._sql.sqlite.commit import Committer
from polyloop.stores._sql.sqlite.sql import (
    DESCRIBE_RUN,
    DROP_UNSTARTED,
    FREE_RUN,
    LIST_RUNS,
    LIST_UNFINISHED,
    NEW_RUN,
    PRUNABLE,
    PRUNE_ROWS,
    PRUNE_RUN,
    SELECT_CLAIM,
    SELECT_RUN,
    TAKE_RUN,
    Database,
    decode_rows,
    immediate,
    run_id_of,
    run_key,
)
from polyloop.types import Record

__all__ = ("SqliteStore",)

logger = logging.getLogger("polyloop")
_FILES = OsFileOps()


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


class Sqlite(OneHost):
    """SQLite's dialect: one connection under the store mutex, shared commits, claims by
    locked bytes. Every method but the two coroutines and :meth:`holds` runs in a worker
    thread; those that touch the database hold the store mutex (``state.mutex``)."""

    kind = "sqlite"

    __slots__ = ("_database", "_owner", "claims", "group", "state")

    def __init__(self, path: Path) -> None:
        self.state = WriterState()
        self._database = Database(path, self.state)  # opened at first use
        directory = path.with_name(path.name + ".claims")
        self.claims = HostClaims(directory, _FILES, self.state, inspect=self._take, free=self._free)
        # What the rows of the runs this object claims say about their writer.
        self._owner = f"{socket.gethostname()} pid {os.getpid()}"
        self.group = GroupCommit(Committer(self._database, self.claims).commit)

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        with self.state.mutex:  # first: an error names the database, not its claims
            self._database.connection(run_id)
        self.claims.take(run_id)

    def read(self, run_id: str) -> tuple[Record, ...]:
        """Query under the store mutex, decode after releasing it."""
        return decode_rows(self._database.path.name, run_id, self._select(SELECT_RUN, run_id))

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        return self._stored(self._select(LIST_UNFINISHED if unfinished_only else LIST_RUNS))

    def describe(self, run_id: str) -> StoredRun | None:
        rows = self._select(DESCRIBE_RUN, run_id)
        return self._stored(rows)[0] if rows else None

    def prunable(self, cutoff: datetime) -> list[str]:
        rows = self._select(PRUNABLE, None, cutoff.timestamp())
        return [run_id_of(key) for (key,) in rows]

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        with self.state.mutex:
            if not self.claims.holds(run_id):
                return False
            claim = self.claims.held(run_id)
            conn, key = self._database.connection(run_id).conn, run_key(run_id)
            with self._database.reading(run_id), immediate(conn):
                gone = conn.execute(PRUNE_RUN, (key, claim.epoch, cutoff.timestamp())).rowcount
                if gone:
                    conn.execute(PRUNE_ROWS, (key,))
            if gone:
                self.claims.ended(claim)
            return bool(gone)

    def open(self) -> None:
        with self.state.mutex, self._database.reading(None):
            self._database.connection(None)

    def close(self) -> None:
        self.state.closed = True  # no claim or write is admitted from here on
        self.claims.close()  # every claim given up before the connection goes
        with self.state.mutex:
            self._database.close()

    def _take(self, run_id: str) -> Claim:
        """Name this object in the run's row and move its epoch on (its byte locked); a
        new id gets a row with no record yet."""
        with self.state.mutex, self._database.reading(run_id):
            conn, key = self._database.connection(run_id).conn, run_key(run_id)
            with immediate(conn):
                row = conn.execute(SELECT_CLAIM, (key,)).fetchone()
                if row is None:
                    conn.execute(NEW_RUN, (key, time.time(), self._owner))
                    return Claim(run_id=run_id, epoch=1)
                epoch, next_seq, finished = row
                conn.execute(TAKE_RUN, (self._owner, key))
        return Claim(run_id=run_id, epoch=epoch + 1, next_seq=next_seq, finished=bool(finished))

    def _free(self, claim: Claim) -> None:
        """Clear this writer from the run's row (a run never started loses it), whatever
        the database says after: the byte, let go next, is the claim."""
        key = run_key(claim.run_id)
        try:
            with self.state.mutex:
                db = self._database.opened
                if db is not None:
                    with immediate(db.conn):
                        db.conn.execute(DROP_UNSTARTED, (key, claim.epoch))
                        db.conn.execute(FREE_RUN, (key, claim.epoch))
        except sqlite3.Error:
            # The row names this writer until its next claim; it holds nothing.
            logger.warning("run %r: could not clear its row's writer", claim.run_id, exc_info=True)

    def _select(
        self, query: str, run_id: str | None = None, *more: object
    ) -> list[tuple[Any, ...]]:
        """The rows of ``query`` (about ``run_id``, if given), under the store mutex."""
        parameters = (() if run_id is None else (run_key(run_id),)) + more
        with self.state.mutex, self._database.reading(run_id):
            return self._database.connection(run_id).conn.execute(query, parameters).fetchall()

    def _stored(self, rows: list[tuple[Any, ...]]) -> tuple[StoredRun, ...]:
        """Rows of the runs table; a run whose row names a writer is asked of its lock."""
        named = [run_id_of(key) for key, _, _, owner in rows if owner is not None]
        claimed = dict(zip(named, self.claims.claimed(named), strict=True))
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
