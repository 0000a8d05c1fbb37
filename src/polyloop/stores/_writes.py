"""The rules every store's writes keep: a call's rows (:class:`Write`), a claim, the runs
not to write again (:class:`WriterState`), and why a call is refused
(docs/stores.md#claims-one-writer-per-run)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from polyloop._shared import exception_text, record_kind
from polyloop.serialization import dumps
from polyloop.types import (
    CancelRequest,
    CancelRequested,
    Intent,
    Proposal,
    Record,
    RunAlreadyExists,
    RunLocked,
    RunNotFound,
    Settlement,
    StoreError,
    Verdict,
)


def store_closed(run_id: str | None = None) -> StoreError:
    return StoreError("the store is closed", run_id=run_id)


def not_claimed(run_id: str) -> RunLocked:
    return RunLocked("this store object does not hold the run's claim", run_id=run_id)


def claimed_already(run_id: str) -> RunLocked:
    return RunLocked("this store object already holds the run's claim", run_id=run_id)


def check_order(run_id: str, *, start: bool, started: bool, finished: bool) -> None:
    """The rule every store keeps: a run starts once, nothing before its start or final end."""
    if start and started:
        raise RunAlreadyExists("the run already has records", run_id=run_id)
    if not start and not started:
        raise StoreError("the run was never started in this store", run_id=run_id)
    if not start and finished:
        raise StoreError("the run has ended; nothing may follow its end record", run_id=run_id)


def announces_effect(records: tuple[Record, ...]) -> bool:
    """Whether a write holds what comes before an effect (an intent) or a person's ask
    (a proposal): what a cancel request fences."""
    return any(isinstance(record, Intent | Proposal) for record in records)


def lets_a_run_go_on(write: Write, last: Record) -> bool:
    """Whether ``write`` (whose last record is ``last``) may let a host go on with its
    run: a start, a person's verdict or settlement, or an end that leaves the run open.
    Intents, results and steps never do: their run's writer goes on by itself."""
    if write.start or isinstance(last, Verdict | Settlement):
        return True
    return write.end and not write.final


def cancel_refusal(request: CancelRequest) -> CancelRequested:
    return CancelRequested(run_id=request.run_id, by=request.by, why=request.reason)


def no_run(run_id: str) -> RunNotFound:
    return RunNotFound("the store holds no record of this run", run_id=run_id)


def taken(request: CancelRequest) -> CancelRequest:
    """``request`` as a store keeps it: ``at`` in UTC, the time it is taken unless given."""
    at = request.at or datetime.now(UTC)
    return replace(request, at=at.replace(tzinfo=at.tzinfo or UTC).astimezone(UTC))


def kept_cancel(run_id: str, by: str, reason: str, at: datetime | str) -> CancelRequest:
    """A cancel request as a store kept it; ``at`` may be ISO text."""
    when = at if isinstance(at, datetime) else datetime.fromisoformat(at)
    return CancelRequest(run_id=run_id, by=by, reason=reason, at=when.astimezone(UTC))


def record_rows(records: tuple[Record, ...]) -> list[tuple[str, str]]:
    """The kind and body of each record of one write, each written after the one before
    it: a step after its action's result names the result's observation (record 0063)."""
    afters = (None, *records[:-1])
    return [(record_kind(r), dumps(r, after=a)) for r, a in zip(records, afters, strict=True)]


@dataclass(eq=False, slots=True)
class Write:
    """The rows of one store call and what it means for its run."""

    run_id: str
    rows: list[tuple[str, str]]  # (kind, body) of each record, in order
    start: bool = False  # the run must have no record yet
    end: bool = False  # an end record: the claim is given up with it
    final: bool = False  # a final end record: nothing may follow it
    reason: str | None = None  # the stop reason of an end record
    barrier: bool = False  # must be fsync'd before the call returns
    fenced: bool = False  # an intent or a proposal: refused once a cancel is requested
    announce: bool = False  # may let a run go on: a store that can tells its listeners


@dataclass(eq=False, slots=True)
class Claim:
    """This store object is ``run_id``'s writer (``offset``: a host store's locked byte;
    ``generation``: a shared database's lease generation; a file's ``next_seq``: 0 or 1)."""

    run_id: str
    epoch: int = 0
    next_seq: int = 0
    finished: bool = False  # the log ends with a final end record
    offset: int = -1
    generation: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # around each write of the run


@dataclass
class WriterState:
    """Whether one store object is closed, and the runs it must not write again: a retried
    ``fsync`` can report success for data the kernel dropped."""

    failed: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    mutex: threading.Lock = field(default_factory=threading.Lock)

    def check_open(self, run_id: str | None) -> None:
        if self.closed:
            raise store_closed(run_id)

    def check_writable(self, run_id: str) -> None:
        self.check_open(run_id)
        if (reason := self.failed.get(run_id)) is not None:
            raise StoreError(
                f"an earlier write of this run failed ({reason}); close and reopen the "
                f"store before writing to it again",
                run_id=run_id,
            )

    def fail(self, run_id: str, exc: BaseException) -> StoreError:
        """Remember that ``run_id`` failed and build the error to raise."""
        self.failed[run_id] = exception_text(exc)
        error = StoreError(f"write failed: {type(exc).__name__}: {exc}", run_id=run_id)
        error.__cause__ = exc
        return error
