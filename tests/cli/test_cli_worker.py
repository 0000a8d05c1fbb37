"""``polyloop worker MODULE:ATTR``: a process of its own drives the runs other processes
start and answer, drains on SIGTERM at a step boundary, and says what is wrong with a
target in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import worker_app
from polyloop import RunEnded, RunState, StepRecord, StopReason, run_status
from polyloop.cli import main
from polyloop.session._draining import DETAIL
from polyloop.stores import SqliteStore

TESTS = Path(__file__).resolve().parent.parent
SOURCE = TESTS.parent / "src"


class App:
    """The files of one worker application: its database, ledger and gate."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.db, self.ledger, self.gate = (tmp_path / n for n in ("runs.db", "ledger", "gate"))
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SOURCE), str(TESTS)]),
            "WORKER_DB": str(self.db),
            "WORKER_LEDGER": str(self.ledger),
            **env,
        }

    def worker(self) -> subprocess.Popen[str]:
        command = ["worker", "kit.worker_app:lifespan", "--poll-s", "0.1", "--json"]
        return subprocess.Popen(
            [sys.executable, "-m", "polyloop", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )

    def polyloop(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "polyloop", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env,
        )

    def start(self, run_id: str) -> None:
        anyio.run(self._in_env, self._start, run_id)

    def state(self, run_id: str) -> RunState:
        return anyio.run(self._in_env, self._state, run_id)  # type: ignore[no-any-return]

    def records(self, run_id: str) -> tuple[Any, ...]:
        return anyio.run(self._in_env, self._records, run_id)  # type: ignore[no-any-return]

    def lines(self) -> list[str]:
        return self.ledger.read_text().splitlines() if self.ledger.exists() else []

    async def _in_env(self, call: Callable[..., Any], *args: Any) -> Any:
        saved = dict(os.environ)
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("WORKER_")})
        try:
            async with SqliteStore(self.db) as store:
                return await call(store, *args)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    @staticmethod
    async def _start(store: Any, run_id: str) -> None:
        await worker_app.agent(store).start(run_id, {})

    @staticmethod
    async def _state(store: Any, run_id: str) -> RunState:
        return (await run_status(store, run_id)).state

    @staticmethod
    async def _records(store: Any, run_id: str) -> tuple[Any, ...]:
        return (await store.read_log(run_id)).records


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> float:
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - began


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[str]]]:
    """Worker processes to end by their pid, should a test fail before it does."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
            child.wait()


def _stop(child: subprocess.Popen[str]) -> tuple[str, str]:
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err
    return out, err


@pytest.mark.slow
def test_a_worker_drives_a_started_run_on_after_an_approval_from_another_process(
    tmp_path: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    app = App(tmp_path, WORKER_APPROVAL="1")
    app.start("r1")
    worker = app.worker()
    stopped.append(worker)
    _until(lambda: app.state("r1") is RunState.AWAITING_APPROVAL, "r1 waiting for approval")
    approved = app.polyloop("approve", f"sqlite:{app.db}", "r1", "--by", "ann")
    assert approved.returncode == 0, approved.stderr
    took = _until(lambda: app.state("r1") is RunState.FINISHED, "r1 going on")
    assert took < 15.0  # about the poll interval; generous for a loaded machine
    out, _ = _stop(worker)
    assert app.lines() == ["entered r1:0:action", "r1:0:action"]
    said = [json.loads(line) for line in out.splitlines()]
    of_run = [(facts["event"], facts.get("why")) for facts in said if facts["run_id"] == "r1"]
    assert of_run == [
        ("driving", "new"),
        ("stopped", None),
        ("driving", "approved"),
        ("stopped", None),
    ]
    assert said[-1]["event"] == "draining"


@pytest.mark.slow
def test_sigterm_while_a_tool_runs_lets_it_finish_and_the_next_worker_goes_on(
    tmp_path: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    app = App(tmp_path, WORKER_GATE=str(tmp_path / "gate"))
    app.start("r1")
    worker = app.worker()
    stopped.append(worker)
    _until(lambda: "entered r1:0:action" in app.lines(), "the payment starting")
    worker.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert worker.poll() is None  # the payment is never cut in half
    app.gate.touch()
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    assert "draining" in err
    records = app.records("r1")
    assert isinstance(records[-2], StepRecord) and records[-2].step == 0
    assert isinstance(records[-1], RunEnded)
    assert (records[-1].stop_reason, records[-1].detail) == (StopReason.CANCELLED, DETAIL)
    assert app.state("r1") is RunState.RESUMABLE  # the claim was given up
    second = app.worker()
    stopped.append(second)
    _until(lambda: app.state("r1") is RunState.FINISHED, "the next worker finishing r1")
    _stop(second)
    assert app.lines() == ["entered r1:0:action", "r1:0:action"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon", "expected MODULE:ATTR"),
        ("kit.no_such_module:agents", "cannot import 'kit.no_such_module'"),
        ("kit.worker_app:nothing", "has no attribute 'nothing'"),
        ("kit.worker_app:SCRIPT", "is list: expected an Agent"),
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
