"""The SQLite store as an owner of runs: its claims, its row in ``owners``, its lease.

A store object that claims a run becomes an owner: a row in the ``owners`` table with
the lease it holds, and a lock file in ``<path>.owners`` that only its living process
can hold. A claim names the owner in the run's row and moves the run's claim epoch on;
another owner may take the run over once this owner's lease ended or its lock is free.
Pruning deletes a run under such a claim. ``docs/stores.md`` describes this for users;
research records 0017 (claims) and 0018 (owners and leases) say why.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime

from anyio.lowlevel import EventLoopToken

from polyloop.stores._common import LockFile
from polyloop.stores._lease import Lease
from polyloop.stores._sqlite_sql import (
    DROP_OWNER,
    DROP_UNSTARTED,
    FREE_OWNED,
    FREE_RUN,
    NEW_RUN,
    OWNER_OF,
    PRUNABLE,
    PRUNE_ROWS,
    PRUNE_RUN,
    REGISTER_OWNER,
    RENEW_OWNER,
    SELECT_CLAIM,
    STALE_OWNERS,
    SYNCHRONOUS_NORMAL,
    TAKE_RUN,
    Database,
    Db,
    connect,
    immediate,
    run_id_of,
    run_key,
)
from polyloop.types import PolyLoopError, RunLocked, StoreError

__all__ = ("Claim", "Owners")

logger = logging.getLogger("polyloop")

# An owner row whose lease ended this long ago, holding no run, is removed.
_FORGET_OWNERS_AFTER_S = 86_400.0


@dataclass(eq=False, slots=True)
class Claim:
    """This store object is a run's writer: its claim epoch, the lease generation it was
    taken under, and where the run's rows stand (kept up to date by each commit)."""

    epoch: int
    generation: int
    next_seq: int  # 0: the run has no record yet
    finished: bool


