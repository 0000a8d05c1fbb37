"""SQLite is a store for one host: a claim is a lock the operating system keeps for a
living process, with no lease; a database written by the release whose claims had leases
is taken over only once none of its owners holds one.

Three worker processes share one database file (``tests/kit/single_host_agent.py``). One of
them hangs at the worst moment: holding SQLite's write lock, so that every other
process's writes wait behind it. While it hangs its runs stay its own (a hung process is
not taken over, as with ``JsonlStore``); the other two lose nothing, they wait; once it
goes on, every run of every worker finishes, and no action whose replay is never allowed
runs twice. A killed process frees its claims at once
(``tests/stores/test_sqlite.py::test_a_dead_writer_process_releases_the_run``).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

import anyio
import anyio.abc
import pytest

from kit import child_agent, single_host_agent
from polyloop.stores import SqliteStore
from polyloop.testing.store_contract import apply, sample_run
from polyloop.types import StoreError

pytestmark = pytest.mark.anyio

WORKERS = ("A", "B", "C")
RUNS = 4
# How long the holder hangs: far longer than the runs need, far shorter than the time a
# write waits for SQLite's lock before it gives up (30 s).
HANG_S = 3.0


async def _noted(side_file: Path, line: str) -> None:
    """Until a worker notes ``line`` in the side file (no event crosses processes)."""
    path = anyio.Path(side_file)
    with anyio.fail_after(30):
        while not (await path.exists() and line in (await path.read_text()).splitlines()):  # noqa: ASYNC110
            await anyio.sleep(0.02)


async def _stopped(pid: int) -> None:
    """Until process ``pid`` is stopped (it is left for its owner to reap)."""
    with anyio.fail_after(10):
        while (change := child_agent.stopped_or_ended(pid)) is None:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert change == "stopped", f"worker {pid} ended instead of stopping"


@pytest.mark.slow
async def test_a_worker_hung_with_the_write_lock_costs_the_others_a_wait_and_nobody_a_run(
    tmp_path: Path,
) -> None:
    db, side_file = tmp_path / "runs.db", tmp_path / "side"
    # Opened before the workers start: opening checks the schema under the write lock.
    reader = SqliteStore(db)
    await reader.__aenter__()
    workers: dict[str, anyio.abc.Process] = {}
    outcomes: dict[str, str] = {}
    try:
        for worker in WORKERS:
            # No run records before the lock is held, so every run waits behind it.
            mode = "hold=" + ",".join(WORKERS) if worker == "A" else "after=A"
            command = [sys.executable, single_host_agent.__file__, str(db), worker, str(RUNS)]
            workers[worker] = await anyio.open_process([*command, str(side_file), mode])
        try:
            await _noted(side_file, "holding A")
            await _stopped(workers["A"].pid)
            hung_at = time.monotonic()
            # While it hangs, the holder's runs are its own: nobody may take them over.
            for i in range(RUNS):
                described = await reader.describe_run(f"A-{i}")
                assert described is not None
                assert (described.claimed, described.finished) == (True, False)
            # The others were under way when the lock was taken, and wait for it now.
            for i in range(RUNS):
                for w in "BC":
                    described = await reader.describe_run(f"{w}-{i}")
                    assert described is not None and not described.finished
            await anyio.sleep(max(0.0, HANG_S - (time.monotonic() - hung_at)))
            assert [process.returncode for process in workers.values()] == [None, None, None]
        finally:
            for process in workers.values():
                if process.returncode is None:
                    os.kill(process.pid, signal.SIGCONT)
        with anyio.fail_after(60):
            for worker, process in workers.items():
                assert process.stdout is not None
                said = (await process.stdout.receive()).decode()
                assert await process.wait() == 0, f"worker {worker} failed: {said}"
                outcomes.update(json.loads(said))
    finally:
        for process in workers.values():
            if process.returncode is None:
                process.kill()
            await process.aclose()
        await reader.aclose()

    assert outcomes == {f"{w}-{i}": "submitted" for w in WORKERS for i in range(RUNS)}
    executions = side_file.read_text().splitlines()
    for run_id in outcomes:  # the two actions whose replay is never allowed: once each
        assert executions.count(f"record {run_id}:4:action") == 1
        assert executions.count(f"submit {run_id}:6:action") == 1


# -- a database from the release whose claims had leases -----------------------------------


def _as_written_by_a_leased_release(path: Path, lease_until: float) -> None:
    """Turn a database into what a release with owners and leases left: an ``owners``
    table whose one owner holds (or held) the run ``r1`` until ``lease_until``."""
    with sqlite3.connect(path, isolation_level=None) as db:
        db.execute("DROP VIEW owners")
        db.execute(
            "CREATE TABLE owners (owner_id TEXT PRIMARY KEY, description TEXT NOT NULL,"
            " lease_until REAL NOT NULL, started_at REAL NOT NULL)"
        )
        db.execute("INSERT INTO owners VALUES ('o1', 'old-host pid 7', ?, 0)", (lease_until,))
        db.execute("UPDATE runs SET owner = 'o1' WHERE run_id = 'r1'")
        db.execute("DELETE FROM meta WHERE key = 'layout'")  # such a release never wrote it
    sqlite3.connect(path).close()


async def _one_unfinished_run(path: Path) -> None:
    async with SqliteStore(path) as store:
        await apply(store, sample_run("r1", steps=1, ended=False))


async def test_a_database_in_use_by_a_leased_release_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    await _one_unfinished_run(path)
    _as_written_by_a_leased_release(path, lease_until=time.time() + 3_600)
    store = SqliteStore(path)
    with pytest.raises(StoreError, match="old-host pid 7") as refused:
        await store.read_log("r1")
    assert "earlier PolyLoop release" in str(refused.value)
    await store.aclose()
    with sqlite3.connect(path) as db:  # nothing was changed
        assert db.execute("SELECT owner FROM runs").fetchall() == [("o1",)]


async def test_a_leased_release_is_fenced_out_once_its_owners_are_gone(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    await _one_unfinished_run(path)
    _as_written_by_a_leased_release(path, lease_until=time.time() - 60)
    async with SqliteStore(path) as store:
        described = await store.describe_run("r1")
        assert described is not None
        assert (described.claimed, described.owner) == (False, None)
        await apply(store, sample_run("r1", steps=2, ended=True)[5:])  # it goes on
    with sqlite3.connect(path) as db:
        kinds = dict(db.execute("SELECT name, type FROM sqlite_master WHERE name = 'owners'"))
        assert kinds == {"owners": "view"}
        # What the earlier release does to claim a run: register as an owner. It fails.
        with pytest.raises(sqlite3.OperationalError, match="view"):
            db.execute("INSERT INTO owners VALUES ('o2', 'old-host pid 8', 1e12, 0)")
