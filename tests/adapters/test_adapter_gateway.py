"""The PolyGateway adapter, against the gateway or a stand-in of it, under asyncio and Trio.

Where PolyGateway is installed, these tests import it. Where it is not (it is not
published), ``polygateway_standin``, next to this file, holds a package of the same name
that mirrors the surface the adapter relies on; this module puts it on the import path,
and only then, so that it never shadows the real package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from polyloop import (
    DecisionKind,
    FinishReason,
    Message,
    ModelCall,
    ModelClient,
    Role,
    RunEnded,
    RunIdentityMismatch,
    RunStarted,
    StopReason,
    TextBlock,
    ToolCallBlock,
    Usage,
    resume,
    run,
)
from polyloop.stores import MemoryStore

_STANDIN = str(Path(__file__).resolve().parent / "polygateway_standin")
USING_STANDIN = _STANDIN in sys.path or importlib.util.find_spec("polygateway") is None
if USING_STANDIN and _STANDIN not in sys.path:
    sys.path.insert(0, _STANDIN)

import polygateway  # noqa: E402
from polygateway import (  # noqa: E402
    AllSourcesExhausted,
    ChatRequest,
    CircuitOpenError,
    GatewayClient,
    GatewaySettings,
    GovernanceBackendError,
    LLMResponse,
    SourceSpec,
    build_model_fingerprint,
)

from polyloop.adapters.gateway import (  # noqa: E402
    GATEWAY_ERRORS,
    REPLY_FIELDS,
    GatewayModelClient,
)

pytestmark = pytest.mark.anyio

Reply = str | LLMResponse | BaseException | object
Responder = Callable[[ChatRequest], Awaitable[LLMResponse]]


def settings(*, temperature: float = 0.0, scope: str = "polyloop-tests") -> GatewaySettings:
    return GatewaySettings(
        scope=scope,
        sources=(
            SourceSpec(
                provider="alpha", model="big-model", temperature=temperature, reasoning=True
            ),
            SourceSpec(provider="beta", model="small-model", temperature=temperature),
        ),
    )


def turn(chat: ChatRequest) -> int:
    """Which model call of its run this is: one assistant message per finished step."""
    return sum(1 for message in chat.messages if message["role"] == "assistant")


def answered(content: str, k: int, **fields: Any) -> LLMResponse:
    """Call ``k``'s response, with everything the adapter reads from one filled in."""
    reported: dict[str, Any] = {
        "call_id": f"gw-{k}",
        "content": content,
        "reasoning": f"thinking {k}",
        "finish_reason": "stop",
        "prompt_tokens": 100 + k,
        "completion_tokens": 20,
        "reasoning_tokens": 8,
        "total_tokens": 120 + k,
        "model_reported": "big-model-2025-06-01",
    }
    return LLMResponse(**{**reported, **fields})


def scripted(replies: Sequence[Reply]) -> Responder:
    """Answers call ``k`` of a run with ``replies[k]``; an exception is raised instead."""

    async def respond(chat: ChatRequest) -> LLMResponse:
        await anyio.lowlevel.checkpoint()
        reply = replies[turn(chat)]
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, str):
            return answered(reply, turn(chat))
        return reply  # type: ignore[return-value]

    return respond


def gateway(
    responder: Responder, *, gateway_settings: GatewaySettings | None = None
) -> tuple[GatewayModelClient, GatewayClient]:
    """A client built from some settings, and the adapter given that same pair."""
    chosen = gateway_settings if gateway_settings is not None else settings()
    client = GatewayClient(chosen, responder=responder)
    return GatewayModelClient(client=client, settings=chosen), client


def model_call(*messages: Message, binding: dict[str, str] | None = None) -> ModelCall:
    return ModelCall(
        messages=messages,
        call_index=0,
        run_id="r",
        result_id="r:0:model",
        binding=binding if binding is not None else {},
    )


# -- the seam -------------------------------------------------------------------------------


async def test_the_adapter_satisfies_the_model_client_seam() -> None:
    adapter, _ = gateway(scripted([answer("x")]))
    assert isinstance(adapter, ModelClient)
    chosen = settings()
    expected = {"fingerprint": build_model_fingerprint(chosen.sources), "scope": "polyloop-tests"}
    assert adapter.parameters() == expected
    assert json.loads(json.dumps(adapter.parameters())) == expected
    params = definition(MemoryStore(), model=adapter).parameters()
    assert params["model.fingerprint"] == expected["fingerprint"]
    assert params["model.scope"] == "polyloop-tests"


