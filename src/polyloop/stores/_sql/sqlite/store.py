"""The SQLite store: every run in one database file, committed in shared transactions.

Tables ``meta`` (the record format and the layout), ``records`` (one row per record, its
body the line :func:`polyloop.serialization.dumps` writes) and ``runs`` (one row per run:
where its log stands, whether it finished, its writer and claim epoch); ``docs/stores.md``
describes them. The database runs in WAL mode on one connection, used by worker threads
under the store mutex. The writes waiting at one moment share one transaction
(:class:`Committer`), and each moves its run's row on under the writer's claim epoch or
rolls back alone. A claim is a lock the operating system keeps for a living process, with
no lease. Research records 0010 (durability), 0017 (claims), 0019 (one write path) and
0032 (claims by locks) say why.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from anyio.lowlevel import EventLoopToken

from polyloop.ports import StoredRun
from polyloop.stores._batching import GroupCommit
from polyloop.stores._byte_locks import HostClaims, OneHost
from polyloop.stores._common import Claim, Write, WriterState
from polyloop.stores._engine import EngineStore
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._refusals import fence_refusal
from polyloop.stores._sql.planning import Errors, Plan, RunPlan, plan
from polyloop.stores._sql.sqlite.sql import (
    ADVANCE_RUN,
    DESCRIBE_RUN,
    DROP_UNSTARTED,
    EXPLAIN_REFUSAL,
    FREE_RUN,
    INSERT,
    LIST_RUNS,
    LIST_UNFINISHED,
    NEW_RUN,
    PRUNABLE,
    PRUNE_ROWS,
    PRUNE_RUN,
    SELECT_CLAIM,
    SELECT_RUN,
    SYNCHRONOUS_FULL,
    SYNCHRONOUS_NORMAL,
    TAKE_RUN,
    Database,
    Db,
    decode_rows,
    immediate,
    rollback_quietly,
    run_id_of,
    run_key,
)
from polyloop.types import PolyLoopError, Record

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


class Committer:
    """Commits one store object's batches of writes, each in one ``BEGIN IMMEDIATE`` ...
    ``COMMIT`` under the store mutex, in a worker thread that runs to its end once
    started. The batch is planned as every database store plans one
    (:mod:`~polyloop.stores._sql.planning`); each run then writes under a savepoint of its
    own, so a run refused by the fence rolls back alone. A batch holding a barrier
    commits with ``synchronous=FULL``, any other with ``NORMAL``."""

    __slots__ = ("_claims", "_database")

    def __init__(self, database: Database, claims: HostClaims) -> None:
        self._database = database
        self._claims = claims

    def commit(self, writes: Sequence[Write]) -> Errors:
        """One transaction for ``writes``; one error or None each."""
        with self._database.state.mutex:
            batch = plan(writes, lambda index: self._admit(writes[index]))
            if batch.runs:
                db = self._database.opened
                assert db is not None  # _admit opened it
                self._transact(db, batch, self.level(batch))
            for run_id in batch.settle():
                # The end record's own statement gave the writer up in the run's row.
                self._claims.ended(batch.runs[run_id].claim)
            return batch.errors

    def level(self, batch: Plan) -> int:
        """The ``synchronous`` level of the transaction: ``FULL`` if a barrier is in it."""
        return SYNCHRONOUS_FULL if batch.barrier else SYNCHRONOUS_NORMAL

    def _admit(self, write: Write) -> Claim:
        """The claim the write is made under; make sure the connection is open."""
        claim = self._claims.held(write.run_id)
        self._database.connection(write.run_id)
        return claim

    def _transact(self, db: Db, batch: Plan, level: int) -> None:
        """Write the planned runs in one transaction, each under a savepoint when there
        are several, so that a refused or failed run is undone alone. A failure that
        ends the transaction fails every run still standing."""
        conn, savepoints = db.conn, len(batch.runs) > 1
        try:
            db.synchronous(level)
            conn.execute("BEGIN IMMEDIATE")
            for run in batch.runs.values():
                self._write_run(conn, batch, run, savepoint=savepoints)
            written = any(batch.written(run) for run in batch.runs.values())
            conn.execute("COMMIT" if written else "ROLLBACK")
        except (sqlite3.Error, OSError) as exc:
            rollback_quietly(conn)
            for run in batch.runs.values():
                batch.refuse(run, self._database.state.fail(run.run_id, exc))

    def _write_run(
        self, conn: sqlite3.Connection, batch: Plan, run: RunPlan, *, savepoint: bool
    ) -> None:
        """Insert one run's rows and move its row on; raises only when the failure ended
        the whole transaction."""
        if savepoint:
            conn.execute("SAVEPOINT run")
        key = run_key(run.run_id)
        try:
            conn.executemany(INSERT, [(key, seq, kind, body) for seq, kind, body in run.rows()])
            self._advance(conn, run, key)
        except PolyLoopError as refused:  # by the fence: nothing of the run may stay
            batch.refuse(run, refused)
        except sqlite3.Error as exc:
            batch.refuse(run, self._database.state.fail(run.run_id, exc))
            if not conn.in_transaction:
                raise
        else:
            if savepoint:
                conn.execute("RELEASE run")
            return
        if savepoint:  # alone in its transaction, the run is undone by its rollback
            conn.execute("ROLLBACK TO run")
            conn.execute("RELEASE run")

    def _advance(self, conn: sqlite3.Connection, run: RunPlan, key: object) -> None:
        """Move the run's row on, in the run's transaction; refuse what the row does not
        expect (another writer claimed the run since, or it ended)."""
        epoch = run.claim.epoch
        moved = conn.execute(
            ADVANCE_RUN,
            (
                run.next_seq,
                run.final,
                run.reason,
                time.time(),
                run.ends,
                key,
                epoch,
                run.first_seq,
            ),
        )
        if moved.rowcount != 1:
            row = conn.execute(EXPLAIN_REFUSAL, (key,)).fetchone()
            raise fence_refusal(run.run_id, epoch=epoch, row=row, start=run.start)


SqliteStore._DIALECT = Sqlite
