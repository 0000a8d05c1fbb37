"""The layout of the database stores' tables: one step runner for SQLite and PostgreSQL.

A database at any earlier layout (and one from before the ``layout`` key) is brought to
the current layout when a store opens it, its records intact and its runs listed as
they stand; a newer layout, an unreadable one, or another major of the record format is
refused without a change.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kit import pg
from kit.store import DURABLE_STORE_BACKENDS
from polyloop.ports import ManagedStore
from polyloop.stores import PostgresStore, SqliteStore
from polyloop.stores._sql.postgres.sql import Queries, run_id_column, run_key
from polyloop.stores._sql.schema import Layout
from polyloop.stores._sql.sqlite.sql import LAYOUT as SQLITE_LAYOUT
from polyloop.stores._writes import record_rows
from polyloop.testing.store_contract import expected_records, in_doubt_run, sample_run
from polyloop.types import CancelRequest, CancelRequested, CorruptLog, SchemaMajorMismatch

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


RUNS = {
    "done": expected_records(sample_run("done", steps=1)),
    "open": expected_records(sample_run("open", steps=1, ended=False)),
    "doubt": expected_records(in_doubt_run("doubt")),
}


@dataclass
class Database:
    """One dialect's database, as raw SQL sees it and as a store opens it."""

    layout: Layout
    raw: Callable[[], AbstractContextManager[Any]]  # an autocommit connection
    open_store: Callable[..., ManagedStore]  # takes ``create``
    insert: Any  # one record: run id, seq, kind, body
    row: Callable[[str, int, str, str], tuple[object, ...]]
    doubt_finished: Any  # what releases before settlements did to a run in doubt

    def build(self, layout: int, *, key: bool = True, format: str = "polyloop/1") -> None:
        """Make the tables the steps up to ``layout`` make, holding ``RUNS`` as a release
        of that layout left them."""
        with self.raw() as conn:
            for number, actions in sorted(self.layout.steps.items()):
                if number > layout:
                    break
                for action in actions:
                    if callable(action):
                        action(conn, "test", None)
                    else:
                        conn.execute(self.layout.compose(action))
                if number == 1:  # the records, before any runs table is filled from them
                    for run_id, records in RUNS.items():
                        for seq, record in enumerate(records):
                            conn.execute(
                                self.insert, self.row(run_id, seq, *record_rows((record,))[0])
                            )
            conn.execute(self.set_meta("format", format))
            if key:
                conn.execute(self.set_meta("layout", str(layout)))
            if 2 <= layout < 4:
                conn.execute(self.doubt_finished)

    def set_meta(self, key: str, value: str) -> Any:
        return self.layout.compose(
            f"INSERT INTO {{meta}} (key, value) VALUES ('{key}', '{value}')"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
        )

    def meta(self) -> dict[str, str]:
        with self.raw() as conn:
            rows = conn.execute(self.layout.compose("SELECT key, value FROM {meta}")).fetchall()
        return dict(rows)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    if request.param == "sqlite":
        path = tmp_path / "runs.db"

        @contextmanager
        def raw_sqlite() -> Iterator[sqlite3.Connection]:
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                yield conn
            finally:
                conn.close()

        return Database(
            layout=SQLITE_LAYOUT,
            raw=raw_sqlite,
            open_store=lambda create=True: SqliteStore(path, create=create),
            insert="INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)",
            row=lambda run_id, seq, kind, body: (run_id, seq, kind, body),
            doubt_finished="UPDATE runs SET finished = 1 WHERE run_id = 'doubt'",
        )
    conninfo = request.getfixturevalue("postgres_shared")
    schema = request.getfixturevalue("postgres_schemas")()
    compose = Queries(schema).layout.compose
    return Database(
        layout=Queries(schema).layout,
        raw=lambda: pg.admin(conninfo),
        open_store=lambda create=True: PostgresStore(conninfo, schema=schema, create=create),
        insert=compose(
            "INSERT INTO {records} (run_key, seq, run_id, kind, body) VALUES (%s, %s, %s, %s, %s)"
        ),
        row=lambda run_id, seq, kind, body: (
            run_key(run_id),
            seq,
            run_id_column(run_id),
            kind,
            body,
        ),
        doubt_finished=compose("UPDATE {runs} SET finished = true WHERE run_id = 'doubt'"),
    )


