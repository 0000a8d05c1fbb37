"""Pruning finished runs, each under its claim, archived first if asked: into a directory
in the JSON-lines store's format, each file written whole and synced before the run is
deleted, so a crash in between leaves the run in both places (research record 0018)."""

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

Archive = str | os.PathLike[str] | None
Delete = Callable[[str], Awaitable[bool]]


def check_cutoff(finished_before: datetime) -> datetime:
    """``finished_before`` as an aware UTC time; a naive one is taken as UTC."""
    if not isinstance(finished_before, datetime):
        raise TypeError(f"finished_before must be a datetime, not {type(finished_before).__name__}")
    if finished_before.tzinfo is None:
        return finished_before.replace(tzinfo=UTC)
    return finished_before.astimezone(UTC)


def _write_archive(directory: Path, log: RunLog) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{safe_name(log.run_id)}{SUFFIX}"
    partial = final.with_name(final.name + ".partial")
    with open(partial, "wb", opener=lambda path, flags: os.open(path, flags, 0o600)) as file:
        file.write(log_lines(log.records))
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, final)
    fsync_directory(directory)


async def prune_runs(
    store: Store, candidates: Iterable[str], *, archive: Archive, delete: Delete
) -> tuple[str, ...]:
    """Prune each finished candidate under its claim; the ids deleted. ``delete(run_id)``
    checks again, gives the claim up with the run, and says whether it deleted it."""
    pruned: list[str] = []
    for run_id in candidates:
        try:
            await store.claim_run(run_id)
        except RunLocked:
            continue  # a worker holds it: it is not ours to remove
        deleted = False
        try:
            log = await store.read_log(run_id)
            ends = [end for end in log.records[-1:] if isinstance(end, RunEnded) and end.is_final]
            if ends and ends[0].stop_reason is not StopReason.IN_DOUBT:
                if archive is not None:
                    await anyio.to_thread.run_sync(_write_archive, Path(archive), log)
                deleted = await delete(run_id)
        finally:
            if not deleted:
                with anyio.move_on_after(RELEASE_GRACE_S, shield=True):
                    await store.release_run(run_id)
        if deleted:
            pruned.append(run_id)
    return tuple(pruned)
