"""Runs as OpenTelemetry spans: the tree, names, kinds, attributes, times and links.

Spans go to the SDK's in-memory exporter through a provider handed to the sink, never
the global one; one test sends them over OTLP/HTTP to a receiver on 127.0.0.1 started
here, and reads them back from the protobuf the exporter sent.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import re
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kit.agent import (
    Ledger,
    answer,
    close_store,
    definition,
    five_step_script,
    make_tools,
    request,
    tool_call,
)
from kit.amending import DEPLOY_FIX, deployed_request
from kit.native import INTERPRETER, NATIVE, native_script
from kit.probe import Payments, tools
from kit.review import approval_script, payment_script, review_tools
from kit.surrogate import HALF
from kit.surrogate import RUN_ID as HALF_RUN_ID
from polyloop import (
    Amended,
    EnvironmentFault,
    Event,
    EventKind,
    EventSink,
    FinishReason,
    Intent,
    ModelCall,
    ModelReply,
    Record,
    Replay,
    RunResult,
    RunStarted,
    StepRecord,
    StopReason,
    ToolRegistry,
    ToolSpec,
    Usage,
    fork,
    resume,
    run,
    run_trace_id,
    settle,
)
from polyloop.otel import OpenTelemetrySink
from polyloop.stores import MemoryStore, SqliteStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash
from polyloop.testing.event_sink_contract import EventSinkContract
from polyloop.testing.store_contract import sample_run

pytestmark = pytest.mark.anyio


class Traced:
    """A tracer provider of its own, whose finished spans an in-memory exporter keeps."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.sink = OpenTelemetrySink(tracer_provider=self.provider)

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [span for span in self.spans() if span.name.startswith(prefix)]


@pytest.fixture
def traced() -> Iterator[Traced]:
    kit = Traced()
    yield kit
    kit.provider.shutdown()


def run_ids(run_id: str) -> tuple[int, int]:
    """The trace id and span id the sink derives from a run id, computed independently."""
    digest = hashlib.sha256(f"polyloop run\x00{run_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big"), int.from_bytes(digest[16:24], "big")


def reply(content: str, index: int, *, tokens: tuple[int, int] = (11, 7)) -> ModelReply:
    return ModelReply(
        call_id=f"chatcmpl-{index}",
        content=content,
        reasoning=None,
        finish=FinishReason.STOP,
        usage=Usage(input_tokens=tokens[0], output_tokens=tokens[1]),
        model="test-model-1",
    )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def live(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """The spans an attempt emitted as its calls ran, not those a resume rebuilt."""
    return [span for span in spans if not attrs(span).get("polyloop.rebuilt")]


# -- the contract -------------------------------------------------------------------------


class TestOpenTelemetrySinkContract(EventSinkContract):
    @pytest.fixture
    def event_sink(self, traced: Traced) -> OpenTelemetrySink:
        return traced.sink


async def test_parameters_say_only_the_kind(traced: Traced) -> None:
    # They are written into the start record: the same in every process.
    assert dict(traced.sink.parameters()) == {"kind": "opentelemetry"}
    assert dict(OpenTelemetrySink().parameters()) == {"kind": "opentelemetry"}


# -- the span tree --------------------------------------------------------------------------


async def test_a_run_is_one_agent_span_with_a_chat_and_a_tool_span_per_step(
    traced: Traced,
) -> None:
    script = [reply(tool_call("double", n=1), 0), reply(tool_call("submit", answer="2"), 1)]
    ledger = Ledger()
    result = await run(
        definition(MemoryStore(), script=script, events=traced.sink),
        request("r1", make_tools(ledger)),
    )
    assert result.stop_reason is StopReason.SUBMITTED and result.event_failures == 0

    (agent,) = traced.named("invoke_agent")
    chats, tools_run = traced.named("chat"), traced.named("execute_tool")
    assert [span.name for span in chats] == ["chat test-model-1"] * 2
    assert [span.name for span in tools_run] == ["execute_tool double", "execute_tool submit"]
    assert len(traced.spans()) == 5
    assert agent.kind is SpanKind.INTERNAL
    assert all(span.kind is SpanKind.CLIENT for span in chats)
    assert all(span.kind is SpanKind.INTERNAL for span in tools_run)
    for child in chats + tools_run:
        assert parent_id(child) == agent.context.span_id
        assert child.context.trace_id == agent.context.trace_id

    assert attrs(agent) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.conversation.id": "r1",
        "polyloop.run.id": "r1",
        "polyloop.run.resumed": False,
        "polyloop.run.stop_reason": "submitted",
        "polyloop.run.steps": 2,
        "polyloop.run.valid_steps": 2,
    }
    assert agent.status.status_code is StatusCode.UNSET
    first_chat = attrs(chats[0])
    assert first_chat["gen_ai.operation.name"] == "chat"
    assert first_chat["gen_ai.conversation.id"] == "r1"
    assert first_chat["gen_ai.response.model"] == "test-model-1"
    assert first_chat["gen_ai.response.id"] == "chatcmpl-0"
    assert first_chat["gen_ai.usage.input_tokens"] == 11
    assert first_chat["gen_ai.usage.output_tokens"] == 7
    assert tuple(first_chat["gen_ai.response.finish_reasons"]) == ("stop",)
    assert first_chat["polyloop.step"] == 0
    double = attrs(tools_run[0])
    assert double["gen_ai.operation.name"] == "execute_tool"
    assert double["gen_ai.tool.name"] == "double"
    assert double["gen_ai.conversation.id"] == "r1"
    assert double["polyloop.action.status"] == "executed"
    assert double["polyloop.action.result_id"] == ledger.calls[0][1]
    assert "gen_ai.tool.call.id" not in double  # not a native call
    assert tools_run[0].status.status_code is StatusCode.UNSET


