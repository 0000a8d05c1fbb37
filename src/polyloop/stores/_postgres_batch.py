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
from polyloop.stores._postgres_connect import Connection
from polyloop.stores._postgres_sql import Queries, run_id_column, run_key
from polyloop.stores._refusals import check_order, fence_refusal, not_claimed, store_closed
from polyloop.types import PolyLoopError, RunLocked, StoreError

__all__ = (
    "Claim",
    "Committer",
    "Errors",
    "Item",
    "Probe",
    "Slot",
    "Writer",
    "fail_run",
)

# One outcome per item of a batch: None (committed) or the error its caller sees.
Errors = list[BaseException | None]
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


@dataclass(eq=False)
class _RunWrite:
    """What a batch writes for one run: its claim, its items, and where its rows go."""

    claim: Claim
    first_seq: int
    items: list[tuple[int, Item]] = field(default_factory=list)

    @property
    def next_seq(self) -> int:
        return self.first_seq + sum(len(item.write.rows) for _, item in self.items)

    @property
    def start(self) -> bool:
        return self.items[0][1].write.start

    @property
    def ends(self) -> bool:
        return self.items[-1][1].write.end

    @property
    def final(self) -> bool:
        return self.items[-1][1].write.final

    @property
    def reason(self) -> str | None:
        return self.items[-1][1].write.reason


