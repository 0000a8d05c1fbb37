"""Smoke test of ``python -m bench suite``: every benchmark's code path at a tiny size.

Nothing here asserts a timing. What is checked: each benchmark produces its rows with
the expected keys, every loop really did the work it claims (PolyLoop, the hand-written
floors and each peer made the same number of model decisions and tool calls), and the
results file is written. LangGraph and Pydantic AI are optional (the ``bench`` extra):
when they are missing, only their rows may be skipped, never PolyLoop's. PostgreSQL
rows run when a server answers (``POLYLOOP_TEST_POSTGRES``) and are skipped otherwise.

The one-commit-per-write baselines of benchmark 3 (``bench/_baselines.py``) replace a
private step of the stores they extend, so they are checked on their own as well: they
keep every record, and commit each write alone.
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench import console as bench_console  # noqa: E402
from bench import listing as bench_listing  # noqa: E402
from bench import report as bench_report  # noqa: E402
from bench.__main__ import main as bench_main  # noqa: E402
from bench._common import TINY, postgres_conninfo  # noqa: E402

from polyloop.testing.store_contract import (  # noqa: E402
    apply,
    expected_records,
    sample_run,
)

# Slow: every benchmark, run as a program at a tiny size.
pytestmark = pytest.mark.slow

PEERS = {"langgraph": "langgraph", "pydantic-ai": "pydantic_ai"}
POLYLOOP_ROLES = ("floor", "polyloop", "reference")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny run of every benchmark (and the profile) through the command line."""
    tmp = tmp_path_factory.mktemp("bench")
    output = tmp / "results.json"
    command = ["suite", "--tiny", "--profile", "--workdir", str(tmp), "--output", str(output)]
    status = bench_main(command)
    assert status == 0
    data: dict[str, Any] = json.loads(output.read_text())
    assert data["meta"]["mode"] == "tiny"
    assert set(data["benchmarks"]) == {
        "overhead",
        "durable",
        "concurrency",
        "recovery",
        "scale",
        "listing",
        "lag",
        "console",
    }
    return data


