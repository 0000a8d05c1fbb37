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


def _collect(*options: str, files: tuple[str, ...] = (FILE,)) -> str:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *options, *files],
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


def test_trio_on_a_durable_store_is_slow_and_its_asyncio_sibling_quick() -> None:
    # Both ways a case gets the rule: a store-kind parameter (the first file) and a file
    # about one durable store that takes DURABLE_STORE_BACKENDS (the second).
    files = ("tests/stores/test_untrusted_input_stores.py", "tests/stores/test_power_loss.py")
    slow = _ids(_collect("--run-slow", "-m", "slow", files=files))
    case = f"{files[0]}::test_hostile_run_ids_and_bindings_are_plain_data_on_every_store"
    assert [test_id for test_id in slow if test_id.startswith(files[0])] == [
        f"{case}[trio-{kind}]" for kind in ("jsonl", "sqlite", "postgresql")
    ]
    trio = [test_id for test_id in slow if test_id.startswith(files[1]) and "[trio-" in test_id]
    quick_twins = [t for t in trio if t.replace("[trio-", "[asyncio-") not in slow]
    assert quick_twins, "a file about one durable store keeps its asyncio cases quick"
