"""The JSON-lines store: the shared contract, crash recovery at every write, its file rules,
and the per-run lock under which no descriptor is closed during a write or a sync.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polyloop.stores._jsonl.store as jsonl_module
from kit import record as record_kit
from kit.agent import (
    SIX_STEP_INTENT_WRITES,
    SIX_STEP_WRITES,
    Ledger,
    close_store,
    crash_and_resume,
    definition,
    make_tools,
    request,
    same_outcome,
    six_step_script,
    uninterrupted,
)
from kit.record import step
from kit.store import DURABLE_STORE_BACKENDS, jsonl_store_on
from kit.sweep import every_point
from polyloop import resume, run
from polyloop.serialization import dumps
from polyloop.stores import JsonlStore, MemoryStore, _paths
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._paths import fsync_directory as real_fsync_directory
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.testing.store_contract import (
    AWKWARD_RUN_IDS,
    DurableStoreContract,
    apply,
    expected_records,
    sample_run,
)
from polyloop.types import (
    CorruptLog,
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    PolyLoopError,
    Replay,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLocked,
    RunStarted,
    SchemaMajorMismatch,
    StepRecord,
    StopReason,
    StoreError,
    UnloggableValue,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class TestJsonlContract(DurableStoreContract):
    @pytest.fixture
    def store_factory(self, tmp_path: Path) -> Callable[[], JsonlStore]:
        return lambda: JsonlStore(tmp_path / "runs")

    @pytest.fixture
    def store_reference(self, tmp_path: Path) -> tuple[str, list[Any]]:
        return ("polyloop.stores:JsonlStore", [str(tmp_path / "runs")])


# -- helpers ------------------------------------------------------------------------------


def run_file(directory: Path, run_id: str) -> Path:
    return directory / f"{safe_name(run_id)}.jsonl"


def started(run_id: str = "r") -> RunStarted:
    return RunStarted(run_id=run_id, snapshot={"model.name": "m"})


def intent(run_id: str = "r", k: int = 0, kind: IntentKind = IntentKind.ACTION) -> Intent:
    return record_kit.intent(run_id, k, kind, {"name": "double", "n": k})


def result(run_id: str = "r", k: int = 0, text: str = "ok") -> Result:
    return record_kit.result(
        run_id, k, IntentKind.MODEL_CALL, {"call_id": None, "content": text, "reasoning": None}
    )


async def started_run(directory: Path, run_id: str = "r") -> list[Any]:
    """Start ``run_id`` with one intent through a store that is then closed."""
    records: list[Any] = [started(run_id), intent(run_id)]
    async with JsonlStore(directory) as store:
        await store.claim_run(run_id)
        await store.start_run(records[0])
        await store.write_intent(records[1])
    return records


def append_bytes(path: Path, data: bytes) -> None:
    with path.open("ab") as file:
        file.write(data)


def is_regular_fd(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


@pytest.fixture
def short_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``os.write`` on regular files write at most 7 bytes and yield the GIL."""
    real_write = os.write
    calls: list[int] = []

    def write(fd: int, data: Any) -> int:
        if not is_regular_fd(fd):
            return real_write(fd, data)
        calls.append(fd)
        time.sleep(0)
        return real_write(fd, bytes(data[:7]))

    monkeypatch.setattr(os, "write", write)
    return calls


# -- parameters, directory, file names ----------------------------------------------------


async def test_parameters_name_the_format_and_never_the_path(tmp_path: Path) -> None:
    store = JsonlStore(tmp_path / "runs")
    assert store.parameters() == {"kind": "jsonl", "format": "polyloop/1"}
    assert str(tmp_path) not in json.dumps(dict(store.parameters()))
    await store.aclose()


async def test_creates_its_directory_with_parents_and_syncs_new_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []

    def record(directory: Path) -> None:
        synced.append(Path(directory))
        real_fsync_directory(directory)

    monkeypatch.setattr(_paths, "fsync_directory", record)
    directory = tmp_path / "a" / "b" / "runs"
    async with JsonlStore(directory) as store:
        await store.claim_run("r")
        # The claim made the directories (each entry synced into its parent).
        assert synced == [tmp_path, tmp_path / "a", tmp_path / "a" / "b"]
        await store.start_run(started())
    assert run_file(directory, "r").is_file()
    # Each new directory's entry is synced into its parent, then the run file's entry.
    assert synced == [tmp_path, tmp_path / "a", tmp_path / "a" / "b", directory]


@pytest.mark.parametrize("inside", ["", "runs"])
async def test_a_directory_that_cannot_be_made_is_refused_naming_it(
    tmp_path: Path, inside: str
) -> None:
    (tmp_path / "a").write_text("a file, not a directory")
    directory = tmp_path / "a" / inside if inside else tmp_path / "a"
    async with JsonlStore(directory) as store:
        with pytest.raises(StoreError) as error:
            await store.claim_run("r")
        # What is in the way, by its path, and what it is: not the system's bare words.
        in_the_way = f"{tmp_path / 'a'} is a file, not a directory"
        if inside:
            assert error.value.reason == f"cannot create the directory {directory}: {in_the_way}"
        else:
            assert error.value.reason == in_the_way
    assert (tmp_path / "a").read_text() == "a file, not a directory"


