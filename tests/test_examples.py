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
        capture_output=True, text=True, timeout=120, check=True,
    )
    out = done.stdout
    assert out.count("stop reason: submitted; steps 5, valid steps 4") == 2
    assert "resumed: True" in out
    assert "[not_executed] Refused: arguments for tool 'add'" in out
    assert "2 steps were on record" in out
    # Only the steps after the crash ran their tools again.
    assert "tool executions after the resume: ['quickstart-2:3:action', " \
           "'quickstart-2:4:action']" in out
