"""A page of runs read from a database's table of runs, alike for every dialect: the
conditions, order and limit after the dialect's listing, and the page its rows make
(docs/stores.md#a-page-of-runs). Only one page of rows, and one more, is read: the
index on ``updated_at`` gives them in order, and a cursor is a place in that index."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from polyloop._paging import PageRequest, cursor
from polyloop.ports import RunPage, StoredRun
from polyloop.types import InvalidRequest


@dataclass(frozen=True, slots=True)
class Dialect:
    """What differs: a named parameter's placeholder, the conditions on ``finished``,
    the column that orders runs of one time, the type of the stored time and how a time
    and a run id are bound."""

    mark: Callable[[str], str]
    finished: tuple[str, str]  # (finished, unfinished)
    tie: str
    stamp: type
    time: Callable[[datetime], object]
    key: Callable[[str], object]


def page_sql(dialect: Dialect, request: PageRequest) -> tuple[str, dict[str, object]]:
    """What follows the dialect's listing (which ends in a ``WHERE`` clause), and its
    parameters, for ``request``."""
    mark, tie = dialect.mark, dialect.tie
    parts: list[str] = []
    params: dict[str, object] = {"limit": request.limit + 1}
    if request.finished is not None:
        parts.append(dialect.finished[0 if request.finished else 1])
    if request.since is not None:
        parts.append(f"r.updated_at >= {mark('since')}")
        params["since"] = dialect.time(request.since)
    if request.until is not None:
        parts.append(f"r.updated_at < {mark('until')}")
        params["until"] = dialect.time(request.until)
    past = ">" if request.backward else "<"
    if (where := request.position) is not None:
        at, run_id = where
        if isinstance(at, int) and dialect.stamp is float:
            at = float(at)  # JSON writes a whole float without its point
        if not isinstance(at, dialect.stamp):
            raise InvalidRequest("the page cursor is not one of this store's")
        # The first condition is a range of the index; the second orders ties by id.
        parts.append(
            f"r.updated_at {past}= {mark('at')} AND (r.updated_at {past} {mark('at')}"
            f" OR {tie} {'<' if request.backward else '>'} {mark('id')})"
        )
        params |= {"at": at, "id": dialect.key(run_id)}
    newest, tied = ("ASC", "DESC") if request.backward else ("DESC", "ASC")
    order = f" ORDER BY r.updated_at {newest}, {tie} {tied} LIMIT {mark('limit')}"
    return "".join(f" AND {part}" for part in parts) + order, params


def run_page(
    rows: Sequence[Sequence[Any]], request: PageRequest, stored: Callable[[Any], StoredRun]
) -> RunPage:
    """The page of the rows ``page_sql`` selected (the listing's: the time third);
    ``stored`` reads a row."""
    more = len(rows) > request.limit
    rows = rows[: request.limit]
    if request.backward:
        rows = rows[::-1]
    runs = tuple(map(stored, rows))
    cursors = [cursor(row[2], run.run_id) for row, run in zip(rows, runs, strict=True)]
    shown = request.position is not None
    return RunPage(
        runs=runs,
        newer=cursors[0] if cursors and (more if request.backward else shown) else None,
        older=cursors[-1] if cursors and (shown if request.backward else more) else None,
    )
