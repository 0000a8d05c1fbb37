"""A run's records read back from a database's rows, alike for every dialect, or a
``CorruptLog`` naming the row (docs/recovery.md#damaged-logs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from polyloop._shared import RECORD_KINDS, record_kind
from polyloop.serialization import loads
from polyloop.stores._writes import no_run
from polyloop.types import CorruptLog, Record

RESULT_KIND = RECORD_KINDS["Result"]


def shown(run_id: object) -> str:
    """``run_id`` quoted and cut short, for messages and record locations."""
    text = repr(run_id)
    return text if len(text) <= 60 else text[:57] + "..."


def read_rows(
    rows: Iterable[Sequence[Any]],
    run_id: str,
    *,
    where: Callable[[object], str],
    column: object = None,
    first: int = 0,
    before: Record | None = None,
) -> tuple[Record, ...]:
    """The records of rows (seq, kind, body[, run id column, which must be ``column``]),
    without a gap from ``first``; ``where(seq)`` is the location of a row. Each is read
    after the one before it (the first after ``before``), whose observation a step may name."""
    records: list[Record] = []
    for index, (seq, kind, body, *keyed) in enumerate(rows, start=first):
        location = where(seq)
        if seq != index:
            reason = f"seq {index} is missing: the run's rows have a gap"
            raise CorruptLog(reason, run_id=run_id, location=location)
        if keyed and keyed[0] != column:
            reason = f"the row's run_id column says {shown(keyed[0])}"
            raise CorruptLog(reason, run_id=run_id, location=location)
        after = records[-1] if records else before
        records.append(decode_row(body, run_id=run_id, kind=kind, location=location, after=after))
    return tuple(records)


def read_rows_after(
    select: Callable[[int], Sequence[Sequence[Any]]],
    exists: Callable[[], bool],
    run_id: str,
    after: int,
    *,
    where: Callable[[object], str],
    column: object = None,
) -> tuple[Record, ...]:
    """The run's records at positions ``after + 1`` on (seq ``after`` on), from the rows
    ``select(seq)`` gives from that seq on; ``RunNotFound`` where there are none and not
    ``exists()``. The row before them is read too, for the observation a step may name."""
    start = max(after - 1, 0)
    rows = select(start)
    if not rows and not exists():
        raise no_run(run_id)
    before = None
    if after and rows and rows[0][0] == start:
        seq, kind, body, *_ = rows[0]
        rows = rows[1:]
        if kind == RESULT_KIND:  # only a result is ever named by the step after it
            before = decode_row(body, run_id=run_id, kind=kind, location=where(seq))
    return read_rows(rows, run_id, where=where, column=column, first=after, before=before)


def decode_row(
    body: object, *, run_id: str, kind: object, location: str, after: Record | None = None
) -> Record:
    """The record a database row holds, of ``run_id`` and ``kind``, or ``CorruptLog``;
    ``after`` is the run's record before it."""
    if not isinstance(body, (str, bytes)):
        reason = f"the body is {type(body).__name__}, not text"
    else:
        try:
            record = loads(body, location=location, after=after)
        except CorruptLog as exc:
            if exc.run_id is not None:
                raise
            raise CorruptLog(exc.reason, run_id=run_id, location=location) from exc
        if record.run_id != run_id:
            reason = f"the row holds a record of run {shown(record.run_id)}"
        elif record_kind(record) != kind:
            reason = f"the row says {kind!r} but holds a {record_kind(record)!r} record"
        else:
            return record
    raise CorruptLog(reason, run_id=run_id, location=location)
