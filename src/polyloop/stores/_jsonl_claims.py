"""The claims of the JSON-lines store: one locked byte per run in a shared lock file.

To claim run ``R`` is to take the write lock on byte ``claim_offset(R)`` of one of the
directory's 16 lock files, ``.claims-<shard>.lock``, through the descriptor this store
object keeps open on that file; the claim then opens (or creates) the run file, cuts off
a torn tail, notes whether the run started and whether it ended, and closes it again. So
a store object holds at most 16 descriptors however many runs it claims, and opens a run
file only for the moment of a write or a read. Giving the claim up lets go of the byte,
and removes a file that no run was started in, so a claim alone leaves no trace but the
lock files. Pruning unlinks a run file under its claim. ``docs/stores.md`` describes the
rules for users; research records 0009 (durability), 0017 (claims) and 0027 (bounded
open files) say why.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from polyloop.stores._common import (
    WriterState,
    claim_offset,
    create_directories,
    open_files_error,
    safe_name,
)
from polyloop.stores._fileops import FileOps
from polyloop.stores._jsonl_reader import (
    COMMON_FLAGS,
    SUFFIX,
    complete_end,
    last_end,
    refuse_link,
    require_regular,
)
from polyloop.types import PolyLoopError, RunLocked, StoreError

__all__ = ("WRITE_FLAGS", "Claim", "Claims", "open_failed")

# The kernel keeps a file's byte locks in one list that each lock and unlock walks, so
# the claims are spread over a few files: at 10,000 claims a lock call stays in the tens
# of microseconds instead of milliseconds, for 16 descriptors per store object.
SHARDS = 16
_FILE_MODE = 0o600
# A claim opens (or creates) the run file to read it (for a torn tail, and whether the
# run ended); a write opens it again, never creating it: the claim made it.
_CLAIM_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | COMMON_FLAGS
WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | COMMON_FLAGS
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | COMMON_FLAGS
_PROBE_FLAGS = os.O_RDONLY | COMMON_FLAGS


@dataclass(eq=False)
class Claim:
    """A run this store object holds: its locked byte and what is in its file.

    ``lock`` is held around every write to the file and around giving the claim up, so
    a claim never ends under a write or a sync.
    """

    shard: int
    offset: int
    started: bool  # the file holds a complete line
    finished: bool  # its last complete line is a final end record
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Claims:
    """The runs one store object holds, by run id, and the directory their files are in.

    Every method is blocking and runs in a worker thread; the store mutex
    (``state.mutex``) guards the map of claims and the lock file's descriptor, each
    claim's own lock its file. Cancellation never stops one halfway: a worker thread
    runs to its end.
    """

    __slots__ = ("_directory_ready", "_held", "_lock_fds", "directory", "files", "state")

    def __init__(self, directory: Path, files: FileOps, state: WriterState) -> None:
        self.directory = directory
        self.files = files
        self.state = state
        self._directory_ready = False  # created, with its parents, by the first claim
        self._held: dict[str, Claim] = {}
        self._lock_fds: dict[int, int] = {}  # by shard, opened when first needed

    def path(self, run_id: str) -> Path:
        return self.directory / f"{safe_name(run_id)}{SUFFIX}"

    def holds(self, run_id: str) -> bool:
        return run_id in self._held

    def take(self, run_id: str) -> None:
        """Lock the run's byte, then open the run's file, cut off a torn tail, note what
        the file holds and close it."""
        with self.state.mutex:
            self.state.check_writable(run_id)
            if run_id in self._held:
                raise RunLocked("this store object already holds the run's claim", run_id=run_id)
        files, offset = self.files, claim_offset(run_id)
        shard = offset % SHARDS
        try:
            self._ensure_directory(run_id)
        except StoreError as exc:
            cause = exc.__cause__
            limit = open_files_error(cause, run_id) if cause is not None else None
            if limit is not None:
                raise limit from cause
            raise
        try:
            lock_fd = self._lock_descriptor(shard)
        except OSError as exc:
            raise open_failed(exc, run_id, "the claims lock file") from exc
        files.lock_range(lock_fd, offset, run_id)
        try:
            started, finished = self._inspect(run_id)
        except BaseException:
            files.unlock_range(lock_fd, offset)
            raise
        with self.state.mutex:
            self._held[run_id] = Claim(
                shard=shard, offset=offset, started=started, finished=finished
            )

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it."""
        with self.state.mutex:
            self.state.check_writable(run_id)
            claim = self._held.get(run_id)
        if claim is None:
            raise RunLocked("this store object does not hold the run's claim", run_id=run_id)
        return claim

    def end(self, run_id: str, claim: Claim) -> None:
        """Give up ``claim`` after its run's last write (its lock held)."""
        with self.state.mutex:
            if self._held.get(run_id) is claim:
                del self._held[run_id]
        self._unlock(claim)

    def release(self, run_id: str) -> None:
        """Give the claim up, removing the run's file if no run started in it."""
        with self.state.mutex:
            claim = self._held.pop(run_id, None)
        if claim is not None:
            with claim.lock:
                self._unclaim(run_id, claim)

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        """Unlink a run this object holds the claim of, unless written to since listed."""
        claim = self.held(run_id)
        files, path = self.files, self.path(run_id)
        with claim.lock:
            fd = files.open(path, os.O_RDONLY | COMMON_FLAGS)
            try:
                written = datetime.fromtimestamp(files.fstat(fd).st_mtime, UTC)
            finally:
                files.close(fd)
            if written >= cutoff:
                return False
            files.unlink(path)
            files.fsync_directory(self.directory)
            self.end(run_id, claim)
            return True

    def close(self) -> None:
        """Refuse further use, give up every claim and close the lock file."""
        with self.state.mutex:
            self.state.closed = True
            claims, self._held = self._held, {}
        for run_id, claim in claims.items():
            with claim.lock:
                self._unclaim(run_id, claim)
        with self.state.mutex:
            lock_fds, self._lock_fds = self._lock_fds, {}
            for lock_fd in lock_fds.values():
                with contextlib.suppress(OSError):
                    self.files.close(lock_fd)

    def claimed(self, run_ids: list[str]) -> list[bool]:
        """Whether a writer (this store object included) holds each run's claim now.

        Asks through a description of the lock file of its own, so this object's claims
        count, and takes no lock, so no writer is kept out.
        """
        files, answers = self.files, []
        for run_id in run_ids:
            offset = claim_offset(run_id)
            try:
                probe = files.open(_lock_path(self.directory, offset % SHARDS), _PROBE_FLAGS)
            except FileNotFoundError:
                answers.append(False)  # nobody ever claimed a run of this shard here
                continue
            try:
                answers.append(files.range_held(probe, offset))
            finally:
                files.close(probe)
        return answers

    def _inspect(self, run_id: str) -> tuple[bool, bool]:
        """Open or create the run file, cut a torn tail, note what it holds, close it."""
        files, path = self.files, self.path(run_id)
        try:
            fd = files.open(path, _CLAIM_FLAGS, _FILE_MODE)
        except OSError as exc:
            refuse_link(exc, run_id)
            raise open_failed(exc, run_id, "the run file") from exc
        try:
            require_regular(files, fd, run_id)
            end, size = complete_end(files, fd)
            if size > end:  # a torn tail: what remains of a write that never finished
                files.ftruncate(fd, end)
                files.fsync(fd)
            ended = last_end(files, fd, end, path.name) if end else None
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise self.state.fail(run_id, exc) from exc
        finally:
            files.close(fd)
        return end > 0, ended is not None and ended.is_final

    def _lock_descriptor(self, shard: int) -> int:
        with self.state.mutex:
            lock_fd = self._lock_fds.get(shard)
            if lock_fd is None:
                path = _lock_path(self.directory, shard)
                lock_fd = self._lock_fds[shard] = self.files.open(path, _LOCK_FLAGS, _FILE_MODE)
            return lock_fd

    def _unclaim(self, run_id: str, claim: Claim) -> None:
        """Give up the claim (its lock held); remove the file if no run started in it."""
        if not claim.closed and not claim.started:
            # Only the claim made the file: remove it, so no run id leaves a trace. The
            # byte is still locked, so nobody has made it a run meanwhile.
            with contextlib.suppress(OSError):
                self.files.unlink(self.path(run_id))
        self._unlock(claim)

    def _unlock(self, claim: Claim) -> None:
        if claim.closed:
            return
        claim.closed = True
        # Under the mutex: the lock file's descriptor is closed under it too, and its
        # number must not be reused by another file while a byte is being let go.
        with self.state.mutex:
            lock_fd = self._lock_fds.get(claim.shard)
            if lock_fd is not None:
                with contextlib.suppress(OSError):
                    self.files.unlock_range(lock_fd, claim.offset)

    def _ensure_directory(self, run_id: str) -> None:
        if not self._directory_ready:
            create_directories(self.files, self.directory, run_id=run_id)
            self._directory_ready = True


def _lock_path(directory: Path, shard: int) -> Path:
    return directory / f".claims-{shard:x}.lock"  # a dot first: no run file's name has one


def open_failed(exc: OSError, run_id: str, what: str) -> StoreError:
    """The error for a file that could not be opened: nothing was written, so the run is
    not marked failed and may be resumed through this very store object."""
    limit = open_files_error(exc, run_id)
    if limit is not None:
        return limit
    error = StoreError(f"could not open {what}: {exc}", run_id=run_id)
    error.__cause__ = exc
    return error