@pytest.mark.parametrize("inside", ["", "runs"])
async def test_listing_or_reading_below_a_regular_file_is_refused_naming_it(
    tmp_path: Path, inside: str
) -> None:
    (tmp_path / "a").write_text("a file, not a directory")
    directory = tmp_path / "a" / inside if inside else tmp_path / "a"
    async with JsonlStore(directory) as store:
        with pytest.raises(StoreError, match="Not a directory") as listing:
            await store.list_runs()
        assert f"could not list {directory}" in str(listing.value)
        with pytest.raises(StoreError, match="Not a directory"):
            await store.read_log("r")
    assert (tmp_path / "a").read_text() == "a file, not a directory"


async def test_listing_or_reading_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "typo" / "runs"
    async with JsonlStore(directory) as store:
        assert await store.list_runs() == ()
        assert (await store.read_log("r")).records == ()
    assert not (tmp_path / "typo").exists()


async def test_start_run_syncs_the_file_then_its_directory_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "runs"
    directory.mkdir()
    events: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if is_regular_fd(fd):
            events.append("file")
        real_fsync(fd)

    def fsync_directory(path: Path) -> None:
        events.append(f"dir:{Path(path).name}")
        real_fsync_directory(path)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(_paths, "fsync_directory", fsync_directory)
    async with JsonlStore(directory) as store:
        await store.claim_run("r")
        assert events == []  # claiming a new run syncs nothing yet
        await store.start_run(started())
    assert events == ["file", "dir:runs"]


async def test_write_intent_syncs_the_run_file_and_a_result_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "runs"
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if is_regular_fd(fd):
            synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    async with JsonlStore(directory) as store:
        await store.claim_run("r")
        await store.start_run(started())
        monkeypatch.setattr(os, "fsync", fsync)
        await store.write_result(result())
        assert synced == []
        await store.write_intent(intent())
        assert synced == [run_file(directory, "r").stat().st_ino]


async def test_run_ids_never_escape_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "runs"
    async with JsonlStore(directory) as store:
        for run_id in AWKWARD_RUN_IDS:
            await store.claim_run(run_id)
            await store.start_run(started(run_id))
    assert os.listdir(tmp_path) == ["runs"]
    names = os.listdir(directory)
    locks = [name for name in names if name.startswith(".claims-")]  # the claims' own files
    assert 0 < len(locks) <= 16 and all(name.endswith(".lock") for name in locks)
    entries = [directory / name for name in names if name not in locks]
    assert len(entries) == len(AWKWARD_RUN_IDS)
    assert {p.name for p in entries} == {f"{safe_name(i)}.jsonl" for i in AWKWARD_RUN_IDS}
    for entry in entries:
        assert entry.parent == directory and entry.is_file() and not entry.is_symlink()
        assert len(entry.name.encode()) <= 255


async def test_moved_directory_still_reads_and_resumes(tmp_path: Path) -> None:
    records = await started_run(tmp_path / "before")
    shutil.move(tmp_path / "before", tmp_path / "after")
    async with JsonlStore(tmp_path / "after") as store:
        assert list((await store.read_log("r")).records) == records
        await store.claim_run("r")
        await store.write_result(result())


# -- start, lock, close -------------------------------------------------------------------


async def test_start_run_refuses_a_run_another_store_object_wrote(tmp_path: Path) -> None:
    await started_run(tmp_path)
    before = run_file(tmp_path, "r").read_bytes()
    async with JsonlStore(tmp_path) as late, JsonlStore(tmp_path) as other:
        await late.claim_run("r")
        with pytest.raises(RunAlreadyExists):
            await late.start_run(started())
        assert run_file(tmp_path, "r").read_bytes() == before
        # The refusal changed nothing about the claim: late still holds it and writes...
        with pytest.raises(RunLocked):
            await other.claim_run("r")
        await late.write_result(result())
        # ...and giving it up leaves the started run's file for the next writer.
        await late.release_run("r")
        await other.claim_run("r")
        await other.write_result(result(k=1))
        assert list((await other.read_log("r")).records)[-2:] == [result(), result(k=1)]


@pytest.mark.parametrize("content", [b"", b'{"schema":"polyloop/1","kind":"run_sta'])
async def test_a_file_without_a_complete_line_is_reused_by_start_run(
    tmp_path: Path, content: bytes
) -> None:
    path = run_file(tmp_path, "r")
    path.write_bytes(content)
    async with JsonlStore(tmp_path) as store:
        assert (await store.read_log("r")).records == ()
        await store.claim_run("r")
        with pytest.raises(StoreError, match="never started"):
            await store.write_intent(intent())
        await store.start_run(started())
        assert (await store.read_log("r")).records == (started(),)
    assert path.read_bytes() == (dumps(started()) + "\n").encode()


