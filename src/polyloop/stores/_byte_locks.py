"""Claims held by the operating system, for the stores of one host (JSON lines, SQLite).

Run ``R`` is claimed by the write lock on byte ``claim_offset(R)`` of one of 16 lock
files ``.claims-<shard>.lock``, taken through a descriptor the store object keeps open.
The lock belongs to the open description (``F_OFD_SETLK``): a second store object, in
this process or another, is refused, and the kernel lets it go when the description is
closed or the process dies. A hung process keeps it. Research records 0027 (bounded open
files) and 0032 (SQLite, a store for one host) say why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from anyio.lowlevel import EventLoopToken

from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import (
    Claim,
    DirectoryOps,
    Write,
    WriterState,
    create_directories,
    open_files_error,
)
from polyloop.stores._refusals import claimed_already, not_claimed
from polyloop.types import RunLocked, StoreError

__all__ = (
    "SHARDS",
    "HostClaims",
    "OneHost",
    "LockFiles",
    "claim_offset",
    "lock_range",
    "open_failed",
    "range_held",
    "unlock_range",
)

# The kernel keeps a file's byte locks in one list that each lock call walks: spread over
# 16 files, a lock stays in the tens of microseconds at 10,000 claims.
SHARDS = 16
_FILE_MODE = 0o600
_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | _FLAGS
_PROBE_FLAGS = os.O_RDONLY | _FLAGS
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux
_RANGE_BITS = 62  # offsets stay positive in a signed 64-bit off_t


def claim_offset(run_id: str) -> int:
    """The byte that stands for ``run_id``: 62 bits of its sha256. Two runs share one
    with a chance of about 1e-10 at 10,000 claims; the cost is a spurious ``RunLocked``."""
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - _RANGE_BITS)


def lock_range(fd: int, offset: int, run_id: str) -> None:
    """Take the write lock on byte ``offset`` of ``fd``'s file, or raise ``RunLocked``."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunLocked("another writer holds this run", run_id=run_id) from None
        raise StoreError(f"could not lock the run: {exc}", run_id=run_id) from exc


def unlock_range(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))


def range_held(fd: int, offset: int) -> bool:
    """Whether another open description holds the lock on byte ``offset`` (asks only)."""
    answer = fcntl.fcntl(
        fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, offset, 1, 0)
    )
    return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)


def open_failed(exc: OSError, run_id: str | None, what: str) -> StoreError:
    """The error for a file that would not open: nothing was written, so the run is not
    marked failed and this store object may resume it."""
    error = open_files_error(exc, run_id) or StoreError(
        f"could not open {what}: {exc}", run_id=run_id
    )
    error.__cause__ = exc
    return error


class LockFiles(DirectoryOps, Protocol):
    """The file operations the claims need (the JSON-lines store passes its own)."""

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int: ...

    def close(self, fd: int) -> None: ...

    def lock_range(self, fd: int, offset: int, run_id: str) -> None: ...

    def unlock_range(self, fd: int, offset: int) -> None: ...

    def range_held(self, fd: int, offset: int) -> bool: ...


