"""Claims held by the operating system: one locked byte per run in a few shared files.

A store for one host (``JsonlStore``, ``SqliteStore``) claims run ``R`` by taking the
write lock on byte ``claim_offset(R)`` of one of the 16 lock files ``.claims-<shard>.lock``
of its claims directory, through a descriptor the store object keeps open on that file.
The lock belongs to that open description (``F_OFD_SETLK``): a second store object,
in this process or another, is refused; the kernel lets it go when the description is
closed or the process dies, at once. A process that hangs keeps it. So a store object
holds at most 16 descriptors however many runs it claims. Research records 0027 (bounded
open files) and 0032 (SQLite, a store for one host) say why.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Protocol

from polyloop.stores._common import claim_offset, open_files_error
from polyloop.types import StoreError

__all__ = ("SHARDS", "ByteLocks", "LockFiles", "open_failed")

# The kernel keeps a file's byte locks in one list that each lock and unlock walks, so
# the claims are spread over a few files: at 10,000 claims a lock call stays in the tens
# of microseconds instead of milliseconds, for 16 descriptors per store object.
SHARDS = 16
_FILE_MODE = 0o600
_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | _FLAGS
_PROBE_FLAGS = os.O_RDONLY | _FLAGS


class LockFiles(Protocol):
    """The file operations :class:`ByteLocks` needs (``JsonlStore`` passes its own, so
    its simulated power loss sees them)."""

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int: ...

    def close(self, fd: int) -> None: ...

    def lock_range(self, fd: int, offset: int, run_id: str) -> None: ...

    def unlock_range(self, fd: int, offset: int) -> None: ...

    def range_held(self, fd: int, offset: int) -> bool: ...


class ByteLocks:
    """The locked bytes of one store object (thread-safe; every method blocks briefly).

    ``directory`` must exist before the first :meth:`lock`.
    """

    __slots__ = ("_descriptors", "_files", "_mutex", "directory")

    def __init__(self, directory: Path, files: LockFiles) -> None:
        self.directory = directory
        self._files = files
        self._mutex = threading.Lock()
        self._descriptors: dict[int, int] = {}  # by shard, opened when first needed

    def lock(self, run_id: str) -> int:
        """Take ``run_id``'s byte, or raise ``RunLocked``; its offset, to give it back."""
        offset = claim_offset(run_id)
        with self._mutex:
            fd = self._descriptors.get(offset % SHARDS)
            if fd is None:
                try:
                    fd = self._files.open(self._path(offset), _LOCK_FLAGS, _FILE_MODE)
                except OSError as exc:
                    raise open_failed(exc, run_id, "the claims lock file") from exc
                self._descriptors[offset % SHARDS] = fd
            self._files.lock_range(fd, offset, run_id)
        return offset

    def unlock(self, offset: int) -> None:
        """Let the byte at ``offset`` go (under the mutex: a descriptor is closed under
        it too, and its number must not be reused by another file meanwhile)."""
        with self._mutex:
            fd = self._descriptors.get(offset % SHARDS)
            if fd is not None:
                with contextlib.suppress(OSError):
                    self._files.unlock_range(fd, offset)

    def held(self, run_ids: list[str]) -> list[bool]:
        """Whether anyone (this store object included) holds each run's byte now.

        Asks through a description of its own, so this object's locks count, and takes
        no lock, so no claimant is kept out.
        """
        answers = []
        for run_id in run_ids:
            offset = claim_offset(run_id)
            try:
                probe = self._files.open(self._path(offset), _PROBE_FLAGS)
            except FileNotFoundError:
                answers.append(False)  # nobody ever claimed a run of this shard here
                continue
            try:
                answers.append(self._files.range_held(probe, offset))
            finally:
                self._files.close(probe)
        return answers

    def close(self) -> None:
        """Let every byte go: close the descriptors."""
        with self._mutex:
            descriptors, self._descriptors = self._descriptors, {}
            for fd in descriptors.values():
                with contextlib.suppress(OSError):
                    self._files.close(fd)

    def _path(self, offset: int) -> Path:
        # A dot first: no run file of a JSON-lines directory has one.
        return self.directory / f".claims-{offset % SHARDS:x}.lock"


def open_failed(exc: OSError, run_id: str, what: str) -> StoreError:
    """The error for a file that could not be opened: nothing was written, so the run is
    not marked failed and may be resumed through this very store object."""
    limit = open_files_error(exc, run_id)
    if limit is not None:
        return limit
    error = StoreError(f"could not open {what}: {exc}", run_id=run_id)
    error.__cause__ = exc
    return error