class Owners:
    """One store object's claims, and the owner identity and lease they are held under.

    ``claims`` maps each run this store object writes to its :class:`Claim`; ``lease``
    keeps the owner's lease. Every method runs in a worker thread; those that touch the
    database take the store mutex, except :meth:`close`, which its caller holds it for.
    Cancellation never stops one halfway: a worker thread runs to its end.
    """

    __slots__ = ("_database", "_directory", "_lock", "_renewer", "claims", "lease")

    def __init__(self, database: Database, lease_s: float) -> None:
        self._database = database
        self._directory = database.path.with_name(database.path.name + ".owners")
        self.claims: dict[str, Claim] = {}
        self.lease = Lease(lease_s, self._renew)
        self._lock: LockFile | None = None  # held while this owner lives
        self._renewer: sqlite3.Connection | None = None  # the lease keeper's own

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        """Name this owner in the run's row and move its epoch on; ``RunLocked`` if a
        live owner (this one included) holds the run."""
        database = self._database
        with database.state.mutex:
            database.state.check_writable(run_id)
            if run_id in self.claims:
                raise RunLocked("this store object already holds the run's claim", run_id=run_id)
            conn = database.connection(run_id).conn
            owner_id, generation = self._registered(conn, run_id, token)
            key = run_key(run_id)
            with database.reading(run_id), immediate(conn):
                row = conn.execute(SELECT_CLAIM, (key,)).fetchone()
                if row is None:
                    conn.execute(NEW_RUN, (key, time.time(), owner_id))
                    epoch, next_seq, finished = 1, 0, False
                else:
                    holder, epoch, next_seq, finished = row
                    if holder is not None and self._alive(conn, holder):
                        raise RunLocked(
                            f"the run is held by {self._holder(conn, holder)}", run_id=run_id
                        )
                    conn.execute(TAKE_RUN, (owner_id, key))
                    epoch += 1
            self.claims[run_id] = Claim(
                epoch=epoch, generation=generation, next_seq=int(next_seq), finished=bool(finished)
            )

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it.

        Called on the event loop, so it does not wait for the store mutex (held through
        commits): each lookup reads one value whole, and a write it races is still
        checked by its own commit.
        """
        self._database.state.check_writable(run_id)
        claim = self.claims.get(run_id)
        if claim is None:
            raise RunLocked("this store object does not hold the run's claim", run_id=run_id)
        return claim

    def unclaim(self, run_id: str) -> None:
        """Give the claim up; the row of a run that never started goes with it."""
        with self._database.state.mutex:
            claim = self.claims.pop(run_id, None)
            db = self._database.opened
            if claim is None or db is None:
                return
            try:
                with immediate(db.conn):
                    db.conn.execute(DROP_UNSTARTED, (run_key(run_id), claim.epoch))
                    db.conn.execute(FREE_RUN, (run_key(run_id), claim.epoch))
            except sqlite3.Error:
                # The row keeps this owner until the store closes or its lease ends.
                logger.warning("run %r: could not give its claim up", run_id, exc_info=True)

    def prunable(self, before: float) -> list[str]:
        """The runs no owner holds that finished (not in doubt) before ``before``."""
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
                del self.claims[run_id]
            return bool(gone)

    def lives(self, owner_id: str, lease_until: float | None, now: float) -> bool:
        """Whether an owner whose lease runs until ``lease_until`` holds its runs now:
        the lease has not ended and its process holds its lock."""
        return (
            lease_until is not None
            and lease_until > now
            and LockFile.held(self._directory / f"{owner_id}.lock")
        )

    def close(self) -> None:
        """Free every run this owner holds, then drop its row, its lock and the lease
        keeper's connection (store mutex held; the lease already stopped)."""
        owner_id, _, registered = self.lease.current()
        db = self._database.opened
        self.claims.clear()
        if registered and db is not None:
            # Every run this owner still holds is free before this returns.
            try:
                with immediate(db.conn):
                    db.conn.execute(FREE_OWNED, (owner_id,))
                    db.conn.execute(DROP_OWNER, (owner_id,))
            except sqlite3.Error:
                logger.warning("could not give up the claims of owner %s", owner_id, exc_info=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._renewer is not None:
            self._renewer.close()
            self._renewer = None

    def _registered(
        self, conn: sqlite3.Connection, run_id: str, token: EventLoopToken
    ) -> tuple[str, int]:
        """This owner's id and lease generation, registering it if need be (store mutex
        held): take the owner's lock, write its row, keep its lease."""
        owner_id, generation, registered = self.lease.current()
        if registered:
            return owner_id, generation
        sent_at = self.lease.clock()
        lock = LockFile(self._directory / f"{owner_id}.lock", run_id)
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
            lock.acquire()
            if self._lock is not None:  # a lapsed identity's lock goes
                self._lock.release()
            self._lock = lock
            now = time.time()
            with self._database.reading(run_id), immediate(conn):
                self._forget_stale(conn, now)
                conn.execute(
                    REGISTER_OWNER,
                    (owner_id, self.lease.description, now + self.lease.lease_s, now),
                )
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise StoreError(
                f"could not register this worker as an owner of runs: {exc}", run_id=run_id
            ) from exc
        self.lease.registered(owner_id, sent_at, token)
        return owner_id, generation

    def _forget_stale(self, conn: sqlite3.Connection, now: float) -> None:
        """Remove owners whose lease ended long ago and who hold nothing, with their files."""
        for (owner_id,) in conn.execute(STALE_OWNERS, (now - _FORGET_OWNERS_AFTER_S,)).fetchall():
            path = self._directory / f"{owner_id}.lock"
            if not LockFile.held(path):
                with suppress(FileNotFoundError):
                    path.unlink()
                conn.execute(DROP_OWNER, (owner_id,))

    def _alive(self, conn: sqlite3.Connection, owner_id: str) -> bool:
        row = conn.execute(OWNER_OF, (owner_id,)).fetchone()
        return row is not None and self.lives(owner_id, row[1], time.time())

    @staticmethod
    def _holder(conn: sqlite3.Connection, owner_id: str) -> str:
        row = conn.execute(OWNER_OF, (owner_id,)).fetchone()
        if row is None:
            return "another writer"
        until = datetime.fromtimestamp(row[1], UTC)
        return f"{row[0]}, whose lease runs until {until:%Y-%m-%d %H:%M:%S %Z}"

    def _renew(self, owner_id: str) -> bool:
        """Extend the owner's lease if it has not ended (the lease keeper's thread, on a
        connection of its own: it must not wait behind the store's commits)."""
        if self._database.state.closed:
            return False
        if self._renewer is None:
            renewer = connect(self._database.path, timeout=self.lease.lease_s / 3)
            # A renewal need not reach the disk before it counts: only a crash of the
            # machine undoes it, and that ends the leaseholder too. Without the fsync, a
            # renewal never holds the write lock through a slow disk, where another
            # owner's renewal would wait and its lease could run out.
            Db(renewer).synchronous(SYNCHRONOUS_NORMAL)
            self._renewer = renewer
        now = time.time()
        done = self._renewer.execute(RENEW_OWNER, (now + self.lease.lease_s, owner_id, now))
        return done.rowcount == 1
