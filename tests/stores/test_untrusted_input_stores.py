"""Hostile input to the stores: run ids, binding values, planted files and raw or tampered logs.

Every case states what must hold: nothing written that should not be (no file outside a
store's directory, an untouched log after a refused ``resume``), a clear error naming
the run and where its log is bad, and never a silent resume of a log the library could
not have written. What a model or a caller can hand the kernel is in
``tests/kernel/test_untrusted_input.py``.

Not repeated here: that the SQLite store checks on open that it really got WAL and
``synchronous=FULL`` is pinned by ``tests/stores/test_sqlite.py``
(``test_database_runs_in_wal_with_full_sync`` and the two refusal tests after it).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from kit.agent import (
    Ledger,
    answer,
    definition,
    make_tools,
    request,
    same_outcome,
    tool_call,
)
from kit.store import STORE_KINDS, Stores, stores_fixture
from polyloop import (
    CorruptLog,
    IntentKind,
    PolyLoopError,
    Replay,
    Result,
    RunStarted,
    SchemaMajorMismatch,
    StopReason,
    Store,
    StoreError,
    resume,
    run,
)
from polyloop._recovery import RecoveryState, read_plan
from polyloop.serialization import dumps
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

pytestmark = pytest.mark.anyio


# -- stores ------------------------------------------------------------------------------------


stores = stores_fixture(STORE_KINDS)


# -- hostile run ids and binding values --------------------------------------------------------

HOSTILE = (
    "../../etc/passwd",
    "'; DROP TABLE records; --",
    "a/b",
    "nul\x00id",
    "k" * 10_000,
)
HOSTILE_BINDING = {
    "episode": "../../etc/passwd",
    "sql": "'; DROP TABLE records; --",
    "nul": "a\x00b",
    "../key/with/slashes": "a/b",
    "'; DROP TABLE meta; --": "x" * 10_000,
}
TWO_STEPS = [tool_call("double", n=2), tool_call("submit", answer="4")]


def tree(root: Path) -> set[tuple[str, bool, bool]]:
    """Every path under ``root``: (relative path, is a symlink, is a regular file); the
    claims lock files of a JSON-lines directory, which hold no run, left out."""
    return {
        (str(path.relative_to(root)), path.is_symlink(), path.is_file())
        for path in root.rglob("*")
        if not path.name.startswith(".claims-")
    }


async def test_hostile_run_ids_and_bindings_are_plain_data_on_every_store(
    stores: Stores,
) -> None:
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)

    def req(run_id: str) -> Any:
        return request(run_id, tools, binding=HOSTILE_BINDING, model_replay=Replay.ALLOWED)

    store = stores.open()
    bystander = await run(definition(store, script=TWO_STEPS), req("bystander"))
    bystander_log = (await store.read_log("bystander")).records
    before = tree(stores.tmp_path)

    results = {}
    for run_id in HOSTILE:
        # Crash after the first action intent, then finish on a new store object, then
        # resume the finished run: start, take-over, replay and read all see the id.
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=4), script=TWO_STEPS), req(run_id)
            )
        store = await stores.reopen(store)
        finished = await resume(definition(store, script=TWO_STEPS), req(run_id))
        assert finished.stop_reason is StopReason.SUBMITTED
        assert finished.run_id == run_id
        again = await resume(definition(store, script=TWO_STEPS), req(run_id))
        assert same_outcome(finished, again)
        results[run_id] = finished

    for run_id in HOSTILE:
        log = await store.read_log(run_id)
        assert {record.run_id for record in log.records} == {run_id}
        assert read_plan(log).state is RecoveryState.FINISHED
        started = log.records[0]
        assert isinstance(started, RunStarted)
        for key, value in HOSTILE_BINDING.items():
            assert started.snapshot[f"binding.{key}"] == value
    assert (await store.read_log("bystander")).records == bystander_log
    assert bystander.stop_reason is StopReason.SUBMITTED

    after = tree(stores.tmp_path)
    if stores.kind == "jsonl":
        new = after - before
        # One regular file per hostile run, directly inside the store's directory.
        assert {(path, link, regular) for path, link, regular in new} == {
            (f"runs/{safe_name(run_id)}.jsonl", False, True) for run_id in HOSTILE
        }
    if stores.kind == "sqlite":
        assert {path.split("/")[0] for path, _, _ in after} <= {
            "runs.db",
            "runs.db-wal",
            "runs.db-shm",
            "runs.db.claims",
        }
        assert not any(link for _, link, _ in after)
        with sqlite3.connect(stores.sqlite_path) as db:
            tables = {
                name
                for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            (runs,) = db.execute("SELECT COUNT(*) FROM records WHERE seq = 0").fetchone()
            (listed,) = db.execute("SELECT COUNT(*) FROM runs WHERE finished = 1").fetchone()
        assert tables == {"meta", "records", "runs"}
        assert runs == len(HOSTILE) + 1
        assert listed == runs  # one row per run in the table of runs, each finished
    if stores.kind == "postgresql":
        assert stores.place is not None
        conninfo, schema = stores.place
        with psycopg.connect(conninfo) as db:
            tables = {
                name
                for (name,) in db.execute(
                    "SELECT tablename FROM pg_catalog.pg_tables WHERE schemaname = %s", (schema,)
                )
            }
            records = sql.SQL("SELECT COUNT(*) FROM {}.records WHERE seq = 0")
            (runs,) = db.execute(records.format(sql.Identifier(schema))).fetchone()  # type: ignore[misc]
            finished = sql.SQL("SELECT COUNT(*) FROM {}.runs WHERE finished")
            (listed,) = db.execute(finished.format(sql.Identifier(schema))).fetchone()
        assert tables == {"meta", "records", "runs", "owners"}
        assert runs == len(HOSTILE) + 1
        assert listed == runs  # one row per run in the table of runs, each finished
    if stores.kind in ("memory", "postgresql"):
        assert after == before  # nothing on the local disk at all


@pytest.mark.parametrize("dangling", [False, True], ids=["existing-target", "dangling"])
async def test_a_planted_symlink_at_a_run_file_is_never_followed_by_run(
    tmp_path: Path, dangling: bool
) -> None:
    directory = tmp_path / "runs"
    directory.mkdir()
    target = tmp_path / "precious.txt"
    if not dangling:
        target.write_bytes(b"keep me\n")
    link = directory / f"{safe_name('r')}.jsonl"
    link.symlink_to(target)
    model = ScriptedModelClient([answer("x")])
    async with JsonlStore(directory) as store:
        with pytest.raises(StoreError, match="symbolic link"):
            await run(definition(store, model=model), request("r", make_tools(Ledger())))
    assert model.calls == []
    assert link.is_symlink()
    runs = [p.name for p in directory.iterdir() if not p.name.startswith(".claims-")]
    assert runs == [link.name]
    if dangling:
        assert not target.exists()
    else:
        assert target.read_bytes() == b"keep me\n"


# -- log lines the codec never writes --------------------------------------------------------


def bad_lines() -> dict[str, str]:
    """Raw log lines holding what the codec never writes, each as a model result."""
    base = dumps(
        Result(run_id="r", result_id="r:0:model", kind=IntentKind.MODEL_CALL, payload={"n": 0})
    )
    assert '"payload":{"n":0}' in base and base.count('"run_id":"r"') == 1
    return {
        "nan": base.replace('{"n":0}', '{"n":NaN}'),
        "infinity": base.replace('{"n":0}', '{"n":Infinity}'),
        "minus-infinity": base.replace('{"n":0}', '{"n":-Infinity}'),
        "1e400": base.replace('{"n":0}', '{"n":1e400}'),
        "integer-of-5000-digits": base.replace('{"n":0}', '{"n":' + "9" * 5_000 + "}"),
        "duplicate-key-in-payload": base.replace('{"n":0}', '{"n":0,"n":1}'),
        "duplicate-top-level-key": base.replace('"run_id":"r"', '"run_id":"r","run_id":"r"'),
    }


BAD_LINES = bad_lines()


async def start_only(store: Store, run_id: str = "r") -> None:
    await store.claim_run(run_id)
    await store.start_run(RunStarted(run_id=run_id, snapshot={"k": 1}))


@pytest.mark.parametrize("line", list(BAD_LINES.values()), ids=list(BAD_LINES))
async def test_a_raw_jsonl_line_the_codec_never_writes_is_corrupt(
    tmp_path: Path, line: str
) -> None:
    async with JsonlStore(tmp_path) as store:
        await start_only(store)
    path = tmp_path / f"{safe_name('r')}.jsonl"
    with path.open("ab") as file:
        file.write(line.encode() + b"\n")
    content = path.read_bytes()
    async with JsonlStore(tmp_path) as store:
        with pytest.raises(CorruptLog) as corrupt:
            await store.read_log("r")
        assert corrupt.value.location == f"{path}:2"
        with pytest.raises(CorruptLog) as again:
            await resume(
                definition(store, script=[answer("x")]), request("r", make_tools(Ledger()))
            )
        assert again.value.location == f"{path}:2"
    assert path.read_bytes() == content


async def test_a_corrupt_jsonl_line_names_its_run(tmp_path: Path) -> None:
    async with JsonlStore(tmp_path) as store:
        await start_only(store)
    path = tmp_path / f"{safe_name('r')}.jsonl"
    with path.open("ab") as file:
        file.write(BAD_LINES["nan"].encode() + b"\n")
    async with JsonlStore(tmp_path) as store:
        with pytest.raises(CorruptLog) as corrupt:
            await store.read_log("r")
    assert corrupt.value.run_id == "r"


@pytest.mark.parametrize("line", list(BAD_LINES.values()), ids=list(BAD_LINES))
async def test_a_raw_sqlite_body_the_codec_never_writes_is_corrupt(
    tmp_path: Path, line: str
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await start_only(store)
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)",
            ("r", 1, "result", line),
        )
    async with SqliteStore(path) as store:
        with pytest.raises(CorruptLog) as corrupt:
            await store.read_log("r")
        assert corrupt.value.location == f"{path}: run row seq 1"
        assert corrupt.value.run_id == "r"


# -- tampered logs: never a silent resume ------------------------------------------------------


async def crashed_run(store: Store, run_id: str) -> None:
    """A resumable run: start, step 0 complete (5 writes), nothing of step 1."""
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=5), script=TWO_STEPS),
            request(run_id, make_tools(Ledger())),
        )


async def refused_resume(store: Store, run_id: str) -> PolyLoopError:
    model = ScriptedModelClient(TWO_STEPS)
    with pytest.raises((SchemaMajorMismatch, CorruptLog)) as refused:
        await resume(definition(store, model=model), request(run_id, make_tools(Ledger())))
    assert model.calls == []
    return refused.value


def jsonl_tamper(kind: str, directory: Path) -> Path:
    """Tamper with run ``a``'s file (or plant a copy of it as run ``b``'s); return it."""
    a = directory / f"{safe_name('a')}.jsonl"
    lines = a.read_bytes().split(b"\n")[:-1]
    assert len(lines) == 5  # start, model intent, model result, action intent, step pair
    if kind == "newer-major":
        lines[2] = lines[2].replace(b'"schema":"polyloop/1"', b'"schema":"polyloop/2"')
    elif kind == "out-of-order":
        lines[1], lines[2] = lines[2], lines[1]
    elif kind == "line-repeated":
        lines.append(lines[1])
    elif kind == "other-runs-file":
        b = directory / f"{safe_name('b')}.jsonl"
        b.write_bytes(a.read_bytes())
        return b
    a.write_bytes(b"\n".join(lines) + b"\n")
    return a


TAMPERS = ("newer-major", "out-of-order", "line-repeated", "other-runs-file")


@pytest.mark.parametrize("kind", TAMPERS)
async def test_a_tampered_jsonl_log_is_refused_by_resume_and_left_untouched(
    tmp_path: Path, kind: str
) -> None:
    async with JsonlStore(tmp_path) as store:
        await crashed_run(store, "a")
    target = jsonl_tamper(kind, tmp_path)
    content = target.read_bytes()
    run_id = "b" if kind == "other-runs-file" else "a"
    async with JsonlStore(tmp_path) as store:
        error = await refused_resume(store, run_id)
    if kind == "newer-major":
        assert isinstance(error, SchemaMajorMismatch)
        assert error.location == f"{target}:3"
    else:
        assert isinstance(error, CorruptLog) and error.location is not None
    if kind == "other-runs-file":
        assert "'a'" in str(error)
    assert target.read_bytes() == content


def sqlite_tamper(kind: str, db: sqlite3.Connection) -> None:
    rows = db.execute(
        "SELECT seq, kind, body FROM records WHERE run_id = 'a' ORDER BY seq"
    ).fetchall()
    assert [kind for _, kind, _ in rows] == [
        "run_started",
        "intent",
        "result",
        "intent",
        "result",
        "step",
    ]
    if kind == "newer-major":
        body = rows[2][2].replace('"schema":"polyloop/1"', '"schema":"polyloop/2"')
        db.execute("UPDATE records SET body = ? WHERE run_id = 'a' AND seq = 2", (body,))
    elif kind == "out-of-order":
        for seq, source in ((1, rows[2]), (2, rows[1])):
            db.execute(
                "UPDATE records SET kind = ?, body = ? WHERE run_id = 'a' AND seq = ?",
                (source[1], source[2], seq),
            )
    elif kind == "line-repeated":
        db.execute(
            "INSERT INTO records (run_id, seq, kind, body) VALUES ('a', 6, ?, ?)",
            (rows[1][1], rows[1][2]),
        )
    elif kind == "other-runs-file":
        db.execute(
            "INSERT INTO records (run_id, seq, kind, body) "
            "SELECT 'b', seq, kind, body FROM records WHERE run_id = 'a'"
        )


@pytest.mark.parametrize("kind", TAMPERS)
async def test_a_tampered_sqlite_log_is_refused_by_resume_and_left_untouched(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await crashed_run(store, "a")
    with sqlite3.connect(path) as db:
        sqlite_tamper(kind, db)
    everything = "SELECT run_id, seq, kind, body FROM records ORDER BY run_id, seq"
    with sqlite3.connect(path) as db:
        before = db.execute(everything).fetchall()
    run_id = "b" if kind == "other-runs-file" else "a"
    async with SqliteStore(path) as store:
        error = await refused_resume(store, run_id)
    if kind == "newer-major":
        assert isinstance(error, SchemaMajorMismatch)
        assert error.location == f"{path}: run row seq 2"
    else:
        assert isinstance(error, CorruptLog) and error.location is not None
    with sqlite3.connect(path) as db:
        assert db.execute(everything).fetchall() == before
