"""What the stores share: the port's writes, file names, directories, the write and claim
values, the failed-run guard, the open-file limit's message (research records 0024, 0027, 0033)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Self

import anyio
import anyio.to_thread

from polyloop import types
from polyloop._shared import FORMAT, exception_text, record_kind
from polyloop.serialization import dumps, loads
from polyloop.stores._refusals import store_closed
from polyloop.types import CorruptLog, Record, Result, SchemaMajorMismatch, StepRecord, StoreError

logger = logging.getLogger("polyloop")

# How long giving a claim back after a failed claim or prune may keep its caller.
RELEASE_GRACE_S = 10.0
_SLOW_RELEASE = "run %r: giving its claim back took over %g s; it goes on in the background"


def check_format(recorded: object, *, holder: str, run_id: str | None, location: str) -> None:
    """Refuse an unreadable record format, or one of another major, held by ``holder``."""
    if not isinstance(recorded, str) or not recorded.startswith("polyloop/"):
        reason = f"no readable record format in the {holder} ({recorded!r:.80})"
        raise CorruptLog(reason, run_id=run_id, location=location)
    if recorded.partition(".")[0] != FORMAT.partition(".")[0]:
        reason = f"the {holder} holds records in format {recorded!r}; this library reads {FORMAT!r}"
        raise SchemaMajorMismatch(reason, run_id=run_id, location=location)


def safe_name(run_id: str) -> str:
    """A file name for ``run_id`` that cannot leave its directory or collide: a readable
    prefix (at most 40 safe characters, no leading dot) and the sha256 of the full id."""
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()
    prefix = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id)[:40].lstrip(".")
    return f"{prefix}-{digest}" if prefix else digest


def shown(run_id: str) -> str:
    """``run_id`` quoted and cut short, for messages and record locations."""
    text = repr(run_id)
    return text if len(text) <= 60 else text[:57] + "..."


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_files_error(exc: BaseException, run_id: str | None) -> StoreError | None:
    """A ``StoreError`` naming the open-file limit ``exc`` hit and what to do, or ``None``.
    SQLite says only "unable to open", so then the process tries to open a file itself."""
    number = getattr(exc, "errno", None)
    text = str(exc).lower()
    if number is None and not isinstance(exc, OSError):
        try:
            os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as probe:
            number = probe.errno
    if number == errno.ENFILE or "file table overflow" in text:
        what = (
            "too many open files on this machine (the system-wide limit, fs.file-max): "
            "raise it with `sysctl fs.file-max` or run fewer processes"
        )
    elif number == errno.EMFILE or "too many open files" in text:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        what = (
            f"too many open files (the process's open-file limit, RLIMIT_NOFILE = {soft}): "
            f"raise it with `ulimit -n` or run fewer concurrent runs per process"
        )
    else:
        return None
    error = StoreError(f"{what}; nothing was written, so the run can be resumed", run_id=run_id)
    error.__cause__ = exc
    return error


def open_failed(exc: OSError, run_id: str | None, what: str) -> StoreError:
    """A file would not open: nothing was written, so this object may resume the run.
    ``what`` names the file by its path, so the reason is the system's words alone."""
    error = open_files_error(exc, run_id) or StoreError(
        f"could not open {what}: {exc.strerror or exc}", run_id=run_id
    )
    error.__cause__ = exc
    return error


class DirectoryOps(Protocol):
    def mkdir(self, path: Path) -> None: ...
    def is_dir(self, path: Path) -> bool: ...
    def fsync_directory(self, directory: Path) -> None: ...


def create_directories(files: DirectoryOps, directory: Path, *, run_id: str | None) -> None:
    """Create ``directory`` and its missing parents, each synced into its parent (a lost
    directory takes its files along); a ``StoreError`` names a path that cannot be made."""
    missing: list[Path] = []
    current = directory
    while not files.is_dir(current) and current != current.parent:
        missing.append(current)
        current = current.parent
    try:
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by someone else meanwhile
                files.mkdir(path)
            if not files.is_dir(path):  # a file is in the way: name it, not the system's words
                raise StoreError(_in_the_way(path, directory), run_id=run_id)
            files.fsync_directory(path.parent)
    except OSError as exc:
        if isinstance(exc, StoreError):
            raise
        reason = exc.strerror or type(exc).__name__
        raise open_files_error(exc, run_id) or StoreError(
            f"cannot create the directory {path}: {reason}", run_id=run_id
        ) from exc


def _in_the_way(path: Path, directory: Path) -> str:
    """Why ``directory`` cannot be made: ``path`` (itself or a parent) is not a directory."""
    what = "a file" if os.path.isfile(path) else "something other than a directory"
    if path == directory:
        return f"{path} is {what}, not a directory"
    return f"cannot create the directory {directory}: {path} is {what}, not a directory"


def in_the_way(directory: Path) -> str | None:
    """Why ``directory`` cannot be made, if a path on the way to it is not a directory.
    Blocking (it looks at the file system)."""
    for path in (directory, *directory.parents):
        if path.is_dir():
            return None
        if path.exists():
            what = "a file" if path.is_file() else "something other than a directory"
            return f"{path} is {what}, not a directory"
    return None


