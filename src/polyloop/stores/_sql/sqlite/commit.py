"""The SQLite store's shared commit: the writes waiting at one moment, one transaction.

:class:`Committer` takes a batch of writes from the store's
:class:`~polyloop.stores._batching.GroupCommit` and commits them in one ``BEGIN
IMMEDIATE`` ... ``COMMIT``. The batch is planned as every database store plans one
(:mod:`~polyloop.stores._sql.planning`); then, under one savepoint per run, each run's rows
are inserted and its row moved on under the writer's claim epoch, or the run writes
nothing and rolls back alone. A batch holding a barrier (a start, an intent) commits with
``synchronous=FULL``, any other with ``NORMAL``. ``docs/stores.md`` describes the
guarantees; research records 0010 (durability), 0017 (claims) and 0019 (one write path,
off the event loop) say why.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from polyloop.stores._byte_locks import HostClaims
from polyloop.stores._common import Claim, Write
from polyloop.stores._refusals import fence_refusal
from polyloop.stores._sql.planning import Errors, Plan, RunPlan, plan
from polyloop.stores._sql.sqlite.sql import (
    ADVANCE_RUN,
    EXPLAIN_REFUSAL,
    INSERT,
    SYNCHRONOUS_FULL,
    SYNCHRONOUS_NORMAL,
    Database,
    Db,
    rollback_quietly,
    run_key,
)
from polyloop.types import PolyLoopError

__all__ = ("Committer",)


class Committer:
    """Commits one store object's batches of writes, each in one transaction.

    :meth:`commit` is blocking: the store calls it in a worker thread, which takes the
    store mutex for the whole batch. Cancellation never reaches it: once a batch has
    started, its thread runs to its end and every write learns its outcome.
    """

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

    def level(self, batch: Plan[Claim]) -> int:
        """The ``synchronous`` level of the transaction: ``FULL`` if a barrier is in it."""
        return SYNCHRONOUS_FULL if batch.barrier else SYNCHRONOUS_NORMAL

    def _admit(self, write: Write) -> Claim:
        """The claim the write is made under; make sure the connection is open."""
        claim = self._claims.held(write.run_id)
        self._database.connection(write.run_id)
        return claim

    def _transact(self, db: Db, batch: Plan[Claim], level: int) -> None:
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
        self, conn: sqlite3.Connection, batch: Plan[Claim], run: RunPlan[Claim], *, savepoint: bool
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

    def _advance(self, conn: sqlite3.Connection, run: RunPlan[Claim], key: object) -> None:
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
