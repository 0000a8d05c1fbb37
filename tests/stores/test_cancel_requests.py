"""Cancel requests in the durable stores, beyond the store contract: a refused write fails
alone in its shared commit, a request waits for an intent whose check it raced, and what
the JSON-lines store keeps on disk.

The contract (``polyloop.testing.store_contract``) checks the fence itself on every store.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest
from psycopg import sql

import polyloop.stores._sql.postgres.batch as postgres_batch
import polyloop.stores._sql.sqlite.store as sqlite_store
from kit.store import DURABLE_STORE_BACKENDS, jsonl_store_on
from polyloop.ports import ManagedStore
from polyloop.stores import JsonlStore, PostgresStore, SqliteStore
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._paths import safe_name
from polyloop.testing.store_contract import apply, sample_run
from polyloop.types import CancelRequest, CancelRequested, CorruptLog, Intent

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _request(run_id: str) -> CancelRequest:
    return CancelRequest(run_id=run_id, by="alice", reason="stop it")


def _action(run_id: str) -> Intent:
    """The intent of the run's first action (step 0)."""
    intent: Intent = sample_run(run_id, steps=1)[3][1][0]
    return intent


def _model_call(run_id: str) -> Intent:
    """The intent of the run's second model call (step 1)."""
    intent: Intent = sample_run(run_id, steps=2)[5][1][0]
    return intent


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Callable[[], ManagedStore], list[int]]:
    """Store objects over one database, each writing its runs through one connection, and
    the size of every shared commit they plan."""
    sizes: list[int] = []
    module: Any = sqlite_store if request.param == "sqlite" else postgres_batch
    planned = module.plan

    def plan(writes: Sequence[Any], admit: Any) -> Any:
        sizes.append(len(writes))
        return planned(writes, admit)

    monkeypatch.setattr(module, "plan", plan)
    if request.param == "sqlite":
        return (lambda: SqliteStore(tmp_path / "runs.db")), sizes
    conninfo = request.getfixturevalue("postgres_shared")
    schema = request.getfixturevalue("postgres_schemas")()
    return (lambda: PostgresStore(conninfo, schema=schema, max_writer_connections=1)), sizes


async def test_a_refused_intent_fails_alone_in_its_shared_commit(
    sql_store: tuple[Callable[[], ManagedStore], list[int]],
) -> None:
    open_store, sizes = sql_store
    runs = [f"r{n}" for n in range(8)]
    async with open_store() as owner, open_store() as asker:
        for run_id in runs:
            await apply(owner, sample_run(run_id, steps=1, ended=False)[:3])
        await asker.request_cancel(_request("r3"))
        outcomes: dict[str, BaseException | None] = {}

        async def write(run_id: str) -> None:
            try:
                await owner.write_intent(_action(run_id))
            except CancelRequested as refused:
                outcomes[run_id] = refused
            else:
                outcomes[run_id] = None

        sizes.clear()
        async with anyio.create_task_group() as group:
            for run_id in runs:
                group.start_soon(write, run_id)
        assert max(sizes) > 1  # the refused write shared a commit with others
        assert [run_id for run_id, error in outcomes.items() if error is not None] == ["r3"]
        for run_id in runs:  # none of the runs is failed in this store object
            log = (await owner.read_log(run_id)).records
            assert len(log) == (3 if run_id == "r3" else 4)
            await apply(owner, sample_run(run_id, steps=1)[4:], claim=False)
        listed = {run.run_id: run for run in await asker.list_runs()}
        assert {run_id for run_id, run in listed.items() if run.cancel_requested} == {"r3"}
        assert all(run.finished for run in listed.values())


class SlowCheck(OsFileOps):
    """Real file operations; once ``slow`` is set, looking for a cancel marker takes a while."""

    def __init__(self) -> None:
        self.slow = False
        self.checking = threading.Event()

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int:
        if self.slow and path.suffix == ".cancel":
            self.checking.set()
            time.sleep(0.3)
        return super().open(path, flags, mode)


async def test_jsonl_a_request_waits_for_an_intent_that_checked_before_it(
    tmp_path: Path,
) -> None:
    """The intent found no marker, then the request came: it returns only once the intent
    is in the log, and the next intent is refused."""
    files = SlowCheck()
    owner, asker = jsonl_store_on(tmp_path / "runs", files), JsonlStore(tmp_path / "runs")
    await apply(owner, sample_run("r1", steps=2, ended=False)[:3])
    files.slow = True
    intent = _action("r1")
    async with anyio.create_task_group() as group:
        group.start_soon(owner.write_intent, intent)
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(files.checking.wait)
        files.slow = False
        await asker.request_cancel(_request("r1"))
        assert (await asker.read_log("r1")).records[-1] == intent
    with pytest.raises(CancelRequested):
        await owner.write_intent(_model_call("r1"))
    await owner.aclose()


