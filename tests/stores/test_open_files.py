"""Open files: many runs at once under a low open-file limit, and the error at the limit.

Each case runs a child process (``kit/open_files_agent.py``) that lowers its own
``RLIMIT_NOFILE`` before it opens the store, so the limit applies to nothing but the
child. A store holds no file or connection per claimed run (research record 0027), so
many times more runs than the limit complete at once; when a store does meet the limit,
the error names the limit and what to do, and the run is not lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

CHILD = Path(__file__).resolve().parents[1] / "kit" / "open_files_agent.py"
LIMIT = 128
RUNS = 1_000  # about eight times the limit
BACKENDS = ("asyncio", "trio")
LIMIT_TEXT = "the process's open-file limit, RLIMIT_NOFILE = {}"


def _child(spec: str, backend: str, limit: int, mode: str, argument: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(CHILD), spec, backend, str(limit), mode, argument],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _spec(kind: str, tmp_path: Path, conninfo: str | None) -> str:
    if kind == "jsonl":
        return f"jsonl:{tmp_path / 'runs'}"
    if kind == "sqlite":
        return f"sqlite:{tmp_path / 'runs.sqlite'}"
    assert conninfo is not None
    return conninfo


@pytest.fixture(params=["jsonl", "sqlite", "postgres"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    conninfo = request.getfixturevalue("postgres_conninfo") if request.param == "postgres" else None
    return _spec(request.param, tmp_path, conninfo)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_many_times_the_open_file_limit_complete_at_once(
    store_spec: str, backend: str
) -> None:
    outcome = _child(store_spec, backend, LIMIT, "many", str(RUNS))
    assert outcome["errors"] == []
    assert outcome["completed"] == RUNS
    assert outcome["peak_fds"] < LIMIT // 2  # bounded, not grown with the runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_that_meets_the_limit_mid_run_says_so_and_resumes(
    tmp_path: Path, backend: str
) -> None:
    """A run file is opened for each write, so the limit can be met mid-run there: the
    error names the run, the limit and the remedy, and a resume finishes the run."""
    run_id = f"limit-{uuid.uuid4().hex[:8]}"
    outcome = _child(_spec("jsonl", tmp_path, None), backend, 64, "exhaust", run_id)
    assert outcome["error"] is not None
    assert run_id in outcome["error"]
    assert LIMIT_TEXT.format(64) in outcome["error"]
    assert "ulimit -n" in outcome["error"]
    assert outcome["resumed"] is True
    assert outcome["stop_reason"] == "submitted" and outcome["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_store_that_meets_the_limit_when_it_opens_says_so_and_runs_later(
    store_spec: str, backend: str
) -> None:
    """The database stores open their connections (and the file store its lock file) at
    the first claim: met there, the limit is named, nothing is written, and the same
    store object runs the run once descriptors are free again."""
    run_id = f"limit-{uuid.uuid4().hex[:8]}"
    outcome = _child(store_spec, backend, 64, "exhaust-first", run_id)
    assert outcome["error"] is not None
    assert run_id in outcome["error"]
    assert LIMIT_TEXT.format(64) in outcome["error"]
    assert "ulimit -n" in outcome["error"]
    assert outcome["resumed"] is False
    assert outcome["stop_reason"] == "submitted" and outcome["steps"] == 2
