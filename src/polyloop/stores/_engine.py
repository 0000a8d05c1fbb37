"""What the durable stores do alike over a backend, and the pruning all stores share
(docs/stores.md#your-own-store)."""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Protocol, Self

import anyio
import anyio.lowlevel
import anyio.to_thread

from polyloop import types
from polyloop._paging import PageRequest
from polyloop._shared import FORMAT
from polyloop.ports import RunPage, Store, StoredRun
from polyloop.stores import _paths
from polyloop.stores._jsonl.reader import SUFFIX, log_lines
from polyloop.stores._paths import in_the_way, safe_name
from polyloop.stores._port import StoreBase
from polyloop.stores._writes import (
    Write,
    announces_effect,
    lets_a_run_go_on,
    no_run,
    record_rows,
    taken,
)

logger = logging.getLogger("polyloop")

# How long giving a claim back after a failed claim or prune may keep its caller.
RELEASE_GRACE_S = 10.0
_SLOW_RELEASE = "run %r: giving its claim back took over %g s; it goes on in the background"

Archive = str | os.PathLike[str] | None
Delete = Callable[[str], Awaitable[bool]]
Watch = AbstractAsyncContextManager[Callable[[], Awaitable[None]]]


class Backend(Protocol):
    """What the engine needs of a backend; all but the coroutines and :meth:`holds` block.
    ``prunable`` lists finished runs nobody holds (refusing an ``archive`` it cannot take);
    ``delete`` deletes one held here. ``request_cancel`` keeps a run's first request,
    durably, and says whether the run has a record; a write that is ``fenced`` is refused
    with ``cancel_refusal`` of the run's request, atomically with the write. ``read_after``
    and ``appended`` are :class:`~polyloop.ports.FollowableStore`'s (the latter on the loop)."""

    kind: str

    def claim(self, run_id: str, token: anyio.lowlevel.EventLoopToken) -> None: ...
    def release(self, run_id: str) -> None: ...
    def holds(self, run_id: str) -> bool: ...
    async def confirm(self, run_id: str) -> None: ...
    async def submit(self, write: Write) -> None: ...
    def read(self, run_id: str) -> tuple[types.Record, ...]: ...
    def read_after(self, run_id: str, after: int) -> tuple[types.Record, ...]: ...
    def appended(self, run_id: str) -> Watch: ...
    def runs(self, unfinished_only: bool) -> tuple[StoredRun, ...]: ...
    def describe(self, run_id: str) -> StoredRun | None: ...
    def page(self, request: PageRequest) -> RunPage: ...
    def request_cancel(self, request: types.CancelRequest) -> bool: ...
    def read_cancel(self, run_id: str) -> types.CancelRequest | None: ...
    def prunable(self, cutoff: datetime, archive: Archive) -> list[str]: ...
    def delete(self, run_id: str, cutoff: datetime) -> bool: ...
    def open(self) -> None: ...
    def close(self) -> None: ...


class EngineStore(StoreBase):
    """The store port over a :class:`Backend`."""

    __slots__ = ("_backend",)

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def parameters(self) -> Mapping[str, types.JSONValue]:
        """The store kind and record format, never where the data is: moved data resumes."""
        return {"kind": self._backend.kind, "format": FORMAT}

    async def claim_run(self, run_id: str) -> None:
        """Become the run's writer; ``RunLocked`` names the holder where the database knows it."""
        claim = partial(self._backend.claim, run_id, anyio.lowlevel.current_token())
        await claim_in_thread(claim, partial(self._backend.release, run_id), run_id=run_id)

    async def release_run(self, run_id: str) -> None:
        """Give up the claim, writing no record (a run never started leaves no trace)."""
        if self._backend.holds(run_id):
            await anyio.to_thread.run_sync(self._backend.release, run_id)

    async def check_claim(self, run_id: str) -> None:
        """Return only if an effect of the run may start now; sends no statement."""
        await self._backend.confirm(run_id)

    async def request_cancel(self, request: types.CancelRequest) -> None:
        """Keep the run's first cancel request, durably; needs no claim."""
        if not await anyio.to_thread.run_sync(self._backend.request_cancel, taken(request)):
            raise no_run(request.run_id)

    async def read_cancel(self, run_id: str) -> types.CancelRequest | None:
        """The run's cancel request, or ``None``."""
        return await anyio.to_thread.run_sync(
            self._backend.read_cancel, run_id, abandon_on_cancel=True
        )

    async def read_log(self, run_id: str) -> types.RunLog:
        """Every record of ``run_id`` in write order; ``CorruptLog`` names a bad line or row."""
        # A read changes nothing: a cancelled caller need not wait for its thread.
        records = await anyio.to_thread.run_sync(self._backend.read, run_id, abandon_on_cancel=True)
        return types.RunLog(run_id=run_id, records=records)

    async def read_after(self, run_id: str, after: int) -> tuple[types.Record, ...]:
        """The records after position ``after``; ``RunNotFound`` if the run has none."""
        return await anyio.to_thread.run_sync(
            self._backend.read_after, run_id, after, abandon_on_cancel=True
        )

    def appended(self, run_id: str) -> Watch:
        """Watch the run for new records: notified where the backend can be, else polled."""
        return self._backend.appended(run_id)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run (or the unfinished ones): in start order in a database, by id in files."""
        return await anyio.to_thread.run_sync(self._backend.runs, unfinished_only)

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it; ``None`` if it has no record."""
        return await anyio.to_thread.run_sync(self._backend.describe, run_id)

    async def _page(self, request: PageRequest) -> RunPage:
        return await anyio.to_thread.run_sync(self._backend.page, request, abandon_on_cancel=True)

    async def prune(self, *, finished_before: datetime, archive: Archive = None) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before``, each under its claim."""
        cutoff = check_cutoff(finished_before)
        candidates = await anyio.to_thread.run_sync(self._backend.prunable, cutoff, archive)
        delete = partial(anyio.to_thread.run_sync, partial(self._backend.delete, cutoff=cutoff))
        return await prune_runs(self, candidates, archive=archive, delete=delete)

    async def aclose(self) -> None:
        """Give up every claim and close every connection or file; idempotent.

        Cancellation: closing runs shielded, so it completes even in a cancelled scope."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._backend.close)

    async def __aenter__(self) -> Self:
        """Open and check the store now rather than at first use."""
        await anyio.to_thread.run_sync(self._backend.open)
        return self

    async def _write(
        self, *records: types.Record, start: bool = False, barrier: bool = False
    ) -> None:
        last = records[-1]
        rows = record_rows(records)
        fenced = announces_effect(records)
        write = Write(last.run_id, rows, start=start, barrier=barrier, fenced=fenced)
        if isinstance(last, types.RunEnded):  # the claim is given up with it
            write.end, write.final, write.reason = True, last.is_final, last.stop_reason.value
        write.announce = lets_a_run_go_on(write, last)
        await self._backend.submit(write)


