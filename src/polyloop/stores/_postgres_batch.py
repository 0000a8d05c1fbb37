"""The writer connections of the PostgreSQL store, and the shared commit of a batch.

A store object sends every write of a run through one writer connection
(:class:`Writer`), the one that holds or will hold the run's lock (:class:`Claim`);
:class:`Slot` ties a run to that connection while the run is written. The writes that
wait on a connection at the same moment form one batch, an :class:`Item` each, which
:class:`Committer` commits in a worker thread in three steps: plan (refuse what must not
be written, claim the runs new to this store object, give each item its first seq),
send, and settle (advance each run's seq, release the locks of ended runs and of claims
taken in vain). The claims, the connections and the failed runs stay the store's: the
committer calls on the store for them.

A batch of up to 1,000 rows is one ``INSERT`` statement on the autocommit connection:
one statement, one transaction, one round trip. A larger one is sent in one pipeline,
``BEGIN`` … ``COMMIT``. Either way a batch holding a barrier commits with
``synchronous_commit`` on, and any other with it off for its own transaction only. If
the server refuses a row, the whole transaction rolls back and the batch runs again,
each item under its own ``SAVEPOINT``, so that the item at fault fails alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import psycopg
from psycopg import sql
from psycopg.rows import TupleRow

from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import WriterState
from polyloop.stores._postgres_sql import Queries, Row, run_id_column, run_key
from polyloop.types import PolyLoopError, RunAlreadyExists, StoreError

__all__ = (
    "Claim",
    "Committer",
    "Connection",
    "Errors",
    "Item",
    "Mode",
    "Probe",
    "Slot",
    "Writer",
    "check_mode",
    "statements",
)

Connection = psycopg.Connection[TupleRow]
# What a write does to the run: start it, append to it, or end it.
Mode = Literal["start", "append", "end"]
# One outcome per item of a batch: None (committed) or the error its caller sees.
Errors = list[BaseException | None]
# The private test probe: the connection, (run id, kind) of each row, the SQL sent.
Probe = Callable[[Connection, tuple[tuple[str, str], ...], tuple[str, ...]], None]

# Five parameters a row: a statement stays far below the protocol's 65,535 parameters.
_MAX_ROWS_PER_STATEMENT = 1000
_ASYNC_COMMIT = "SET LOCAL synchronous_commit = off"


@dataclass(eq=False)
class Writer:
    """A writer connection of this store object and the runs routed to it.

    ``runs`` holds every run whose lock lives on the connection or whose write is on its
    way to it; ``group`` gathers the waiting writes of those runs into shared commits.
    """

    group: GroupCommit[Item]
    connection: Connection | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    runs: set[str] = field(default_factory=set)
    writing: int = 0  # writes of its runs in flight, counted on the event loop
    broken: bool = False


@dataclass(eq=False)
class Claim:
    """This store object holds ``run_id``'s lock on ``writer``; ``next_seq`` is its next row."""

    run_id: str
    key: int
    writer: Writer
    next_seq: int


@dataclass(eq=False)
class Slot:
    """Per-run bookkeeping: the run's writer connection, its claim, and who writes now.

    ``lock`` orders the run's writes when each write takes its own thread (without group
    commit); with group commit the run's writes are ordered by its writer's batches.
    """

    run_id: str
    writer: Writer
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0
    claim: Claim | None = None


@dataclass(eq=False, slots=True)
class Item:
    """One write waiting for a shared commit: its run's slot, its rows, what it does."""

    slot: Slot
    rows: Sequence[Row]
    mode: Mode
    barrier: bool


@dataclass(eq=False)
class _Plan:
    """What one batch inserts, decided before anything is sent.

    ``accepted`` holds (index in the batch, item, the item's first seq) in submission
    order. Per run of the batch: ``claims`` is the claim it writes under (``fresh`` the
    ones this batch took), ``seqs`` its next seq once the batch commits, and ``ended``
    says its last accepted item ends it.
    """

    accepted: list[tuple[int, Item, int]] = field(default_factory=list)
    claims: dict[str, Claim] = field(default_factory=dict)
    fresh: dict[str, Claim] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)

    @property
    def barrier(self) -> bool:
        return any(item.barrier for _, item, _ in self.accepted)

    def rows(self) -> tuple[tuple[str, str], ...]:
        """(run id, kind) of every row the batch inserts, in order."""
        return tuple((item.slot.run_id, kind) for _, item, _ in self.accepted
                     for kind, _ in item.rows)

    def accept(self, index: int, item: Item, claim: Claim, seq: int) -> None:
        run_id = item.slot.run_id
        self.claims[run_id] = claim
        self.seqs[run_id] = seq + len(item.rows)
        self.accepted.append((index, item, seq))
        if item.mode == "end":
            self.ended.add(run_id)
        else:
            self.ended.discard(run_id)


