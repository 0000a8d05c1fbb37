"""A page of runs worked out from ``list_runs``: the order, the cursors and the filters
every store's ``page_runs`` keeps, and the page of a store that has no ``page_runs``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from polyloop._paging import cursor, page_of, page_request, pages, run_cursor
from polyloop.ports import PagedStore, StoredRun
from polyloop.stores import MemoryStore
from polyloop.testing.store_contract import apply, sample_run
from polyloop.types import InvalidRequest

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def stored(run_id: str, minute: int | None, *, finished: bool = True) -> StoredRun:
    at = None if minute is None else T0 + timedelta(minutes=minute)
    return StoredRun(run_id=run_id, finished=finished, claimed=False, updated_at=at)


RUNS = [
    stored("b", 1),
    stored("a", 1),
    stored("c", 5, finished=False),
    stored("z", None),
    stored("y", None, finished=False),
    stored("d", 3),
]
ORDER = ["c", "d", "a", "b", "y", "z"]  # newest first, ties by id, unknown times last


def ids(runs: Any) -> list[str]:
    return [run.run_id for run in runs]


def test_pages_follow_each_other_by_cursor_both_ways() -> None:
    first = page_of(RUNS, page_request(limit=4))
    assert ids(first.runs) == ORDER[:4] and first.newer is None
    assert first.older == run_cursor(first.runs[-1])
    second = page_of(RUNS, page_request(limit=4, after=first.older))
    assert ids(second.runs) == ORDER[4:] and second.older is None
    assert second.newer is not None
    back = page_of(RUNS, page_request(limit=4, before=second.newer))
    assert back == first
    # A cursor names a place, not a run: it holds once its run is gone.
    rest = [run for run in RUNS if run.run_id != "b"]
    assert ids(page_of(rest, page_request(limit=9, after=first.older)).runs) == ["y", "z"]


def test_filters_keep_the_runs_they_name() -> None:
    assert ids(page_of(RUNS, page_request(limit=9, finished=True)).runs) == ["d", "a", "b", "z"]
    assert ids(page_of(RUNS, page_request(limit=9, finished=False)).runs) == ["c", "y"]
    since = page_request(limit=9, updated_since=(T0 + timedelta(minutes=3)).replace(tzinfo=None))
    assert ids(page_of(RUNS, since).runs) == ["c", "d"]  # a naive time is UTC
    before = page_request(limit=9, updated_before=T0 + timedelta(minutes=3))
    assert ids(page_of(RUNS, before).runs) == ["a", "b"]  # unknown times are in no window


@pytest.mark.parametrize(
    "request_args",
    [
        {"limit": 0},
        {"limit": True},
        {"limit": 1, "after": "x", "before": "y"},
        {"limit": 1, "after": "not json"},
        {"limit": 1, "after": '["2026-01-01T00:00:00", "naive"]'},
        {"limit": 1, "after": "[1, 2]"},
        {"limit": 1, "updated_since": "yesterday"},
    ],
)
def test_a_bad_request_is_refused_in_words(request_args: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        page_request(**request_args)


def test_a_cursor_of_another_kind_of_store_is_refused() -> None:
    """A database's cursor holds its own time (a number in SQLite), not a listed one."""
    with pytest.raises(InvalidRequest, match="not one of this store's"):
        page_of(RUNS, page_request(limit=1, after=cursor(1.5, "a")))


class Unpaged:
    """A store without ``page_runs``: everything else is the memory store's."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name == "page_runs":
            raise AttributeError(name)
        return getattr(self._store, name)


@pytest.mark.anyio
async def test_a_store_without_pages_is_paged_from_its_listing() -> None:
    store = MemoryStore()
    for n in range(5):
        await apply(store, sample_run(f"r{n}", steps=1, ended=n != 2))
    plain = Unpaged(store)
    assert not isinstance(plain, PagedStore)
    for filters in ({}, {"finished": True}, {"finished": False}):
        own = await store.page_runs(limit=2, **filters)
        derived = await pages(plain).page_runs(limit=2, **filters)  # type: ignore[arg-type]
        assert derived == own
        if own.older is not None:
            after = await pages(plain).page_runs(limit=2, after=own.older, **filters)  # type: ignore[arg-type]
            assert after == await store.page_runs(limit=2, after=own.older, **filters)
