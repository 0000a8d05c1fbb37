"""The JSON-lines store: one append-only file per run in one directory.

Run ``R`` lives in ``<directory>/<safe_name(R)>.jsonl``, one record per line; an
action's result and its step record share one line, so ``write_step`` lands whole or
not at all; bytes after the last newline are a torn tail that readers ignore and the
next claim cuts off (:mod:`polyloop.stores._jsonl.reader` reads the format). A claim
is a write lock on one byte of the directory's shared lock file, held through one
descriptor per store object, and a run file is open only while it is read or written,
so the open files do not grow with the runs claimed; intents and starts are synced
before the call returns. ``docs/stores.md`` describes the store for its users; research
records 0009 (durability), 0012 (the file-operation layer), 0017 (claims), 0019 (one
write path, off the event loop) and 0027 (bounded open files) say why it is built this
way.

Every blocking call runs in a worker thread: a write joins a shared batch
(:class:`~polyloop.stores._batching.GroupCommit`), which appends and syncs the items of
many runs in one thread hop, with up to 16 such batches at once so that the syncs of
different files overlap on the disk. A run's own lock is held around each of its
writes and around giving its claim up, so a claim never ends under a write or a sync.
The store class keeps the public methods and the reads;
:mod:`~polyloop.stores._jsonl.claims` takes and gives up claims, and
:mod:`~polyloop.stores._jsonl.write` appends the lines.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import anyio.to_thread

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import (
    ClosedOnExit,
    WriterState,
    claim_in_thread,
    fsync_directory,
)
from polyloop.stores._jsonl.claims import Claims
from polyloop.stores._jsonl.fileops import FileOps, OsFileOps
from polyloop.stores._jsonl.reader import (
    SUFFIX,
    complete_end,
    first_run_id,
    last_end,
    open_run_file,
    pair_line,
    parse_lines,
    read_file,
    record_line,
    require_regular,
)
from polyloop.stores._jsonl.write import Appender, Write
from polyloop.stores._refusals import store_closed
from polyloop.types import (
    CorruptLog,
    Intent,
    JSONValue,
    PolyLoopError,
    Record,
    Result,
    Review,
    RunEnded,
    RunLog,
    RunStarted,
    SchemaMajorMismatch,
    StepRecord,
    StoreError,
)

__all__ = ("JsonlStore",)

logger = logging.getLogger("polyloop")

# Batches that may run at once, each in its own worker thread: the disk overlaps the
# syncs of different files, and 16 leaves most of AnyIO's 40 default threads free.
_PARALLEL_BATCHES = 16


class _SystemFiles(OsFileOps):
    """The operating system's file operations; directory syncs go through this module's
    ``fsync_directory``, the one name here that syncs a directory."""

    __slots__ = ()

    def fsync_directory(self, directory: Path) -> None:
        fsync_directory(directory)


_SYSTEM_FILES = _SystemFiles()


class JsonlStore(ClosedOnExit):
    """Keeps every run in an append-only JSON-lines file in ``directory``.

    The directory (with its parents) is created when the first run is claimed in it.
    Runs survive the store object, the process and, for what the durability rules cover,
    the machine: open a new ``JsonlStore`` on the same directory (or a copy of it moved
    elsewhere) to read or resume them. A store for one host: a claim has no lease, so a
    process that hangs keeps its runs until it dies (its locks then go at once). Use it
    as an async context manager, or call :meth:`aclose`, to give up its claims.

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its batch started writes
    nothing; once it started, the line is appended (and synced, for a start or an
    intent) either way. Reads change nothing.
    """

    __slots__ = ("_claims", "_directory", "_files", "_state", "_writes")

    def __init__(self, directory: str | os.PathLike[str], *, _files: FileOps | None = None) -> None:
        self._directory = Path(os.path.abspath(os.fspath(directory)))
        # Private: a model of a disk for the power-loss tests (research record 0012).
        self._files: FileOps = _SYSTEM_FILES if _files is None else _files
        self._state = WriterState()
        self._claims = Claims(self._directory, self._files, self._state)
        appender = Appender(self._claims)
        self._writes: GroupCommit[Write] = GroupCommit(appender.commit, parallel=_PARALLEL_BATCHES)

    def parameters(self) -> Mapping[str, JSONValue]:
        """The kind and record format; never the directory, so moved data still resumes."""
        return {"kind": "jsonl", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Take the run's writer lock, then create (mode ``0o600``) or inspect its file.

        ``RunLocked`` if anyone holds it, this store object included. A torn tail is cut
        off now; a file holding no complete line counts as empty.
        """
        self._check_open(run_id)
        await claim_in_thread(
            partial(self._claims.take, run_id), partial(self._claims.release, run_id), run_id=run_id
        )

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, removing the run's file if no run started in it."""
        if self._claims.holds(run_id):
            await anyio.to_thread.run_sync(self._claims.release, run_id)

    async def check_claim(self, run_id: str) -> None:
        """Pass if this store object holds the run's claim: the claim is a lock that only
        this living process holds, with no lease to run out."""
        self._claims.held(run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the claimed run's first line, then sync the file and the directory."""
        await self._write(
            Write(run_id=record.run_id, data=record_line(record), sync=True, start=True)
        )

    async def write_intent(self, intent: Intent) -> None:
        """Append an intent and sync the file before returning."""
        await self._write(Write(run_id=intent.run_id, data=record_line(intent), sync=True))

    async def write_result(self, result: Result) -> None:
        """Append the result of a model call (not synced)."""
        await self._write(Write(run_id=result.run_id, data=record_line(result)))

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Append a step, with its action's result on the same line (not synced)."""
        if action_result is None:
            await self._write(Write(run_id=step.run_id, data=record_line(step)))
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(Write(run_id=step.run_id, data=pair_line(action_result, step)))

    async def write_review(self, record: Review) -> None:
        """Append a proposal, verdict or settlement and sync the file before returning."""
        await self._write(Write(run_id=record.run_id, data=record_line(record), sync=True))

    async def end_run(self, record: RunEnded) -> None:
        """Append the end record (not synced) and give up the claim."""
        await self._write(Write(run_id=record.run_id, data=record_line(record), end=True))

    async def read_log(self, run_id: str) -> RunLog:
        """Every complete record of ``run_id`` in write order; empty if it has no file."""
        self._check_open(run_id)
        records = await anyio.to_thread.run_sync(self._read_sync, run_id)
        return RunLog(run_id=run_id, records=records)

    # -- listing, pruning, closing --------------------------------------------------------

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run in the directory, sorted by id (only unfinished ones if asked).

        Each ``*.jsonl`` file is opened for its first line (the file name only hashes the
        run id), its last line and whether a writer holds its lock; ``updated_at`` is the
        file's modification time. A file with no complete line holds no run. A file whose
        first line is not a record of its run is left out with a warning naming it.
        """
        if self._state.closed:
            raise store_closed()
        listed = await anyio.to_thread.run_sync(self._list_sync)
        return tuple(run for run in listed if not (unfinished_only and run.finished))

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if its file holds no record."""
        self._check_open(run_id)
        path = self._claims.path(run_id)
        return await anyio.to_thread.run_sync(self._describe_sync, path, run_id)

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before`` (file time); their ids.

        Unfinished, in-doubt and claimed runs are never touched: each run's file is
        unlinked under its claim. With ``archive``, each log is first written there.
        """
        cutoff = check_cutoff(finished_before)
        candidates = [
            run.run_id
            for run in await self.list_runs()
            if run.finished
            and not run.claimed
            and run.updated_at is not None
            and run.updated_at < cutoff
        ]
        return await prune_runs(
            self,
            candidates,
            archive=Path(archive) if archive is not None else None,
            delete=partial(self._delete_claimed, cutoff=cutoff),
        )

    async def aclose(self) -> None:
        """Give up every claim and refuse further use. Idempotent."""
        await anyio.to_thread.run_sync(self._claims.close)

    async def __aenter__(self) -> JsonlStore:
        return self

    def __repr__(self) -> str:
        return f"JsonlStore({str(self._directory)!r})"

    # -- writing and pruning (worker threads) ---------------------------------------------

    async def _write(self, write: Write) -> None:
        await self._writes.submit(write)

    async def _delete_claimed(self, run_id: str, *, cutoff: datetime) -> bool:
        return await anyio.to_thread.run_sync(self._claims.delete, run_id, cutoff)

    # -- reading (worker threads) ---------------------------------------------------------

    def _read_sync(self, run_id: str) -> tuple[Record, ...]:
        path = self._claims.path(run_id)
        data = read_file(self._files, path, run_id)
        return tuple(parse_lines(data, path.name, run_id))

    def _list_sync(self) -> list[StoredRun]:
        try:
            names = self._files.listdir(self._directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StoreError(f"could not list {self._directory}: {exc}") from exc
        listed = []
        for name in sorted(name for name in names if name.endswith(SUFFIX)):
            try:
                run = self._describe_sync(self._directory / name, None)
            except (CorruptLog, SchemaMajorMismatch, StoreError) as exc:
                logger.warning("%s is left out of the listing: %s", name, exc)
                continue
            if run is not None:
                listed.append(run)
        return sorted(listed, key=lambda run: run.run_id)

    def _describe_sync(self, path: Path, run_id: str | None) -> StoredRun | None:
        """What the file at ``path`` holds; its first line names the run unless given."""
        files = self._files
        if run_id is None:
            run_id = first_run_id(files, path)
            if run_id is None:
                return None
        fd = open_run_file(files, path, run_id)
        if fd is None:
            return None
        try:
            require_regular(files, fd, run_id)
            end, _ = complete_end(files, fd)
            if end == 0:
                return None
            ended = last_end(files, fd, end, path.name)
            return StoredRun(
                run_id=run_id,
                finished=ended is not None and ended.is_final,
                claimed=self._claims.claimed([run_id])[0],
                updated_at=datetime.fromtimestamp(files.fstat(fd).st_mtime, UTC),
            )
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise StoreError(f"could not read the run file: {exc}", run_id=run_id) from exc
        finally:
            files.close(fd)

    def _check_open(self, run_id: str) -> None:
        if self._state.closed:
            raise store_closed(run_id)
