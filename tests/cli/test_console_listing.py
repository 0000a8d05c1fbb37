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
    Place,
    Query,
    RowCache,
    RunRow,
    StateFilter,
    ordered,
    passes,
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
    ("wanted", "finished"),
    [
        (StateFilter.ALL, None),
        (StateFilter.FINISHED, True),
        (StateFilter.UNFINISHED, False),
        (StateFilter.IN_DOUBT, False),  # the runs to read: unfinished ones only
        (StateFilter.RUNNING, False),
    ],
)
def test_the_run_table_leaves_finished_runs_out_of_finer_filters(
    wanted: StateFilter, finished: bool | None
) -> None:
    assert Query(state=wanted).finished is finished


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


def test_a_place_in_the_list_reads_back_from_its_parameters() -> None:
    assert Place.parse({}) == Place() and Place().params() == {}
    assert Place.parse({"after": "c", "before": "d"}) == Place(after="c")  # one way only
    assert Place.parse(Place(before="d").params()) == Place(before="d")


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
            counting, cache, Query(state=StateFilter.ALL), Place(), per_page=5
        )  # type: ignore[arg-type]
        assert [r.run_id for r in rows] == ["doubt", "done-11", "done-10", "done-09", "done-08"]
        assert set(counting.read) == set(ids(page.runs))
        counting.read.clear()
        await list_page(counting, cache, Query(state=StateFilter.ALL), Place(), per_page=5)  # type: ignore[arg-type]
        assert counting.read == []  # nothing changed: every row came from the cache
        _, doubts, _ = await list_page(
            counting, cache, Query(state=StateFilter.IN_DOUBT), Place(), per_page=5
        )  # type: ignore[arg-type]
        assert [r.run_id for r in doubts] == ["doubt"]
        assert counting.read == []  # the in-doubt run's row was cached; finished ones unread
        await crash_in_doubt(store, "later")
        _, doubts, _ = await list_page(
            counting, cache, Query(state=StateFilter.IN_DOUBT), Place(), per_page=5
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
    in_doubt = Query(stop_reason=StopReason.IN_DOUBT)
    assert in_doubt.finished is False and in_doubt.unfinished_only
    ended = Query(stop_reason=StopReason.FINAL_ANSWER)
    assert ended.finished is True and ended.finished_only
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
            page, rows, _ = await list_page(
                counting, cache, query, Place(), per_page=5, scan_limit=4
            )  # type: ignore[arg-type]
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


# -- a page of the run table (issue 47) --------------------------------------------------------


class UnpagedStore(CountingStore):
    """A store without ``page_runs`` (the console pages it from ``list_runs``) that
    counts how it was asked for its run table."""

    def __init__(self, store: SqliteStore) -> None:
        super().__init__(store)
        self.asked: list[str] = []

    async def list_runs(self, *, unfinished_only: bool = False) -> Any:
        self.asked.append("list_runs")
        return await self._store.list_runs(unfinished_only=unfinished_only)

    def __getattr__(self, name: str) -> Any:
        if name == "page_runs":
            raise AttributeError(name)
        return super().__getattr__(name)


class TableCountingStore(UnpagedStore):
    """The same with ``page_runs``, the store's own."""

    async def page_runs(self, **request: Any) -> Any:
        self.asked.append(f"page_runs {request['limit']}")
        return await self._store.page_runs(**request)


async def _walk_list(store: Any, query: Query) -> list[list[str]]:
    """The ids of every page of the list, following the older links from the first."""
    cache, place, pages = RowCache(), Place(), []
    while True:
        page, rows, _ = await list_page(store, cache, query, place, per_page=3)
        pages.append([r.run_id for r in rows])
        if page.older is None:
            return pages
        place = Place(after=page.older)


async def test_the_first_page_reads_one_page_of_the_run_table_and_its_runs_only(
    tmp_path: Path,
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        await finished_runs(store, [f"done-{n}" for n in range(7)])
        await crash_in_doubt(store, "doubt")
        paged = TableCountingStore(store)
        page, rows, seen = await list_page(paged, RowCache(), Query(), Place(), per_page=3)  # type: ignore[arg-type]
        assert [r.run_id for r in rows] == ["doubt", "done-6", "done-5"]
        assert paged.asked == ["page_runs 3"] and set(paged.read) == set(ids(seen))
        assert page.total is None and page.newer is None and page.older is not None
        unpaged = UnpagedStore(store)
        for query in (Query(), Query(state=StateFilter.FINISHED), Query(text="done")):
            assert await _walk_list(paged, query) == await _walk_list(unpaged, query)
        assert "list_runs" not in paged.asked and set(unpaged.asked) == {"list_runs"}
        walked = await _walk_list(paged, Query(state=StateFilter.FINISHED))
        assert walked == [
            ["done-6", "done-5", "done-4"],
            ["done-3", "done-2", "done-1"],
            ["done-0"],
        ]


async def test_a_search_pages_the_runs_that_pass_it_by_cursor(tmp_path: Path) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        await finished_runs(store, [f"run-{n}" for n in range(7)], "answer {n}")
        cache = RowCache()
        query = Query(text="answer")
        first, rows, _ = await list_page(store, cache, query, Place(), per_page=4)
        assert [r.run_id for r in rows] == ["run-6", "run-5", "run-4", "run-3"]
        assert first.total == 7 and first.searched_only is None and first.older is not None
        second, rows, _ = await list_page(store, cache, query, Place(after=first.older), per_page=4)
        assert [r.run_id for r in rows] == ["run-2", "run-1", "run-0"] and second.older is None
        assert second.newer is not None
        back, rows, _ = await list_page(store, cache, query, Place(before=second.newer), per_page=4)
        assert back.runs == first.runs and back.newer is None
