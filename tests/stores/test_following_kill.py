"""Following a run across a real crash: a follower in its own process sees every record of
a run whose worker is SIGKILLed mid-run and resumed by another, in order, with no gap and
no duplicate, though it drops its stream every few records and calls again with the last
position it saw (docs/following.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest

from kit import child_agent
from polyloop import RunEnded, serialization

# Slow: child processes, one of them killed with SIGKILL mid-run.
pytestmark = pytest.mark.slow

KIT = Path(__file__).resolve().parents[1] / "kit"
WORKER, FOLLOWER = KIT / "kill_agent.py", KIT / "follow_agent.py"


def _spawn(script: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(script), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _specs(tmp_path: Path, postgres_conninfo: str) -> dict[str, str]:
    return {
        "jsonl": f"jsonl:{tmp_path / 'jsonl'}",
        "sqlite": f"sqlite:{tmp_path / 'runs.db'}",
        "postgresql": postgres_conninfo,
    }


def _kill_after_tools(spec: str, run_id: str, side: Path, tools: int) -> None:
    """Start the run in a worker process and SIGKILL it once ``tools`` tools started."""
    worker = _spawn(WORKER, spec, run_id, "run", str(side))
    deadline = time.monotonic() + 60
    while len(side.read_text().splitlines() if side.exists() else []) < tools:
        assert worker.poll() is None, "the worker ended before it could be killed"
        assert time.monotonic() < deadline, "the worker made no progress"
        time.sleep(0.002)
    os.kill(worker.pid, signal.SIGKILL)
    worker.communicate(timeout=30)
    assert worker.returncode == -signal.SIGKILL


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["jsonl", "sqlite", "postgresql"])
def test_a_follower_in_another_process_sees_a_killed_and_resumed_run_whole(
    kind: str, backend: str, tmp_path: Path, postgres_conninfo: str
) -> None:
    spec = _specs(tmp_path, postgres_conninfo)[kind]
    run_id, side, out = f"followed-{uuid.uuid4().hex[:8]}", tmp_path / "side", tmp_path / "out"
    follower = _spawn(FOLLOWER, spec, run_id, str(out), backend)  # before the run exists
    _kill_after_tools(spec, run_id, side, tools=3)
    resumer = _spawn(WORKER, spec, run_id, "resume", str(side))
    _, err = resumer.communicate(timeout=120)
    assert resumer.returncode == 0, err
    _, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err

    seen = [line.split("\t", 1) for line in out.read_text(encoding="utf-8").splitlines()]
    logged = anyio.run(_read_log, spec, run_id)
    assert [int(position) for position, _ in seen] == list(range(1, len(logged) + 1))
    assert [text for _, text in seen] == [serialization.dumps(r) for r in logged]
    assert sum(isinstance(r, RunEnded) for r in logged) == 1  # the kill left no end record


async def _read_log(spec: str, run_id: str) -> tuple[object, ...]:
    store = child_agent.open_store(spec)
    try:
        return (await store.read_log(run_id)).records
    finally:
        await store.aclose()  # type: ignore[attr-defined]