async def claim_in_thread(
    claim: Callable[[], None], release: Callable[[], None], *, run_id: str
) -> None:
    """Run a blocking ``claim`` in a worker thread; ``release`` it if the call then raises."""
    taken = False

    def claim_and_note() -> None:
        nonlocal taken
        claim()
        taken = True

    try:
        await anyio.to_thread.run_sync(claim_and_note)
    except BaseException:
        if taken:
            # Past the grace the release goes on in its thread, unwaited for.
            with anyio.move_on_after(RELEASE_GRACE_S, shield=True) as scope:
                await anyio.to_thread.run_sync(release, abandon_on_cancel=True)
            if scope.cancelled_caught:
                logger.warning(_SLOW_RELEASE, run_id, RELEASE_GRACE_S)
        raise


def check_cutoff(finished_before: datetime) -> datetime:
    """``finished_before`` as an aware UTC time; a naive one is taken as UTC."""
    if not isinstance(finished_before, datetime):
        raise TypeError(f"finished_before must be a datetime, not {type(finished_before).__name__}")
    return finished_before.replace(tzinfo=finished_before.tzinfo or UTC).astimezone(UTC)


async def prune_runs(
    store: Store, candidates: Iterable[str], *, archive: Archive, delete: Delete
) -> tuple[str, ...]:
    """Prune each finished candidate under its claim; the ids deleted. ``delete(run_id)``
    checks again and gives the claim up with the run."""
    pruned: list[str] = []
    for run_id in candidates:
        try:
            await store.claim_run(run_id)
        except types.RunLocked:
            continue  # a worker holds it: it is not ours to remove
        deleted = False
        try:
            log = await store.read_log(run_id)
            if finished(log.records):  # never in doubt: such an end is not final
                if archive is not None:
                    await anyio.to_thread.run_sync(_archive_or_say_why, Path(archive), log)
                deleted = await delete(run_id)
        finally:
            if not deleted:
                with anyio.move_on_after(RELEASE_GRACE_S, shield=True):
                    await store.release_run(run_id)
        if deleted:
            pruned.append(run_id)
    return tuple(pruned)


def finished(records: Sequence[types.Record]) -> bool:
    """Whether the log ends with a final end record."""
    return bool(records) and isinstance(records[-1], types.RunEnded) and records[-1].is_final


def _archive_or_say_why(directory: Path, log: types.RunLog) -> None:
    """Archive the log; a ``StoreError`` naming the run and the archive if it cannot be."""
    try:
        _write_archive(directory, log)
    except OSError as exc:
        reason = in_the_way(directory) or exc.strerror or type(exc).__name__
        raise types.StoreError(
            f"cannot archive the run: {reason}", run_id=log.run_id, location=str(directory)
        ) from exc


def _write_archive(directory: Path, log: types.RunLog) -> None:
    """Write the log whole and synced before its run goes (record 0018); never replace an
    archived log: a run id's second goes in ``directory/2``, and so on (record 0037)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = log_lines(log.records)
    fd, part = tempfile.mkstemp(suffix=".partial", dir=directory)  # readable by owner only
    try:
        with open(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        for copy in itertools.count(1):
            folder = directory / str(copy) if copy > 1 else directory
            folder.mkdir(exist_ok=True)
            final = folder / f"{safe_name(log.run_id)}{SUFFIX}"
            try:
                os.link(part, final)  # never replaces, even with another prune at once
            except FileExistsError:
                if final.stat().st_size != len(data) or final.read_bytes() != data:
                    continue
            _paths.fsync_directory(folder)
            break
    finally:
        os.unlink(part)
    _paths.fsync_directory(directory)


def refuse_own_archive(archive: str | os.PathLike[str], home: Path) -> None:
    """Refuse an archive that holds the JSONL store's own directory."""
    target, home_path = Path(archive).resolve(), home.resolve()
    if target == home_path or target in home_path.parents:
        reason = "each log would be archived onto itself, then deleted"
        raise types.InvalidRequest(f"cannot archive the runs of {home} into {archive}: {reason}")
