"""Native tool calls end to end on the memory store, under asyncio and Trio: the tools go
to the model client, the call and its result stay in the history as structured blocks,
one call per step, and a resumed run sends exactly the messages an uninterrupted one
sends."""

from __future__ import annotations

import pytest

from kit.agent import Ledger, definition, make_tools, request, same_outcome
from kit.native import INTERPRETER, NATIVE, HashingModel, call, native_script
from polyloop import (
    Action,
    DecisionKind,
    FinalAnswer,
    FinishReason,
    InvalidDecision,
    Message,
    ModelReply,
    Replay,
    Role,
    StopReason,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    ToolStyle,
    resume,
    run,
)
from polyloop._assembly import block_json, size, step_messages
from polyloop.interpreters import NativeToolCallInterpreter
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio


# -- blocks and their size ---------------------------------------------------------------------


def test_block_sizes_are_the_characters_the_model_reads_and_writes() -> None:
    block = ToolCallBlock(call_id="c", name="search", arguments={"q": "naïve"})
    assert block.size() == len("search") + len('{"q":"naïve"}')
    assert ToolResultBlock(call_id="c", text="found 3").size() == len("found 3")
    both = Message(role=Role.ASSISTANT, content=(TextBlock(text="hm"), block))
    assert size([both]) == 2 + block.size()


def test_a_native_step_keeps_the_call_and_answers_it_with_its_result() -> None:
    block = ToolCallBlock(call_id="c9", name="double", arguments={"n": 1})
    said, seen = step_messages("Let me see.", "2", "Result: {observation}", block)
    assert said == Message(role=Role.ASSISTANT, content=(TextBlock(text="Let me see."), block))
    assert seen == Message(
        role=Role.USER, content=(ToolResultBlock(call_id="c9", text="Result: 2"),)
    )
    (bare, _) = step_messages("", "2", "{observation}", block)
    assert bare.content == (block,)  # no empty text block beside a bare call
    assert block_json(block) == {
        "type": "tool_call",
        "call_id": "c9",
        "name": "double",
        "arguments": {"n": 1},
    }


# -- the interpreter ----------------------------------------------------------------------------


def reply(*calls: ToolCallBlock, text: str = "", **facts: object) -> ModelReply:
    return ModelReply(call_id=None, content=text, reasoning=None, tool_calls=calls, **facts)  # type: ignore[arg-type]


def block(name: str = "double", arguments: object = None, call_id: str = "c") -> ToolCallBlock:
    return ToolCallBlock(
        call_id=call_id,
        name=name,
        arguments={"n": 1} if arguments is None else arguments,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("the_reply", "says"),
    [
        (reply(block(call_id="a"), block("submit", call_id="b")), "called 2 tools at once"),
        (reply(block(arguments='{"n": 1')), "are not valid JSON"),
        (reply(block(arguments=[1, 2])), "are a JSON list, not an object"),
        (reply(block(arguments="[1, 2]")), "are a JSON list, not an object"),
        (reply(block(arguments='{"n": NaN}')), "are not valid JSON"),
        # Text the client parsed but passed on: the log could not carry the value.
        (reply(block(arguments='{"n": 1e400}')), "hold a number too large or nesting too deep"),
        (reply(block(arguments='{"n": ' + "9" * 5000 + "}")), "hold a number too large"),
        (reply(block(arguments='{"n": ' + "[" * 2000 + "]" * 2000 + "}")), "nesting too deep"),
        (
            reply(text="Let me look that up.", finish=FinishReason.TOOL_CALLS),
            "ended as a tool call, but no call came through",
        ),
        (reply(block(name="")), "names no tool"),
        (reply(text="  "), "was empty"),
    ],
)
def test_the_native_interpreter_refuses_what_it_cannot_run(
    the_reply: ModelReply, says: str
) -> None:
    decision = NativeToolCallInterpreter().interpret(the_reply)
    assert isinstance(decision, InvalidDecision)
    assert says in decision.feedback


def test_a_call_with_text_beside_it_is_an_action_carrying_the_call() -> None:
    the_call = block(arguments={"n": 2})
    decision = NativeToolCallInterpreter().interpret(reply(the_call, text="Doubling."))
    assert decision == Action(
        payload={"name": "double", "arguments": {"n": 2}},
        action_text='double({"n": 2})',
        history_text="Doubling.",
        tool_call=the_call,
    )


def test_text_without_a_call_is_the_answer_unless_answers_go_through_tools() -> None:
    text = reply(text="It is 6.")
    assert NativeToolCallInterpreter().interpret(text) == FinalAnswer(
        answer="It is 6.", history_text="It is 6."
    )
    refused = NativeToolCallInterpreter(answer_in_text=False).interpret(text)
    assert isinstance(refused, InvalidDecision) and "called no tool" in refused.feedback


def test_a_cut_off_tool_call_is_never_run() -> None:
    decision = NativeToolCallInterpreter().interpret(reply(block(), finish=FinishReason.LENGTH))
    assert isinstance(decision, InvalidDecision) and "cut off" in decision.feedback


# -- whole runs ---------------------------------------------------------------------------------


