"""Where stores run their blocking writes: the inline gate, group commit, JSONL placement."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import anyio
import pytest

from polyloop.stores import JsonlStore
from polyloop.stores._batching import GroupCommit, InlineSyncGate
from polyloop.stores._fileops import OsFileOps
from polyloop.testing.store_contract import apply, expected_records, sample_run
from polyloop.types import StoreError

pytestmark = pytest.mark.anyio


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


# -- InlineSyncGate -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("writing_runs", "last_sync_s", "allowed"),
    [
        (0, 0.0, True),
        (1, 0.0, True),
        (1, 0.0019, True),
        (1, 0.0021, False),
        (2, 0.0, False),
        (100, 0.0, False),
    ],
)
def test_gate_allows_only_a_lone_run_with_quick_syncs(
    writing_runs: int, last_sync_s: float, allowed: bool
) -> None:
    clock = _Clock()
    gate = InlineSyncGate(limit_s=0.002, clock=clock)
    gate.timed(lambda: clock.advance(last_sync_s))
    assert gate.allows(writing_runs) is allowed


def test_gate_times_a_failing_action_too() -> None:
    clock = _Clock()
    gate = InlineSyncGate(limit_s=0.002, clock=clock)

    def slow_failure() -> None:
        clock.advance(0.003)
        raise OSError("EIO")

    with pytest.raises(OSError, match="EIO"):
        gate.timed(slow_failure)
    assert not gate.allows(1)
    gate.timed(lambda: None)
    assert gate.allows(1)


def test_gate_measures_real_time_by_default() -> None:
    gate = InlineSyncGate(limit_s=0.002)
    gate.timed(lambda: time.sleep(0.005))  # at least 5 ms on any machine
    assert not gate.allows(1)


class _Clock:
    """A clock that moves only when told: the gate's verdicts without timing anything."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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
    assert group.idle


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
    assert group.idle


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
    assert group.idle


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
                outcome.append("cancelled after commit" if "follower" in commit.committed
                               else "cancelled before commit")
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
    assert group.idle


def test_parallel_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GroupCommit(lambda items: [None] * len(items), parallel=0)


# -- where JsonlStore syncs ----------------------------------------------------------------


class ThreadNotingFiles(OsFileOps):
    """The real file operations, noting which thread wrote and synced."""

    def __init__(self, *, sync_delay_s: float = 0.0) -> None:
        self.writes: list[bool] = []
        self.syncs: list[bool] = []
        self.sync_delay_s = sync_delay_s

    def write(self, fd: int, data: bytes | memoryview) -> int:
        self.writes.append(threading.current_thread() is threading.main_thread())
        return super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self.syncs.append(threading.current_thread() is threading.main_thread())
        if self.sync_delay_s:
            time.sleep(self.sync_delay_s)
        super().fsync(fd)


async def test_a_lone_run_appends_and_syncs_on_the_event_loop_thread(tmp_path: Path) -> None:
    files = ThreadNotingFiles()
    writes = sample_run("lone", steps=3)
    async with JsonlStore(tmp_path, _files=files) as store:
        store._gate = InlineSyncGate(limit_s=60.0)  # a busy test machine is not a slow disk
        await apply(store, writes)
        log = await store.read_log("lone")
    assert list(log.records) == expected_records(writes)
    # the claim creates the file and start_run writes it in a worker thread; every later
    # write stays inline
    assert files.writes[0] is False
    assert all(files.writes[1:]) and len(files.writes) == len(writes)
    assert files.syncs[0] is False  # the start's sync, with the file's creation
    assert all(files.syncs[1:]) and len(files.syncs) == 1 + 2 * 3


async def test_several_runs_sync_in_worker_threads(tmp_path: Path) -> None:
    files = ThreadNotingFiles()
    runs = [sample_run(f"run-{index}", steps=2) for index in range(4)]
    async with JsonlStore(tmp_path, _files=files) as store:
        store._gate = InlineSyncGate(limit_s=60.0)  # only the number of runs decides here
        for writes in runs:  # start all four, so the store writes four runs at once
            await apply(store, writes[:1])
        async with anyio.create_task_group() as tasks:
            for writes in runs:
                tasks.start_soon(partial(apply, store, writes[1:], claim=False))
        for index, writes in enumerate(runs):
            assert list((await store.read_log(f"run-{index}")).records) == \
                expected_records(writes)
    intent_syncs = files.syncs[4:]
    assert len(intent_syncs) == 4 * 2 * 2 and not any(intent_syncs[:4])
    assert any(files.writes[4:])  # the plain appends stayed on the loop thread


async def test_a_slow_disk_sends_syncs_to_worker_threads(tmp_path: Path) -> None:
    files = ThreadNotingFiles(sync_delay_s=0.005)
    writes = sample_run("slow", steps=3)
    async with JsonlStore(tmp_path, _files=files) as store:
        await apply(store, writes)
        assert list((await store.read_log("slow")).records) == expected_records(writes)
    assert files.syncs and not any(files.syncs)


class FailingSyncFiles(ThreadNotingFiles):
    """Syncs of one run's file fail with EIO; everything else is the real thing."""

    def __init__(self, doomed: str) -> None:
        super().__init__()
        self.doomed = doomed
        self.doomed_fds: set[int] = set()

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int:
        fd = super().open(path, flags, mode)
        if path.name.startswith(self.doomed):
            self.doomed_fds.add(fd)
        return fd

    def fsync(self, fd: int) -> None:
        if fd in self.doomed_fds and len(self.syncs) > 3:  # its start succeeds
            self.syncs.append(False)
            raise OSError(errno.EIO, "simulated EIO")
        super().fsync(fd)


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

    async with JsonlStore(tmp_path, _files=files) as store:
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


async def test_with_several_runs_only_the_sync_leaves_the_event_loop_thread(
    tmp_path: Path,
) -> None:
    files = ThreadNotingFiles()
    runs = [sample_run(f"run-{index}", steps=2) for index in range(3)]
    async with JsonlStore(tmp_path, _files=files) as store:
        store._gate = InlineSyncGate(limit_s=60.0)  # only the number of runs decides here
        for writes in runs:
            await apply(store, writes[:1])
        writes_before, syncs_before = len(files.writes), len(files.syncs)
        async with anyio.create_task_group() as tasks:
            for writes in runs:
                tasks.start_soon(partial(apply, store, writes[1:], claim=False))
    # every line, intents included, was appended on the loop thread; every sync was not
    assert len(files.writes) - writes_before == 3 * (4 * 2 + 1)
    assert all(files.writes[writes_before:])
    assert len(files.syncs) - syncs_before == 3 * 2 * 2
    assert not any(files.syncs[syncs_before:][:3])
