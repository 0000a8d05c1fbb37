"""The claims of the JSON-lines store: a run file's writer lock, held on its descriptor.

To claim run ``R`` is to open (or create) its file and take an exclusive ``flock`` on
that descriptor; the claim then cuts off a torn tail and notes whether the run started
and whether it ended. Giving the claim up closes the descriptor, which lets the lock go,
and removes a file that no run was started in, so a claim alone leaves no trace. Pruning
unlinks a run file under its claim. ``docs/stores.md`` describes the rules for users;
research records 0009 (durability) and 0017 (claims) say why.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from polyloop.stores._common import WriterState, create_directories, safe_name
from polyloop.stores._fileops import FileOps
from polyloop.stores._jsonl_reader import (
    COMMON_FLAGS,
    SUFFIX,
    complete_end,
    last_end,
    refuse_link,
    require_regular,
)
from polyloop.types import PolyLoopError, RunLocked

__all__ = ("Claim", "Claims", "close_claim")

_FILE_MODE = 0o600
# A claim opens (or creates) the run file and reads it (for a torn tail, and whether the
# run ended) through the same descriptor, so the file it inspects is the file it locked.
_CLAIM_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | COMMON_FLAGS
# A claimant that locked a file its previous holder had just removed tries again.
_CLAIM_ATTEMPTS = 100


@dataclass(eq=False)
class Claim:
    """A run this store object holds: its locked descriptor and what is in the file.

    ``lock`` is held around every write to the file and around closing the descriptor,
    so a descriptor is never closed under a write or a sync.
    """

    fd: int
    started: bool  # the file holds a complete line
    finished: bool  # its last complete line is a final end record
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Claims:
    """The runs one store object holds, by run id, and the directory their files are in.

    Every method is blocking and runs in a worker thread; the store mutex
    (``state.mutex``) guards the map of claims, each claim's own lock its descriptor.
    Cancellation never stops one halfway: a worker thread runs to its end.
    """

    __slots__ = ("_directory_ready", "_held", "directory", "files", "state")

    def __init__(self, directory: Path, files: FileOps, state: WriterState) -> None:
        self.directory = directory
        self.files = files
        self.state = state
        self._directory_ready = False  # created, with its parents, by the first claim
        self._held: dict[str, Claim] = {}

    def path(self, run_id: str) -> Path:
        return self.directory / f"{safe_name(run_id)}{SUFFIX}"

    def holds(self, run_id: str) -> bool:
        return run_id in self._held

    def take(self, run_id: str) -> None:
        """Open and lock the run's file, cut off a torn tail, note what the file holds."""
        with self.state.mutex:
            self.state.check_writable(run_id)
            if run_id in self._held:
                raise RunLocked("this store object already holds the run's claim", run_id=run_id)
        files = self.files
        try:
            self._ensure_directory(run_id)
            fd = self._open_locked(run_id)
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise self.state.fail(run_id, exc) from exc
        try:
            end, size = complete_end(files, fd)
            if size > end:  # a torn tail: what remains of a write that never finished
                files.ftruncate(fd, end)
                files.fsync(fd)
            ended = last_end(files, fd, end, self.path(run_id).name) if end else None
        except BaseException as exc:
            files.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, PolyLoopError):
                raise self.state.fail(run_id, exc) from exc
            raise
        with self.state.mutex:
            self._held[run_id] = Claim(
                fd=fd, started=end > 0, finished=ended is not None and ended.is_final
            )

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it."""
        with self.state.mutex:
            self.state.check_writable(run_id)
            claim = self._held.get(run_id)
        if claim is None:
            raise RunLocked("this store object does not hold the run's claim", run_id=run_id)
        return claim

    def forget(self, run_id: str, claim: Claim) -> None:
        """Drop ``claim`` from the map (its descriptor is closed by the caller)."""
        with self.state.mutex:
            if self._held.get(run_id) is claim:
                del self._held[run_id]

    def release(self, run_id: str) -> None:
        """Give the claim up: close the descriptor, removing the file if no run started."""
        with self.state.mutex:
            claim = self._held.pop(run_id, None)
        if claim is not None:
            with claim.lock:
                self._unclaim(run_id, claim)

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        """Unlink a run this object holds the claim of, unless written to since listed."""
        claim = self.held(run_id)
        files = self.files
        with claim.lock:
            if datetime.fromtimestamp(files.fstat(claim.fd).st_mtime, UTC) >= cutoff:
                return False
            path = self.path(run_id)
            if files.names_file(claim.fd, path):
                files.unlink(path)
                files.fsync_directory(self.directory)
            self.forget(run_id, claim)
            close_claim(files, claim, quiet=True)
            return True

    def close(self) -> None:
        """Refuse further use and give up every claim."""
        with self.state.mutex:
            self.state.closed = True
            claims, self._held = self._held, {}
        for run_id, claim in claims.items():
            with claim.lock:
                self._unclaim(run_id, claim)

    def _open_locked(self, run_id: str) -> int:
        """Open or create the run file and lock it, as it is named now."""
        files, path = self.files, self.path(run_id)
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

    def _unclaim(self, run_id: str, claim: Claim) -> None:
        """Close the claim (its lock held); remove the file if no run started in it."""
        if not claim.closed and not claim.started:
            # Only the claim made the file: remove it, so no run id leaves a trace. The
            # lock is still held, so nobody has made it a run meanwhile.
            path = self.path(run_id)
            with contextlib.suppress(OSError):
                if self.files.names_file(claim.fd, path):
                    self.files.unlink(path)
        close_claim(self.files, claim, quiet=True)

    def _ensure_directory(self, run_id: str) -> None:
        if not self._directory_ready:
            create_directories(self.files, self.directory, run_id=run_id)
            self._directory_ready = True


def close_claim(files: FileOps, claim: Claim, *, quiet: bool = False) -> None:
    """Close the claim's descriptor, which releases its ``flock`` (once)."""
    if claim.closed:
        return
    claim.closed = True
    try:
        files.close(claim.fd)
    except OSError:
        if not quiet:
            raise
