"""The JSONL store's per-run lock: a descriptor is never closed under a write or a sync.

An intent's append and its ``fsync`` run with the run's lock held, and so does closing
the run's descriptor (``end_run``, ``release_run``, ``aclose``, a failed write). Without
the lock, closing the store while an intent is being synced would close the descriptor
under the sync: the intent's caller would get an error for a line that is on disk, or,
had the descriptor number been reused, a sync of some other file reported as its own.
The second test removes the lock and shows that this test would notice.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from polyloop import StoreError
from polyloop.stores import JsonlStore
from polyloop.stores._fileops import OsFileOps
from polyloop.testing.store_contract import sample_run

pytestmark = pytest.mark.anyio


class SlowSyncs(OsFileOps):
    """Real file operations whose syncs of intents take a while once ``slow`` is set."""

    def __init__(self) -> None:
        self.slow = False
        self.syncing = threading.Event()
        self.events: list[str] = []

    def fsync(self, fd: int) -> None:
        if self.slow:
            self.syncing.set()
            time.sleep(0.3)
        os.fsync(fd)
        self.events.append("synced")

    def close(self, fd: int) -> None:
        self.events.append("closed")
        os.close(fd)


class NoLock:
    """Stands in for the run's lock in the test that removes it."""

    def acquire(self, blocking: bool = True) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass


async def _close_while_syncing(tmp_path: Path, *, remove_lock: bool) -> tuple[Any, SlowSyncs]:
    files = SlowSyncs()
    store = JsonlStore(tmp_path / "runs", _files=files)
    for run_id in ("a", "b"):  # two runs: an intent's sync goes to a worker thread
        await store.claim_run(run_id)
        await store.start_run(sample_run(run_id)[0][1][0])
    if remove_lock:
        for slot in store._slots.values():
            slot.lock = NoLock()  # type: ignore[assignment]
    _, (intent,) = sample_run("a")[1]
    files.slow = True
    outcome: dict[str, Any] = {}

    async def write() -> None:
        try:
            await store.write_intent(intent)
        except StoreError as exc:
            outcome["error"] = exc
        else:
            outcome["error"] = None

    async with anyio.create_task_group() as group:
        group.start_soon(write)
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(files.syncing.wait)
        await store.aclose()
    files.slow = False
    return outcome["error"], files


async def test_closing_the_store_waits_for_an_intent_being_synced(tmp_path: Path) -> None:
    error, files = await _close_while_syncing(tmp_path, remove_lock=False)
    assert error is None
    # The intent's sync ended before its descriptor was closed.
    assert files.events[-3:] == ["synced", "closed", "closed"]
    reader = JsonlStore(tmp_path / "runs")
    _, (intent,) = sample_run("a")[1]
    assert (await reader.read_log("a")).records[-1] == intent


async def test_without_the_run_lock_the_descriptor_is_closed_under_the_sync(
    tmp_path: Path,
) -> None:
    """The check above is not vacuous: with the lock removed, the close wins the race."""
    error, files = await _close_while_syncing(tmp_path, remove_lock=True)
    assert isinstance(error, StoreError)
    assert "closed" in files.events
