"""Smoke test of ``python -m bench throughput``: every store and backend at a tiny size, the
hand-written floors (with a trajectory, and durable by hand), the peers and several
workers sharing one database.

No timing is asserted (speed targets live in ``bench/``). What is checked: each cell
runs in its child processes, completes every run without an error, made as many model
decisions and tool executions as runs x steps, and reports every column; the results
file is written. LangGraph and Pydantic AI are optional (the ``bench`` extra): a peer's
row may be skipped only when its library is not installed. The tests that need
PostgreSQL take the server from ``tests/kit/pg.py``, so under ``CI=true`` they fail rather
than skip without one.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench import hand_durable, throughput, workload  # noqa: E402
from bench.__main__ import main as bench_main  # noqa: E402
from bench.report import render  # noqa: E402
from bench.workload import HandWorkload  # noqa: E402

# Slow: every store and backend of the throughput benchmark, and its peers.
pytestmark = pytest.mark.slow

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
    status = bench_main(
        [
            "throughput",
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


def _cells(tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    """Run the benchmark with 3 runs of 2 steps (unless ``flags`` say otherwise)."""
    output = tmp_path / "throughput.json"
    common = ["--runs", "3", "--steps", "2", "--latency-ms", "1", "--workdir", str(tmp_path)]
    assert bench_main(["throughput", *common, "--output", str(output), *flags]) == 0
    rows: list[dict[str, Any]] = json.loads(output.read_text())["rows"]
    return rows


def _did_the_work(row: dict[str, Any], runs: int = 3, steps: int = 2, workers: int = 1) -> None:
    assert "skipped" not in row, row
    assert set(row) >= KEYS, row
    assert row["errors"] == 0, row
    assert (row["runs"], row["workers"]) == (runs, workers), row
    assert row["decisions"] == row["tool_executions"] == runs * steps, row
    assert row["steps_per_s"] * row["wall_s"] == pytest.approx(runs * steps)
    assert row["cpu_us_per_step"] > 0


def _use_server(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Point the benchmark at the tests' PostgreSQL server (fails under CI=true if none)."""
    monkeypatch.setenv("POLYLOOP_TEST_POSTGRES", request.getfixturevalue("postgres_server"))


def test_the_hand_written_floor_runs_with_and_without_validation(tmp_path: Path) -> None:
    rows = _cells(tmp_path, "--stores", "hand,hand-novalidate")
    assert [row["name"] for row in rows] == [
        "asyncio / hand-written",
        "trio / hand-written",
        "asyncio / hand-written, no validation",
        "trio / hand-written, no validation",
    ]
    for row in rows:
        _did_the_work(row)


def test_the_children_take_the_garbage_collection_threshold_asked_for(tmp_path: Path) -> None:
    (tmp_path / "default").mkdir()
    (tmp_path / "raised").mkdir()
    default, raised = (
        _cells(tmp_path / name, "--stores", "memory", "--backends", "asyncio", *flags)[0]
        for name, flags in (("default", ()), ("raised", ("--gc-threshold", "50000")))
    )
    _did_the_work(raised)
    assert raised["gc_threshold"] == 50_000
    assert default["gc_threshold"] == gc.get_threshold()[0] != 50_000