async def test_the_adapter_takes_a_built_client_and_its_settings_by_keyword() -> None:
    chosen = settings()
    client = GatewayClient(chosen, responder=scripted([]))
    with pytest.raises(TypeError):
        GatewayModelClient(client, chosen)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="GatewayClient"):
        GatewayModelClient(client=chosen, settings=client)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GatewaySettings"):
        GatewayModelClient(client=client, settings={"scope": "x"})  # type: ignore[arg-type]


async def test_the_mapping_lists_the_three_gateway_failures() -> None:
    assert set(GATEWAY_ERRORS) == {AllSourcesExhausted, CircuitOpenError, GovernanceBackendError}
    assert all(getattr(polygateway, cls.__name__) is cls for cls in GATEWAY_ERRORS)


# -- a whole run --------------------------------------------------------------------------


async def test_a_whole_run_through_the_gateway() -> None:
    adapter, client = gateway(scripted([tool_call("double", n=2), answer("4")]))
    store, ledger = MemoryStore(), Ledger()
    result = await run(definition(store, model=adapter), request("r", make_tools(ledger)))

    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "4"
    assert [step.call_id for step in result.steps] == ["gw-0", "gw-1"]
    assert [step.reasoning for step in result.steps] == ["thinking 0", "thinking 1"]
    assert ledger.calls == [("double", "r:0:action")]

    first, second = client.calls
    assert [m["role"] for m in first.messages] == ["system", "system", "user"]
    assert first.messages[0]["content"] == "You are a careful agent."
    assert first.messages[2]["content"] == "Double 1, then 3, and submit 6."
    assert second.messages[:3] == first.messages
    assert second.messages[3] == {"role": "assistant", "content": tool_call("double", n=2)}
    assert second.messages[4] == {"role": "user", "content": "Observation: 4 (r:0:action)"}
    # The default binding has neither slot: nothing is passed for them.
    assert (first.session_id, first.parent_card_id) == (None, None)


async def test_text_blocks_are_joined_without_a_separator() -> None:
    adapter, client = gateway(scripted([answer("x")] * 2))
    blocks = (
        TextBlock(text="ab"),
        TextBlock(text="cd"),
        TextBlock(text=""),
        TextBlock(text=" e\n"),
        TextBlock(text="f"),
    )
    await adapter.call(
        model_call(
            Message.text(Role.SYSTEM, "sys"),
            Message(role=Role.USER, content=blocks),
            Message(role=Role.ASSISTANT, content=()),
        )
    )
    assert client.calls[0].messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "abcd e\nf"},
        {"role": "assistant", "content": ""},
    ]


async def test_the_native_tool_style_is_refused_until_the_gateway_protocol_is_known() -> None:
    adapter, client = gateway(scripted([answer("x")]))
    native = dataclasses.replace(
        model_call(Message.text(Role.USER, "hi")),
        tools=({"name": "t", "description": "d", "parameters": {"type": "object"}},),
    )
    with pytest.raises(ValueError, match="native tool style"):
        await adapter.call(native)
    call = ToolCallBlock(call_id="c", name="t", arguments={})
    with pytest.raises(ValueError, match="text blocks only"):
        await adapter.call(model_call(Message(role=Role.ASSISTANT, content=(call,))))
    assert client.calls == []  # nothing reached the gateway


# -- the binding ----------------------------------------------------------------------------


async def test_only_session_id_and_parent_card_id_reach_chat() -> None:
    adapter, client = gateway(scripted([answer("x")]))
    binding = {
        "session_id": "s-1",
        "parent_card_id": "card-9",
        "episode": "e3",
        "some.unknown/key": "whatever",
    }
    await adapter.call(model_call(Message.text(Role.USER, "hi"), binding=binding))
    # The stand-in's chat takes no other keyword, so any other key would have failed.
    assert (client.calls[0].session_id, client.calls[0].parent_card_id) == ("s-1", "card-9")


