"""Native tool calls through the OpenAI-compatible adapter, against a loopback server, under
asyncio and Trio: the tools go out in the API's form with one call per step asked for,
calls come back with their arguments as text, as an object or malformed, and the history
goes back as assistant tool calls and tool messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from chat_shapes import BodyServer, openai_body

from kit.agent import Ledger, definition, make_tools, request
from kit.backends import BOTH_BACKENDS, TRIO_SLOW
from kit.openai_example import load_example
from polyloop import DecisionKind, FinishReason, Result, StopReason, ToolStyle, run
from polyloop.adapters.openai import OpenAIModelClient
from polyloop.interpreters import NativeToolCallInterpreter
from polyloop.stores import MemoryStore

pytestmark = pytest.mark.anyio


# The adapter maps a reply alike under either backend: only a whole run goes under Trio in
# the quick run (kit.backends).
@pytest.fixture(params=TRIO_SLOW)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


MODEL = "test-model"


@pytest.fixture
def server() -> Iterator[BodyServer]:
    loopback = BodyServer()
    loopback.start()
    try:
        yield loopback
    finally:
        loopback.close()


def calls_body(*calls: tuple[str, str, Any], content: str | None = None) -> dict[str, Any]:
    """A completion whose message makes the given (id, name, arguments) calls."""
    body = openai_body(content, finish_reason="tool_calls")
    body["choices"][0]["message"]["tool_calls"] = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, name, arguments in calls
    ]
    return body


async def native_run(
    server: BodyServer,
    ledger: Ledger,
    *,
    store: MemoryStore | None = None,
    answer_in_text: bool = False,
) -> Any:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={}, send_binding=False)
        return await run(
            definition(
                store or MemoryStore(),
                model=adapter,
                interpreter=NativeToolCallInterpreter(answer_in_text=answer_in_text),
            ),
            request("r", make_tools(ledger), tool_style=ToolStyle.NATIVE),
        )


@BOTH_BACKENDS
async def test_a_native_run_submits_through_a_tool_and_sends_the_history_back(
    server: BodyServer,
) -> None:
    server.respond(
        calls_body(("call_a", "double", '{"n": 1}'), content="Doubling one."),
        calls_body(("call_b", "submit", {"answer": "2"})),  # an object, as some servers send
    )
    ledger = Ledger()
    result = await native_run(server, ledger)
    assert result.stop_reason is StopReason.SUBMITTED, result.detail
    assert [rid for _, rid in ledger.calls] == ["r:0:action", "r:1:action"]
    first, second = server.requests
    assert [tool["function"]["name"] for tool in first["tools"]] == ["double", "submit"]
    assert first["tools"][0]["type"] == "function"
    assert first["parallel_tool_calls"] is False
    assert not any("submit" in str(m.get("content")) for m in first["messages"][:1])
    assistant, tool = second["messages"][-2:]
    assert assistant == {
        "role": "assistant",
        "content": "Doubling one.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "double", "arguments": '{"n":1}'},
            }
        ],
    }
    assert tool["role"] == "tool" and tool["tool_call_id"] == "call_a"
    assert "2" in tool["content"]


@pytest.mark.parametrize(
    ("calls", "says"),
    [
        ((("x", "double", '{"n": 1}'), ("y", "submit", '{"answer": "2"}')), "called 2 tools"),
        ((("x", "double", '{"n": 1'),), "are not valid JSON"),
        ((("x", "double", "[1, 2]"),), "are a JSON list, not an object"),
    ],
)
async def test_a_reply_the_loop_cannot_run_is_an_invalid_step_not_a_crash(
    server: BodyServer, calls: tuple[tuple[str, str, Any], ...], says: str
) -> None:
    server.respond(calls_body(*calls), calls_body(("z", "submit", '{"answer": "2"}')))
    ledger = Ledger()
    result = await native_run(server, ledger)
    first = result.steps[0]
    assert first.decision is DecisionKind.INVALID
    assert first.observation is not None and says in first.observation
    assert [rid for _, rid in ledger.calls] == ["r:1:action"]  # only the submit ran
    # The refused calls are not in the history sent next: the API would want answers.
    assert "tool_calls" not in server.requests[1]["messages"][-2]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ('{"n": 1e400}', "hold a number too large"),
        ('{"n": -2E+999}', "hold a number too large"),
        ('{"n": ' + "[" * 300 + "]" * 300 + "}", "nesting too deep"),
        ('{"n": ' + "[" * 2000 + "]" * 2000 + "}", "nesting too deep"),
        ('{"n": ' + "9" * 5000 + "}", "hold a number too large"),
        ('{"n": NaN}', "are not valid JSON"),
        ({"n": float("inf")}, "are not valid JSON"),  # an object, sent as Infinity
    ],
)
async def test_arguments_the_log_cannot_hold_are_refused_and_the_reply_is_recorded(
    server: BodyServer, arguments: Any, says: str
) -> None:
    server.respond(
        calls_body(("x", "double", arguments), content="Doubling."),
        calls_body(("z", "submit", '{"answer": "2"}')),
    )
    store, ledger = MemoryStore(), Ledger()
    result = await native_run(server, ledger, store=store)
    assert result.stop_reason is StopReason.SUBMITTED, result.detail
    first = result.steps[0]
    assert first.decision is DecisionKind.INVALID
    assert first.observation is not None and says in first.observation
    assert (first.model_output, first.finish) == ("Doubling.", FinishReason.TOOL_CALLS)
    assert first.usage is not None and first.usage.input_tokens == 42
    assert [rid for _, rid in ledger.calls] == ["r:1:action"]
    # The model result holds the call, its arguments as the text they came as.
    [reply] = [
        record.payload
        for record in (await store.read_log("r")).records
        if isinstance(record, Result) and record.result_id == "r:0:model"
    ]
    assert isinstance(reply, dict) and isinstance(reply["tool_calls"], list)
    [recorded] = reply["tool_calls"]
    assert isinstance(recorded, dict) and recorded["name"] == "double"
    assert isinstance(recorded["arguments"], str)
    if isinstance(arguments, str):
        assert recorded["arguments"] == arguments


async def test_arguments_with_a_lone_surrogate_run_and_go_back_escaped(
    server: BodyServer,
) -> None:
    server.respond(
        calls_body(("x", "double", '{"n": 1, "note": "\\ud800"}')),
        calls_body(("z", "submit", '{"answer": "2"}')),
    )
    result = await native_run(server, Ledger())
    assert result.stop_reason is StopReason.SUBMITTED, result.detail
    assert result.steps[0].decision is DecisionKind.ACTION
    sent = server.requests[1]["messages"][-2]["tool_calls"][0]["function"]["arguments"]
    assert sent == '{"n":1,"note":"\\ud800"}'


async def test_a_reply_text_with_a_lone_surrogate_goes_back_escaped(server: BodyServer) -> None:
    """Half an emoji in the model's text (a JSON escape a server can send) is recorded as
    sent; the next request carries it escaped, since UTF-8 cannot."""
    server.respond(
        calls_body(("x", "double", '{"n": 1}'), content="Doubling \ud83d"),
        calls_body(("z", "submit", '{"answer": "2"}')),
    )
    result = await native_run(server, Ledger())
    assert result.stop_reason is StopReason.SUBMITTED, result.detail
    assert result.steps[0].model_output == "Doubling \ud83d"
    assert server.requests[1]["messages"][-2]["content"] == "Doubling \\ud83d"


@pytest.mark.parametrize("calls", [[], {}, "call", None])
async def test_a_reply_that_ends_in_a_call_but_carries_none_asks_for_the_call_again(
    server: BodyServer, calls: Any
) -> None:
    preamble = calls_body(content="Let me look that up.")
    preamble["choices"][0]["message"]["tool_calls"] = calls
    server.respond(preamble, calls_body(("z", "submit", '{"answer": "2"}')))
    result = await native_run(server, Ledger(), answer_in_text=True)
    assert result.stop_reason is StopReason.SUBMITTED, result.detail
    first = result.steps[0]
    assert first.decision is DecisionKind.INVALID
    assert first.observation is not None and "no call came through" in first.observation
    # Not the preamble as the answer: the run went on to the call asked for.
    assert result.steps[1].decision is DecisionKind.ACTION


async def test_a_call_without_arguments_or_an_id_still_runs(server: BodyServer) -> None:
    body = calls_body(("", "submit", ""))
    server.respond(body)
    result = await native_run(server, Ledger())
    # submit's schema asks for an answer: the empty arguments are refused by the registry.
    assert result.steps[0].tool_call is not None
    assert result.steps[0].tool_call.call_id == "r:0:model:0"
    assert result.steps[0].tool_call.arguments == {}


def test_tools_in_sampling_are_refused_with_the_way_to_native_calls() -> None:
    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:1/v1", api_key="k")
    with pytest.raises(ValueError, match=r"ToolStyle\.NATIVE"):
        OpenAIModelClient(client, model=MODEL, sampling={"tools": []})


async def test_the_example_agent_runs_with_native_tool_calls(server: BodyServer) -> None:
    example = load_example("polyloop_openai_agent_native")
    server.respond(
        calls_body(("c1", "add", '{"a": 17, "b": 25}')),
        calls_body(("c2", "multiply", '{"a": 42, "b": 3}'), content="Now the product."),
        calls_body(("c3", "submit", '{"answer": "126"}')),
    )
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        result = await example.solve(client, model=MODEL, task="(17 + 25) * 3", native=True)
    assert result.stop_reason is StopReason.SUBMITTED, example.report(result)
    assert [step.tool_call.name for step in result.steps] == ["add", "multiply", "submit"]
    assert server.requests[0]["tools"][0]["function"]["name"] == "add"
