"""What a store object knows of its writes: the rows of one call (:class:`Write`), a
claim it holds (:class:`Claim`), and the runs it must not write again (:class:`WriterState`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from polyloop._shared import exception_text, record_kind
from polyloop.serialization import dumps
from polyloop.stores._refusals import store_closed
from polyloop.types import Record, StoreError


def record_row(record: Record) -> tuple[str, str]:
    return record_kind(record), dumps(record)  # dumps refuses anything not a record


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
