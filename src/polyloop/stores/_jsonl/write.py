"""The writes of the JSON-lines store: one line appended to a claimed run's file.

:class:`Appender` applies a batch of writes from the store's
:class:`~polyloop.stores._batching.GroupCommit`, each under its run's claim lock: it
opens the run's file, appends the line whole, syncs the file for a start or an intent
(and the directory entry for a start), closes it, and gives the claim up with an end
record. A failed write or sync fails its run for this store object: a sync is never
retried, since the kernel may have dropped the data. ``docs/stores.md`` states the
guarantees; research records 0009 (durability) and 0019 (one write path, off the event
loop) say why.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass

from polyloop.stores._jsonl.claims import WRITE_FLAGS, Claims, open_failed
from polyloop.stores._jsonl.fileops import FileOps
from polyloop.stores._refusals import check_order, not_claimed
from polyloop.types import PolyLoopError

__all__ = ("Appender", "Write")


@dataclass(frozen=True, slots=True, kw_only=True)
class Write:
    """One line to append to a claimed run, and what comes with it."""

    run_id: str
    data: bytes
    sync: bool = False  # the line is synced before the call returns
    start: bool = False  # the run's first line: the directory entry is synced too
    end: bool = False  # the claim ends with the line


class Appender:
    """Appends the lines of one store object's writes to the files it holds claims on.

    :meth:`commit` is blocking: the store runs it in a worker thread. Cancellation never
    reaches it: once a batch has started, each of its lines is appended (and synced, if
    asked) or fails, whatever happens to the callers.
    """

    __slots__ = ("_claims",)

    def __init__(self, claims: Claims) -> None:
        self._claims = claims

    def commit(self, writes: Sequence[Write]) -> list[BaseException | None]:
        """Apply a batch of writes in this worker thread; each one's own outcome."""
        return [self._apply(write) for write in writes]

    def _apply(self, write: Write) -> BaseException | None:
        claims, files, run_id = self._claims, self._claims.files, write.run_id
        try:
            claim = claims.held(run_id)
            with claim.lock:
                if claim.closed:
                    raise not_claimed(run_id)
                check_order(
                    run_id, start=write.start, started=claim.started, finished=claim.finished
                )
                # The file is open only for this write, so a process holds as many
                # run files open as writes run at once, however many runs it claims.
                try:
                    fd = files.open(claims.path(run_id), WRITE_FLAGS)
                except OSError as exc:
                    return open_failed(exc, run_id, "the run file")  # nothing written
                try:
                    _write_all(files, fd, write.data)
                    claim.started = True
                    if write.sync:
                        files.fsync(fd)
                    files.close(fd)
                    fd = -1
                    if write.start:
                        files.fsync_directory(claims.directory)
                    if write.end:
                        claims.end(run_id, claim)
                except OSError as exc:
                    # An fsync is never retried: the kernel may have dropped the data.
                    if fd >= 0:
                        files.close(fd)
                    claims.end(run_id, claim)
                    return claims.state.fail(run_id, exc)
        except PolyLoopError as exc:
            return exc
        return None


def _write_all(files: FileOps, fd: int, data: bytes) -> None:
    """Append ``data`` completely; a write may take only part of it per call."""
    view = memoryview(data)
    while view:
        written = files.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        view = view[written:]
