"""A PostgreSQL store object's writers, and a batch's commit as one statement, so that a
batch costs one round trip (docs/stores.md#postgresstore)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from polyloop.stores._batching import GroupCommit
from polyloop.stores._lease import Lease
from polyloop.stores._sql.planning import Errors, Plan, RunPlan, plan
from polyloop.stores._sql.postgres.connection import Link
from polyloop.stores._sql.postgres.sql import Connection, Queries, run_key
from polyloop.stores._writes import Claim, Write, WriterState, not_claimed
from polyloop.types import StoreError


@dataclass(eq=False)
class Writer(Link):
    """A writer connection and the claims of the runs that write through it. ``claims``
    and ``claiming`` change with the store's mutex held, the rest with ``lock`` held."""

    group: GroupCommit[Write] = field(init=False)
    claims: dict[str, Claim] = field(default_factory=dict)
    claiming: int = 0  # claims being taken through it count as load
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, state: WriterState, run_id: str, exc: Exception) -> StoreError:
        """Refuse ``run_id`` from now on (not the writer's other runs); drop a lost connection."""
        with state.mutex:
            error = state.fail(run_id, exc)
        if self.connection is None or self.connection.broken or self.connection.closed:
            self.drop()
        return error


@dataclass(eq=False, slots=True)
class Committer:
    """Commits the batches of one store object's writers, in a worker thread."""

    state: WriterState
    queries: Queries
    lease: Lease

    def commit(self, writer: Writer, writes: Sequence[Write]) -> Errors:
        """Commit every write that may be made in one transaction; say how each ended."""
        with writer.lock:
            batch = plan(writes, lambda index: self._admit(writer, writes[index].run_id))
            if batch.runs:
                self._send_plan(writer, batch)
            ended = batch.settle()  # their end record gave the owner up in the statement
            with self.state.mutex:
                for run_id in ended:
                    writer.claims.pop(run_id, None)
        return batch.errors

    def _admit(self, writer: Writer, run_id: str) -> Claim:
        self.state.check_writable(run_id)
        claim = writer.claims.get(run_id)
        if claim is None:
            raise not_claimed(run_id)
        self.lease.check(claim.generation, run_id)
        return claim

    def _send_plan(self, writer: Writer, batch: Plan) -> None:
        """Send the batch in one statement; if refused, each run alone (only one is at fault)."""
        runs = list(batch.runs.values())
        try:
            conn = writer.connected(runs[0].run_id)
            try:
                self._send(conn, runs, batch.barrier, batch)
            except psycopg.Error as lost:
                if conn.broken or conn.closed:
                    self._after_loss(writer, runs, batch, lost)
                    return
                if len(runs) == 1:
                    raise
                for run in runs:  # nothing was committed: one statement, one transaction
                    try:
                        self._send(conn, [run], run.barrier, batch)
                    except psycopg.Error as exc:
                        if conn.broken or conn.closed:
                            raise
                        self._fail(writer, [run], batch, exc)
        except Exception as exc:  # noqa: BLE001 - every write of the batch fails
            if not isinstance(exc, (psycopg.Error, StoreError)):
                writer.drop()  # its state is unknown: give the connection up
            self._fail(writer, runs, batch, exc)

    def _send(self, conn: Connection, runs: Sequence[RunPlan], barrier: bool, batch: Plan) -> None:
        """One statement: fence, advance and insert ``runs``; refuse those not admitted."""
        query = self.queries.write if barrier else self.queries.lazy_write
        admitted = {bytes(key) for key, *_ in conn.execute(query, _parameters(runs)).fetchall()}
        for run, row in self._rows(conn, [r for r in runs if run_key(r.run_id) not in admitted]):
            batch.refuse(run, run.fenced_out(row))

    def _after_loss(
        self, writer: Writer, runs: Sequence[RunPlan], batch: Plan, lost: psycopg.Error
    ) -> None:
        """The connection was lost, the outcome unknown: on a new one, each run's row says
        whether the statement wrote it; one it did not is sent again, once (record 0035)."""
        writer.drop()
        try:
            conn = writer.connected(runs[0].run_id)
            rows = self._rows(conn, runs)
        except psycopg.Error:
            self._fail(writer, runs, batch, lost)  # the loss says why, not the retry
            return
        again = []
        for run, row in rows:
            seq = row[2] if row is not None and row[0] == run.claim.epoch else None
            if seq == run.first_seq:
                again.append(run)
            elif seq != run.next_seq:  # at next_seq, the lost statement wrote it
                batch.refuse(run, run.fenced_out(row))
        if again:
            try:
                self._send(conn, again, any(run.barrier for run in again), batch)
            except psycopg.Error as exc:
                self._fail(writer, again, batch, exc)

    def _rows(
        self, conn: Connection, runs: Sequence[RunPlan]
    ) -> list[tuple[RunPlan, Sequence[Any] | None]]:
        """Each run with its row now (claim epoch, finished, next seq, cancel request), or
        None if gone."""
        if not runs:
            return []
        found = conn.execute(self.queries.rows_now, ([run_key(run.run_id) for run in runs],))
        rows = {bytes(key): row for key, *row in found}
        return [(run, rows.get(run_key(run.run_id))) for run in runs]

    def _fail(self, writer: Writer, runs: Sequence[RunPlan], batch: Plan, exc: Exception) -> None:
        """The statement failed or its outcome is unknown: every write of ``runs`` fails."""
        conn = writer.connection
        if conn is not None and not (conn.broken or conn.closed):
            try:
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    conn.execute("ROLLBACK")
            except psycopg.Error:
                writer.drop()
        for run in runs:
            batch.refuse(run, writer.fail(self.state, run.run_id, exc))


def _parameters(runs: Sequence[RunPlan]) -> dict[str, object]:
    """The parameters of the write statement: an array entry per run, and the rows' kinds
    and bodies each joined in one text, one a line, numbered from 1 in batch order."""
    columns: tuple[str, ...] = ("run_keys", "epochs", "first_seqs", "next_seqs", "finals")
    columns += ("ends", "reasons", "fenceds", "announces", "first_rows")
    params: dict[str, list[object]] = {name: [] for name in columns}
    first_row = 1
    for run in runs:
        each = (run.first_seq, run.next_seq, run.final, run.ends, run.reason, run.fenced)
        values = (run_key(run.run_id), run.claim.epoch, *each, run.announce, first_row)
        for name, value in zip(columns, values, strict=True):
            params[name].append(value)
        first_row += run.next_seq - run.first_seq
    rows = [row for run in runs for _, write in run.writes for row in write.rows]
    kinds, bodies = zip(*rows, strict=True) if rows else ((), ())
    return {**params, "kinds": _lines(kinds), "bodies": _lines(bodies)}


def _lines(texts: Sequence[str]) -> str:
    """``texts`` one a line; a text holding a newline would shift every row after it."""
    joined = "\n".join(texts)
    if texts and joined.count("\n") != len(texts) - 1:
        raise StoreError("a record's row holds a newline, which canonical JSON never does")
    return joined