async def test_a_fork_s_run_span_names_its_source_and_links_to_its_trace(
    traced: Traced,
) -> None:
    script = [reply(tool_call("double", n=1), 0), reply(tool_call("submit", answer="2"), 1)]
    store, ledger = MemoryStore(), Ledger()
    await run(definition(store, script=script), request("src", make_tools(ledger)))
    result = await fork(
        definition(store, script=script, events=traced.sink),
        request("f", make_tools(ledger)),
        source_run_id="src",
        at_step=1,
    )
    assert result.stop_reason is StopReason.SUBMITTED
    (agent,) = traced.named("invoke_agent")
    assert attrs(agent)["polyloop.run.forked_from"] == "src"
    assert attrs(agent)["polyloop.run.forked_at_step"] == 1
    assert agent.context.trace_id == run_ids("f")[0]
    [link] = agent.links
    assert (link.context.trace_id, link.context.span_id) == run_ids("src")
    assert dict(link.attributes or {}) == {"polyloop.link": "forked_from"}
    # Only the fork's own step has spans: the inherited one ran in the source.
    assert [attrs(span)["polyloop.step"] for span in traced.named("chat")] == [1]


async def test_span_times_are_the_calls_and_nest(traced: Traced) -> None:
    tools = make_tools(Ledger(), delay=0.02)
    result = await run(
        definition(MemoryStore(), script=five_step_script(), events=traced.sink),
        request("r1", tools),
    )
    assert result.stop_reason is StopReason.SUBMITTED
    (agent,) = traced.named("invoke_agent")
    assert agent.start_time is not None and agent.end_time is not None
    for child in traced.named("chat") + traced.named("execute_tool"):
        assert child.start_time is not None and child.end_time is not None
        assert agent.start_time <= child.start_time <= child.end_time <= agent.end_time
    chats = {attrs(span)["polyloop.step"]: span for span in traced.named("chat")}
    for tool in traced.named("execute_tool"):
        chat = chats[attrs(tool)["polyloop.step"]]
        assert chat.start_time is not None and tool.start_time is not None
        assert chat.start_time <= tool.start_time
    # A tool that slept 20 ms shows at least that long; its step ends when the tool does.
    slept = [
        span
        for span in traced.named("execute_tool double")
        if attrs(span)["polyloop.action.status"] == "executed"
    ]
    assert len(slept) == 2
    for span in slept:
        assert span.end_time is not None and span.start_time is not None
        assert span.end_time - span.start_time >= 15_000_000
    # A tool span ends when the tool returns, just before its step is recorded.
    steps_end = {step.step: step.at for step in result.steps}
    for tool in traced.named("execute_tool"):
        at = steps_end[attrs(tool)["polyloop.step"]]
        assert at is not None and tool.end_time is not None
        at_ns = int(at.timestamp() * 1e6) * 1000  # records keep microseconds
        assert at_ns - 100_000_000 < tool.end_time <= at_ns + 1_000


async def test_a_refused_action_is_an_error_of_its_tool_span_only(traced: Traced) -> None:
    await run(
        definition(MemoryStore(), script=five_step_script(), events=traced.sink),
        request("r1", make_tools(Ledger())),
    )
    refused = [
        span
        for span in traced.named("execute_tool")
        if attrs(span)["polyloop.action.status"] == "not_executed"
    ]
    assert len(refused) == 1
    assert refused[0].status.status_code is StatusCode.ERROR
    assert attrs(refused[0])["error.type"] == "not_executed"
    assert "Refused" in (refused[0].status.description or "")
    # The unusable reply has a chat span and no tool span.
    steps_with_tools = {attrs(span)["polyloop.step"] for span in traced.named("execute_tool")}
    assert steps_with_tools == {0, 1, 3, 4}
    assert len(traced.named("chat")) == 5
    (agent,) = traced.named("invoke_agent")
    assert agent.status.status_code is StatusCode.UNSET


# -- spans current while their call runs ---------------------------------------------------


class SpanningModel:
    """A model client that, like an instrumented HTTP client, starts a span of its own
    around each call and awaits inside it."""

    def __init__(self, traced: Traced, script: Sequence[Any]) -> None:
        self.tracer = traced.provider.get_tracer("an-http-client")
        self.inner = ScriptedModelClient(list(script))

    def parameters(self) -> Any:
        return self.inner.parameters()

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.lowlevel.checkpoint()  # the span must still be current after an await
        with self.tracer.start_as_current_span("POST /chat/completions"):
            return await self.inner.call(call)


def spanning_tools(traced: Traced, *, fail: bool = False, hang: bool = False) -> ToolRegistry:
    """``double`` and ``submit``, each starting a span of its own, as a database driver
    would; ``fail`` makes ``double`` fail inside it, ``hang`` makes it never return."""
    tracer = traced.provider.get_tracer("a-database-driver")

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.lowlevel.checkpoint()
        with tracer.start_as_current_span("SELECT double"):
            if hang:
                await anyio.sleep_forever()
            if fail:
                raise EnvironmentFault("the database is gone")
            await anyio.lowlevel.checkpoint()
            return str(arguments["n"] * 2)

    async def submit(arguments: dict[str, Any], *, result_id: str) -> str:
        with tracer.start_as_current_span("INSERT answer"):
            await anyio.lowlevel.checkpoint()
            return "accepted"

    specs = [
        ToolSpec(name=name, description=name, parameters={"type": "object"}, handler=handler)
        for name, handler in (("double", double), ("submit", submit))
    ]
    specs[1] = dataclasses.replace(specs[1], completes=True)
    return ToolRegistry(specs, max_observation_chars=1_000)


def only(spans: list[ReadableSpan], step: int) -> ReadableSpan:
    (found,) = [span for span in spans if attrs(span).get("polyloop.step") == step]
    return found


