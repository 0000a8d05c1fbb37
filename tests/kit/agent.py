"""Builders shared by the tests that drive whole runs."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from polyloop import (
    Budget,
    Definition,
    EventSink,
    Injection,
    Interpreter,
    Message,
    ModelCall,
    ModelClient,
    ModelReply,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunResult,
    StepRecord,
    Store,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
)
from polyloop.testing import JsonActionInterpreter, ScriptedModelClient, without_timing

TEXTS = ObservationTexts(not_executed="Refused: {reason}", env_fault="Fault: {detail}")
NUMBER_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
}


def tool_call(name: str, **arguments: Any) -> str:
    """A scripted model reply that calls a tool (for ``JsonActionInterpreter``)."""
    return json.dumps({"tool": name, "arguments": arguments})


def answer(text: str) -> str:
    """A scripted model reply that answers."""
    return json.dumps({"answer": text})


class Ledger:
    """Side effects of the test tools, by result id: proves what ran how often."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def count(self, result_id: str) -> int:
        return sum(1 for _, rid in self.calls if rid == result_id)


def make_tools(
    ledger: Ledger,
    *,
    replay: Replay = Replay.NEVER,
    delay: float = 0.0,
    max_observation_chars: int = 10_000,
) -> ToolRegistry:
    """``double`` doubles a number (and names its result id), ``submit`` completes."""

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("double", result_id))
        if delay:
            await anyio.sleep(delay)
        else:
            await anyio.lowlevel.checkpoint()
        return f"{arguments['n'] * 2} ({result_id})"

    async def submit(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("submit", result_id))
        await anyio.lowlevel.checkpoint()
        return f"accepted {arguments['answer']}"

    return ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=NUMBER_SCHEMA,
                handler=double,
                replay=replay,
            ),
            ToolSpec(
                name="submit",
                description="Submit the answer.",
                parameters=ANSWER_SCHEMA,
                handler=submit,
                replay=replay,
                completes=True,
            ),
        ],
        max_observation_chars=max_observation_chars,
    )


def five_step_script() -> list[str]:
    """Four doubling steps (one of them refused by the schema) and a submit."""
    return [
        tool_call("double", n=1),
        tool_call("double", n="two"),
        "this is not JSON",
        tool_call("double", n=3),
        tool_call("submit", answer="6"),
    ]


def definition(
    store: Store,
    *,
    model: ModelClient | None = None,
    script: Sequence[Any] = (),
    interpreter: Interpreter | None = None,
    events: EventSink | None = None,
    texts: ObservationTexts = TEXTS,
) -> Definition:
    return Definition(
        model=model if model is not None else ScriptedModelClient(list(script)),
        interpreter=interpreter if interpreter is not None else JsonActionInterpreter(),
        store=store,
        events=events if events is not None else NullSink(),
        texts=texts,
    )


def request(run_id: str, tools: ToolRegistry, /, **overrides: Any) -> Request:
    fields: dict[str, Any] = {
        "run_id": run_id,
        "budget": Budget(max_steps=20, max_valid_steps=20, max_context_chars=100_000),
        "executor": tools.executor(),
        "tools": tools,
        "run_context": (Message.text(Role.SYSTEM, "You are a careful agent."),),
        "goal_context": (Message.text(Role.USER, "Double 1, then 3, and submit 6."),),
        "injection": Injection(entries={}),
        "binding": {"episode": "e1"},
        "model_replay": Replay.NEVER,
        "observation_template": "Observation: {observation}",
        "tool_style": ToolStyle.JSON,
        "cancel_grace_s": 5.0,
    }
    fields.update(overrides)
    return Request(**fields)


