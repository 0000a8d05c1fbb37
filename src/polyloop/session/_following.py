"""Following a run as it is written: its records from a position on, waiting for new ones,
until an end record (docs/following.md, research-wiki/0072)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import anyio

from polyloop.ports import FollowableStore, Store
from polyloop.types import FollowedRecord, InvalidRequest, Record, RunEnded, RunNotFound

# How often a store that cannot say when it was written is read again.
POLL_S = 0.2


async def follow(
    store: Store, run_id: str, *, after: int = 0
) -> AsyncGenerator[FollowedRecord, None]:
    """The run's records after position ``after``, each with its position, as they are
    written; the iteration ends after the first end record it yields.

    Position 1 is the run's start record, and each record after it is one more. A reader
    that kept the last position it saw and calls again with it gets exactly the records
    it has not seen. A run whose log stops before ``after`` is waited for; a run that ended
    finally at position ``after`` yields nothing. To go on past a run's stop that a
    ``resume`` may continue (cancelled, in doubt, awaiting approval), call again with the
    end record's position. ``follow`` never claims the run: it reads beside the writer.

    ``RunNotFound`` if the run has no record; the same error, saying so, if the run's
    records are deleted (pruned) while it is followed. ``InvalidRequest`` for a negative
    ``after``. Leaving the loop early stops the watching when the iterator is closed:
    ``contextlib.aclosing`` closes it at once.

    Cancellation: reading changes nothing, so a cancelled follower leaves nothing behind;
    call again with the last position it saw.
    """
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise InvalidRequest(f"after must be a position, 0 or more; got {after!r}", run_id=run_id)
    reader = _reader(store)
    position = after
    async with reader.watching(run_id) as wait:
        # The record at ``after`` is read too: a run that ended there for good ends here.
        records = await reader.read(run_id, max(after - 1, 0))
        if after and records:
            if _final(records[0]):
                return
            records = records[1:]
        while True:
            for record in records:
                position += 1
                yield FollowedRecord(position=position, record=record)
                if isinstance(record, RunEnded):
                    return
            if not records:
                await wait()
            records = await _read_on(reader, run_id, position)


def _final(record: Record) -> bool:
    return isinstance(record, RunEnded) and record.is_final


async def _read_on(reader: _Reader, run_id: str, position: int) -> tuple[Record, ...]:
    """The records after ``position``, where the run was seen to have records."""
    try:
        return await reader.read(run_id, position)
    except RunNotFound as exc:
        reason = (
            f"the run's records were deleted (pruned) while followed, after position {position}"
        )
        raise RunNotFound(reason, run_id=run_id) from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reader:
    """How one store is read after a position, and watched for more."""

    read: Callable[[str, int], Awaitable[tuple[Record, ...]]]
    watching: Callable[[str], AbstractAsyncContextManager[Callable[[], Awaitable[None]]]]


def _reader(store: Store) -> _Reader:
    if isinstance(store, FollowableStore):
        return _Reader(read=store.read_after, watching=store.appended)

    async def read_after(run_id: str, after: int) -> tuple[Record, ...]:
        # A store without the capability: its whole log, and what was seen skipped.
        records = (await store.read_log(run_id)).records
        if not records:
            raise RunNotFound("the store holds no record of this run", run_id=run_id)
        return records[after:]

    return _Reader(read=read_after, watching=_timer)


@asynccontextmanager
async def _timer(run_id: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    async def wait() -> None:
        await anyio.sleep(POLL_S)

    yield wait