async def test_a_tool_s_own_spans_nest_under_its_execute_tool_span(traced: Traced) -> None:
    script = [tool_call("double", n=1), tool_call("submit", answer="2")]
    result = await run(
        definition(MemoryStore(), script=script, events=traced.sink),
        request("r1", spanning_tools(traced)),
    )
    assert result.stop_reason is StopReason.SUBMITTED
    (agent,) = traced.named("invoke_agent")
    for own, step in (("SELECT double", 0), ("INSERT answer", 1)):
        (inner,) = traced.named(own)
        tool = only(traced.named("execute_tool"), step)
        assert parent_id(inner) == tool.context.span_id
        assert parent_id(tool) == agent.context.span_id
        assert inner.context.trace_id == agent.context.trace_id
        assert tool.start_time is not None and inner.start_time is not None
        assert inner.end_time is not None and tool.end_time is not None
        assert tool.start_time <= inner.start_time <= inner.end_time <= tool.end_time
    # The live span still gets the record's name and attributes.
    assert attrs(only(traced.named("execute_tool submit"), 1))["polyloop.action.status"] == (
        "executed"
    )


async def test_a_model_client_s_own_spans_nest_under_its_chat_span(traced: Traced) -> None:
    script = [reply(tool_call("double", n=1), 0), reply(answer("2"), 1)]
    result = await run(
        definition(MemoryStore(), model=SpanningModel(traced, script), events=traced.sink),
        request("r1", spanning_tools(traced)),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    chats = traced.named("chat")
    posts = traced.named("POST /chat/completions")
    assert len(chats) == len(posts) == 2
    assert {parent_id(post) for post in posts} == {chat.context.span_id for chat in chats}
    assert attrs(only(chats, 0))["gen_ai.usage.input_tokens"] == 11
    # Nothing nests under a chat span but the client's own: the tool ran after it ended.
    (select,) = traced.named("SELECT double")
    assert parent_id(select) == only(traced.named("execute_tool"), 0).context.span_id


async def test_a_failing_tool_s_span_is_in_error_with_its_inner_span_under_it(
    traced: Traced,
) -> None:
    result = await run(
        definition(MemoryStore(), script=[tool_call("double", n=1)], events=traced.sink),
        request("r1", spanning_tools(traced, fail=True)),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE
    (tool,) = traced.named("execute_tool double")
    (inner,) = traced.named("SELECT double")
    assert parent_id(inner) == tool.context.span_id
    assert inner.status.status_code is StatusCode.ERROR  # the handler's exception
    assert tool.status.status_code is StatusCode.ERROR
    assert attrs(tool)["error.type"] == "env_fault"
    assert "the database is gone" in (tool.status.description or "")


async def test_a_cancelled_call_still_ends_its_span(traced: Traced) -> None:
    with anyio.move_on_after(0.2) as scope:
        await run(
            definition(MemoryStore(), script=[tool_call("double", n=1)], events=traced.sink),
            request("r1", spanning_tools(traced, hang=True)),
        )
    assert scope.cancelled_caught
    (tool,) = traced.named("execute_tool")
    (inner,) = traced.named("SELECT double")
    (agent,) = traced.named("invoke_agent")
    assert parent_id(inner) == tool.context.span_id
    assert parent_id(tool) == agent.context.span_id
    assert tool.status.status_code is StatusCode.ERROR
    assert attrs(tool)["error.type"] == "cancelled"
    assert attrs(tool)["polyloop.step"] == 0
    assert tool.end_time is not None and agent.end_time is not None
    assert tool.end_time <= agent.end_time
    assert attrs(agent)["error.type"] == "cancelled"
    assert "open_runs=0" in repr(traced.sink)


async def test_a_cancelled_model_call_still_ends_its_chat_span(traced: Traced) -> None:
    with anyio.move_on_after(0.2) as scope:
        await run(
            definition(
                MemoryStore(),
                model=ScriptedModelClient([answer("late")], delay=30.0),
                events=traced.sink,
            ),
            request("r1", make_tools(Ledger())),
        )
    assert scope.cancelled_caught
    (chat,) = traced.named("chat")
    assert chat.status.status_code is StatusCode.ERROR
    assert attrs(chat)["error.type"] == "cancelled"
    (agent,) = traced.named("invoke_agent")
    assert parent_id(chat) == agent.context.span_id


async def test_a_resumed_run_s_inner_spans_stay_in_its_one_trace(
    traced: Traced, tmp_path: Path
) -> None:
    path = tmp_path / "runs.db"
    tools = spanning_tools(traced)
    script = [tool_call("double", n=1), tool_call("double", n=2), tool_call("submit", answer="4")]
    first = SqliteStore(path)
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(first, fail_after_writes=5), script=script, events=traced.sink),
            request("r", tools),
        )
    await close_store(first)
    second = SqliteStore(path)
    try:
        result = await resume(
            definition(second, script=script, events=traced.sink), request("r", tools)
        )
    finally:
        await close_store(second)
    assert result.stop_reason is StopReason.SUBMITTED and result.resumed
    trace_id, _ = run_ids("r")
    assert {span.context.trace_id for span in traced.spans()} == {trace_id}
    crashed, resumed = sorted(traced.named("invoke_agent"), key=lambda span: span.start_time or 0)
    attempt_of = {
        attrs(tool)["polyloop.step"]: parent_id(tool) for tool in live(traced.named("execute_tool"))
    }
    assert attempt_of[0] == crashed.context.span_id
    assert attempt_of[2] == resumed.context.span_id
    tools_by_id = {tool.context.span_id for tool in traced.named("execute_tool")}
    inner = traced.named("SELECT double") + traced.named("INSERT answer")
    assert len(inner) >= 3
    assert all(parent_id(span) in tools_by_id for span in inner)


# -- failures and unusual ends ------------------------------------------------------------


