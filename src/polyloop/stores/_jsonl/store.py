"""The JSON-lines store: one append-only file per run, on the engine, each file open only
while it is read or written (docs/stores.md#jsonlstore)."""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from polyloop import types
from polyloop._paging import PageRequest, page_of
from polyloop.ports import RunPage, StoredRun
from polyloop.stores._byte_locks import OneHost
from polyloop.stores._engine import Archive, EngineStore, Watch, refuse_own_archive
from polyloop.stores._jsonl import reader
from polyloop.stores._jsonl.fileops import FileOps, OsFileOps, write_all
from polyloop.stores._paths import safe_name
from polyloop.stores._polling import Poller
from polyloop.stores._writes import (
    Claim,
    Write,
    cancel_refusal,
    check_order,
    no_run,
    not_claimed,
)
from polyloop.types import CorruptLog, PolyLoopError, Record, SchemaMajorMismatch, StoreError

logger = logging.getLogger("polyloop")

# A claim opens (or creates) the run file; a write opens it again, never creating it.
_CLAIM_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | reader.COMMON_FLAGS
_WRITE_FLAGS = os.O_WRONLY | os.O_APPEND | reader.COMMON_FLAGS
_MARKER_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | reader.COMMON_FLAGS
# The byte of a run file locked around an intent's check and write, a cancel request's
# marker, and a prune: each sees the others whole. Closing the file lets it go.
_FENCE = 0


class JsonlStore(EngineStore):
    """Keeps every run in an append-only JSON-lines file in ``directory`` (made at the first
    claim); a new ``JsonlStore`` on it, or on a moved copy, reads or resumes the runs. For one
    host: a claim has no lease, so a hung process keeps its runs until it dies.

    Cancellation, for every method: the worker thread a call started finishes before
    the cancellation is delivered. A write cancelled before its batch started writes
    nothing; once it started, the line is appended (and synced, for a start or an
    intent) either way. Reads change nothing."""

    __slots__ = ("_directory",)

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(os.path.abspath(os.fspath(directory)))
        super().__init__(Jsonl(self._directory, OsFileOps()))

    def __repr__(self) -> str:
        return f"JsonlStore({str(self._directory)!r})"