@pytest.mark.parametrize("content", [None, b"", b'{"schema":"polyloop/1","kind":"run_sta'])
async def test_a_claim_that_starts_nothing_leaves_no_file(
    tmp_path: Path, content: bytes | None
) -> None:
    path = run_file(tmp_path, "r")
    if content is not None:
        path.write_bytes(content)
    async with JsonlStore(tmp_path) as store, JsonlStore(tmp_path) as other:
        await store.claim_run("r")
        # The claim holds the (new or emptied) file, owner-only, locked against others.
        assert path.read_bytes() == b""
        if content is None:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(RunLocked):
            await other.claim_run("r")
        assert await store.describe_run("r") is None
        assert await store.list_runs() == ()
        await store.release_run("r")
        assert not path.exists()
        await store.release_run("r")  # nothing held: nothing happens
        # The id is free again, for any store object.
        await other.claim_run("r")
        await other.start_run(started())
        await other.release_run("r")
    assert path.read_bytes() == (dumps(started()) + "\n").encode()
    # Closing a store that still holds a claim which started nothing removes that file too.
    async with JsonlStore(tmp_path) as store:
        await store.claim_run("unstarted")
        assert run_file(tmp_path, "unstarted").exists()
    assert not run_file(tmp_path, "unstarted").exists()


async def test_writes_after_aclose_are_refused(tmp_path: Path) -> None:
    store = JsonlStore(tmp_path)
    await store.claim_run("r")
    await store.start_run(started())
    await store.aclose()
    before = run_file(tmp_path, "r").read_bytes()
    with pytest.raises(StoreError, match="closed"):
        await store.write_intent(intent())
    with pytest.raises(StoreError, match="closed"):
        await store.claim_run("other")
    with pytest.raises(StoreError, match="closed"):
        await store.start_run(started("other"))
    with pytest.raises(StoreError, match="closed"):
        await store.read_log("r")
    assert run_file(tmp_path, "r").read_bytes() == before
    assert not run_file(tmp_path, "other").exists()


async def test_a_resumed_run_is_locked_from_its_claim_until_end_run(
    tmp_path: Path,
) -> None:
    await started_run(tmp_path)
    before = run_file(tmp_path, "r").read_bytes()
    async with JsonlStore(tmp_path) as holder, JsonlStore(tmp_path) as other:
        # Nobody writes without the claim, and nothing is written by the refusal.
        with pytest.raises(RunLocked, match="does not hold"):
            await holder.write_result(result())
        assert run_file(tmp_path, "r").read_bytes() == before
        await holder.claim_run("r")
        with pytest.raises(RunLocked):
            await other.claim_run("r")
        with pytest.raises(RunLocked):  # not re-entrant either
            await holder.claim_run("r")
        await holder.write_result(result())
        with pytest.raises(RunLocked):
            await other.write_result(result(k=1))
        await holder.end_run(
            RunEnded(
                run_id="r",
                stop_reason=StopReason.CANCELLED,
                final_answer=None,
                steps=0,
                valid_steps=0,
                detail=None,
            )
        )
        # A cancelled end is not final: the next claimant may continue the run.
        await other.claim_run("r")
        await other.write_result(result(k=1))
        with pytest.raises(RunLocked):
            await holder.write_result(result(k=2))
        with pytest.raises(RunLocked):
            await holder.claim_run("r")


async def test_write_step_refuses_a_result_of_another_run(tmp_path: Path) -> None:
    await started_run(tmp_path)
    before = run_file(tmp_path, "r").read_bytes()
    async with JsonlStore(tmp_path) as store:
        await store.claim_run("r")
        with pytest.raises(StoreError, match="belongs to run"):
            await store.write_step(step(), result(run_id="other"))
        await store.write_step(step(), None)
    assert run_file(tmp_path, "r").read_bytes().startswith(before)


async def test_an_unloggable_value_writes_nothing_and_does_not_fail_the_run(
    tmp_path: Path,
) -> None:
    await started_run(tmp_path)
    before = run_file(tmp_path, "r").read_bytes()
    bad = Result(
        run_id="r", result_id="r:0:model", kind=IntentKind.MODEL_CALL, payload={"x": float("nan")}
    )
    async with JsonlStore(tmp_path) as store:
        await store.claim_run("r")
        with pytest.raises(UnloggableValue):
            await store.write_result(bad)
        assert run_file(tmp_path, "r").read_bytes() == before
        await store.write_result(result())


# -- symbolic links and special files -----------------------------------------------------


