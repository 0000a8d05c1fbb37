"""The SQLite store: every run in one database file, one connection under the store
mutex, shared transactions with a savepoint per run (docs/stores.md#sqlitestore)."""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from anyio.lowlevel import EventLoopToken

from polyloop._paging import PageRequest
from polyloop.ports import RunPage, StoredRun
from polyloop.stores._byte_locks import OneHost
from polyloop.stores._engine import Archive, EngineStore, Watch
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._polling import Poller
from polyloop.stores._sql.paging import run_page
from polyloop.stores._sql.planning import Errors, Plan, RunPlan, plan
from polyloop.stores._sql.rows import read_rows, read_rows_after
from polyloop.stores._sql.sqlite import sql
from polyloop.stores._writes import Claim, Write, kept_cancel
from polyloop.types import CancelRequest, PolyLoopError, Record, StoreError

logger = logging.getLogger("polyloop")


class SqliteStore(EngineStore):
    """Keeps runs in one SQLite database file (WAL; starts, intents and reviews fsync'd
    before their call returns) for one host (docs/stores.md#sqlitestore).

    ``path`` names the database file (missing directories are made); a new store object
    on it, or on a moved copy, reads and resumes its runs. A claim is a locked byte of a
    lock file in ``<path>.claims``, freed when its process dies. With ``create=False``
    only a file that holds PolyLoop tables opens, and nothing is made.

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered, so a write is committed or failed whole; a write
    cancelled before its shared commit started writes nothing. Reads change nothing;
    closing completes even in a cancelled scope.
    """

    __slots__ = ("_path",)

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        self._path = Path(os.fspath(path))
        super().__init__(Sqlite(self._path, create=create))

    def __repr__(self) -> str:
        return f"SqliteStore({os.fspath(self._path)!r})"