async def _check_upgraded(database: Database, *, create: bool = True) -> None:
    async with database.open_store(create=create) as store:
        listed = {run.run_id: run.finished for run in await store.list_runs()}
        assert listed == {"done": True, "open": False, "doubt": False}
        for run_id, records in RUNS.items():
            assert list((await store.read_log(run_id)).records) == records
        await store.claim_run("open")  # the run goes on where its log stands
        _, (intent,) = sample_run("open", steps=2)[5]
        await store.write_intent(intent)
        assert (await store.read_log("open")).records[-1] == intent
        # Its runs have no cancel request, and take one.
        assert await store.read_cancel("done") is None
        await store.request_cancel(CancelRequest(run_id="open", by="alice", reason="stop"))
        with pytest.raises(CancelRequested):
            await store.write_intent(intent)
        described = await store.describe_run("open")
        assert described is not None and described.cancel_requested
    meta = database.meta()
    assert (meta["format"], meta["layout"]) == ("polyloop/1", str(database.layout.current))


# Every layout before the current one: SQLite's 5 retired the owners of leased releases,
# PostgreSQL's 4 reopened runs in doubt, both 6 keep cancel requests.
EARLIER = [("sqlite", n) for n in range(1, SQLITE_LAYOUT.current)] + [
    ("postgresql", n) for n in range(1, Queries("any").layout.current)
]


# A store that may not create one still brings an existing database up to date.
@pytest.mark.parametrize("create", [True, False], ids=["create", "existing-only"])
@pytest.mark.parametrize(("database", "layout"), EARLIER, indirect=["database"])
async def test_a_database_at_an_earlier_layout_is_brought_to_the_current_one(
    database: Database, layout: int, create: bool
) -> None:
    assert layout < database.layout.current
    database.build(layout)
    await _check_upgraded(database, create=create)


@pytest.mark.parametrize("layout", [1, 2])
async def test_a_database_from_before_the_layout_key_is_brought_to_the_current_one(
    database: Database, layout: int
) -> None:
    database.build(layout, key=False)
    await _check_upgraded(database)


async def test_a_new_database_gets_the_current_layout(database: Database) -> None:
    async with database.open_store() as store:
        assert await store.list_runs() == ()
    assert database.meta() == {"format": "polyloop/1", "layout": str(database.layout.current)}


async def test_a_newer_layout_is_refused_and_left_as_it_is(database: Database) -> None:
    database.build(database.layout.current)
    newer = str(database.layout.current + 1)
    with database.raw() as conn:
        conn.execute(database.set_meta("layout", newer))
    store = database.open_store()
    with pytest.raises(SchemaMajorMismatch, match="newer") as refused:
        await store.list_runs()
    assert refused.value.location is not None
    assert refused.value.location.endswith("meta layout")
    await store.aclose()
    assert database.meta()["layout"] == newer


async def test_an_unreadable_layout_is_corrupt(database: Database) -> None:
    database.build(database.layout.current)
    with database.raw() as conn:
        conn.execute(database.set_meta("layout", "four"))
    store = database.open_store()
    with pytest.raises(CorruptLog, match="layout"):
        await store.list_runs()
    await store.aclose()


async def test_another_major_of_the_format_is_refused_before_any_step_runs(
    database: Database,
) -> None:
    database.build(1, format="polyloop/2")
    store = database.open_store()
    with pytest.raises(SchemaMajorMismatch):
        await store.list_runs()
    await store.aclose()
    assert database.meta() == {"format": "polyloop/2", "layout": "1"}
    with database.raw() as conn:  # no step ran: there is still no runs table
        (count,) = conn.execute(database.layout.exists, ("runs",)).fetchone()
    assert count == 0