@dataclass(frozen=True, slots=True)
class Committer:
    """Commits the batches of one store object's writer connections (in a worker thread).

    What a batch needs of its store is handed in: ``state`` (the failed runs and the
    mutex), ``queries``, and the store's steps on a writer connection. ``ready`` checks
    (or creates) the schema, ``claim`` takes a run's lock, ``connection`` opens the
    writer's connection, ``failed`` refuses a run after an error (and gives up a broken
    connection), ``drop`` gives up a lost connection with every run it held, and
    ``unlock`` releases run locks. Each is called with ``writer.lock`` held.
    """

    state: WriterState
    queries: Queries
    ready: Callable[[str], object]
    claim: Callable[[Writer, str], Claim]
    connection: Callable[[Writer, str], Connection]
    failed: Callable[[str, Writer, Exception], StoreError]
    drop: Callable[[Writer, BaseException], None]
    unlock: Callable[[Writer, Sequence[int]], None]

    def commit(self, writer: Writer, items: Sequence[Item], probe: Probe | None) -> Errors:
        """Commit every item that may be written in one transaction; say how each ended."""
        errors: Errors = [None] * len(items)
        with writer.lock:
            plan = self._plan(writer, items, errors)
            if plan.accepted:
                self._commit_plan(writer, plan, errors, probe)
            self._settle(writer, plan, errors)
        return errors

    def _plan(self, writer: Writer, items: Sequence[Item], errors: Errors) -> _Plan:
        """Refuse what must not be written, claim new runs, give each item its seq."""
        plan = _Plan()
        for index, item in enumerate(items):
            run_id = item.slot.run_id
            try:
                self.state.check_writable(run_id)
                self.ready(run_id)
                claim = plan.claims.get(run_id) or item.slot.claim
                if claim is None:
                    claim = plan.fresh[run_id] = plan.claims[run_id] = self.claim(writer, run_id)
                seq = plan.seqs.get(run_id, claim.next_seq)
                check_mode(run_id, seq, item.mode)
            except PolyLoopError as exc:
                errors[index] = exc
                continue
            plan.accept(index, item, claim, seq)
        return plan

    def _commit_plan(self, writer: Writer, plan: _Plan, errors: Errors,
                     probe: Probe | None) -> None:
        """Insert every accepted item and commit; on failure every item learns why."""
        first = plan.accepted[0][1].slot.run_id
        try:
            conn = self.connection(writer, first)
            try:
                _insert_all(self.queries, conn, plan, probe)
            except psycopg.Error:
                if conn.broken or conn.closed:
                    raise
                # Nothing was committed (a server error ends the whole transaction):
                # again, item by item, so that one bad item fails alone.
                _roll_back(conn)
                self._insert_each(conn, writer, plan, errors, probe)
        except (psycopg.Error, StoreError) as exc:
            self._fail_all(writer, plan, errors, exc)
        except Exception as exc:  # noqa: BLE001 - its state is unknown: give the connection up
            self.drop(writer, exc)
            self._fail_all(writer, plan, errors, exc)

    def _insert_each(self, conn: Connection, writer: Writer, plan: _Plan, errors: Errors,
                     probe: Probe | None) -> None:
        """The batch again, each item under a savepoint: a failing item rolls back alone."""
        head = _begin(plan.barrier)
        for text in head:
            conn.execute(text)
        sent: list[sql.Composed | str] = [*head]
        written: list[tuple[str, str]] = []
        for index, item, seq in plan.accepted:
            run_id = item.slot.run_id
            try:  # an earlier item of the run failed: writing this one would leave a gap
                self.state.check_writable(run_id)
            except StoreError as exc:
                errors[index] = exc
                continue
            conn.execute("SAVEPOINT polyloop_item")
            try:
                for query, params in statements(self.queries, [(run_id, seq, item.rows)]):
                    conn.execute(query, params)
                    sent.append(query)
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise
                conn.execute("ROLLBACK TO SAVEPOINT polyloop_item")
                errors[index] = self.failed(run_id, writer, exc)
            else:
                conn.execute("RELEASE SAVEPOINT polyloop_item")
                written += [(run_id, kind) for kind, _ in item.rows]
        _show(probe, conn, tuple(written), sent)
        conn.execute("COMMIT")

    def _fail_all(self, writer: Writer, plan: _Plan, errors: Errors, exc: Exception) -> None:
        """The commit failed or its outcome is unknown: every accepted item fails."""
        conn = writer.connection
        if conn is not None and not (conn.broken or conn.closed):
            try:
                _roll_back(conn)
            except psycopg.Error as lost:
                self.drop(writer, lost)
        for index, item, _ in plan.accepted:
            if errors[index] is None:
                errors[index] = self.failed(item.slot.run_id, writer, exc)

    def _settle(self, writer: Writer, plan: _Plan, errors: Errors) -> None:
        """After the commit: advance each run's seq, keep the new claims that wrote, and
        unlock the runs that ended (only now: their end record is committed) and the
        claims this batch took in vain."""
        committed = {item.slot.run_id: item.slot for index, item, _ in plan.accepted
                     if errors[index] is None}
        keys: list[int] = []
        with self.state.mutex:
            for run_id, claim in plan.claims.items():
                slot = committed.get(run_id)
                if slot is None:
                    if run_id in plan.fresh:
                        keys.append(claim.key)
                    continue
                claim.next_seq = plan.seqs[run_id]
                slot.claim = None if run_id in plan.ended else claim
                if run_id in plan.ended:
                    keys.append(claim.key)
        if keys:
            self.unlock(writer, keys)


