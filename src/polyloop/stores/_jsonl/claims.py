"""The claims of the JSON-lines store: one locked byte per run in a shared lock file.

To claim run ``R`` is to take its byte in the directory's lock files
(:class:`~polyloop.stores._byte_locks.ByteLocks`); the claim then opens (or creates)
the run file, cuts off a torn tail, notes whether the run started and whether it ended,
and closes it again. So a store object holds at most 16 descriptors however many runs
it claims, and opens a run file only for the moment of a write or a read. Giving the
claim up lets go of the byte, and removes a file that no run was started in, so a claim
alone leaves no trace but the lock files. Pruning unlinks a run file under its claim.
``docs/stores.md`` describes the rules for users; research records 0009 (durability),
0017 (claims) and 0027 (bounded open files) say why.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from polyloop.stores._byte_locks import ByteLocks, open_failed
from polyloop.stores._common import WriterState, create_directories, open_files_error, safe_name
from polyloop.stores._jsonl.fileops import FileOps
from polyloop.stores._jsonl.reader import (
    COMMON_FLAGS,
    SUFFIX,
    complete_end,
    last_end,
    refuse_link,
    require_regular,
)
from polyloop.stores._refusals import claimed_already, not_claimed
from polyloop.types import PolyLoopError, StoreError

__all__ = ("WRITE_FLAGS", "Claim", "Claims", "open_failed")

_FILE_MODE = 0o600
# A claim opens (or creates) the run file to read it (for a torn tail, and whether the
# run ended); a write opens it again, never creating it: the claim made it.
_CLAIM_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | COMMON_FLAGS
WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | COMMON_FLAGS


@dataclass(eq=False)
class Claim:
    """A run this store object holds: its locked byte and what is in its file.

    ``lock`` is held around every write to the file and around giving the claim up, so
    a claim never ends under a write or a sync.
    """

    offset: int  # of the run's locked byte
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

    __slots__ = ("_directory_ready", "_held", "_locks", "directory", "files", "state")

    def __init__(self, directory: Path, files: FileOps, state: WriterState) -> None:
        self.directory = directory
        self.files = files
        self.state = state
        self._directory_ready = False  # created, with its parents, by the first claim
        self._held: dict[str, Claim] = {}
        self._locks = ByteLocks(directory, files)

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
                raise claimed_already(run_id)
        try:
            self._ensure_directory(run_id)
        except StoreError as exc:
            cause = exc.__cause__
            limit = open_files_error(cause, run_id) if cause is not None else None
            if limit is not None:
                raise limit from cause
            raise
        offset = self._locks.lock(run_id)
        try:
            started, finished = self._inspect(run_id)
        except BaseException:
            self._locks.unlock(offset)
            raise
        with self.state.mutex:
            self._held[run_id] = Claim(offset=offset, started=started, finished=finished)

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it."""
        with self.state.mutex:
            self.state.check_writable(run_id)
            claim = self._held.get(run_id)
        if claim is None:
            raise not_claimed(run_id)
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
        self._locks.close()

    def claimed(self, run_ids: list[str]) -> list[bool]:
        """Whether a writer (this store object included) holds each run's claim now."""
        return self._locks.held(run_ids)

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

    def _unclaim(self, run_id: str, claim: Claim) -> None:
        """Give up the claim (its lock held); remove the file if no run started in it."""
        if not claim.closed and not claim.started:
            # Only the claim made the file: remove it, so no run id leaves a trace. The
            # byte is still locked, so nobody has made it a run meanwhile.
            with contextlib.suppress(OSError):
                self.files.unlink(self.path(run_id))
        self._unlock(claim)

    def _unlock(self, claim: Claim) -> None:
        if not claim.closed:
            claim.closed = True
            self._locks.unlock(claim.offset)

    def _ensure_directory(self, run_id: str) -> None:
        if not self._directory_ready:
            create_directories(self.files, self.directory, run_id=run_id)
            self._directory_ready = True
