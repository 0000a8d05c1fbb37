"""``polyloop worker MODULE:ATTR``: a process of its own drives the runs other processes
start and answer, drains on SIGTERM at a step boundary, and says what is wrong with a
target in one line."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import worker_process
from kit.hosting import eventually
from kit.worker_process import STORES, WorkerApp
from polyloop import RunEnded, RunStarted, RunState, StepRecord, StopReason, Verdict, run_status
from polyloop.cli import main
from polyloop.session._draining import DETAIL

TESTS = Path(__file__).resolve().parent.parent


@pytest.fixture(params=STORES)
def apps(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., WorkerApp]]:
    with worker_process.apps(request, tmp_path) as make:
        yield make


async def _state(store: Any, run_id: str) -> RunState:
    return (await run_status(store, run_id)).state


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_worker_drives_a_started_run_on_after_an_approval_from_another_process(
    apps: Callable[..., WorkerApp], anyio_backend: str
) -> None:
    app = apps(WORKER_APPROVAL="1")
    async with app.store() as store:
        await app.agent(store).start("r1", {})
        worker = app.worker(backend=anyio_backend)
        await eventually(
            lambda: _is(store, "r1", RunState.AWAITING_APPROVAL),
            timeout_s=30,
            what="r1 waiting for approval",
        )
        began = time.monotonic()
        approved = await app.polyloop("approve", app.settings.store, "r1", "--by", "ann")
        assert approved.returncode == 0, approved.stderr
        await eventually(
            lambda: _is(store, "r1", RunState.FINISHED), timeout_s=30, what="r1 going on"
        )
        command_s = time.monotonic() - began
        records = (await store.read_log("r1")).records
        await worker.stop()
    # From the verdict's record to the run's end record, both stamped when written.
    [verdict] = [record for record in records if isinstance(record, Verdict)]
    assert isinstance(records[-1], RunEnded)
    assert verdict.at is not None and records[-1].at is not None
    took = (records[-1].at - verdict.at).total_seconds()
    print(
        f"\n{app.settings.store.split(':')[0]}, {anyio_backend}: approval written -> run "
        f"finished {took:.3f} s; approve command started -> finished seen {command_s:.3f} s "
        "(worker polling every 0.1 s)"
    )
    assert took < 10.0  # about the poll interval; generous for a loaded machine
    assert [(entry.what, entry.pid) for entry in app.entries()] == [
        ("entered", worker.pid),
        ("paid", worker.pid),
    ]
    assert app.paid() == ["r1:0:action"]
    said = worker.said()
    of_run = [(facts["event"], facts.get("why")) for facts in said if facts["run_id"] == "r1"]
    assert of_run == [
        ("driving", "new"),
        ("stopped", None),
        ("driving", "approved"),
        ("stopped", None),
    ]
    assert said[-1]["event"] == "draining"


async def _is(store: Any, run_id: str, state: RunState) -> bool:
    return await _state(store, run_id) is state


@pytest.mark.slow
@pytest.mark.anyio
async def test_sigterm_while_runs_are_mid_tool_records_every_step_and_the_next_worker_goes_on(
    apps: Callable[..., WorkerApp], anyio_backend: str
) -> None:
    app = apps(gated=True)
    runs = [f"r{index}" for index in range(4)]
    async with app.store() as store:
        agent = app.agent(store)
        for run_id in runs:
            await agent.start(run_id, {})
        # Three runs pay at once; the fourth waits for a free slot.
        worker = app.worker("--concurrency", "3", backend=anyio_backend)
        await eventually(
            lambda: len(app.entries("entered")) == 3, timeout_s=30, what="three payments starting"
        )
        worker.signal(signal.SIGTERM)
        await anyio.sleep(0.5)
        assert not worker.ended()  # no payment is ever cut in half
        app.gate.touch()
        assert await worker.exit_status() == 0, worker.stderr()
        assert "draining" in worker.stderr()
        paying = {entry.run_id for entry in app.entries("entered")}
        assert len(paying) == 3  # nothing new was claimed while draining
        for run_id in runs:
            records = (await store.read_log(run_id)).records
            stored = await store.describe_run(run_id)
            assert stored is not None and not stored.claimed  # the claim was given up
            assert await _state(store, run_id) is RunState.RESUMABLE
            if run_id not in paying:
                assert [type(record) for record in records] == [RunStarted]
                assert worker.of(run_id) == []
                continue
            # The running step was recorded, then the run ended at the step boundary.
            assert isinstance(records[-2], StepRecord) and records[-2].step == 0
            assert isinstance(records[-1], RunEnded)
            assert (records[-1].stop_reason, records[-1].detail) == (StopReason.CANCELLED, DETAIL)
            stopped = worker.of(run_id, "stopped")
            assert [facts["stop_reason"] for facts in stopped] == ["cancelled"]
        second = app.worker(backend=anyio_backend)
        for run_id in runs:
            await eventually(
                lambda r=run_id: _is(store, r, RunState.FINISHED),  # type: ignore[misc]
                timeout_s=30,
                what=f"the next worker finishing {run_id}",
            )
        await second.stop()
    assert sorted(app.paid()) == sorted(f"{run_id}:0:action" for run_id in runs)
    assert {entry.pid for entry in app.entries() if entry.run_id in paying} == {worker.pid}
    for run_id in runs:
        why = "new" if run_id not in paying else "interrupted"
        assert [facts["why"] for facts in second.of(run_id, "driving")] == [why]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon", "expected MODULE:ATTR"),
        ("kit.no_such_module:agents", "cannot import 'kit.no_such_module'"),
        ("kit.worker_app:nothing", "has no attribute 'nothing'"),
        ("kit.worker_app:VOID", "is str: expected an Agent"),
        ("os:getcwd", "'os:getcwd' returned str: expected an Agent"),
    ],
)
def test_a_target_it_cannot_host_is_one_line_and_status_1(
    target: str, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("WORKER_LEDGER", os.devnull)
    status = main(["worker", target])
    err = capsys.readouterr().err
    assert status == 1
    assert len(err.splitlines()) == 1
    assert message in err
    assert "Traceback" not in err
