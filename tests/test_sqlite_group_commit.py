"""The SQLite store's two write paths: inline for a lone run, shared commits for many.

What is checked, under asyncio and Trio:

* concurrent runs share commits (fewer ``COMMIT`` statements than writes), and a lone
  run writes on the event loop's thread without a worker-thread hop;
* every barrier (``start_run``, ``write_intent``) commits under ``synchronous=FULL``,
  transactions of non-barriers only may commit under ``NORMAL``; an inline write runs
  ``BEGIN IMMEDIATE``, its ``INSERT`` and ``COMMIT``, preceded by a ``synchronous``
  pragma only when the level changes, and a barrier after a failed switch still commits
  under ``FULL``;
* a caller's rows are visible to another connection the moment its call returns;
* a refused or failed write in a shared commit rolls back alone;
* a failing ``COMMIT`` fails every write and run in it, and the logs stay valid and
  resumable on a new store object;
* a write withdrawn by cancellation before its commit started writes nothing;
* an inline write never waits on the event loop for another connection's write lock,
  and neither connection has its busy timeout switched to make that so;
* ``_group_commit=False`` (one transaction per write) still passes the contract.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

import polyloop.stores._sqlite as sqlite_module
from agent_kit import (
    SIX_STEP_WRITES,
    Ledger,
    definition,
    kinds,
    make_tools,
    request,
    same_outcome,
    six_step_script,
    uninterrupted,
)
from polyloop import Replay, RunEnded, StopReason, resume, run
from polyloop.ports import Store
from polyloop.serialization import dumps
from polyloop.stores import SqliteStore
from polyloop.testing.store_contract import (
    DurableStoreContract,
    apply,
    expected_records,
    sample_run,
)
from polyloop.types import (
    Intent,
    Record,
    RunAlreadyExists,
    RunLocked,
    RunResult,
    StoreError,
)

pytestmark = pytest.mark.anyio

FULL, NORMAL = 2, 1
_NAME = {FULL: "FULL", NORMAL: "NORMAL"}
BARRIER_KINDS = frozenset({"run_started", "intent"})
_real_connect = sqlite3.connect


# -- a connection that records every commit ------------------------------------------------


@dataclass
class Commit:
    """One ``COMMIT``: the synchronous level SQLite reported, and the rows it held."""

    level: int
    rows: list[tuple[Any, str]]  # (run id as bound, kind)

    @property
    def runs(self) -> set[Any]:
        return {run_id for run_id, _ in self.rows}

    @property
    def has_barrier(self) -> bool:
        return any(kind in BARRIER_KINDS for _, kind in self.rows)


@dataclass
class Recorder:
    """What the store's connections did, and an optional fault for one ``COMMIT``.

    ``fail`` decides, from the commit about to happen, whether it fails: ``"commit"``
    (nothing lands), ``"after-commit"`` (it lands, the call still fails) or None.
    """

    commits: list[Commit] = field(default_factory=list)
    fail: Callable[[Commit], str | None] | None = None
    failed: list[Commit] = field(default_factory=list)


class RecordingConnection(sqlite3.Connection):
    recorder: Recorder
    pending: list[tuple[Any, str]]
    marks: list[int]

    def executemany(self, statement: str, rows: Any, /) -> sqlite3.Cursor:
        rows = list(rows)
        cursor = super().executemany(statement, rows)
        if statement.startswith("INSERT INTO records"):
            self.pending += [(row[0], row[2]) for row in rows]
        return cursor

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        if statement == "COMMIT":
            return self._commit()
        cursor = super().execute(statement, parameters)
        if statement in ("BEGIN IMMEDIATE", "ROLLBACK"):
            self.pending, self.marks = [], []
        elif statement.startswith("SAVEPOINT"):
            self.marks.append(len(self.pending))
        elif statement.startswith("ROLLBACK TO"):
            del self.pending[self.marks[-1]:]
        elif statement.startswith("RELEASE"):
            self.marks.pop()
        return cursor

    def _commit(self) -> sqlite3.Cursor:
        level = super().execute("PRAGMA synchronous").fetchone()[0]
        commit = Commit(level, self.pending)
        self.pending = []
        stage = self.recorder.fail(commit) if self.recorder.fail else None
        if stage == "commit":
            self.recorder.failed.append(commit)
            raise sqlite3.OperationalError("disk I/O error")
        cursor = super().execute("COMMIT")
        if commit.rows:  # not the schema's own transaction
            self.recorder.commits.append(commit)
        if stage == "after-commit":
            self.recorder.failed.append(commit)
            raise sqlite3.OperationalError("disk I/O error")
        return cursor


def install_recorder(
    monkeypatch: pytest.MonkeyPatch, factory: type[RecordingConnection] = RecordingConnection
) -> Recorder:
    """Make the SQLite store module's connections (of class ``factory``) record commits."""
    found = Recorder()

    class Sqlite3:
        def __getattr__(self, name: str) -> Any:
            return getattr(sqlite3, name)

        @staticmethod
        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = _real_connect(*args, factory=factory, **kwargs)
            assert isinstance(conn, RecordingConnection)
            conn.recorder, conn.pending, conn.marks = found, [], []
            return conn

    monkeypatch.setattr(sqlite_module, "sqlite3", Sqlite3())
    return found


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Make the SQLite store module's connections record their commits."""
    return install_recorder(monkeypatch)


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The run ids of every batch a store committed in a worker thread."""
    seen: list[list[str]] = []
    commit_batch = SqliteStore._commit_batch

    def recording(self: SqliteStore, writes: Any) -> Any:
        seen.append([write.run_id for write in writes])
        return commit_batch(self, writes)

    monkeypatch.setattr(SqliteStore, "_commit_batch", recording)
    return seen


@contextmanager
def raw(path: Path) -> Iterator[sqlite3.Connection]:
    """A plain connection of the test's own, next to the store's."""
    with closing(_real_connect(path, isolation_level=None)) as conn:
        yield conn


def intent(run_id: str, k: int = 0) -> Intent:
    _, (found,) = sample_run(run_id, steps=k + 1)[1 + 4 * k]
    assert isinstance(found, Intent)
    return found


async def run_many(store: Any, run_ids: list[str]) -> dict[str, RunResult]:
    """The six-step run under every id at once through ``store``."""
    results: dict[str, RunResult] = {}

    async def one(run_id: str) -> None:
        results[run_id] = await run(definition(store, script=six_step_script()),
                                    request(run_id, make_tools(Ledger())))

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    return results


# -- sharing commits, and the inline path ---------------------------------------------------


async def test_concurrent_runs_share_commits(tmp_path: Path, recorder: Recorder) -> None:
    run_ids = [f"run-{i}" for i in range(50)]
    async with SqliteStore(tmp_path / "runs.db") as store:
        results = await run_many(store, run_ids)
        for run_id in run_ids:
            assert results[run_id].stop_reason is StopReason.SUBMITTED
            records = (await store.read_log(run_id)).records
            assert len(records) == SIX_STEP_WRITES + 5  # five write_steps hold two rows
            assert {record.run_id for record in records} == {run_id}
    writes = len(run_ids) * SIX_STEP_WRITES
    assert sum(len(commit.rows) for commit in recorder.commits) == len(run_ids) * 30
    assert len(recorder.commits) < writes / 5
    assert max(len(commit.runs) for commit in recorder.commits) > 10


async def test_one_commit_per_write_without_group_commit(
    tmp_path: Path, recorder: Recorder
) -> None:
    run_ids = [f"run-{i}" for i in range(10)]
    async with SqliteStore(tmp_path / "runs.db", _group_commit=False) as store:
        results = await run_many(store, run_ids)
    assert all(result.stop_reason is StopReason.SUBMITTED for result in results.values())
    assert len(recorder.commits) == len(run_ids) * SIX_STEP_WRITES
    assert all(commit.level == FULL for commit in recorder.commits)


async def test_a_lone_run_writes_without_a_thread_hop(
    tmp_path: Path, recorder: Recorder, batches: list[list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        monkeypatch.setattr(store._gate, "limit_s", 60.0)  # however slow this disk is
        result = await uninterrupted(lambda: store, Replay.NEVER, six_step_script())
        assert result.stop_reason is StopReason.SUBMITTED
    assert batches == []  # no write went through a worker thread
    assert len(recorder.commits) == SIX_STEP_WRITES


async def test_a_slow_sync_sends_writes_to_worker_threads(
    tmp_path: Path, batches: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        monkeypatch.setattr(store._gate, "limit_s", 1e-9)  # every sync counts as slow
        await apply(store, sample_run("r1", steps=1))
    # The first write ran inline (nothing timed yet), then every later one in a thread.
    assert len(batches) == len(sample_run("r1", steps=1)) - 1


# -- durability levels ----------------------------------------------------------------------


@pytest.mark.parametrize("runs", [1, 30])
async def test_barriers_commit_under_full_and_only_non_barriers_under_normal(
    tmp_path: Path, recorder: Recorder, runs: int
) -> None:
    async with SqliteStore(tmp_path / "runs.db") as store:
        await run_many(store, [f"run-{i}" for i in range(runs)])
    barriers = [commit for commit in recorder.commits if commit.has_barrier]
    others = [commit for commit in recorder.commits if not commit.has_barrier]
    assert barriers
    assert all(commit.level == FULL for commit in barriers)
    # A transaction without a barrier does not pay for an fsync. (Shared commits of many
    # runs nearly always hold some barrier; a lone run's results and steps never do.)
    assert all(commit.level == NORMAL for commit in others)
    if runs == 1:
        assert len(others) == SIX_STEP_WRITES - len(barriers)


class LoggingConnection(sqlite3.Connection):
    """Keeps every statement it runs (``execute`` and ``executemany`` alike)."""

    log: list[str]

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        self.log.append(statement)
        return super().execute(statement, parameters)

    def executemany(self, statement: str, rows: Any, /) -> sqlite3.Cursor:
        self.log.append(statement)
        return super().executemany(statement, rows)


async def test_an_inline_write_switches_the_level_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[LoggingConnection] = []

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = _real_connect(*args, factory=LoggingConnection, **kwargs)
        assert isinstance(conn, LoggingConnection)
        conn.log = []
        made.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    # Starts with two barriers in a row; a second result after the first makes two
    # non-barriers in a row (the store does not look into what a result says).
    writes = sample_run("r1", steps=2)
    writes.insert(3, writes[2])
    switches = 0
    async with SqliteStore(tmp_path / "runs.db") as store:
        monkeypatch.setattr(store._gate, "limit_s", 60.0)  # however slow this disk is
        await store.claim_run("r1")  # in a worker thread, before any write
        worker, inline = made
        worker.log.clear()
        inline.log.clear()
        level = FULL  # as the store opened it
        for method, args in writes:
            await getattr(store, method)(*args)
            wanted = FULL if method in ("start_run", "write_intent") else NORMAL
            expected = [] if wanted == level else [f"PRAGMA synchronous={_NAME[wanted]}"]
            switches += wanted != level
            level = wanted
            # The records' rows, then the run's row moved on in the same transaction.
            run_row = "UPDATE runs"  # the claim made the run's row, even for its start
            expected += ["BEGIN IMMEDIATE", "INSERT INTO records", run_row, "COMMIT"]
            assert [_statement(sql) for sql in inline.log] == expected, method
            assert inline.execute("PRAGMA synchronous").fetchone()[0] == level
            assert not inline.in_transaction
            inline.log.clear()
        assert worker.log == []  # a lone run's writes never needed the worker connection
    assert 0 < switches < len(writes) - 1


def _statement(sql: str) -> str:
    """What a statement is, without its columns and values: ``INSERT INTO records``."""
    words = sql.split()
    if words[0] == "INSERT":
        return " ".join(words[:3]).split("(")[0].strip()
    if words[0] == "UPDATE":
        return " ".join(words[:2])
    return sql


class _FailsSwitchingOnce(RecordingConnection):
    """Switches to ``NORMAL`` as asked, then reports an error, once per test."""

    failures: ClassVar[list[bool]] = []  # set by the test

    def execute(self, statement: str, parameters: Any = (), /) -> sqlite3.Cursor:
        cursor = super().execute(statement, parameters)
        if statement == "PRAGMA synchronous=NORMAL" and self.failures:
            self.failures.pop()
            raise sqlite3.OperationalError("disk I/O error")
        return cursor


async def test_a_barrier_after_a_failed_level_switch_still_commits_under_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_FailsSwitchingOnce, "failures", [True])
    recorder = install_recorder(monkeypatch, _FailsSwitchingOnce)
    start_1, start_2 = sample_run("r1")[0], sample_run("r2")[0]
    _, (result,) = sample_run("r1", steps=1)[2]
    async with SqliteStore(tmp_path / "runs.db") as store:
        await apply(store, [start_1])
        await apply(store, [start_2])  # two runs claimed: worker threads from now on
        with pytest.raises(StoreError, match="disk I/O error"):
            await store.write_result(result)  # the connection was left at NORMAL
        await store.write_intent(intent("r2"))
        assert list((await store.read_log("r1")).records) == expected_records([start_1])
    assert _FailsSwitchingOnce.failures == []
    last = recorder.commits[-1]
    assert last.rows == [("r2", "intent")] and last.level == FULL


# -- visibility -----------------------------------------------------------------------------


class Visible:
    """Wraps a store; after every write, another connection must see the rows."""

    def __init__(self, store: SqliteStore, path: Path) -> None:
        self.store, self.path = store, path
        self.checked = 0

    def parameters(self) -> Any:
        return self.store.parameters()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        async def checked(*args: Any) -> Any:
            result = await method(*args)
            if name == "write_step":  # the action result's row comes first
                self._expect([record for record in (args[1], args[0]) if record is not None])
            elif name in ("start_run", "write_intent", "write_result", "end_run"):
                self._expect([args[0]])
            return result

        return checked

    def _expect(self, records: list[Record]) -> None:
        with raw(self.path) as db:
            found = db.execute("SELECT body FROM records WHERE run_id = ? ORDER BY seq DESC "
                               "LIMIT ?", (records[0].run_id, len(records))).fetchall()
        assert [body for (body,) in reversed(found)] == [dumps(r) for r in records]
        self.checked += 1


@pytest.mark.parametrize("runs", [1, 20])
async def test_rows_are_visible_to_another_connection_when_the_call_returns(
    tmp_path: Path, runs: int
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        visible = Visible(store, path)
        results = await run_many(visible, [f"run-{i}" for i in range(runs)])
    assert all(result.stop_reason is StopReason.SUBMITTED for result in results.values())
    assert visible.checked == runs * SIX_STEP_WRITES


# -- refusals and failures inside a shared commit ---------------------------------------------


@dataclass
class Hold:
    """A trigger that holds the commit writing an intent of run ``held`` until released."""

    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def gate(self) -> int:
        self.entered.set()
        self.release.wait(10)
        return 0

    def install(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            conn = _real_connect(*args, **kwargs)
            conn.create_function("gate", 0, self.gate)
            return conn

        monkeypatch.setattr(sqlite3, "connect", connect)
        with raw(path) as db:
            db.execute("CREATE TRIGGER hold AFTER INSERT ON records WHEN NEW.kind = 'intent' "
                       "AND NEW.run_id = 'held' BEGIN SELECT gate(); END")

    async def entered_(self) -> None:
        assert await anyio.to_thread.run_sync(self.entered.wait, 5)


async def _started(path: Path, *run_ids: str) -> None:
    async with SqliteStore(path) as store:
        for run_id in run_ids:
            await apply(store, sample_run(run_id, steps=0, ended=False))


async def test_a_refused_or_failed_write_rolls_back_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batches: list[list[str]]
) -> None:
    path = tmp_path / "runs.db"
    await _started(path, "held", "ok-1", "ok-2", "exists", "locked", "doomed", "half")
    with raw(path) as db:
        db.execute("CREATE TRIGGER doom BEFORE INSERT ON records WHEN NEW.run_id = 'doomed' "
                   "BEGIN SELECT RAISE(ABORT, 'doomed refused'); END")
        db.execute("CREATE TRIGGER halve BEFORE INSERT ON records WHEN NEW.run_id = 'half' "
                   "AND NEW.kind = 'step' BEGIN SELECT RAISE(ABORT, 'steps refused'); END")
    hold = Hold()
    hold.install(monkeypatch, path)
    step_writes = sample_run("half", steps=1, ended=False)
    (_, step_args) = step_writes[-1]
    outcomes: dict[str, BaseException | None] = {}

    async with SqliteStore(path) as store, SqliteStore(path) as other:
        # No write of ``store`` runs inline (on the event loop, which the held commit
        # would block): every sync counts as slow.
        monkeypatch.setattr(store._gate, "limit_s", 0.0)
        await other.claim_run("locked")  # another store object holds "locked"
        await other.write_intent(intent("locked"))
        with pytest.raises(RunLocked):
            await store.claim_run("locked")
        # Claimed before the commit is held (a claim needs the store's connection).
        for run_id in ("held", "ok-1", "ok-2", "exists", "ghost", "doomed", "half"):
            await store.claim_run(run_id)

        async def write(name: str, call: Callable[[], Any]) -> None:
            try:
                await call()
            except Exception as exc:  # noqa: BLE001 -- the outcome is what is checked
                outcomes[name] = exc
            else:
                outcomes[name] = None

        async with anyio.create_task_group() as group:
            group.start_soon(write, "held", lambda: store.write_intent(intent("held")))
            await hold.entered_()  # a shared commit is running: the next ones wait together
            calls: dict[str, Callable[[], Any]] = {
                "ok-1": lambda: store.write_intent(intent("ok-1")),
                "exists": lambda: store.start_run(sample_run("exists")[0][1][0]),
                "locked": lambda: store.write_intent(intent("locked")),
                "ghost": lambda: store.write_intent(intent("ghost")),
                "doomed": lambda: store.write_intent(intent("doomed")),
                "half": lambda: store.write_step(*step_args),
                "ok-2": lambda: store.write_intent(intent("ok-2")),
            }
            for name, call in calls.items():
                group.start_soon(write, name, call)
            await anyio.wait_all_tasks_blocked()
            hold.release.set()
        assert sorted(batches[-1]) == sorted(calls)  # all of them shared one commit

        assert outcomes["held"] is None and outcomes["ok-1"] is None and outcomes["ok-2"] is None
        assert isinstance(outcomes["exists"], RunAlreadyExists)
        assert isinstance(outcomes["locked"], RunLocked)
        assert isinstance(outcomes["ghost"], StoreError)
        assert "never started" in str(outcomes["ghost"])
        for name, message in (("doomed", "doomed refused"), ("half", "steps refused")):
            error = outcomes[name]
            assert isinstance(error, StoreError) and message in str(error)
            assert isinstance(error.__cause__, sqlite3.Error)
            # A failed run stays failed for this store object; the others go on.
            with pytest.raises(StoreError, match="earlier write"):
                await store.write_intent(intent(name, 1))
        await store.write_intent(intent("ok-1", 1))

        for run_id in ("held", "ok-2"):
            assert (await store.read_log(run_id)).records[-1] == intent(run_id)
        assert list((await store.read_log("ok-1")).records)[-2:] == [intent("ok-1"),
                                                                      intent("ok-1", 1)]
        for run_id in ("exists", "doomed", "half"):
            assert len((await store.read_log(run_id)).records) == 1  # only its start
        assert (await store.read_log("locked")).records[1:] == (intent("locked"),)  # other's
        assert (await store.read_log("ghost")).records == ()
    with raw(path) as db:
        seqs = db.execute("SELECT seq FROM records WHERE run_id = 'ok-1' ORDER BY seq")
        assert [seq for (seq,) in seqs] == [0, 1, 2]


@pytest.mark.parametrize("stage", ["commit", "after-commit"])
async def test_a_failing_commit_fails_every_run_in_it_and_the_logs_resume(
    tmp_path: Path, recorder: Recorder, stage: str
) -> None:
    path = tmp_path / "runs.db"
    run_ids = [f"run-{i}" for i in range(12)]

    def fail(commit: Commit) -> str | None:
        # The first shared commit of many runs, once the runs are well under way.
        if not recorder.failed and len(recorder.commits) > 10 and len(commit.runs) >= 3:
            return stage
        return None

    recorder.fail = fail
    results: dict[str, RunResult | StoreError] = {}
    store = SqliteStore(path)

    async def one(run_id: str) -> None:
        try:
            results[run_id] = await run(
                definition(store, script=six_step_script()),
                request(run_id, make_tools(Ledger(), replay=Replay.ALLOWED),
                        model_replay=Replay.ALLOWED))
        except StoreError as exc:
            results[run_id] = exc

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    recorder.fail = None
    (failed_commit,) = recorder.failed
    doomed = {str(key) for key in failed_commit.runs}
    assert len(doomed) >= 3
    assert {run_id for run_id, r in results.items() if isinstance(r, StoreError)} == doomed
    for run_id in doomed:
        error = results[run_id]
        assert isinstance(error, StoreError) and error.run_id == run_id
        assert isinstance(error.__cause__, sqlite3.OperationalError)
        with pytest.raises(StoreError, match="earlier write"):
            await store.write_intent(intent(run_id, 9))
    await store.aclose()

    async with SqliteStore(path) as reopened:
        for run_id in run_ids:
            clean = await uninterrupted(lambda: SqliteStore(tmp_path / "clean.db"),
                                        Replay.ALLOWED, six_step_script(), run_id=run_id)
            result = results[run_id]
            if run_id in doomed:
                recover = resume if (await reopened.read_log(run_id)).records else run
                result = await recover(
                    definition(reopened, script=six_step_script()),
                    request(run_id, make_tools(Ledger(), replay=Replay.ALLOWED),
                            model_replay=Replay.ALLOWED))
            assert isinstance(result, RunResult) and same_outcome(result, clean)
            log = (await reopened.read_log(run_id)).records
            assert isinstance(log[-1], RunEnded)
            assert kinds(log).count("RunEnded") == 1


# -- cancellation ---------------------------------------------------------------------------


async def test_a_write_cancelled_before_its_commit_starts_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    await _started(path, "held", "r1")
    hold = Hold()
    hold.install(monkeypatch, path)
    scope = anyio.CancelScope()
    after_write: list[bool] = []

    async with SqliteStore(path) as store:
        monkeypatch.setattr(store._gate, "limit_s", 0.0)  # no inline write (see above)
        await store.claim_run("held")
        await store.claim_run("r1")

        async def cancelled_write() -> None:
            with scope:
                await store.write_intent(intent("r1"))
                after_write.append(True)

        async with anyio.create_task_group() as group:
            group.start_soon(store.write_intent, intent("held"))
            await hold.entered_()
            group.start_soon(cancelled_write)
            await anyio.wait_all_tasks_blocked()  # waiting to join the next commit
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            hold.release.set()
        assert scope.cancelled_caught and after_write == []
        # Nothing is left waiting: a lone run may write inline again.
        assert store._group is not None and store._group.idle
        assert list((await store.read_log("r1")).records) == expected_records(
            sample_run("r1", steps=0, ended=False))
        # The withdrawn write left no gap: the run goes on from where it was.
        await store.write_intent(intent("r1"))
        assert (await store.read_log("r1")).records[-1] == intent("r1")
    with raw(path) as db:
        seqs = db.execute("SELECT seq FROM records WHERE run_id = 'r1' ORDER BY seq")
        assert [seq for (seq,) in seqs] == [0, 1]


async def test_a_started_commit_completes_when_its_leader_is_cancelled_waiting_for_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    await _started(path, "r1", "r2")
    release = threading.Event()
    scope = anyio.CancelScope()
    async with SqliteStore(path) as store:
        monkeypatch.setattr(store._gate, "limit_s", 0.0)  # every write in a shared commit
        await store.claim_run("r1")  # while worker threads are free
        await store.claim_run("r2")

        async def lead() -> None:
            with scope:
                await store.write_intent(intent("r1"))

        async with anyio.create_task_group() as group:
            try:
                # Every worker thread busy: the commit, once started, waits for one.
                limiter = anyio.to_thread.current_default_thread_limiter()
                for _ in range(int(limiter.total_tokens)):
                    group.start_soon(anyio.to_thread.run_sync, release.wait)
                await anyio.wait_all_tasks_blocked()
                group.start_soon(lead)
                group.start_soon(store.write_intent, intent("r2"))  # joins the same commit
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
            finally:
                release.set()
        assert scope.cancelled_caught
        # The commit ran for both writes, the cancelled leader's included.
        for run_id in ("r1", "r2"):
            assert (await store.read_log(run_id)).records[-1] == intent(run_id)


@pytest.mark.parametrize("group_commit", [True, False])
async def test_a_write_in_a_cancelled_scope_writes_nothing(
    tmp_path: Path, group_commit: bool
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path, _group_commit=group_commit) as store:
        await apply(store, sample_run("r1", steps=0, ended=False))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.write_intent(intent("r1"))
        assert scope.cancelled_caught
        assert len((await store.read_log("r1")).records) == 1


# -- the inline path never blocks the event loop on another connection --------------------


async def test_an_inline_write_does_not_wait_for_another_writer_on_the_loop(
    tmp_path: Path, batches: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "runs.db"
    ticks = 0
    async with SqliteStore(path) as store:
        monkeypatch.setattr(store._gate, "limit_s", 60.0)  # however slow this disk is
        await apply(store, sample_run("r1", steps=0, ended=False))
        assert batches == []
        with raw(path) as db:
            db.execute("BEGIN IMMEDIATE")  # holds the database's write lock
            done = anyio.Event()

            async def write() -> None:
                await store.write_intent(intent("r1"))
                done.set()

            # A write blocking the event loop for the busy timeout would end past this.
            with anyio.fail_after(10):
                async with anyio.create_task_group() as group:
                    group.start_soon(write)
                    while ticks < 5:  # the event loop keeps running meanwhile
                        await anyio.sleep(0.01)
                        ticks += 1
                    assert not done.is_set()
                    db.execute("COMMIT")
        assert batches == [["r1"]]  # it waited in a worker thread instead
        assert (await store.read_log("r1")).records[-1] == intent("r1")
        # Neither connection had its busy timeout switched for that, and with the
        # database free again the next write is inline once more.
        assert store._inline is not None and store._worker is not None
        assert store._inline.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0
        assert store._worker.conn.execute("PRAGMA busy_timeout").fetchone()[0] > 0
        await store.write_intent(intent("r1", 1))
        assert batches == [["r1"]]
        started = expected_records(sample_run("r1", steps=0, ended=False))
        assert list((await store.read_log("r1")).records) == [
            *started, intent("r1"), intent("r1", 1)]


# -- seq counters and writer locks -----------------------------------------------------------


async def test_the_next_seq_is_read_again_when_a_run_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    writes = sample_run("r1", steps=2, ended=False)
    first, second = SqliteStore(path), SqliteStore(path)
    await apply(first, writes[:3])
    await first.aclose()  # gives the run up
    await apply(second, writes[3:6])
    await second.aclose()
    third = SqliteStore(path)
    await apply(third, writes[6:])
    assert list((await third.read_log("r1")).records) == expected_records(writes)
    await third.aclose()
    with raw(path) as db:
        seqs = db.execute("SELECT seq FROM records WHERE run_id = 'r1' ORDER BY seq")
        assert [seq for (seq,) in seqs] == list(range(len(expected_records(writes))))


# -- the one-commit-per-write baseline still keeps the contract -------------------------------


class TestSqliteWithoutGroupCommit(DurableStoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Callable[[], Store]:
        return lambda: SqliteStore(tmp_path / "runs.db", _group_commit=False)

    @pytest.fixture
    def store_reference(self, tmp_path: Path) -> tuple[str, list[Any]]:
        return ("polyloop.stores:SqliteStore", [str(tmp_path / "runs.db")])
