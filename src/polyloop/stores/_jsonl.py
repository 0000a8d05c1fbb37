"""The JSON-lines store: one append-only file per run in one directory.

Run ``R`` lives in ``<directory>/<safe_name(R)>.jsonl``, one record per line; an
action's result and its step record share one line, so ``write_step`` lands whole or
not at all; bytes after the last newline are a torn tail that readers ignore and the
next claim cuts off (:mod:`polyloop.stores._jsonl_reader` reads the format). A claim
is an exclusive ``flock`` on the run file; intents and starts are synced before the
call returns. ``docs/stores.md`` describes the store for its users; research records
0009 (durability), 0012 (the file-operation layer), 0017 (claims) and 0019 (one write
path, off the event loop) say why it is built this way.

Every blocking call runs in a worker thread: a write joins a shared batch
(:class:`~polyloop.stores._batching.GroupCommit`), which appends and syncs the items of
many runs in one thread hop, with up to 16 such batches at once so that the syncs of
different files overlap on the disk. A run's own lock is held around each of its
writes and around closing its descriptor, so a descriptor is never closed under a
write or a sync.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType

import anyio.to_thread

from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import (
    WriterState,
    claim_in_thread,
    fsync_directory,
    safe_name,
)
from polyloop.stores._fileops import FileOps, OsFileOps
from polyloop.stores._jsonl_reader import (
    COMMON_FLAGS,
    READ_FLAGS,
    SUFFIX,
    complete_end,
    first_run_id,
    last_end,
    pair_line,
    parse_lines,
    read_file,
    record_line,
    refuse_link,
    require_regular,
)
from polyloop.types import (
    CorruptLog,
    Intent,
    JSONValue,
    PolyLoopError,
    Record,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLocked,
    RunLog,
    RunStarted,
    SchemaMajorMismatch,
    StepRecord,
    StoreError,
)

__all__ = ("JsonlStore",)

logger = logging.getLogger("polyloop")

_FILE_MODE = 0o600
# A claim opens (or creates) the run file and reads it (for a torn tail, and whether the
# run ended) through the same descriptor, so the file it inspects is the file it locked.
_CLAIM_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | COMMON_FLAGS
# A claimant that locked a file its previous holder had just removed tries again.
_CLAIM_ATTEMPTS = 100
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


@dataclass(eq=False)
class _Claim:
    """A run this store object holds: its locked descriptor and what is in the file."""

    fd: int
    started: bool  # the file holds a complete line
    finished: bool  # its last complete line is a final end record
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False, slots=True)
class _Write:
    """One line to append to a claimed run, and what comes with it."""

    run_id: str
    data: bytes
    sync: bool = False  # the line is synced before the call returns
    start: bool = False  # the run's first line: the directory entry is synced too
    end: bool = False  # the claim ends with the line


class JsonlStore:
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

    __slots__ = ("_claims", "_directory", "_directory_ready", "_files", "_state", "_writes")

    def __init__(self, directory: str | os.PathLike[str], *, _files: FileOps | None = None) -> None:
        self._directory = Path(os.path.abspath(os.fspath(directory)))
        # Private: a model of a disk for the power-loss tests (research record 0012).
        self._files: FileOps = _SYSTEM_FILES if _files is None else _files
        self._directory_ready = False
        self._claims: dict[str, _Claim] = {}
        self._state = WriterState()
        self._writes: GroupCommit[_Write] = GroupCommit(self._commit, parallel=_PARALLEL_BATCHES)

    def parameters(self) -> Mapping[str, JSONValue]:
        """The kind and record format; never the directory, so moved data still resumes."""
        return {"kind": "jsonl", "format": FORMAT}

    # -- the Store protocol ---------------------------------------------------------------

    async def claim_run(self, run_id: str) -> None:
        """Open (or create, mode ``0o600``) the run's file and take its writer lock.

        ``RunLocked`` if anyone holds it, this store object included. A torn tail is cut
        off now; a file holding no complete line counts as empty.
        """
        self._check_open(run_id)
        await claim_in_thread(
            partial(self._claim_sync, run_id), partial(self._release_sync, run_id)
        )

    async def release_run(self, run_id: str) -> None:
        """Give up the claim: close the descriptor, removing the file if no run started."""
        if run_id in self._claims:
            await anyio.to_thread.run_sync(self._release_sync, run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the claimed run's first line, then sync the file and the directory."""
        await self._write(_Write(record.run_id, record_line(record), sync=True, start=True))

    async def write_intent(self, intent: Intent) -> None:
        """Append an intent and sync the file before returning."""
        await self._write(_Write(intent.run_id, record_line(intent), sync=True))

    async def write_result(self, result: Result) -> None:
        """Append the result of a model call (not synced)."""
        await self._write(_Write(result.run_id, record_line(result)))

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Append a step, with its action's result on the same line (not synced)."""
        if action_result is None:
            await self._write(_Write(step.run_id, record_line(step)))
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._write(_Write(step.run_id, pair_line(action_result, step)))

    async def end_run(self, record: RunEnded) -> None:
        """Append the end record (not synced) and give up the claim."""
        await self._write(_Write(record.run_id, record_line(record), end=True))

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
            raise StoreError("the store is closed")
        listed = await anyio.to_thread.run_sync(self._list_sync)
        return tuple(run for run in listed if not (unfinished_only and run.finished))

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if its file holds no record."""
        self._check_open(run_id)
        return await anyio.to_thread.run_sync(self._describe_sync, self._path(run_id), run_id)

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
        await anyio.to_thread.run_sync(self._close_sync)

    async def __aenter__(self) -> JsonlStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"JsonlStore({str(self._directory)!r})"

    # -- writing (worker threads) ---------------------------------------------------------

    async def _write(self, write: _Write) -> None:
        await self._writes.submit(write)

    def _commit(self, writes: Sequence[_Write]) -> list[BaseException | None]:
        """Apply a batch of writes in this worker thread; each one's own outcome."""
        return [self._apply(write) for write in writes]

    def _apply(self, write: _Write) -> BaseException | None:
        run_id = write.run_id
        try:
            claim = self._held(run_id)
            with claim.lock:
                if claim.closed:
                    raise RunLocked(
                        "this store object does not hold the run's claim", run_id=run_id
                    )
                _check_order(claim, write)
                try:
                    _write_all(self._files, claim.fd, write.data)
                    claim.started = True
                    if write.sync:
                        self._files.fsync(claim.fd)
                    if write.start:
                        self._files.fsync_directory(self._directory)
                    if write.end:
                        self._forget(run_id, claim)
                        _close(self._files, claim)
                except OSError as exc:
                    # An fsync is never retried: the kernel may have dropped the data.
                    self._forget(run_id, claim)
                    _close(self._files, claim, quiet=True)
                    return self._state.fail(run_id, exc)
        except PolyLoopError as exc:
            return exc
        return None

    def _held(self, run_id: str) -> _Claim:
        """The run's claim, if the store may write and this object holds it."""
        with self._state.mutex:
            self._state.check_writable(run_id)
            claim = self._claims.get(run_id)
        if claim is None:
            raise RunLocked("this store object does not hold the run's claim", run_id=run_id)
        return claim

    def _forget(self, run_id: str, claim: _Claim) -> None:
        with self._state.mutex:
            if self._claims.get(run_id) is claim:
                del self._claims[run_id]

    # -- claims (worker threads) ----------------------------------------------------------

    def _claim_sync(self, run_id: str) -> None:
        with self._state.mutex:
            self._state.check_writable(run_id)
            if run_id in self._claims:
                raise RunLocked("this store object already holds the run's claim", run_id=run_id)
        try:
            self._ensure_directory()
            fd = self._open_claimed(run_id)
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise self._state.fail(run_id, exc) from exc
        try:
            end, size = complete_end(self._files, fd)
            if size > end:  # a torn tail: what remains of a write that never finished
                self._files.ftruncate(fd, end)
                self._files.fsync(fd)
            ended = last_end(self._files, fd, end, self._path(run_id).name) if end else None
        except BaseException as exc:
            self._files.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, PolyLoopError):
                raise self._state.fail(run_id, exc) from exc
            raise
        with self._state.mutex:
            self._claims[run_id] = _Claim(
                fd=fd, started=end > 0, finished=ended is not None and ended.is_final
            )

    def _open_claimed(self, run_id: str) -> int:
        """Open or create the run file and lock it, as it is named now."""
        files, path = self._files, self._path(run_id)
        for _ in range(_CLAIM_ATTEMPTS):
            try:
                fd = files.open(path, _CLAIM_FLAGS, _FILE_MODE)
            except OSError as exc:
                refuse_link(exc, run_id)
                raise
            try:
                require_regular(files, fd, run_id)
                files.lock(fd, run_id)
                if files.names_file(fd, path):
                    return fd
            except BaseException:
                files.close(fd)
                raise
            # The previous holder removed the file it had claimed: lock its successor.
            files.close(fd)
        raise RunLocked("the run file kept changing hands; try again", run_id=run_id)

    def _release_sync(self, run_id: str) -> None:
        with self._state.mutex:
            claim = self._claims.pop(run_id, None)
        if claim is not None:
            with claim.lock:
                self._unclaim(run_id, claim)

    def _unclaim(self, run_id: str, claim: _Claim) -> None:
        """Close the claim (its lock held); remove the file if no run started in it."""
        if not claim.closed and not claim.started:
            # Only the claim made the file: remove it, so no run id leaves a trace. The
            # lock is still held, so nobody has made it a run meanwhile.
            path = self._path(run_id)
            with contextlib.suppress(OSError):
                if self._files.names_file(claim.fd, path):
                    self._files.unlink(path)
        _close(self._files, claim, quiet=True)

    async def _delete_claimed(self, run_id: str, *, cutoff: datetime) -> bool:
        return await anyio.to_thread.run_sync(self._delete_sync, run_id, cutoff)

    def _delete_sync(self, run_id: str, cutoff: datetime) -> bool:
        """Unlink a run this object holds the claim of, unless written to since listed."""
        claim = self._held(run_id)
        with claim.lock:
            if datetime.fromtimestamp(self._files.fstat(claim.fd).st_mtime, UTC) >= cutoff:
                return False
            path = self._path(run_id)
            if self._files.names_file(claim.fd, path):
                self._files.unlink(path)
                self._files.fsync_directory(self._directory)
            self._forget(run_id, claim)
            _close(self._files, claim, quiet=True)
            return True

    def _ensure_directory(self) -> None:
        if not self._directory_ready:
            _create_directories(self._files, self._directory)
            self._directory_ready = True

    def _close_sync(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            claims, self._claims = self._claims, {}
        for run_id, claim in claims.items():
            with claim.lock:
                self._unclaim(run_id, claim)

    # -- reading (worker threads) ---------------------------------------------------------

    def _read_sync(self, run_id: str) -> tuple[Record, ...]:
        path = self._path(run_id)
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
        try:
            fd = files.open(path, READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            refuse_link(exc, run_id)
            raise StoreError(f"could not open the run file: {exc}", run_id=run_id) from exc
        try:
            require_regular(files, fd, run_id)
            end, _ = complete_end(files, fd)
            if end == 0:
                return None
            ended = last_end(files, fd, end, path.name)
            return StoredRun(
                run_id=run_id,
                finished=ended is not None and ended.is_final,
                claimed=files.lock_held(fd),
                updated_at=datetime.fromtimestamp(files.fstat(fd).st_mtime, UTC),
            )
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise StoreError(f"could not read the run file: {exc}", run_id=run_id) from exc
        finally:
            files.close(fd)

    def _path(self, run_id: str) -> Path:
        return self._directory / f"{safe_name(run_id)}{SUFFIX}"

    def _check_open(self, run_id: str) -> None:
        if self._state.closed:
            raise StoreError("the store is closed", run_id=run_id)


# -- helpers ------------------------------------------------------------------------------


def _check_order(claim: _Claim, write: _Write) -> None:
    """Refuse a start of a run that has records, and any write before or after the run."""
    if write.start:
        if claim.started:
            raise RunAlreadyExists("the run already has records", run_id=write.run_id)
        return
    if not claim.started:
        raise StoreError("the run was never started in this store", run_id=write.run_id)
    if claim.finished:
        raise StoreError(
            "the run has ended; nothing may follow its end record", run_id=write.run_id
        )


def _write_all(files: FileOps, fd: int, data: bytes) -> None:
    """Append ``data`` completely; a write may take only part of it per call."""
    view = memoryview(data)
    while view:
        written = files.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        view = view[written:]


def _close(files: FileOps, claim: _Claim, *, quiet: bool = False) -> None:
    """Close the claim's descriptor, which releases its ``flock`` (once)."""
    if claim.closed:
        return
    claim.closed = True
    try:
        files.close(claim.fd)
    except OSError:
        if not quiet:
            raise


def _create_directories(files: FileOps, directory: Path) -> None:
    """Create ``directory`` and missing parents, syncing each new entry into its parent."""
    missing: list[Path] = []
    current = directory
    while not files.is_dir(current) and current != current.parent:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            files.mkdir(path)
        files.fsync_directory(path.parent)