async def test_a_native_run_hands_the_tools_over_and_submits_through_a_tool() -> None:
    model = HashingModel(native_script())
    ledger = Ledger()
    result = await run(
        definition(MemoryStore(), model=model, interpreter=INTERPRETER),
        request("r", make_tools(ledger), **NATIVE),
    )
    assert result.stop_reason is StopReason.SUBMITTED
    assert [s.decision for s in result.steps] == [
        DecisionKind.ACTION,
        DecisionKind.ACTION,
        DecisionKind.INVALID,
        DecisionKind.ACTION,
        DecisionKind.ACTION,
    ]
    assert [rid for _, rid in ledger.calls] == ["r:0:action", "r:3:action", "r:4:action"]
    # Every call carries the tools, and the prompt holds no tool list.
    names = [[tool["name"] for tool in tools] for tools in model.tool_lists]
    assert all(listed == ["double", "submit"] for listed in names)
    assert set(model.tool_lists[0][0]) == {"name", "description", "parameters"}
    # No tool list in the prompt: the first call holds the run and goal contexts only.
    assert [m.role for m in model.calls[0].messages] == [Role.SYSTEM, Role.USER]
    last = model.calls[-1].messages
    # The history holds each call and answers it by id; the refused arguments too.
    calls = [b for m in last for b in m.content if isinstance(b, ToolCallBlock)]
    results = [b for m in last for b in m.content if isinstance(b, ToolResultBlock)]
    assert [c.call_id for c in calls] == ["c0", "c1", "c3"]
    assert [r.call_id for r in results] == ["c0", "c1", "c3"]
    assert result.steps[0].tool_call == calls[0]


async def test_without_tools_and_injection_the_native_prompt_is_the_plain_one() -> None:
    from polyloop.tools import ToolRegistry

    plain: list[tuple[Message, ...]] = []
    for style in ToolStyle:
        model = HashingModel([ModelReply(call_id=None, content="done", reasoning=None)])
        empty = ToolRegistry([], max_observation_chars=100)
        await run(
            definition(MemoryStore(), model=model, interpreter=NativeToolCallInterpreter()),
            request("r", empty, tool_style=style),
        )
        plain.append(model.calls[0].messages)
        assert model.calls[0].tools == ()
    assert all(messages == plain[0] for messages in plain)


# The native run makes 1 + 4 + 4 + 3 + 4 + 4 + 1 = 21 writes.
TOTAL_WRITES = 21


@pytest.mark.parametrize("k", range(1, TOTAL_WRITES))
async def test_a_native_run_resumed_after_any_write_sends_the_same_messages(k: int) -> None:
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)
    the_request = request("r", tools, model_replay=Replay.ALLOWED, **NATIVE)
    whole = HashingModel(native_script())
    expected = await run(
        definition(MemoryStore(), model=whole, interpreter=INTERPRETER), the_request
    )
    store = MemoryStore()
    first = HashingModel(native_script())
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(store, fail_after_writes=k), model=first, interpreter=INTERPRETER
            ),
            the_request,
        )
    second = HashingModel(native_script())
    resumed = await resume(definition(store, model=second, interpreter=INTERPRETER), the_request)
    assert same_outcome(resumed, expected)
    # Each model call index was answered once in the end; its messages hash the same.
    by_index = {c.call_index: d for c, d in zip(first.calls, first.digests, strict=True)}
    by_index.update({c.call_index: d for c, d in zip(second.calls, second.digests, strict=True)})
    assert [by_index[i] for i in range(len(whole.digests))] == whole.digests


@pytest.mark.parametrize("k", [4, 8, 15, 19])
async def test_a_native_never_tool_interrupted_after_its_intent_is_in_doubt(k: int) -> None:
    ledger = Ledger()
    tools = make_tools(ledger, replay=Replay.NEVER)
    the_request = request("r", tools, **NATIVE)
    store = MemoryStore()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(store, fail_after_writes=k),
                model=HashingModel(native_script()),
                interpreter=INTERPRETER,
            ),
            the_request,
        )
    resumed = await resume(
        definition(store, model=HashingModel(native_script()), interpreter=INTERPRETER),
        the_request,
    )
    assert resumed.stop_reason is StopReason.IN_DOUBT
    assert all(ledger.count(rid) <= 1 for _, rid in ledger.calls)


async def test_an_ill_typed_tool_call_is_a_model_failure() -> None:
    bad = ModelReply(call_id=None, content="", reasoning=None, tool_calls=[block()])  # type: ignore[arg-type]
    result = await run(
        definition(MemoryStore(), script=[bad], interpreter=INTERPRETER),
        request("r", make_tools(Ledger()), **NATIVE),
    )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and "tool_calls is not a tuple" in result.detail


async def test_the_tool_style_is_part_of_the_identity() -> None:
    from polyloop import RunIdentityMismatch

    store = MemoryStore()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(
                FaultyStore(store, fail_after_writes=2),
                model=HashingModel(native_script()),
                interpreter=INTERPRETER,
            ),
            request("r", make_tools(Ledger()), **NATIVE),
        )
    with pytest.raises(RunIdentityMismatch, match="tool_style"):
        await resume(
            definition(store, model=HashingModel(native_script()), interpreter=INTERPRETER),
            request("r", make_tools(Ledger()), tool_style=ToolStyle.JSON),
        )


def test_call_helper_builds_one_call() -> None:
    made = call("double", n=1)
    assert made.tool_calls == (
        ToolCallBlock(call_id="call-double", name="double", arguments={"n": 1}),
    )
