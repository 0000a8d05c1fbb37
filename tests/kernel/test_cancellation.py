"""Cancelling a run in a model call, an action or a store write, under asyncio and Trio."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from kit.agent import SlowStore, answer, cancel_when, definition, request, tool_call
from polyloop import (
    Intent,
    IntentKind,
    ModelCall,
    ModelReply,
    Replay,
    RunEnded,
    RunNotFound,
    StopReason,
    ToolRegistry,
    ToolSpec,
    resume,
    run,
)
from polyloop.stores import MemoryStore

pytestmark = pytest.mark.anyio

SCRIPT = [tool_call("wait", n=1), answer("finished")]


class BlockingModel:
    """Answers from ``SCRIPT``; the first call of index ``block_at`` never returns."""

    def __init__(self, block_at: int | None) -> None:
        self.block_at = block_at
        self.entered = anyio.Event()
        self.calls: list[int] = []

    def parameters(self) -> dict[str, Any]:
        return {"kind": "blocking-test-model"}

    async def call(self, call: ModelCall) -> ModelReply:
        self.calls.append(call.call_index)
        if call.call_index == self.block_at and not self.entered.is_set():
            self.entered.set()
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()
        return ModelReply(call_id=None, content=SCRIPT[call.call_index], reasoning=None)


class WaitTool:
    """A tool whose first run blocks until cancelled; later runs answer at once."""

    def __init__(self, *, block: bool = True) -> None:
        self.entered = anyio.Event()
        self.runs: list[str] = []
        if not block:
            self.entered.set()

    def registry(self) -> ToolRegistry:
        async def wait(arguments: dict[str, Any], *, result_id: str) -> str:
            self.runs.append(result_id)
            if not self.entered.is_set():
                self.entered.set()
                await anyio.sleep_forever()
            return "waited"

        return ToolRegistry(
            [
                ToolSpec(
                    name="wait",
                    description="Wait.",
                    parameters={},
                    handler=wait,
                    replay=Replay.ALLOWED,
                )
            ],
            max_observation_chars=1000,
        )


async def _assert_unclaimed(store: Any, run_id: str) -> None:
    """The cancelled call gave the run's claim up: the store object can claim it again."""
    await store.claim_run(run_id)
    await store.release_run(run_id)


async def _check_cancelled_then_resume(store: Any, model: Any, tool: WaitTool) -> None:
    log = await store.read_log("r")
    end = log.records[-1]
    assert isinstance(end, RunEnded)
    assert end.stop_reason is StopReason.CANCELLED
    await _assert_unclaimed(store, "r")

    later = await resume(
        definition(store, model=model),
        request("r", tool.registry(), model_replay=Replay.ALLOWED),
    )
    assert later.stop_reason is StopReason.FINAL_ANSWER
    assert later.final_answer == "finished"
    assert later.resumed