async def test_a_model_failure_ends_the_run_span_in_error(traced: Traced) -> None:
    script: list[Any] = [tool_call("double", n=1), ConnectionError("the server went away")]
    result = await run(
        definition(MemoryStore(), script=script, events=traced.sink),
        request("r1", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    (agent,) = traced.named("invoke_agent")
    assert agent.status.status_code is StatusCode.ERROR
    assert "the server went away" in (agent.status.description or "")
    assert attrs(agent)["error.type"] == "model_failure"
    failed_chat = next(span for span in traced.named("chat") if attrs(span)["polyloop.step"] == 1)
    assert failed_chat.status.status_code is StatusCode.ERROR
    assert attrs(failed_chat)["error.type"] == "ConnectionError"


async def test_an_environment_failure_ends_the_run_span_in_error(traced: Traced) -> None:
    async def broken(arguments: dict[str, Any], *, result_id: str) -> str:
        raise EnvironmentFault("the sandbox is gone")

    tools = ToolRegistry(
        [
            ToolSpec(
                name="probe",
                description="Probe the sandbox.",
                parameters={"type": "object"},
                handler=broken,
                replay=Replay.NEVER,
            )
        ],
        max_observation_chars=1_000,
    )
    result = await run(
        definition(MemoryStore(), script=[tool_call("probe")], events=traced.sink),
        request("r1", tools),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE
    (agent,) = traced.named("invoke_agent")
    assert agent.status.status_code is StatusCode.ERROR
    assert attrs(agent)["error.type"] == "env_failure"
    (probe,) = traced.named("execute_tool probe")
    assert probe.status.status_code is StatusCode.ERROR
    assert attrs(probe)["error.type"] == "env_fault"
    assert "the sandbox is gone" in (probe.status.description or "")


async def test_a_cancelled_run_says_so_on_its_span(traced: Traced) -> None:
    tools = make_tools(Ledger(), delay=30.0)
    with anyio.move_on_after(0.3) as scope:
        await run(
            definition(MemoryStore(), script=[tool_call("double", n=1)], events=traced.sink),
            request("r1", tools),
        )
    assert scope.cancelled_caught
    (agent,) = traced.named("invoke_agent")
    assert attrs(agent)["polyloop.run.stop_reason"] == "cancelled"
    assert attrs(agent)["error.type"] == "cancelled"
    assert agent.status.status_code is StatusCode.ERROR


class FailingExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        raise OSError("the collector is down")

    def shutdown(self) -> None:
        return None


class FailingProcessor(SpanProcessor):
    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("a broken span processor")


@pytest.mark.parametrize("broken", ["exporter", "processor"])
async def test_a_failing_exporter_or_processor_does_not_disturb_the_run(
    broken: str, caplog: pytest.LogCaptureFixture
) -> None:
    provider = TracerProvider()
    if broken == "exporter":
        provider.add_span_processor(SimpleSpanProcessor(FailingExporter()))
    else:
        provider.add_span_processor(FailingProcessor())
    try:
        result = await run(
            definition(
                MemoryStore(),
                script=five_step_script(),
                events=OpenTelemetrySink(tracer_provider=provider),
            ),
            request("r1", make_tools(Ledger())),
        )
    finally:
        provider.shutdown()
    assert result.stop_reason is StopReason.SUBMITTED
    assert result.step_count == 5
    assert result.event_failures == 0
    assert any(record.exc_info for record in caplog.records)


# -- attempts of one run, and the caller's span --------------------------------------------


async def _crash_on_sqlite(path: Path, tools: ToolRegistry, writes: int, events: EventSink) -> None:
    """Run "r" on the SQLite file until a simulated crash after ``writes`` writes.

    The crashed store object is closed, as the death of its process would close it.
    """
    first = SqliteStore(path)
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(first, fail_after_writes=writes),
                script=five_step_script(),
                events=events,
            ),
            request("r", tools),
        )
    await close_store(first)


async def _resume_on_sqlite(path: Path, tools: ToolRegistry, events: EventSink) -> RunResult:
    """Resume "r" on a new store object over the same SQLite file, closed after."""
    second = SqliteStore(path)
    try:
        return await resume(
            definition(second, script=five_step_script(), events=events), request("r", tools)
        )
    finally:
        await close_store(second)


async def _crashed_and_resumed(traced: Traced, tmp_path: Path) -> RunResult:
    """Run "r" on SQLite, crash it after 5 writes, resume it: both attempts traced."""
    path = tmp_path / "runs.db"
    tools = make_tools(Ledger())
    await _crash_on_sqlite(path, tools, 5, traced.sink)
    return await _resume_on_sqlite(path, tools, traced.sink)


async def test_a_crashed_and_resumed_run_is_one_trace_and_the_resume_links_to_it(
    traced: Traced, tmp_path: Path
) -> None:
    result = await _crashed_and_resumed(traced, tmp_path)
    assert result.stop_reason is StopReason.SUBMITTED and result.resumed

    crashed, resumed = sorted(traced.named("invoke_agent"), key=lambda span: span.start_time or 0)
    trace_id, span_id = run_ids("r")
    for span in (crashed, resumed):
        assert span.context.trace_id == trace_id
        assert parent_id(span) == span_id
        assert span.parent is not None and span.parent.is_remote
    # The crashed attempt never ended through the library; the resume ended it.
    assert attrs(crashed)["polyloop.run.abandoned"] is True
    assert crashed.status.status_code is StatusCode.ERROR
    assert attrs(resumed)["polyloop.run.resumed"] is True
    assert attrs(resumed)["polyloop.run.stop_reason"] == "submitted"
    assert not crashed.links
    (link,) = resumed.links
    assert (link.context.trace_id, link.context.span_id) == (trace_id, span_id)
    assert dict(link.attributes or {}) == {"polyloop.link": "continues"}
    # Steps land under the attempt that took them.
    by_parent = {crashed.context.span_id: set(), resumed.context.span_id: set()}
    for span in live(traced.named("chat")):
        by_parent[parent_id(span)].add(attrs(span)["polyloop.step"])
    assert by_parent[crashed.context.span_id] == {0}
    assert by_parent[resumed.context.span_id] == {1, 2, 3, 4}
    assert {attrs(span).get("polyloop.step.resumed") for span in live(traced.named("chat"))} == {
        None,
        True,
    }
    # Though step 0's spans were exported, the resume rebuilt them all the same.
    again = [span for span in traced.named("chat") if attrs(span).get("polyloop.rebuilt")]
    assert [attrs(span)["polyloop.step"] for span in again] == [0]
    assert [parent_id(span) for span in again] == [span_id]


async def test_attempts_in_two_processes_meet_in_one_trace(tmp_path: Path) -> None:
    """Two sinks on two providers stand for two processes: the same trace all the same."""
    path = tmp_path / "runs.db"
    tools = make_tools(Ledger())
    before, after = Traced(), Traced()
    await _crash_on_sqlite(path, tools, 5, before.sink)
    assert before.named("invoke_agent") == []  # still open: the run raised
    before.sink.close()
    before.sink.close()  # a second close finds nothing left to end
    try:
        await _resume_on_sqlite(path, tools, after.sink)
    finally:
        before.provider.shutdown()
        after.provider.shutdown()
    (crashed,) = before.named("invoke_agent")
    (resumed,) = after.named("invoke_agent")
    assert attrs(crashed)["error.type"] == "abandoned"
    assert crashed.context.trace_id == resumed.context.trace_id == run_ids("r")[0]
    assert parent_id(crashed) == parent_id(resumed) == run_ids("r")[1]


async def test_run_trace_id_is_the_trace_of_every_span_the_sink_emits(
    traced: Traced, tmp_path: Path
) -> None:
    """Both attempts of a crashed and resumed run, and each of their step spans."""
    await _crashed_and_resumed(traced, tmp_path)
    spans = traced.spans()
    assert len(traced.named("invoke_agent")) == 2 and len(spans) > 2
    assert {format(span.context.trace_id, "032x") for span in spans} == {run_trace_id("r")}
    # As the docs derive it, and in the form tracing tools show.
    assert run_trace_id("r") == f"{run_ids('r')[0]:032x}"
    assert re.fullmatch(r"[0-9a-f]{32}", run_trace_id("r"))
    assert run_trace_id("r") != run_trace_id("r2")


async def test_a_run_whose_id_holds_a_lone_surrogate_is_traced_and_exportable(
    traced: Traced,
) -> None:
    """Half an emoji in the run id and in a tool's failure: the run is traced under
    :func:`run_trace_id`, and every span still encodes for OTLP, the surrogate escaped."""

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.lowlevel.checkpoint()
        raise EnvironmentFault(f"gone {HALF}")

    spec = ToolSpec(name="double", description="d", parameters={"type": "object"}, handler=double)
    result = await run(
        definition(MemoryStore(), script=[tool_call("double", n=1)], events=traced.sink),
        request(HALF_RUN_ID, ToolRegistry([spec], max_observation_chars=1_000)),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE and result.event_failures == 0
    (agent,), (tool,) = traced.named("invoke_agent"), traced.named("execute_tool")
    assert len(traced.named("chat")) == 1
    spans = traced.spans()
    assert {format(span.context.trace_id, "032x") for span in spans} == {run_trace_id(HALF_RUN_ID)}
    assert attrs(agent)["polyloop.run.id"] == attrs(tool)["gen_ai.conversation.id"] == "id \\ud83d"
    assert tool.status.description is not None
    assert tool.status.description.endswith("gone \\ud83d")
    assert agent.status.description is not None and "gone \\ud83d" in agent.status.description
    # What the OTLP exporters send: protobuf refuses strings UTF-8 cannot encode.
    assert encode_spans(spans).SerializeToString()


async def test_an_in_doubt_resume_is_marked(traced: Traced, tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    tools = make_tools(Ledger(), replay=Replay.NEVER)
    # Write 4 is the action intent of step 0: a crash right after leaves it open. The
    # crashed attempt has another sink object of the same kind, as another process would.
    await _crash_on_sqlite(path, tools, 4, OpenTelemetrySink(tracer_provider=TracerProvider()))
    result = await _resume_on_sqlite(path, tools, traced.sink)
    assert result.stop_reason is StopReason.IN_DOUBT
    (agent,) = traced.named("invoke_agent")
    assert attrs(agent)["polyloop.run.in_doubt"] is True
    assert attrs(agent)["error.type"] == "in_doubt"
    assert agent.status.status_code is StatusCode.ERROR


async def test_the_callers_current_span_is_the_parent(traced: Traced) -> None:
    tracer = traced.provider.get_tracer("the-caller")
    with tracer.start_as_current_span("handle request") as outer:
        await run(
            definition(MemoryStore(), script=five_step_script(), events=traced.sink),
            request("r1", make_tools(Ledger())),
        )
    (agent,) = traced.named("invoke_agent")
    assert agent.context.trace_id == outer.get_span_context().trace_id
    assert parent_id(agent) == outer.get_span_context().span_id
    (link,) = agent.links
    assert (link.context.trace_id, link.context.span_id) == run_ids("r1")
    for child in traced.named("chat"):
        assert parent_id(child) == agent.context.span_id


async def test_close_ends_the_span_of_a_run_that_raised(traced: Traced) -> None:
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(MemoryStore(), fail_after_writes=6),
                script=five_step_script(),
                events=traced.sink,
            ),
            request("r1", make_tools(Ledger())),
        )
    assert "open_runs=1" in repr(traced.sink)
    traced.sink.close()
    assert "open_runs=0" in repr(traced.sink)
    (agent,) = traced.named("invoke_agent")
    assert attrs(agent)["polyloop.run.abandoned"] is True
    assert agent.end_time is not None
    for child in traced.named("chat"):
        assert child.end_time is not None and child.end_time <= agent.end_time
    # Step 1's model call returned, and its result never landed: its span ends with the run.
    unrecorded = only(traced.named("chat"), 1)
    assert attrs(unrecorded)["error.type"] == "abandoned"
    assert unrecorded.status.status_code is StatusCode.ERROR


async def _crash_in_memory(sink: OpenTelemetrySink, ledger: Ledger) -> None:
    """Run "r1" until the store fails after step 0's tool really ran and was recorded."""
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(MemoryStore(), fail_after_writes=6),
                script=five_step_script(),
                events=sink,
            ),
            request("r1", make_tools(ledger)),
        )
    assert len(ledger.calls) == 1  # step 0's double ran


