"""Every model client PolyLoop ships keeps the model-client contract.

The OpenAI-compatible adapter talks to the loopback Chat Completions server of
``tests/kit/chat.py``; the gateway adapter to PolyGateway, or where it is not installed
to the stand-in next to the gateway adapter's tests, put on the import path only then.
Each model answers a call by echoing its last message, so concurrent calls can be told
apart; the slow clients' models never answer.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import openai
import pytest

from kit.chat import ChatServer, Hold, Mode, Reply
from kit.replay import echo_log
from polyloop import ModelCall, ModelClient, TextBlock
from polyloop.adapters.openai import OpenAIModelClient
from polyloop.testing import RecordedModelClient, ScriptedModelClient
from polyloop.testing.model_client_contract import ModelClientContract

_STANDIN = str(Path(__file__).resolve().parent.parent / "adapters" / "polygateway_standin")
if importlib.util.find_spec("polygateway") is None and _STANDIN not in sys.path:
    sys.path.insert(0, _STANDIN)

from polygateway import (  # noqa: E402
    ChatRequest,
    GatewayClient,
    GatewaySettings,
    LLMResponse,
    SourceSpec,
)

from polyloop.adapters.gateway import GatewayModelClient  # noqa: E402


def echo(text: str) -> str:
    return f"echo: {text}"


def expected_echo(call: ModelCall) -> str:
    blocks = call.messages[-1].content
    return echo("".join(block.text for block in blocks if isinstance(block, TextBlock)))


class TestScriptedModelClient(ModelClientContract):
    @pytest.fixture
    def model_client(self) -> ModelClient:
        return ScriptedModelClient(expected_echo)

    @pytest.fixture
    def slow_model_client(self) -> ModelClient:
        return ScriptedModelClient(expected_echo, delay=60)

    @pytest.fixture
    def expected_content(self) -> Any:
        return expected_echo


# -- the OpenAI-compatible adapter, over HTTP on loopback --------------------------------------


def echoing(body: dict[str, Any]) -> Mode:
    return Reply(echo(body["messages"][-1]["content"]), id=f"chatcmpl-{len(body['messages'])}")


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer()
    server.responder = echoing
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def holding_server() -> Iterator[ChatServer]:
    server = ChatServer()
    server.responder = lambda body: Hold()
    server.start()
    try:
        yield server
    finally:
        server.close()


async def openai_adapter(server: ChatServer) -> AsyncIterator[ModelClient]:
    async with openai.AsyncOpenAI(
        base_url=server.base_url, api_key="test-key", max_retries=0
    ) as client:
        yield OpenAIModelClient(client, model="test-model", sampling={"temperature": 0.0})


class TestOpenAIModelClient(ModelClientContract):
    @pytest.fixture
    async def model_client(self, chat_server: ChatServer) -> AsyncIterator[ModelClient]:
        async for adapter in openai_adapter(chat_server):
            yield adapter

    @pytest.fixture
    async def slow_model_client(self, holding_server: ChatServer) -> AsyncIterator[ModelClient]:
        async for adapter in openai_adapter(holding_server):
            yield adapter

    @pytest.fixture
    def expected_content(self) -> Any:
        return expected_echo


# -- the gateway adapter -------------------------------------------------------------------------


SETTINGS = GatewaySettings(
    scope="polyloop-contract",
    sources=(SourceSpec(provider="alpha", model="big-model", temperature=0.0),),
)


async def echo_response(chat: ChatRequest) -> LLMResponse:
    await anyio.lowlevel.checkpoint()
    return LLMResponse(
        call_id=f"gw-{id(chat)}",
        content=echo(chat.messages[-1]["content"]),
        finish_reason="stop",
        prompt_tokens=10,
        completion_tokens=2,
        total_tokens=12,
        model_reported="big-model-2025-06-01",
    )


async def never_respond(chat: ChatRequest) -> LLMResponse:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


class TestGatewayModelClient(ModelClientContract):
    @pytest.fixture
    def model_client(self) -> ModelClient:
        client = GatewayClient(SETTINGS, responder=echo_response)
        return GatewayModelClient(client=client, settings=SETTINGS)

    @pytest.fixture
    def slow_model_client(self) -> ModelClient:
        client = GatewayClient(SETTINGS, responder=never_respond)
        return GatewayModelClient(client=client, settings=SETTINGS)

    @pytest.fixture
    def expected_content(self) -> Any:
        return expected_echo


class TestRecordedModelClient(ModelClientContract):
    """Answering from a recorded run: every call of the suite is the recorded run's first,
    sent under the suite's own run ids."""

    @pytest.fixture
    async def recorded(self) -> tuple[Any, ScriptedModelClient]:
        return await echo_log(1)

    @pytest.fixture
    def model_client(self, recorded: tuple[Any, ScriptedModelClient]) -> ModelClient:
        return RecordedModelClient.from_log(recorded[0])

    @pytest.fixture
    def slow_model_client(self, recorded: tuple[Any, ScriptedModelClient]) -> ModelClient:
        return RecordedModelClient.from_log(recorded[0], delay=60)

    @pytest.fixture
    def model_call(self, recorded: tuple[Any, ScriptedModelClient]) -> Any:
        messages = recorded[1].calls[0].messages

        def make(index: int) -> ModelCall:
            run_id = f"contract-{index}"
            return ModelCall(
                messages=messages,
                call_index=0,
                run_id=run_id,
                result_id=f"{run_id}:0:model",
                binding={},
            )

        return make

    @pytest.fixture
    def expected_content(self) -> Any:
        return lambda call: '{"tool": "echo", "arguments": {"text": "hello"}}'