@pytest.mark.parametrize("dangling", [False, True])
async def test_a_planted_symlink_is_never_followed(tmp_path: Path, dangling: bool) -> None:
    directory = tmp_path / "runs"
    directory.mkdir()
    target = tmp_path / "precious.txt"
    if not dangling:
        target.write_bytes(b"keep me\n")
    run_file(directory, "r").symlink_to(target)
    async with JsonlStore(directory) as store:
        with pytest.raises(StoreError, match="symbolic link") as refused:
            await store.claim_run("r")
        assert f"the run file {run_file(directory, 'r')} is a symbolic link" in str(refused.value)
        # The refused claim holds nothing, so no write goes through the link either.
        with pytest.raises(RunLocked):
            await store.start_run(started())
        with pytest.raises(RunLocked):
            await store.write_intent(intent())
        with pytest.raises(StoreError, match="symbolic link"):
            await store.read_log("r")
        with pytest.raises(StoreError, match="symbolic link"):
            await store.describe_run("r")
    if dangling:
        assert not target.exists()
    else:
        assert target.read_bytes() == b"keep me\n"


async def test_a_planted_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(run_file(tmp_path, "r"))
    async with JsonlStore(tmp_path) as store:
        with anyio.fail_after(10):
            with pytest.raises(StoreError, match="regular file") as refused:
                await store.read_log("r")
            # The file by its full path, not "the run file" alone.
            assert f"the run file {run_file(tmp_path, 'r')} is not a regular file" in str(
                refused.value
            )
            with pytest.raises(StoreError, match="regular file"):
                await store.claim_run("r")
            with pytest.raises(RunLocked):
                await store.write_intent(intent())
            with pytest.raises(RunLocked):
                await store.start_run(started())
    assert stat.S_ISFIFO(run_file(tmp_path, "r").lstat().st_mode)


async def test_a_run_file_that_will_not_open_is_named_by_its_path(tmp_path: Path) -> None:
    run_file(tmp_path, "r").mkdir()  # a directory where the run file should be
    async with JsonlStore(tmp_path) as store:
        with pytest.raises(StoreError) as refused:
            await store.claim_run("r")
    # The path once, then the system's words: not its errno text with the path again.
    assert (
        refused.value.reason
        == f"could not open the run file {run_file(tmp_path, 'r')}: Is a directory"
    )


# -- torn tails ---------------------------------------------------------------------------


