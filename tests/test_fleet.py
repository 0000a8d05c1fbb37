"""A fleet of ``polyloop worker`` processes on one PostgreSQL database, one killed mid-payment.

The fleet is ``examples/fleet_worker.py``: its ``start`` command starts one run per
invoice, and ``polyloop worker fleet_worker:agents`` processes drive them, each run
paying its invoice once with ``pay`` (replay ``NEVER``, with a probe; every payment is a
row of a ledger outside the store, keyed by its result id). The worker that makes the
tenth payment is SIGKILLed right after it, so at least one of its runs dies inside
``pay``; a new worker is started in its place.

The test reads the store, the ledger and the workers' own lines back, and checks the
promises: every run ends once, ``submitted``; no invoice is paid twice; every run the
dead worker left is driven on by another worker, those it left inside ``pay`` settled by
the probe (which tells the truth: "ran" exactly where the payment went out), and no run
waits for a person.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from polyloop import RunEnded, RunState, Settlement, StepRecord, StopReason, run_status
from polyloop.stores import PostgresStore

# Slow: a fleet of worker processes, one of them killed.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
JOBS, WORKERS, KILL_AFTER = 200, 4, 10
SCHEMA = "fleet"


class Fleet:
    """The example's processes on one database: ``start``, and the workers."""

    def __init__(self, conninfo: str, backend: str) -> None:
        self.conninfo, self.backend = conninfo, backend
        self.env = {
            **os.environ,
            "POLYLOOP_TEST_POSTGRES": conninfo,
            "FLEET_SCHEMA": SCHEMA,
            "PYTHONPATH": str(ROOT / "src"),
        }
        self.workers: list[subprocess.Popen[str]] = []
        self._conn: psycopg.Connection[Any] | None = None

    def start(self, jobs: int) -> str:
        done = subprocess.run(
            [sys.executable, "fleet_worker.py", "start", "--jobs", str(jobs)],
            cwd=EXAMPLES,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def worker(self) -> subprocess.Popen[str]:
        command = ["--backend", self.backend, "worker", "fleet_worker:agents", "--json"]
        child = subprocess.Popen(
            [sys.executable, "-m", "polyloop", *command, "--concurrency", "16", "--poll-s", "0.1"],
            cwd=EXAMPLES,  # the worker imports its target with the current directory on the path
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.workers.append(child)
        return child

    def ledger(self) -> list[tuple[str, str, int, bool, int]]:
        """Every row of the example's ledger: result id, invoice, cents, voided, pid."""
        if self._conn is None:
            self._conn = psycopg.connect(self.conninfo, autocommit=True)
        query = f"SELECT result_id, invoice, cents, voided, pid FROM {SCHEMA}_app.payments"
        return list(self._conn.execute(query))

    def close(self) -> None:
        for child in self.workers:
            if child.poll() is None:
                child.kill()
                child.wait()
        if self._conn is not None:
            self._conn.close()


@pytest.fixture(params=["asyncio", "trio"])
def fleet(request: pytest.FixtureRequest, postgres_conninfo: str) -> Iterator[Fleet]:
    """The fleet on a database of its own; its workers killed should the test fail."""
    started = Fleet(postgres_conninfo, request.param)
    yield started
    started.close()


def _until(
    check: Callable[[], bool], what: str, *, every_s: float, timeout_s: float = 120.0
) -> None:
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(every_s)


def _said(child: subprocess.Popen[str]) -> tuple[list[dict[str, Any]], str]:
    """The lines a worker printed (a last line a kill cut short left out), once it ended,
    and what it said on stderr."""
    out, err = child.communicate(timeout=60)
    lines = out.splitlines()
    if lines and not out.endswith("\n"):
        lines.pop()
    return [json.loads(line) for line in lines], err


async def _unfinished(conninfo: str) -> int:
    async with PostgresStore(conninfo, schema=SCHEMA, create=False) as store:
        return len(await store.list_runs(unfinished_only=True))


async def _read(conninfo: str) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    async with PostgresStore(conninfo, schema=SCHEMA, create=False) as store:
        return {
            run.run_id: (
                await run_status(store, run.run_id),
                (await store.read_log(run.run_id)).records,
            )
            for run in await store.list_runs()
        }


def test_workers_share_the_runs_and_a_killed_worker_s_runs_go_on_with_no_payment_twice(
    fleet: Fleet,
) -> None:
    assert fleet.start(JOBS) == f"started {JOBS} invoices in schema {SCHEMA}\n"
    for _ in range(WORKERS):
        fleet.worker()
    # Right after a payment its run waits for the bank inside pay: kill that worker then.
    _until(lambda: len(fleet.ledger()) >= KILL_AFTER, f"{KILL_AFTER} payments", every_s=0.005)
    pid = fleet.ledger()[-1][4]
    (victim,) = [child for child in fleet.workers if child.pid == pid]
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    fleet.worker()  # its replacement
    _until(lambda: anyio.run(_unfinished, fleet.conninfo) == 0, "every run ending", every_s=0.1)
    took = time.monotonic() - killed_at
    said = {pid: _said(victim)[0]}
    assert victim.returncode == -signal.SIGKILL
    for child in fleet.workers:
        if child is not victim:
            child.send_signal(signal.SIGTERM)
            said[child.pid], err = _said(child)
            assert child.returncode == 0, err

    # The dead worker's runs: those it started driving and never said it stopped.
    by_victim = [facts for facts in said[pid] if facts.get("run_id")]
    driven = {facts["run_id"] for facts in by_victim if facts["event"] == "driving"}
    left = driven - {facts["run_id"] for facts in by_victim if facts["event"] == "stopped"}
    assert left, "the kill landed after the dead worker's last run"
    # Every one was driven on by another worker, for why run_status gave.
    taken: dict[str, str] = {}
    for other, lines in said.items():
        for facts in lines:
            if other != pid and facts["event"] == "driving" and facts["run_id"] in left:
                taken[facts["run_id"]] = facts["why"]
    # (A run the kill caught between its end record and its "stopped" line is finished.)
    assert taken and set(taken) <= left
    # Killed inside pay, or elsewhere in a step, or before it wrote anything of the run.
    assert set(taken.values()) <= {"probe", "interrupted", "new"}

    runs = anyio.run(_read, fleet.conninfo)
    assert len(runs) == JOBS
    ledger = fleet.ledger()
    paid = Counter(invoice for _, invoice, _, voided, _ in ledger if not voided)
    voided = {result_id for result_id, _, _, was_voided, _ in ledger if was_voided}
    assert paid == dict.fromkeys(runs, 1)  # every invoice paid once, by whichever worker
    settled: dict[str, Settlement] = {}
    for run_id, (status, records) in runs.items():
        assert (status.state, status.stop_reason) == (RunState.FINISHED, StopReason.SUBMITTED)
        assert sum(isinstance(record, RunEnded) for record in records) == 1, run_id
        settlements = [record for record in records if isinstance(record, Settlement)]
        if settlements:
            (settled[run_id],) = settlements
    # The probe settled exactly the runs the kill left inside pay, and only the dead
    # worker's; a worker drove each on because of it.
    assert settled, "the kill landed outside pay"
    assert set(settled) <= left
    assert {run_id for run_id, why in taken.items() if why == "probe"} == set(settled)
    for run_id, settlement in settled.items():
        status, records = runs[run_id]
        key = f"{run_id}:0:action"
        assert settlement.by == "reconcile:pay" and settlement.result_id == key
        assert status.reconciled_steps == (0,)
        # It told the truth: ran where the payment went out, else the key is void for
        # good and the model paid again under the next step's key.
        assert settlement.ran is (key not in voided), run_id
        steps = [record for record in records if isinstance(record, StepRecord)]
        assert len(steps) == (1 if settlement.ran else 2), run_id
    assert voided <= {f"{run_id}:0:action" for run_id in settled}
    print(
        f"\n[{fleet.backend}] {len(left)} runs of the killed worker, {len(settled)} inside pay "
        f"({sum(s.ran for s in settled.values())} had paid); every run finished "
        f"{took:.2f} s after the kill"
    )