class Sqlite(OneHost):
    """SQLite's dialect: one connection, opened at first use and used only under the store
    mutex (``state.mutex``), shared commits, claims by locked bytes. Blocking."""

    kind = "sqlite"

    def __init__(self, path: Path, *, create: bool = True) -> None:
        super().__init__(path.with_name(path.name + ".claims"), OsFileOps(), self.commit)
        self._path = path
        self._create = create
        self._conn: sqlite3.Connection | None = None
        self._full: bool | None = True  # synchronous=FULL; None: unknown, a pragma failed
        # What the rows of the runs this object claims say about their writer.
        self._owner = f"{socket.gethostname()} pid {os.getpid()}"
        self._poller = Poller(self._lengths)

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        self.open(run_id)  # first: an error names the database, not its claims
        super().claim(run_id, token)

    def read(self, run_id: str) -> tuple[Record, ...]:
        rows, where = self._select(sql.SELECT_RUN, run_id), self._path
        return read_rows(rows, run_id, where=lambda seq: f"{where}: run row seq {seq}")

    def read_after(self, run_id: str, after: int) -> tuple[Record, ...]:
        where = self._path
        return read_rows_after(
            partial(self._select, sql.SELECT_AFTER, run_id),
            lambda: bool(self._select(sql.RUN_LENGTH, run_id)),
            run_id,
            after,
            where=lambda seq: f"{where}: run row seq {seq}",
        )

    def appended(self, run_id: str) -> Watch:
        return self._poller.appended(run_id)

    def _lengths(self, run_ids: Collection[str]) -> dict[str, int]:
        """The length of each run that has a record, a few hundred runs a statement."""
        keys = {sql.run_key(run_id): run_id for run_id in run_ids}
        listed, lengths = list(keys), dict[str, int]()
        for at in range(0, len(listed), sql.KEYS_A_STATEMENT):
            chunk = listed[at : at + sql.KEYS_A_STATEMENT]
            rows = self._select(sql.run_lengths(len(chunk)), None, *chunk)
            lengths.update((keys[key], length) for key, length in rows)
        return lengths

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        rows = self._select(sql.LIST_UNFINISHED if unfinished_only else sql.LIST_RUNS)
        return tuple(map(self._stored, rows))

    def page(self, request: PageRequest) -> RunPage:
        query, params = sql.page_query(request)
        with self.state.mutex, self._reading(None) as conn:
            rows = conn.execute(query, params).fetchall()
        return run_page(rows, request, self._stored)

    def describe(self, run_id: str) -> StoredRun | None:
        rows = self._select(sql.DESCRIBE_RUN, run_id)
        return self._stored(rows[0]) if rows else None

    def request_cancel(self, request: CancelRequest) -> bool:
        """Keep the first request in the run's row, synced; whether the run has a record."""
        assert request.at is not None  # the engine stamped it
        asked = (request.by, request.reason, time.time(), request.at.isoformat())
        with self.state.mutex, self._reading(request.run_id, "write") as conn:
            self._synchronous(conn, full=True)  # the statement is its own transaction
            return conn.execute(sql.ASK_CANCEL, (*asked, sql.run_key(request.run_id))).rowcount == 1

    def read_cancel(self, run_id: str) -> CancelRequest | None:
        rows = self._select(sql.READ_CANCEL, run_id)
        return kept_cancel(run_id, *rows[0]) if rows else None

    def prunable(self, cutoff: datetime, archive: Archive) -> list[str]:
        return [
            sql.run_id_of(key) for (key,) in self._select(sql.PRUNABLE, None, cutoff.timestamp())
        ]

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        with self.state.mutex:
            if not self.holds(run_id):
                return False
            claim, key = self.held(run_id), sql.run_key(run_id)
            with self._reading(run_id) as conn, sql.immediate(conn):
                gone = conn.execute(sql.PRUNE_RUN, (key, claim.epoch, cutoff.timestamp())).rowcount
                if gone:
                    conn.execute(sql.PRUNE_ROWS, (key,))
            if gone:
                self.ended(claim)
            return bool(gone)

    def open(self, run_id: str | None = None) -> None:
        with self.state.mutex:
            self._connection(run_id)

    def close(self) -> None:
        super().close()  # every claim given up before the connection goes
        with self.state.mutex:
            conn, self._conn = self._conn, None
            try:
                if conn is not None:
                    conn.close()
            except sqlite3.Error as exc:
                raise StoreError(f"closing {self._path} failed: {exc}") from exc

    def commit(self, writes: Sequence[Write]) -> Errors:
        """One transaction for the writes waiting at one moment; an outcome each."""
        with self.state.mutex:
            batch = plan(writes, lambda index: self._admit(writes[index]))
            if batch.runs:
                self._transact(batch)
            for run_id in batch.settle():
                # The end record's own statement gave the writer up in the run's row.
                self.ended(batch.runs[run_id].claim)
            return batch.errors

    def _connection(self, run_id: str | None) -> sqlite3.Connection:
        self.state.check_open(run_id)
        if self._conn is None:
            self._conn = sql.connect(self._path, run_id, create=self._create)
        return self._conn

    @contextmanager
    def _reading(self, run_id: str | None, what: str = "read") -> Iterator[sqlite3.Connection]:
        """The connection; a statement that fails is a ``StoreError``."""
        try:
            yield self._connection(run_id)
        except sqlite3.Error as exc:
            reason = f"{what} failed: {type(exc).__name__}: {exc}"
            raise StoreError(reason, run_id=run_id) from exc

    def _synchronous(self, conn: sqlite3.Connection, *, full: bool) -> None:
        """``synchronous=FULL`` to sync a commit, else NORMAL; taken between transactions."""
        if self._full is not full:
            self._full = None  # unknown until the pragma returns
            conn.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
            self._full = full

    def _select(
        self, query: str, run_id: str | None = None, *more: object
    ) -> list[tuple[Any, ...]]:
        """The rows of ``query`` (about ``run_id``, if given), under the store mutex."""
        parameters = (() if run_id is None else (sql.run_key(run_id),)) + more
        with self.state.mutex, self._reading(run_id) as conn:
            return conn.execute(query, parameters).fetchall()

    def _stored(self, row: tuple[Any, ...]) -> StoredRun:
        """A row of the runs table; a run whose row names a writer asks its lock."""
        key, finished, updated_at, owner, cancel_requested = row
        return StoredRun(
            run_id=sql.run_id_of(key),
            finished=bool(finished),
            claimed=owner is not None and self.claimed(sql.run_id_of(key)),
            updated_at=datetime.fromtimestamp(updated_at, UTC),
            owner=owner,
            cancel_requested=bool(cancel_requested),
        )

    def inspect(self, run_id: str) -> Claim:
        """Name this object in the run's row (a new one for a new id) and move its epoch on."""
        key = sql.run_key(run_id)
        with self.state.mutex, self._reading(run_id) as conn, sql.immediate(conn):
            row = conn.execute(sql.SELECT_CLAIM, (key,)).fetchone()
            if row is None:
                conn.execute(sql.NEW_RUN, (key, time.time(), self._owner))
                return Claim(run_id=run_id, epoch=1)
            conn.execute(sql.TAKE_RUN, (self._owner, key))
        epoch, finished, next_seq = row[:3]
        return Claim(run_id=run_id, epoch=epoch + 1, next_seq=next_seq, finished=bool(finished))

    def free(self, claim: Claim) -> None:
        """Clear this writer from the run's row (drop a run never started); the byte,
        let go next, is the claim, so a failure is only logged."""
        key = sql.run_key(claim.run_id)
        try:
            with self.state.mutex:
                if (conn := self._conn) is not None:
                    with sql.immediate(conn):
                        conn.execute(sql.DROP_UNSTARTED, (key, claim.epoch))
                        conn.execute(sql.FREE_RUN, (key, claim.epoch))
        except sqlite3.Error:
            logger.warning("run %r: could not clear its row's writer", claim.run_id, exc_info=True)

    def _admit(self, write: Write) -> Claim:
        """The claim the write is made under, the connection opened."""
        claim = self.held(write.run_id)
        self._connection(write.run_id)
        return claim

    def _transact(self, batch: Plan) -> None:
        """Write the planned runs in one transaction, ``synchronous=FULL`` for a barrier."""
        conn = self._conn
        assert conn is not None  # _admit opened it
        try:
            self._synchronous(conn, full=batch.barrier)
            conn.execute("BEGIN IMMEDIATE")
            for run in batch.runs.values():
                self._write_run(conn, batch, run, savepoint=len(batch.runs) > 1)
            written = any(batch.written(run) for run in batch.runs.values())
            conn.execute("COMMIT" if written else "ROLLBACK")
        except (sqlite3.Error, OSError) as exc:
            sql.rollback_quietly(conn)
            for run in batch.runs.values():
                batch.refuse(run, self.state.fail(run.run_id, exc))

    def _write_run(
        self, conn: sqlite3.Connection, batch: Plan, run: RunPlan, *, savepoint: bool
    ) -> None:
        """Insert one run's rows and move its row on past the fence (under a savepoint
        if not alone); raise only when the failure ended the whole transaction."""
        if savepoint:
            conn.execute("SAVEPOINT run")
        key, epoch = sql.run_key(run.run_id), run.claim.epoch
        try:
            conn.executemany(sql.INSERT, [(key, *row) for row in run.rows()])
            moved_to = (run.next_seq, run.final, run.reason, time.time(), run.ends)
            fence = (key, epoch, run.first_seq, run.fenced)
            if conn.execute(sql.ADVANCE_RUN, (*moved_to, *fence)).rowcount != 1:
                # Another writer claimed the run since, it ended, or a cancel was requested.
                row = conn.execute(sql.SELECT_CLAIM, (key,)).fetchone()
                raise run.fenced_out(row)
        except PolyLoopError as refused:  # by the fence: nothing of the run may stay
            batch.refuse(run, refused)
        except sqlite3.Error as exc:
            batch.refuse(run, self.state.fail(run.run_id, exc))
            if not conn.in_transaction:
                raise
        else:
            if savepoint:
                conn.execute("RELEASE run")
            return
        if savepoint:  # alone in its transaction, the run is undone by its rollback
            conn.execute("ROLLBACK TO run")
            conn.execute("RELEASE run")