@pytest.mark.parametrize("flush", ["force_flush", "shutdown"])
async def test_a_batch_processor_holds_a_crashed_attempt_s_spans_until_flushed(
    flush: str,
) -> None:
    """What a killed process loses with a batch processor, and the flush at exit (either
    call) that keeps it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    # A delay no test reaches: only a flush sends the batch, as in a process killed early.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    sink = OpenTelemetrySink(tracer_provider=provider)
    try:
        await _crash_in_memory(sink, Ledger())
        # Killed now, the process would take these spans with it: none was exported.
        assert exporter.get_finished_spans() == ()
        sink.close()
        if flush == "force_flush":
            assert provider.force_flush()
        else:
            provider.shutdown()
        spans = exporter.get_finished_spans()
    finally:
        provider.shutdown()
    (tool,) = [span for span in spans if span.name.startswith("execute_tool")]
    assert tool.name == "execute_tool double" and attrs(tool)["polyloop.step"] == 0
    (agent,) = [span for span in spans if span.name == "invoke_agent"]
    assert attrs(agent)["polyloop.run.abandoned"] is True


async def test_a_simple_processor_has_sent_each_step_s_spans_before_a_crash(
    traced: Traced,
) -> None:
    await _crash_in_memory(traced.sink, Ledger())
    # Nothing was closed or flushed: a process killed here has lost no finished step.
    (tool,) = traced.named("execute_tool")
    assert tool.name == "execute_tool double" and attrs(tool)["polyloop.step"] == 0
    assert [attrs(span)["polyloop.step"] for span in traced.named("chat")] == [0]


# -- spans rebuilt from the log on resume -------------------------------------------------


def record_ns(at: datetime | None) -> int:
    """A record's time in nanoseconds since the epoch, exactly."""
    assert at is not None
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) * 1000