class Jsonl(OneHost):
    """The JSON-lines backend (a :class:`~polyloop.stores._engine.Backend`)."""

    kind = "jsonl"

    def __init__(self, directory: Path, files: FileOps) -> None:
        # Up to 16 batches at once, each in a worker thread: the syncs of different files
        # overlap on the disk, and most of AnyIO's 40 default threads stay free.
        super().__init__(directory, files, lambda writes: [*map(self._append, writes)], parallel=16)
        self._poller = Poller(lambda run_ids: {run_id: self._size(run_id) for run_id in run_ids})

    def read(self, run_id: str) -> tuple[Record, ...]:
        self.state.check_open(run_id)
        path = self._path(run_id)
        with reader.run_file(self.files, path, run_id) as fd:
            if fd is None:
                return ()
            # Up to the last complete line only: a torn tail, however long, is never held.
            end, _ = reader.extent(self.files, fd)
            return tuple(reader.records_of(reader.lines(self.files, fd, end), str(path), run_id))

    def read_after(self, run_id: str, after: int) -> tuple[Record, ...]:
        """The whole file is read: a line may hold two records, so no offset is a position."""
        records = self.read(run_id)
        if not records:
            raise no_run(run_id)
        return records[after:]

    def appended(self, run_id: str) -> Watch:
        return self._poller.appended(run_id)

    def _size(self, run_id: str) -> int | None:
        """The run file's size: it grows with each record (``None``: no file)."""
        self.state.check_open(run_id)
        path = self._path(run_id)
        with reader.run_file(self.files, path, run_id) as fd:
            return None if fd is None else self.files.fstat(fd).st_size

    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]:
        """Every run file's run, by id; a file that is not one run's is left out, warned of."""
        self.state.check_open(None)
        try:
            names = self.files.listdir(self.directory)
        except FileNotFoundError:
            return ()
        except OSError as exc:
            raise StoreError(f"could not list {self.directory}: {exc.strerror or exc}") from exc
        listed = []
        for name in sorted(name for name in names if name.endswith(reader.SUFFIX)):
            try:
                run = self._describe(self.directory / name, None)
            except (CorruptLog, SchemaMajorMismatch, StoreError) as exc:
                logger.warning("%s is left out of the listing: %s", self.directory / name, exc)
                continue
            if run is not None and not (unfinished_only and run.finished):
                listed.append(run)
        return tuple(sorted(listed, key=lambda run: run.run_id))

    def page(self, request: PageRequest) -> RunPage:
        """Worked out from every run file's run: the files are not kept in time order."""
        return page_of(self.runs(request.finished is False), request)

    def describe(self, run_id: str) -> StoredRun | None:
        self.state.check_open(run_id)
        return self._describe(self._path(run_id), run_id)

    def request_cancel(self, request: types.CancelRequest) -> bool:
        """Write the first request to a marker file beside the run file, under the fence."""
        run_id, files = request.run_id, self.files
        self.state.check_open(run_id)
        with reader.run_file(files, self._path(run_id), run_id, os.O_RDWR) as fd:
            if fd is None:
                return False
            files.wait_range(fd, _FENCE)
            if files.fstat(fd).st_nlink == 0 or reader.extent(files, fd)[0] == 0:
                return False  # pruned meanwhile, or never started
            if self._cancel(run_id) is None:
                self._keep(request)
        return True

    def read_cancel(self, run_id: str) -> types.CancelRequest | None:
        self.state.check_open(run_id)
        return self._cancel(run_id)

    def prunable(self, cutoff: datetime, archive: Archive) -> list[str]:
        """Finished runs nobody holds whose file was last written before ``cutoff``; an
        ``archive`` that holds this store's directory is refused."""
        if archive is not None:
            refuse_own_archive(archive, self.directory)
        return [
            run.run_id
            for run in self.runs(False)
            if run.finished and not run.claimed and run.updated_at and run.updated_at < cutoff
        ]

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        """Unlink a run this object holds the claim of, unless written to since listed."""
        claim = self.held(run_id)
        files, path = self.files, self._path(run_id)
        with claim.lock:
            with reader.run_file(files, path, run_id, os.O_RDWR) as fd:
                if fd is None or _written(files, fd) >= cutoff:
                    return False
                files.wait_range(fd, _FENCE)  # a request waiting for it then finds no run
                with contextlib.suppress(FileNotFoundError):  # first: it never outlives the run
                    files.unlink(self._path(run_id, reader.CANCEL_SUFFIX))
                files.unlink(path)
            files.fsync_directory(self.directory)
            self.ended(claim)
            return True

    def open(self) -> None:
        """Nothing to open: the directory is made by the first claim."""

    def inspect(self, run_id: str) -> Claim:
        """Open or create the run file, cut a torn tail, note what it holds, close it."""
        files, path = self.files, self._path(run_id)
        try:
            fd = files.open(path, _CLAIM_FLAGS, 0o600)
        except OSError as exc:
            raise reader.cannot_open(exc, run_id, path) from exc
        try:
            reader.require_regular(files, fd, run_id, path)
            end, size, ended = reader.tail(files, fd, str(path))
            if size > end:  # what remains of a write that never finished
                files.ftruncate(fd, end)
                files.fsync(fd)
        except OSError as exc:
            if isinstance(exc, PolyLoopError):
                raise
            raise self.state.fail(run_id, exc) from exc
        finally:
            files.close(fd)
        return Claim(run_id=run_id, next_seq=int(end > 0), finished=bool(ended and ended.is_final))

    def free(self, claim: Claim) -> None:
        """A file only the claim made goes with it: a run id never started leaves no trace."""
        if claim.next_seq == 0:
            with contextlib.suppress(OSError):
                self.files.unlink(self._path(claim.run_id))

    def _append(self, write: Write) -> BaseException | None:
        """Append the write's line, synced for a barrier; a failure fails the run here (a
        sync is never retried)."""
        run_id, files = write.run_id, self.files
        try:
            claim = self.held(run_id)
            with claim.lock:
                if not self.current(claim):
                    raise not_claimed(run_id)
                started, finished = claim.next_seq > 0, claim.finished
                check_order(run_id, start=write.start, started=started, finished=finished)
                path = self._path(run_id)
                try:
                    fd = files.open(path, _WRITE_FLAGS)
                except OSError as exc:
                    return reader.cannot_open(exc, run_id, path)  # nothing written
                try:
                    try:
                        if write.fenced:  # the check and the write are one step for a request
                            files.wait_range(fd, _FENCE)
                            if (request := self._cancel(run_id)) is not None:
                                return cancel_refusal(request)
                        write_all(files, fd, reader.line(*(body for _, body in write.rows)))
                        claim.next_seq += len(write.rows)
                        if write.barrier:
                            files.fsync(fd)
                    finally:
                        files.close(fd)
                    if write.start:
                        files.fsync_directory(self.directory)
                except OSError as exc:
                    self.ended(claim)
                    return self.state.fail(run_id, exc)
                if write.end:
                    self.ended(claim)
        except PolyLoopError as exc:
            return exc
        return None

    def _describe(self, path: Path, run_id: str | None) -> StoredRun | None:
        """What the file at ``path`` holds; its first line names the run unless given."""
        files = self.files
        with reader.run_file(files, path, run_id) as fd:
            end, _, ended = (0, 0, None) if fd is None else reader.tail(files, fd, str(path))
            if fd is None or end == 0:
                return None  # no run yet, or removed while the directory was listed
            if run_id is None:
                run_id = reader.first_run_id(files, fd, path, end)
            written = _written(files, fd)
        with reader.run_file(files, self._path(run_id, reader.CANCEL_SUFFIX), run_id) as marker:
            asked = None if marker is None else _written(files, marker)
        return StoredRun(
            run_id=run_id,
            finished=ended is not None and ended.is_final,
            claimed=self.claimed(run_id),
            updated_at=written if asked is None else max(written, asked),
            cancel_requested=asked is not None,
        )

    def _cancel(self, run_id: str) -> types.CancelRequest | None:
        """The request in the run's marker file (``None`` if there is none)."""
        path = self._path(run_id, reader.CANCEL_SUFFIX)
        with reader.run_file(self.files, path, run_id) as fd:
            if fd is None:
                return None
            data = b"".join(iter(lambda: self.files.read(fd, 1 << 16), b""))
            return reader.cancel_of(data, run_id, str(path))

    def _keep(self, request: types.CancelRequest) -> None:
        """Write the request to its marker file whole and synced: a reader takes no lock."""
        files, path = self.files, self._path(request.run_id, reader.CANCEL_SUFFIX)
        part = path.with_name(f".{path.name}.partial")  # a dot: never taken for a run
        try:
            fd = files.open(part, _MARKER_FLAGS, 0o600)
            try:
                write_all(files, fd, reader.cancel_text(request))
                files.fsync(fd)
            finally:
                files.close(fd)
            files.replace(part, path)
            files.fsync_directory(self.directory)
        except OSError as exc:
            reason = f"could not keep the cancel request: {exc.strerror or exc}"
            raise StoreError(reason, run_id=request.run_id, location=str(path)) from exc

    def _path(self, run_id: str, suffix: str = reader.SUFFIX) -> Path:
        return self.directory / f"{safe_name(run_id)}{suffix}"


def _written(files: FileOps, fd: int) -> datetime:
    """When the open file was last written."""
    return datetime.fromtimestamp(files.fstat(fd).st_mtime, UTC)