async def test_each_slot_is_passed_only_when_the_binding_has_it() -> None:
    adapter, client = gateway(scripted([answer("x")]))
    await adapter.call(model_call(Message.text(Role.USER, "a"), binding={"session_id": "s"}))
    await adapter.call(model_call(Message.text(Role.USER, "b"), binding={"parent_card_id": "p"}))
    await adapter.call(model_call(Message.text(Role.USER, "c")))
    assert [(c.session_id, c.parent_card_id) for c in client.calls] == [
        ("s", None),
        (None, "p"),
        (None, None),
    ]


async def test_other_binding_keys_are_recorded_by_the_snapshot_only() -> None:
    adapter, client = gateway(scripted([answer("done")]))
    store = MemoryStore()
    binding = {"session_id": "s", "parent_card_id": "p", "stage": "2", "variant": "b"}
    result = await run(
        definition(store, model=adapter), request("r", make_tools(Ledger()), binding=binding)
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    started = (await store.read_log("r")).records[0]
    assert isinstance(started, RunStarted)
    for key, value in binding.items():
        assert started.snapshot[f"binding.{key}"] == value
    assert (client.calls[0].session_id, client.calls[0].parent_card_id) == ("s", "p")


# -- the reply --------------------------------------------------------------------------------


async def test_an_empty_call_id_becomes_none() -> None:
    adapter, _ = gateway(
        scripted(
            [
                LLMResponse(call_id="", content="visible", reasoning="hidden", total_tokens=7),
            ]
        )
    )
    reply = await adapter.call(model_call(Message.text(Role.USER, "q")))
    assert (reply.call_id, reply.content, reply.reasoning) == (None, "visible", "hidden")


async def test_a_run_records_none_for_an_empty_call_id() -> None:
    adapter, _ = gateway(scripted([LLMResponse(call_id="", content=answer("a"))]))
    result = await run(definition(MemoryStore(), model=adapter), request("r", make_tools(Ledger())))
    assert result.steps[0].call_id is None
    assert result.steps[0].reasoning is None
    assert result.final_answer == "a"


async def test_a_response_of_another_type_is_a_model_failure() -> None:
    adapter, _ = gateway(scripted([{"call_id": "x", "content": "y"}]))
    result = await run(definition(MemoryStore(), model=adapter), request("r", make_tools(Ledger())))
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None
    assert result.detail.startswith("TypeError: the gateway returned dict")


# -- what the response says about the reply ----------------------------------------------------


async def test_the_mapping_names_attributes_the_gateway_response_has() -> None:
    names = {field.name for field in dataclasses.fields(LLMResponse)}
    assert set(REPLY_FIELDS.values()) <= names


async def test_finish_usage_and_model_land_in_the_trajectory() -> None:
    adapter, _ = gateway(scripted([tool_call("double", n=2), answer("4")]))
    result = await run(definition(MemoryStore(), model=adapter), request("r", make_tools(Ledger())))

    assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
    for k, step in enumerate(result.steps):
        assert step.finish is FinishReason.STOP
        assert step.usage == Usage(input_tokens=100 + k, output_tokens=20, reasoning_tokens=8)
        assert (step.model, step.refusal) == ("big-model-2025-06-01", None)
    assert result.usage == Usage(input_tokens=201, output_tokens=40, reasoning_tokens=16)


@pytest.mark.parametrize(
    ("reported", "finish"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("content_filter", FinishReason.CONTENT_FILTER),
        ("tool_calls", FinishReason.TOOL_CALLS),
        ("end_turn", FinishReason.OTHER),
        ("", None),
    ],
)
async def test_the_finish_reason_mapping(reported: str, finish: FinishReason | None) -> None:
    adapter, _ = gateway(scripted([answered("x", 0, finish_reason=reported)]))
    reply = await adapter.call(model_call(Message.text(Role.USER, "q")))
    assert reply.finish is finish


async def test_a_reply_cut_at_the_length_limit_runs_no_tool() -> None:
    cut = answered(tool_call("double", n=2), 0, finish_reason="length")
    adapter, _ = gateway(scripted([cut, answer("done")]))
    ledger = Ledger()
    result = await run(definition(MemoryStore(), model=adapter), request("r", make_tools(ledger)))
    assert [(s.decision, s.finish) for s in result.steps] == [
        (DecisionKind.INVALID, FinishReason.LENGTH),
        (DecisionKind.FINAL, FinishReason.STOP),
    ]
    assert ledger.calls == []


async def test_counts_are_taken_as_reported_and_an_empty_model_is_none() -> None:
    adapter, _ = gateway(
        scripted(
            [
                answered("x", 0, prompt_tokens=0, completion_tokens=0, reasoning_tokens=0),
                answered("x", 1, prompt_tokens=-3, model_reported=""),
            ]
        )
    )
    zero = await adapter.call(model_call(Message.text(Role.USER, "q")))
    assert zero.usage == Usage(input_tokens=0, output_tokens=0, reasoning_tokens=0)
    odd = await adapter.call(
        model_call(Message.text(Role.USER, "q"), Message.text(Role.ASSISTANT, "x"))
    )
    assert odd.usage == Usage(output_tokens=20, reasoning_tokens=8)
    assert odd.model is None


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error_class", [AllSourcesExhausted, CircuitOpenError, GovernanceBackendError]
)
async def test_each_gateway_failure_reaches_the_result_by_its_own_name(
    error_class: type[Exception],
) -> None:
    adapter, client = gateway(scripted([error_class("scope polyloop-tests: upstream said no")]))
    store = MemoryStore()
    result = await run(definition(store, model=adapter), request("r", make_tools(Ledger())))

    assert result.stop_reason is StopReason.MODEL_FAILURE
    expected = f"{error_class.__name__}: scope polyloop-tests: upstream said no"
    assert result.detail == expected
    assert result.steps[0].error == expected
    assert len(client.calls) == 1, "the adapter must not retry"
    end = (await store.read_log("r")).records[-1]
    assert isinstance(end, RunEnded)
    assert end.detail == expected


