"""The OpenAI-compatible adapter streaming, against LLMock, a mock server this project did
not write, which sends real server-sent event chunks (usage last, when asked).

A run streamed through the adapter hands its delta sink each piece of the reply's text
before the step's record is written, and leaves the log a whole-reply run leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import openai
import pytest
from llmock.scenarios import Delay, StreamFault
from llmock.scenarios import Reply as LLMockReply
from llmock.scenarios import ToolCall as LLMockToolCall
from llmock.testing import LLMockServer

from kit.agent import Ledger, answer, cancel_when, definition, make_tools, request, tool_call
from kit.backends import BOTH_BACKENDS
from kit.deltas import DeltaRecordingSink, TimelineStore
from kit.openai_example import load_example
from polyloop import (
    DeltaSink,
    Event,
    EventKind,
    Message,
    ModelCall,
    ModelReply,
    Record,
    Replay,
    Result,
    Role,
    RunEnded,
    StepRecord,
    StopReason,
    StreamingModelClient,
    TextDelta,
    ToolStyle,
)
from polyloop import run as run_agent
from polyloop.adapters.openai import OpenAIModelClient
from polyloop.interpreters import NativeToolCallInterpreter
from polyloop.stores import MemoryStore
from polyloop.testing import RecordingSink, without_timing

pytestmark = [
    pytest.mark.anyio,
    # Under Trio, the SDK stops reading its server-sent events at "[DONE]" (or at a
    # cancellation) without closing the generators it reads them with; Trio closes them
    # itself and warns. Nothing else is muted.
    pytest.mark.filterwarnings(
        r"ignore:Async generator '(httpx2|httpcore2|openai)\.:ResourceWarning"
    ),
]

MODEL = "test-model"
REPLIES = (tool_call("double", n=2), answer("the number 2 doubled is 4"))


def script(llmock: LLMockServer) -> None:
    llmock.state.scenarios.add(*(LLMockReply(text=text) for text in REPLIES))


def client_for(llmock: LLMockServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=llmock.base_url("openai"), api_key="k", max_retries=0)


def without_call_ids(records: tuple[Record, ...]) -> list[Record]:
    """The records with the server's ids left out: LLMock draws a new one per request."""
    plain: list[Record] = []
    for record in records:
        record = without_timing(record)
        if isinstance(record, StepRecord):
            record = dataclasses.replace(record, call_id=None)
        elif isinstance(record, Result) and isinstance(record.payload, dict):
            record = dataclasses.replace(record, payload={**record.payload, "call_id": None})
        plain.append(record)
    return plain


async def streamed_run(
    llmock: LLMockServer,
    *,
    stream: bool,
    sink: DeltaRecordingSink,
    store: MemoryStore | None = None,
) -> tuple[Any, MemoryStore]:
    store = store if store is not None else TimelineStore(sink.timeline)
    async with client_for(llmock) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={}, stream=stream)
        assert isinstance(adapter, StreamingModelClient) and isinstance(sink, DeltaSink)
        result = await run_agent(
            definition(store, model=adapter, events=sink), request("r", make_tools(Ledger()))
        )
    return result, store


@BOTH_BACKENDS
async def test_pieces_arrive_in_order_before_the_step_and_add_up_to_the_reply(
    llmock: LLMockServer,
) -> None:
    script(llmock)
    timeline: list[tuple[str, Any]] = []
    sink = DeltaRecordingSink(timeline)
    result, _ = await streamed_run(llmock, stream=True, sink=sink)

    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    assert result.event_failures == 0
    for index, step in enumerate(result.steps):
        assert sink.text_of(index) == step.model_output == REPLIES[index]
        assert len([d for d in sink.deltas if d.step == index]) > 3, "it came in pieces"
        assert {d.result_id for d in sink.deltas if d.step == index} == {f"r:{index}:model"}
        pieces_at = [i for i, entry in enumerate(timeline) if entry == ("delta", index)]
        assert max(pieces_at) < timeline.index(("write_step", index))
        # The usage came in the stream's last chunk, because the adapter asked for it.
        assert step.usage is not None and step.usage.input_tokens and step.usage.output_tokens
        assert step.call_id is not None and step.call_id.startswith("chatcmpl-")
        assert step.model == MODEL
    bodies = [record.body for record in llmock.state.journal.records(wait=2.0)]
    assert [(b["stream"], b["stream_options"]) for b in bodies] == [
        (True, {"include_usage": True})
    ] * 2


