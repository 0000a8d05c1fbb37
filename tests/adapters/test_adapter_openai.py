"""The OpenAI-compatible adapter against a real HTTP server on loopback, under asyncio and Trio.

The server (``tests/kit/chat.py``) speaks just enough of the Chat Completions protocol:
it answers ``POST /v1/chat/completions`` with scripted bodies, records every request body,
and can fail, send a broken body, or hold a request open to be cancelled. It runs in a
thread of this process, on 127.0.0.1 and a port the system picks. A second server
(``chat_shapes.py``, next to this file) sends whole bodies in the shapes of OpenAI, vLLM,
llama.cpp and Ollama, and a third, LLMock, is a mock server this project did not write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from chat_shapes import (
    Body,
    BodyServer,
    ollama_body,
    openai_body,
    reasoning_content_body,
    vllm_body,
)
from llmock.scenarios import Reply as LLMockReply
from llmock.testing import LLMockServer

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.backends import BOTH_BACKENDS, TRIO_SLOW
from kit.chat import ChatServer, Hold, Malformed, Mode, PlainText, Reply, Status
from kit.openai_example import load_example
from polyloop import (
    Budget,
    DecisionKind,
    FinishReason,
    Message,
    ModelCall,
    ModelClient,
    Role,
    RunEnded,
    RunIdentityMismatch,
    StopReason,
    TextBlock,
    Usage,
    resume,
    run,
)
from polyloop.adapters.openai import METADATA_LIMITS, RESERVED_SAMPLING_KEYS, OpenAIModelClient
from polyloop.stores import MemoryStore

pytestmark = pytest.mark.anyio


# The adapter maps a reply alike under either backend: only the cases where the event loop
# matters run under Trio in the quick run (kit.backends).
@pytest.fixture(params=TRIO_SLOW)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


MODEL = "test-model"
SAMPLING: dict[str, Any] = {
    "temperature": 0.2,
    "max_tokens": 64,
    "seed": 7,
    "extra_body": {"top_k": 20},
}


# -- the server ---------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[ChatServer]:
    chat = ChatServer()
    chat.start()
    try:
        yield chat
    finally:
        chat.close()


def client_for(server: ChatServer) -> openai.AsyncOpenAI:
    """The client a user would build; no SDK retries, so one model call is one request."""
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="test-key", max_retries=0)


def adapter_for(client: openai.AsyncOpenAI, **overrides: Any) -> OpenAIModelClient:
    options: dict[str, Any] = {"model": MODEL, "sampling": SAMPLING, **overrides}
    return OpenAIModelClient(client, **options)


def model_call(*messages: Message, binding: dict[str, str] | None = None) -> ModelCall:
    return ModelCall(
        messages=messages,
        call_index=0,
        run_id="r",
        result_id="r:0:model",
        binding=binding if binding is not None else {},
    )


async def wait_for(event: threading.Event, seconds: float = 5.0) -> None:
    """Wait for an event the server thread sets, without tying up a worker thread."""
    with anyio.fail_after(seconds):
        while not event.is_set():  # noqa: ASYNC110 - set from a thread, not from a task
            await anyio.sleep(0.01)


# -- the seam -----------------------------------------------------------------------------------


@BOTH_BACKENDS
async def test_the_adapter_satisfies_the_model_client_seam(server: ChatServer) -> None:
    sampling: dict[str, Any] = {"temperature": 0.2, "extra_body": {"top_k": 20}}
    async with client_for(server) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling=sampling)
        assert isinstance(adapter, ModelClient)
        expected = {"base_url": server.base_url + "/", "model": MODEL, "sampling": sampling}
        assert adapter.parameters() == expected
        assert json.loads(json.dumps(adapter.parameters())) == expected
        sampling["extra_body"]["top_k"] = 99
        assert adapter.parameters()["sampling"] == {"temperature": 0.2, "extra_body": {"top_k": 20}}
        params = definition(MemoryStore(), model=adapter).parameters()
        assert params["model.base_url"] == server.base_url + "/"
        assert params["model.model"] == MODEL


async def test_the_constructor_refuses_what_would_fail_every_call(server: ChatServer) -> None:
    async with client_for(server) as client:
        with pytest.raises(TypeError, match="AsyncOpenAI"):
            OpenAIModelClient(
                openai.OpenAI(base_url=server.base_url, api_key="k"),  # type: ignore[arg-type]
                model=MODEL,
                sampling={},
            )
        for reserved in ("model", "messages", "metadata", "stream", "extra_headers", "timeout"):
            with pytest.raises(ValueError, match=reserved):
                OpenAIModelClient(client, model=MODEL, sampling={reserved: "x"})
        with pytest.raises(TypeError, match="send_binding"):
            OpenAIModelClient(client, model=MODEL, sampling={}, send_binding="no")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="extra_body"):
            OpenAIModelClient(client, model=MODEL, sampling={"top_k": 20})
        with pytest.raises(ValueError, match="model"):
            OpenAIModelClient(client, model="", sampling={})


async def test_a_different_sampling_makes_resume_refuse(server: ChatServer) -> None:
    server.respond(Reply(answer("a")))
    store, tools = MemoryStore(), make_tools(Ledger())
    async with client_for(server) as client:
        await run(definition(store, model=adapter_for(client)), request("r", tools))
        warmer = adapter_for(client, sampling={**SAMPLING, "temperature": 0.9})
        with pytest.raises(RunIdentityMismatch) as mismatch:
            await resume(definition(store, model=warmer), request("r", tools))
    assert [key for key, _, _ in mismatch.value.differences] == ["model.sampling"]
    assert len(server.requests) == 1


# -- what goes over the wire --------------------------------------------------------------------


@BOTH_BACKENDS
async def test_a_whole_run_over_http(server: ChatServer) -> None:
    server.respond(
        Reply(tool_call("double", n=2), id="chatcmpl-a", reasoning="I should double 2."),
        Reply(answer("4"), id="chatcmpl-b"),
    )
    store, ledger = MemoryStore(), Ledger()
    async with client_for(server) as client:
        result = await run(
            definition(store, model=adapter_for(client)), request("r", make_tools(ledger))
        )

    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "4"
    assert [step.call_id for step in result.steps] == ["chatcmpl-a", "chatcmpl-b"]
    assert [step.reasoning for step in result.steps] == ["I should double 2.", None]
    assert ledger.calls == [("double", "r:0:action")]

    assert server.paths == ["/v1/chat/completions"] * 2
    first, second = server.requests
    for body in (first, second):
        assert body["model"] == MODEL
        assert body["metadata"] == {"episode": "e1"}
        assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.2, 64, 7)
        assert body["top_k"] == 20  # from extra_body
        assert "stream" not in body
    assert [m["role"] for m in first["messages"]] == ["system", "system", "user"]
    assert first["messages"][0] == {"role": "system", "content": "You are a careful agent."}
    assert first["messages"][2] == {"role": "user", "content": "Double 1, then 3, and submit 6."}
    assert second["messages"][:3] == first["messages"]
    assert second["messages"][3:] == [
        {"role": "assistant", "content": tool_call("double", n=2)},
        {"role": "user", "content": "Observation: 4 (r:0:action)"},
    ]


async def test_every_binding_key_goes_as_metadata_and_none_when_empty(
    server: ChatServer,
) -> None:
    server.respond(Reply("one"), Reply("two"))
    binding = {"session_id": "s-1", "stage": "3", "variant": "b"}
    async with client_for(server) as client:
        adapter = adapter_for(client, sampling={})
        await adapter.call(model_call(Message.text(Role.USER, "hi"), binding=binding))
        await adapter.call(model_call(Message.text(Role.USER, "hi")))
    assert server.requests[0]["metadata"] == binding
    assert "metadata" not in server.requests[1]
    assert set(server.requests[1]) == {"model", "messages"}


async def test_text_blocks_are_joined_without_a_separator(server: ChatServer) -> None:
    server.respond(Reply("ok"))
    blocks = (TextBlock(text="ab"), TextBlock(text="cd"), TextBlock(text=" e\n"))
    async with client_for(server) as client:
        await adapter_for(client).call(
            model_call(
                Message(role=Role.USER, content=blocks),
                Message(role=Role.ASSISTANT, content=()),
            )
        )
    assert server.requests[0]["messages"] == [
        {"role": "user", "content": "abcd e\n"},
        {"role": "assistant", "content": ""},
    ]


# -- what comes back ----------------------------------------------------------------------------


async def test_the_reply_mapping(server: ChatServer) -> None:
    server.respond(
        Reply("visible", id="chatcmpl-9", reasoning="hidden"),
        Reply("no id", id=""),
        Reply("no id at all", id=None),
        Reply(None, id="chatcmpl-10"),
    )
    async with client_for(server) as client:
        adapter = adapter_for(client)
        replies = [await adapter.call(model_call(Message.text(Role.USER, "q"))) for _ in range(4)]
    assert [(r.call_id, r.content, r.reasoning) for r in replies] == [
        ("chatcmpl-9", "visible", "hidden"),
        (None, "no id", None),
        (None, "no id at all", None),
        ("chatcmpl-10", "", None),
    ]
    for reply in replies:  # this server reports a stop, its usage, and echoes the model
        assert reply.finish is FinishReason.STOP
        assert reply.usage == Usage(input_tokens=10, output_tokens=5)
        assert (reply.model, reply.refusal) == (MODEL, None)


# -- what each server family sends, through a whole run ------------------------------------------


@pytest.fixture
def shapes() -> Iterator[BodyServer]:
    server = BodyServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


async def run_against(server: BodyServer, ledger: Ledger, **overrides: Any) -> Any:
    """One run of the test agent against ``server``, its adapter sending no sampling."""
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={})
        return await run(
            definition(MemoryStore(), model=adapter), request("r", make_tools(ledger), **overrides)
        )


SHAPES: dict[str, tuple[Body, dict[str, Any]]] = {
    "openai": (
        openai_body(tool_call("double", n=2), reasoning_tokens=11),
        {
            "call_id": "chatcmpl-AbC123",
            "model": "gpt-4o-2024-08-06",
            "usage": Usage(input_tokens=42, output_tokens=17, reasoning_tokens=11),
            "reasoning": None,
        },
    ),
    "vllm": (
        vllm_body(tool_call("double", n=2), reasoning="Double 2 first."),
        {
            "call_id": "chatcmpl-9f2b7c41d0e34f6a",
            "model": "Qwen/Qwen3-8B",
            "usage": Usage(input_tokens=31, output_tokens=12),
            "reasoning": "Double 2 first.",
        },
    ),
    "older vllm, llama.cpp": (
        reasoning_content_body(tool_call("double", n=2), reasoning_content="Double 2 first."),
        {
            "call_id": "chatcmpl-Yq3pQ0bWm8",
            "model": "gpt-3.5-turbo",
            "usage": Usage(input_tokens=27, output_tokens=9),
            "reasoning": "Double 2 first.",
        },
    ),
    "ollama": (
        ollama_body(tool_call("double", n=2), reasoning="Double 2 first."),
        {
            "call_id": "chatcmpl-417",
            "model": "qwen3:8b",
            "usage": Usage(input_tokens=55, output_tokens=8),
            "reasoning": "Double 2 first.",
        },
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_what_each_server_reports_lands_in_the_trajectory(
    shapes: BodyServer, shape: str
) -> None:
    body, expected = SHAPES[shape]
    shapes.respond(body, openai_body(answer("4"), id="chatcmpl-last", completion_tokens=3))
    ledger = Ledger()
    result = await run_against(shapes, ledger)

    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    first = result.steps[0]
    assert first.decision is DecisionKind.ACTION
    assert (first.call_id, first.model, first.usage) == (
        expected["call_id"],
        expected["model"],
        expected["usage"],
    )
    assert (first.finish, first.refusal, first.reasoning) == (
        FinishReason.STOP,
        None,
        expected["reasoning"],
    )
    assert ledger.calls == [("double", "r:0:action")]
    last = Usage(input_tokens=42, output_tokens=3, reasoning_tokens=0)
    assert result.usage == expected["usage"].plus(last)


@pytest.mark.parametrize(
    ("finish_reason", "finish"),
    [("length", FinishReason.LENGTH), ("content_filter", FinishReason.CONTENT_FILTER)],
)
async def test_a_cut_reply_is_an_invalid_decision_and_its_tool_does_not_run(
    shapes: BodyServer, finish_reason: str, finish: FinishReason
) -> None:
    # The content parses as a whole tool call: only the finish reason says it is not.
    shapes.respond(
        vllm_body(tool_call("double", n=2), finish_reason=finish_reason),
        vllm_body(answer("done")),
    )
    ledger = Ledger()
    result = await run_against(shapes, ledger)

    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    cut = result.steps[0]
    assert (cut.decision, cut.finish, cut.action_status) == (DecisionKind.INVALID, finish, None)
    assert cut.model_output == tool_call("double", n=2)
    assert ledger.calls == [], "a cut reply must not run its tool"
    # The model is told what happened, and its reply stays in the history as sent.
    history = shapes.requests[1]["messages"]
    assert history[3] == {"role": "assistant", "content": tool_call("double", n=2)}
    assert finish_reason.replace("_", " ").split()[0] in history[4]["content"]


async def test_a_refusal_is_recorded_and_is_an_invalid_decision(shapes: BodyServer) -> None:
    said = "I'm sorry, but I can't help with that."
    shapes.respond(
        openai_body(None, refusal=said, finish_reason="stop"),
        openai_body(answer("fine")),
    )
    ledger = Ledger()
    result = await run_against(shapes, ledger)

    refused = result.steps[0]
    assert (refused.decision, refused.finish, refused.refusal) == (
        DecisionKind.INVALID,
        FinishReason.REFUSAL,
        said,
    )
    assert refused.model_output == ""
    assert ledger.calls == []
    assert said in shapes.requests[1]["messages"][4]["content"]
    assert result.steps[1].refusal is None and result.steps[1].finish is FinishReason.STOP


async def test_ollama_repeats_ids_and_each_step_keeps_the_one_it_got(shapes: BodyServer) -> None:
    shapes.respond(
        ollama_body(tool_call("double", n=2), id="chatcmpl-417"),
        ollama_body(tool_call("double", n=4), id="chatcmpl-417"),
        ollama_body(answer("8"), id="chatcmpl-417"),
    )
    ledger = Ledger()
    result = await run_against(shapes, ledger)

    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    assert [step.call_id for step in result.steps] == ["chatcmpl-417"] * 3
    assert [rid for _, rid in ledger.calls] == ["r:0:action", "r:1:action"]


async def test_a_token_budget_counts_what_the_server_reports(shapes: BodyServer) -> None:
    shapes.respond(
        openai_body(tool_call("double", n=2), prompt_tokens=40, completion_tokens=20),
        openai_body(tool_call("double", n=4), prompt_tokens=60, completion_tokens=20),
        openai_body(answer("8")),
    )
    budget = Budget(max_steps=20, max_valid_steps=20, max_context_chars=100_000, max_tokens=100)
    result = await run_against(shapes, Ledger(), budget=budget)
    assert result.stop_reason is StopReason.TOKEN_LIMIT
    assert result.usage == Usage(input_tokens=100, output_tokens=40, reasoning_tokens=0)


# -- the reply, field by field --------------------------------------------------------------------


async def one_reply(server: BodyServer, body: Body) -> Any:
    server.respond(body)
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={})
        return await adapter.call(model_call(Message.text(Role.USER, "q")))


@pytest.mark.parametrize(
    ("reported", "finish"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("content_filter", FinishReason.CONTENT_FILTER),
        ("tool_calls", FinishReason.TOOL_CALLS),
        ("function_call", FinishReason.TOOL_CALLS),
        ("eos", FinishReason.OTHER),
        ("", None),
        (None, None),
    ],
)
async def test_the_finish_reason_mapping(
    shapes: BodyServer, reported: str | None, finish: FinishReason | None
) -> None:
    reply = await one_reply(shapes, openai_body("x", finish_reason=reported))
    assert reply.finish is finish


async def test_a_missing_finish_reason_is_none(shapes: BodyServer) -> None:
    body = reasoning_content_body("x")
    del body["choices"][0]["finish_reason"]
    assert (await one_reply(shapes, body)).finish is None


async def test_reasoning_is_preferred_to_reasoning_content(shapes: BodyServer) -> None:
    both = vllm_body("x", reasoning="new field")
    both["choices"][0]["message"]["reasoning_content"] = "old field"
    assert (await one_reply(shapes, both)).reasoning == "new field"
    old_only = reasoning_content_body("x", reasoning_content="old field")
    assert (await one_reply(shapes, old_only)).reasoning == "old field"
    empty_new = reasoning_content_body("x", reasoning_content="old field")
    empty_new["choices"][0]["message"]["reasoning"] = ""
    assert (await one_reply(shapes, empty_new)).reasoning == "old field"
    assert (await one_reply(shapes, vllm_body("x", reasoning=None))).reasoning is None


async def test_usage_counts_that_are_missing_or_malformed_are_none(shapes: BodyServer) -> None:
    without = openai_body("x")
    del without["usage"]
    assert (await one_reply(shapes, without)).usage is None

    partial = openai_body("x")
    partial["usage"] = {"prompt_tokens": 12}
    assert (await one_reply(shapes, partial)).usage == Usage(input_tokens=12)

    malformed = openai_body("x")
    malformed["usage"].update(prompt_tokens=-1, completion_tokens="many")
    malformed["usage"]["completion_tokens_details"]["reasoning_tokens"] = 3
    assert (await one_reply(shapes, malformed)).usage == Usage(reasoning_tokens=3)

    nothing = openai_body("x")
    nothing["usage"] = {}
    assert (await one_reply(shapes, nothing)).usage is None


async def test_an_empty_model_or_refusal_is_none(shapes: BodyServer) -> None:
    reply = await one_reply(shapes, openai_body("x", model="", refusal=""))
    assert (reply.model, reply.refusal, reply.finish) == (None, None, FinishReason.STOP)


async def test_a_refusal_keeps_a_finish_reason_that_says_more(shapes: BodyServer) -> None:
    reply = await one_reply(shapes, openai_body(None, refusal="No.", finish_reason="length"))
    assert (reply.refusal, reply.finish, reply.content) == ("No.", FinishReason.LENGTH, "")


# -- keys the adapter refuses, and the binding as metadata --------------------------------------

THROWN_AWAY = (
    "n",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "modalities",
    "audio",
    "logprobs",
    "top_logprobs",
)


async def test_sampling_keys_whose_results_would_be_dropped_are_refused(
    server: ChatServer,
) -> None:
    assert set(THROWN_AWAY) <= RESERVED_SAMPLING_KEYS
    async with client_for(server) as client:
        for key in THROWN_AWAY:
            with pytest.raises(ValueError, match=f"sampling may not set '{key}': ") as refused:
                OpenAIModelClient(client, model=MODEL, sampling={key: 1})
            assert "\n" not in str(refused.value)
        with pytest.raises(ValueError, match=r"'n': .*; 'tools': ") as both:
            OpenAIModelClient(client, model=MODEL, sampling={"tools": [], "n": 2})
        assert "first choice" in str(both.value) and "ToolStyle.NATIVE" in str(both.value)
        # What shapes the text that is read is fine, and so is store.
        fine = {"response_format": {"type": "json_object"}, "store": True, "stop": ["\n\n"]}
        OpenAIModelClient(client, model=MODEL, sampling=fine)
    assert server.requests == []


def binding_of(pairs: int, *, key_chars: int = 8, value_chars: int = 8) -> dict[str, str]:
    return {f"{index:0{key_chars}d}": "v" * value_chars for index in range(pairs)}


@pytest.mark.parametrize(
    ("binding", "problem"),
    [
        (binding_of(METADATA_LIMITS["pairs"] + 1), "17 pairs"),
        (binding_of(1, key_chars=METADATA_LIMITS["key_chars"] + 1), "has 65 characters"),
        (binding_of(1, value_chars=METADATA_LIMITS["value_chars"] + 1), "has 513 characters"),
    ],
)
async def test_a_binding_over_the_metadata_limits_fails_before_sending(
    server: ChatServer, binding: dict[str, str], problem: str
) -> None:
    async with client_for(server) as client:
        adapter = adapter_for(client)
        with pytest.raises(ValueError, match=problem) as caught:
            await adapter.call(model_call(Message.text(Role.USER, "q"), binding=binding))
        result = await run(
            definition(MemoryStore(), model=adapter),
            request("r", make_tools(Ledger()), binding=binding),
        )
    message = str(caught.value)
    assert "store=True" in message and "send_binding=False" in message and "\n" not in message
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and result.detail.startswith("ValueError: the binding")
    assert server.requests == [], "nothing may be sent"


async def test_a_binding_at_the_limits_is_sent_and_send_binding_false_sends_none(
    server: ChatServer,
) -> None:
    widest = binding_of(
        METADATA_LIMITS["pairs"],
        key_chars=METADATA_LIMITS["key_chars"],
        value_chars=METADATA_LIMITS["value_chars"],
    )
    too_many = binding_of(METADATA_LIMITS["pairs"] + 5)
    server.respond(Reply("one"), Reply("two"))
    async with client_for(server) as client:
        await adapter_for(client).call(model_call(Message.text(Role.USER, "q"), binding=widest))
        quiet = adapter_for(client, send_binding=False)
        assert quiet.parameters() == adapter_for(client).parameters()
        await quiet.call(model_call(Message.text(Role.USER, "q"), binding=too_many))
    assert server.requests[0]["metadata"] == widest
    assert "metadata" not in server.requests[1]


# -- failures -----------------------------------------------------------------------------------


async def test_a_server_error_is_a_model_failure_under_the_sdk_name(server: ChatServer) -> None:
    server.respond(Status(500), Status(500))
    async with client_for(server) as client:
        adapter = adapter_for(client)
        with pytest.raises(openai.InternalServerError) as caught:
            await adapter.call(model_call(Message.text(Role.USER, "q")))
        assert caught.value.status_code == 500
        result = await run(
            definition(MemoryStore(), model=adapter), request("r", make_tools(Ledger()))
        )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None
    assert result.detail.startswith("InternalServerError: ")
    assert len(server.requests) == 2, "neither the adapter nor the SDK may retry"


async def test_a_malformed_body_is_a_model_failure(server: ChatServer) -> None:
    server.respond(Malformed(), Malformed())
    async with client_for(server) as client:
        adapter = adapter_for(client)
        with pytest.raises(Exception) as caught:  # noqa: PT011 - whatever the SDK raises
            await adapter.call(model_call(Message.text(Role.USER, "q")))
        result = await run(
            definition(MemoryStore(), model=adapter), request("r", make_tools(Ledger()))
        )
    # The SDK's own exception passes through: today a JSON decoding error.
    assert isinstance(caught.value, (ValueError, openai.APIError))
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None
    assert result.detail.startswith(f"{type(caught.value).__name__}: ")


async def test_an_answer_that_is_not_a_completion_is_a_model_failure(
    server: ChatServer,
) -> None:
    server.respond(PlainText(), Reply("x", choices=False))
    async with client_for(server) as client:
        adapter = adapter_for(client)
        with pytest.raises(TypeError, match="not a chat completion"):
            await adapter.call(model_call(Message.text(Role.USER, "q")))
        with pytest.raises(ValueError, match="no choices"):
            await adapter.call(model_call(Message.text(Role.USER, "q")))


@pytest.mark.parametrize(
    ("choices", "says"),
    [
        ([{"index": 0, "message": None, "finish_reason": "stop"}], "no message in its first"),
        ([{"index": 0, "message": "text", "finish_reason": "stop"}], "no message in its first"),
        ([{"index": 0, "finish_reason": "stop"}], "no message in its first"),
        ([None], "no message in its first"),
        ({"0": {"message": {"content": "x"}}}, "no choices"),
    ],
)
async def test_a_completion_without_a_message_says_the_body_is_malformed(
    shapes: BodyServer, choices: Any, says: str
) -> None:
    body = openai_body("x")
    body["choices"] = choices
    with pytest.raises(ValueError, match=f"the chat completion 'chatcmpl-AbC123' has {says}"):
        await one_reply(shapes, body)


@BOTH_BACKENDS
async def test_cancelling_an_in_flight_request(server: ChatServer) -> None:
    server.respond(Hold())
    store = MemoryStore()
    tasks_before = len(anyio.get_running_tasks())
    finished = False
    async with client_for(server) as client:
        adapter = adapter_for(client)
        with anyio.fail_after(10), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:

                async def cancel_while_held() -> None:
                    await wait_for(server.holding)
                    scope.cancel()

                group.start_soon(cancel_while_held)
                await run(definition(store, model=adapter), request("r", make_tools(Ledger())))
                finished = True
        assert scope.cancelled_caught, "the cancellation did not propagate out of the run"
        assert not finished
        # The connection of the cancelled request is closed at once, not left in the pool.
        await wait_for(server.hold_saw_close)
        assert len(anyio.get_running_tasks()) == tasks_before
    assert len(server.requests) == 1
    end = (await store.read_log("r")).records[-1]
    assert isinstance(end, RunEnded)
    assert end.stop_reason is StopReason.CANCELLED
    assert len(anyio.get_running_tasks()) == tasks_before


@BOTH_BACKENDS
async def test_one_adapter_serves_concurrent_runs_without_mixing_them(
    server: ChatServer,
) -> None:
    runs = 20

    def by_metadata(body: dict[str, Any]) -> Mode:
        index = int(body["metadata"]["episode"].removeprefix("e"))
        if body["messages"][2]["content"] != f"Double {index} and answer.":
            return Status(500, f"run {index} was sent another run's messages")
        turns = sum(1 for m in body["messages"] if m["role"] == "assistant")
        content = tool_call("double", n=index) if turns == 0 else answer(str(index * 2))
        return Reply(content, id=f"chatcmpl-{index}-{turns}")

    server.responder = by_metadata
    store, ledger = MemoryStore(), Ledger()
    tools = make_tools(ledger)
    results: dict[int, Any] = {}
    async with client_for(server) as client:
        adapter = adapter_for(client)

        async def one(index: int) -> None:
            results[index] = await run(
                definition(store, model=adapter),
                request(
                    f"run-{index}",
                    tools,
                    binding={"episode": f"e{index}"},
                    goal_context=(Message.text(Role.USER, f"Double {index} and answer."),),
                ),
            )

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for index in range(runs):
                    group.start_soon(one, index)

    assert len(server.requests) == 2 * runs
    for index in range(runs):
        result = results[index]
        assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
        assert result.final_answer == str(index * 2)
        assert [s.call_id for s in result.steps] == [f"chatcmpl-{index}-0", f"chatcmpl-{index}-1"]
        log = await store.read_log(f"run-{index}")
        assert {record.run_id for record in log.records} == {f"run-{index}"}


# -- against LLMock, a mock server this project did not write -------------------------------------


async def test_llmock_cut_and_filtered_replies_are_invalid_and_run_no_tool(
    llmock: LLMockServer,
) -> None:
    llmock.state.scenarios.add(
        LLMockReply(text=tool_call("double", n=2), finish_reason="length"),
        LLMockReply(text=tool_call("double", n=2), finish_reason="content_filter"),
        LLMockReply(text=tool_call("double", n=2)),
        LLMockReply(text=answer("4")),
    )
    ledger = Ledger()
    async with openai.AsyncOpenAI(
        base_url=llmock.base_url("openai"), api_key="k", max_retries=0
    ) as client:
        adapter = OpenAIModelClient(client, model=MODEL, sampling={"temperature": 0.0})
        result = await run(
            definition(MemoryStore(), model=adapter), request("r", make_tools(ledger))
        )

    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    assert [(step.decision, step.finish) for step in result.steps] == [
        (DecisionKind.INVALID, FinishReason.LENGTH),
        (DecisionKind.INVALID, FinishReason.CONTENT_FILTER),
        (DecisionKind.ACTION, FinishReason.STOP),
        (DecisionKind.FINAL, FinishReason.STOP),
    ]
    assert ledger.calls == [("double", "r:2:action")], "only the whole reply ran its tool"
    for step in result.steps:
        assert step.model == MODEL and step.refusal is None and step.reasoning is None
        assert step.call_id is not None and step.call_id.startswith("chatcmpl-")
        # LLMock estimates its counts and reports no reasoning tokens.
        assert step.usage is not None and step.usage.reasoning_tokens is None
        assert step.usage.input_tokens and step.usage.output_tokens
    assert len({step.call_id for step in result.steps}) == 4
    assert result.usage is not None and result.usage.total_tokens == sum(
        step.usage.total_tokens or 0 for step in result.steps if step.usage is not None
    )
    bodies = [record.body for record in llmock.state.journal.records(wait=2.0)]
    assert [body["metadata"] for body in bodies] == [{"episode": "e1"}] * 4
    assert all(body["temperature"] == 0.0 and body["model"] == MODEL for body in bodies)


# -- the runnable example ------------------------------------------------------------------------


async def test_the_example_agent_runs_against_the_server(
    server: ChatServer, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example("polyloop_openai_agent_example")
    server.respond(
        Reply('{"tool": "add", "arguments": {"a": 17, "b": 25}}'),
        Reply('Sure.\n```json\n{"tool": "multiply", "arguments": {"a": 42, "b": 3}}\n```'),
        Reply("I think the answer is 126."),
        Reply('{"tool": "submit", "arguments": {"answer": "126"}}'),
    )
    args = example.parse_args(
        [
            "--base-url",
            server.base_url,
            "--model",
            MODEL,
            "--api-key",
            "k",
            "--max-retries",
            "0",
            "--binding",
            "purpose=test",
            "--binding",
            "batch=7",
        ]
    )
    assert await example.amain(args) == 0
    printed = capsys.readouterr().out
    assert "add" in printed and "-> 42" in printed and "-> 126" in printed
    assert "stopped: submitted after 4 steps" in printed
    assert server.requests[0]["metadata"] == {"purpose": "test", "batch": "7"}
    assert server.requests[0]["temperature"] == 0.0


def _run_program(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENAI_API_KEY": "test-key"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


# The program under Trio checks nothing the whole run over HTTP under Trio does not.
@pytest.mark.parametrize("backend", TRIO_SLOW)
def test_the_example_program_runs_from_the_command_line(server: ChatServer, backend: str) -> None:
    server.respond(
        Reply('{"tool": "multiply", "arguments": {"a": 6, "b": 7}}'),
        Reply('{"tool": "submit", "arguments": {"answer": "42"}}'),
    )
    path = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"
    done = _run_program(
        [
            str(path),
            "--base-url",
            server.base_url,
            "--model",
            MODEL,
            "--max-retries",
            "0",
            "--backend",
            backend,
        ]
    )
    assert done.returncode == 0, done.stderr
    assert "multiply" in done.stdout and "stopped: submitted after 2 steps" in done.stdout
    assert all("metadata" not in body for body in server.requests)


def test_the_documented_example_runs(server: ChatServer) -> None:
    """The Chat Completions example of docs/adapters.md, as written, against this server."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"
    blocks = re.findall(r"```python\n(.*?)```", docs.read_text(encoding="utf-8"), re.S)
    [program] = [block for block in blocks if "Ask a model one question" in block]
    server.respond(Reply("Rayleigh scattering.", id="chatcmpl-doc", reasoning="short"))
    done = _run_program(["-c", program, "--base-url", server.base_url, "--model", MODEL])
    assert done.returncode == 0, done.stderr
    assert "stop reason: final_answer" in done.stdout
    assert "chatcmpl-doc" in done.stdout and "Rayleigh scattering." in done.stdout
    assert "metadata" not in server.requests[0]
