"""The writer connections of the PostgreSQL store, and the shared commit of a batch.

A store object sends every write of a run through one writer connection
(:class:`Writer`), the one that holds the run's claim (:class:`Claim`); :class:`Slot`
ties a run to that connection while the run is claimed or written. The writes that wait
on a connection at the same moment form one batch, an :class:`Item` each, which
:class:`Committer` commits in a worker thread in three steps: plan (refuse what must not
be written, give each item its first seq), send, and settle (advance each claim, give up
the claims of ended runs).

A batch is one statement on the autocommit connection, whatever its size: the rows and
the runs travel as arrays, and the statement moves each run's row of the ``runs`` table
on (its fence: the claim's epoch, the seq it expects, not finished; an end record also
gives the owner up) and inserts the rows of exactly the runs whose row moved, in one
transaction. A run whose row did not
move (another writer claimed it since, or it ended) has written nothing, and its items
are refused. A batch holding a barrier commits with ``synchronous_commit`` on, any other
with it off for its own transaction only. If the server refuses the statement, each run
of the batch is sent again on its own, so that the run at fault fails alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg

from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import Write, WriterState
from polyloop.stores._lease import Lease
from polyloop.stores._refusals import fence_refusal, not_claimed, store_closed
from polyloop.stores._sql.planning import Errors, Plan, RunPlan, plan
from polyloop.stores._sql.postgres.connect import Connection
from polyloop.stores._sql.postgres.sql import Queries, run_id_column, run_key
from polyloop.types import PolyLoopError, StoreError

__all__ = (
    "Claim",
    "Committer",
    "Item",
    "Probe",
    "Slot",
    "Writer",
    "fail_run",
)

# The private test probe: the connection, (run id, kind) of each row, the SQL sent.
Probe = Callable[[Connection, tuple[tuple[str, str], ...], tuple[str, ...]], None]


@dataclass(eq=False)
class Writer:
    """A writer connection of this store object and the runs routed to it.

    ``runs`` holds every run whose claim or write is routed to the connection; ``group``
    gathers the waiting writes of those runs into shared commits; ``connect`` opens a
    connection. Every method but the constructor is called with ``lock`` held.
    """

    connect: Callable[[], Connection]
    group: GroupCommit[Item] = field(init=False)
    connection: Connection | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    runs: set[str] = field(default_factory=set)
    closed: bool = False

    def connected(self, run_id: str) -> Connection:
        """The connection, opened on first use and after a loss. A new connection writes
        nothing unfenced: every write checks its run's claim epoch, which lives in the
        run's row, not on a connection."""
        if self.closed:
            raise store_closed(run_id)
        if self.connection is None:
            self.connection = self.connect()
        return self.connection

    def drop(self) -> None:
        """The connection is lost: close it; the next write opens another."""
        conn, self.connection = self.connection, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        self.closed = True
        self.runs.clear()
        self.drop()


def fail_run(state: WriterState, writer: Writer, run_id: str, exc: Exception) -> StoreError:
    """Refuse ``run_id`` from now on, and give up the writer's connection if it is lost.

    Only the runs whose writes met the lost connection fail (their outcome is unknown);
    the other runs routed to the writer keep their claims.
    """
    conn = writer.connection
    with state.mutex:
        error = state.fail(run_id, exc)
    if conn is None or conn.broken or conn.closed:
        writer.drop()
    return error


@dataclass(eq=False)
class Claim:
    """This store object holds ``run_id``'s claim; its writes go through ``writer``.

    ``epoch`` is the claim epoch this claim gave the run's row, ``generation`` the lease
    generation it was taken under, ``next_seq`` the run's next row and ``finished``
    whether its log ends with a final end record.
    """

    run_id: str
    writer: Writer
    epoch: int
    generation: int
    next_seq: int
    finished: bool


@dataclass(eq=False)
class Slot:
    """Per-run bookkeeping: the run's writer connection, its claim, and who uses it."""

    run_id: str
    writer: Writer
    users: int = 0
    claim: Claim | None = None


@dataclass(eq=False, slots=True)
class Item:
    """One write waiting for a shared commit, and its run's slot."""

    slot: Slot
    write: Write