async def test_jsonl_keeps_the_request_in_a_marker_file_that_goes_with_the_run(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "runs"
    async with JsonlStore(directory) as store:
        await apply(store, sample_run("r1", steps=1))
        await store.request_cancel(_request("r1"))
        kept = await store.read_cancel("r1")
        assert kept is not None and kept.at is not None  # the store's time of the request
        assert sorted(os.listdir(directory)) == sorted(
            [f"{safe_name('r1')}.jsonl", f"{safe_name('r1')}.cancel", *_locks(directory)]
        )
        marker = directory / f"{safe_name('r1')}.cancel"
        assert json.loads(marker.read_text()) == {
            "run_id": "r1",
            "by": "alice",
            "reason": "stop it",
            "at": kept.at.isoformat(),
        }
        tomorrow = datetime.now(UTC) + timedelta(days=1)
        assert await store.prune(finished_before=tomorrow) == ("r1",)
        assert not marker.exists()
        # The id is free again, and its new run is not cancelled.
        await apply(store, sample_run("r1", steps=1))
        assert await store.read_cancel("r1") is None


async def test_jsonl_a_damaged_marker_is_corrupt_and_still_fences(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    async with JsonlStore(directory) as store:
        await apply(store, sample_run("r1", steps=1, ended=False)[:3])
        marker = directory / f"{safe_name('r1')}.cancel"
        marker.write_text('{"run_id": "r2", "by": "x", "reason": "y", "at": "2026-12-06"}')
        with pytest.raises(CorruptLog) as corrupt:
            await store.read_cancel("r1")
        assert corrupt.value.location == str(marker)
        with pytest.raises(CorruptLog):
            await store.write_intent(_action("r1"))
        assert len((await store.read_log("r1")).records) == 3
        await apply(store, sample_run("r1", steps=1)[4:], claim=False)  # not failed


def _locks(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".claims-")]


async def test_postgres_a_request_waits_for_the_row_an_intent_holds(
    postgres_shared: str, postgres_schemas: Callable[[], str]
) -> None:
    """The intent's statement holds the run's row while its rows go in (stalled here by
    a trigger): the request waits for its commit, and the next intent is refused."""
    schema = postgres_schemas()
    owner = PostgresStore(postgres_shared, schema=schema)
    asker = PostgresStore(postgres_shared, schema=schema)
    await apply(owner, sample_run("r1", steps=2, ended=False)[:3])
    name = sql.Identifier(schema)
    await anyio.to_thread.run_sync(
        _execute,
        postgres_shared,
        sql.SQL(
            "CREATE FUNCTION {}.stall() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " IF NEW.seq = 3 THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END $$"
        ).format(name),
        sql.SQL(
            "CREATE TRIGGER stall BEFORE INSERT ON {}.records"
            " FOR EACH ROW EXECUTE FUNCTION {}.stall()"
        ).format(name, name),
    )
    intent = _action("r1")
    async with anyio.create_task_group() as group:
        group.start_soon(owner.write_intent, intent)
        with anyio.fail_after(10):
            while True:
                if await anyio.to_thread.run_sync(_sleeping, postgres_shared):
                    break
                await anyio.sleep(0.02)
        await asker.request_cancel(_request("r1"))
        assert (await asker.read_log("r1")).records[-1] == intent
    with pytest.raises(CancelRequested):
        await owner.write_intent(_model_call("r1"))
    await owner.aclose()
    await asker.aclose()


def _execute(conninfo: str, *statements: sql.Composable) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _sleeping(conninfo: str) -> bool:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'polyloop-writer' AND wait_event = 'PgSleep'"
        ).fetchone()
    return bool(row and row[0])


async def test_postgres_a_request_commits_synchronously_on_a_lax_server(
    postgres_shared: str, postgres_schemas: Callable[[], str]
) -> None:
    """The reader connections, through which a request is written, switch a server's
    ``synchronous_commit=off`` back on, as the writers do."""
    lax = psycopg.conninfo.make_conninfo(postgres_shared, options="-c synchronous_commit=off")
    async with PostgresStore(lax, schema=postgres_schemas()) as store:
        await apply(store, sample_run("r1", steps=1, ended=False))
        await store.request_cancel(_request("r1"))

        def setting() -> str:
            with store._backend._ready_pool(None).connection() as conn:  # type: ignore[attr-defined]
                row = conn.execute("SHOW synchronous_commit").fetchone()
            return str(row[0]) if row else ""

        assert await anyio.to_thread.run_sync(setting) == "on"
        assert await store.read_cancel("r1") is not None
