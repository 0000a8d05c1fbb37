"""Many runs sharing one definition, and the event sink's contract."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from polyloop import (
    Event,
    EventKind,
    Intent,
    IntentKind,
    ModelCall,
    ModelReply,
    NullSink,
    Replay,
    RunStarted,
    StepRecord,
    StopReason,
    TracingSink,
    resume,
    run,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, RecordingSink, ScriptedModelClient, SimulatedCrash

pytestmark = pytest.mark.anyio


class JitteryModel:
    """Answers by call index after a random short pause, so runs interleave."""

    SCRIPT = (tool_call("double", n=1), tool_call("double", n=2), tool_call("submit", answer="4"))

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)
        self.calls: list[ModelCall] = []

    def parameters(self) -> dict[str, Any]:
        return {"kind": "jittery"}

    async def call(self, call: ModelCall) -> ModelReply:
        self.calls.append(call)
        await anyio.sleep(self.random.random() / 1000)
        return ModelReply(
            call_id=f"{call.run_id}#{call.call_index}",
            content=self.SCRIPT[call.call_index],
            reasoning=None,
        )


async def test_200_concurrent_runs_share_one_definition_without_mixing() -> None:
    store, model, ledger = MemoryStore(), JitteryModel(seed=7), Ledger()
    tools = make_tools(ledger)
    shared = definition(store, model=model)
    run_ids = [f"run-{i:03d}" for i in range(200)]
    results: dict[str, Any] = {}

    async def one(run_id: str) -> None:
        results[run_id] = await run(shared, request(run_id, tools, binding={"who": run_id}))

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)

    assert len(model.calls) == 600
    for run_id in run_ids:
        result = results[run_id]
        assert result.stop_reason is StopReason.SUBMITTED
        log = await store.read_log(run_id)
        assert {record.run_id for record in log.records} == {run_id}
        steps = [r for r in log.records if isinstance(r, StepRecord)]
        assert [s.call_id for s in steps] == [f"{run_id}#{i}" for i in range(3)]
        # Observations name the result id they were produced under: the run's own.
        assert f"({run_id}:0:action)" in (steps[0].observation or "")
        assert f"({run_id}:1:action)" in (steps[1].observation or "")
    for call in model.calls:
        assert call.binding == {"who": call.run_id}
        assert call.result_id.startswith(f"{call.run_id}:")
        history = " ".join(b.text for m in call.messages for b in m.content)
        assert all(f"{other}:" not in history for other in run_ids if other != call.run_id)
    assert sorted({rid.split(":")[0] for _, rid in ledger.calls}) == run_ids


async def test_events_of_a_run_and_of_its_resumption() -> None:
    sink = RecordingSink()
    inner = MemoryStore()
    tools = make_tools(Ledger())
    script = [tool_call("double", n=1), answer("2")]
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(inner, fail_after_writes=5), script=script, events=sink),
            request("r", tools),
        )
    assert [e.kind for e in sink.events] == [EventKind.RUN_STARTED, EventKind.STEP_FINISHED]
    assert sink.events[1].step == 0 and isinstance(sink.events[1].record, StepRecord)
    sink.events.clear()
    result = await resume(definition(inner, script=script, events=sink), request("r", tools))
    assert [e.kind for e in sink.events] == [
        EventKind.RUN_RESUMED,
        EventKind.STEP_FINISHED,
        EventKind.RUN_ENDED,
    ]
    assert all(e.run_id == "r" for e in sink.events)
    assert sink.events[-1].record.stop_reason is StopReason.FINAL_ANSWER  # type: ignore[union-attr]
    assert result.event_failures == 0


async def test_a_resumed_event_carries_the_log_the_resume_read() -> None:
    """A sink can rebuild what earlier attempts did from the resume event alone."""
    sink = RecordingSink()
    inner = MemoryStore()
    tools = make_tools(Ledger())
    script = [tool_call("double", n=1), tool_call("double", n=2), answer("2")]
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(inner, fail_after_writes=8), script=script, events=sink),
            request("r", tools),
        )
    before = (await inner.read_log("r")).records
    # Step 0 whole, and step 1 up to its action intent: an action in flight.
    assert isinstance(before[-1], Intent) and before[-1].kind is IntentKind.ACTION
    assert all(not e.logged for e in sink.events)  # only a resume carries a log
    sink.events.clear()
    await resume(definition(inner, script=script, events=sink), request("r", tools))
    resumed, *later = sink.events
    assert resumed.kind is EventKind.RUN_RESUMED
    assert resumed.logged == before
    assert all(not e.logged for e in later)
    assert "logged" not in repr(resumed)  # a long log stays out of log lines


class FailingSink:
    """Fails on every event and checks it is never entered while already failing."""

    def __init__(self) -> None:
        self.received: list[Event] = []
        self.inside = False

    def parameters(self) -> dict[str, Any]:
        return {"kind": "failing"}

    async def emit(self, event: Event) -> None:
        assert not self.inside, "the sink was re-entered"
        self.inside = True
        try:
            self.received.append(event)
            await anyio.lowlevel.checkpoint()
            raise ConnectionError("progress backend unreachable")
        finally:
            self.inside = False


async def test_a_failing_sink_is_counted_logged_and_not_re_entered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = FailingSink()
    script = [tool_call("double", n=1), tool_call("submit", answer="2")]
    with caplog.at_level(logging.ERROR, logger="polyloop"):
        result = await run(
            definition(MemoryStore(), script=script, events=sink),
            request("r", make_tools(Ledger())),
        )
    assert result.stop_reason is StopReason.SUBMITTED
    # RUN_STARTED, two STEP_FINISHED, RUN_ENDED: each delivered once, each failing once.
    assert [e.kind for e in sink.received] == [
        EventKind.RUN_STARTED,
        EventKind.STEP_FINISHED,
        EventKind.STEP_FINISHED,
        EventKind.RUN_ENDED,
    ]
    assert result.event_failures == 4
    failures = [r for r in caplog.records if r.name == "polyloop"]
    assert len(failures) == 4
    assert "ConnectionError" in (failures[0].exc_text or "")


async def test_concurrent_resume_of_one_run_on_one_store_is_refused() -> None:
    from polyloop import RunLocked

    class SlowModel:
        def __init__(self) -> None:
            self.entered = anyio.Event()

        def parameters(self) -> dict[str, Any]:
            return {"kind": "slow"}

        async def call(self, call: ModelCall) -> ModelReply:
            self.entered.set()
            await anyio.sleep(0.05)
            return ModelReply(call_id=None, content=answer("x"), reasoning=None)

    store, model = MemoryStore(), SlowModel()
    tools = make_tools(Ledger())
    inner_crash = FaultyStore(store, fail_after_writes=1)
    with pytest.raises(SimulatedCrash):
        await run(definition(inner_crash, model=model), request("r", tools))
    model.entered = anyio.Event()
    outcomes: list[Any] = []

    async def second() -> None:
        await model.entered.wait()
        with pytest.raises(RunLocked):
            await resume(definition(store, model=model), request("r", tools))
        outcomes.append("locked")

    async with anyio.create_task_group() as group:
        group.start_soon(second)
        outcomes.append(
            (await resume(definition(store, model=model), request("r", tools))).stop_reason
        )
    assert sorted(map(str, outcomes)) == ["final_answer", "locked"]


async def test_model_replay_allowed_is_part_of_identity() -> None:
    from polyloop import RunIdentityMismatch

    store = MemoryStore()
    tools = make_tools(Ledger())
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=2), script=[answer("x")]),
            request("r", tools),
        )
    with pytest.raises(RunIdentityMismatch) as mismatch:
        await resume(
            definition(store, script=[answer("x")]),
            request("r", tools, model_replay=Replay.ALLOWED),
        )
    assert [key for key, _, _ in mismatch.value.differences] == ["model_replay"]


class CountingNullSink(NullSink):
    """A NullSink subclass that looks at its events: it must still get every one."""

    __slots__ = ("kinds",)

    def __init__(self) -> None:
        self.kinds: list[EventKind] = []

    async def emit(self, event: Event) -> None:
        self.kinds.append(event.kind)


async def test_events_reach_a_null_sink_subclass_and_a_patched_null_sink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Whatever the sink's class, every event reaches its emit().
    script = [tool_call("double", n=1), answer("2")]
    expected = [
        EventKind.RUN_STARTED,
        EventKind.STEP_FINISHED,
        EventKind.STEP_FINISHED,
        EventKind.RUN_ENDED,
    ]
    sink = CountingNullSink()
    await run(
        definition(MemoryStore(), script=script, events=sink), request("sub", make_tools(Ledger()))
    )
    assert sink.kinds == expected

    seen: list[EventKind] = []

    async def spy(self: NullSink, event: Event) -> None:
        seen.append(event.kind)

    monkeypatch.setattr(NullSink, "emit", spy)
    await run(
        definition(MemoryStore(), script=script, events=NullSink()),
        request("patched", make_tools(Ledger())),
    )
    assert seen == expected


async def test_a_run_resumes_with_another_event_sink() -> None:
    """The sink is recorded in the start record but is not part of the identity: events
    change nothing a run does, and tracing may be added to runs already under way."""
    store = MemoryStore()
    tools = make_tools(Ledger())
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=2), script=[answer("x")]),
            request("r", tools, model_replay=Replay.ALLOWED),
        )
    sink = RecordingSink()
    result = await resume(
        definition(store, script=[answer("x")], events=sink),
        request("r", tools, model_replay=Replay.ALLOWED),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert sink.events[0].kind is EventKind.RUN_RESUMED
    (started,) = [r for r in (await store.read_log("r")).records if isinstance(r, RunStarted)]
    assert started.snapshot["events.kind"] == "null"  # what the run started with stays


CURRENT_CALL: contextvars.ContextVar[tuple[str, int, str] | None] = contextvars.ContextVar(
    "current_call", default=None
)


class WrappingSink(RecordingSink):
    """A tracing sink whose wrapper makes the call current, as a span would be."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, str, str | None]] = []

    @contextlib.contextmanager
    def around_call(self, *, run_id: str, step: int, kind: IntentKind) -> Iterator[None]:
        token = CURRENT_CALL.set((run_id, step, kind.value))
        failure: str | None = None
        try:
            yield
        except BaseException as exc:
            failure = type(exc).__name__
            raise
        finally:
            CURRENT_CALL.reset(token)
            self.calls.append((run_id, step, kind.value, failure))