async def test_a_streamed_run_logs_what_a_whole_reply_run_logs(llmock: LLMockServer) -> None:
    script(llmock)
    streamed_sink = DeltaRecordingSink([])
    streamed, streamed_store = await streamed_run(llmock, stream=True, sink=streamed_sink)
    script(llmock)
    whole_sink = DeltaRecordingSink([])
    whole, whole_store = await streamed_run(llmock, stream=False, sink=whole_sink)

    assert streamed.stop_reason is whole.stop_reason is StopReason.FINAL_ANSWER
    streamed_log = await streamed_store.read_log("r")
    whole_log = await whole_store.read_log("r")
    assert without_call_ids(streamed_log.records) == without_call_ids(whole_log.records)
    assert [e.kind for e in streamed_sink.events] == [e.kind for e in whole_sink.events]
    # Read whole, each reply reaches the sink as one piece, once it is in.
    assert [(d.step, d.index, d.text) for d in whole_sink.deltas] == [
        (0, 0, REPLIES[0]),
        (1, 0, REPLIES[1]),
    ]
    assert len(streamed_sink.deltas) > len(whole_sink.deltas)
    bodies = [record.body for record in llmock.state.journal.records(wait=2.0)]
    assert ["stream" in body for body in bodies] == [True, True, False, False]


async def test_a_streaming_adapter_streams_for_a_sink_that_takes_no_pieces(
    llmock: LLMockServer,
) -> None:
    script(llmock)
    store, sink = MemoryStore(), RecordingSink()
    async with client_for(llmock) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={}, stream=True)
        result = await run_agent(
            definition(store, model=adapter, events=sink), request("r", make_tools(Ledger()))
        )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [step.model_output for step in result.steps] == list(REPLIES)
    assert all(step.usage is not None for step in result.steps)
    bodies = [record.body for record in llmock.state.journal.records(wait=2.0)]
    assert all(body["stream"] is True for body in bodies)


async def test_native_tool_calls_streamed_in_fragments_are_the_ones_read_whole(
    llmock: LLMockServer,
) -> None:
    arguments = {"city": "Paris", "days": 3, "notes": "a long text to fragment"}
    replies = []
    for stream in (True, False):
        llmock.state.scenarios.add(
            LLMockReply(text="Checking.", tool_calls=(LLMockToolCall("weather", arguments),))
        )
        async with client_for(llmock) as client:
            adapter = OpenAIModelClient(client, model=MODEL, sampling={}, stream=stream)
            call = ModelCall(
                messages=(Message.text(Role.USER, "Weather?"),),
                call_index=0,
                run_id="r",
                result_id="r:0:model",
                binding={},
                tools=({"name": "weather", "description": "", "parameters": {}},),
            )
            replies.append(await adapter.call(call))
    streamed, whole = replies
    assert streamed.tool_calls and streamed.tool_calls[0].arguments == arguments
    assert streamed.tool_calls[0].name == "weather"
    # LLMock draws a new id for each call: all else is the same.
    assert streamed.tool_calls[0].call_id.startswith("call_")
    assert anonymous(streamed) == anonymous(whole)


def anonymous(reply: ModelReply) -> ModelReply:
    calls = tuple(dataclasses.replace(call, call_id="") for call in reply.tool_calls)
    return dataclasses.replace(reply, call_id=None, tool_calls=calls)


async def test_the_stream_flag_is_a_bool_and_stream_stays_out_of_sampling(
    llmock: LLMockServer,
) -> None:
    async with client_for(llmock) as client:
        with pytest.raises(TypeError, match="stream must be True or False"):
            OpenAIModelClient(client, model=MODEL, sampling={}, stream=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="build the adapter with stream=True"):
            OpenAIModelClient(client, model=MODEL, sampling={"stream": True})
        with pytest.raises(ValueError, match="asks for usage itself"):
            OpenAIModelClient(client, model=MODEL, sampling={"stream_options": {}})
        streaming = OpenAIModelClient(client, model=MODEL, sampling={}, stream=True)
        whole = OpenAIModelClient(client, model=MODEL, sampling={})
        # Streaming changes how the reply travels, not the reply: not in the snapshot.
        assert streaming.parameters() == whole.parameters()


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("truncate", "ValueError: the stream of chat completion 'chatcmpl-"),
        ("disconnect", "APIConnectionError: Connection error."),
        ("malformed", "JSONDecodeError: "),
    ],
)
async def test_a_stream_broken_in_transit_is_a_model_failure_not_half_a_reply(
    llmock: LLMockServer, fault: str, error: str
) -> None:
    """A stream cut off cleanly looks finished to the SDK: the missing finish reason
    gives it away, and half a reply is never interpreted."""
    llmock.state.scenarios.add(
        LLMockReply(text=tool_call("double", n=2)), StreamFault(fault, after_chunks=3)
    )
    sink = DeltaRecordingSink()
    ledger = Ledger()
    async with client_for(llmock) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={}, stream=True)
        result = await run_agent(
            definition(MemoryStore(), model=adapter, events=sink),
            request("r", make_tools(ledger)),
        )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and result.detail.startswith(error), result.detail
    assert ledger.calls == []
    if fault != "malformed":
        assert sink.text_of(0), "the pieces before the break were shown"
        assert tool_call("double", n=2).startswith(sink.text_of(0))


