"""The SQLite store's claims: a locked byte per run that only a living process holds.

SQLite is a store for one host, like ``JsonlStore``: to claim run ``R`` is to take its
byte in the lock files of ``<path>.claims/``
(:class:`~polyloop.stores._byte_locks.ByteLocks`), then, in one transaction, name this
store object in the run's row and move its claim epoch on. The operating system frees
the byte when the process dies, at once; a process that hangs keeps it, and its runs,
until it is killed. There is no lease to run out: research record 0032 says why. The
epoch still fences every write, and pruning deletes a run under its claim.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from dataclasses import dataclass

from polyloop.stores._byte_locks import ByteLocks
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._refusals import claimed_already, not_claimed
from polyloop.stores._sql.sqlite.sql import (
    DROP_UNSTARTED,
    FREE_RUN,
    NEW_RUN,
    PRUNABLE,
    PRUNE_ROWS,
    PRUNE_RUN,
    SELECT_CLAIM,
    TAKE_RUN,
    Database,
    immediate,
    run_id_of,
    run_key,
)
from polyloop.types import StoreError

__all__ = ("Claim", "Claims")

logger = logging.getLogger("polyloop")

_FILES = OsFileOps()


@dataclass(eq=False, slots=True)
class Claim:
    """This store object is a run's writer: its claim epoch, its locked byte, and where
    the run's rows stand (kept up to date by each commit)."""

    epoch: int
    offset: int
    next_seq: int  # 0: the run has no record yet
    finished: bool


class Claims:
    """One store object's claims, by run id, and the locked bytes that hold them.

    Every method runs in a worker thread, except :meth:`held`, which the event loop
    calls. Those that touch the database take the store mutex, except :meth:`close` and
    :meth:`ended`, whose callers hold it. Cancellation never stops one halfway.
    """

    __slots__ = ("_database", "_locks", "_ready", "claims", "owner")

    def __init__(self, database: Database) -> None:
        self._database = database
        self._locks = ByteLocks(database.path.with_name(database.path.name + ".claims"), _FILES)
        self._ready = False  # the claims directory exists
        self.claims: dict[str, Claim] = {}
        # What the rows of the runs this object claims say about their writer.
        self.owner = f"{socket.gethostname()} pid {os.getpid()}"

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it.

        Called on the event loop, so it does not wait for the store mutex (held through
        commits): each lookup reads one value whole, and a write it races is still
        checked by its own commit.
        """
        self._database.state.check_writable(run_id)
        claim = self.claims.get(run_id)
        if claim is None:
            raise not_claimed(run_id)
        return claim

    def claim(self, run_id: str) -> None:
        """Take the run's byte, then name this store object in the run's row and move its
        epoch on; ``RunLocked`` if anyone (this object included) holds the run."""
        database = self._database
        with database.state.mutex:
            database.state.check_writable(run_id)
            if run_id in self.claims:
                raise claimed_already(run_id)
            conn = database.connection(run_id).conn
            if not self._ready:
                self._make_directory(run_id)
            offset = self._locks.lock(run_id)
            try:
                key = run_key(run_id)
                with database.reading(run_id), immediate(conn):
                    row = conn.execute(SELECT_CLAIM, (key,)).fetchone()
                    if row is None:
                        conn.execute(NEW_RUN, (key, time.time(), self.owner))
                        epoch, next_seq, finished = 1, 0, False
                    else:
                        epoch, next_seq, finished = row
                        conn.execute(TAKE_RUN, (self.owner, key))
                        epoch += 1
            except BaseException:
                self._locks.unlock(offset)
                raise
            self.claims[run_id] = Claim(
                epoch=epoch, offset=offset, next_seq=int(next_seq), finished=bool(finished)
            )

    def unclaim(self, run_id: str) -> None:
        """Give the claim up; the row of a run that never started goes with it."""
        with self._database.state.mutex:
            claim = self.claims.pop(run_id, None)
            if claim is not None:
                self._free(run_id, claim)

    def ended(self, run_id: str) -> None:
        """The run's end record was committed, and its row gave this writer up with it:
        let the byte go (store mutex held)."""
        claim = self.claims.pop(run_id, None)
        if claim is not None:
            self._locks.unlock(claim.offset)

    def prunable(self, before: float) -> list[str]:
        """The runs nobody holds that finished (not in doubt) before ``before``."""
        with self._database.state.mutex, self._database.reading(None):
            rows = self._database.connection(None).conn.execute(PRUNABLE, (before,)).fetchall()
        return [run_id_of(key) for (key,) in rows]

    def delete(self, run_id: str, before: float) -> bool:
        """Delete a run this store object holds the claim of, if it still may go."""
        database = self._database
        with database.state.mutex:
            claim = self.claims.get(run_id)
            if claim is None:
                return False
            conn, key = database.connection(run_id).conn, run_key(run_id)
            with database.reading(run_id), immediate(conn):
                gone = conn.execute(PRUNE_RUN, (key, claim.epoch, before)).rowcount
                if gone:
                    conn.execute(PRUNE_ROWS, (key,))
            if gone:
                self.ended(run_id)
            return bool(gone)

    def claimed(self, run_ids: list[str]) -> list[bool]:
        """Whether anyone (this store object included) holds each run's claim now."""
        return self._locks.held(run_ids)

    def close(self) -> None:
        """Give up every claim (store mutex held): free the rows, then the bytes."""
        claims, self.claims = self.claims, {}
        for run_id, claim in claims.items():
            self._free(run_id, claim)
        self._locks.close()

    def _make_directory(self, run_id: str) -> None:
        """Make the claims directory beside the database. It holds only lock files,
        whose locks live in the kernel, so its entry need not reach the disk."""
        directory = self._locks.directory
        try:
            directory.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise StoreError(
                f"cannot create the directory {directory}: {reason}", run_id=run_id
            ) from exc
        self._ready = True

    def _free(self, run_id: str, claim: Claim) -> None:
        """Clear this writer from the run's row (a run never started loses its row),
        then let the byte go, whatever the database says: the byte is the claim."""
        db = self._database.opened
        try:
            if db is not None:
                with immediate(db.conn):
                    db.conn.execute(DROP_UNSTARTED, (run_key(run_id), claim.epoch))
                    db.conn.execute(FREE_RUN, (run_key(run_id), claim.epoch))
        except sqlite3.Error:
            # The row names this writer until its next claim; it holds nothing.
            logger.warning("run %r: could not clear its row's writer", run_id, exc_info=True)
        finally:
            self._locks.unlock(claim.offset)
