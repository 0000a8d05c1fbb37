"""The followers of a store that cannot notify: one thread a store object checks every
followed run at once (``stores/_polling.py``; docs/following.md#how-a-follower-wakes)."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from pathlib import Path

import anyio
import pytest

from kit.hosting import eventually
from polyloop import StoreError
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._polling import POLL_S, Poller
from polyloop.testing.store_contract import sample_run

pytestmark = pytest.mark.anyio

POLLER = "polyloop-poller"


def _pollers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == POLLER]


async def _no_pollers() -> None:
    """Wait out the polling threads of earlier tests: each ends within a tick of its last
    follower leaving."""
    await eventually(lambda: not _pollers(), what="earlier polling threads end")


class Marks:
    """A check that says what ``lengths`` holds, and counts its calls and their runs."""

    def __init__(self) -> None:
        self.lengths: dict[str, int] = {}
        self.calls: list[frozenset[str]] = []
        self.failing = False

    def __call__(self, run_ids: Collection[str]) -> Mapping[str, object]:
        if self.failing:
            raise RuntimeError("the check failed")
        self.calls.append(frozenset(run_ids))
        return {run_id: self.lengths[run_id] for run_id in run_ids if run_id in self.lengths}


async def test_one_check_a_tick_serves_every_follower_and_wakes_only_the_changed() -> None:
    marks = Marks()
    marks.lengths = {f"r{index}": 1 for index in range(200)}
    poller = Poller(marks)
    woken: list[str] = []
    await _no_pollers()

    async def follow(run_id: str, ready: anyio.Event) -> None:
        async with poller.appended(run_id) as wait:
            ready.set()
            await wait()
            woken.append(run_id)

    async with anyio.create_task_group() as group:
        for run_id in marks.lengths:
            ready = anyio.Event()
            group.start_soon(follow, run_id, ready)
            await ready.wait()
        assert len(_pollers()) == 1
        marks.calls.clear()
        marks.lengths["r7"] = 2
        del marks.lengths["r9"]  # a run gone (pruned) is a change too
        with anyio.fail_after(5):
            await eventually(lambda: len(woken) == 2, what="the two woken")
        assert sorted(woken) == ["r7", "r9"]
        await anyio.sleep(3 * POLL_S)
        assert sorted(woken) == ["r7", "r9"]  # the others saw no change
        # Each tick asked about every followed run in one call.
        assert marks.calls and all(len(call) >= 198 for call in marks.calls)
        group.cancel_scope.cancel()
    await eventually(lambda: not _pollers(), what="the thread ends with its last follower")


async def test_a_failed_check_is_raised_by_each_follower_from_its_own_check() -> None:
    marks = Marks()
    marks.lengths = {"r1": 1, "r2": 1}
    poller = Poller(marks)
    async with poller.appended("r1") as first, poller.appended("r2") as second:
        marks.failing = True
        for wait in (first, second):
            with anyio.fail_after(5), pytest.raises(RuntimeError, match="the check failed"):
                await wait()


async def test_a_follower_of_a_closed_sqlite_store_gets_the_store_s_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "runs.db")
    await store.claim_run("r1")
    await store.start_run(sample_run("r1")[0][1][0])
    async with store.appended("r1") as wait:
        await store.aclose()
        with anyio.fail_after(5), pytest.raises(StoreError, match="closed"):
            await wait()


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
async def test_many_followers_of_one_store_object_share_one_thread(
    tmp_path: Path, kind: str
) -> None:
    async with (
        SqliteStore(tmp_path / "runs.db") if kind == "sqlite" else JsonlStore(tmp_path)
    ) as store:
        for index in range(600):  # more than one statement's worth of keys
            await store.claim_run(f"r{index}")
            await store.start_run(sample_run(f"r{index}")[0][1][0])
        await _no_pollers()
        async with anyio.create_task_group() as group:
            woken = anyio.Event()

            async def follow(run_id: str, ready: anyio.Event) -> None:
                async with store.appended(run_id) as wait:
                    ready.set()
                    await wait()
                    if run_id == "r599":
                        woken.set()

            for index in range(600):
                ready = anyio.Event()
                group.start_soon(follow, f"r{index}", ready)
                await ready.wait()
            assert len(_pollers()) == 1
            step = sample_run("r599", steps=1)[1]
            await getattr(store, step[0])(*step[1])
            with anyio.fail_after(5):
                await woken.wait()
            group.cancel_scope.cancel()