def _rows(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    rows = results["benchmarks"][name]["rows"]
    assert rows, f"{name} produced no rows"
    return list(rows)


def _postgres_up() -> bool:
    return postgres_conninfo()[0] is not None


def _check_skip(row: dict[str, Any]) -> None:
    """Only a peer that is not installed, or PostgreSQL without a server, may be skipped."""
    if not row.get("skipped"):
        return
    key = row["key"]
    if "postgres" in key:
        assert not _postgres_up(), f"{key} skipped although PostgreSQL answers"
        return
    peer = next((module for prefix, module in PEERS.items() if key.startswith(prefix)), None)
    assert peer is not None, f"a PolyLoop row was skipped: {row}"
    assert not _installed(peer), f"{key} skipped although {peer} is installed"


@pytest.mark.parametrize(
    ("name", "steps"), [("overhead", TINY.overhead_steps), ("durable", TINY.durable_steps)]
)
def test_single_run_benchmarks_do_the_same_work_everywhere(
    results: dict[str, Any], name: str, steps: int
) -> None:
    rows = _rows(results, name)
    keys = {row["key"] for row in rows}
    assert (
        {"polyloop-memory", "floor-memory", "langgraph-none", "langgraph-memory", "pydantic-ai"}
        <= keys
        if name == "overhead"
        else {
            "fsync-floor",
            "floor-two-fsyncs",
            "floor-same-bytes",
            "floor-sqlite",
            "floor-sqlite-fresh",
            "polyloop-jsonl",
            "polyloop-sqlite",
            "polyloop-postgres",
            "langgraph-sqlite",
            "langgraph-sqlite-sync",
        }
        <= keys
    )
    for row in rows:
        _check_skip(row)
        if row.get("skipped") or row["key"] == "fsync-floor":
            continue
        assert {
            "name",
            "role",
            "us_per_step",
            "ratio_to_floor",
            "decisions",
            "tool_executions",
            "repeats",
        } <= row.keys()
        # Every loop: `steps` model decisions and a tool call on each but the last.
        assert (row["decisions"], row["tool_executions"]) == (steps, steps - 1), row
    measured = {row["role"] for row in rows if not row.get("skipped")}
    assert {"floor", "polyloop"} <= measured
    fsync = next((row for row in rows if row["key"] == "fsync-floor"), None)
    assert name == "overhead" or (fsync is not None and fsync["us_per_step"] > 0)
    if name == "durable":
        # The floor is measured in the round-robin, like every loop, and the SQLite store
        # is also set beside the hand-written SQLite loop.
        assert fsync is not None and fsync["repeats"] == TINY.durable_repeats and fsync["calls"] > 0
        sqlite_row = next(row for row in rows if row["key"] == "polyloop-sqlite")
        assert sqlite_row["ratio_to_sqlite_floor"] > 0
    for item in results["benchmarks"][name]["targets"]:
        assert {"target", "measured", "limit", "met"} <= item.keys()
        assert item["measured"] is not None


def test_concurrency_covers_every_store_backend_and_count(results: dict[str, Any]) -> None:
    rows = _rows(results, "concurrency")
    largest = max(TINY.concurrency_runs)
    for backend in TINY.backends:
        for store in ("memory", "jsonl", "sqlite", "postgres", "handwritten"):
            for runs in TINY.concurrency_runs:
                row = next(r for r in rows if r["key"] == f"{backend}-{store}-{runs}")
                _check_skip(row)
                if row.get("skipped"):
                    continue
                steps = (
                    TINY.concurrency_steps_largest if runs == largest else TINY.concurrency_steps
                )
                assert row["steps_per_run"] == steps
                assert (row["decisions"], row["tool_executions"]) == (
                    runs * steps,
                    runs * (steps - 1),
                )
                assert {"wall_s", "steps_per_s", "us_per_step", "peak_kib_per_run"} <= row.keys()
    speedups = results["benchmarks"]["concurrency"]["speedups"]
    for row in speedups:
        _check_skip(row)
        if not row.get("skipped"):
            assert {
                "sequential_s",
                "concurrent_s",
                "speedup",
                "speedup_vs_handwritten",
            } <= row.keys()
    assert {row["store"] for row in speedups if not row.get("skipped")} >= {
        "jsonl",
        "sqlite",
        "handwritten",
    }
    groups = results["benchmarks"]["concurrency"]["group_commit"]
    assert {(row["backend"], row["store"]) for row in groups} == {
        (backend, store) for backend in TINY.backends for store in ("sqlite", "postgres")
    }
    for row in groups:
        _check_skip(row)
        if not row.get("skipped"):
            assert row["single_steps_per_s"] > 0 and row["group_steps_per_s"] > 0
            assert row["gain"] == pytest.approx(
                row["group_steps_per_s"] / row["single_steps_per_s"]
            )


def test_recovery_reads_whole_logs_and_fits_a_slope(results: dict[str, Any]) -> None:
    rows = _rows(results, "recovery")
    for store in ("memory", "jsonl", "sqlite", "postgres"):
        for size in TINY.recovery_sizes:
            row = next(r for r in rows if r["key"] == f"{store}-{size}")
            _check_skip(row)
            if row.get("skipped"):
                continue
            # The start record plus five records per logged step, all read back.
            assert row["records"] == 1 + 5 * size
            assert row["seconds"] > 0 and row["us_per_logged_step"] > 0
    slopes = {row["store"]: row for row in results["benchmarks"]["recovery"]["slopes"]}
    for store in ("memory", "jsonl", "sqlite"):
        assert {"slope_us_per_step", "segment_ratio"} <= slopes[store].keys()


def test_scale_compares_early_and_late_steps(results: dict[str, Any]) -> None:
    rows = _rows(results, "scale")
    for point in TINY.scale_points:
        row = next(r for r in rows if r["key"] == f"polyloop-{point}")
        assert row["us_per_step"] > 0 and row["ratio_to_first"] > 0
    (item,) = results["benchmarks"]["scale"]["targets"]
    assert item["measured"] is not None


def test_listing_compares_stores_with_and_without_finished_runs(
    results: dict[str, Any],
) -> None:
    rows = _rows(results, "listing")
    sizes = bench_listing.TINY_SIZES
    assert sizes.finished[0] == 0
    for store in ("memory", "jsonl", "sqlite", "postgres"):
        for finished in sizes.finished:
            row = next(r for r in rows if r["key"] == f"{store}-{finished}")
            _check_skip(row)
            if row.get("skipped"):
                continue
            # Each pass checked what it listed; the row says how many runs it held.
            assert (row["unfinished"], row["finished"]) == (sizes.unfinished, finished)
            assert row["repeats"] == sizes.repeats
            for field in ("list_unfinished", "status", "list_all"):
                ratio = row[f"{field}_ratio"]
                assert ratio > 0
                if finished == 0:  # the baseline each ratio divides by
                    assert ratio == pytest.approx(1.0)
            assert row["list_unfinished_ms"] > 0 and row["status_total_ms"] > 0
            assert row["status_us_per_run"] > 0 and row["list_all_ms"] > 0
    measured = {row["store"] for row in rows if not row.get("skipped")}
    targets = results["benchmarks"]["listing"]["targets"]
    # Two targets (listing, statuses) per SQL store and number of finished runs.
    assert len(targets) == 2 * len(measured & {"sqlite", "postgres"}) * (len(sizes.finished) - 1)
    for item in targets:
        assert {"target", "measured", "limit", "met"} <= item.keys()
        assert item["measured"] is not None


def test_lag_ticks_beside_every_store_and_the_idle_floor(results: dict[str, Any]) -> None:
    rows = _rows(results, "lag")
    for backend in TINY.backends:
        for store in ("idle", "memory", "jsonl", "sqlite", "postgres"):
            row = next(r for r in rows if r["key"] == f"{backend}-{store}")
            _check_skip(row)
            if row.get("skipped"):
                continue
            assert row["samples"] > 0
            assert 0 <= row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
    targets = results["benchmarks"]["lag"]["targets"]
    durable = [
        row
        for row in rows
        if not row.get("skipped") and row["store"] in ("jsonl", "sqlite", "postgres")
    ]
    assert durable and len(targets) == 2 * len(durable)  # p99 and largest, per store
    for item in targets:
        assert {"target", "measured", "limit", "met"} <= item.keys()
        assert item["measured"] is not None


def test_console_answers_every_request_and_counts_the_logs_it_read(
    results: dict[str, Any],
) -> None:
    rows = _rows(results, "console")
    sizes = bench_console.TINY_SIZES
    assert results["benchmarks"]["console"]["sizes"]["mix"] == sizes.mix()
    for store in ("sqlite", "postgres"):
        for backend in ("asyncio", "trio"):
            mine = [r for r in rows if r["store"] == store and r["backend"] == backend]
            if any(r.get("skipped") for r in mine):
                assert store == "postgres" and not _postgres_up()
                continue
            by_key = {r["key"].removeprefix(f"{store}-{backend}-"): r for r in mine}
            probes = ["first-cold", "first-warm"]
            if backend == "asyncio":
                probes += [
                    "doubt-cold",
                    "doubt-cold-serial",
                    "doubt-warm",
                    "deep-cold",
                    "run-cold",
                    "events-look",
                ]
            assert set(by_key) == {"list-all", "list-unfinished", "page", *probes}
            for key in probes:
                row = by_key[key]
                assert 0 < row["ttfb_ms"] <= row["full_ms"]
                assert row["stall_ms"] >= 0
                assert row["peak_mb"] > 0 and row["repeats"] == sizes.repeats
            # A cold page reads its own runs' logs; the same page again reads none.
            assert by_key["first-cold"]["logs_read"] > 0
            assert by_key["first-warm"]["logs_read"] == 0
            if backend == "asyncio":
                # The finer filter reads unfinished runs only, never the finished ones.
                for key in ("doubt-cold", "doubt-cold-serial"):
                    assert by_key[key]["logs_read"] == 2 * sizes.unfinished
                assert by_key["doubt-warm"]["logs_read"] == 0
            assert by_key["list-all"]["full_ms"] > 0 and by_key["list-unfinished"]["full_ms"] > 0
            # The deep page reads its own runs' logs only: those past the pages above it.
            assert by_key["page"]["full_ms"] > 0
            if backend == "asyncio":
                above = (sizes.deep_page - 1) * bench_console.PER_PAGE
                runs = min(bench_console.PER_PAGE, sizes.finished + sizes.unfinished - above)
                assert by_key["deep-cold"]["logs_read"] == 2 * runs


def test_profile_names_polyloop_functions(results: dict[str, Any]) -> None:
    for kind in ("memory", "jsonl"):
        files = [item["file"] for item in results["profile"][kind]["files"]]
        assert any(name.startswith("polyloop/") for name in files), files


def test_the_report_renders_every_benchmark_table_and_target(results: dict[str, Any]) -> None:
    text = bench_report.render(results)
    for bench in results["benchmarks"].values():
        assert f"### {bench['title']}" in text
        for extra in bench.get("tables", ()):
            assert f"**{extra['title']}**" in text
        for item in bench.get("targets", ()):
            assert f"| {item['target']} |" in text
    assert results["meta"]["versions"]["anyio"] in text


# -- the one-commit-per-write baselines ---------------------------------------------------

BASELINE_RUNS = 6


async def _write_runs_at_once(store: Any) -> int:
    """A two-step sample run per id, all at once; each log must read back whole.
    Returns how many writes were made."""
    runs = {f"run-{n}": sample_run(f"run-{n}", steps=2) for n in range(BASELINE_RUNS)}
    async with anyio.create_task_group() as group:
        for writes in runs.values():
            group.start_soon(apply, store, writes)
    for run_id, writes in runs.items():
        assert list((await store.read_log(run_id)).records) == expected_records(writes)
    return sum(len(writes) for writes in runs.values())


class _CommitCounting(sqlite3.Connection):
    """Notes each ``COMMIT`` of records: the ``synchronous`` level it ran under."""

    levels: list[int]
    rows: int

    def executemany(self, statement: str, rows: Any, /) -> sqlite3.Cursor:
        rows = list(rows)
        if statement.startswith("INSERT INTO records"):
            self.rows += len(rows)
        return super().executemany(statement, rows)

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if statement == "COMMIT" and self.rows:
            self.levels.append(super().execute("PRAGMA synchronous").fetchone()[0])
        if statement in ("BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"):
            self.rows = 0
        return super().execute(statement, parameters)


@pytest.mark.anyio
async def test_the_sqlite_baseline_commits_each_write_alone_under_full_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench._baselines import SqliteOneCommitPerWrite  # needs the postgres extra too

    levels: list[int] = []
    real_connect = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, factory=_CommitCounting, **kwargs)
        assert isinstance(conn, _CommitCounting)
        conn.levels, conn.rows = levels, 0
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    async with SqliteOneCommitPerWrite(tmp_path / "runs.db") as store:
        writes = await _write_runs_at_once(store)
    assert len(levels) == writes
    assert set(levels) == {2}  # FULL, for every commit