def rebuilt(spans: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    return [span for span in spans if attrs(span).get("polyloop.rebuilt") is True]


async def _read_log_on_sqlite(path: Path) -> tuple[Record, ...]:
    store = SqliteStore(path)
    try:
        return (await store.read_log("r")).records
    finally:
        await close_store(store)


def _lossy_sink() -> tuple[OpenTelemetrySink, TracerProvider, InMemorySpanExporter]:
    """A sink whose batch processor exports nothing until flushed: a process killed
    before then loses every span it emitted."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    return OpenTelemetrySink(tracer_provider=provider), provider, exporter


async def test_a_resume_rebuilds_the_spans_a_crashed_attempt_never_exported(
    traced: Traced, tmp_path: Path
) -> None:
    path, ledger = tmp_path / "runs.db", Ledger()
    tools = make_tools(ledger)
    lossy, lossy_provider, lost = _lossy_sink()
    try:
        # Steps 0 (a tool that ran), 1 (a call the schema refused) and 2 (not JSON) land.
        await _crash_on_sqlite(path, tools, 12, lossy)
        assert lost.get_finished_spans() == ()  # the process dies here with its spans
        logged = [r for r in await _read_log_on_sqlite(path) if isinstance(r, StepRecord)]
        assert [step.step for step in logged] == [0, 1, 2]
        assert ledger.calls == [("double", "r:0:action")]
        result = await _resume_on_sqlite(path, tools, traced.sink)
        # What the crashed attempt would have exported, to compare the rebuilt spans with.
        lossy.close()
        assert lossy_provider.force_flush()
        crashed = [span for span in lost.get_finished_spans() if span.name != "invoke_agent"]
    finally:
        lossy_provider.shutdown()
    assert result.stop_reason is StopReason.SUBMITTED

    again = rebuilt(traced.spans())
    trace_id, parent = run_ids("r")
    # Exactly the logged steps, in log order, each shaped as its live span was.
    assert [(attrs(s)["polyloop.step"], s.name) for s in again] == [
        (0, "chat"),
        (0, "execute_tool double"),
        (1, "chat"),
        (1, "execute_tool double"),
        (2, "chat"),
    ]
    assert [(s.name, {**attrs(s), "polyloop.rebuilt": True}, s.kind) for s in crashed] == [
        (s.name, attrs(s), s.kind) for s in again
    ]
    for span in again:
        assert span.context.trace_id == trace_id and parent_id(span) == parent
        assert span.parent is not None and span.parent.is_remote
    # At the times the records hold.
    for step in logged:
        chat, *tool = [span for span in again if attrs(span)["polyloop.step"] == step.step]
        assert step.duration_s is not None and step.model_duration_s is not None
        assert chat.start_time == record_ns(step.at) - round(step.duration_s * 1e9)
        assert chat.end_time == chat.start_time + round(step.model_duration_s * 1e9)
        for span in tool:
            assert span.end_time == record_ns(step.at)
    ran, refused = [span for span in again if span.name.startswith("execute_tool")]
    assert attrs(ran)["polyloop.action.status"] == "executed"
    assert attrs(ran)["polyloop.action.result_id"] == "r:0:action"
    assert ran.status.status_code is StatusCode.UNSET
    assert attrs(refused)["error.type"] == "not_executed"
    # The resumed attempt's own spans are not marked, and start at step 3.
    assert sorted(attrs(s)["polyloop.step"] for s in live(traced.named("chat"))) == [3, 4]


async def test_a_rebuilt_action_in_doubt_is_not_reported_as_a_success(
    traced: Traced, tmp_path: Path
) -> None:
    path, ledger = tmp_path / "runs.db", Ledger()
    tools = make_tools(ledger, replay=Replay.NEVER)
    script = [tool_call("double", n=1), tool_call("double", n=3), tool_call("submit", answer="6")]
    lossy, lossy_provider, lost = _lossy_sink()
    first = SqliteStore(path)
    try:
        # Write 8 is step 1's action intent: the tool runs, its result never lands.
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(first, fail_after_writes=8), script=script, events=lossy),
                request("r", tools),
            )
        await close_store(first)
        assert lost.get_finished_spans() == ()
        second = SqliteStore(path)
        try:
            result = await resume(
                definition(second, script=script, events=traced.sink), request("r", tools)
            )
        finally:
            await close_store(second)
    finally:
        lossy_provider.shutdown()
    assert result.stop_reason is StopReason.IN_DOUBT
    assert ledger.calls == [("double", "r:0:action"), ("double", "r:1:action")]
    intent = next(
        r
        for r in await _read_log_on_sqlite(path)
        if isinstance(r, Intent) and r.result_id == "r:1:action"
    )
    again = rebuilt(traced.spans())
    assert [(attrs(s)["polyloop.step"], s.name) for s in again] == [
        (0, "chat"),
        (0, "execute_tool double"),
        (1, "execute_tool double"),
    ]
    doubt = again[-1]
    assert attrs(doubt)["polyloop.action.in_doubt"] is True
    assert attrs(doubt)["polyloop.action.result_id"] == "r:1:action"
    assert "polyloop.action.status" not in attrs(doubt)
    assert "error.type" not in attrs(doubt)
    assert doubt.status.status_code is StatusCode.UNSET
    assert doubt.start_time == doubt.end_time == record_ns(intent.at)
    assert parent_id(doubt) == run_ids("r")[1]
    assert attrs(again[1])["polyloop.action.status"] == "executed"
    assert "polyloop.action.in_doubt" not in attrs(again[1])


async def test_a_sink_told_not_to_rebuild_emits_only_the_resumed_attempt(
    traced: Traced, tmp_path: Path
) -> None:
    path = tmp_path / "runs.db"
    tools = make_tools(Ledger())
    await _crash_on_sqlite(path, tools, 12, OpenTelemetrySink(tracer_provider=TracerProvider()))
    sink = OpenTelemetrySink(tracer_provider=traced.provider, rebuild_logged_steps=False)
    result = await _resume_on_sqlite(path, tools, sink)
    assert result.stop_reason is StopReason.SUBMITTED
    assert rebuilt(traced.spans()) == []
    assert sorted(attrs(s)["polyloop.step"] for s in traced.named("chat")) == [3, 4]
    (agent,) = traced.named("invoke_agent")
    assert {parent_id(span) for span in traced.named("chat")} == {agent.context.span_id}


async def test_a_long_log_is_rebuilt_in_turns_and_a_cancelled_rebuild_stops(
    traced: Traced,
) -> None:
    """The rebuild gives other tasks a turn every 200 logged steps: cancelled, it stops
    there."""
    store = MemoryStore()
    await store.claim_run("r")
    for method, args in sample_run("r", steps=1_000, ended=False):
        await getattr(store, method)(*args)
    logged = (await store.read_log("r")).records
    started = logged[0]
    assert isinstance(started, RunStarted)
    event = Event(kind=EventKind.RUN_RESUMED, run_id="r", step=None, record=started, logged=logged)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await traced.sink.emit(event)
    assert scope.cancelled_caught
    assert [attrs(s)["polyloop.step"] for s in traced.named("chat")] == list(range(200))
    assert {attrs(s)["polyloop.step"] for s in rebuilt(traced.spans())} == set(range(200))
    traced.sink.close()  # the attempt span was opened before the rebuild began
    assert len(traced.named("invoke_agent")) == 1


async def test_native_tool_calls_carry_their_call_id(traced: Traced) -> None:
    result = await run(
        definition(
            MemoryStore(), script=native_script(), interpreter=INTERPRETER, events=traced.sink
        ),
        request("r1", make_tools(Ledger()), **NATIVE),
    )
    assert result.stop_reason is StopReason.SUBMITTED
    called = {
        attrs(span)["gen_ai.tool.call.id"]: span.name for span in traced.named("execute_tool")
    }
    assert called == {
        "c0": "execute_tool double",
        "c1": "execute_tool double",
        "c3": "execute_tool double",
        "c4": "execute_tool submit",
    }


# -- a real OTLP receiver -------------------------------------------------------------------


class Receiver(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        if self.path == "/v1/traces":
            self.server.received.append(message)  # type: ignore[attr-defined]
        answer_body = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer_body)))
        self.end_headers()
        self.wfile.write(answer_body)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[str, list[ExportTraceServiceRequest]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}/v1/traces", server.received  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_spans_reach_an_otlp_receiver(
    otlp_receiver: tuple[str, list[ExportTraceServiceRequest]],
) -> None:
    endpoint, received = otlp_receiver
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    script = [reply(tool_call("double", n=1), 0), reply(answer("2"), 1, tokens=(5, 3))]
    try:
        result = await run(
            definition(
                MemoryStore(),
                model=ScriptedModelClient(script),
                events=OpenTelemetrySink(tracer_provider=provider),
            ),
            request("otlp-run", make_tools(Ledger())),
        )
    finally:
        await anyio.to_thread.run_sync(provider.shutdown)  # flushes the batch
    assert result.stop_reason is StopReason.FINAL_ANSWER

    spans = [
        span
        for message in received
        for resource in message.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = sorted(span.name for span in spans)
    assert names == [
        "chat test-model-1",
        "chat test-model-1",
        "execute_tool double",
        "invoke_agent",
    ]

    def values(span: Any) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for item in span.attributes:
            kind = item.value.WhichOneof("value")
            value = getattr(item.value, kind)
            found[item.key] = list(value.values) if kind == "array_value" else value
        return found

    by_name = {span.name: values(span) for span in spans}
    agent = by_name["invoke_agent"]
    assert agent["gen_ai.conversation.id"] == "otlp-run"
    assert agent["polyloop.run.stop_reason"] == "final_answer"
    tool = by_name["execute_tool double"]
    assert tool["gen_ai.tool.name"] == "double"
    assert tool["polyloop.action.result_id"]
    chats = [values(span) for span in spans if span.name.startswith("chat")]
    assert sorted(chat["gen_ai.usage.input_tokens"] for chat in chats) == [5, 11]
    trace_ids = {span.trace_id for span in spans}
    assert trace_ids == {run_ids("otlp-run")[0].to_bytes(16, "big")}


# -- an action in doubt, settled ----------------------------------------------------------------

# Write 8 is step 1's action intent, the payment: a crash right after leaves it open.
PAY_INTENT = 8


async def _pay_attempt(
    store: Any, payments: Payments, events: EventSink, *, crashes: bool = False
) -> None:
    """One attempt at the payment run "r": a first run, or a resume if the log has one."""
    go = (
        definition(store, script=payment_script(), events=events),
        request("r", tools(payments), model_replay=Replay.ALLOWED),
    )
    started = bool((await store.read_log("r")).records)
    if crashes:
        with pytest.raises(SimulatedCrash):
            await (resume(*go) if started else run(*go))
    else:
        await (resume(*go) if started else run(*go))


def settled_events(spans: Sequence[ReadableSpan]) -> list[tuple[ReadableSpan, dict[str, Any]]]:
    """Each ``polyloop.settled`` event, with the span that carries it."""
    return [
        (span, dict(event.attributes or {}))
        for span in spans
        for event in span.events
        if event.name == "polyloop.settled"
    ]


@pytest.mark.parametrize("reachable", [True, False])
async def test_a_probe_s_settlement_is_an_event_on_the_step_s_tool_span(
    traced: Traced, reachable: bool
) -> None:
    store, payments = MemoryStore(), Payments(reachable=reachable)
    quiet = OpenTelemetrySink(tracer_provider=TracerProvider())
    await _pay_attempt(
        FaultyStore(store, fail_after_writes=PAY_INTENT), payments, quiet, crashes=True
    )
    await _pay_attempt(store, payments, traced.sink)
    ((span, event),) = settled_events(traced.spans())
    assert span.name == "execute_tool pay" and not attrs(span).get("polyloop.rebuilt")
    assert attrs(span)["polyloop.step"] == 1
    assert attrs(span)["polyloop.action.result_id"] == "r:1:action"
    assert event.pop("polyloop.probe.duration_s") > 0
    assert event == {
        "polyloop.settled_by": "reconcile:pay",
        "polyloop.settled.ran": reachable,
        "polyloop.settled.by_probe": True,
    }
    (at,) = [e.timestamp for e in span.events]
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= at <= span.end_time
    # Settled before the resumed attempt went on: no span calls the payment in doubt.
    assert not [s for s in traced.spans() if attrs(s).get("polyloop.action.in_doubt")]


async def test_a_person_s_settlement_is_the_same_event_without_a_probe(traced: Traced) -> None:
    store, payments = MemoryStore(), Payments()
    quiet = OpenTelemetrySink(tracer_provider=TracerProvider())
    ledger_only = Payments()  # no probe asked: the run ends in doubt, a person answers
    await _pay_attempt(
        FaultyStore(store, fail_after_writes=PAY_INTENT), payments, quiet, crashes=True
    )
    await settle(store, "r", by="carol", ran=False, observation="declined")
    await _pay_attempt(store, ledger_only, traced.sink)
    assert ledger_only.tombstones == set()  # the person's answer stood: the probe was not asked
    ((span, event),) = settled_events(traced.spans())
    assert span.name == "execute_tool pay"
    assert event == {
        "polyloop.settled_by": "carol",
        "polyloop.settled.ran": False,
        "polyloop.settled.by_probe": False,
    }


async def test_a_rebuilt_settled_step_carries_the_event_too(traced: Traced) -> None:
    store, payments = MemoryStore(), Payments()
    quiet = OpenTelemetrySink(tracer_provider=TracerProvider())
    await _pay_attempt(
        FaultyStore(store, fail_after_writes=PAY_INTENT), payments, quiet, crashes=True
    )
    # The resume writes the settlement, then step 1's record, and dies.
    await _pay_attempt(FaultyStore(store, fail_after_writes=2), payments, quiet, crashes=True)
    steps = [r for r in (await store.read_log("r")).records if isinstance(r, StepRecord)]
    assert [step.settled_by for step in steps] == [None, "reconcile:pay"]
    await _pay_attempt(store, payments, traced.sink)
    ((span, event),) = settled_events(traced.spans())
    assert span.name == "execute_tool pay" and attrs(span)["polyloop.rebuilt"] is True
    assert event["polyloop.settled_by"] == "reconcile:pay" and event["polyloop.settled.ran"]
    assert event["polyloop.probe.duration_s"] > 0
    assert len(payments.paid()) == 1


async def test_an_amendment_is_an_instant_span_in_the_run_s_trace(traced: Traced) -> None:
    store, ledger = MemoryStore(), Ledger()
    first = request("r", review_tools(ledger))
    waiting = await run(definition(store, script=approval_script()), first)
    assert waiting.stop_reason is StopReason.AWAITING_APPROVAL
    defined = definition(store, script=approval_script(), events=traced.sink)
    await resume(defined, deployed_request(ledger), amend=DEPLOY_FIX)
    (span,) = traced.named("amend_agent")
    (amended,) = [r for r in (await store.read_log("r")).records if isinstance(r, Amended)]
    assert span.context.trace_id == run_ids("r")[0]
    assert span.start_time == span.end_time
    assert attrs(span) == {
        "gen_ai.operation.name": "amend_agent",
        "gen_ai.conversation.id": "r",
        "polyloop.run.id": "r",
        "polyloop.step": amended.step,
        "polyloop.amended_by": DEPLOY_FIX.by,
        "polyloop.amended.reason": DEPLOY_FIX.reason,
        "polyloop.amended.keys": ("run_context.sha256", "tools"),
    }
