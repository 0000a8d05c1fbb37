"""The console's list, as pure logic (order, filters, pages, the row cache), and that a
page reads the logs of its own runs only."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kit.agent import Ledger, answer, definition, request
from kit.console import crash_in_doubt
from kit.review import review_tools
from polyloop import run
from polyloop.cli._console._data import list_page
from polyloop.cli._console._listing import (
    Query,
    RowCache,
    RunRow,
    StateFilter,
    candidates,
    ordered,
    paginate,
    passes,
    select,
)
from polyloop.ports import StoredRun
from polyloop.stores import SqliteStore
from polyloop.types import StopReason

pytestmark = pytest.mark.anyio

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def stored(run_id: str, minute: int | None, *, finished: bool = True, **more: Any) -> StoredRun:
    at = None if minute is None else T0 + timedelta(minutes=minute)
    return StoredRun(run_id=run_id, finished=finished, claimed=False, updated_at=at, **more)


def row(run_id: str, state: str) -> RunRow:
    return RunRow(run_id, state, None, 1, None, None, None)


def ids(runs: Any) -> list[str]:
    return [run.run_id for run in runs]


def test_the_most_recent_record_comes_first_then_the_run_id() -> None:
    runs = [stored("b", 1), stored("a", 1), stored("c", 5), stored("z", None), stored("y", None)]
    assert ids(ordered(runs)) == ["c", "a", "b", "y", "z"]


@pytest.mark.parametrize(
    ("wanted", "expected"),
    [
        (StateFilter.ALL, ["u2", "f2", "u1", "f1"]),
        (StateFilter.FINISHED, ["f2", "f1"]),
        (StateFilter.UNFINISHED, ["u2", "u1"]),
        (StateFilter.IN_DOUBT, ["u2", "u1"]),  # the runs to read: unfinished ones only
        (StateFilter.RUNNING, ["u2", "u1"]),
    ],
)
def test_candidates_leave_finished_runs_out_of_finer_filters(
    wanted: StateFilter, expected: list[str]
) -> None:
    runs = [
        stored("f1", 1),
        stored("f2", 3),
        stored("u1", 2, finished=False),
        stored("u2", 4, finished=False),
    ]
    assert ids(candidates(runs, Query(state=wanted))) == expected


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        (None, StateFilter.ALL),
        ("", StateFilter.ALL),
        ("in doubt", StateFilter.IN_DOUBT),
        ("awaiting approval", StateFilter.AWAITING_APPROVAL),
        ("in_doubt", StateFilter.IN_DOUBT),
        ("awaiting_approval", StateFilter.AWAITING_APPROVAL),
        ("bogus", StateFilter.ALL),
    ],
)
def test_the_state_parameter(text: str | None, wanted: StateFilter) -> None:
    assert StateFilter.parse(text) is wanted


@pytest.mark.parametrize(
    ("count", "number", "shown", "page", "pages"),
    [
        (0, 1, [], 1, 1),
        (5, 1, ["r0", "r1"], 1, 3),
        (5, 3, ["r4"], 3, 3),
        (5, 9, ["r4"], 3, 3),
        (5, -2, ["r0", "r1"], 1, 3),
        (4, 2, ["r2", "r3"], 2, 2),
    ],
)
def test_pages(count: int, number: int, shown: list[str], page: int, pages: int) -> None:
    runs = [stored(f"r{n}", -n) for n in range(count)]
    found = paginate(runs, number, per_page=2)
    assert ids(found.runs) == shown
    assert (found.number, found.pages, found.total) == (page, pages, count)
    assert found.has_previous is (page > 1) and found.has_next is (page < pages)


def test_a_finer_filter_pages_the_runs_whose_rows_pass_it() -> None:
    runs = [stored(f"r{n}", -n, finished=False) for n in range(5)]
    rows = {
        "r0": row("r0", "in doubt"),
        "r1": row("r1", "awaiting approval"),
        "r2": row("r2", "in doubt"),
        "r4": row("r4", "in doubt"),  # r3 went away while it was read: no row
    }
    found = select(runs, rows, Query(state=StateFilter.IN_DOUBT), 2, per_page=2)
    assert ids(found.runs) == ["r4"] and found.total == 3
    assert ids(select(runs, rows, Query(), 1, per_page=9).runs) == ids(runs)


def test_the_cache_keeps_a_row_while_the_run_table_says_nothing_changed() -> None:
    cache = RowCache(size=2)
    first = stored("a", 1, finished=False)
    cache.put(first, row("a", "resumable"))
    assert cache.get(first) == row("a", "resumable")
    # A new record, a claim taken, a new owner: each makes a different key.
    assert cache.get(stored("a", 2, finished=False)) is None
    claimed = StoredRun(run_id="a", finished=False, claimed=True, updated_at=first.updated_at)
    assert cache.get(claimed) is None
    assert cache.get(stored("a", 1, finished=False, owner="host:1")) is None


def test_the_cache_never_keeps_a_run_of_unknown_time_and_forgets_the_oldest() -> None:
    cache = RowCache(size=2)
    cache.put(stored("undated", None), row("undated", "finished"))
    assert len(cache) == 0
    a, b, c = stored("a", 1), stored("b", 2), stored("c", 3)
    cache.put(a, row("a", "finished"))
    cache.put(b, row("b", "finished"))
    assert cache.get(a) is not None  # a is now the most recently used
    cache.put(c, row("c", "finished"))
    assert len(cache) == 2
    assert cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None


class CountingStore:
    """A store that counts which runs' logs were read."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self.read: list[str] = []

    async def read_log(self, run_id: str) -> Any:
        self.read.append(run_id)
        return await self._store.read_log(run_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def finished_runs(store: SqliteStore, run_ids: list[str], text: str = "ok") -> None:
    """A run per id that answers ``text`` (``{n}`` its place in ``run_ids``) and ends."""
    tools = review_tools(Ledger())
    for n, run_id in enumerate(run_ids):
        script = [answer(text.format(n=n))]
        await run(definition(store, script=script), request(run_id, tools))


async def test_a_page_reads_only_its_own_runs_and_then_only_what_changed(
    tmp_path: Path,
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        await finished_runs(store, [f"done-{n:02}" for n in range(12)])
        await crash_in_doubt(store, "doubt")
        counting = CountingStore(store)
        cache = RowCache()
        page, rows, _ = await list_page(
            counting, cache, Query(state=StateFilter.ALL), 1, per_page=5
        )  # type: ignore[arg-type]
        assert [r.run_id for r in rows] == ["doubt", "done-11", "done-10", "done-09", "done-08"]
        assert set(counting.read) == set(ids(page.runs))
        counting.read.clear()
        await list_page(counting, cache, Query(state=StateFilter.ALL), 1, per_page=5)  # type: ignore[arg-type]
        assert counting.read == []  # nothing changed: every row came from the cache
        _, doubts, _ = await list_page(
            counting, cache, Query(state=StateFilter.IN_DOUBT), 1, per_page=5
        )  # type: ignore[arg-type]
        assert [r.run_id for r in doubts] == ["doubt"]
        assert counting.read == []  # the in-doubt run's row was cached; finished ones unread
        await crash_in_doubt(store, "later")
        _, doubts, _ = await list_page(
            counting, cache, Query(state=StateFilter.IN_DOUBT), 1, per_page=5
        )  # type: ignore[arg-type]
        assert [r.run_id for r in doubts] == ["later", "doubt"]
        assert set(counting.read) == {"later"}


# -- search and filters (issue 47) -------------------------------------------------------------


def found(run_id: str, **fields: Any) -> RunRow:
    return replace(row(run_id, "finished"), **fields)


def test_a_query_reads_back_from_its_parameters() -> None:
    params = {
        "q": " needle ",
        "state": "in_doubt",
        "stop_reason": "in_doubt",
        "tool": "deploy",
        "model": "gpt",
        "started_after": "2026-12-06",
        "started_before": "2026-12-07T00:00:00+01:00",
    }
    query = Query.parse(params)
    assert query.text == "needle" and query.state is StateFilter.IN_DOUBT
    assert query.stop_reason is StopReason.IN_DOUBT
    assert query.started_after == datetime(2026, 12, 6, tzinfo=UTC)
    assert query.started_before == datetime(2026, 12, 6, 23, tzinfo=UTC)
    assert Query.parse(query.params()) == query
    assert Query.parse({"stop_reason": "bogus", "started_after": "soon"}) == Query(
        unreadable=("soon",)
    )
    assert Query().params() == {} and not Query().needs_rows


def test_a_filter_on_what_a_log_holds_needs_every_row_and_rules_out_by_the_run_table() -> None:
    runs = [
        stored("f-old", 1),
        stored("f-new", 30),
        stored("u-old", 2, finished=False),
        stored("u-new", 40, finished=False),
        stored("undated", None),
    ]
    since = T0 + timedelta(minutes=10)
    # A last record before the start asked for rules the run out; so does the stop reason.
    assert ids(candidates(runs, Query(started_after=since))) == ["u-new", "f-new", "undated"]
    in_doubt = Query(stop_reason=StopReason.IN_DOUBT)
    assert ids(candidates(runs, in_doubt)) == ["u-new", "u-old"] and in_doubt.unfinished_only
    ended = Query(stop_reason=StopReason.FINAL_ANSWER)
    assert ids(candidates(runs, ended)) == ["f-new", "f-old", "undated"] and ended.finished_only
    assert Query(tool="x").needs_rows and Query(text="x").needs_rows


@pytest.mark.parametrize(
    ("query", "passing"),
    [
        (Query(tool="deploy"), ["a"]),
        (Query(tool="dep"), []),  # a tool by its whole name
        (Query(model="MINI"), ["b"]),
        (Query(text="A-1"), ["a-1"]),
        (Query(text="DISK IS"), ["b"]),
        (Query(stop_reason=StopReason.IN_DOUBT), ["a", "c"]),  # c: no end record yet
        (Query(stop_reason=StopReason.FINAL_ANSWER), []),
        (Query(started_after=T0 + timedelta(hours=1)), ["b"]),
        (Query(started_before=T0 + timedelta(hours=1)), ["a"]),
        (Query(started_after=T0, started_before=T0 + timedelta(hours=1)), ["a"]),
    ],
)
def test_which_rows_pass(query: Query, passing: list[str]) -> None:
    rows = [
        found("a", tools=("double", "deploy"), stop_reason="in_doubt", started_at=T0),
        found(
            "b",
            models=("gpt-4o-mini",),
            last_texts=("the disk is full",),
            started_at=T0 + timedelta(hours=2),
        ),
        found("a-1"),  # no start time: out of any time filter
        found("c", state="in doubt"),
    ]
    assert [r.run_id for r in rows if passes(r, query)] == passing


def test_a_run_without_an_end_has_no_duration() -> None:
    assert found("a", started_at=T0).duration_s is None
    assert found("a", started_at=T0, ended_at=T0 + timedelta(seconds=3)).duration_s == 3.0


async def test_a_search_reads_the_most_recent_runs_up_to_its_limit_then_only_what_changed(
    tmp_path: Path,
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        await finished_runs(store, [f"done-{n}" for n in range(8)], "answer {n}")
        counting = CountingStore(store)
        cache = RowCache()

        async def search(text: str, **more: Any) -> tuple[Any, list[str]]:
            query = Query(text=text, **more)
            page, rows, _ = await list_page(counting, cache, query, 1, per_page=5, scan_limit=4)  # type: ignore[arg-type]
            return page, [r.run_id for r in rows]

        page, found_ids = await search("ANSWER")
        assert found_ids == ["done-7", "done-6", "done-5", "done-4"]
        assert page.searched_only == 4 and page.total == 4
        assert set(counting.read) == {"done-4", "done-5", "done-6", "done-7"}
        counting.read.clear()
        page, found_ids = await search("answer 5")
        assert found_ids == ["done-5"] and counting.read == []  # all from the cache
        # A start-time filter rules out, unread, the runs whose last record is older.
        status = await store.describe_run("done-5")
        assert status is not None and status.updated_at is not None
        page, found_ids = await search("answer", started_after=status.updated_at)
        assert found_ids == ["done-7", "done-6"]  # done-5 started before its last record
        assert page.searched_only is None and counting.read == []