async def test_cancel_during_a_model_call() -> None:
    store, model, tool = MemoryStore(), BlockingModel(block_at=0), WaitTool(block=False)
    tasks_before = len(anyio.get_running_tasks())

    async def drive() -> None:
        await run(
            definition(store, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )

    assert await cancel_when(model.entered, drive) is not None
    assert len(anyio.get_running_tasks()) == tasks_before
    await _check_cancelled_then_resume(store, model, tool)
    # The interrupted call was replayed under its own result id: no second intent.
    log = await store.read_log("r")
    model_intents = [
        r.result_id
        for r in log.records
        if isinstance(r, Intent) and r.kind is IntentKind.MODEL_CALL
    ]
    assert model_intents == ["r:0:model", "r:1:model"]


async def test_cancel_during_an_action() -> None:
    store, model, tool = MemoryStore(), BlockingModel(block_at=None), WaitTool()
    tasks_before = len(anyio.get_running_tasks())

    async def drive() -> None:
        await run(
            definition(store, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )

    assert await cancel_when(tool.entered, drive) is not None
    assert len(anyio.get_running_tasks()) == tasks_before
    await _check_cancelled_then_resume(store, model, tool)
    # The action was announced with ALLOWED replay, so it ran again under the same id.
    assert tool.runs == ["r:0:action", "r:0:action"]


async def test_cancel_during_a_store_write() -> None:
    store = SlowStore("write_result")
    model, tool = BlockingModel(block_at=None), WaitTool(block=False)
    tasks_before = len(anyio.get_running_tasks())

    async def drive() -> None:
        await run(
            definition(store, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )

    assert await cancel_when(store.entered, drive) is not None
    assert len(anyio.get_running_tasks()) == tasks_before
    await _check_cancelled_then_resume(store.inner, model, tool)


async def test_a_run_cancelled_before_its_start_lands_leaves_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = SlowStore("start_run")
    model, tool = BlockingModel(block_at=None), WaitTool(block=False)

    async def drive() -> None:
        await run(
            definition(store, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )

    with caplog.at_level(logging.WARNING, logger="polyloop"):
        assert await cancel_when(store.entered, drive) is not None
    assert (await store.inner.read_log("r")).records == ()
    assert model.calls == []
    # Nothing to end, so no end record was attempted and nothing was reported as lost.
    assert [r.getMessage() for r in caplog.records if r.name == "polyloop"] == []
    await _assert_unclaimed(store.inner, "r")
    with pytest.raises(RunNotFound):
        await resume(
            definition(store.inner, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )
    # The id is still free: the same run can start afresh.
    result = await run(
        definition(store.inner, model=model),
        request("r", tool.registry(), model_replay=Replay.ALLOWED),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER


async def test_a_start_that_landed_before_the_cancellation_is_ended() -> None:
    store = SlowStore("start_run", after=True)
    model, tool = BlockingModel(block_at=None), WaitTool(block=False)

    async def drive() -> None:
        await run(
            definition(store, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )

    assert await cancel_when(store.entered, drive) is not None
    assert model.calls == []
    records = (await store.inner.read_log("r")).records
    assert [type(r).__name__ for r in records] == ["RunStarted", "RunEnded"]
    end = records[-1]
    assert isinstance(end, RunEnded)
    assert (end.stop_reason, end.steps) == (StopReason.CANCELLED, 0)
    await _check_cancelled_then_resume(store.inner, model, tool)


async def test_cancel_with_replay_never_resumes_in_doubt() -> None:
    store, model, tool = MemoryStore(), BlockingModel(block_at=0), WaitTool(block=False)

    async def drive() -> None:
        await run(definition(store, model=model), request("r", tool.registry()))

    await cancel_when(model.entered, drive)
    later = await resume(definition(store, model=model), request("r", tool.registry()))
    assert later.stop_reason is StopReason.IN_DOUBT
    assert later.detail is not None and "r:0:model" in later.detail


async def test_grace_running_out_leaves_a_log_that_resume_handles() -> None:
    slow_end = SlowStore("end_run")
    model, tool = BlockingModel(block_at=0), WaitTool(block=False)

    async def drive() -> None:
        await run(
            definition(slow_end, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED, cancel_grace_s=0.05),
        )

    with anyio.fail_after(5):
        await cancel_when(model.entered, drive)
    log = await slow_end.inner.read_log("r")
    assert not any(isinstance(r, RunEnded) for r in log.records)
    later = await resume(
        definition(slow_end.inner, model=model),
        request("r", tool.registry(), model_replay=Replay.ALLOWED),
    )
    assert later.stop_reason is StopReason.FINAL_ANSWER


async def test_a_deadline_is_a_cancellation_too() -> None:
    store, model, tool = MemoryStore(), BlockingModel(block_at=1), WaitTool(block=False)
    with anyio.move_on_after(0.5) as scope:
        await run(
            definition(store, model=model),
            request("r", tool.registry(), model_replay=Replay.ALLOWED),
        )
    assert scope.cancelled_caught
    log = await store.read_log("r")
    assert isinstance(log.records[-1], RunEnded)
    assert log.records[-1].stop_reason is StopReason.CANCELLED
    assert log.records[-1].steps == 1