# -- cancelled mid-stream -------------------------------------------------------------------------


class Stalls(DeltaRecordingSink):
    """Once step 0 is recorded, makes the next request stall: a stream after its first
    pieces, a whole reply before it is sent. ``entered`` fires once the request is in
    that stall, as far as the run can see: for a stream, at its first piece; for a whole
    reply, once the server holds it (``_watch_in_flight``)."""

    def __init__(self, llmock: LLMockServer, *, stream: bool) -> None:
        super().__init__([])
        self.llmock = llmock
        self.stream = stream
        self.entered = anyio.Event()

    async def emit(self, event: Event) -> None:
        await super().emit(event)
        if event.kind is EventKind.STEP_FINISHED and event.step == 0:
            # Queued now, before the run asks again: the next request takes it.
            self.llmock.state.scenarios.add(
                StreamFault("stall", after_chunks=3, stall_seconds=30.0)
                if self.stream
                else Delay(30.0)
            )

    async def emit_delta(self, delta: TextDelta) -> None:
        await super().emit_delta(delta)
        if delta.step == 1:
            self.entered.set()


async def cancelled_log(llmock: LLMockServer, *, stream: bool) -> tuple[list[Record], Stalls]:
    script(llmock)
    sink = Stalls(llmock, stream=stream)
    store = MemoryStore()
    async with client_for(llmock) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={}, stream=stream)
        shared = definition(store, model=adapter, events=sink)

        async def drive() -> None:
            async with anyio.create_task_group() as group:
                if not stream:
                    group.start_soon(_watch_in_flight, llmock, sink)
                await run_agent(
                    shared, request("r", make_tools(Ledger()), model_replay=Replay.ALLOWED)
                )
                group.cancel_scope.cancel()

        with anyio.fail_after(20):
            await cancel_when(sink.entered, drive)
    llmock.state.reset()  # the stalled request is dropped with the queue
    return list((await store.read_log("r")).records), sink


async def _watch_in_flight(llmock: LLMockServer, sink: Stalls) -> None:
    """Fires ``sink.entered`` once step 0 is recorded and the next request is open."""
    # The count lives in the server's thread: nothing there can wake a task here.
    while not (  # noqa: ASYNC110
        any(e.kind is EventKind.STEP_FINISHED for e in sink.events)
        and llmock.state.journal.in_flight > 0
    ):
        await anyio.sleep(0.01)
    sink.entered.set()


@BOTH_BACKENDS
async def test_cancelling_mid_stream_leaves_the_records_of_a_cancelled_whole_call(
    llmock: LLMockServer,
) -> None:
    streamed, streamed_sink = await cancelled_log(llmock, stream=True)
    whole, whole_sink = await cancelled_log(llmock, stream=False)

    assert streamed_sink.text_of(1), "the second reply had begun to arrive"
    assert REPLIES[1].startswith(streamed_sink.text_of(1))
    assert streamed_sink.text_of(1) != REPLIES[1]
    assert without_call_ids(tuple(streamed)) == without_call_ids(tuple(whole))
    end = streamed[-1]
    assert isinstance(end, RunEnded) and end.stop_reason is StopReason.CANCELLED
    assert [e.kind for e in streamed_sink.events] == [e.kind for e in whole_sink.events]


async def test_a_native_tool_style_run_streams_its_text_around_the_call(
    llmock: LLMockServer,
) -> None:
    llmock.state.scenarios.add(
        LLMockReply(text="Doubling.", tool_calls=(LLMockToolCall("double", {"n": 2}),)),
        LLMockReply(text=answer("4")),
    )
    sink = DeltaRecordingSink([])
    async with client_for(llmock) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={}, stream=True)
        ledger = Ledger()
        result = await run_agent(
            definition(
                MemoryStore(),
                model=adapter,
                events=sink,
                interpreter=NativeToolCallInterpreter(answer_in_text=True),
            ),
            request("r", make_tools(ledger), tool_style=ToolStyle.NATIVE),
        )
    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    assert ledger.calls == [("double", "r:0:action")]
    assert sink.text_of(0) == "Doubling." == result.steps[0].model_output
    assert sink.text_of(1) == answer("4")


async def test_the_example_agent_prints_the_text_as_it_arrives(
    llmock: LLMockServer, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("polyloop_openai_agent_streaming")
    multiply = '{"tool": "multiply", "arguments": {"a": 6, "b": 7}}'
    submit = '{"tool": "submit", "arguments": {"answer": "42"}}'
    llmock.state.scenarios.add(LLMockReply(text=multiply), LLMockReply(text=submit))
    base_url = llmock.base_url("openai")
    args = example.parse_args(
        ["--base-url", base_url, "--model", MODEL, "--max-retries", "0", "--stream"]
    )
    assert await example.amain(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == [f"[step 0] {multiply}", f"[step 1] {submit}"]
    assert "stopped: submitted after 2 steps" in printed[-1]