async def test_a_tracing_sink_wraps_each_model_call_and_action_while_it_runs() -> None:
    seen: list[tuple[str, int, str] | None] = []

    def script(call: ModelCall) -> str:
        seen.append(CURRENT_CALL.get())
        return (tool_call("double", n=1), answer("2"))[call.call_index]

    sink = WrappingSink()
    assert isinstance(sink, TracingSink) and not isinstance(NullSink(), TracingSink)
    tools = make_tools(Ledger())
    inner = tools.executor()

    class Spying:
        def replay(self, action: Any) -> Replay:
            return inner.replay(action)

        async def execute(self, action: Any, *, result_id: str) -> Any:
            seen.append(CURRENT_CALL.get())
            return await inner.execute(action, result_id=result_id)

    result = await run(
        definition(MemoryStore(), model=ScriptedModelClient(script), events=sink),
        request("r1", tools, executor=Spying()),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert seen == [("r1", 0, "model_call"), ("r1", 0, "action"), ("r1", 1, "model_call")]
    assert sink.calls == [
        ("r1", 0, "model_call", None),
        ("r1", 0, "action", None),
        ("r1", 1, "model_call", None),
    ]
    assert CURRENT_CALL.get() is None


async def test_a_tracing_sink_sees_a_failing_model_call_pass_through() -> None:
    sink = WrappingSink()
    result = await run(
        definition(MemoryStore(), script=[ConnectionError("gone")], events=sink),
        request("r1", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert sink.calls == [("r1", 0, "model_call", "ConnectionError")]


class FaultyWrappingSink(RecordingSink):
    """A tracing sink whose wrapper breaks as it enters or as it leaves."""

    def __init__(self, breaks: str) -> None:
        super().__init__()
        self.breaks = breaks

    @contextlib.contextmanager
    def around_call(self, *, run_id: str, step: int, kind: IntentKind) -> Iterator[None]:
        if self.breaks == "entering":
            raise RuntimeError("the tracer broke")
        yield
        raise RuntimeError("the tracer broke")


@pytest.mark.parametrize("breaks", ["entering", "leaving"])
async def test_a_tracing_sink_that_breaks_costs_the_run_nothing(
    breaks: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Like a failing ``emit``: counted and logged, while the calls run and the run ends
    as it would have."""
    ledger = Ledger()
    result = await run(
        definition(
            MemoryStore(),
            script=[tool_call("double", n=1), answer("2")],
            events=FaultyWrappingSink(breaks),
        ),
        request("r1", make_tools(ledger)),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert len(ledger.calls) == 1
    assert result.event_failures == 3  # two model calls and an action
    assert f"the event sink failed {breaks} a model_call" in caplog.text
