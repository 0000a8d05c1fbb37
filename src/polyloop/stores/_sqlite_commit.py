"""The SQLite store's shared commit: the writes waiting at one moment, one transaction.

:class:`Committer` takes a batch of writes from the store's
:class:`~polyloop.stores._batching.GroupCommit` and commits them in one ``BEGIN
IMMEDIATE`` ... ``COMMIT``, one savepoint per write, so that a refused or failed write
rolls back alone. Each write moves its run's row on under the writer's claim epoch, or
writes nothing. A batch holding a barrier (a start, an intent) commits with
``synchronous=FULL``, any other with ``NORMAL``. ``docs/stores.md`` describes the
guarantees; research records 0010 (durability), 0017 (claims) and 0019 (one write path,
off the event loop) say why.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from polyloop.stores._common import Write
from polyloop.stores._refusals import check_order, fence_refusal, not_claimed
from polyloop.stores._sqlite_claims import Claims
from polyloop.stores._sqlite_sql import (
    ADVANCE_RUN,
    EXPLAIN_REFUSAL,
    INSERT,
    SYNCHRONOUS_FULL,
    SYNCHRONOUS_NORMAL,
    Database,
    Db,
    params,
    rollback_quietly,
    run_key,
)
from polyloop.types import PolyLoopError

__all__ = ("Committer", "Outcome")

# One error (or None for success) per write of a commit.
Outcome = list[BaseException | None]


@dataclass(eq=False, slots=True)
class _Batch:
    """What one transaction learns about its writes before it commits."""

    writes: Sequence[Write]
    errors: Outcome
    next_seq: dict[str, int] = field(default_factory=dict)  # valid once committed

    @classmethod
    def of(cls, writes: Sequence[Write]) -> _Batch:
        return cls(writes, [None] * len(writes))


class Committer:
    """Commits one store object's batches of writes, each in one transaction.

    :meth:`commit` is blocking: the store calls it in a worker thread, which takes the
    store mutex for the whole batch. Cancellation never reaches it: once a batch has
    started, its thread runs to its end and every write learns its outcome.
    """

    __slots__ = ("_claims", "_database")

    def __init__(self, database: Database, claims: Claims) -> None:
        self._database = database
        self._claims = claims

    def commit(self, writes: Sequence[Write]) -> Outcome:
        """One transaction for ``writes``; one error or None each."""
        with self._database.state.mutex:
            batch = _Batch.of(writes)
            admitted = [i for i in range(len(writes)) if self._admit(batch, i)]
            if admitted:
                db = self._database.opened
                assert db is not None  # _admit opened it
                self._transact(db, batch, admitted, self.level(writes, admitted))
            self._settle(batch)
            return batch.errors

    def level(self, writes: Sequence[Write], admitted: Sequence[int]) -> int:
        """The ``synchronous`` level of the transaction: ``FULL`` if a barrier is in it."""
        if any(writes[i].barrier for i in admitted):
            return SYNCHRONOUS_FULL
        return SYNCHRONOUS_NORMAL

    def _admit(self, batch: _Batch, i: int) -> bool:
        """Refuse the write unless its run is claimed; make sure the connection is open."""
        write = batch.writes[i]
        try:
            self._database.state.check_writable(write.run_id)
            if write.run_id not in self._claims.claims:
                raise not_claimed(write.run_id)
            self._database.connection(write.run_id)
        except PolyLoopError as exc:
            batch.errors[i] = exc
            return False
        return True

    def _transact(self, db: Db, batch: _Batch, admitted: Sequence[int], level: int) -> None:
        """Insert the admitted writes in one transaction.

        A failure that ends the transaction fails every admitted write still standing.
        """
        conn = db.conn
        try:
            db.synchronous(level)
            conn.execute("BEGIN IMMEDIATE")
            for i in admitted:
                self._insert(conn, batch, i, savepoint=len(admitted) > 1)
            committing = any(batch.errors[i] is None for i in admitted)
            conn.execute("COMMIT" if committing else "ROLLBACK")
        except (sqlite3.Error, OSError) as exc:
            rollback_quietly(conn)
            batch.next_seq.clear()
            for i in admitted:
                if batch.errors[i] is None:
                    batch.errors[i] = self._database.state.fail(batch.writes[i].run_id, exc)

    def _insert(self, conn: sqlite3.Connection, batch: _Batch, i: int, *, savepoint: bool) -> None:
        """Insert one write's rows; a refused or failed write is undone alone.

        Raises only when the failure ended the whole transaction.
        """
        write = batch.writes[i]
        if savepoint:
            conn.execute("SAVEPOINT write")
        try:
            first = self._first_seq(batch, write)
            conn.executemany(INSERT, params(write, first))
            self._advance(conn, write, first)
        except PolyLoopError as exc:
            batch.errors[i] = exc
        except (sqlite3.Error, OSError) as exc:
            batch.errors[i] = self._database.state.fail(write.run_id, exc)
            if not conn.in_transaction:
                raise
        else:
            batch.next_seq[write.run_id] = first + len(write.rows)
            if savepoint:
                conn.execute("RELEASE write")
            return
        if savepoint:  # alone in its transaction, the write is undone by its rollback
            conn.execute("ROLLBACK TO write")
            conn.execute("RELEASE write")

    def _first_seq(self, batch: _Batch, write: Write) -> int:
        """The run's next ``seq``, from this batch or from the claim."""
        claim = self._claims.claims[write.run_id]
        first = batch.next_seq.get(write.run_id, claim.next_seq)
        check_order(write.run_id, start=write.start, started=first > 0, finished=claim.finished)
        return first

    def _advance(self, conn: sqlite3.Connection, write: Write, first: int) -> None:
        """Move the run's row on, in the write's transaction; refuse a write the row
        does not expect (another writer claimed the run since, or it ended)."""
        key, following = run_key(write.run_id), first + len(write.rows)
        epoch = self._claims.claims[write.run_id].epoch
        moved = conn.execute(
            ADVANCE_RUN,
            (following, write.final, write.reason, time.time(), write.end, key, epoch, first),
        )
        if moved.rowcount == 1:
            return
        row = conn.execute(EXPLAIN_REFUSAL, (key,)).fetchone()
        raise fence_refusal(write.run_id, epoch=epoch, row=row, start=write.start)

    def _settle(self, batch: _Batch) -> None:
        """After the commit: remember each run's next seq; an ended run gives up its claim."""
        for i, write in enumerate(batch.writes):
            if batch.errors[i] is None and write.end:
                # The end record's own statement gave the writer up in the run's row.
                self._claims.ended(write.run_id)
        claims = self._claims.claims
        for run_id, seq in batch.next_seq.items():
            claim = claims.get(run_id)
            if claim is not None:
                claim.next_seq = seq
