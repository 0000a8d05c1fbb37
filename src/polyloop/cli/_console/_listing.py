"""Which runs the console's list shows, in which order, a page at a time: pure logic.

The list is built from the store's run table, which says whether each run finished
without reading its log. Without a filter, or with one on finished or unfinished runs,
the store hands over one page of it, sorted (``page_runs``), and only the runs on the
page are read. A finer filter (awaiting approval, in doubt, running, resumable) needs
each unfinished run's status; finished runs, the vast majority of a long-lived store,
are never read for it. A search or a filter on what a log holds (its stop reason,
tools, model, start time, last reply) needs the row of every run the run table cannot
rule out, up to the most recent ``SCAN_LIMIT``. Rows are kept in a cache keyed by what
the run table says of a run, so an unchanged run is not read again. A page is reached
by a cursor (the run it follows or precedes), never by a count of runs to skip.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from polyloop.cli._view import span_s
from polyloop.ports import StoredRun
from polyloop.types import StopReason

PER_PAGE = 50
CACHE_SIZE = 4096
# The most recent runs a search or a filter on what a log holds reads, at most: as many
# as the row cache keeps, so asking again reads only what changed. Older runs are
# reached by narrowing the time (a start-time filter rules runs out unread).
SCAN_LIMIT = CACHE_SIZE


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
    started_at: datetime | None = None
    ended_at: datetime | None = None
    # The tools the run called or was asked to call (a proposal, an action in doubt).
    tools: tuple[str, ...] = ()
    # The snapshot's model parameters (``model.name``, ...) and the models that replied.
    models: tuple[str, ...] = ()
    # The last step's reply and observation, and the run's final answer: what a search reads.
    last_texts: tuple[str, ...] = ()
    # The tool of the action in doubt, for a run in doubt about an action.
    doubt_tool: str | None = None

    @property
    def duration_s(self) -> float | None:
        """From the start record to the end record; ``None`` while the run goes on."""
        return span_s(self.started_at, self.ended_at)


@dataclass(frozen=True, slots=True)
class Page:
    """The runs of one page, and the cursors of the pages next to it."""

    runs: tuple[StoredRun, ...]
    newer: str | None = None  # the cursor of the page above, if there is one
    older: str | None = None  # the cursor of the page below, if there is one
    # The runs that pass a filter the rows were read for; the run table is not counted.
    total: int | None = None
    # How many of the most recent runs a search read, when it read no further.
    searched_only: int | None = None

    @property
    def has_previous(self) -> bool:
        return self.newer is not None

    @property
    def has_next(self) -> bool:
        return self.older is not None


@dataclass(frozen=True, slots=True)
class Place:
    """Where a page of the list is: right after a cursor, right before one, or first
    (the ``after`` and ``before`` query parameters)."""

    after: str | None = None
    before: str | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Place:
        after, before = params.get("after") or None, params.get("before") or None
        return cls(after=after) if after is not None else cls(before=before)

    def params(self) -> dict[str, str]:
        found = {"after": self.after or "", "before": self.before or ""}
        return {key: value for key, value in found.items() if value}


def ordered(runs: Iterable[StoredRun]) -> list[StoredRun]:
    """Most recent record first, runs whose time is unknown last; ties by run id."""
    runs = list(runs)
    dated = sorted((run for run in runs if run.updated_at is not None), key=lambda run: run.run_id)
    # A stable sort on time after the sort on id keeps ids in order among equal times.
    dated.sort(key=lambda run: run.updated_at or datetime.min, reverse=True)
    undated = sorted((run for run in runs if run.updated_at is None), key=lambda run: run.run_id)
    return dated + undated


# Stop reasons that leave a run unfinished in the run table (``StoredRun.finished``).
UNFINISHED_REASONS = frozenset(
    {StopReason.CANCELLED, StopReason.IN_DOUBT, StopReason.AWAITING_APPROVAL}
)
QUERY_KEYS = ("q", "state", "stop_reason", "tool", "model", "started_after", "started_before")


def parse_time(text: str) -> datetime | None:
    """A time typed in a filter, ISO 8601 (``2026-12-06``, ``2026-12-06T09:30``, with
    ``Z`` or an offset); a time without an offset is UTC, as the list shows times.
    ``None`` if it is no time."""
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        return None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class Query:
    """What a person asked the list for: the query parameters of its address, so a
    filtered list is a link to share. Empty texts filter nothing."""

    state: StateFilter = StateFilter.ALL
    text: str = ""  # a part of the run id, or of the last reply or observation
    stop_reason: StopReason | None = None
    tool: str = ""
    model: str = ""  # a part of a model parameter of the snapshot, any case
    started_after: datetime | None = None
    started_before: datetime | None = None
    # The time filters that are no time, as typed: refused in words, never applied.
    unreadable: tuple[str, ...] = field(default=())

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Query:
        """The query of an address; an unknown state or stop reason filters nothing."""
        try:
            stop_reason = StopReason(params.get("stop_reason", "").strip() or "-")
        except ValueError:
            stop_reason = None
        times: dict[str, datetime | None] = {}
        unreadable = []
        for key in ("started_after", "started_before"):
            typed = params.get(key, "").strip()
            times[key] = parse_time(typed) if typed else None
            if typed and times[key] is None:
                unreadable.append(typed)
        return cls(
            state=StateFilter.parse(params.get("state")),
            text=params.get("q", "").strip(),
            stop_reason=stop_reason,
            tool=params.get("tool", "").strip(),
            model=params.get("model", "").strip(),
            started_after=times["started_after"],
            started_before=times["started_before"],
            unreadable=tuple(unreadable),
        )

    def params(self) -> dict[str, str]:
        """The query parameters that say this query, the empty ones left out."""
        found = {
            "q": self.text,
            "state": "" if self.state is StateFilter.ALL else self.state.value,
            "stop_reason": self.stop_reason.value if self.stop_reason is not None else "",
            "tool": self.tool,
            "model": self.model,
            "started_after": _time_param(self.started_after),
            "started_before": _time_param(self.started_before),
        }
        return {key: value for key, value in found.items() if value}

    def with_changes(self, **changes: object) -> Query:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def reads_content(self) -> bool:
        """Whether the query needs what a log holds beyond the run's state."""
        return bool(
            self.text
            or self.stop_reason is not None
            or self.tool
            or self.model
            or self.started_after is not None
            or self.started_before is not None
        )

    @property
    def needs_rows(self) -> bool:
        """Whether telling a run in from one out takes its row, not just the run table."""
        return self.state.needs_status or self.reads_content

    @property
    def unfinished_only(self) -> bool:
        """Whether the runs that may pass are all among the unfinished ones."""
        if self.stop_reason is not None and self.stop_reason in UNFINISHED_REASONS:
            return True
        return self.state not in (StateFilter.ALL, StateFilter.FINISHED)

    @property
    def finished_only(self) -> bool:
        if self.stop_reason is not None and self.stop_reason not in UNFINISHED_REASONS:
            return True
        return self.state is StateFilter.FINISHED

    @property
    def finished(self) -> bool | None:
        """The runs the run table keeps (``page_runs``' ``finished``): only finished
        ones, only unfinished ones, or all."""
        return True if self.finished_only else False if self.unfinished_only else None