async def test_a_gateway_failure_passes_through_untouched() -> None:
    raised = CircuitOpenError("breaker open")
    adapter, client = gateway(scripted([raised]))
    with pytest.raises(CircuitOpenError) as caught:
        await adapter.call(model_call(Message.text(Role.USER, "q")))
    assert caught.value is raised
    assert len(client.calls) == 1


async def test_cancellation_during_chat_propagates_and_ends_the_log() -> None:
    entered = anyio.Event()

    async def hang(chat: ChatRequest) -> LLMResponse:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    adapter, client = gateway(hang)
    store = MemoryStore()
    tasks_before = len(anyio.get_running_tasks())
    finished = False
    with anyio.fail_after(5), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel_once_inside() -> None:
                await entered.wait()
                scope.cancel()

            group.start_soon(cancel_once_inside)
            await run(definition(store, model=adapter), request("r", make_tools(Ledger())))
            finished = True

    assert scope.cancelled_caught, "the cancellation did not propagate out of the run"
    assert not finished
    assert len(client.calls) == 1
    assert len(anyio.get_running_tasks()) == tasks_before
    end = (await store.read_log("r")).records[-1]
    assert isinstance(end, RunEnded)
    assert end.stop_reason is StopReason.CANCELLED


# -- identity --------------------------------------------------------------------------------


async def test_a_temperature_change_makes_resume_refuse() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    script = [tool_call("double", n=1), answer("2")]
    before, _ = gateway(scripted(script), gateway_settings=settings(temperature=0.0))
    first = await run(definition(store, model=before), request("r", tools))
    assert first.stop_reason is StopReason.FINAL_ANSWER
    records = (await store.read_log("r")).records

    # The same pair, rebuilt, is the same model: resume returns the recorded result.
    same, _ = gateway(scripted(script), gateway_settings=settings(temperature=0.0))
    again = await resume(definition(store, model=same), request("r", tools))
    assert again.resumed and again.final_answer == "2"

    warmer, warmer_client = gateway(scripted(script), gateway_settings=settings(temperature=1.0))
    assert warmer.parameters()["fingerprint"] != before.parameters()["fingerprint"]
    with pytest.raises(RunIdentityMismatch) as mismatch:
        await resume(definition(store, model=warmer), request("r", tools))
    assert [key for key, _, _ in mismatch.value.differences] == ["model.fingerprint"]
    assert mismatch.value.differences[0][1:] == (
        before.parameters()["fingerprint"],
        warmer.parameters()["fingerprint"],
    )
    assert warmer_client.calls == []
    assert (await store.read_log("r")).records == records