def test_a_profiled_cell_reports_the_loop_threads_shares_per_file(tmp_path: Path) -> None:
    flags = ("--stores", "sqlite", "--backends", "asyncio", "--runs", "20", "--profile")
    row = _cells(tmp_path, *flags)[0]
    _did_the_work(row, runs=20)
    shares = [share for share, _ in row["profile"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100.5
    names = [name for _, name in row["profile"]]
    assert any(name.startswith("polyloop/") for name in names), names
    # No machine paths: files are named by package or by their place in the project.
    assert not any(
        name.startswith("/") or str(ROOT)[1:] in name or "site-packages" in name for name in names
    ), names


def test_results_render_as_markdown_without_where_they_were_written() -> None:
    # A file recorded before ``python -m bench`` shows its command as it runs today.
    results = {
        "command": "python bench/throughput.py --runs 3 --output /somewhere/t.json --steps 2",
        "date": "2026-12-02T01:00:00+00:00",
        "lease_s": 15.0,
        "gc_threshold": 50000,
        "rows": [
            {
                "name": "asyncio / MemoryStore",
                "runs": 3,
                "workers": 1,
                "wall_over_ideal": 1.5,
                "steps_per_s": 12.0,
                "cpu_us_per_step": 350.0,
                "lag_p50_ms": 0.4,
                "lag_p99_ms": 2.0,
                "lag_max_ms": 3.0,
                "peak_kib_per_run": 90.0,
                "peak_fds": 6,
                "errors": 0,
            },
            {"name": "trio / LangGraph", "runs": 3, "skipped": "asyncio only"},
        ],
    }
    lines = render(results).splitlines()
    assert lines[0] == (
        "`python -m bench throughput --runs 3 --steps 2` "
        "(2026-12-02; lease 15 s, GC threshold 50,000)"
    )
    assert lines[4] == (
        "| asyncio / MemoryStore | 3 | 1 | 1.50 | 12.0 | 350 | 0.4 | 2.0 | 3.0 | 90.0 | 6 | 0 |"
    )
    assert lines[5] == "| trio / LangGraph | skipped: asyncio only" + " | " * 10 + " |"
    assert len(lines) == 6


def test_profile_shares_that_tie_render_in_one_order() -> None:
    # The files of a profile come from a set: equal shares are ordered by name, so the
    # committed rendering on the performance page does not depend on the process.
    row = {"name": "asyncio / MemoryStore", "runs": 3, "skipped": "shown"}
    results = {
        "command": "python -m bench throughput --profile",
        "date": "2026-12-05T01:00:00+00:00",
        "lease_s": 15.0,
        "rows": [{**row, "profile": [[9.0, "z.py"], *([4.0, f"{name}.py"] for name in "fbdace")]}],
    }
    files = [line.split(" | ")[0] for line in render(results).splitlines()[-7:]]
    assert files == ["| z.py", *(f"| {name}.py" for name in "abcdef")]


PEERS = {
    "langgraph-sqlite": "langgraph.checkpoint.sqlite",
    "langgraph-postgres": "langgraph.checkpoint.postgres",
    "pydantic-ai": "pydantic_ai",
}


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; a dotted name whose package is missing is not."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.parametrize("store", sorted(PEERS))
def test_a_peer_does_the_same_work_on_asyncio_and_is_skipped_on_trio(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if "postgres" in store:
        _use_server(monkeypatch, request)
    on_asyncio, on_trio = _cells(tmp_path, "--stores", store)
    assert on_trio["skipped"] == "LangGraph and Pydantic AI run on asyncio only"
    if on_asyncio.get("skipped"):
        assert not _installed(PEERS[store]), on_asyncio
        pytest.skip(f"{store}: {on_asyncio['skipped']}")
    _did_the_work(on_asyncio)


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_one_and_two_workers_share_one_database(
    tmp_path: Path, store: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if store == "postgres":
        _use_server(monkeypatch, request)
    rows = _cells(
        tmp_path, "--runs", "5", "--stores", store, "--backends", "asyncio", "--workers", "1,2"
    )
    assert [row["workers"] for row in rows] == [1, 2]
    for row in rows:
        _did_the_work(row, runs=5, workers=row["workers"])


def test_workers_combine_from_the_first_start_to_the_last_end() -> None:
    def part(began: float, ended: float, runs: int, lateness: list[float]) -> dict[str, Any]:
        return {
            "runs": runs,
            "began": began,
            "ended": ended,
            "cpu_s": 1.0,
            "decisions": runs * 10,
            "tool_executions": runs * 10,
            "lateness_ms": lateness,
            "peak_kib": 100 * runs,
            "peak_fds": 10 + runs,
            "nofile": 1024,
            "gc_threshold": 700,
            "errors": 0,
            "first_errors": [],
        }

    cell = throughput.Cell("memory", "asyncio", 5, "", steps=10, latency_ms=200)
    row = throughput._combine([part(1.0, 4.0, 3, [1.0, 3.0]), part(2.0, 5.0, 2, [2.0])], cell)
    assert row["workers"] == 2 and row["runs"] == 5
    assert row["wall_s"] == 4.0 and row["wall_over_ideal"] == pytest.approx(4.0 / 2.1)
    assert row["steps_per_s"] == 50 / 4.0
    assert row["cpu_us_per_step"] == pytest.approx(2.0 / 50 * 1e6)
    assert (row["lag_p50_ms"], row["lag_max_ms"]) == (2.0, 3.0)
    assert (row["peak_kib_per_run"], row["peak_fds"]) == (100, 13)


def test_a_cell_whose_work_falls_short_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SkipsATool(HandWorkload):
        async def run(self, run_id: str) -> None:
            await super().run(run_id)
            self.counts.executions -= 1

    monkeypatch.setattr(throughput, "HandWorkload", SkipsATool)
    cell = throughput.Cell("hand", "asyncio", 3, str(tmp_path), steps=2, latency_ms=1)
    with pytest.raises(AssertionError, match="6 model decisions and 3 tool executions"):
        anyio.run(throughput.measure, cell)


FLOORS = "hand-trajectory,hand-sqlite,hand-postgres"


def test_the_trajectory_and_durable_floors_run_as_cells(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    _use_server(monkeypatch, request)
    rows = _cells(tmp_path, "--runs", "5", "--steps", "3", "--stores", FLOORS)
    assert [row["name"] for row in rows] == [
        f"{backend} / hand-written, trajectory{suffix}"
        for suffix in ("", ", SQLite", ", PostgreSQL")
        for backend in ("asyncio", "trio")
    ]
    for row in rows:
        _did_the_work(row, runs=5, steps=3)
    # Start, 5 rows a step and end, for each run: the warm-up's rows are not counted.
    assert [row["rows"] for row in rows] == [0, 0] + [5 * (5 * 3 + 2)] * 4


def _record_observations(monkeypatch: pytest.MonkeyPatch, module: str) -> list[str]:
    """Make ``module``'s tool keep every observation it returns, in order."""
    returned: list[str] = []
    tool = workload.observation

    def kept(arguments: Any) -> str:
        returned.append(tool(arguments))
        return returned[-1]

    monkeypatch.setattr(f"{module}.observation", kept)
    return returned


@pytest.mark.anyio
async def test_the_trajectory_floor_keeps_the_very_observations_the_tool_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    returned = _record_observations(monkeypatch, "bench.workload")
    driver = HandWorkload(steps=3, latency_s=0.001, tool_s=0.001, trajectory=True)
    trajectory = await driver.trajectory_of("run-0")
    assert [step.step for step in trajectory] == [0, 1, 2]
    assert [step.done for step in trajectory] == [False, False, True]
    assert len(returned) == 2  # the last step submits
    for step, text in zip(trajectory, returned, strict=False):
        assert step.observation is text
        assert step.action_text.startswith('search({"page": ')
    assert trajectory[-1].observation == workload.SUBMITTED
    assert (driver.counts.decisions, driver.counts.executions) == (3, 3)


def _committed(database: str, where: str) -> list[tuple[str, int, str]]:
    """Every row of the durable floor's table, read on a connection of its own."""
    query = "SELECT run_id, seq, body FROM {} ORDER BY run_id, seq"
    if database == "sqlite":
        with contextlib.closing(sqlite3.connect(Path(where) / hand_durable.SQLITE_FILE)) as lite:
            return list(lite.execute(query.format(hand_durable.TABLE)))
    conninfo, _, schema = where.partition("#")
    with psycopg.connect(conninfo) as conn:
        return list(conn.execute(query.format(f'"{schema}".{hand_durable.TABLE}')))


STEP_KINDS = ["intent", "result", "intent", "result", "step"]


@pytest.mark.anyio
@pytest.mark.parametrize("database", ["sqlite", "postgres"])
async def test_a_durable_floor_has_committed_every_row_when_its_runs_return(
    tmp_path: Path,
    database: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    where = str(tmp_path)
    if database == "postgres":
        where = f"{request.getfixturevalue('postgres_shared')}#"
        where += request.getfixturevalue("postgres_schemas")()
    returned = _record_observations(monkeypatch, "bench.workload")  # its tool is the floor's
    trajectories: dict[str, list[workload.HandStep]] = {}
    opened = hand_durable.hand_durable(database, where, steps=3, latency_s=0.001, tool_s=0.001)
    async with opened as driver:

        async def one(run_id: str) -> None:
            trajectories[run_id] = await driver.trajectory_of(run_id)

        async with anyio.create_task_group() as group:
            for index in range(5):
                group.start_soon(one, f"run-{index}")
        rows = await anyio.to_thread.run_sync(_committed, database, where)
    assert driver.counts.rows == len(rows) == hand_durable.rows_written(5, 3) == 85
    assert (driver.counts.decisions, driver.counts.executions) == (15, 15)
    for index in range(5):
        run_id = f"run-{index}"
        mine = [(seq, json.loads(body)) for key, seq, body in rows if key == run_id]
        assert [seq for seq, _ in mine] == list(range(17))
        kinds = [body["kind"] for _, body in mine]
        assert kinds == ["run_started", *STEP_KINDS * 3, "run_ended"]
        # The tool's result carries the observation the run kept; the step names the result.
        for step in trajectories[run_id]:
            assert any(step.observation is text for text in returned) or step.done
            result, record = (body for seq, body in mine[4 + 5 * step.step : 6 + 5 * step.step])
            assert result["payload"]["observation"] == step.observation
            assert record["observation_of"] == result["result_id"] and "observation" not in record
    if database == "postgres":  # the table went with the driver
        with pytest.raises(psycopg.errors.UndefinedTable):
            _committed(database, where)
