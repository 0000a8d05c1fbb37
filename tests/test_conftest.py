"""The ``slow`` marker of ``tests/conftest.py``: plain ``pytest`` leaves the slow tests out
and says so; ``--run-slow`` runs them too."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One fast test (the README check) and several slow ones (the examples run as programs).
FILE = "tests/test_examples.py"


def _collect(*options: str) -> str:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *options, FILE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@functools.cache
def _everything() -> str:
    return _collect("--run-slow")


def _ids(out: str) -> list[str]:
    return [line for line in out.splitlines() if "::" in line]


def test_plain_pytest_leaves_the_slow_tests_out_and_says_how_many() -> None:
    everything = _ids(_everything())
    slow = len(everything) - 1
    assert slow >= 5
    out = _collect()
    assert _ids(out) == [
        f"{FILE}::test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second"
    ]
    assert f"1/{slow + 1} tests collected ({slow} deselected)" in out
    assert f"{slow} slow tests were not run; --run-slow includes them" in out


def test_run_slow_runs_them_too() -> None:
    out = _everything()
    assert f"{FILE}::test_the_main_job_runs_the_demo_to_a_submitted_stop" in _ids(out)
    assert "deselected" not in out
    assert "slow tests were not run" not in out
