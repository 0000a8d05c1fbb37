"""Smoke test of ``bench/throughput.py``: every store and backend at a tiny size.

No timing is asserted (speed targets live in ``bench/``). What is checked: each cell
runs in its child process, completes every run without an error, did the steps it
claims, and reports every column; the results file is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench import throughput  # noqa: E402

KEYS = {
    "wall_s",
    "wall_over_ideal",
    "steps_per_s",
    "cpu_us_per_step",
    "lag_p50_ms",
    "lag_p99_ms",
    "lag_max_ms",
    "peak_kib_per_run",
    "peak_fds",
    "errors",
}


def test_every_store_and_backend_runs_a_tiny_cell(tmp_path: Path) -> None:
    output = tmp_path / "throughput.json"
    status = throughput.main(
        [
            "--runs",
            "3",
            "--steps",
            "2",
            "--latency-ms",
            "5",
            "--nofile",
            "256",
            "--workdir",
            str(tmp_path),
            "--output",
            str(output),
        ]
    )
    assert status == 0
    data = json.loads(output.read_text())
    rows = data["rows"]
    assert {row["name"] for row in rows} == {
        f"{backend} / {store}"
        for backend in ("asyncio", "trio")
        for store in ("MemoryStore", "JsonlStore", "SqliteStore", "PostgresStore")
    }
    for row in rows:
        assert "skipped" not in row, row
        assert set(row) >= KEYS, row
        assert row["errors"] == 0, row
        assert row["runs"] == 3 and row["nofile"] == 256
        assert row["steps_per_s"] * row["wall_s"] == pytest.approx(3 * 2)
