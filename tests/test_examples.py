"""Every example in examples/ runs and shows what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_quickstart_runs_crashes_and_resumes_without_repeating_steps(backend: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = done.stdout
    assert out.count("stop reason: submitted; steps 5, valid steps 4") == 2
    assert "resumed: True" in out
    assert "[not_executed] Refused: arguments for tool 'add'" in out
    assert "2 steps were on record" in out
    # Only the steps after the crash ran their tools again.
    assert (
        "tool executions after the resume: ['quickstart-2:3:action', "
        "'quickstart-2:4:action']" in out
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_mcp_tools_mounts_a_servers_tools_and_runs_them_durably(backend: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "mcp_tools.py"), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "mounted multiply: replay allowed",
        "mounted submit: replay never, completes",
        '  step 0: multiply({"a": 7, "b": 24}) -> 168',
        '  step 1: submit({"answer": 168}) -> accepted 168 (idempotency key mcp-demo:1:action)',
        "stop reason: submitted after 2 steps",
    ]


def _readme_commands() -> list[str]:
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = readme.split("```sh\n")[1:]
    return [block.split("```")[0].strip() for block in blocks]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    main_job, tests = _readme_commands()
    assert main_job.endswith("polyloop demo")
    assert tests.endswith("python -m pytest")
    ci = (EXAMPLES.parent / ".ci" / "run").read_text()
    assert tests in ci


def test_the_main_job_runs_the_demo_to_a_submitted_stop(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "polyloop", "demo", "--pace", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "submitted" in done.stdout.lower()
    assert (tmp_path / "polyloop-demo").is_dir()