def torn_tails() -> list[bytes]:
    line = dumps(intent(k=1)).encode()
    return [line[: len(line) // 2], line, b"\xe2\x82"]


@pytest.mark.parametrize("tail", torn_tails(), ids=["half-record", "whole-json", "half-utf8"])
async def test_a_torn_tail_is_ignored_then_truncated_by_the_next_writer(
    tmp_path: Path, tail: bytes
) -> None:
    records = await started_run(tmp_path)
    path = run_file(tmp_path, "r")
    complete = path.read_bytes()
    append_bytes(path, tail)
    async with JsonlStore(tmp_path) as store:
        assert list((await store.read_log("r")).records) == records
        assert path.read_bytes() == complete + tail  # readers leave the tail alone
        await store.claim_run("r")
        assert path.read_bytes() == complete  # the claim cut it off, before any write
        await store.write_result(result())
        assert list((await store.read_log("r")).records) == [*records, result()]
    assert path.read_bytes() == complete + (dumps(result()) + "\n").encode()


async def test_a_huge_torn_tail_is_read_past_and_cut_without_being_held(tmp_path: Path) -> None:
    """Reading, listing, describing and claiming scan the file in chunks: the most memory
    held at once is a small fraction of the tail (``tracemalloc`` sees the worker threads)."""
    records = await started_run(tmp_path)
    path = run_file(tmp_path, "r")
    complete = path.read_bytes()
    size = 20 * 1024 * 1024
    append_bytes(path, torn_tails()[0] + b"\xff" * size)
    assert path.stat().st_size > len(complete) + size
    async with JsonlStore(tmp_path) as store:
        tracemalloc.start()
        try:
            assert list((await store.read_log("r")).records) == records
            assert [run.run_id for run in await store.list_runs()] == ["r"]
            described = await store.describe_run("r")
            assert described is not None and not described.finished
            _, peak_reading = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            await store.claim_run("r")
            _, peak_claiming = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert path.read_bytes() == complete  # the claim cut the tail at the last newline
    assert peak_reading < size // 8, f"reading held {peak_reading} bytes"
    assert peak_claiming < size // 8, f"the claim held {peak_claiming} bytes"


class ChangesWhileRead(OsFileOps):
    """The real file operations; the first ``read`` of a run file first runs ``change``."""

    __slots__ = ("change",)

    def __init__(self, change: Callable[[], None] | None) -> None:
        self.change = change

    def read(self, fd: int, size: int) -> bytes:
        if self.change is not None:
            change, self.change = self.change, None
            change()
        return super().read(fd, size)


async def test_a_read_returns_the_lines_complete_when_it_started(tmp_path: Path) -> None:
    records = await started_run(tmp_path)
    path = run_file(tmp_path, "r")
    later = (dumps(result()) + "\n").encode()
    files = ChangesWhileRead(lambda: append_bytes(path, later))
    async with jsonl_store_on(tmp_path, files) as store:
        assert list((await store.read_log("r")).records) == records
        assert files.change is None  # the line was appended during that read
        assert list((await store.read_log("r")).records) == [*records, result()]


async def test_a_run_file_cut_shorter_while_read_is_a_store_error(tmp_path: Path) -> None:
    await started_run(tmp_path)
    path = run_file(tmp_path, "r")
    files = ChangesWhileRead(lambda: os.truncate(path, 10))
    async with jsonl_store_on(tmp_path, files) as store:
        with pytest.raises(StoreError, match="shrank while it was being read") as caught:
            await store.read_log("r")
    assert caught.value.run_id == "r" and caught.value.location == str(path)


async def test_a_torn_tail_is_left_alone_while_another_writer_holds_the_run(
    tmp_path: Path,
) -> None:
    async with JsonlStore(tmp_path) as holder, JsonlStore(tmp_path) as other:
        await holder.claim_run("r")
        await holder.start_run(started())
        path = run_file(tmp_path, "r")
        append_bytes(path, b'{"schema":"polyl')  # as if the holder were mid-write
        content = path.read_bytes()
        with pytest.raises(RunLocked):
            await other.claim_run("r")
        with pytest.raises(RunLocked):
            await other.write_result(result())
        assert path.read_bytes() == content


async def test_resume_ignores_a_whole_intent_that_lacks_its_newline(tmp_path: Path) -> None:
    """The next action's intent, complete but unterminated, was never acknowledged.

    Had the reader accepted it, a NEVER-replay resume would end in doubt; the action
    never ran, so the resumed run must be the uninterrupted one.
    """
    expected = await uninterrupted(
        lambda: JsonlStore(tmp_path / "u"), Replay.NEVER, six_step_script()
    )
    directory = tmp_path / "c"
    ledger = Ledger()
    tools = make_tools(ledger)
    async with JsonlStore(directory) as first:
        with pytest.raises(SimulatedCrash):
            # Write 4 would be the first action intent.
            await run(
                definition(FaultyStore(first, fail_after_writes=3), script=six_step_script()),
                request("r", tools),
            )
    unacknowledged = Intent(
        run_id="r",
        result_id="r:0:action",
        kind=IntentKind.ACTION,
        step=0,
        call_index=0,
        replay=Replay.NEVER,
        payload={"tool": "double", "arguments": {"n": 1}},
    )
    append_bytes(run_file(directory, "r"), dumps(unacknowledged).encode())
    async with JsonlStore(directory) as second:
        resumed = await resume(definition(second, script=six_step_script()), request("r", tools))
    assert resumed.stop_reason is not StopReason.IN_DOUBT
    assert same_outcome(resumed, expected)
    assert all(ledger.count(rid) == 1 for _, rid in ledger.calls)
    data = run_file(directory, "r").read_bytes()
    assert data.endswith(b"\n")
    assert data.count(b"\n") == SIX_STEP_WRITES


# -- corrupt lines ------------------------------------------------------------------------


def _pair(first: Any, second: Any) -> bytes:
    return f"[{dumps(first)},{dumps(second)}]".encode()


CORRUPT_LINES: dict[str, tuple[bytes, type[PolyLoopError]]] = {
    "empty-object": (b"{}", CorruptLog),
    "empty-line": (b"", CorruptLog),
    "garbage": (b"this is not json", CorruptLog),
    "json-number": (b"42", CorruptLog),
    "duplicate-key": (b'{"kind":"result",' + dumps(result()).encode()[1:], CorruptLog),
    "another-run": (dumps(result(run_id="other")).encode(), CorruptLog),
    "schema-major-2": (
        dumps(result()).replace("polyloop/1", "polyloop/2").encode(),
        SchemaMajorMismatch,
    ),
    "invalid-utf8": (b'{"x":"\xff\xfe"}', CorruptLog),
    "empty-array": (b"[]", CorruptLog),
    "numbers-array": (b"[1,2]", CorruptLog),
    "pair-of-one": (f"[{dumps(result())}]".encode(), CorruptLog),
    "pair-reversed": (_pair(step(), result()), CorruptLog),
    "pair-of-two-results": (_pair(result(), result(k=1)), CorruptLog),
    "pair-trailing-text": (_pair(result(), step()) + b"x", CorruptLog),
    "pair-three": (_pair(result(), step())[:-1] + b"," + dumps(step()).encode() + b"]", CorruptLog),
    "pair-another-run": (_pair(result(run_id="other"), step()), CorruptLog),
    "pair-schema-major-2": (
        _pair(result(), step()).replace(b"polyloop/1", b"polyloop/2"),
        SchemaMajorMismatch,
    ),
    "pair-duplicate-key": (b'[{"kind":"result",' + _pair(result(), step())[2:], CorruptLog),
}


@pytest.mark.parametrize("name", sorted(CORRUPT_LINES))
async def test_a_terminated_bad_line_is_an_error_naming_file_and_line(
    tmp_path: Path, name: str
) -> None:
    line, error_type = CORRUPT_LINES[name]
    await started_run(tmp_path)
    path = run_file(tmp_path, "r")
    append_bytes(path, line + b"\n")
    async with JsonlStore(tmp_path) as store:
        # Lines after the bad one do not hide it.
        await store.claim_run("r")
        await store.write_result(result())
        with pytest.raises(error_type) as caught:
            await store.read_log("r")
    assert type(caught.value) is error_type
    # The file by its full path, so that whoever reads the message can open it.
    assert caught.value.location == f"{path}:3"
    assert f"{path}:3" in str(caught.value)


@pytest.mark.parametrize("breaker", ["\u2028", "\u2029", "\x85"])
async def test_only_newline_ends_a_line(tmp_path: Path, breaker: str) -> None:
    """Characters that ``splitlines`` breaks on: raw in a string, and ``\\r`` as JSON space."""
    await started_run(tmp_path)
    raw = Result(
        run_id="r",
        result_id="r:0:model",
        kind=IntentKind.MODEL_CALL,
        payload={"content": f"a{breaker}b"},
    )
    line = json.dumps(json.loads(dumps(raw)), ensure_ascii=False, separators=(",", ":"))
    assert breaker in line
    append_bytes(run_file(tmp_path, "r"), ("{\r" + line[1:] + "\n").encode())
    async with JsonlStore(tmp_path) as store:
        assert (await store.read_log("r")).records[-1] == raw


async def test_a_pair_line_with_json_whitespace_still_reads(tmp_path: Path) -> None:
    await started_run(tmp_path)
    line = f" [ {dumps(result())} ,\t{dumps(step())} ] ".encode()
    append_bytes(run_file(tmp_path, "r"), line + b"\n")
    async with JsonlStore(tmp_path) as store:
        assert (await store.read_log("r")).records[-2:] == (result(), step())


# -- failures -----------------------------------------------------------------------------


def failing_fsync(monkeypatch: pytest.MonkeyPatch, *, after: int = 0) -> list[int]:
    """Make ``os.fsync`` of a regular file fail with EIO after ``after`` successes."""
    real = os.fsync
    calls: list[int] = []

    def fsync(fd: int) -> None:
        if is_regular_fd(fd):
            calls.append(fd)
            if len(calls) > after:
                raise OSError(errno.EIO, "simulated I/O error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


async def test_an_fsync_error_fails_the_run_for_this_store_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = run_file(tmp_path, "r")
    store = JsonlStore(tmp_path)
    await store.claim_run("r")
    await store.start_run(started())
    calls = failing_fsync(monkeypatch)
    with pytest.raises(StoreError) as caught:
        await store.write_intent(intent())
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.EIO
    assert caught.value.run_id == "r"
    monkeypatch.undo()
    content = path.read_bytes()
    for write in (
        store.write_result(result()),
        store.write_intent(intent(k=1)),
        store.write_step(step(), None),
    ):
        with pytest.raises(StoreError, match="earlier write of this run failed"):
            await write
    with pytest.raises(StoreError, match="earlier write of this run failed"):
        await store.claim_run("r")
    assert path.read_bytes() == content
    assert len(calls) == 1  # never retried
    # Other runs of the same store object are unaffected.
    await store.claim_run("other")
    await store.start_run(started("other"))
    await store.aclose()
    async with JsonlStore(tmp_path) as reopened:
        await reopened.claim_run("r")
        await reopened.write_intent(intent(k=1))
        records = (await reopened.read_log("r")).records
    assert records[0] == started() and records[-1] == intent(k=1)


def files_open_under(directory: Path) -> list[str]:
    """The names of the files under ``directory`` that this process holds open (read
    from ``/proc/self/fd``)."""
    descriptors = Path("/proc/self/fd")
    if not descriptors.is_dir():
        pytest.skip("needs /proc/self/fd to see which files are open")
    root = str(directory.resolve())
    found = []
    for entry in descriptors.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith(root):
            found.append(os.path.basename(target))
    return found


def run_files_open_under(directory: Path) -> list[str]:
    """The run files (not the claim lock files) this process holds open."""
    return [name for name in files_open_under(directory) if not name.startswith(".claims-")]


async def test_runs_that_end_or_fail_leave_no_state_in_the_store_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-lived store object must not grow with every run it has written: it gives
    a run up (its claim) once the end record is written or a write of the run failed.
    No run file stays open even while its run is claimed: only the claim lock files
    (at most 16, whatever the number of runs) do."""
    async with JsonlStore(tmp_path) as store:
        for index in range(5):
            await apply(store, sample_run(f"ended-{index}", steps=1))
        assert run_files_open_under(tmp_path) == []
        # Given up, not only closed: this store object may claim an ended run again.
        for index in range(5):
            await store.claim_run(f"ended-{index}")
            await store.release_run(f"ended-{index}")
        assert run_files_open_under(tmp_path) == []
        await store.claim_run("r")
        await store.start_run(started())
        assert run_files_open_under(tmp_path) == []  # claimed, and no file held for it
        failing_fsync(monkeypatch)
        with pytest.raises(StoreError):
            await store.write_intent(intent())
        monkeypatch.undo()
        assert run_files_open_under(tmp_path) == []
        assert 0 < len(files_open_under(tmp_path)) <= 16
        records = (await store.read_log("ended-4")).records
    assert isinstance(records[-1], RunEnded)


async def test_a_failed_store_object_releases_the_run_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with JsonlStore(tmp_path) as failed:
        await failed.claim_run("r")
        await failed.start_run(started())
        failing_fsync(monkeypatch)
        with pytest.raises(StoreError):
            await failed.write_intent(intent())
        monkeypatch.undo()
        async with JsonlStore(tmp_path) as other:
            await other.claim_run("r")
            await other.write_result(result())


async def test_a_run_that_hit_an_fsync_error_resumes_on_a_new_store_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await uninterrupted(
        lambda: JsonlStore(tmp_path / "u"), Replay.ALLOWED, six_step_script()
    )
    directory = tmp_path / "c"
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)
    failing_fsync(monkeypatch, after=1)  # start_run's sync passes, the first intent's fails
    async with JsonlStore(directory) as first:
        with pytest.raises(StoreError):
            await run(
                definition(first, script=six_step_script()),
                request("r", tools, model_replay=Replay.ALLOWED),
            )
    monkeypatch.undo()
    async with JsonlStore(directory) as second:
        resumed = await resume(
            definition(second, script=six_step_script()),
            request("r", tools, model_replay=Replay.ALLOWED),
        )
    assert same_outcome(resumed, expected)


# -- short and concurrent writes ----------------------------------------------------------


async def test_short_writes_are_completed(tmp_path: Path, short_writes: list[int]) -> None:
    writes = sample_run("r", steps=2)
    async with JsonlStore(tmp_path) as store:
        await apply(store, writes)
        assert list((await store.read_log("r")).records) == expected_records(writes)
    assert len(short_writes) > 10 * len(writes)


async def test_writes_to_one_run_never_interleave(tmp_path: Path, short_writes: list[int]) -> None:
    texts = [f"task {i} " + "x" * (50 + i) for i in range(24)]
    async with JsonlStore(tmp_path) as store:
        await store.claim_run("r")
        await store.start_run(started())
        async with anyio.create_task_group() as group:
            for i, text in enumerate(texts):
                group.start_soon(store.write_result, result(k=i, text=text))
        records = (await store.read_log("r")).records
    assert records[0] == started()
    assert sorted(records[1:], key=repr) == sorted(
        (result(k=i, text=t) for i, t in enumerate(texts)), key=repr
    )


async def test_many_runs_write_concurrently_through_one_store(
    tmp_path: Path, short_writes: list[int]
) -> None:
    run_ids = [f"run-{i}" for i in range(16)]
    async with JsonlStore(tmp_path) as store:
        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(apply, store, sample_run(run_id, steps=1))
        for run_id in run_ids:
            records = list((await store.read_log(run_id)).records)
            assert records == expected_records(sample_run(run_id, steps=1))


# -- the reader, property-based -----------------------------------------------------------

_text = st.text(st.characters(exclude_categories=()), max_size=12)
_json: st.SearchStrategy[JSONValue] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def _writes(draw: st.DrawFn) -> list[tuple[str, Any]]:
    writes: list[tuple[str, Any]] = [("start_run", (started(),))]
    for k in range(draw(st.integers(0, 6))):
        payload = draw(_json)
        choice = draw(st.sampled_from(["intent", "result", "step", "pair"]))
        if choice == "intent":
            writes.append(
                (
                    "write_intent",
                    (
                        Intent(
                            run_id="r",
                            result_id=draw(_text),
                            kind=IntentKind.ACTION,
                            step=k,
                            call_index=k,
                            replay=Replay.ALLOWED,
                            payload=payload,
                        ),
                    ),
                )
            )
        elif choice == "result":
            writes.append(
                (
                    "write_result",
                    (
                        Result(
                            run_id="r",
                            result_id=draw(_text),
                            kind=IntentKind.MODEL_CALL,
                            payload=payload,
                        ),
                    ),
                )
            )
        else:
            record = StepRecord(
                run_id="r",
                step=k,
                call_id=None,
                model_output=draw(_text),
                reasoning=None,
                decision=DecisionKind.INVALID,
                history_text=draw(_text),
                action_text=None,
                observation=draw(_text),
                observation_synthesized=False,
                action_status=None,
                done=False,
                truncated_chars=0,
                error=None,
            )
            paired = (
                Result(
                    run_id="r", result_id=f"r:{k}:action", kind=IntentKind.ACTION, payload=payload
                )
                if choice == "pair"
                else None
            )
            writes.append(("write_step", (record, paired)))
    return writes


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(writes=_writes(), offsets=st.lists(st.integers(0, 2**32), min_size=1, max_size=4))
async def test_read_log_returns_exactly_the_complete_lines_of_any_cut(
    writes: list[tuple[str, Any]], offsets: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        written, cut_dir = Path(scratch) / "written", Path(scratch) / "cut"
        cut_dir.mkdir()
        async with JsonlStore(written) as store:
            await apply(store, writes)
        content = run_file(written, "r").read_bytes()
        ends = [i + 1 for i, byte in enumerate(content) if byte == ord("\n")]
        assert len(ends) == len(writes)
        # Random cuts, plus a cut right at and right before every line end.
        cuts = {offset % (len(content) + 1) for offset in offsets}
        cuts |= {end - delta for end in ends for delta in (0, 1)}
        for cut in sorted(cuts):
            run_file(cut_dir, "r").write_bytes(content[:cut])
            complete = sum(1 for end in ends if end <= cut)
            async with JsonlStore(cut_dir) as reader:
                records = list((await reader.read_log("r")).records)
            assert records == expected_records(writes[:complete])


# -- crash at every write point -----------------------------------------------------------


@pytest.mark.parametrize("k", every_point(range(1, SIX_STEP_WRITES)))
async def test_crash_after_every_write_resumes_to_the_uninterrupted_run(
    tmp_path: Path, k: int
) -> None:
    expected = await uninterrupted(MemoryStore, Replay.ALLOWED, six_step_script())
    resumed, _, store = await crash_and_resume(
        lambda: JsonlStore(tmp_path / f"k{k}"), k, Replay.ALLOWED, six_step_script()
    )
    try:
        assert resumed.resumed
        assert same_outcome(resumed, expected)
        log = await store.read_log("r")
        assert isinstance(log.records[-1], RunEnded)
    finally:
        await close_store(store)


@pytest.mark.parametrize("k", every_point(range(1, SIX_STEP_WRITES)))
async def test_crash_with_replay_never_is_in_doubt_only_after_an_intent(
    tmp_path: Path, k: int
) -> None:
    expected = await uninterrupted(MemoryStore, Replay.NEVER, six_step_script())
    resumed, ledger, store = await crash_and_resume(
        lambda: JsonlStore(tmp_path / f"k{k}"), k, Replay.NEVER, six_step_script()
    )
    try:
        if k in SIX_STEP_INTENT_WRITES:
            assert resumed.stop_reason is StopReason.IN_DOUBT
        else:
            assert same_outcome(resumed, expected)
        assert all(ledger.count(rid) == 1 for _, rid in ledger.calls)
    finally:
        await close_store(store)


# -- the module itself --------------------------------------------------------------------


def test_the_module_never_imports_asyncio() -> None:
    source = inspect.getsource(jsonl_module)
    assert "import asyncio" not in source and "from asyncio" not in source


def test_errors_are_polyloop_errors() -> None:
    assert issubclass(StoreError, PolyLoopError) and issubclass(RunLocked, PolyLoopError)


# -- the per-run lock: a descriptor is never closed under a write or a sync ------------------
#
# An intent's append and its ``fsync`` run with the run's lock held, and so does closing the
# run's descriptor (``end_run``, ``release_run``, ``aclose``, a failed write). Without the
# lock, closing the store while an intent is being synced would close the descriptor under
# the sync: the intent's caller would get an error for a line that is on disk, or, had the
# descriptor number been reused, a sync of some other file reported as its own. The test
# checks the order of the sync and the closes, which fails without the lock.


class SlowSyncs(OsFileOps):
    """Real file operations whose syncs of intents take a while once ``slow`` is set."""

    def __init__(self) -> None:
        self.slow = False
        self.syncing = threading.Event()
        self.events: list[str] = []

    def fsync(self, fd: int) -> None:
        if self.slow:
            self.syncing.set()
            time.sleep(0.3)
        os.fsync(fd)
        self.events.append("synced")

    def close(self, fd: int) -> None:
        self.events.append("closed")
        os.close(fd)


async def _close_while_syncing(tmp_path: Path) -> tuple[Any, SlowSyncs]:
    files = SlowSyncs()
    store = jsonl_store_on(tmp_path / "runs", files)
    for run_id in ("a", "b"):  # two runs: an intent's sync goes to a worker thread
        await store.claim_run(run_id)
        await store.start_run(sample_run(run_id)[0][1][0])
    _, (intent,) = sample_run("a")[1]
    files.slow = True
    outcome: dict[str, Any] = {}

    async def write() -> None:
        try:
            await store.write_intent(intent)
        except StoreError as exc:
            outcome["error"] = exc
        else:
            outcome["error"] = None

    async with anyio.create_task_group() as group:
        group.start_soon(write)
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(files.syncing.wait)
        await store.aclose()
    files.slow = False
    return outcome["error"], files


async def test_closing_the_store_waits_for_an_intent_being_synced(tmp_path: Path) -> None:
    error, files = await _close_while_syncing(tmp_path)
    assert error is None
    # The intent's sync ended before its descriptor was closed.
    assert files.events[-3:] == ["synced", "closed", "closed"]
    reader = JsonlStore(tmp_path / "runs")
    _, (intent,) = sample_run("a")[1]
    assert (await reader.read_log("a")).records[-1] == intent