class Committer:
    """Commits the batches of one store object's writer connections (in a worker thread).

    It knows the store's failed runs (``state``), its statements (``queries``) and its
    lease (whose lapse ends the claims taken under it); each batch names its writer.
    ``probe`` is a private test hook: called just before each commit with the
    connection, the (run id, kind) of every row and the SQL text sent.
    """

    __slots__ = ("lease", "probe", "queries", "state")

    def __init__(
        self, state: WriterState, queries: Queries, lease: Lease, probe: Probe | None = None
    ) -> None:
        self.state = state
        self.queries = queries
        self.lease = lease
        self.probe = probe

    def commit(self, writer: Writer, items: Sequence[Item]) -> Errors:
        """Commit every item that may be written in one transaction; say how each ended."""
        with writer.lock:
            batch = plan([item.write for item in items], lambda index: self._admit(items[index]))
            if batch.runs:
                self._commit_plan(writer, batch, self.probe)
            ended = batch.settle()
            if ended:
                # Their rows gave the owner up in the same statement as the end record.
                slots = {item.write.run_id: item.slot for item in items}
                with self.state.mutex:
                    for run_id in ended:
                        slots[run_id].claim = None
        return batch.errors

    def _admit(self, item: Item) -> Claim:
        """The claim the item is written under, unless the run failed, is not claimed
        here, or its lease lapsed."""
        run_id = item.write.run_id
        self.state.check_writable(run_id)
        claim = item.slot.claim
        if claim is None:
            raise not_claimed(run_id)
        self.lease.check(claim.generation, run_id)
        return claim

    def _commit_plan(self, writer: Writer, batch: Plan[Claim], probe: Probe | None) -> None:
        """Send the batch; on a refused statement, each run again on its own."""
        runs = list(batch.runs.values())
        try:
            conn = writer.connected(runs[0].run_id)
            try:
                self._send(conn, runs, batch.barrier, batch, probe)
            except psycopg.Error:
                if conn.broken or conn.closed or len(runs) == 1:
                    raise
                for run in runs:  # nothing was committed: one statement, one transaction
                    self._send_alone(conn, writer, run, batch, probe)
        except (psycopg.Error, StoreError) as exc:
            self._fail(writer, runs, batch, exc)
        except Exception as exc:  # noqa: BLE001 - its state is unknown: give the connection up
            writer.drop()
            self._fail(writer, runs, batch, exc)

    def _send_alone(
        self,
        conn: Connection,
        writer: Writer,
        run: RunPlan[Claim],
        batch: Plan[Claim],
        probe: Probe | None,
    ) -> None:
        try:
            self._send(conn, [run], run.barrier, batch, probe)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise
            self._fail(writer, [run], batch, exc)

    def _send(
        self,
        conn: Connection,
        runs: Sequence[RunPlan[Claim]],
        barrier: bool,
        batch: Plan[Claim],
        probe: Probe | None,
    ) -> None:
        """One statement: fence, advance and insert ``runs``; refuse those not admitted."""
        query = self.queries.write if barrier else self.queries.lazy_write
        if probe is not None:
            rows = tuple((run.run_id, kind) for run in runs for _, kind, _ in run.rows())
            probe(conn, rows, (query.as_string(conn),))
        admitted = {bytes(key) for (key,) in conn.execute(query, _parameters(runs)).fetchall()}
        for run in runs:
            if run_key(run.run_id) not in admitted:
                batch.refuse(run, self._refusal(conn, run))

    def _refusal(self, conn: Connection, run: RunPlan[Claim]) -> PolyLoopError:
        """Why the fence refused ``run``'s rows (nothing of them was written)."""
        row = conn.execute(self.queries.explain_refusal, (run_key(run.run_id),)).fetchone()
        return fence_refusal(run.run_id, epoch=run.claim.epoch, row=row, start=run.start)

    def _fail(
        self, writer: Writer, runs: Sequence[RunPlan[Claim]], batch: Plan[Claim], exc: Exception
    ) -> None:
        """The statement failed or its outcome is unknown: every write of ``runs`` fails."""
        conn = writer.connection
        if conn is not None and not (conn.broken or conn.closed):
            try:
                _roll_back(conn)
            except psycopg.Error:
                writer.drop()
        for run in runs:
            batch.refuse(run, fail_run(self.state, writer, run.run_id, exc))


def _parameters(runs: Sequence[RunPlan[Claim]]) -> dict[str, list[object]]:
    """The arrays of the write statement: one entry per run, then one per row."""
    columns = ("run_keys", "epochs", "first_seqs", "next_seqs", "finals", "ends", "reasons")
    rows = ("row_keys", "seqs", "row_ids", "kinds", "bodies")
    params: dict[str, list[object]] = {name: [] for name in (*columns, *rows)}
    for run in runs:
        key, column = run_key(run.run_id), run_id_column(run.run_id)
        each: tuple[object, ...] = (key, run.claim.epoch, run.first_seq, run.next_seq)
        for name, value in zip(columns, (*each, run.final, run.ends, run.reason), strict=True):
            params[name].append(value)
        for seq, kind, body in run.rows():
            for name, cell in zip(rows, (key, seq, column, kind, body), strict=True):
                params[name].append(cell)
    return params


def _roll_back(conn: Connection) -> None:
    """End the connection's open transaction, if any, without committing it."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")
