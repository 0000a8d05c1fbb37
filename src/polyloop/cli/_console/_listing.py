"""Which runs the console's list shows, in which order, a page at a time: pure logic.

The list is built from the store's run table (``list_runs``), which says whether each
run finished without reading its log. A filter on finished or unfinished runs needs
nothing more, so only the runs on the page are read. A finer filter (awaiting approval,
in doubt, running, resumable) needs each unfinished run's status; finished runs, the
vast majority of a long-lived store, are never read for it. Summaries are kept in a
small cache keyed by what the run table says of a run, so an unchanged run is not read
again.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from polyloop.ports import StoredRun

PER_PAGE = 50
CACHE_SIZE = 4096


class StateFilter(enum.StrEnum):
    """The states the list can be narrowed to (the ``state`` query parameter)."""

    ALL = "all"
    UNFINISHED = "unfinished"
    FINISHED = "finished"
    AWAITING_APPROVAL = "awaiting approval"
    IN_DOUBT = "in doubt"
    RUNNING = "running"
    RESUMABLE = "resumable"

    @property
    def needs_status(self) -> bool:
        """Whether telling a run in from one out takes its status, not just the run table."""
        return self not in (StateFilter.ALL, StateFilter.UNFINISHED, StateFilter.FINISHED)

    @classmethod
    def parse(cls, text: str | None) -> StateFilter:
        """The filter a query names, with ``_`` for a space as the run states are
        spelled in JSON (``in_doubt``); every run for a missing or unknown one."""
        try:
            return cls((text or "all").replace("_", " "))
        except ValueError:
            return cls.ALL


@dataclass(frozen=True, slots=True)
class RunRow:
    """One line of the list: what the run's status and log say, read once."""

    run_id: str
    state: str  # a word of polyloop runs: "awaiting approval", "finished", "corrupt", ...
    stop_reason: str | None
    steps: int | None
    tokens: str | None
    last_record_at: datetime | None
    owner: str | None
    detail: str | None = None
    # What the state's word leaves out, as polyloop runs prints it in brackets.
    state_detail: str | None = None


@dataclass(frozen=True, slots=True)
class Page:
    """The runs of one page, and where it sits among the pages."""

    runs: tuple[StoredRun, ...]
    number: int  # from 1
    pages: int  # at least 1
    total: int  # the runs that pass the filter

    @property
    def has_previous(self) -> bool:
        return self.number > 1

    @property
    def has_next(self) -> bool:
        return self.number < self.pages


def ordered(runs: Iterable[StoredRun]) -> list[StoredRun]:
    """Most recent record first, runs whose time is unknown last; ties by run id."""
    runs = list(runs)
    dated = sorted((run for run in runs if run.updated_at is not None), key=lambda run: run.run_id)
    # A stable sort on time after the sort on id keeps ids in order among equal times.
    dated.sort(key=lambda run: run.updated_at or datetime.min, reverse=True)
    undated = sorted((run for run in runs if run.updated_at is None), key=lambda run: run.run_id)
    return dated + undated


def candidates(runs: Iterable[StoredRun], wanted: StateFilter) -> list[StoredRun]:
    """The runs that may pass ``wanted``, in list order; exactly those that pass it when
    the run table alone can tell (see :attr:`StateFilter.needs_status`)."""
    if wanted is StateFilter.FINISHED:
        return ordered(run for run in runs if run.finished)
    if wanted is StateFilter.ALL:
        return ordered(runs)
    return ordered(run for run in runs if not run.finished)


def passes(row: RunRow, wanted: StateFilter) -> bool:
    """Whether a run whose status was read passes a filter that needed it."""
    return not wanted.needs_status or row.state == wanted.value


def paginate(runs: Sequence[StoredRun], number: int, per_page: int = PER_PAGE) -> Page:
    """Page ``number`` (from 1; clamped to the pages there are) of ``runs``."""
    pages = max(1, -(-len(runs) // per_page))
    number = min(max(1, number), pages)
    start = (number - 1) * per_page
    return Page(tuple(runs[start : start + per_page]), number, pages, len(runs))


def select(
    runs: Sequence[StoredRun],
    rows: Mapping[str, RunRow],
    wanted: StateFilter,
    number: int,
    per_page: int = PER_PAGE,
) -> Page:
    """The page of ``runs`` (the :func:`candidates`) that pass ``wanted``, given the
    ``rows`` read for them (a run with no row is left out of a filter that needs one)."""
    if wanted.needs_status:
        runs = [run for run in runs if run.run_id in rows and passes(rows[run.run_id], wanted)]
    return paginate(runs, number, per_page)


class RowCache:
    """The rows last read, by everything the run table says of a run.

    A run whose table entry is unchanged (same last record time, claim, owner and
    lease) has the same status and log, so its row is reused. A run whose store cannot
    tell when it last changed (no ``updated_at``) is never cached. The least recently
    used rows go first once ``size`` is reached.
    """

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._size = size
        self._rows: OrderedDict[StoredRun, RunRow] = OrderedDict()

    def get(self, run: StoredRun) -> RunRow | None:
        row = self._rows.get(run)
        if row is not None:
            self._rows.move_to_end(run)
        return row

    def put(self, run: StoredRun, row: RunRow) -> None:
        if run.updated_at is None:
            return
        self._rows[run] = row
        self._rows.move_to_end(run)
        while len(self._rows) > self._size:
            self._rows.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rows)
