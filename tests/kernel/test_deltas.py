"""The model's text as it arrives: a streaming client's pieces reach a delta sink, in
order, before the step's record, and never reach the log."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import Ledger, answer, cancel_when, definition, make_tools, request, tool_call
from kit.deltas import DeltaRecordingSink, TimelineStore
from polyloop import (
    DeltaSink,
    Event,
    EventKind,
    ModelCall,
    ModelReply,
    NullSink,
    Record,
    Replay,
    RunEnded,
    StopReason,
    StreamingModelClient,
    TextDelta,
    resume,
    run,
)
from polyloop.stores import MemoryStore
from polyloop.testing import RecordingSink, ScriptedModelClient, without_timing

pytestmark = pytest.mark.anyio

SCRIPT = (tool_call("double", n=1), tool_call("double", n=2), tool_call("submit", answer="4"))


def pieces_of(text: str) -> list[str]:
    """``text`` in pieces of five characters, with an empty one a server may send."""
    return ["", *(text[start : start + 5] for start in range(0, len(text), 5))]


class PlainModel:
    """Answers from ``SCRIPT`` by call index, whole."""

    def __init__(self, timeline: list[tuple[str, Any]] | None = None) -> None:
        self.timeline = timeline if timeline is not None else []
        self.called: list[str] = []

    def parameters(self) -> dict[str, Any]:
        return {"kind": "pieces"}  # the same for both classes: both runs have one snapshot

    async def call(self, call: ModelCall) -> ModelReply:
        self.called.append("call")
        await anyio.lowlevel.checkpoint()
        return self.reply(call)

    def reply(self, call: ModelCall) -> ModelReply:
        return ModelReply(
            call_id=f"c{call.call_index}", content=SCRIPT[call.call_index], reasoning=None
        )


class StreamingModel(PlainModel):
    """Answers as :class:`PlainModel` does, or in pieces through ``stream``."""

    async def stream(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
    ) -> ModelReply:
        self.called.append("stream")
        for piece in pieces_of(SCRIPT[call.call_index]):
            await on_text(piece)
        self.timeline.append(("returned", call.call_index))
        return self.reply(call)


def timeless(records: tuple[Record, ...]) -> list[Record]:
    return [without_timing(record) for record in records]


async def test_both_capabilities_are_protocols_the_doubles_satisfy() -> None:
    assert isinstance(StreamingModel(), StreamingModelClient)
    assert not isinstance(PlainModel(), StreamingModelClient)
    assert isinstance(DeltaRecordingSink(), DeltaSink)
    assert not isinstance(RecordingSink(), DeltaSink)
    assert not isinstance(NullSink(), DeltaSink)


async def test_a_null_sink_with_emit_delta_is_a_delta_sink_as_the_docs_show() -> None:
    class Printer(NullSink):
        def __init__(self) -> None:
            self.printed: list[str] = []

        async def emit_delta(self, delta: TextDelta) -> None:
            self.printed.append(delta.text)

    printer = Printer()
    assert isinstance(printer, DeltaSink)
    result = await run(
        definition(MemoryStore(), model=StreamingModel(), events=printer),
        request("r", make_tools(Ledger())),
    )
    assert "".join(printer.printed) == "".join(step.model_output for step in result.steps)


async def test_pieces_reach_the_sink_in_order_before_their_step_is_written() -> None:
    timeline: list[tuple[str, Any]] = []
    model, sink = StreamingModel(timeline), DeltaRecordingSink(timeline)
    result = await run(
        definition(TimelineStore(timeline), model=model, events=sink),
        request("r", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.SUBMITTED
    assert result.event_failures == 0
    assert model.called == ["stream"] * 3

    for index, step in enumerate(result.steps):
        mine = [delta for delta in sink.deltas if delta.step == index]
        assert [delta.index for delta in mine] == list(range(len(mine)))
        assert {(d.run_id, d.result_id) for d in mine} == {("r", f"r:{index}:model")}
        assert "".join(delta.text for delta in mine) == step.model_output == SCRIPT[index]
        assert all(delta.text for delta in mine), "empty pieces are not sent"
        # Every piece of the step's call came before the call returned, and so before
        # the step's record was written and its event sent.
        last_piece = max(i for i, entry in enumerate(timeline) if entry == ("delta", index))
        assert last_piece < timeline.index(("returned", index))
        assert timeline.index(("returned", index)) < timeline.index(("write_step", index))
    assert [kind for what, kind in timeline if what == "event"] == [
        EventKind.RUN_STARTED,
        EventKind.STEP_FINISHED,
        EventKind.STEP_FINISHED,
        EventKind.STEP_FINISHED,
        EventKind.RUN_ENDED,
    ]


async def test_nothing_of_the_pieces_is_in_the_log() -> None:
    """The same run, streamed to a delta sink and called whole: the same log."""
    streamed_store, plain_store = MemoryStore(), MemoryStore()
    streamed_sink = DeltaRecordingSink()
    streamed = await run(
        definition(streamed_store, model=StreamingModel(), events=streamed_sink),
        request("r", make_tools(Ledger())),
    )
    plain = await run(
        definition(plain_store, model=PlainModel(), events=DeltaRecordingSink()),
        request("r", make_tools(Ledger())),
    )
    assert streamed_sink.deltas, "the streamed run did stream"
    streamed_log = await streamed_store.read_log("r")
    plain_log = await plain_store.read_log("r")
    assert timeless(streamed_log.records) == timeless(plain_log.records)
    assert [e.kind for e in streamed_sink.events] == [
        e.kind for e in (await _events_of_a_plain_run())
    ]
    assert streamed.steps and [without_timing(s) for s in streamed.steps] == [
        without_timing(s) for s in plain.steps
    ]


async def _events_of_a_plain_run() -> list[Event]:
    sink = RecordingSink()
    await run(
        definition(MemoryStore(), model=PlainModel(), events=sink),
        request("r", make_tools(Ledger())),
    )
    return sink.events


class FailingDeltaSink(DeltaRecordingSink):
    """Takes the step events and breaks on every piece of text."""

    async def emit_delta(self, delta: TextDelta) -> None:
        self.deltas.append(delta)
        raise ConnectionError("the display went away")


async def test_a_sink_failing_on_pieces_is_counted_and_logged_and_still_fed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = FailingDeltaSink()
    ledger = Ledger()
    with caplog.at_level(logging.ERROR, logger="polyloop"):
        result = await run(
            definition(MemoryStore(), model=StreamingModel(), events=sink),
            request("r", make_tools(ledger)),
        )
    assert result.stop_reason is StopReason.SUBMITTED
    assert len(ledger.calls) == 3, "the run went on as it would have"
    pieces = sum(len([p for p in pieces_of(text) if p]) for text in SCRIPT)
    assert len(sink.deltas) == pieces, "each piece was still offered"
    assert result.event_failures == pieces
    failures = [r for r in caplog.records if r.name == "polyloop"]
    assert len(failures) == pieces
    assert "text delta 0 of step 0" in failures[0].getMessage()
    assert "ConnectionError" in (failures[0].exc_text or "")
    assert len(sink.events) == 5, "the step events are not affected"


async def test_a_client_that_cannot_stream_is_called_as_before() -> None:
    model, sink = PlainModel(), DeltaRecordingSink()
    result = await run(
        definition(MemoryStore(), model=model, events=sink), request("r", make_tools(Ledger()))
    )
    assert result.stop_reason is StopReason.SUBMITTED
    assert model.called == ["call"] * 3
    assert sink.deltas == []


async def test_a_sink_that_takes_no_pieces_gets_a_plain_call() -> None:
    model, sink = StreamingModel(), RecordingSink()
    result = await run(
        definition(MemoryStore(), model=model, events=sink), request("r", make_tools(Ledger()))
    )
    assert result.stop_reason is StopReason.SUBMITTED
    assert model.called == ["call"] * 3, "no one would hear the pieces"


async def test_a_scripted_client_with_a_delta_sink_runs_unchanged() -> None:
    sink = DeltaRecordingSink()
    result = await run(
        definition(MemoryStore(), model=ScriptedModelClient(list(SCRIPT)), events=sink),
        request("r", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.SUBMITTED and sink.deltas == []


class Lingering(StreamingModel):
    """Keeps ``on_text`` and calls it after the call has returned, as a leaky client might."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Callable[[str], Awaitable[None]]] = []

    async def stream(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
    ) -> ModelReply:
        if self.kept:
            await self.kept[-1]("late")
        self.kept.append(on_text)
        return await super().stream(call, on_text)