class HostClaims:
    """One store object's claims, by run id, each held by a locked byte (blocking: call
    it from a worker thread). ``inspect(run_id)`` reads the run's :class:`Claim` with its
    byte locked; ``free(claim)`` clears the store's own trace of a claim given up (a row
    naming the writer, a file no run started in) before the byte goes. The map changes
    under its own mutex, never held while a file or the database is touched."""

    __slots__ = (
        "_descriptors",
        "_files",
        "_free",
        "_held",
        "_inspect",
        "_mutex",
        "_ready",
        "_state",
        "_taking",
        "directory",
    )

    def __init__(
        self,
        directory: Path,
        files: LockFiles,
        state: WriterState,
        *,
        inspect: Callable[[str], Claim],
        free: Callable[[Claim], None],
    ) -> None:
        self.directory = directory
        self._files, self._state = files, state
        self._inspect, self._free = inspect, free
        self._mutex = threading.Lock()
        self._held: dict[str, Claim] = {}
        self._taking: set[str] = set()  # being claimed now: a second claim is refused
        self._descriptors: dict[int, int] = {}  # by shard, opened when first needed
        self._ready = False  # the directory exists

    def take(self, run_id: str) -> None:
        """Lock the run's byte and inspect the run; ``RunLocked`` if anyone holds it."""
        with self._mutex:
            self._state.check_writable(run_id)
            if run_id in self._held or run_id in self._taking:
                raise claimed_already(run_id)
            self._taking.add(run_id)
        try:
            if not self._ready:
                create_directories(self._files, self.directory, run_id=run_id)
                self._ready = True
            offset = self._lock(run_id)
            try:
                claim = self._inspect(run_id)
            except BaseException:
                self._unlock(offset)
                raise
            claim.offset = offset
            with self._mutex:
                self._held[run_id] = claim
        finally:
            with self._mutex:
                self._taking.discard(run_id)

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it."""
        self._state.check_writable(run_id)
        claim = self._held.get(run_id)
        if claim is None:
            raise not_claimed(run_id)
        return claim

    def holds(self, run_id: str) -> bool:
        return run_id in self._held

    def current(self, claim: Claim) -> bool:
        """Whether ``claim`` still holds its run (it was not given up meanwhile)."""
        return self._held.get(claim.run_id) is claim

    def release(self, run_id: str) -> None:
        """Give the claim up: free the store's trace of it, then the byte."""
        with self._mutex:
            claim = self._held.pop(run_id, None)
        if claim is not None:
            self._give_up(claim)

    def ended(self, claim: Claim) -> None:
        """The run's last write gave the claim up in the store itself: let the byte go."""
        with self._mutex:
            if self._held.get(claim.run_id) is not claim:
                return
            del self._held[claim.run_id]
        self._unlock(claim.offset)

    def claimed(self, run_ids: list[str]) -> list[bool]:
        """Whether anyone (this object included) holds each run now: asked through a
        description of its own, taking no lock, so no claimant is kept out."""
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
        """Give up every claim, then close the lock files."""
        with self._mutex:
            claims, self._held = self._held, {}
        for claim in claims.values():
            self._give_up(claim)
        with self._mutex:
            descriptors, self._descriptors = self._descriptors, {}
            for fd in descriptors.values():
                with contextlib.suppress(OSError):
                    self._files.close(fd)

    def _give_up(self, claim: Claim) -> None:
        with claim.lock:  # never under a write of the run
            try:
                self._free(claim)
            finally:
                self._unlock(claim.offset)

    def _lock(self, run_id: str) -> int:
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

    def _unlock(self, offset: int) -> None:
        # Under the mutex: a descriptor closes under it too, and its number must not be
        # reused by another file meanwhile.
        with self._mutex:
            fd = self._descriptors.get(offset % SHARDS)
            if fd is not None:
                with contextlib.suppress(OSError):
                    self._files.unlock_range(fd, offset)

    def _path(self, offset: int) -> Path:
        # A dot first: no run file of a JSON-lines directory has one.
        return self.directory / f".claims-{offset % SHARDS:x}.lock"


class OneHost:
    """The backend calls of a store for one host: its claims are :class:`HostClaims`,
    its writes go through one :class:`GroupCommit`."""

    __slots__ = ()

    claims: HostClaims
    group: GroupCommit[Write]

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        self.claims.take(run_id)

    def release(self, run_id: str) -> None:
        self.claims.release(run_id)

    def holds(self, run_id: str) -> bool:
        return self.claims.holds(run_id)

    async def confirm(self, run_id: str) -> None:
        self.claims.held(run_id)  # a lock only this living process holds, with no lease

    async def submit(self, write: Write) -> None:
        await self.group.submit(write)
