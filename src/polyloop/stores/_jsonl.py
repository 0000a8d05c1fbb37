"""The JSON-lines store: one append-only file per run in one directory.

On disk
=======

Run ``R`` lives in ``<directory>/<safe_name(R)>.jsonl``. The file name is a readable
prefix of the id plus the sha256 of the whole id, so no run id (``../x``, ``/``, NUL,
``.``, thousands of characters) can name a file outside the directory or collide with
another run. The file is UTF-8 text made of lines, each ended by ``\\n``:

* every record except a step is one line: the canonical JSON object that
  :func:`polyloop.serialization.dumps` produces for it;
* a step written together with its action's result is one line holding a JSON array of
  exactly two such objects, the result first and the step second
  (``[{..."kind":"result"...},{..."kind":"step"...}]``). Putting both on one line is
  what makes ``write_step`` atomic: the pair is valid only once its newline is on disk.
  A step written without a result is a plain one-object line.

Bytes after the last ``\\n`` are a *torn tail*, the trace of a write that never
completed. The next claim of the run removes a torn tail (truncating the file to the
end of its last complete line), once it holds the run's writer lock.

What readers make of each line, torn or bad: see :mod:`polyloop.stores._jsonl_reader`.

Durability
==========

* ``start_run`` (on a claimed run, whose file the claim created with mode ``0o600``:
  logs hold prompts and model output) writes the first line, then syncs (``fsync``)
  the file and after it the directory, so that both the content and the directory
  entry survive a machine crash. If the store had to create the directory itself,
  each new directory's entry is synced into its parent as well. A file that holds no
  complete line (a start that died before its newline) is treated as empty; any
  complete line makes it :class:`~polyloop.types.RunAlreadyExists`.
* ``write_intent`` syncs the file before returning: the intent is durable before the
  effect it announces happens.
* ``write_result``, ``write_step`` and ``end_run`` only append. Losing them in a
  machine crash leaves a log that recovery already handles (an open intent, or a run
  whose stop is decided again from the same records), so they skip the cost of a sync.
* Every line is written with ``O_APPEND`` in a loop that completes short writes, and
  no open ever follows a symbolic link (``O_NOFOLLOW``) or accepts anything but a
  regular file.
* An ``OSError`` while writing or syncing makes that run unwritable through this store
  object (:class:`~polyloop.types.StoreError`); an ``fsync`` is never retried, because
  after a failed one the kernel may already have dropped the data it could not write.
  The failed store object closes its descriptor at once, which releases the writer lock
  so that a new store object can take the run over.

Writers
=======

A store object becomes a run's writer with ``claim_run``, which opens the run file
(creating it, mode ``0o600``, if it is new) and takes an exclusive ``flock`` on it. The
claim cuts off a torn tail and reads the last complete line, to know whether the run
has finished. It is held until ``end_run`` for that run, ``release_run``, ``aclose()``
or the end of the process; releasing the claim of a run that never started removes the
empty file. Every write needs the claim, and none may follow a final end record. Any
other store object, in this process or another, gets :class:`~polyloop.types.RunLocked`.
This is a store for one host, and a claim has no lease: a process that hangs keeps its
runs until it dies (the operating system then frees its locks at once), and one that is
merely slow is never taken over.
Readers never take the lock; asking whether a run is claimed holds it shared for a
moment, which a claimant waits out. Inside one store object, the writes of one run are
serialized by a per-run lock held around the whole write, while different runs proceed
in parallel.

Threads
=======

Opening, locking, reading, creating a run, claiming and releasing run in a worker thread
(``anyio.to_thread.run_sync``), which is what lets this store serve asyncio and Trio
alike. Two kinds of call run on the event loop's own thread instead, because a thread
hop (two wake-ups) costs as much as the disk work it would carry:

* an append to a run whose descriptor this object already holds, without a sync (a
  copy of a few hundred bytes into the page cache);
* an append with its sync, while this object writes a single run and the last timed
  sync took under two milliseconds.

With several runs (or a slow disk, until it is fast again), an intent's line is still
appended here, and its sync goes to a worker thread: the syncs waiting at the same
moment share a thread (up to 16 such batches run at once), so the syncs of different
runs overlap on the disk instead of queueing behind the event loop, and many runs do
not pay one thread hop each. The run's lock is held until its sync ends. Any of these
falls back to one worker thread for the whole write when the run's lock is busy. Research-wiki
record 0013 holds the measurements behind these rules.

File operations
===============

Every call the store makes to the file system (open, write, read, sync a file or a
directory, truncate, close, lock, create and list directories) goes through one object
(see :mod:`polyloop.stores._fileops`). By default that object is the operating system
itself; a test can hand the store a model of a disk instead, through the private
``_files`` keyword, to see what the rules above leave behind when the power fails or a
write is refused.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import anyio.to_thread

from polyloop.ports import StoredRun
from polyloop.stores._archive import check_cutoff, prune_runs
from polyloop.stores._batching import GroupCommit, InlineSyncGate
from polyloop.stores._common import (
    FORMAT,
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

_T = TypeVar("_T")

logger = logging.getLogger("polyloop")

_FILE_MODE = 0o600
# A claim opens (or creates) the run file and also reads it (to find a torn tail and
# whether the run ended) through the same descriptor, so that the file it inspects is
# the file it locked.
_CLAIM = os.O_RDWR | os.O_CREAT | os.O_APPEND | COMMON_FLAGS
# A claimant that locked a file its previous holder had just removed tries again.
_CLAIM_ATTEMPTS = 100
# Batches of syncs that may run at once, each in its own worker thread: the disk
# overlaps syncs of different files, and 16 reached the hand-written loop's overlap in
# the concurrency benchmark while leaving most of AnyIO's 40 default threads free.
_PARALLEL_SYNCS = 16


class _SystemFiles(OsFileOps):
    """The operating system's file operations; directory syncs use this module's name.

    Calling the module-level ``fsync_directory`` (rather than the shared helper
    directly) keeps that name the single place where this module syncs a directory.
    """

    __slots__ = ()

    def fsync_directory(self, directory: Path) -> None:
        fsync_directory(directory)


_SYSTEM_FILES = _SystemFiles()


@dataclass(eq=False)
class _Slot:
    """One run inside one store object: its serializing lock and, while this object holds
    the run's claim, the locked descriptor and what the claim found in the file."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    fd: int | None = None
    users: int = 0
    started: bool = False  # the file holds a complete line
    finished: bool = False  # its last complete line is a final end record


