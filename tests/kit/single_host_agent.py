"""A worker process of the single-host SQLite tests: several runs at once on one file.

    python tests/kit/single_host_agent.py DB WORKER RUNS SIDE_FILE work|hold=W1,W2,...|after=W

The worker drives ``RUNS`` runs at once (``<WORKER>-0`` ...) on the SQLite database
``DB``, each the agent of ``kit/kill_agent.py`` (slow tools, an action that must never run
twice), noting every tool execution in ``SIDE_FILE``. With ``hold=W1,W2,...``, once every
run of those workers (itself among them) has executed a tool, so that all of them are
under way, it takes SQLite's write lock on a connection of its own
(``BEGIN IMMEDIATE``), notes ``holding <WORKER>`` and stops itself (``SIGSTOP``): the
worst moment for a process to hang, since every other process's writes now wait. Once
continued, it lets the lock go and finishes its runs. With ``hold=...`` or ``after=W``,
no run records before ``holding`` (of itself or of ``W``) is noted: however the
processes are scheduled, every run still has writes to make when the lock is taken. It
prints one JSON object: each run's stop reason, or the error that ended it.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import sys
import threading
from functools import partial
from pathlib import Path

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import anyio

from kit import child_agent, kill_agent
from polyloop import PolyLoopError, run


async def _noted(side_file: str, line: str) -> None:
    """Until ``line`` is noted in ``side_file``."""
    path = anyio.Path(side_file)
    while not (await path.exists() and line in (await path.read_text()).splitlines()):  # noqa: ASYNC110
        await anyio.sleep(0.02)


async def _ran_a_tool(side_file: str, run_ids: list[str]) -> None:
    """Until every one of ``run_ids`` has executed a tool (noted in ``side_file``)."""
    path = anyio.Path(side_file)
    with anyio.fail_after(30):
        while True:
            noted = (await path.read_text()) if await path.exists() else ""
            if all(f" {run_id}:" in noted for run_id in run_ids):
                return
            await anyio.sleep(0.02)


def _hold_the_write_lock_and_stop(db: str, side_file: str, worker: str) -> None:
    conn = sqlite3.connect(db, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        child_agent.append_synced(side_file, f"holding {worker}")
        # Stops this very thread before it goes on: a signal sent to the process may be
        # taken by another thread, and this one would let the lock go before it stops.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def main(
    db: str, worker: str, runs: int, side_file: str, hold: list[str], holder: str | None
) -> None:
    store = child_agent.open_store(f"sqlite:{db}")
    gate = partial(_noted, side_file, f"holding {holder}") if holder else None
    run_ids = [f"{worker}-{i}" for i in range(runs)]
    busy = [f"{other}-{i}" for other in hold for i in range(runs)]
    outcomes: dict[str, str] = {}

    async def drive(run_id: str) -> None:
        try:
            result = await run(*kill_agent.build(store, run_id, side_file, gate))
        except PolyLoopError as exc:
            outcomes[run_id] = f"{type(exc).__name__}: {exc}"
        else:
            outcomes[run_id] = result.stop_reason.value

    try:
        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(drive, run_id)
            if hold:
                await _ran_a_tool(side_file, busy)
                await anyio.to_thread.run_sync(_hold_the_write_lock_and_stop, db, side_file, worker)
    finally:
        await store.aclose()  # type: ignore[attr-defined]
    print(json.dumps(outcomes), flush=True)


if __name__ == "__main__":
    db, worker, runs, side_file, mode = sys.argv[1:6]
    hold = mode.removeprefix("hold=").split(",") if mode.startswith("hold=") else []
    holder = worker if hold else mode.removeprefix("after=") if mode.startswith("after=") else None
    anyio.run(main, db, worker, int(runs), side_file, hold, holder)