@dataclass(eq=False)
class _Plan:
    """What one batch writes, decided before anything is sent: each run's items."""

    runs: dict[str, _RunWrite] = field(default_factory=dict)

    @property
    def barrier(self) -> bool:
        return any(item.write.barrier for run in self.runs.values() for _, item in run.items)

    def accept(self, index: int, item: Item, claim: Claim) -> None:
        run_id = item.slot.run_id
        run = self.runs.get(run_id)
        if run is None:
            check_order(
                run_id,
                start=item.write.start,
                started=claim.next_seq > 0,
                finished=claim.finished,
            )
            run = self.runs[run_id] = _RunWrite(claim, claim.next_seq)
        else:
            check_order(
                run_id, start=item.write.start, started=True, finished=run.ends and run.final
            )
            if run.ends:  # an earlier item of this batch ends the run, and its claim
                raise RunLocked("the run's claim ends with its end record", run_id=run_id)
        run.items.append((index, item))


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
        errors: Errors = [None] * len(items)
        with writer.lock:
            plan = self._plan(items, errors)
            if plan.runs:
                self._commit_plan(writer, plan, errors, self.probe)
            self._settle(plan, errors)
        return errors

    def _plan(self, items: Sequence[Item], errors: Errors) -> _Plan:
        """Refuse what must not be written; group the rest by run, in submission order."""
        plan = _Plan()
        for index, item in enumerate(items):
            run_id = item.slot.run_id
            try:
                self.state.check_writable(run_id)
                claim = item.slot.claim
                if claim is None:
                    raise not_claimed(run_id)
                self.lease.check(claim.generation, run_id)
                plan.accept(index, item, claim)
            except PolyLoopError as exc:
                errors[index] = exc
        return plan

    def _commit_plan(
        self, writer: Writer, plan: _Plan, errors: Errors, probe: Probe | None
    ) -> None:
        """Send the batch; on a refused statement, each run again on its own."""
        runs = list(plan.runs.values())
        try:
            conn = writer.connected(runs[0].claim.run_id)
            try:
                self._send(conn, runs, plan.barrier, errors, probe)
            except psycopg.Error:
                if conn.broken or conn.closed or len(runs) == 1:
                    raise
                for run in runs:  # nothing was committed: one statement, one transaction
                    self._send_alone(conn, writer, run, errors, probe)
        except (psycopg.Error, StoreError) as exc:
            self._fail(writer, runs, errors, exc)
        except Exception as exc:  # noqa: BLE001 - its state is unknown: give the connection up
            writer.drop()
            self._fail(writer, runs, errors, exc)

    def _send_alone(
        self, conn: Connection, writer: Writer, run: _RunWrite, errors: Errors, probe: Probe | None
    ) -> None:
        barrier = any(item.write.barrier for _, item in run.items)
        try:
            self._send(conn, [run], barrier, errors, probe)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise
            self._fail(writer, [run], errors, exc)

    def _send(
        self,
        conn: Connection,
        runs: Sequence[_RunWrite],
        barrier: bool,
        errors: Errors,
        probe: Probe | None,
    ) -> None:
        """One statement: fence, advance and insert ``runs``; refuse those not admitted."""
        query = self.queries.write if barrier else self.queries.lazy_write
        if probe is not None:
            rows = tuple(
                (run.claim.run_id, kind)
                for run in runs
                for _, item in run.items
                for kind, _ in item.write.rows
            )
            probe(conn, rows, (query.as_string(conn),))
        admitted = {bytes(key) for (key,) in conn.execute(query, _parameters(runs)).fetchall()}
        for run in runs:
            if run_key(run.claim.run_id) not in admitted:
                refusal = self._refusal(conn, run)
                for index, _ in run.items:
                    errors[index] = refusal
            else:
                run.claim.next_seq = run.next_seq
                run.claim.finished = run.final

    def _refusal(self, conn: Connection, run: _RunWrite) -> PolyLoopError:
        """Why the fence refused ``run``'s rows (nothing of them was written)."""
        run_id = run.claim.run_id
        row = conn.execute(self.queries.explain_refusal, (run_key(run_id),)).fetchone()
        return fence_refusal(run_id, epoch=run.claim.epoch, row=row, start=run.start)

    def _fail(
        self, writer: Writer, runs: Sequence[_RunWrite], errors: Errors, exc: Exception
    ) -> None:
        """The statement failed or its outcome is unknown: every item of ``runs`` fails."""
        conn = writer.connection
        if conn is not None and not (conn.broken or conn.closed):
            try:
                _roll_back(conn)
            except psycopg.Error:
                writer.drop()
        for run in runs:
            for index, _ in run.items:
                if errors[index] is None:
                    errors[index] = fail_run(self.state, writer, run.claim.run_id, exc)

    def _settle(self, plan: _Plan, errors: Errors) -> None:
        """After the commit: the runs that ended no longer hold their claims (their rows
        gave the owner up in the same statement as the end record)."""
        with self.state.mutex:
            for run in plan.runs.values():
                if run.ends and all(errors[index] is None for index, _ in run.items):
                    run.items[-1][1].slot.claim = None


def _parameters(runs: Sequence[_RunWrite]) -> dict[str, list[object]]:
    """The arrays of the write statement: one entry per run, then one per row."""
    params: dict[str, list[object]] = {
        name: []
        for name in (
            "run_keys",
            "epochs",
            "first_seqs",
            "next_seqs",
            "finals",
            "ends",
            "reasons",
            "row_keys",
            "seqs",
            "row_ids",
            "kinds",
            "bodies",
        )
    }
    for run in runs:
        run_id = run.claim.run_id
        key, column = run_key(run_id), run_id_column(run_id)
        for name, value in (
            ("run_keys", key),
            ("epochs", run.claim.epoch),
            ("first_seqs", run.first_seq),
            ("next_seqs", run.next_seq),
            ("finals", run.final),
            ("ends", run.ends),
            ("reasons", run.reason if run.ends else None),
        ):
            params[name].append(value)
        seq = run.first_seq
        for _, item in run.items:
            for kind, body in item.write.rows:
                for name, value in (
                    ("row_keys", key),
                    ("seqs", seq),
                    ("row_ids", column),
                    ("kinds", kind),
                    ("bodies", body),
                ):
                    params[name].append(value)
                seq += 1
    return params


def _roll_back(conn: Connection) -> None:
    """End the connection's open transaction, if any, without committing it."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")
