"""Where stores run their blocking calls: shared commits in worker threads, never the loop.

:class:`GroupCommit` on its own, a failed shared sync of the JSON-lines store, and, for
every durable store, a watch on each blocking call (file operations, ``sqlite3``,
``psycopg``) through whole runs, one alone and several at once: none runs on the event
loop's thread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import InterruptedModel, Ledger, definition, make_tools, six_step_script
from kit.agent import request as run_request
from kit.store import jsonl_store_on
from polyloop import RunState, recover, run, run_status, start_or_resume
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._batching import GroupCommit
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.testing.store_contract import apply, expected_records, sample_run
from polyloop.types import Replay, RunEnded, StopReason, StoreError

pytestmark = pytest.mark.anyio


def idle(group: GroupCommit[Any]) -> bool:
    """No batch of ``group`` runs or waits."""
    return group._active == 0 and group._open is None


class Recorder:
    """A blocking commit that remembers every batch, optionally held until released."""

    def __init__(self, *, fail: frozenset[str] = frozenset()) -> None:
        self.batches: list[list[str]] = []
        self.committed: set[str] = set()
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, items: Sequence[str]) -> list[BaseException | None]:
        self.entered.set()
        self.gate.wait(10)
        self.batches.append(list(items))
        errors: list[BaseException | None] = []
        for item in items:
            if item in self.fail:
                errors.append(ValueError(f"refused {item}"))
            else:
                self.committed.add(item)
                errors.append(None)
        return errors


# -- GroupCommit ----------------------------------------------------------------------------


async def test_items_waiting_together_share_a_commit() -> None:
    commit = Recorder()
    group = GroupCommit(commit)
    commit.gate.clear()
    returned: list[str] = []

    async def submit(item: str) -> None:
        await group.submit(item)
        assert item in commit.committed  # released only after its own commit
        returned.append(item)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(submit, "first")
        await anyio.to_thread.run_sync(commit.entered.wait, 10)
        for index in range(20):
            tasks.start_soon(submit, f"item-{index}")
        await anyio.wait_all_tasks_blocked()
        commit.gate.set()
    assert sorted(returned) == sorted(["first", *(f"item-{i}" for i in range(20))])
    assert commit.batches[0] == ["first"]
    assert len(commit.batches) == 2  # all twenty waited for the same next commit
    assert sorted(commit.batches[1]) == sorted(f"item-{i}" for i in range(20))
    assert idle(group)


async def test_each_caller_gets_its_own_items_error() -> None:
    commit = Recorder(fail=frozenset({"bad"}))
    group = GroupCommit(commit)
    outcomes: dict[str, str] = {}

    async def submit(item: str) -> None:
        try:
            await group.submit(item)
        except ValueError as exc:
            outcomes[item] = str(exc)
        else:
            outcomes[item] = "ok"

    async with anyio.create_task_group() as tasks:
        for item in ("good-1", "bad", "good-2"):
            tasks.start_soon(submit, item)
    assert outcomes == {"good-1": "ok", "bad": "refused bad", "good-2": "ok"}


async def test_a_commit_that_raises_fails_every_item_of_its_batch() -> None:
    calls: list[list[str]] = []

    def broken(items: Sequence[str]) -> list[BaseException | None]:
        calls.append(list(items))
        raise OSError("disk gone")

    group = GroupCommit(broken)
    for item in ("a", "b"):
        with pytest.raises(OSError, match="disk gone"):
            await group.submit(item)
    assert calls == [["a"], ["b"]]
    assert idle(group)


async def test_cancelled_before_its_batch_starts_nothing_is_committed() -> None:
    commit = Recorder()
    group = GroupCommit(commit)
    commit.gate.clear()
    cancelled = False

    async def late() -> None:
        nonlocal cancelled
        with anyio.CancelScope() as scope:
            scope.cancel()  # delivered at its first wait
            try:
                await group.submit("late")
            except anyio.get_cancelled_exc_class():
                cancelled = True
                raise

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(group.submit, "running")
        await anyio.to_thread.run_sync(commit.entered.wait, 10)
        tasks.start_soon(late)
        await anyio.wait_all_tasks_blocked()
        commit.gate.set()
    assert cancelled
    assert commit.batches == [["running"]]
    assert "late" not in commit.committed
    assert idle(group)


async def test_a_leader_cancelled_before_its_batch_starts_hands_it_on() -> None:
    commit = Recorder()
    group = GroupCommit(commit)
    commit.gate.clear()
    lead = anyio.CancelScope()
    cancelled = False

    async def leader() -> None:
        nonlocal cancelled
        with lead:
            try:
                await group.submit("leader")
            except anyio.get_cancelled_exc_class():
                cancelled = True
                raise

    with anyio.fail_after(10):  # a batch left without a leader would wait forever
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(group.submit, "running")
            await anyio.to_thread.run_sync(commit.entered.wait, 10)
            tasks.start_soon(leader)  # the first of the next batch, waiting for its turn
            await anyio.wait_all_tasks_blocked()
            for name in ("second", "third"):
                tasks.start_soon(group.submit, name)
            await anyio.wait_all_tasks_blocked()
            lead.cancel()
            await anyio.wait_all_tasks_blocked()
            commit.gate.set()
    assert cancelled
    # Trio starts tasks in any order: the two share the second commit, in either order.
    assert [sorted(batch) for batch in commit.batches] == [["running"], ["second", "third"]]
    assert idle(group)


async def test_cancelled_after_its_batch_started_the_item_is_committed() -> None:
    commit = Recorder()
    group = GroupCommit(commit)
    commit.gate.clear()
    outcome: list[str] = []

    async def follower(scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await group.submit("follower")
            except anyio.get_cancelled_exc_class():
                outcome.append(
                    "cancelled after commit"
                    if "follower" in commit.committed
                    else "cancelled before commit"
                )
                raise

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(group.submit, "leader")
        await anyio.to_thread.run_sync(commit.entered.wait, 10)
        tasks.start_soon(follower, scope)
        await anyio.wait_all_tasks_blocked()
        commit.entered.clear()
        leaders_gate, commit.gate = commit.gate, threading.Event()
        leaders_gate.set()  # the leader's batch ends; the follower's starts and waits
        await anyio.to_thread.run_sync(commit.entered.wait, 10)
        scope.cancel()
        commit.gate.set()
    assert outcome == ["cancelled after commit"]
    assert commit.batches == [["leader"], ["follower"]]


async def test_a_cancelled_caller_gives_a_stuck_commit_up_with_abandon() -> None:
    """A caller cancelled in a commit that does not end (a silent network) stops waiting
    after ``cancelled_wait_s`` and its item is handed to ``abandon``; the commit ends on its
    own later, and the next batch then runs."""
    commit = Recorder()
    abandoned: list[str] = []
    gave_up = anyio.Event()

    def abandon(item: str) -> None:
        abandoned.append(item)
        gave_up.set()

    group = GroupCommit(commit, abandon=abandon, cancelled_wait_s=0.2)
    commit.gate.clear()
    outcome: list[str] = []

    async def caller(item: str, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await group.submit(item)
            except anyio.get_cancelled_exc_class():
                outcome.append(f"{item} cancelled")
                raise

    stuck, waiting = anyio.CancelScope(), anyio.CancelScope()
    with anyio.fail_after(10):  # without ``abandon`` the cancelled callers would wait
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(caller, "leader", stuck)
            await anyio.to_thread.run_sync(commit.entered.wait, 10)
            tasks.start_soon(caller, "next", waiting)
            await anyio.wait_all_tasks_blocked()
            stuck.cancel()
            await gave_up.wait()
            assert outcome == ["leader cancelled"]
            assert not idle(group)  # the commit still runs: the next batch waits its turn
            commit.gate.set()
    assert abandoned == ["leader"]
    assert commit.batches == [["leader"], ["next"]]  # in order, one after the other
    assert "next cancelled" not in outcome
    assert idle(group)


async def test_parallel_batches_run_at_once_up_to_the_limit() -> None:
    running = 0
    most = 0
    calls: list[int] = []
    lock = threading.Lock()
    release = threading.Event()

    def commit(items: Sequence[str]) -> list[BaseException | None]:
        nonlocal running, most
        with lock:
            calls.append(len(items))
            running += 1
            most = max(most, running)
        release.wait(10)
        with lock:
            running -= 1
        return [None] * len(items)

    group = GroupCommit(commit, parallel=3)
    async with anyio.create_task_group() as tasks:
        for index in range(10):  # one by one: each finds the previous batches running
            tasks.start_soon(group.submit, f"item-{index}")
            await anyio.wait_all_tasks_blocked()
        for _ in range(500):  # wait until three threads are in commit
            if most == 3:
                break
            await anyio.sleep(0.01)
        release.set()
    assert most == 3
    assert calls == [1, 1, 1, 7]  # three alone, then everyone who waited, together
    assert idle(group)


def test_parallel_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GroupCommit(lambda items: [None] * len(items), parallel=0)


# -- a failed shared sync of the JSON-lines store ---------------------------------------


class FailingSyncFiles(OsFileOps):
    """Syncs of one run's file fail with EIO once three syncs passed (the three starts);
    everything else is the real thing."""

    def __init__(self, doomed: str) -> None:
        self.doomed = doomed
        self.doomed_fds: set[int] = set()
        self.syncs = 0

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int:
        fd = super().open(path, flags, mode)
        if path.name.startswith(self.doomed):
            self.doomed_fds.add(fd)
        return fd

    def fsync(self, fd: int) -> None:
        self.syncs += 1
        if fd in self.doomed_fds and self.syncs > 3:  # its start succeeds
            raise OSError(errno.EIO, "simulated EIO")
        super().fsync(fd)

    def close(self, fd: int) -> None:
        # A run file is open only for one write: its number may next name another file.
        self.doomed_fds.discard(fd)
        super().close(fd)


async def test_a_failed_shared_sync_fails_only_its_run(tmp_path: Path) -> None:
    files = FailingSyncFiles("doomed")
    names = ["healthy-1", "doomed", "healthy-2"]
    runs = {name: sample_run(name, steps=2) for name in names}
    errors: dict[str, BaseException] = {}

    async def rest(name: str) -> None:
        try:
            await apply(store, runs[name][1:], claim=False)
        except StoreError as exc:
            errors[name] = exc

    async with jsonl_store_on(tmp_path, files) as store:
        for name in names:
            await apply(store, runs[name][:1])
        async with anyio.create_task_group() as tasks:
            for name in names:
                tasks.start_soon(rest, name)
        assert set(errors) == {"doomed"}
        assert errors["doomed"].run_id == "doomed"
        with pytest.raises(StoreError, match="earlier write of this run failed"):
            await store.write_result(runs["doomed"][2][1][0])
        for name in ("healthy-1", "healthy-2"):
            assert list((await store.read_log(name)).records) == expected_records(runs[name])
        # the failed run's log is readable and holds its start and what preceded the fault
        doomed = (await store.read_log("doomed")).records
        assert doomed and list(doomed) == expected_records(runs["doomed"])[: len(doomed)]


# -- no store blocks the event loop ---------------------------------------------------------


class LoopWatch:
    """Notes every blocking call a store makes, and which of them ran on the loop's thread.

    Built inside the test, on the event loop's thread. Watched while :meth:`installed`:
    the file operations on paths under ``root`` (and on the descriptors they open, locks
    included), every ``sqlite3`` connection (each statement step through its progress
    handler) and every ``psycopg`` round trip, connection and pool hand-over.
    """

    def __init__(self, root: Path) -> None:
        self.root = os.fspath(root)
        self.loop_thread = threading.get_ident()
        self.calls: Counter[str] = Counter()
        self.on_loop: list[str] = []
        self.fds: set[int] = set()
        self.mutex = threading.Lock()

    def note(self, what: str) -> None:
        with self.mutex:
            self.calls[what] += 1
            if threading.get_ident() == self.loop_thread:
                self.on_loop.append(what)

    def _ours(self, path: Any) -> bool:
        if isinstance(path, int):
            return path in self.fds
        try:
            return os.fsdecode(os.fspath(path)).startswith(self.root)
        except TypeError:
            return False

    def installed(self, patch: pytest.MonkeyPatch) -> None:
        self._files(patch)
        self._sqlite(patch)
        self._psycopg(patch)

    def _files(self, patch: pytest.MonkeyPatch) -> None:
        real_open, real_close = os.open, os.close

        def opened(path: Any, *args: Any, **kwargs: Any) -> int:
            ours = self._ours(path)
            if ours:
                self.note("open")
            fd = real_open(path, *args, **kwargs)
            if ours:
                with self.mutex:
                    self.fds.add(fd)
            return fd

        def closed(fd: int) -> None:
            if fd in self.fds:
                self.note("close")
                with self.mutex:
                    self.fds.discard(fd)
            real_close(fd)

        patch.setattr(os, "open", opened)
        patch.setattr(os, "close", closed)
        for name in (
            "write",
            "read",
            "pread",
            "fstat",
            "fsync",
            "ftruncate",
            "stat",
            "lstat",
            "unlink",
            "mkdir",
            "listdir",
            "scandir",
            "replace",
            "rename",
            "rmdir",
        ):
            patch.setattr(os, name, self._watched(name, getattr(os, name)))
        patch.setattr(fcntl, "flock", self._watched("flock", fcntl.flock))
        patch.setattr(fcntl, "fcntl", self._watched("fcntl", fcntl.fcntl))

    def _watched(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(target: Any = None, *args: Any, **kwargs: Any) -> Any:
            if target is not None and self._ours(target):
                self.note(name)
            return real(*args, **kwargs) if target is None else real(target, *args, **kwargs)

        return call

    def _sqlite(self, patch: pytest.MonkeyPatch) -> None:
        watch, real_connect = self, sqlite3.connect

        class Watched(sqlite3.Connection):
            def execute(self, *args: Any) -> sqlite3.Cursor:
                watch.note("sqlite3.execute")
                return super().execute(*args)

            def executemany(self, *args: Any) -> sqlite3.Cursor:
                watch.note("sqlite3.execute")
                return super().executemany(*args)

            def executescript(self, *args: Any) -> sqlite3.Cursor:
                watch.note("sqlite3.execute")
                return super().executescript(*args)

            def commit(self) -> None:
                watch.note("sqlite3.commit")
                super().commit()

            def close(self) -> None:
                watch.note("sqlite3.close")
                super().close()

        def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
            watch.note("sqlite3.connect")
            conn = real_connect(*args, factory=Watched, **kwargs)
            # Called from inside every step of every statement, in the thread that steps.
            conn.set_progress_handler(lambda: watch.note("sqlite3.step"), 1)
            return conn

        patch.setattr(sqlite3, "connect", connect)

    def _psycopg(self, patch: pytest.MonkeyPatch) -> None:
        try:
            import psycopg
            import psycopg_pool
        except ImportError:  # only the PostgreSQL store needs it
            return
        watch = self
        real_connect = psycopg.Connection.__dict__["connect"].__func__

        def connect(cls: Any, *args: Any, **kwargs: Any) -> Any:
            watch.note("psycopg.connect")
            return real_connect(cls, *args, **kwargs)

        patch.setattr(psycopg.Connection, "connect", classmethod(connect))
        for owner, name in (
            (psycopg.Connection, "wait"),
            (psycopg.Connection, "close"),
            (psycopg_pool.ConnectionPool, "open"),
            (psycopg_pool.ConnectionPool, "close"),
            (psycopg_pool.ConnectionPool, "getconn"),
            (psycopg_pool.ConnectionPool, "putconn"),
        ):
            patch.setattr(owner, name, self._method(f"psycopg.{name}", getattr(owner, name)))

    def _method(self, what: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
            self.note(what)
            return real(obj, *args, **kwargs)

        return call


# What each store must be seen doing, so that a watch that saw nothing cannot pass.
EXPECTED_CALLS = {
    "jsonl": {"open", "write", "fsync", "fcntl", "fstat", "pread", "close", "listdir", "unlink"},
    "sqlite": {
        "sqlite3.connect",
        "sqlite3.execute",
        "sqlite3.step",
        "sqlite3.close",
        "open",
        "fcntl",
        "fsync",
    },
    "postgres": {
        "psycopg.connect",
        "psycopg.wait",
        "psycopg.getconn",
        "psycopg.putconn",
        "psycopg.close",
        "open",
        "fsync",
    },
}
# Syncs a six-step run asks for: its start and its eleven intents (see kit.agent).
SIX_STEP_BARRIERS = 12


def _open_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    if kind == "jsonl":
        return JsonlStore(tmp_path / "runs")
    if kind == "sqlite":
        return SqliteStore(tmp_path / "runs.db")
    conninfo = request.getfixturevalue("postgres_conninfo")
    from polyloop.stores import PostgresStore

    return PostgresStore(conninfo)


async def _every_kind_of_call(store: Any, run_ids: list[str], archive: Path) -> None:
    """Runs cancelled half-way and recovered, read, listed, asked about, pruned."""
    script = six_step_script()

    def request_for(run_id: str) -> Any:
        return run_request(
            run_id, make_tools(Ledger(), replay=Replay.ALLOWED), model_replay=Replay.ALLOWED
        )

    async def interrupted(run_id: str) -> None:
        with anyio.CancelScope() as scope:

            async def cancel(_: Any) -> None:
                scope.cancel()
                await anyio.lowlevel.checkpoint()

            model = InterruptedModel(script, at=3, before=cancel)
            await run(definition(store, model=model, script=script), request_for(run_id))
        assert scope.cancelled_caught

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(interrupted, run_id)
    assert {stored.run_id for stored in await store.list_runs(unfinished_only=True)} == set(run_ids)
    recovered = await recover(
        definition(store, script=script), store, request_for, max_concurrent=len(run_ids)
    )
    assert sorted(found.run_id for found in recovered) == sorted(run_ids)
    for found in recovered:
        assert found.error is None and found.result is not None
        assert found.result.stop_reason is StopReason.SUBMITTED
    for run_id in run_ids:
        assert (await run_status(store, run_id)).state is RunState.FINISHED
        described = await store.describe_run(run_id)
        assert described is not None and described.finished and not described.claimed
        again = await start_or_resume(definition(store, script=script), request_for(run_id))
        assert again.resumed and again.stop_reason is StopReason.SUBMITTED
        assert isinstance((await store.read_log(run_id)).records[-1], RunEnded)
    assert await store.list_runs(unfinished_only=True) == ()
    pruned = await store.prune(
        finished_before=datetime.now(UTC) + timedelta(minutes=5), archive=archive
    )
    assert sorted(pruned) == sorted(run_ids)
    assert await store.list_runs() == ()


@pytest.mark.parametrize("runs", [1, 8], ids=["one-run", "eight-runs"])
@pytest.mark.parametrize("kind", ["jsonl", "sqlite", "postgres"])
async def test_no_blocking_call_of_a_store_runs_on_the_event_loop_thread(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    runs: int,
) -> None:
    watch = LoopWatch(tmp_path)
    store = _open_store(kind, tmp_path, request)  # connects to nothing yet
    with monkeypatch.context() as patch:
        watch.installed(patch)
        async with store:
            await _every_kind_of_call(
                store, [f"run-{n}" for n in range(runs)], tmp_path / "archive"
            )
    assert watch.on_loop == []
    assert EXPECTED_CALLS[kind] <= set(watch.calls), watch.calls
    if kind == "jsonl":
        assert watch.calls["fsync"] >= SIX_STEP_BARRIERS * runs