def timeless(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """Step records without their wall-clock timing, for equivalence checks."""
    return [without_timing(step) for step in steps]


def same_outcome(a: RunResult, b: RunResult) -> bool:
    return (
        timeless(a.steps) == timeless(b.steps)
        and a.stop_reason == b.stop_reason
        and a.final_answer == b.final_answer
        and a.step_count == b.step_count
        and a.valid_step_count == b.valid_step_count
        and a.detail == b.detail
    )


def kinds(records: Sequence[Any]) -> list[str]:
    """Record kinds with the intent/result kind spelled out, for readable pins."""
    names = []
    for record in records:
        name = type(record).__name__
        kind = getattr(record, "kind", None)
        names.append(f"{name}:{kind.value}" if kind is not None and name != "Event" else name)
    return names


async def cancel_when(entered: anyio.Event, drive: Callable[[], Awaitable[Any]]) -> float | None:
    """Run ``drive`` and cancel it once ``entered`` fires; assert that the cancellation
    came out of it. The seconds from the cancellation until ``drive`` gave way, or None
    if ``drive`` returned instead."""
    cancelled_at: float | None = None
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel() -> None:
                nonlocal cancelled_at
                await entered.wait()
                cancelled_at = time.monotonic()
                scope.cancel()

            group.start_soon(cancel)
            await drive()
            return None
    assert scope.cancelled_caught, "the cancellation did not propagate out of the run"
    assert cancelled_at is not None
    return time.monotonic() - cancelled_at


WriteHook = Callable[[str], Any]


class SlowStore:
    """A memory store whose writes of one kind take a while: room to cancel inside them.

    The first write of that kind waits ``delay`` seconds before it reaches the inner
    store, or, with ``after``, once it has landed there.
    """

    def __init__(self, slow: str, *, delay: float = 10.0, after: bool = False) -> None:
        from polyloop.stores import MemoryStore

        self.inner = MemoryStore()
        self.slow = slow
        self.delay = delay
        self.after = after
        self.entered = anyio.Event()

    def parameters(self) -> Any:
        return self.inner.parameters()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        async def maybe_slow(*args: Any) -> Any:
            if name != self.slow or self.entered.is_set():
                return await method(*args)
            if self.after:
                outcome = await method(*args)
                self.entered.set()
                await anyio.sleep(self.delay)
                return outcome
            self.entered.set()
            await anyio.sleep(self.delay)
            return await method(*args)

        return maybe_slow


class InterruptedModel:
    """A scripted model that awaits ``before(call)`` just before answering call ``at``.

    For tests that break something (a connection, a lock) at a chosen point of a run.
    """

    def __init__(
        self, script: list[str], *, at: int, before: Callable[[ModelCall], Awaitable[None]]
    ) -> None:
        self.inner = ScriptedModelClient(script)
        self.at = at
        self.before = before

    def parameters(self) -> Any:
        return self.inner.parameters()

    async def call(self, call: ModelCall) -> ModelReply:
        if call.call_index == self.at:
            await self.before(call)
        return await self.inner.call(call)


def six_step_script() -> list[str]:
    """Five doubling steps (one refused by the schema, one unusable reply) and a submit."""
    return [
        tool_call("double", n=1),
        tool_call("double", n="two"),
        "this is not JSON",
        tool_call("double", n=3),
        tool_call("double", n=4),
        tool_call("submit", answer="8"),
    ]


# RunStarted, 4 + 4 + 3 + 4 + 4 + 4 step writes, RunEnded.
SIX_STEP_WRITES = 25
# The write numbers (1-based) that are intents: a crash right after one leaves it open.
SIX_STEP_INTENT_WRITES = frozenset({2, 4, 6, 8, 10, 13, 15, 17, 19, 21, 23})


async def close_store(store: Any) -> None:
    aclose = getattr(store, "aclose", None)
    if aclose is not None:
        await aclose()


async def crash_and_resume(
    open_store: Callable[[], Store], k: int, replay: Replay, script: Sequence[Any]
) -> tuple[RunResult, Ledger, Store]:
    """Run until a simulated crash after write ``k``, then resume on a new store object.

    The crashed store object is closed first, as the death of its process would; the
    returned store is the one the run was resumed on (the caller closes it).
    """
    import pytest

    from polyloop import resume, run
    from polyloop.testing import FaultyStore, SimulatedCrash

    ledger = Ledger()
    tools = make_tools(ledger, replay=replay)
    first = open_store()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(first, fail_after_writes=k), script=script),
            request("r", tools, model_replay=replay),
        )
    await close_store(first)
    second = open_store()
    resumed = await resume(
        definition(second, script=script), request("r", tools, model_replay=replay)
    )
    return resumed, ledger, second


async def uninterrupted(
    open_store: Callable[[], Store], replay: Replay, script: Sequence[Any], run_id: str = "r"
) -> RunResult:
    """The same run as :func:`crash_and_resume`, without a crash."""
    from polyloop import run

    store = open_store()
    try:
        return await run(
            definition(store, script=script),
            request(run_id, make_tools(Ledger(), replay=replay), model_replay=replay),
        )
    finally:
        await close_store(store)
