"""Claims for the stores of one host: a write lock on the run id's byte of a lock file,
which the kernel lets go when the process dies (docs/stores.md#claims-one-writer-per-run)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path

from anyio.lowlevel import EventLoopToken

from polyloop.stores._batching import GroupCommit
from polyloop.stores._jsonl.fileops import FileOps
from polyloop.stores._open_files import open_failed
from polyloop.stores._paths import create_directories
from polyloop.stores._writes import Claim, Write, WriterState, claimed_already, not_claimed

# The kernel walks a file's list of byte locks: 16 files keep a lock fast at 10,000 claims.
_SHARDS = 16
_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
# Commits the writes of one batch: an outcome for each.
Commit = Callable[[Sequence[Write]], Sequence[BaseException | None]]


def claim_offset(run_id: str) -> int:
    """62 bits of the id's sha256: two of 10,000 runs share a byte with a chance of 1e-10."""
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") >> 2


class OneHost:
    """The backend calls of a store for one host (blocking, but for the coroutines): its
    claims, each a locked byte of a lock file in ``directory``, and the group of its
    writes. A subclass reads the :class:`Claim` of a run once locked (:meth:`inspect`) and
    clears its trace of a claim given up (:meth:`free`). The claims' mutex is never held
    while a file or the database is touched."""

    def __init__(
        self, directory: Path, files: FileOps, commit: Commit, *, parallel: int = 1
    ) -> None:
        self.directory, self.files = directory, files
        self.state = WriterState()
        self.group = GroupCommit(commit, parallel=parallel)
        self._mutex = threading.Lock()
        self._held: dict[str, Claim] = {}
        self._taking: set[str] = set()  # being claimed now: a second claim is refused
        self._descriptors: dict[int, int] = {}  # by shard, opened when first needed
        self._ready = False  # the directory exists

    @abstractmethod
    def inspect(self, run_id: str) -> Claim: ...

    @abstractmethod
    def free(self, claim: Claim) -> None: ...

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        """Lock the run's byte and inspect the run; ``RunLocked`` if anyone holds it."""
        with self._mutex:
            self.state.check_writable(run_id)
            if run_id in self._held or run_id in self._taking:
                raise claimed_already(run_id)
            self._taking.add(run_id)
        try:
            if not self._ready:
                create_directories(self.files, self.directory, run_id=run_id)
                self._ready = True
            offset = self._lock(run_id)
            try:
                claim = self.inspect(run_id)
            except BaseException:
                self._unlock(offset)
                raise
            claim.offset = offset
            with self._mutex:
                self._held[run_id] = claim
        finally:
            with self._mutex:
                self._taking.discard(run_id)

    async def confirm(self, run_id: str) -> None:
        self.held(run_id)  # a lock only this living process holds, with no lease

    async def submit(self, write: Write) -> None:
        await self.group.submit(write)

    def held(self, run_id: str) -> Claim:
        """The run's claim, if the store may write it."""
        self.state.check_writable(run_id)
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

    def claimed(self, run_id: str) -> bool:
        """Whether anyone holds the run now, asked through a description of its own."""
        offset = claim_offset(run_id)
        try:
            probe = self.files.open(self._lock_file(offset), os.O_RDONLY | _FLAGS)
        except FileNotFoundError:
            return False  # nobody ever claimed a run of this shard here
        try:
            return self.files.range_held(probe, offset)
        finally:
            self.files.close(probe)

    def close(self) -> None:
        """Admit no claim or write from now on, and give every claim up."""
        self.state.closed = True
        with self._mutex:
            claims, self._held = self._held, {}
        for claim in claims.values():
            self._give_up(claim)
        with self._mutex:
            descriptors, self._descriptors = self._descriptors, {}
            for fd in descriptors.values():
                with contextlib.suppress(OSError):
                    self.files.close(fd)

    def _give_up(self, claim: Claim) -> None:
        with claim.lock:  # never under a write of the run
            try:
                self.free(claim)
            finally:
                self._unlock(claim.offset)

    def _lock(self, run_id: str) -> int:
        offset = claim_offset(run_id)
        with self._mutex:
            fd = self._descriptors.get(offset % _SHARDS)
            if fd is None:
                path, flags = self._lock_file(offset), os.O_RDWR | os.O_CREAT | _FLAGS
                try:
                    fd = self._descriptors[offset % _SHARDS] = self.files.open(path, flags, 0o600)
                except OSError as exc:
                    raise open_failed(exc, run_id, f"the claims lock file {path}") from exc
            self.files.lock_range(fd, offset, run_id)
        return offset

    def _unlock(self, offset: int) -> None:
        # Under the mutex, as closing is: a descriptor's number may not be reused meanwhile.
        with self._mutex:
            fd = self._descriptors.get(offset % _SHARDS)
            if fd is not None:
                with contextlib.suppress(OSError):
                    self.files.unlock_range(fd, offset)

    def _lock_file(self, offset: int) -> Path:
        # A dot first: no run file of a JSON-lines directory has one.
        return self.directory / f".claims-{offset % _SHARDS:x}.lock"