class JsonlStore:
    """Keeps every run in an append-only JSON-lines file in ``directory``.

    The directory (with its parents) is created when the first run starts in it. Runs
    survive the store object, the process and, for what the durability rules cover, the
    machine: open a new ``JsonlStore`` on the same directory (or a copy of it moved
    elsewhere) to read or resume them. Use it as an async context manager, or call
    :meth:`aclose`, to release the writer locks it holds.
    """

    __slots__ = (
        "_directory", "_directory_ready", "_files", "_gate", "_slots", "_state", "_syncs",
    )

    def __init__(
        self, directory: str | os.PathLike[str], *, _files: FileOps | None = None
    ) -> None:
        self._directory = Path(os.path.abspath(os.fspath(directory)))
        self._files: FileOps = _SYSTEM_FILES if _files is None else _files
        self._directory_ready = False
        self._slots: dict[str, _Slot] = {}
        self._state = WriterState()
        self._gate = InlineSyncGate()
        self._syncs: GroupCommit[int] = GroupCommit(
            self._sync_batch, parallel=_PARALLEL_SYNCS
        )

    def parameters(self) -> Mapping[str, JSONValue]:
        """The kind and record format; never the directory, so moved data still resumes."""
        return {"kind": "jsonl", "format": FORMAT}

    async def claim_run(self, run_id: str) -> None:
        """Open (or create) the run's file and take its writer lock.

        Raises :class:`~polyloop.types.RunLocked` if another store object, here or in
        another process, or this one already, holds it. A torn tail is cut off now; a
        file holding no complete line (a start that died before its first newline)
        counts as empty.

        Cancellation: the worker thread finishes before the cancellation is delivered,
        and the claim is given up again if the call does not return.
        """
        self._check_open(run_id)
        await claim_in_thread(partial(self._claim_sync, run_id),
                              partial(self._release_sync, run_id))

    async def release_run(self, run_id: str) -> None:
        """Give up the claim: close the descriptor, removing the file if no run started.

        Cancellation: the worker thread finishes before the cancellation is delivered.
        """
        slot = self._slots.get(run_id)
        if slot is not None and slot.fd is not None:
            await anyio.to_thread.run_sync(self._release_sync, run_id)

    async def start_run(self, record: RunStarted) -> None:
        """Write the claimed run's first record, then sync the file and the directory.

        Raises :class:`~polyloop.types.RunAlreadyExists` if the file already holds a
        complete record.

        Cancellation: the worker thread finishes writing and syncing before the
        cancellation is delivered, so a cancelled call still leaves a started run whose
        first record and directory entry are durable.
        """
        data = record_line(record)
        await anyio.to_thread.run_sync(self._start_sync, record.run_id, data)

    async def write_intent(self, intent: Intent) -> None:
        """Append an intent and ``fsync`` the file before returning.

        Cancellation: the append and the sync (on this thread or in a worker thread)
        finish before the cancellation is delivered, so a cancelled call still leaves a
        durable intent.
        """
        await self._append(intent.run_id, record_line(intent), sync=True)

    async def write_result(self, result: Result) -> None:
        """Append the result of a model call (not synced).

        Cancellation: the append finishes before the cancellation is delivered; the
        line is complete in the file either way.
        """
        await self._append(result.run_id, record_line(result))

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Append a step and its action's result as one line, so both land or neither.

        Cancellation: the append finishes before the cancellation is delivered; the
        line is complete in the file either way.
        """
        if action_result is None:
            await self._append(step.run_id, record_line(step))
            return
        if action_result.run_id != step.run_id:
            raise StoreError(
                f"the action result belongs to run {action_result.run_id!r}", run_id=step.run_id
            )
        await self._append(step.run_id, pair_line(action_result, step))

    async def end_run(self, record: RunEnded) -> None:
        """Append the end record, then release this run's writer lock.

        Cancellation: the append and the release finish before the cancellation is
        delivered.
        """
        await self._append(record.run_id, record_line(record), release=True)

    async def read_log(self, run_id: str) -> RunLog:
        """Every complete record of ``run_id`` in write order; empty if it has no file.

        Cancellation: reading has no effect on disk; the worker thread finishes the read
        and its result is discarded.
        """
        self._check_open(run_id)
        records = await anyio.to_thread.run_sync(self._read_sync, run_id)
        return RunLog(run_id=run_id, records=records)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run in the directory, sorted by id (only unfinished ones if asked).

        Each ``*.jsonl`` file is opened for its first line (the file name only hashes
        the run id), its last line (has the run finished?) and whether a writer holds
        its lock; ``updated_at`` is the file's modification time. A file with no
        complete line yet (a start that never finished, a claimed id) holds no run. A
        file whose first line is not a record of its run is left out with a warning
        naming it (``polyloop verify`` tells more).

        Cancellation: listing has no effect on disk; the worker thread finishes and its
        result is discarded.
        """
        if self._state.closed:
            raise StoreError("the store is closed")
        listed = await anyio.to_thread.run_sync(self._list_sync)
        return tuple(run for run in listed if not (unfinished_only and run.finished))

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if its file holds no record.

        Cancellation: as for :meth:`list_runs`.
        """
        self._check_open(run_id)
        return await anyio.to_thread.run_sync(self._describe_sync, self._path(run_id), run_id)

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before`` (file time); their ids.

        A run that is unfinished, ended in doubt, or claimed is never touched: each run
        is removed under its claim, its file unlinked while the writer lock is held.
        With ``archive``, each run's log is first written durably to that directory.

        Cancellation: each run is archived and removed whole or not at all.
        """
        cutoff = check_cutoff(finished_before)
        candidates = [run.run_id for run in await self.list_runs() if run.finished
                      and not run.claimed and run.updated_at is not None
                      and run.updated_at < cutoff]
        return await prune_runs(self, candidates,
                                archive=Path(archive) if archive is not None else None,
                                delete=partial(self._delete_claimed, cutoff=cutoff))

    async def aclose(self) -> None:
        """Release every writer lock and refuse further use. Idempotent.

        Cancellation: the worker thread finishes closing before the cancellation is
        delivered; a write in progress completes first.
        """
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

    async def _append(
        self, run_id: str, data: bytes, *, sync: bool = False, release: bool = False
    ) -> None:
        # An append to a descriptor we already hold is a short copy into the page cache:
        # it runs here rather than paying a thread hop. A sync joins it only while this
        # store writes one run and syncs are quick (see InlineSyncGate); otherwise the
        # sync goes to a worker thread, where the syncs of different runs overlap.
        if not sync or self._gate.allows(len(self._slots)):
            if self._append_here(run_id, data, sync, release):
                return
        elif await self._append_then_share_sync(run_id, data):
            return
        await anyio.to_thread.run_sync(self._append_sync, run_id, data, sync, release)

    def _append_here(self, run_id: str, data: bytes, sync: bool, release: bool) -> bool:
        """Append (and sync) on this thread if the run's descriptor is held and its lock free.

        ``False`` (nothing done) sends the caller to a worker thread: a run this object
        has not claimed is refused there, and a busy lock means a worker thread is using
        the run (closing the store), which must not block the event loop. Written out
        rather than composed from :meth:`_claimed` and :meth:`_guarded`: it runs up to
        four times a step, right after a blocking sync, when every call costs most.
        """
        slot = self._slots.get(run_id)
        if slot is None or not slot.lock.acquire(blocking=False):
            return False
        try:
            # Only a holder of the lock clears the descriptor, and a slot holding one is
            # never dropped, so this slot stays the run's while we hold its lock.
            if slot.fd is None:
                return False
            self._state.check_writable(run_id)
            fd = _writable_fd(slot, run_id)
            try:
                _write_all(self._files, fd, data)
                if sync:
                    self._gate.timed(lambda: self._files.fsync(fd))
                if release:
                    _release(self._files, slot)
            except OSError as exc:
                _release(self._files, slot, quiet=True)
                raise self._state.fail(run_id, exc) from exc
            return True
        finally:
            slot.lock.release()
            if slot.fd is None:
                self._drop_if_unused(run_id, slot)

    async def _append_then_share_sync(self, run_id: str, data: bytes) -> bool:
        """Append here, then sync in a worker-thread batch with other runs' syncs.

        With many runs writing, the syncs waiting at the same moment share one thread
        hop, and up to ``_PARALLEL_SYNCS`` batches overlap on the disk. ``False``
        (nothing done) as for :meth:`_append_here`. The run's lock is held until the sync
        ends, so no one closes the descriptor under it; only worker threads ever wait
        for that lock.
        """
        with self._claimed(run_id) as slot:
            if slot is None or slot.fd is None:
                return False
            fd = _writable_fd(slot, run_id)
            # A failed append raises here (and gives the descriptor up); after a
            # successful one the descriptor is still ``fd``: only we hold its lock.
            self._guarded(run_id, slot, lambda _: _write_all(self._files, fd, data))
            try:
                # Shielded: an intent whose line is written must be synced before the
                # caller hears anything, cancelled or not.
                with anyio.CancelScope(shield=True):
                    await self._syncs.submit(fd)
            except OSError as exc:
                _release(self._files, slot, quiet=True)
                raise self._state.fail(run_id, exc) from exc
            return True

    def _sync_batch(self, fds: Sequence[int]) -> list[BaseException | None]:
        """Sync each descriptor (worker thread); each caller gets its own outcome."""
        errors: list[BaseException | None] = []
        for fd in fds:
            try:
                self._gate.timed(lambda: self._files.fsync(fd))  # noqa: B023 -- runs at once
            except OSError as exc:
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    def _append_sync(self, run_id: str, data: bytes, sync: bool, release: bool) -> None:
        self._locked(run_id, self._appender(run_id, data, sync, release))

    def _appender(
        self, run_id: str, data: bytes, sync: bool, release: bool
    ) -> Callable[[_Slot], None]:
        files = self._files

        def append(slot: _Slot) -> None:
            fd = _writable_fd(slot, run_id)
            _write_all(files, fd, data)
            if sync:
                self._gate.timed(lambda: files.fsync(fd))
            if release:
                _release(files, slot)

        return append

    def _start_sync(self, run_id: str, data: bytes) -> None:
        def start(slot: _Slot) -> None:
            fd = _claimed_fd(slot, run_id)
            if slot.started:
                raise RunAlreadyExists("the run already has records", run_id=run_id)
            _write_all(self._files, fd, data)
            slot.started = True
            self._gate.timed(lambda: self._files.fsync(fd))
            self._files.fsync_directory(self._directory)

        self._locked(run_id, start)

    def _claim_sync(self, run_id: str) -> None:
        def claim(slot: _Slot) -> None:
            if slot.fd is not None:
                raise RunLocked("this store object already holds the run's claim",
                                run_id=run_id)
            self._ensure_directory()
            fd = self._open_claimed(run_id)
            try:
                end, size = complete_end(self._files, fd)
                if size > end:  # a torn tail: what remains of a write that never finished
                    self._files.ftruncate(fd, end)
                    self._files.fsync(fd)
                ended = last_end(self._files, fd, end, self._path(run_id).name) if end else None
                finished = ended is not None and ended.is_final
            except BaseException:
                self._files.close(fd)
                raise
            slot.fd, slot.started, slot.finished = fd, end > 0, finished

        self._locked(run_id, claim)

    async def _delete_claimed(self, run_id: str, *, cutoff: datetime) -> bool:
        return await anyio.to_thread.run_sync(self._delete_sync, run_id, cutoff)

    def _delete_sync(self, run_id: str, cutoff: datetime) -> bool:
        def delete(slot: _Slot) -> bool:
            fd = _claimed_fd(slot, run_id)
            if datetime.fromtimestamp(self._files.fstat(fd).st_mtime, UTC) >= cutoff:
                return False  # written to since it was listed
            path = self._path(run_id)
            if self._files.names_file(fd, path):
                self._files.unlink(path)
                self._files.fsync_directory(self._directory)
            _release(self._files, slot)
            return True

        return self._locked(run_id, delete)

    def _release_sync(self, run_id: str) -> None:
        self._locked(run_id, lambda slot: self._unclaim(slot, run_id))

    def _unclaim(self, slot: _Slot, run_id: str, *, quiet: bool = False) -> None:
        """Close the claim's descriptor (its lock held); remove the file if no run started."""
        if slot.fd is not None and not slot.started:
            # Only a claim made the file: remove it, so no run id leaves a trace. The
            # lock is still held, so nobody has made it a run meanwhile.
            path = self._path(run_id)
            with contextlib.suppress(OSError):
                if self._files.names_file(slot.fd, path):
                    self._files.unlink(path)
        _release(self._files, slot, quiet=quiet)

    def _open_claimed(self, run_id: str) -> int:
        """Open or create the run file and lock it, as it is named now."""
        files, path = self._files, self._path(run_id)
        for _ in range(_CLAIM_ATTEMPTS):
            try:
                fd = files.open(path, _CLAIM, _FILE_MODE)
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

    def _locked(self, run_id: str, action: Callable[[_Slot], _T]) -> _T:
        """Run ``action`` holding the run's lock; map OS failures to a failed run."""
        slot = self._enter(run_id)
        try:
            with slot.lock:
                return self._guarded(run_id, slot, action)
        finally:
            self._leave(run_id, slot)

    @contextlib.contextmanager
    def _claimed(self, run_id: str) -> Iterator[_Slot | None]:
        """The run's slot, locked, if its descriptor is held and its lock free; else None.

        Never waits: the event loop's thread must not block on a lock a worker holds.
        """
        slot = self._slots.get(run_id)
        if slot is None or not slot.lock.acquire(blocking=False):
            yield None
            return
        # Only a holder of the slot's lock clears its descriptor, and a slot with a
        # descriptor is never dropped, so this check under the lock is stable.
        if slot.fd is None:
            slot.lock.release()
            yield None
            return
        with self._state.mutex:
            slot.users += 1
        try:
            yield slot
        finally:
            slot.lock.release()
            self._leave(run_id, slot)

    def _guarded(self, run_id: str, slot: _Slot, action: Callable[[_Slot], _T]) -> _T:
        """Run ``action`` under the run's lock (held by the caller); failures end the run."""
        self._state.check_writable(run_id)
        try:
            return action(slot)
        except PolyLoopError:
            raise
        except OSError as exc:
            _release(self._files, slot, quiet=True)
            raise self._state.fail(run_id, exc) from exc

    def _enter(self, run_id: str) -> _Slot:
        with self._state.mutex:
            slot = self._slots.setdefault(run_id, _Slot())
            slot.users += 1
            return slot

    def _leave(self, run_id: str, slot: _Slot) -> None:
        with self._state.mutex:
            slot.users -= 1
            if slot.users == 0 and slot.fd is None:
                del self._slots[run_id]

    def _drop_if_unused(self, run_id: str, slot: _Slot) -> None:
        """Forget a slot that gave up its descriptor, unless a caller still uses it."""
        with self._state.mutex:
            if slot.users == 0 and slot.fd is None and self._slots.get(run_id) is slot:
                del self._slots[run_id]

    def _ensure_directory(self) -> None:
        if not self._directory_ready:
            _create_directories(self._files, self._directory)
            self._directory_ready = True

    def _close_sync(self) -> None:
        with self._state.mutex:
            self._state.closed = True
            slots = list(self._slots.items())
        for run_id, slot in slots:
            with slot.lock:
                self._unclaim(slot, run_id, quiet=True)

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
            return StoredRun(
                run_id=run_id,
                finished=_is_final(last_end(files, fd, end, path.name)),
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


# -- file helpers -------------------------------------------------------------------------


def _write_all(files: FileOps, fd: int, data: bytes) -> None:
    """Append ``data`` completely; a write may take only part of it per call."""
    written = files.write(fd, data)
    if written == len(data):
        return  # the usual case, without building a view
    view = memoryview(data)
    while True:
        if written <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        view = view[written:]
        if not view:
            return
        written = files.write(fd, view)


def _release(files: FileOps, slot: _Slot, *, quiet: bool = False) -> None:
    """Close the run's writer descriptor, which releases its ``flock``."""
    if slot.fd is None:
        return
    fd, slot.fd = slot.fd, None
    try:
        files.close(fd)
    except OSError:
        if not quiet:
            raise


def _is_final(end: RunEnded | None) -> bool:
    return end is not None and end.is_final


def _claimed_fd(slot: _Slot, run_id: str) -> int:
    """The run's descriptor, if this store object holds the run's claim."""
    if slot.fd is None:
        raise RunLocked("this store object does not hold the run's claim", run_id=run_id)
    return slot.fd


def _writable_fd(slot: _Slot, run_id: str) -> int:
    """The descriptor to append to: the run is claimed, started and not ended."""
    fd = _claimed_fd(slot, run_id)
    if not slot.started:
        raise StoreError("the run was never started in this store", run_id=run_id)
    if slot.finished:
        raise StoreError("the run has ended; nothing may follow its end record",
                         run_id=run_id)
    return fd


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

