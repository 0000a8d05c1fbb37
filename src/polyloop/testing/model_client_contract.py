"""The contract every :class:`~polyloop.ports.ModelClient` keeps, as reusable pytest classes.

Subclass :class:`ModelClientContract` in a test module and provide a ``model_client``
fixture: the client under test, ready to answer any call with a reply (a scripted
model, a local stand-in server, a recorded conversation). Every test then runs against
your client, under each ``anyio_backend`` your test session parametrizes::

    class TestMyClient(ModelClientContract):
        @pytest.fixture
        def model_client(self, stand_in_server):
            return MyClient(base_url=stand_in_server.url, model="m")

        @pytest.fixture
        def slow_model_client(self, holding_server):
            return MyClient(base_url=holding_server.url, model="m")

        @pytest.fixture
        def expected_content(self):
            return lambda call: f"echo {call.run_id}"

Three fixtures are optional, and have defaults here:

* ``slow_model_client``: a client of the same kind whose calls wait until they are
  cancelled (a server that never answers, say). With it, the suite cancels a call in
  flight and checks the cancellation comes out of it; without it (``None``), that test
  is skipped, and only a call made in an already cancelled scope is checked.
* ``expected_content``: a function of a :class:`~polyloop.ports.ModelCall` that says
  what ``content`` your model answers to it, if it answers each call differently and
  predictably. With it, the suite checks that concurrent calls each get their own
  reply; without it, that each gets a well-formed one.
* ``model_call``: a function of an index that makes the calls the suite sends; the
  default is one user message, ``call_index`` 0, and run ``contract-<index>``.

A client that is also a :class:`~polyloop.ports.StreamingModelClient` is checked to
hand over pieces of text that add up to its reply's ``content``; for any other client
that test is skipped.

The tests need pytest and anyio's pytest plugin (installed with anyio).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from polyloop.ports import ModelCall, ModelClient, ModelReply, StreamingModelClient
from polyloop.testing._contract_checks import (
    assert_cancelled_before_start,
    assert_cancelled_in_flight,
    assert_plain_parameters,
    credential_keys,
)
from polyloop.types import FinishReason, Message, Role, ToolCallBlock, Usage

__all__ = ("ModelClientContract", "assert_well_formed_reply", "contract_call")

CallFactory = Callable[[int], ModelCall]
ExpectedContent = Callable[[ModelCall], str]

CONCURRENT_CALLS = 20


def contract_call(index: int) -> ModelCall:
    """Call ``index`` of the suite: the first model call of its own run."""
    run_id = f"contract-{index}"
    return ModelCall(
        messages=(Message.text(Role.USER, f"Say something about number {index}."),),
        call_index=0,
        run_id=run_id,
        result_id=f"{run_id}:0:model",
        binding={},
    )


def assert_well_formed_reply(reply: object) -> ModelReply:
    """``reply`` is a :class:`ModelReply` whose every field has its declared type."""
    assert isinstance(reply, ModelReply), f"call() returned {type(reply).__name__}"
    assert isinstance(reply.content, str), "content must be a string"
    # An empty call id looks like a join key and matches nothing: None says "none".
    assert reply.call_id is None or (isinstance(reply.call_id, str) and reply.call_id), (
        f"call_id must be None or a non-empty string, not {reply.call_id!r}"
    )
    assert reply.reasoning is None or isinstance(reply.reasoning, str), "reasoning"
    assert reply.finish is None or isinstance(reply.finish, FinishReason), "finish"
    assert reply.usage is None or isinstance(reply.usage, Usage), "usage"
    assert reply.model is None or isinstance(reply.model, str), "model"
    assert reply.refusal is None or isinstance(reply.refusal, str), "refusal"
    assert isinstance(reply.tool_calls, tuple), "tool_calls must be a tuple"
    for call in reply.tool_calls:
        assert isinstance(call, ToolCallBlock), f"a tool call is {type(call).__name__}"
        assert isinstance(call.call_id, str) and call.call_id, "a tool call needs an id"
        assert isinstance(call.name, str), "a tool call's name must be a string"
    return reply


@pytest.mark.anyio
class ModelClientContract:
    """Tests every model client passes. Provide a ``model_client`` fixture."""

    @pytest.fixture
    def slow_model_client(self) -> ModelClient | None:
        return None

    @pytest.fixture
    def expected_content(self) -> ExpectedContent | None:
        return None

    @pytest.fixture
    def model_call(self) -> CallFactory:
        return contract_call

    async def test_satisfies_the_seam(self, model_client: ModelClient) -> None:
        assert isinstance(model_client, ModelClient)

    async def test_parameters_are_plain_json_and_stable(
        self, model_client: ModelClient, model_call: CallFactory
    ) -> None:
        params = assert_plain_parameters(model_client.parameters())
        assert dict(model_client.parameters()) == params
        await model_client.call(model_call(0))
        assert dict(model_client.parameters()) == params, "a call changed the parameters"

    async def test_parameters_hold_no_credentials(self, model_client: ModelClient) -> None:
        # They are reproducibility facts, and every run's snapshot records them.
        found = credential_keys(dict(model_client.parameters()))
        assert not found, f"parameters name what looks like a credential: {found}"

    async def test_a_call_returns_a_well_formed_reply(
        self,
        model_client: ModelClient,
        model_call: CallFactory,
        expected_content: ExpectedContent | None,
    ) -> None:
        call = model_call(0)
        reply = assert_well_formed_reply(await model_client.call(call))
        if expected_content is not None:
            assert reply.content == expected_content(call)

    async def test_one_client_serves_concurrent_calls(
        self,
        model_client: ModelClient,
        model_call: CallFactory,
        expected_content: ExpectedContent | None,
    ) -> None:
        calls = [model_call(index) for index in range(CONCURRENT_CALLS)]
        replies: dict[int, ModelReply] = {}

        async def make(index: int) -> None:
            replies[index] = await model_client.call(calls[index])

        async with anyio.create_task_group() as group:
            for index in range(CONCURRENT_CALLS):
                group.start_soon(make, index)
        assert sorted(replies) == list(range(CONCURRENT_CALLS))
        for index, reply in replies.items():
            assert_well_formed_reply(reply)
            if expected_content is not None:
                assert reply.content == expected_content(calls[index]), (
                    f"call {index} got another call's reply"
                )

    async def test_a_call_in_a_cancelled_scope_lets_the_cancellation_out(
        self, model_client: ModelClient, model_call: CallFactory
    ) -> None:
        await assert_cancelled_before_start(lambda: model_client.call(model_call(0)))

    async def test_cancelling_a_call_in_flight_propagates(
        self, slow_model_client: ModelClient | None, model_call: CallFactory
    ) -> None:
        if slow_model_client is None:
            pytest.skip("no slow_model_client: a call in flight cannot be cancelled")
        await assert_cancelled_in_flight(lambda: slow_model_client.call(model_call(0)))

    async def test_streamed_pieces_add_up_to_the_reply(
        self,
        model_client: ModelClient,
        model_call: CallFactory,
        expected_content: ExpectedContent | None,
    ) -> None:
        if not isinstance(model_client, StreamingModelClient):
            pytest.skip("not a StreamingModelClient: it hands over no pieces of text")
        pieces: list[object] = []

        async def on_text(text: str) -> None:
            pieces.append(text)

        call = model_call(0)
        reply = assert_well_formed_reply(await model_client.stream(call, on_text))
        assert all(isinstance(piece, str) for piece in pieces), "a piece is not a str"
        assert "".join(str(piece) for piece in pieces) == reply.content
        if expected_content is not None:
            assert reply.content == expected_content(call)
