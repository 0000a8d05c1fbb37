"""The ``slow`` marker of ``tests/conftest.py``: plain ``pytest`` leaves the slow tests out
and says so; ``--run-slow`` runs them too. Also which cases of a file the rules of
research-wiki/0044 and 0065 make slow."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# One fast test (the README check) and several slow ones (the examples run as programs).
FILE = "tests/test_examples.py"
# A file whose cases take the store kind as a parameter, and one about one durable store
# that takes DURABLE_STORE_BACKENDS; the third samples the stores (kit.store.sampled).
STORE_KIND_FILE = "tests/stores/test_untrusted_input_stores.py"
ONE_STORE_FILE = "tests/stores/test_power_loss.py"
SAMPLED_FILE = "tests/stores/test_offline_replay_stores.py"
FILES = (FILE, STORE_KIND_FILE, ONE_STORE_FILE, SAMPLED_FILE)


def _collect(*options: str) -> str:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *options, *FILES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# Each collection runs once for the module: a child pytest takes a second or more.
@functools.cache
def _everything() -> str:
    return _collect("--run-slow")


@functools.cache
def _quick() -> str:
    return _collect()


def _ids(out: str) -> list[str]:
    return [line for line in out.splitlines() if "::" in line]


def _slow() -> list[str]:
    quick = set(_ids(_quick()))
    return [test_id for test_id in _ids(_everything()) if test_id not in quick]


def test_plain_pytest_leaves_the_slow_tests_out_and_says_how_many() -> None:
    everything, out = _ids(_everything()), _quick()
    assert [test_id for test_id in _ids(out) if test_id.startswith(FILE)] == [
        f"{FILE}::test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second"
    ]
    assert len([test_id for test_id in everything if test_id.startswith(FILE)]) >= 6
    slow, total = len(_slow()), len(everything)
    assert set(_ids(out)) <= set(everything)
    assert f"{total - slow}/{total} tests collected ({slow} deselected)" in out
    assert f"{slow} slow tests were not run; --run-slow includes them" in out


def test_run_slow_runs_them_too() -> None:
    out = _everything()
    assert f"{FILE}::test_the_main_job_runs_the_demo_to_a_submitted_stop" in _ids(out)
    assert "deselected" not in out
    assert "slow tests were not run" not in out


def test_trio_on_a_durable_store_is_slow_and_its_asyncio_sibling_quick() -> None:
    slow = _slow()
    case = f"{STORE_KIND_FILE}::test_hostile_run_ids_and_bindings_are_plain_data_on_every_store"
    assert [test_id for test_id in slow if test_id.startswith(STORE_KIND_FILE)] == [
        f"{case}[trio-{kind}]" for kind in ("jsonl", "sqlite", "postgresql")
    ]
    trio = [t for t in slow if t.startswith(ONE_STORE_FILE) and "[trio-" in t]
    quick_twins = [t for t in trio if t.replace("[trio-", "[asyncio-") not in slow]
    assert quick_twins, "a file about one durable store keeps its asyncio cases quick"


def test_a_sampled_case_is_quick_on_memory_and_sqlite_and_slow_elsewhere() -> None:
    slow, everything = set(_slow()), _ids(_everything())
    case = f"{SAMPLED_FILE}::test_a_run_recorded_on_any_store_re_drives_to_the_same_trajectory"
    kinds = {"memory": False, "sqlite": False, "jsonl": True, "postgresql": True}
    for backend in ("asyncio", "trio"):
        for kind, is_slow in kinds.items():
            test_id = f"{case}[{backend}-{kind}]"
            assert test_id in everything
            # Trio on a durable store is slow by the older rule.
            assert (test_id in slow) is (is_slow or (backend == "trio" and kind != "memory"))
