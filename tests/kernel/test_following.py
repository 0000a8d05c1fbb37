"""``follow``: a run's records from a position on, as they are written, on every store and
on a store of one's own without the capability (docs/following.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, cast

import anyio
import pytest

from kit.agent import Ledger, definition, five_step_script, make_tools, request
from kit.store import STORE_KINDS, Stores, sampled, stores_fixture
from polyloop import (
    FollowableStore,
    FollowedRecord,
    InvalidRequest,
    Record,
    RunEnded,
    RunNotFound,
    StopReason,
    Store,
    follow,
    run,
)
from polyloop.testing.store_contract import apply, awaiting_run, sample_run

pytestmark = pytest.mark.anyio

stores = stores_fixture(sampled(STORE_KINDS))
# How long a follower is given to show it is waiting, not done: it must yield nothing.
QUIET_S = 0.3


async def collect(
    store: Store,
    run_id: str,
    *,
    after: int = 0,
    limit: int | None = None,
    into: list[FollowedRecord] | None = None,
) -> list[FollowedRecord]:
    """What ``follow`` yields (added to ``into`` as it comes), up to ``limit`` items (then
    the iterator is closed)."""
    got = [] if into is None else into
    async with aclosing(follow(store, run_id, after=after)) as followed:
        async for item in followed:
            got.append(item)
            if len(got) == limit:
                break
    return got


@asynccontextmanager
async def following(
    store: Store, run_id: str, *, after: int = 0, limit: int | None = None
) -> AsyncIterator[list[FollowedRecord]]:
    """A follower in a task of its own while the block runs, and what it has been given
    so far; leaving the block waits for the follower to end."""
    got: list[FollowedRecord] = []
    async with anyio.create_task_group() as group:
        group.start_soon(partial(collect, store, run_id, after=after, limit=limit, into=got))
        yield got


def numbered(records: Sequence[Record], first: int = 1) -> list[FollowedRecord]:
    return [FollowedRecord(position=first + n, record=r) for n, r in enumerate(records)]


async def write_all(store: Store, writes: list[tuple[str, Any]], *, claim: bool = True) -> None:
    await apply(store, writes, claim=claim)


async def test_every_shipped_store_can_be_followed(stores: Stores) -> None:
    assert isinstance(stores.open(), FollowableStore)


async def test_a_follower_started_after_start_sees_the_run_from_its_start_and_stops_at_its_end(
    stores: Stores,
) -> None:
    writer, reader = stores.open(), stores.open()
    writes = sample_run("r", steps=2)
    await write_all(writer, writes[:1])
    async with following(reader, "r") as seen:
        for method, args in writes[1:]:
            await getattr(writer, method)(*args)
            await anyio.sleep(0.01)  # some writes land while the follower waits
    records = (await writer.read_log("r")).records
    assert seen == numbered(records)
    assert isinstance(seen[-1].record, RunEnded)


async def test_after_beyond_the_log_waits_then_yields_what_is_written_past_it(
    stores: Stores,
) -> None:
    writer, reader = stores.open(), stores.open()
    writes = sample_run("r", steps=2)
    await write_all(writer, writes[:3])
    async with following(reader, "r", after=5, limit=1) as got:
        await anyio.sleep(QUIET_S)
        assert got == []  # three records: nothing after 5 yet
        for method, args in writes[3:6]:  # positions 4 to 6 at least
            await getattr(writer, method)(*args)
    records = (await writer.read_log("r")).records
    assert got == [FollowedRecord(position=6, record=records[5])]


async def test_a_run_never_written_is_not_found(stores: Stores) -> None:
    store = stores.open()
    await write_all(store, sample_run("other", steps=1))
    for after in (0, 3):
        with pytest.raises(RunNotFound) as caught:
            await collect(store, "never", after=after)
        assert caught.value.run_id == "never"


async def test_a_negative_position_is_refused(stores: Stores) -> None:
    with pytest.raises(InvalidRequest):
        await collect(stores.open(), "r", after=-1)


async def test_reconnecting_from_every_position_yields_exactly_the_rest(stores: Stores) -> None:
    """A real run: its steps name their results' observations (record 0063), so a read
    that starts between a result and its step must still decode the step."""
    store = stores.open()
    tools = make_tools(Ledger())
    result = await run(definition(store, script=five_step_script()), request("r", tools))
    assert result.stop_reason is StopReason.SUBMITTED
    records = (await store.read_log("r")).records
    for after in range(len(records)):
        assert await collect(store, "r", after=after) == numbered(records[after:], after + 1)
    # From the final end record on, nothing will ever come: the stream ends at once.
    assert await collect(store, "r", after=len(records)) == []


async def test_a_stop_a_resume_may_continue_ends_the_stream_and_the_next_call_goes_on(
    stores: Stores,
) -> None:
    writer = stores.open()
    writes = awaiting_run("r")
    await write_all(writer, writes)
    first = await collect(writer, "r")
    assert first[-1].record == writes[-1][1][0]
    assert first[-1].record.stop_reason is StopReason.AWAITING_APPROVAL  # type: ignore[union-attr]
    ended = sample_run("r", steps=2)[-1][1][0]
    async with following(writer, "r", after=first[-1].position, limit=1) as got:
        await anyio.sleep(QUIET_S)
        assert got == []
        await writer.claim_run("r")
        await writer.end_run(ended)
    assert got == [FollowedRecord(position=first[-1].position + 1, record=ended)]


async def test_a_run_pruned_while_followed_ends_the_stream_with_a_clear_error(
    stores: Stores,
) -> None:
    writer, reader = stores.open(), stores.open()
    await write_all(writer, sample_run("r", steps=1))
    length = len((await writer.read_log("r")).records)

    failures: list[RunNotFound] = []

    async def follower() -> None:
        try:
            await collect(reader, "r", after=length + 1)  # past the log: it waits
        except RunNotFound as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(follower)
        await anyio.sleep(QUIET_S)
        assert await writer.prune(finished_before=datetime.now(UTC) + timedelta(days=1))
    (failure,) = failures
    assert "pruned" in str(failure)
    assert failure.run_id == "r"


class _LogOnly:
    """A store of one's own that can only read whole logs: followed by reading on a timer."""

    def __init__(self, store: Store) -> None:
        self._store = store

    async def read_log(self, run_id: str) -> Any:
        return await self._store.read_log(run_id)


async def test_a_store_without_the_capability_is_followed_by_reading_its_whole_log(
    stores: Stores,
) -> None:
    writer = stores.open()
    own = cast(Store, _LogOnly(writer))
    assert not isinstance(own, FollowableStore)
    writes = sample_run("r", steps=1)
    await write_all(writer, writes[:2])
    async with following(own, "r", after=1) as got:
        for method, args in writes[2:]:
            await getattr(writer, method)(*args)
    records = (await writer.read_log("r")).records
    assert got == numbered(records[1:], 2)
    with pytest.raises(RunNotFound):
        await collect(own, "never")
