"""A fleet of worker processes on one PostgreSQL database, one of them killed mid-flight.

The fleet is ``examples/fleet_worker.py``, imported by path: worker processes share the
runs of one store schema, one run per invoice (check it, then ``pay``, whose replay is
``NEVER`` and whose every execution is a row of a ledger table outside the store).
Worker 0 is SIGKILLed right after one of its payments, once it has paid a third of its
invoices, then restarted; ``recover``, in the restarted process or in a survivor, resumes
what it left. The example reports what it saw; this test reads the store and the ledger
back itself and checks the promises: every run ends exactly once, no ``NEVER`` effect
runs twice, the runs killed inside ``pay`` end ``IN_DOUBT`` and no other run does, and
every run the dead worker left unfinished is resumed through ``recover``.

The same fleet with a probe on ``pay`` (the example's ``--probe``: the ledger gets a
unique key on the result id, and the probe finds the payment or writes a tombstone for
its key) leaves no run in doubt: the runs killed inside ``pay`` are settled by the probe,
still with no invoice paid twice, and every log verifies.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import anyio.to_thread
import pytest

from kit import pg
from polyloop import Replay, RunEnded, RunState, Settlement, StepRecord, StopReason, run_status
from polyloop.cli import main as polyloop_command
from polyloop.stores import PostgresStore

# Slow: a fleet of worker processes, one of them killed.
pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fleet_worker.py"
SCHEMA = "fleet"
JOBS, WORKERS = 400, 4


@pytest.fixture(scope="module")
def fleet() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("fleet_worker_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.anyio
async def test_four_workers_share_400_runs_and_a_killed_workers_runs_are_recovered(
    fleet: ModuleType, postgres_conninfo: str, anyio_backend: str
) -> None:
    settings = fleet.Settings(
        postgres_conninfo, SCHEMA, jobs=JOBS, workers=WORKERS, concurrency=16, backend=anyio_backend
    )
    report = await fleet.run_fleet(settings, kill=True)  # the database goes with the test

    # The kill landed mid-flight: runs were in progress, one at least inside pay.
    assert report.victim == 0
    orphans, inside_pay = set(report.orphans), set(report.inside_pay)
    assert inside_pay, "the kill landed outside pay"
    assert inside_pay <= orphans
    # The restarted worker ran to its end (workers that fail make run_fleet raise).
    assert 0 in {summary.slot for summary in report.summaries}

    app = await anyio.to_thread.run_sync(fleet.AppTables, postgres_conninfo, SCHEMA)
    try:
        jobs = await anyio.to_thread.run_sync(app.jobs)
        payments = await anyio.to_thread.run_sync(app.payment_counts)
    finally:
        app.close()
    assert len(jobs) == JOBS
    victims_runs = {run_id for run_id, job in jobs.items() if job.slot == 0}
    assert orphans <= victims_runs

    def pay_result(run_id: str) -> str:
        return f"{run_id}:{fleet.PAY_STEP}:action"

    in_doubt: set[str] = set()
    async with PostgresStore(postgres_conninfo, schema=SCHEMA) as store:
        listed = await store.list_runs()
        assert sorted(run.run_id for run in listed) == sorted(jobs)
        # A run in doubt waits for a person to settle it: listed as unfinished.
        unfinished = {run.run_id for run in await store.list_runs(unfinished_only=True)}
        for run in listed:
            log = await store.read_log(run.run_id)
            ends = [record for record in log.records if isinstance(record, RunEnded)]
            assert len(ends) == 1 and log.records[-1] == ends[0], (
                f"{run.run_id} ended {len(ends)} times"
            )
            assert ends[0].is_final or ends[0].stop_reason is StopReason.IN_DOUBT
            status = await run_status(store, run.run_id)
            if status.state is RunState.IN_DOUBT:
                in_doubt.add(run.run_id)
                assert status.stop_reason is StopReason.IN_DOUBT
                assert status.open_intent is not None
                assert status.open_intent.replay is Replay.NEVER
                assert status.open_intent.result_id == pay_result(run.run_id)
                assert status.steps == 1  # the check; pay is the effect in doubt
            else:
                assert status.state is RunState.FINISHED, run.run_id
                assert (status.stop_reason, status.steps) == (StopReason.SUBMITTED, 2)

    # No NEVER effect ran twice, in any process; every submitted run paid exactly once.
    assert max(payments.values()) == 1, [rid for rid, n in payments.items() if n > 1]
    assert set(payments) <= {pay_result(run_id) for run_id in jobs}
    for run_id in set(jobs) - in_doubt:
        assert payments[pay_result(run_id)] == 1, run_id

    # The runs killed inside pay, and only they, are in doubt, and unfinished.
    assert in_doubt == inside_pay == unfinished

    # Every run the dead worker left unfinished was resumed through recover().
    recoveries = report.recoveries()
    assert sum(recovery.runs for recovery in recoveries) == len(orphans)
    recovered = {
        run_id
        for summary in report.summaries
        for run_id in summary.at_start.recovered + summary.at_end.recovered
    }
    assert orphans <= recovered
    print(
        f"\n[{anyio_backend}] recovery of {len(orphans)} runs of the killed worker "
        f"({len(inside_pay)} inside pay): "
        + ", ".join(f"{r.runs} by {r.who} in {r.seconds:.2f} s" for r in recoveries)
        + f"; all ended {report.recovery_s():.2f} s after the kill"
    )


# -- the example as a program ---------------------------------------------------------------


def _run_example(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, (
        f"fleet_worker.py {' '.join(args)} exited {done.returncode}\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done.stdout


def _schemas(conninfo: str) -> set[str]:
    with pg.admin(conninfo) as conn:
        rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'fleet%'")
        return {name for (name,) in rows}


def test_the_example_kills_a_worker_recovers_its_runs_and_cleans_up(
    postgres_conninfo: str,
) -> None:
    out = _run_example(
        "fleet",
        "--conninfo",
        postgres_conninfo,
        "--jobs",
        "24",
        "--workers",
        "3",
        "--concurrency",
        "4",
        "--kill",
    )
    lines = out.splitlines()
    header = re.fullmatch(
        r"fleet (fleet_[0-9a-f]{8}): 24 invoices, 3 worker processes, "
        r"up to 4 runs at once in each",
        lines[0],
    )
    assert header is not None, out
    killed = re.fullmatch(
        r"  worker 0 killed \(SIGKILL\) after (\d+) payments: (\d+) runs "
        r"left unfinished, (\d+) of them inside 'pay'",
        lines[1],
    )
    assert killed is not None, out
    orphans, inside_pay = int(killed.group(2)), int(killed.group(3))
    assert orphans >= inside_pay >= 1
    resumed = re.fullmatch(
        r"  recover\(\) resumed them: (.+); all ended \d+\.\d\d s after "
        r"the kill",
        lines[2],
    )
    assert resumed is not None, out
    # One "N in <which worker> <which call> (<how long>)" per recover() call that took some.
    calls = [
        re.fullmatch(
            r"(\d+) in (the restarted )?worker \d (at its start|at the end of "
            r"its jobs) \(\d+\.\d\d s\)",
            call,
        )
        for call in resumed.group(1).split(", ")
    ]
    assert all(calls), out
    assert sum(int(call.group(1)) for call in calls if call) == orphans
    assert (
        lines[3] == f"runs: 24 finished ({24 - inside_pay} submitted, {inside_pay} in doubt)"
        ", 0 unfinished"
    )
    assert lines[4] == "  in doubt: exactly the runs killed inside 'pay'"
    assert re.fullmatch(
        rf"payments: \d+ on the ledger, none made twice; in-doubt runs that "
        rf"had paid: \d+ of {inside_pay}",
        lines[5],
    ), out
    assert len(lines) == 6
    assert _schemas(postgres_conninfo) == set()  # both schemas dropped at the end


def test_the_example_without_a_kill_pays_every_invoice_once_and_can_keep_its_tables(
    postgres_conninfo: str,
) -> None:
    # The connection string comes from the environment this time.
    out = _run_example(
        "fleet",
        "--jobs",
        "12",
        "--workers",
        "2",
        "--schema",
        "fleet_kept",
        "--keep",
        "--backend",
        "trio",
        env={**os.environ, "POLYLOOP_TEST_POSTGRES": postgres_conninfo},
    )
    assert out.splitlines() == [
        "fleet fleet_kept: 12 invoices, 2 worker processes, up to 16 runs at once in each",
        "runs: 12 finished (12 submitted, 0 in doubt), 0 unfinished",
        "payments: 12 on the ledger, none made twice",
        "kept the schemas fleet_kept and fleet_kept_app",
    ]
    assert _schemas(postgres_conninfo) == {"fleet_kept", "fleet_kept_app"}
    with pg.admin(postgres_conninfo) as conn:
        assert conn.execute("SELECT count(*) FROM fleet_kept.runs WHERE finished").fetchone() == (
            12,
        )


# -- the same fleet, with a probe on pay ----------------------------------------------------


@pytest.mark.anyio
async def test_with_a_probe_on_pay_no_run_of_a_killed_worker_is_left_in_doubt(
    fleet: ModuleType,
    postgres_conninfo: str,
    anyio_backend: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = fleet.Settings(
        postgres_conninfo,
        SCHEMA,
        jobs=JOBS,
        workers=WORKERS,
        concurrency=16,
        backend=anyio_backend,
        probe=True,
    )
    report = await fleet.run_fleet(settings, kill=True)

    # The kill landed inside pay at least once, so the probe had something to answer.
    assert report.victim == 0
    inside_pay = set(report.inside_pay)
    assert inside_pay, "the kill landed outside pay"

    app = await anyio.to_thread.run_sync(fleet.AppTables, postgres_conninfo, SCHEMA)
    try:
        jobs = await anyio.to_thread.run_sync(app.jobs)
        paid_keys = await anyio.to_thread.run_sync(app.payment_counts)
        paid_invoices = await anyio.to_thread.run_sync(app.invoice_payments)
        voided = await anyio.to_thread.run_sync(app.voided_keys)
    finally:
        app.close()
    assert len(jobs) == JOBS
    victims_runs = {run_id for run_id, job in jobs.items() if job.slot == 0}

    reconciled: dict[str, Settlement] = {}
    async with PostgresStore(postgres_conninfo, schema=SCHEMA) as store:
        assert not await store.list_runs(unfinished_only=True)
        listed = await store.list_runs()
        assert sorted(run.run_id for run in listed) == sorted(jobs)
        for run_id in jobs:
            status = await run_status(store, run_id)
            assert (status.state, status.stop_reason) == (RunState.FINISHED, StopReason.SUBMITTED)
            records = (await store.read_log(run_id)).records
            assert sum(isinstance(record, RunEnded) for record in records) == 1, run_id
            settlements = [record for record in records if isinstance(record, Settlement)]
            if not status.reconciled_steps:
                assert settlements == [], run_id  # nobody else settles anything here
                assert status.steps == 2, run_id  # check, pay
                continue
            assert status.reconciled_steps == (fleet.PAY_STEP,), run_id
            (settlement,) = settlements
            assert settlement.by == "reconcile:pay" and settlement.by_probe
            assert settlement.result_id == fleet.pay_key(run_id)
            (step,) = [r for r in records if isinstance(r, StepRecord) and r.step == fleet.PAY_STEP]
            assert step.settled_by is not None and step.settled_by.startswith("reconcile:")
            # Paid: the run ends on the probe's observation. Voided: it pays again.
            assert status.steps == (3 if fleet.pay_key(run_id) in voided else 2), run_id
            reconciled[run_id] = settlement

    # The runs killed inside pay were settled by the probe, and only the victim's were.
    assert inside_pay <= set(reconciled) <= victims_runs
    # The probe told the truth: "ran" exactly where the key was paid, "did not" where it
    # wrote the tombstone that now keeps that key from ever paying.
    for run_id, settlement in reconciled.items():
        key = fleet.pay_key(run_id)
        assert settlement.ran == (paid_keys[key] == 1) == (key not in voided), run_id
        if settlement.ran:
            assert settlement.observation == fleet.paid_text(jobs[run_id].amount_cents)
    assert voided <= {fleet.pay_key(run_id) for run_id in reconciled}

    # No effect twice: every invoice paid exactly once, tombstones not counted.
    assert paid_invoices == dict.fromkeys(jobs, 1)
    assert sum(paid_keys.values()) == JOBS

    # Every log verifies, as the command line checks it.
    verified = await anyio.to_thread.run_sync(
        polyloop_command, ["verify", postgres_conninfo, "--schema", SCHEMA]
    )
    out = capsys.readouterr().out
    assert verified == 0, out
    assert f"{JOBS} runs checked: {JOBS} clean, 0 with warnings, 0 with errors" in out

    # The example's own report says the same.
    assert report.problems() == []
    paid_before = sum(1 for settlement in reconciled.values() if settlement.ran)
    fleet.print_report(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == [
        f"runs: {JOBS} finished ({JOBS} submitted, 0 in doubt), 0 unfinished",
        f"  settled by the probe: {len(reconciled)} runs ({paid_before} had paid, "
        f"{len(reconciled) - paid_before} had not: paid again)",
        f"payments: {JOBS} on the ledger, none made twice",
    ]
    with capsys.disabled():
        print(
            f"\n[{anyio_backend}] with a probe: {len(report.orphans)} runs of the killed "
            f"worker left unfinished, {len(inside_pay)} inside pay; {len(reconciled)} settled "
            f"by the probe ({paid_before} had paid, {len(reconciled) - paid_before} had not); "
            "0 in doubt"
        )