def check_mode(run_id: str, next_seq: int, mode: Mode) -> None:
    """Refuse to start a run that has rows, or to write to one that has none."""
    if mode == "start" and next_seq > 0:
        raise RunAlreadyExists("the run already has records", run_id=run_id)
    if mode != "start" and next_seq == 0:
        raise StoreError("the run was never started in this database", run_id=run_id)


def statements(
    queries: Queries, writes: Sequence[tuple[str, int, Sequence[Row]]], *, lazy: bool = False
) -> list[tuple[sql.Composed, list[object]]]:
    """``INSERT`` statements for (run id, first seq, rows) writes, in order."""
    params: list[object] = []
    for run_id, seq, rows in writes:
        key, column = run_key(run_id), run_id_column(run_id)
        for offset, (kind, body) in enumerate(rows):
            params += [key, seq + offset, column, kind, body]
    width, count = 5, len(params) // 5
    return [
        (queries.insert_rows(min(_MAX_ROWS_PER_STATEMENT, count - start), lazy=lazy),
         params[start * width:(start + _MAX_ROWS_PER_STATEMENT) * width])
        for start in range(0, count, _MAX_ROWS_PER_STATEMENT)
    ]


def _insert_all(queries: Queries, conn: Connection, plan: _Plan, probe: Probe | None) -> None:
    """The batch in one round trip: one transaction, committed synchronously if it
    holds a barrier, else with ``synchronous_commit`` off for this transaction only."""
    writes = [(item.slot.run_id, seq, item.rows) for _, item, seq in plan.accepted]
    if sum(len(item.rows) for _, item, _ in plan.accepted) <= _MAX_ROWS_PER_STATEMENT:
        # One statement on an autocommit connection is one transaction; the writer
        # session's synchronous_commit is on (the store makes sure when it connects),
        # and only a batch without a barrier turns it off, for that transaction alone.
        [(query, params)] = statements(queries, writes, lazy=not plan.barrier)
        _show(probe, conn, plan.rows(), [query])
        conn.execute(query, params)
        return
    sent = statements(queries, writes)
    head = _begin(plan.barrier)
    with conn.pipeline():
        for text in head:
            conn.execute(text)
        for query, params in sent:
            conn.execute(query, params)
        _show(probe, conn, plan.rows(), [*head, *(query for query, _ in sent)])
        conn.execute("COMMIT")


def _show(probe: Probe | None, conn: Connection, rows: tuple[tuple[str, str], ...],
          sent: Sequence[sql.Composed | str]) -> None:
    """Show the private test probe what is about to commit, and the SQL sent for it."""
    if probe is not None:
        texts = [text if isinstance(text, str) else text.as_string(conn) for text in sent]
        probe(conn, rows, tuple(texts))


def _begin(barrier: bool) -> list[str]:
    """What opens a batch's transaction: a barrier's commits synchronously."""
    return ["BEGIN"] if barrier else ["BEGIN", _ASYNC_COMMIT]


def _roll_back(conn: Connection) -> None:
    """End the connection's open transaction, if any, without committing it."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")