async def test_pieces_sent_after_their_call_returned_are_dropped() -> None:
    sink = DeltaRecordingSink()
    await run(
        definition(MemoryStore(), model=Lingering(), events=sink),
        request("r", make_tools(Ledger())),
    )
    assert "late" not in [delta.text for delta in sink.deltas]
    for index in range(3):
        text = "".join(delta.text for delta in sink.deltas if delta.step == index)
        assert text == SCRIPT[index]


class NotText(StreamingModel):
    async def stream(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
    ) -> ModelReply:
        await on_text(b"bytes")  # type: ignore[arg-type]
        return self.reply(call)


async def test_a_piece_that_is_not_text_fails_the_call() -> None:
    result = await run(
        definition(MemoryStore(), model=NotText(), events=DeltaRecordingSink()),
        request("r", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and "must be a str, not bytes" in result.detail


# -- cancelled mid-stream ---------------------------------------------------------------------


class Stalling(StreamingModel):
    """Sends two pieces of its second call, then waits forever; or, called whole, waits."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = anyio.Event()

    async def call(self, call: ModelCall) -> ModelReply:
        if call.call_index == 1 and not self.entered.is_set():
            self.entered.set()
            await anyio.sleep_forever()
        return await super().call(call)

    async def stream(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
    ) -> ModelReply:
        if call.call_index == 1 and not self.entered.is_set():
            await on_text('{"tool": ')
            await on_text('"double"')
            self.entered.set()
            await anyio.sleep_forever()
        return await super().stream(call, on_text)


async def _cancelled_log(model: Stalling, sink: RecordingSink) -> Any:
    store = MemoryStore()
    shared = definition(store, model=model, events=sink)

    async def drive() -> None:
        await run(shared, request("r", make_tools(Ledger()), model_replay=Replay.ALLOWED))

    await cancel_when(model.entered, drive)
    return store, (await store.read_log("r")).records


async def test_cancelling_mid_stream_leaves_the_records_of_a_cancelled_call() -> None:
    # The same model: streamed to a delta sink, and called whole for a plain one.
    streamed_sink, plain_sink = DeltaRecordingSink(), RecordingSink()
    streaming, plain_model = Stalling(), Stalling()
    store, streamed = await _cancelled_log(streaming, streamed_sink)
    _, plain = await _cancelled_log(plain_model, plain_sink)

    assert [d.text for d in streamed_sink.deltas if d.step == 1] == ['{"tool": ', '"double"']
    # Step 0 answered through each; step 1 stalled before it answered.
    assert streaming.called == ["stream"] and plain_model.called == ["call"]
    assert timeless(streamed) == timeless(plain)
    end = streamed[-1]
    assert isinstance(end, RunEnded) and end.stop_reason is StopReason.CANCELLED
    assert [e.kind for e in streamed_sink.events] == [e.kind for e in plain_sink.events]

    # The resumed run calls the model again, streams the whole reply this time, and
    # its pieces are those of the new call only.
    resumed_sink = DeltaRecordingSink()
    later = await resume(
        definition(store, model=streaming, events=resumed_sink),
        request("r", make_tools(Ledger()), model_replay=Replay.ALLOWED),
    )
    assert later.stop_reason is StopReason.SUBMITTED
    step_one = [d for d in resumed_sink.deltas if d.step == 1]
    assert [d.index for d in step_one] == list(range(len(step_one)))
    assert "".join(d.text for d in step_one) == later.steps[1].model_output


async def test_a_sink_can_show_each_run_of_a_shared_definition_apart() -> None:
    sink = DeltaRecordingSink()
    shared = definition(MemoryStore(), model=StreamingModel(), events=sink)
    async with anyio.create_task_group() as group:
        for run_id in ("a", "b", "c"):
            group.start_soon(run, shared, request(run_id, make_tools(Ledger())))
    for run_id in ("a", "b", "c"):
        mine = [d for d in sink.deltas if d.run_id == run_id]
        texts = ["".join(d.text for d in mine if d.step == i) for i in range(3)]
        assert texts == list(SCRIPT)
        assert {d.result_id for d in mine} == {f"{run_id}:{i}:model" for i in range(3)}


async def test_the_final_answer_streams_too() -> None:
    class Answering(StreamingModel):
        def reply(self, call: ModelCall) -> ModelReply:
            return ModelReply(call_id=None, content=answer("42"), reasoning=None)

        async def stream(
            self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
        ) -> ModelReply:
            for piece in pieces_of(answer("42")):
                await on_text(piece)
            return self.reply(call)

    sink = DeltaRecordingSink()
    result = await run(
        definition(MemoryStore(), model=Answering(), events=sink),
        request("r", make_tools(Ledger())),
    )
    assert result.final_answer == "42"
    assert "".join(d.text for d in sink.deltas) == answer("42")