@pytest.mark.anyio
async def test_the_postgres_baseline_sends_each_write_in_a_statement_of_its_own(
    postgres_conninfo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench._baselines import PostgresOneCommitPerWrite

    from polyloop.stores._sql.postgres import connection as _postgres_connection
    from polyloop.stores._sql.postgres.sql import Queries

    queries = Queries("polyloop")
    sent: list[str] = []
    opened = _postgres_connection.open_connection

    def open_connection(conninfo: str, *args: Any, **options: Any) -> Any:
        conn = opened(conninfo, *args, **options)
        writes = {query.as_string(conn) for query in (queries.write, queries.lazy_write)}
        execute = conn.execute

        def noted(query: Any, *args: Any, **kwargs: Any) -> Any:
            text = query if isinstance(query, str) else query.as_string(conn)
            if text in writes:
                sent.append(text)
            return execute(query, *args, **kwargs)

        conn.execute = noted  # type: ignore[method-assign]
        return conn

    monkeypatch.setattr(_postgres_connection, "open_connection", open_connection)
    async with PostgresOneCommitPerWrite(postgres_conninfo, max_writer_connections=1) as store:
        writes = await _write_runs_at_once(store)
    assert len(sent) == writes  # one statement, one transaction, per write


def test_the_codec_benchmark_times_every_record_of_a_run() -> None:
    from bench import codec as bench_codec
    from bench.workload import OBSERVATION_CHARS

    figures = bench_codec.measure(repeats=1, rounds=1)
    # Ten steps of a tool call each: a start, two intents and two results a step, ten
    # step records and an end.
    assert figures["records"] == 2 + 5 * bench_codec.STEPS
    # Written whole, a step's records hold its 3 KB observation twice; as the stores write
    # them, once (record 0063): a step adds about the observation's size less.
    observation = OBSERVATION_CHARS
    assert figures["whole_bytes_per_step"] > 2 * observation
    saved = figures["whole_bytes_per_step"] - figures["bytes_per_step"]
    assert observation * 0.85 < saved < observation  # the last step's observation is short
    for name in ("dumps", "encode", "canonical_json"):
        assert figures[f"{name}_us_per_step"] > 0


def test_the_hosting_benchmark_times_every_write_and_reads_no_finished_log(
    tmp_path: Path,
) -> None:
    from bench import hosting as bench_hosting

    output = tmp_path / "hosting.json"
    command = ["hosting", "--tiny", "--workdir", str(tmp_path), "--output", str(output)]
    assert bench_main(command) == 0
    results = json.loads(output.read_text())
    assert results["mode"] == "tiny"
    sizes = bench_hosting.TINY_SIZES
    for store in bench_hosting.STORES:
        for kind in bench_hosting.KINDS:
            row = next(r for r in results["rows"] if r["key"] == f"{store}-{kind}")
            _check_skip(row)
            if row.get("skipped"):
                continue
            assert row["samples"] == len(row["waited_ms"]) == sizes.samples
            # The worker's record comes after the write's, and well within the
            # smoke test's patience (a poll interval is half a second).
            assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"] < 10_000
        idle = [r for r in results["tables"][0]["rows"] if r["store"] == store]
        assert [r["key"] for r in idle] == [f"{store}-{n}" for n in sizes.finished]
        for row in idle:
            _check_skip(row)
            if row.get("skipped"):
                continue
            # Nothing can go on, so the worker lists its store and reads no log (a store
            # that notifies is listed every 5 s: maybe not within the tiny window).
            assert row["logs_read"] == 0, row
            assert row["listings_total"] > 0 and row["cpu_ms_per_s"] > 0
    rendered = bench_report.render(results)
    assert "### 12. A worker process" in rendered and "**12b. " in rendered
    assert "`python -m bench hosting --tiny --workdir" in rendered


def test_the_following_benchmark_times_every_write_and_sees_every_one_followed(
    tmp_path: Path,
) -> None:
    if not _postgres_up():
        pytest.skip("benchmark 13 needs PostgreSQL")
    from bench import following as bench_following

    output = tmp_path / "following.json"
    command = ["following", "--tiny", "--workdir", str(tmp_path), "--output", str(output)]
    assert bench_main(command) == 0
    results = json.loads(output.read_text())
    assert results["mode"] == "tiny"
    rows = results["rows"]
    assert [row["name"].split(",")[0] for row in rows] == ["PostgreSQL"] * 3 + ["SQLite"] * 3
    writes = (bench_following.TINY.steps * 4 + 2) * bench_following.TINY.rounds
    assert {row["writes"] for row in rows} == {writes}
    assert rows[0]["ratio"] == rows[3]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    assert rows[4]["ratio"] > 0
    assert all(rows[at]["followers_cpu_pct"] >= 0 for at in (1, 4))
    assert [t["target"] for t in results["targets"]] == [
        "PostgreSQL: idle followers",
        "SQLite: idle followers",
    ]
    for alone in (rows[0], rows[1], rows[3], rows[4]):
        assert "seen_p50_ms" not in alone
    for followed in (rows[2], rows[5]):
        # Every write was seen by the follower in the other process, after it returned.
        assert 0 <= followed["seen_p50_ms"] <= followed["seen_p99_ms"] < 10_000
    rendered = bench_report.render(results)
    assert "### 13. Following runs: the writer beside followers" in rendered
