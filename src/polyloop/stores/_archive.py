"""Pruning finished runs, and the archive a pruned run's log goes to first.

A store prunes one run at a time, under the run's claim: while the pruning store object
holds it, no worker can resume the run, so its log cannot change between the moment it
is found finished, written to the archive, and deleted. A run some worker holds is left
alone (its claim is refused), and so is one that is unfinished, ended in doubt, or
written to after the cutoff; the store's own deletion checks the last two again, in the
same step as the delete.

The archive is a directory in the JSON-lines store's format, one file per run, so
``polyloop show jsonl:ARCHIVE RUN_ID`` (or a ``JsonlStore`` over it) reads a pruned run
back. Each file is written whole to a temporary name, synced, renamed into place, and
the directory synced, before the run is deleted from its store: a crash in between
leaves the run in both places, and pruning again writes the same file again.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import anyio
import anyio.to_thread

from polyloop.ports import Store
from polyloop.stores._common import RELEASE_GRACE_S, fsync_directory, safe_name
from polyloop.stores._jsonl.reader import SUFFIX, log_lines
from polyloop.types import RunEnded, RunLocked, RunLog, StopReason

__all__ = ("archive_path", "check_cutoff", "prunable", "prune_runs", "write_archive")


def check_cutoff(finished_before: datetime) -> datetime:
    """``finished_before`` as an aware UTC time; a naive one is taken as UTC."""
    if not isinstance(finished_before, datetime):
        raise TypeError(f"finished_before must be a datetime, not {type(finished_before).__name__}")
    if finished_before.tzinfo is None:
        return finished_before.replace(tzinfo=UTC)
    return finished_before.astimezone(UTC)


def prunable(log: RunLog) -> bool:
    """Whether ``log`` ends with a final end record that does not leave the run in doubt."""
    last = log.records[-1] if log.records else None
    return (
        isinstance(last, RunEnded) and last.is_final and last.stop_reason is not StopReason.IN_DOUBT
    )


def archive_path(directory: Path, run_id: str) -> Path:
    return directory / f"{safe_name(run_id)}{SUFFIX}"


def write_archive(directory: Path, log: RunLog) -> None:
    """Write ``log`` durably into the archive ``directory`` (blocking; a worker thread)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = archive_path(directory, log.run_id)
    partial = final.with_name(final.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        data = memoryview(log_lines(log.records))
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, final)
    fsync_directory(directory)


async def prune_runs(
    store: Store,
    candidates: Iterable[str],
    *,
    archive: Path | None,
    delete: Callable[[str], Awaitable[bool]],
) -> tuple[str, ...]:
    """Prune each candidate under its claim; the ids of the runs deleted, in order.

    ``delete(run_id)`` is the store's own deletion of a run it holds the claim of: it
    checks what it can check in the same step (finished, not in doubt, last written
    before the cutoff), gives the claim up with the run, and says whether it deleted it.
    """
    pruned: list[str] = []
    for run_id in candidates:
        try:
            await store.claim_run(run_id)
        except RunLocked:
            continue  # a worker holds it: it is not ours to remove
        deleted = False
        try:
            log = await store.read_log(run_id)
            if prunable(log):
                if archive is not None:
                    await anyio.to_thread.run_sync(write_archive, archive, log)
                deleted = await delete(run_id)
        finally:
            if not deleted:
                with anyio.move_on_after(RELEASE_GRACE_S, shield=True):
                    await store.release_run(run_id)
        if deleted:
            pruned.append(run_id)
    return tuple(pruned)