async def claim_in_thread(
    claim: Callable[[], None], release: Callable[[], None], *, run_id: str
) -> None:
    """Run a blocking ``claim`` of ``run_id`` in a worker thread; if the call then raises
    (its caller was cancelled as the thread finished, say), ``release`` it again."""
    taken = False

    def claim_and_note() -> None:
        nonlocal taken
        claim()
        taken = True

    try:
        await anyio.to_thread.run_sync(claim_and_note)
    except BaseException:
        if taken:
            # Bounded: past the grace the release goes on in its thread, unwaited for,
            # and the caller's error or cancellation is not held up behind the store.
            with anyio.move_on_after(RELEASE_GRACE_S, shield=True) as scope:
                await anyio.to_thread.run_sync(release, abandon_on_cancel=True)
            if scope.cancelled_caught:
                logger.warning(_SLOW_RELEASE, run_id, RELEASE_GRACE_S)
        raise


def decode_row(body: object, *, run_id: str, kind: object, location: str) -> Record:
    """The record a database row holds, of ``run_id`` and ``kind``, or ``CorruptLog``."""
    if not isinstance(body, (str, bytes)):
        reason = f"the body is {type(body).__name__}, not text"
    else:
        try:
            record = loads(body, location=location)
        except CorruptLog as exc:
            if exc.run_id is not None:
                raise
            raise CorruptLog(exc.reason, run_id=run_id, location=location) from exc
        if record.run_id != run_id:
            reason = f"the row holds a record of run {shown(record.run_id)}"
        elif record_kind(record) != kind:
            reason = f"the row says {kind!r} but holds a {record_kind(record)!r} record"
        else:
            return record
    raise CorruptLog(reason, run_id=run_id, location=location)


def record_row(record: Record) -> tuple[str, str]:
    return record_kind(record), dumps(record)  # dumps refuses anything not a record


@dataclass(eq=False, slots=True)
class Write:
    """The rows of one store call and what it means for its run."""

    run_id: str
    rows: list[tuple[str, str]]  # (kind, body) of each record, in order
    start: bool = False  # the run must have no record yet
    end: bool = False  # an end record: the claim is given up with it
    final: bool = False  # a final end record: nothing may follow it
    reason: str | None = None  # the stop reason of an end record
    barrier: bool = False  # must be fsync'd before the call returns


@dataclass(eq=False, slots=True)
class Claim:
    """This store object is ``run_id``'s writer. ``epoch`` fences database writes; a file
    store's ``next_seq`` is only 0 or 1; ``offset`` is the locked byte of a store for one
    host, ``generation`` the lease generation of a shared database."""

    run_id: str
    epoch: int = 0
    next_seq: int = 0
    finished: bool = False  # the log ends with a final end record
    offset: int = -1
    generation: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)  # around each write of the run


class StoreBase:
    """The store port's writes over one ``_write``; leaving an ``async with`` block closes it."""

    __slots__ = ()

    async def start_run(self, record: types.RunStarted) -> None:
        """Write the run's first record, a durable barrier."""
        await self._write(record, start=True, barrier=True)

    async def write_intent(self, intent: types.Intent) -> None:
        """Write an intent, a durable barrier."""
        await self._write(intent, barrier=True)

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call; committed, not necessarily durable."""
        await self._write(result)

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record in one transaction."""
        records = (step,) if action_result is None else (action_result, step)
        if records[0].run_id != step.run_id:
            reason = f"the action result belongs to run {records[0].run_id!r}"
            raise StoreError(reason, run_id=step.run_id)
        await self._write(*records)

    async def write_review(self, record: types.Review) -> None:
        """Write a proposal, verdict or settlement, a durable barrier like an intent."""
        await self._write(record, barrier=True)

    async def end_run(self, record: types.RunEnded) -> None:
        """Write the run's end record and give up the claim, in one transaction."""
        await self._write(record)

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _write(
        self, *records: Record, start: bool = False, barrier: bool = False
    ) -> None: ...


@dataclass
class WriterState:
    """Whether one store object is closed, and the runs it must not write again: a retried
    ``fsync`` can report success for data the kernel dropped."""

    failed: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    mutex: threading.Lock = field(default_factory=threading.Lock)

    def check_open(self, run_id: str | None) -> None:
        if self.closed:
            raise store_closed(run_id)

    def check_writable(self, run_id: str) -> None:
        self.check_open(run_id)
        if (reason := self.failed.get(run_id)) is not None:
            raise StoreError(
                f"an earlier write of this run failed ({reason}); close and reopen the "
                f"store before writing to it again",
                run_id=run_id,
            )

    def fail(self, run_id: str, exc: BaseException) -> StoreError:
        """Remember that ``run_id`` failed and build the error to raise."""
        self.failed[run_id] = exception_text(exc)
        error = StoreError(f"write failed: {type(exc).__name__}: {exc}", run_id=run_id)
        error.__cause__ = exc
        return error