async def test_a_scope_change_makes_resume_refuse() -> None:
    store, tools = MemoryStore(), make_tools(Ledger())
    adapter, _ = gateway(scripted([answer("a")]))
    await run(definition(store, model=adapter), request("r", tools))
    moved, _ = gateway(scripted([answer("a")]), gateway_settings=settings(scope="elsewhere"))
    with pytest.raises(RunIdentityMismatch) as mismatch:
        await resume(definition(store, model=moved), request("r", tools))
    assert mismatch.value.differences == (("model.scope", "polyloop-tests", "elsewhere"),)


# -- sharing -----------------------------------------------------------------------------------


async def test_one_adapter_serves_100_concurrent_runs_without_mixing_them() -> None:
    runs = 100

    async def by_session(chat: ChatRequest) -> LLMResponse:
        # Every answer is derived from the call's own session id; a message of another
        # run in this conversation would show as a mismatch with the goal.
        assert chat.session_id is not None
        index = int(chat.session_id.removeprefix("session-"))
        goal = chat.messages[2]["content"]
        if goal != f"Double {index} and answer.":
            raise AssertionError(f"{chat.session_id} got the goal {goal!r}")
        if chat.parent_card_id != f"card-{index}":
            raise AssertionError(f"{chat.session_id} got card {chat.parent_card_id!r}")
        await anyio.sleep(0.001 * (index % 7))
        k = turn(chat)
        content = tool_call("double", n=index) if k == 0 else answer(f"{index * 2}")
        return LLMResponse(
            call_id=f"{chat.session_id}/{k}", content=content, session_id=chat.session_id
        )

    adapter, client = gateway(by_session)
    store, ledger = MemoryStore(), Ledger()
    tools = make_tools(ledger)
    results: dict[int, Any] = {}

    async def one(index: int) -> None:
        results[index] = await run(
            definition(store, model=adapter),
            request(
                f"run-{index}",
                tools,
                goal_context=(Message.text(Role.USER, f"Double {index} and answer."),),
                binding={
                    "session_id": f"session-{index}",
                    "parent_card_id": f"card-{index}",
                    "episode": f"e{index}",
                },
            ),
        )

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            for index in range(runs):
                group.start_soon(one, index)

    assert len(client.calls) == 2 * runs
    for index in range(runs):
        result = results[index]
        assert result.stop_reason is StopReason.FINAL_ANSWER, result.detail
        assert result.final_answer == str(index * 2)
        assert [s.call_id for s in result.steps] == [f"session-{index}/0", f"session-{index}/1"]
        assert result.steps[0].observation == f"{index * 2} (run-{index}:0:action)"
        log = await store.read_log(f"run-{index}")
        assert {record.run_id for record in log.records} == {f"run-{index}"}
    assert sorted(rid for _, rid in ledger.calls) == sorted(
        f"run-{index}:0:action" for index in range(runs)
    )


# -- the documented example -------------------------------------------------------------------

_PROJECT_WIRING = '''
"""What a project's own module would hold: settings, and the client built from them."""
import json

from polygateway import GatewayClient, GatewaySettings, LLMResponse, SourceSpec

gateway_settings = GatewaySettings(
    scope="docs", sources=(SourceSpec(provider="alpha", model="big-model"),))


async def _respond(chat):
    if chat.messages[-1]["content"].startswith("Result: "):
        content = json.dumps({"answer": "About 2.1 million."})
    else:
        content = json.dumps({"tool": "population", "arguments": {"city": "Paris"}})
    return LLMResponse(call_id=f"{chat.session_id}/{len(chat.messages)}", content=content)


gateway_client = GatewayClient(gateway_settings, responder=_respond)
'''


def test_the_documented_example_runs(tmp_path: Path) -> None:
    """The PolyGateway example of docs/adapters.md, with a project module over the stand-in."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"
    blocks = re.findall(r"```python\n(.*?)```", docs.read_text(encoding="utf-8"), re.S)
    [program] = [block for block in blocks if "through PolyGateway" in block]
    (tmp_path / "myproject").mkdir()
    (tmp_path / "myproject" / "__init__.py").write_text("")
    (tmp_path / "myproject" / "llm.py").write_text(_PROJECT_WIRING)
    standin = [_STANDIN] if USING_STANDIN else []
    path = os.pathsep.join([str(tmp_path), *standin, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr
    assert "About 2.1 million." in done.stdout
    assert "population-paris-1/3" in done.stdout
    assert (tmp_path / "runs.db").exists()
