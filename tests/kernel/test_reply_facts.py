"""What the model said about its reply reaches the trajectory: how the reply ended, its
token usage, the model that answered and a refusal; a reply that did not end normally is
never acted on; and a token budget, enforced in the fixed stop order. Memory store,
asyncio and Trio."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from kit.agent import Ledger, definition, make_tools, request, same_outcome, tool_call
from polyloop import (
    Budget,
    CorruptLog,
    DecisionKind,
    FinishReason,
    InvalidDecision,
    InvalidRequest,
    ModelCall,
    ModelReply,
    Replay,
    Result,
    RunIdentityMismatch,
    RunStarted,
    StepRecord,
    StopReason,
    Usage,
    reject_incomplete,
    resume,
    run,
    serialization,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, JsonActionInterpreter, SimulatedCrash

pytestmark = pytest.mark.anyio


def reply(content: str, **facts: Any) -> ModelReply:
    return ModelReply(call_id=facts.pop("call_id", "c"), content=content, reasoning=None, **facts)


def metered(content: str, tokens_in: int = 100, tokens_out: int = 10, **facts: Any) -> ModelReply:
    usage = Usage(input_tokens=tokens_in, output_tokens=tokens_out)
    return reply(content, usage=usage, finish=FinishReason.STOP, **facts)


def budget(**limits: Any) -> Budget:
    values: dict[str, Any] = {"max_steps": 20, "max_valid_steps": 20, "max_context_chars": 100_000}
    values.update(limits)
    return Budget(**values)


async def test_every_reported_fact_lands_in_the_result_record_step_and_run_result() -> None:
    store = MemoryStore()
    first = reply(
        tool_call("double", n=1),
        call_id="cmpl-1",
        finish=FinishReason.TOOL_CALLS,
        usage=Usage(input_tokens=1200, output_tokens=80, reasoning_tokens=30),
        model="gpt-4o-2024-08-06",
    )
    last = metered(tool_call("submit", answer="2"), 1300, 20, model="gpt-4o-2024-08-06")
    result = await run(definition(store, script=[first, last]), request("r", make_tools(Ledger())))
    assert result.stop_reason is StopReason.SUBMITTED
    step = result.steps[0]
    assert (step.finish, step.model, step.refusal) == (
        FinishReason.TOOL_CALLS,
        "gpt-4o-2024-08-06",
        None,
    )
    assert step.usage == Usage(input_tokens=1200, output_tokens=80, reasoning_tokens=30)
    log = await store.read_log("r")
    model_result = next(r for r in log.records if isinstance(r, Result))
    assert model_result.payload == {
        "call_id": "cmpl-1",
        "content": tool_call("double", n=1),
        "reasoning": None,
        "finish": "tool_calls",
        "usage": {"input_tokens": 1200, "output_tokens": 80, "reasoning_tokens": 30},
        "model": "gpt-4o-2024-08-06",
    }
    # Reasoning is known for one call only, so the run's reasoning total is unknown.
    assert result.usage == Usage(input_tokens=2500, output_tokens=100, reasoning_tokens=None)
    assert [s for s in log.records if isinstance(s, StepRecord)] == list(result.steps)


async def test_a_reply_that_reports_nothing_more_is_recorded_as_before() -> None:
    store = MemoryStore()
    result = await run(
        definition(store, script=[tool_call("submit", answer="x")]),
        request("r", make_tools(Ledger())),
    )
    log = await store.read_log("r")
    model_result = next(r for r in log.records if isinstance(r, Result))
    assert set(model_result.payload) == {"call_id", "content", "reasoning"}  # type: ignore[arg-type]
    assert result.usage is None
    assert result.steps[0].finish is None and result.steps[0].usage is None


@pytest.mark.parametrize(
    ("finish", "refusal", "says"),
    [
        (FinishReason.LENGTH, None, "cut off at the length limit"),
        (FinishReason.CONTENT_FILTER, None, "content filter"),
        (FinishReason.REFUSAL, "I won't do that.", "refusal: I won't do that."),
        (None, "I won't do that.", "refusal: I won't do that."),
    ],
)
async def test_a_reply_that_did_not_end_normally_is_never_acted_on(
    finish: FinishReason | None, refusal: str | None, says: str
) -> None:
    ledger = Ledger()
    # A complete tool call that the server says was cut off (or refused) is not run.
    cut = reply(tool_call("submit", answer="6"), finish=finish, refusal=refusal)
    result = await run(
        definition(MemoryStore(), script=[cut, tool_call("submit", answer="6")]),
        request("r", make_tools(ledger)),
    )
    first = result.steps[0]
    assert first.decision is DecisionKind.INVALID
    assert first.action_status is None and first.observation is not None
    assert says in first.observation
    assert (first.finish, first.refusal) == (finish, refusal)
    assert ledger.calls == [("submit", "r:1:action")]
    assert result.stop_reason is StopReason.SUBMITTED


@pytest.mark.parametrize(
    "finish", [None, FinishReason.STOP, FinishReason.TOOL_CALLS, FinishReason.OTHER]
)
def test_a_complete_reply_is_left_to_the_interpreter(finish: FinishReason | None) -> None:
    assert reject_incomplete(reply("x", finish=finish)) is None
    assert reply("x", finish=finish).complete


def test_a_refusal_with_no_text_goes_into_the_history_as_the_refusal() -> None:
    decision = reject_incomplete(reply("", refusal="No."))
    assert decision == InvalidDecision(
        feedback="Your reply was a refusal: No. Nothing was run.", history_text="No."
    )


async def test_a_custom_interpreter_sees_how_the_reply_finished() -> None:
    seen: list[FinishReason | None] = []

    class Noting(JsonActionInterpreter):
        def interpret(self, reply: ModelReply) -> Any:
            seen.append(reply.finish)
            return super().interpret(reply)

    script = [reply("not json", finish=FinishReason.LENGTH), tool_call("submit", answer="1")]
    await run(
        definition(MemoryStore(), script=script, interpreter=Noting()),
        request("r", make_tools(Ledger())),
    )
    assert seen == [FinishReason.LENGTH, None]


async def test_an_ill_typed_reply_fact_is_a_model_failure() -> None:
    bad = reply("x", finish="length")  # a string, not a FinishReason
    result = await run(definition(MemoryStore(), script=[bad]), request("r", make_tools(Ledger())))
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and "finish is not a FinishReason" in result.detail


def test_usage_refuses_negative_and_non_integer_counts() -> None:
    with pytest.raises(ValueError, match=r"Usage.input_tokens"):
        Usage(input_tokens=-1)
    with pytest.raises(ValueError, match=r"Usage.output_tokens"):
        Usage(output_tokens=True)


def test_usage_sums_keep_an_unknown_count_unknown() -> None:
    a = Usage(input_tokens=1, output_tokens=2, reasoning_tokens=3)
    b = Usage(input_tokens=10, output_tokens=20)
    assert a.plus(b) == Usage(input_tokens=11, output_tokens=22, reasoning_tokens=None)
    assert a.total_tokens == 3 and Usage(input_tokens=1).total_tokens is None


# -- the token budget ------------------------------------------------------------------------


def counting_script(calls: int, tokens: int) -> list[ModelReply]:
    return [metered(tool_call("double", n=i), tokens - 10, 10) for i in range(calls)]


async def test_the_token_budget_stops_before_the_next_model_call() -> None:
    model_calls: list[int] = []

    def script(call: ModelCall) -> ModelReply:
        model_calls.append(call.call_index)
        return metered(tool_call("double", n=call.call_index), 90, 10)

    from polyloop.testing import ScriptedModelClient

    result = await run(
        definition(MemoryStore(), model=ScriptedModelClient(script)),
        request("r", make_tools(Ledger()), budget=budget(max_tokens=250)),
    )
    # 100 tokens a call: after three calls 300 >= 250, so no fourth call is made.
    assert result.stop_reason is StopReason.TOKEN_LIMIT
    assert model_calls == [0, 1, 2]
    assert result.detail == "300 tokens used, max_tokens=250 reached"
    assert result.usage == Usage(input_tokens=270, output_tokens=30)


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        # Two reasons at once: the one earlier in the stop order wins.
        ({"max_steps": 2, "max_tokens": 200}, StopReason.STEP_LIMIT),
        ({"max_valid_steps": 2, "max_tokens": 200}, StopReason.VALID_STEP_LIMIT),
        ({"max_context_chars": 1, "max_tokens": 1}, StopReason.CONTEXT_LIMIT),
        ({"max_tokens": 200}, StopReason.TOKEN_LIMIT),
    ],
)
async def test_the_token_limit_comes_after_the_other_budget_checks(
    limits: dict[str, int], expected: StopReason
) -> None:
    result = await run(
        definition(MemoryStore(), script=counting_script(5, 100)),
        request("r", make_tools(Ledger()), budget=budget(**limits)),
    )
    assert result.stop_reason is expected


async def test_a_step_that_submits_past_the_token_budget_ends_submitted() -> None:
    script = [metered(tool_call("submit", answer="x"), 5000, 500)]
    result = await run(
        definition(MemoryStore(), script=script),
        request("r", make_tools(Ledger()), budget=budget(max_tokens=10)),
    )
    assert result.stop_reason is StopReason.SUBMITTED


@pytest.mark.parametrize(
    "usage", [None, Usage(input_tokens=10), Usage(output_tokens=10, reasoning_tokens=3)]
)
async def test_a_reply_without_usage_under_a_token_budget_is_a_model_failure(
    usage: Usage | None,
) -> None:
    ledger = Ledger()
    script = [reply(tool_call("submit", answer="x"), usage=usage)]
    result = await run(
        definition(MemoryStore(), script=script),
        request("r", make_tools(ledger), budget=budget(max_tokens=1000)),
    )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None
    assert "does not report its input and output tokens" in result.detail
    assert "max_tokens=1000" in result.detail
    assert ledger.calls == []  # the reply was not acted on
    step = result.steps[0]
    assert step.model_output == tool_call("submit", answer="x")  # what the model said is kept
    assert result.usage is not None and result.usage.total_tokens is None


async def test_without_a_token_budget_a_reply_without_usage_is_fine() -> None:
    result = await run(
        definition(MemoryStore(), script=[tool_call("submit", answer="x")]),
        request("r", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.SUBMITTED


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "100"])
async def test_a_bad_token_budget_is_refused_before_anything_is_written(bad: Any) -> None:
    store = MemoryStore()
    with pytest.raises(InvalidRequest, match=r"budget\.max_tokens"):
        await run(
            definition(store, script=[]),
            request("r", make_tools(Ledger()), budget=budget(max_tokens=bad)),
        )
    assert (await store.read_log("r")).records == ()


async def test_the_token_budget_is_part_of_the_identity_only_when_set() -> None:
    store = MemoryStore()
    await run(
        definition(store, script=[tool_call("submit", answer="x")]),
        request("plain", make_tools(Ledger())),
    )
    started = (await store.read_log("plain")).records[0]
    assert isinstance(started, RunStarted)
    # A run without a token budget has the snapshot it had before budgets had tokens.
    assert not any("max_tokens" in key for key in started.snapshot)
    with pytest.raises(RunIdentityMismatch, match=r"budget\.max_tokens"):
        await resume(
            definition(store, script=[]),
            request("plain", make_tools(Ledger()), budget=budget(max_tokens=5)),
        )


# Five metered steps: tool, tool, invalid, tool, submit.
def _metered_five() -> list[ModelReply]:
    texts = [
        tool_call("double", n=1),
        tool_call("double", n="two"),
        "this is not JSON",
        tool_call("double", n=3),
        tool_call("submit", answer="6"),
    ]
    return [metered(text, 100 * (i + 1), 7) for i, text in enumerate(texts)]


TOKENS_OF_FOUR = 100 + 200 + 300 + 400 + 4 * 7
# Stopped by the budget after four steps, the run makes 17 writes; let through, 21.
CRASH_POINTS = [(TOKENS_OF_FOUR, k) for k in range(1, 17)] + [
    (TOKENS_OF_FOUR + 1, k) for k in range(1, 21)
]


@pytest.mark.parametrize(("limit", "k"), CRASH_POINTS)
async def test_the_token_count_survives_a_crash_after_every_write(k: int, limit: int) -> None:
    """With a limit of exactly four steps' tokens the fifth call is never made; one more
    token and it is: a resumed run must count the tokens of the steps before the crash."""
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)
    the_request = request("r", tools, budget=budget(max_tokens=limit), model_replay=Replay.ALLOWED)
    expected = await run(definition(MemoryStore(), script=_metered_five()), the_request)
    inner = MemoryStore()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(inner, fail_after_writes=k), script=_metered_five()),
            the_request,
        )
    resumed = await resume(definition(inner, script=_metered_five()), the_request)
    assert same_outcome(resumed, expected)
    assert resumed.usage == expected.usage
    reason = StopReason.TOKEN_LIMIT if limit == TOKENS_OF_FOUR else StopReason.SUBMITTED
    assert expected.stop_reason is reason


async def test_a_log_written_before_reply_facts_resumes_and_sums_nothing() -> None:
    """A client that reports nothing beyond the text writes its records byte for byte as
    the first release did (the fixture tests pin those bytes); such a log, crashed after
    its first step, resumes under a token-free request and sums no usage."""
    store = MemoryStore()
    script = [tool_call("double", n=1), tool_call("submit", answer="2")]
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=5), script=script),
            request("r", make_tools(Ledger())),
        )
    records = (await store.read_log("r")).records
    lines = [json.loads(serialization.dumps(r)) for r in records]
    step = next(line for line in lines if line["kind"] == "step")
    assert not {"finish", "usage", "model", "refusal"} & set(step)
    assert set(lines[2]["payload"]) == {"call_id", "content", "reasoning"}
    resumed = await resume(definition(store, script=script), request("r", make_tools(Ledger())))
    assert resumed.stop_reason is StopReason.SUBMITTED and resumed.resumed
    assert resumed.usage is None


async def test_resuming_a_finished_run_returns_its_usage() -> None:
    store = MemoryStore()
    script = [metered(tool_call("double", n=1), 50, 5), metered(tool_call("submit", answer="2"))]
    first = await run(definition(store, script=script), request("r", make_tools(Ledger())))
    again = await resume(definition(store, script=script), request("r", make_tools(Ledger())))
    assert first.usage == again.usage == Usage(input_tokens=150, output_tokens=15)


async def test_a_model_result_with_an_unreadable_usage_is_a_corrupt_log() -> None:
    """A crash after the model result: resume reads the reply back, and refuses a
    payload whose reported usage cannot be read rather than guessing at it."""
    store = MemoryStore()
    script = [metered(tool_call("double", n=1))]
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=3), script=script),
            request("r", make_tools(Ledger())),
        )
    records = list((await store.read_log("r")).records)
    result = records[-1]
    assert isinstance(result, Result) and isinstance(result.payload, dict)
    broken = dataclasses.replace(result, payload={**result.payload, "usage": {"input_tokens": -1}})
    tampered = MemoryStore()
    await tampered.claim_run("r")
    for record in [*records[:-1], broken]:
        await _write(tampered, record)
    await tampered.release_run("r")
    with pytest.raises(CorruptLog, match=r"model result 'r:0:model': .*Usage.input_tokens"):
        await resume(definition(tampered, script=script), request("r", make_tools(Ledger())))


async def _write(store: MemoryStore, record: Any) -> None:
    if isinstance(record, RunStarted):
        await store.start_run(record)
    elif isinstance(record, Result):
        await store.write_result(record)
    else:
        await store.write_intent(record)
