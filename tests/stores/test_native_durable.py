"""A native tool-call run crashed after every write on each durable store, under asyncio
and Trio: the resumed run equals the uninterrupted one, the messages of every model call
hash the same, and a tool whose replay is never allowed ends in doubt, never run twice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kit.agent import Ledger, close_store, definition, make_tools, request, same_outcome
from kit.native import INTERPRETER, NATIVE, HashingModel, native_script
from kit.store import DURABLE_KINDS, durable_opener, sampled
from kit.sweep import every_point
from polyloop import Replay, RunResult, StopReason, Store, resume, run
from polyloop.stores import JsonlStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio

TOTAL_WRITES = 21  # 1 + 4 + 4 + 3 + 4 + 4 + 1
ACTION_INTENTS = {4, 8, 15, 19}


@pytest.fixture(params=sampled(DURABLE_KINDS))
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return durable_opener(request, tmp_path)


async def _crash_and_resume(
    open_store: Callable[[], Store], k: int, replay: Replay, ledger: Ledger
) -> tuple[RunResult, HashingModel, HashingModel]:
    the_request = request("r", make_tools(ledger, replay=replay), model_replay=replay, **NATIVE)
    first_store, first = open_store(), HashingModel(native_script())
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(first_store, fail_after_writes=k), model=first, interpreter=INTERPRETER
            ),
            the_request,
        )
    await close_store(first_store)
    second_store, second = open_store(), HashingModel(native_script())
    try:
        resumed = await resume(
            definition(second_store, model=second, interpreter=INTERPRETER), the_request
        )
    finally:
        await close_store(second_store)
    return resumed, first, second


@pytest.mark.parametrize("k", every_point(range(1, TOTAL_WRITES)))
async def test_a_native_run_resumes_after_every_write_with_the_same_messages(
    open_store: Callable[[], Store], k: int, tmp_path: Path
) -> None:
    whole = HashingModel(native_script())
    async with JsonlStore(tmp_path / "reference") as reference:
        expected = await run(
            definition(reference, model=whole, interpreter=INTERPRETER),
            request(
                "r",
                make_tools(Ledger(), replay=Replay.ALLOWED),
                model_replay=Replay.ALLOWED,
                **NATIVE,
            ),
        )
    resumed, first, second = await _crash_and_resume(open_store, k, Replay.ALLOWED, Ledger())
    assert same_outcome(resumed, expected)
    digests = {c.call_index: d for c, d in zip(first.calls, first.digests, strict=True)}
    digests.update({c.call_index: d for c, d in zip(second.calls, second.digests, strict=True)})
    assert [digests[i] for i in range(len(whole.digests))] == whole.digests


@pytest.mark.parametrize("k", every_point(sorted(ACTION_INTENTS)))
async def test_a_native_never_tool_interrupted_after_its_intent_is_in_doubt(
    open_store: Callable[[], Store], k: int
) -> None:
    ledger = Ledger()
    resumed, _, _ = await _crash_and_resume(open_store, k, Replay.NEVER, ledger)
    assert resumed.stop_reason is StopReason.IN_DOUBT
    assert all(ledger.count(rid) <= 1 for _, rid in ledger.calls)