def _time_param(at: datetime | None) -> str:
    return "" if at is None else at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def passes(row: RunRow, query: Query) -> bool:
    """Whether a run whose row was read passes ``query``."""
    if query.state.needs_status and row.state != query.state.value:
        return False
    if query.stop_reason is not None and not ended_with(row, query.stop_reason):
        return False
    if query.tool and query.tool not in row.tools:
        return False
    if query.model and not _holds(row.models, query.model):
        return False
    if not _started_within(row.started_at, query):
        return False
    return not query.text or _holds((row.run_id, *row.last_texts), query.text)


def ended_with(row: RunRow, reason: StopReason) -> bool:
    """Whether the run ended with ``reason``. A run whose process died during an action
    it may not replay is in doubt before any end record says so (a resume writes it):
    it counts as ended in doubt, as the person who must settle it sees it."""
    if row.stop_reason is not None:
        return row.stop_reason == reason.value
    return reason is StopReason.IN_DOUBT and row.state == StateFilter.IN_DOUBT.value


def _holds(texts: Iterable[str], part: str) -> bool:
    wanted = part.casefold()
    return any(wanted in text.casefold() for text in texts)


def _started_within(started_at: datetime | None, query: Query) -> bool:
    if query.started_after is None and query.started_before is None:
        return True
    if started_at is None:
        return False
    after_ok = query.started_after is None or started_at >= query.started_after
    return after_ok and (query.started_before is None or started_at < query.started_before)


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
