"""Tests for polyloop.serialization: the record codec, strict in both directions.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit import record as record_kit
from polyloop.serialization import decode, dumps, encode, loads, plain
from polyloop.testing import without_timing
from polyloop.types import (
    ActionStatus,
    Amended,
    CorruptLog,
    DecisionKind,
    FinishReason,
    Intent,
    IntentKind,
    JSONValue,
    PolyLoopError,
    Proposal,
    Record,
    Replay,
    Result,
    RunEnded,
    RunStarted,
    SchemaMajorMismatch,
    Settlement,
    StepRecord,
    StopReason,
    ToolCallBlock,
    UnloggableValue,
    Usage,
    Verdict,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "records" / "v1"
RUN = "exp-7/task-12#3"

# -- realistic records, one per kind (also the expected content of the fixtures) ----------

_AT = datetime(2026, 12, 1, 9, 30, 15, 250000, tzinfo=UTC)

EXPECTED: dict[str, Record] = {
    "run_started": RunStarted(
        run_id=RUN,
        snapshot={
            "model.kind": "scripted",
            "model.name": "demo",
            "interpreter.kind": "json-action",
            "store.kind": "jsonl",
            "store.format": "polyloop/1",
            "events.kind": "null",
            "texts.not_executed": "The action was not executed: {reason}",
            "texts.env_fault": "The environment failed: {detail}",
            "budget.max_steps": 20,
            "budget.max_valid_steps": 10,
            "budget.max_context_chars": 120000,
            "tools": {
                "max_observation_chars": 4000,
                "specs": [
                    {
                        "name": "search",
                        "description": "Search the repository.",
                        "parameters": {
                            "type": "object",
                            "properties": {"q": {"type": "string", "maxLength": 200}},
                            "required": ["q"],
                            "additionalProperties": False,
                        },
                        "replay": "allowed",
                        "completes": False,
                    },
                    {
                        "name": "submit",
                        "description": "Hand in the patch.",
                        "parameters": {"type": "object"},
                        "replay": "never",
                        "completes": True,
                    },
                ],
            },
            "run_context.sha256": "5d41402abc4b2a76b9719d911017c592" * 2,
            "goal_context.sha256": "7d793037a0760186574b0282f2f435e7" * 2,
            "injection.sha256": "44136fa355b3678a1146ad16f7e8649e" * 2,
            "binding.session_id": "sess-41",
            "binding.parent_card_id": "card-9",
            "model_replay": "allowed",
            "observation_template": "Observation:\n{observation}",
            "tool_style": "json",
            "temperature": 0.25,
        },
    ),
    "intent_model_call": record_kit.intent(
        RUN,
        0,
        IntentKind.MODEL_CALL,
        {"messages_sha256": "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"},
        replay=Replay.ALLOWED,
    ),
    "intent_action": record_kit.intent(
        RUN,
        1,
        IntentKind.ACTION,
        {"name": "submit", "arguments": {"patch": "--- a/x.py\n+++ b/x.py\n", "n": 3}},
        action_text='submit(patch="--- a/x.py…")',
        history_text='{"tool": "submit", "arguments": {"patch": "--- a/x.py\\n+++ b/x.py\\n"}}',
    ),
    "result_model_call": record_kit.result(
        RUN,
        0,
        IntentKind.MODEL_CALL,
        {
            "call_id": "chatcmpl-9f8e7d",
            "content": '{"tool": "search", "arguments": {"q": "naïve \\"quote\\""}}',
            "reasoning": "Look for the failing test first. 先找测试。",
        },
    ),
    "result_action": record_kit.result(
        RUN,
        0,
        IntentKind.ACTION,
        {
            "status": "executed",
            "observation": "tests/test_x.py:12: assert 1 == 2\n\ttab and emoji 🙂",
            "synthesized": False,
            "done": False,
            "truncated_chars": 17,
        },
    ),
    "step_action": record_kit.step(
        RUN,
        0,
        call_id="chatcmpl-9f8e7d",
        model_output='{"tool": "search", "arguments": {"q": "naïve \\"quote\\""}}',
        reasoning="Look for the failing test first. 先找测试。",
        history_text='{"tool": "search", "arguments": {"q": "naïve \\"quote\\""}}',
        action_text='search(q="naïve \\"quote\\"")',
        observation="tests/test_x.py:12: assert 1 == 2\n\ttab and emoji 🙂",
        truncated_chars=17,
        duration_s=1.5,
    ),
    "step_final": record_kit.step(
        RUN,
        2,
        call_id="chatcmpl-aa01",
        model_output="FINAL: the bug is in x.py line 12",
        decision=DecisionKind.FINAL,
        history_text="FINAL: the bug is in x.py line 12",
        action_text=None,
        observation=None,
        action_status=None,
        final_answer="the bug is in x.py line 12",
        duration_s=0.125,
    ),
    "step_model_failure": record_kit.step(
        RUN,
        3,
        model_output="",
        decision=DecisionKind.INVALID,
        history_text="",
        action_text=None,
        observation=None,
        action_status=None,
        error="AllSourcesExhausted: every source failed: 429, 503",
        duration_s=30.0,
    ),
    # Added with the reply facts (finish, usage, model, refusal): a compatible change.
    "result_model_call_reported": record_kit.result(
        RUN,
        4,
        IntentKind.MODEL_CALL,
        {
            "call_id": "chatcmpl-bb02",
            "content": '{"tool": "submit", "arguments": {"patch": "--- a/x.py',
            "reasoning": None,
            "finish": "length",
            "usage": {"input_tokens": 1200, "output_tokens": 256, "reasoning_tokens": 64},
            "model": "gpt-4o-mini-2024-07-18",
        },
    ),
    "step_cut_off": record_kit.step(
        RUN,
        4,
        call_id="chatcmpl-bb02",
        model_output='{"tool": "submit", "arguments": {"patch": "--- a/x.py',
        decision=DecisionKind.INVALID,
        history_text='{"tool": "submit", "arguments": {"patch": "--- a/x.py',
        action_text=None,
        observation="Your reply was cut off at the length limit before it ended.",
        observation_synthesized=True,
        action_status=None,
        duration_s=2.0,
        finish=FinishReason.LENGTH,
        usage=Usage(input_tokens=1200, output_tokens=256, reasoning_tokens=64),
        model="gpt-4o-mini-2024-07-18",
    ),
    "step_refusal": record_kit.step(
        RUN,
        5,
        call_id="chatcmpl-cc03",
        model_output="",
        decision=DecisionKind.INVALID,
        history_text="I can't help with that.",
        action_text=None,
        observation="Your reply was a refusal: I can't help with that. Nothing was run.",
        observation_synthesized=True,
        action_status=None,
        duration_s=0.5,
        finish=FinishReason.REFUSAL,
        usage=Usage(input_tokens=1300, output_tokens=9),
        refusal="I can't help with that.",
    ),
    # Added with native tool calls: a compatible change.
    "result_model_call_native": record_kit.result(
        RUN,
        6,
        IntentKind.MODEL_CALL,
        {
            "call_id": "chatcmpl-dd04",
            "content": "Searching first.",
            "reasoning": None,
            "finish": "tool_calls",
            "tool_calls": [{"call_id": "call_Xy7", "name": "search", "arguments": {"q": "x.py"}}],
        },
    ),
    "intent_action_native": record_kit.intent(
        RUN,
        6,
        IntentKind.ACTION,
        {"name": "search", "arguments": {"q": "x.py"}},
        replay=Replay.ALLOWED,
        action_text='search({"q": "x.py"})',
        history_text="Searching first.",
        tool_call=ToolCallBlock(call_id="call_Xy7", name="search", arguments={"q": "x.py"}),
    ),
    "step_native": record_kit.step(
        RUN,
        6,
        call_id="chatcmpl-dd04",
        model_output="Searching first.",
        history_text="Searching first.",
        action_text='search({"q": "x.py"})',
        observation="x.py:12: def f():",
        duration_s=0.25,
        finish=FinishReason.TOOL_CALLS,
        tool_call=ToolCallBlock(call_id="call_Xy7", name="search", arguments={"q": "x.py"}),
    ),
    "run_ended": RunEnded(
        run_id=RUN,
        stop_reason=StopReason.FINAL_ANSWER,
        final_answer="the bug is in x.py line 12",
        steps=3,
        valid_steps=2,
        detail=None,
    ),
    # When each record was written, and how long the calls took (added later).
    "run_started_timed": RunStarted(run_id=RUN, snapshot={"model.name": "gpt-4o-mini"}, at=_AT),
    "intent_action_timed": record_kit.intent(
        RUN,
        7,
        IntentKind.ACTION,
        {"name": "submit", "arguments": {"patch": ""}},
        action_text="submit()",
        history_text="Submitting.",
        at=_AT,
    ),
    "result_model_call_timed": record_kit.result(
        RUN,
        7,
        IntentKind.MODEL_CALL,
        {"call_id": "chatcmpl-ee05", "content": "Submitting.", "reasoning": None},
        at=_AT,
        duration_s=0.8125,
    ),
    "result_action_timed": record_kit.result(
        RUN,
        7,
        IntentKind.ACTION,
        {"status": "executed", "observation": "submitted", "done": True},
        at=_AT,
        duration_s=0.0625,
    ),
    "step_timed": record_kit.step(
        RUN,
        7,
        call_id="chatcmpl-ee05",
        model_output="Submitting.",
        history_text="Submitting.",
        action_text="submit()",
        observation="submitted",
        done=True,
        duration_s=0.875,
        at=_AT,
        model_duration_s=0.8125,
        action_duration_s=0.0625,
        resumed=True,
    ),
    "run_ended_timed": RunEnded(
        run_id=RUN,
        stop_reason=StopReason.SUBMITTED,
        final_answer=None,
        steps=8,
        valid_steps=8,
        detail=None,
        at=_AT,
    ),
}

# issue 19: a person in the loop. Added later, under the same rule as the others.
_PERSON_AT = datetime(2026, 12, 1, 22, 0, 0, 123456, tzinfo=UTC)
EXPECTED.update(
    {
        "proposal": Proposal(
            run_id=RUN,
            result_id=f"{RUN}:2:action",
            step=2,
            replay=Replay.NEVER,
            payload={"name": "deploy", "arguments": {"env": "prod"}},
            action_text='deploy({"env": "prod"})',
            history_text="Deploying now.",
            description="Deploy the build to an environment.",
            at=_PERSON_AT,
        ),
        "verdict_approved": Verdict(
            run_id=RUN,
            result_id=f"{RUN}:2:action",
            approved=True,
            by="alice",
            payload={"name": "deploy", "arguments": {"env": "staging"}},
            reason=None,
            at=_PERSON_AT,
        ),
        "verdict_rejected": Verdict(
            run_id=RUN,
            result_id=f"{RUN}:2:action",
            approved=False,
            by="bob",
            payload=None,
            reason="not on a Friday",
            at=_PERSON_AT,
        ),
        "settlement": Settlement(
            run_id=RUN,
            result_id=f"{RUN}:1:action",
            ran=True,
            observation="paid: receipt 7731",
            by="carol",
            at=_PERSON_AT,
        ),
        # A run started through an agent: the agent's name and the input its request
        # was built from, so that any host of the agent can build the request again.
        "run_started_agent": RunStarted(
            run_id="INV-2041",
            snapshot={"model.name": "gpt-4o-mini"},
            at=_AT,
            agent="invoices",
            input={"invoice": "INV-2041", "amount_cents": 129900, "notes": ["rush", None]},
        ),
        # A fork's start record: its source, its step, the digest, and the two steps it
        # took over (one of them timed and with a native tool call), with its run id.
        "run_started_fork": RunStarted(
            run_id="exp-7/task-12#3/fork-b",
            snapshot={"model.name": "gpt-4o"},
            at=_AT,
            forked_from=RUN,
            forked_at_step=2,
            inherited_sha256="5f0c" * 16,
            inherited=(
                record_kit.step(
                    "exp-7/task-12#3/fork-b",
                    0,
                    call_id="c-1",
                    model_output="Reading.",
                    history_text="Reading.",
                    action_text='read({"path": "a.txt"})',
                    observation="hello",
                    duration_s=0.25,
                ),
                record_kit.step(
                    "exp-7/task-12#3/fork-b",
                    1,
                    call_id="c-2",
                    model_output="Doubling.",
                    history_text="Doubling.",
                    action_text='double({"n": 2})',
                    observation="4",
                    duration_s=0.5,
                    at=_AT,
                    model_duration_s=0.375,
                    action_duration_s=0.125,
                    tool_call=ToolCallBlock(call_id="t-9", name="double", arguments={"n": 2}),
                ),
            ),
        ),
        # A settlement a tool's probe wrote, with how long the probe took.
        "settlement_reconciled": Settlement(
            run_id=RUN,
            result_id=f"{RUN}:1:action",
            ran=False,
            observation="no payment under this key; it is now void",
            by="reconcile:pay",
            at=_PERSON_AT,
            duration_s=0.042,
        ),
        "step_settled": record_kit.step(
            RUN,
            1,
            call_id="c-2",
            model_output="Paying.",
            history_text="Paying.",
            action_text='pay({"amount": 5})',
            observation="paid: receipt 7731",
            duration_s=0.5,
            settled_by="carol",
        ),
        # A call a person edited before approving it: what ran, and what was proposed.
        "intent_action_edited": Intent(
            run_id=RUN,
            result_id=f"{RUN}:2:action",
            kind=IntentKind.ACTION,
            step=2,
            call_index=2,
            replay=Replay.NEVER,
            payload={"name": "deploy", "arguments": {"env": "staging"}},
            action_text='deploy({"env": "staging"})',
            history_text="Deploying now.",
            edited_by="alice",
            proposed_action_text='deploy({"env": "prod"})',
        ),
        "step_edited": record_kit.step(
            RUN,
            2,
            call_id="c-3",
            model_output="Deploying now.",
            history_text="Deploying now.",
            action_text='deploy({"env": "staging"})',
            observation="deployed to staging",
            duration_s=0.5,
            edited_by="alice",
            proposed_action_text='deploy({"env": "prod"})',
        ),
        "run_ended_awaiting_approval": RunEnded(
            run_id=RUN,
            stop_reason=StopReason.AWAITING_APPROVAL,
            final_answer=None,
            steps=2,
            valid_steps=1,
            detail="action waits for a person",
        ),
        # An action never replayed whose tool's probe could settle it, were it in doubt.
        "intent_action_reconciles": record_kit.intent(
            RUN,
            1,
            IntentKind.ACTION,
            {"name": "pay", "arguments": {"invoice": "INV-2041", "amount_cents": 4250}},
            action_text='pay({"invoice": "INV-2041", "amount_cents": 4250})',
            history_text='{"tool": "pay", "arguments": {"invoice": "INV-2041"}}',
            at=_AT,
            reconciles=True,
        ),
    }
)

# issue 44, part 3: a run a person cancelled; who asked is written only when set.
EXPECTED["run_ended_cancelled_by_request"] = RunEnded(
    run_id=RUN,
    stop_reason=StopReason.CANCELLED_BY_REQUEST,
    final_answer=None,
    steps=3,
    valid_steps=2,
    detail="wrong customer: stop before it pays anyone",
    at=_PERSON_AT,
    cancelled_by="dana",
)

# issue 48: a run going on under a changed definition, as a person accepted it. A kind
# the format's first releases do not know, so it says "polyloop/1.2" (record 0074).
EXPECTED["amended"] = Amended(
    run_id=RUN,
    step=2,
    by="ops@example.com",
    reason="deploy 2026-12-02: clearer deploy description and system prompt",
    changes={
        "run_context.sha256": {"recorded": "a" * 64, "amended": "b" * 64},
        "binding.region": {"amended": "eu-west-1"},
        "binding.shard": {"recorded": "7"},
    },
    at=_PERSON_AT,
)

# issue 48: a fork's start record also holds the snapshot its source held at the fork's
# step (amended there, so it differs from the fork's own); written only when set.
EXPECTED["run_started_fork_snapshot"] = dataclasses.replace(
    EXPECTED["run_started_fork"],
    inherited_snapshot={"model.name": "gpt-4o-mini", "run_context.sha256": "b" * 64},
)

# The step of ``step_timed`` as a store writes it after its action's result: it names the
# result's observation rather than copying it (record 0063), and reads back only after it.
EXPECTED["step_observation_of"] = EXPECTED["step_timed"]
AFTER = {"step_observation_of": "result_action_timed"}


def after_of(name: str) -> Record | None:
    """The record a fixture's record is written and read after, if any."""
    return EXPECTED[AFTER[name]] if name in AFTER else None


def one_of_each() -> list[Any]:
    return [pytest.param(record, id=name) for name, record in EXPECTED.items()]


def encoded(name: str) -> dict[str, Any]:
    return encode(EXPECTED[name])


def line_of(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("record", one_of_each())
def test_round_trip_each_kind(record: Record) -> None:
    line = dumps(record)
    assert loads(line) == record
    assert loads(line.encode("utf-8")) == record
    assert decode(encode(record)) == record
    assert type(loads(line)) is type(record)
    assert dumps(loads(line)) == line


@pytest.mark.parametrize("record", one_of_each())
def test_encoded_shape(record: Record) -> None:
    data = encode(record)
    # A kind added after the major's first release names the minor that added it.
    assert data["schema"] == ("polyloop/1.2" if isinstance(record, Amended) else "polyloop/1")
    assert data["kind"] in {
        "run_started",
        "intent",
        "result",
        "step",
        "run_ended",
        "proposal",
        "verdict",
        "settlement",
        "amended",
    }
    assert json.loads(dumps(record)) == data
    # A plain JSON document: it survives the stdlib's own strict round trip.
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_intent_and_result_carry_their_kind_as_intent_kind() -> None:
    data = encoded("intent_model_call")
    assert data["kind"] == "intent"
    assert data["intent_kind"] == "model_call"
    assert encoded("result_action")["intent_kind"] == "action"


def test_dumps_is_canonical_json() -> None:
    line = dumps(EXPECTED["result_model_call"])
    data = json.loads(line)
    assert line == json.dumps(data, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    assert "先找测试" in line  # UTF-8, not \u escapes
    small = RunEnded(
        run_id="r",
        stop_reason=StopReason.CANCELLED,
        final_answer=None,
        steps=1,
        valid_steps=0,
        detail="é\n",
    )
    assert dumps(small) == (
        '{"detail":"é\\n","final_answer":null,"kind":"run_ended","run_id":"r",'
        '"schema":"polyloop/1","steps":1,"stop_reason":"cancelled","valid_steps":0}'
    )


def test_lone_surrogate_falls_back_to_ascii_escapes() -> None:
    record = Result(
        run_id="r",
        result_id="r:0:model",
        kind=IntentKind.MODEL_CALL,
        payload={"content": "ok \ud83d then é"},
    )
    line = dumps(record)
    line.encode("utf-8")  # valid UTF-8 text
    assert line.isascii()
    assert "\\ud83d" in line
    assert loads(line) == record
    assert dumps(loads(line)) == line


def test_tuples_are_written_as_lists() -> None:
    record = Result(
        run_id="r", result_id="r:0:action", kind=IntentKind.ACTION, payload={"xs": (1, (2, 3))}
    )  # type: ignore[dict-item]
    assert loads(dumps(record)).payload == {"xs": [1, [2, 3]]}  # type: ignore[union-attr]


def test_integer_at_the_digit_limit_round_trips() -> None:
    biggest = 10**4300 - 1  # 4,300 digits
    record = Result(
        run_id="r", result_id="r:0:action", kind=IntentKind.ACTION, payload=[biggest, -biggest]
    )
    assert loads(dumps(record)) == record


def test_defaulted_fields_may_be_absent() -> None:
    data = encoded("intent_action")
    del data["action_text"], data["history_text"]
    intent = decode(data)
    assert isinstance(intent, Intent)
    assert intent.action_text is None
    assert intent.history_text is None
    step = encoded("step_final")
    del step["final_answer"], step["duration_s"]
    record = decode(step)
    assert isinstance(record, StepRecord)
    assert record.final_answer is None
    assert record.duration_s is None


def test_integral_duration_reads_as_float() -> None:
    data = encoded("step_action")
    data["duration_s"] = 2
    record = decode(data)
    assert isinstance(record, StepRecord)
    assert record.duration_s == 2.0
    assert isinstance(record.duration_s, float)


# -- hypothesis: arbitrary records of all five kinds --------------------------------------

characters = st.one_of(
    st.characters(max_codepoint=0x1F),  # control characters
    st.characters(max_codepoint=0x7F),
    st.characters(min_codepoint=0x80),  # non-ASCII, including U+2028, U+0085
    st.characters(categories=["Cs"]),  # lone surrogates
)
texts = st.text(alphabet=characters, max_size=20)
big_ints = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**4300 - 1, -(10**4300 - 1)])
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
json_values: st.SearchStrategy[JSONValue] = st.recursive(
    st.none() | st.booleans() | st.integers() | big_ints | finite_floats | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
snapshots = st.dictionaries(texts, json_values, max_size=5)
counts = st.integers(min_value=0, max_value=2**40)
opt_texts = st.none() | texts

run_started = st.builds(RunStarted, run_id=texts, snapshot=snapshots)
intents = st.builds(
    Intent,
    run_id=texts,
    result_id=texts,
    kind=st.sampled_from(IntentKind),
    step=counts,
    call_index=counts,
    replay=st.sampled_from(Replay),
    payload=json_values,
    action_text=opt_texts,
    history_text=opt_texts,
)
results = st.builds(
    Result, run_id=texts, result_id=texts, kind=st.sampled_from(IntentKind), payload=json_values
)
steps = st.builds(
    StepRecord,
    run_id=texts,
    step=counts,
    call_id=opt_texts,
    model_output=texts,
    reasoning=opt_texts,
    decision=st.sampled_from(DecisionKind),
    history_text=texts,
    action_text=opt_texts,
    observation=opt_texts,
    observation_synthesized=st.booleans(),
    action_status=st.none() | st.sampled_from(ActionStatus),
    done=st.booleans(),
    truncated_chars=counts,
    error=opt_texts,
    final_answer=opt_texts,
    duration_s=st.none() | finite_floats,
)
run_ended = st.builds(
    RunEnded,
    run_id=texts,
    stop_reason=st.sampled_from(StopReason),
    final_answer=opt_texts,
    steps=counts,
    valid_steps=counts,
    detail=opt_texts,
)
records: st.SearchStrategy[Record] = st.one_of(run_started, intents, results, steps, run_ended)


@given(records)
def test_any_record_round_trips_exactly(record: Record) -> None:
    line = dumps(record)
    assert loads(line) == record
    assert decode(encode(record)) == record
    assert "\n" not in line
    assert "\r" not in line
    raw = line.encode("utf-8")  # valid UTF-8
    assert raw.splitlines() == [raw]  # one line for any byte-oriented line reader
    assert loads(raw) == record
    assert dumps(loads(line)) == line  # canonical: stable under a second round trip
    assert json.loads(line)["schema"] == "polyloop/1"


@given(records)
def test_encode_is_plain_json(record: Record) -> None:
    data = encode(record)
    # Plain JSON types only: the strict stdlib encoder accepts it as is.
    text = json.dumps(data, allow_nan=False, ensure_ascii=True)
    assert decode(json.loads(text)) == record


# -- refusals when writing ----------------------------------------------------------------


def _result(payload: Any) -> Result:
    return Result(run_id="r-9", result_id="r-9:0:action", kind=IntentKind.ACTION, payload=payload)


class _Opaque:
    pass


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(math.nan, id="nan"),
        pytest.param(math.inf, id="inf"),
        pytest.param(-math.inf, id="minus-inf"),
        pytest.param({"a": [1, {"b": math.nan}]}, id="nested-nan"),
        pytest.param(10**4999, id="int-of-5000-digits"),
        pytest.param(-(10**4999), id="negative-int-of-5000-digits"),
        pytest.param(10**4300, id="int-of-4301-digits"),
        pytest.param({1: "x"}, id="int-key"),
        pytest.param({None: "x"}, id="none-key"),
        pytest.param({("a",): "x"}, id="tuple-key"),
        pytest.param({"ok": {2.5: "x"}}, id="nested-float-key"),
        pytest.param({1, 2}, id="set"),
        pytest.param(frozenset(), id="frozenset"),
        pytest.param(b"bytes", id="bytes"),
        pytest.param(_Opaque(), id="object"),
        pytest.param([1, 2, _Opaque()], id="object-in-list"),
        pytest.param(1 + 2j, id="complex"),
    ],
)
def test_unloggable_payloads_are_refused(payload: Any) -> None:
    record = _result(payload)
    for write in (encode, dumps):
        with pytest.raises(UnloggableValue) as caught:
            write(record)
        error = caught.value
        assert isinstance(error, PolyLoopError)
        assert isinstance(error, ValueError)
        assert error.run_id == "r-9"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_unloggable_snapshot_and_duration(value: float) -> None:
    with pytest.raises(UnloggableValue):
        dumps(RunStarted(run_id="r", snapshot={"temperature": value}))
    step = dataclasses.replace(EXPECTED["step_action"], duration_s=value)  # type: ignore[type-var]
    with pytest.raises(UnloggableValue) as caught:
        dumps(step)
    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, PolyLoopError)


def test_too_deep_payload_is_refused() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(UnloggableValue, match="nested more than 256 levels"):
        dumps(_result(deep))


# -- what strict JSON cannot carry, refused on the way out ----------------------------------

UNLOGGABLE = {
    "nan": float("nan"),
    "infinity": float("inf"),
    "minus-infinity": float("-inf"),
    "nan-in-a-list": [1, float("nan")],
    "integer-of-5000-digits": 10**4_999,
    "non-string-key": {1: "x"},
}


@pytest.mark.parametrize("value", list(UNLOGGABLE.values()), ids=list(UNLOGGABLE))
def test_dumps_refuses_what_strict_json_cannot_carry(value: Any) -> None:
    result = Result(
        run_id="r", result_id="r:0:model", kind=IntentKind.MODEL_CALL, payload={"value": value}
    )
    with pytest.raises(UnloggableValue) as refused:
        dumps(result)
    assert isinstance(refused.value, PolyLoopError) and isinstance(refused.value, ValueError)
    assert refused.value.run_id == "r"


class RepeatedKeys(Mapping[str, Any]):
    """A mapping whose items name one key twice: an object with duplicate keys."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs

    def __getitem__(self, key: str) -> Any:
        return next(value for name, value in self.pairs if name == key)

    def __iter__(self) -> Iterator[str]:
        return iter([name for name, _ in self.pairs])

    def __len__(self) -> int:
        return len(self.pairs)

    def items(self) -> Any:
        return list(self.pairs)


def test_dumps_refuses_an_object_with_duplicate_keys() -> None:
    result = Result(
        run_id="r",
        result_id="r:0:model",
        kind=IntentKind.MODEL_CALL,
        payload={"outer": RepeatedKeys([("a", 1), ("a", 2)])},
    )
    with pytest.raises(UnloggableValue):
        dumps(result)


@pytest.mark.parametrize("duration", [float("nan"), float("inf")], ids=["nan", "infinity"])
def test_dumps_refuses_a_non_finite_typed_float(duration: float) -> None:
    with pytest.raises(UnloggableValue):
        dumps(record_kit.step(duration_s=duration))


class _Label(str):
    """A str subclass: plain() keeps it."""


_plain_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.builds(_Label, st.text())
    | st.sampled_from([4299, 4300, 5000]).map(lambda n: -(10**n))
)
_plain_values = st.recursive(
    _plain_leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=3) | st.integers(0, 3), inner, max_size=4)
    ),
    max_leaves=25,
)


def _plain_outcome(value: Any) -> tuple[str, Any]:
    try:
        return "copied", repr(plain(value, owner="Intent", field="payload", run_id="r"))
    except UnloggableValue as exc:
        return "refused", (str(exc), exc.run_id)


@given(_plain_values)
def test_plain_treats_any_mapping_as_a_dict(value: Any) -> None:
    as_dict = _plain_outcome({"v": value})
    as_mapping = _plain_outcome(MappingProxyType({"v": value}))
    assert as_dict == as_mapping


@pytest.mark.parametrize("depth", [255, 256, 257])
def test_plain_depth_limit_is_the_same_for_any_mapping(depth: int) -> None:
    nested: Any = "leaf"
    for _ in range(depth):
        nested = {"k": [nested]}
    assert _plain_outcome({"v": nested}) == _plain_outcome(MappingProxyType({"v": nested}))


def test_not_a_record_is_refused() -> None:
    with pytest.raises(UnloggableValue):
        encode({"schema": "polyloop/1"})  # type: ignore[arg-type]


# -- rejections when reading --------------------------------------------------------------


def _with(name: str, **changes: Any) -> str:
    return line_of({**encoded(name), **changes})


def _without(name: str, key: str) -> str:
    data = encoded(name)
    del data[key]
    return line_of(data)


def _payload_literal(literal: str) -> str:
    """A valid result line whose payload is the given raw JSON text."""
    base = line_of({**encoded("result_action"), "payload": "@@"})
    return base.replace('"@@"', literal)


REQUIRED = {
    "run_started": ["run_id", "snapshot"],
    "intent_model_call": [
        "run_id",
        "result_id",
        "intent_kind",
        "step",
        "call_index",
        "replay",
        "payload",
    ],
    "result_model_call": ["run_id", "result_id", "intent_kind", "payload"],
    "step_action": [
        "run_id",
        "step",
        "call_id",
        "model_output",
        "reasoning",
        "decision",
        "history_text",
        "action_text",
        "observation",
        "observation_synthesized",
        "action_status",
        "done",
        "truncated_chars",
        "error",
    ],
    "run_ended": ["run_id", "stop_reason", "final_answer", "steps", "valid_steps", "detail"],
}

CORRUPT_LINES = [
    pytest.param("{}", id="empty-object"),
    pytest.param("[]", id="array"),
    pytest.param('"run_started"', id="string"),
    pytest.param("1", id="number"),
    pytest.param("null", id="null"),
    pytest.param("true", id="true"),
    pytest.param("", id="empty-line"),
    pytest.param("not json", id="not-json"),
    pytest.param('{"schema":"polyloop/1","kind":', id="truncated"),
    pytest.param(dumps(EXPECTED["run_ended"]) + "x", id="trailing-garbage"),
    pytest.param(dumps(EXPECTED["run_ended"]) * 2, id="two-records-on-one-line"),
    pytest.param(
        dumps(EXPECTED["run_ended"]).replace('"steps":3', '"steps":3,"steps":4'),
        id="duplicate-top-level-key",
    ),
    pytest.param(_payload_literal('{"a":1,"a":1}'), id="duplicate-nested-key"),
    pytest.param(_payload_literal("NaN"), id="nan-literal"),
    pytest.param(_payload_literal("Infinity"), id="infinity-literal"),
    pytest.param(_payload_literal("-Infinity"), id="minus-infinity-literal"),
    pytest.param(_payload_literal("[1e400]"), id="overflowing-float"),
    pytest.param(_payload_literal("-1e400"), id="overflowing-negative-float"),
    pytest.param(
        _with("step_action", duration_s="@").replace('"@"', "1e999"), id="overflowing-duration"
    ),
    pytest.param(_payload_literal("1" * 5000), id="int-literal-of-5000-digits"),
    pytest.param(_payload_literal("[" * 100_000 + "]" * 100_000), id="too-deep"),
    *[
        pytest.param(_without(name, key), id=f"missing-{name}-{key}")
        for name, keys in REQUIRED.items()
        for key in keys
    ],
    pytest.param(_without("run_ended", "kind"), id="missing-kind"),
    pytest.param(_without("run_ended", "schema"), id="missing-schema"),
    pytest.param(_with("run_ended", schema=None), id="null-schema"),
    pytest.param(_with("run_ended", schema=1), id="numeric-schema"),
    pytest.param(_with("run_ended", schema="other/1"), id="foreign-schema"),
    pytest.param(_with("run_ended", schema="polyloop/"), id="schema-without-major"),
    pytest.param(_with("run_ended", schema="polyloop/one"), id="schema-word-major"),
    pytest.param(_with("intent_action", step="1"), id="step-as-string"),
    pytest.param(_with("intent_action", step=1.0), id="step-as-float"),
    pytest.param(_with("intent_action", call_index=None), id="call-index-null"),
    pytest.param(_with("run_ended", steps=True), id="bool-where-int"),
    pytest.param(_with("step_action", done=1), id="int-where-bool"),
    pytest.param(_with("step_action", observation_synthesized="false"), id="str-where-bool"),
    pytest.param(_with("step_action", truncated_chars=1.5), id="float-where-int"),
    pytest.param(_with("step_action", duration_s="1.5"), id="str-where-float"),
    pytest.param(_with("step_action", duration_s=True), id="bool-where-float"),
    pytest.param(_with("step_action", model_output=None), id="null-where-str"),
    pytest.param(_with("step_action", call_id=7), id="int-where-optional-str"),
    pytest.param(_with("run_started", run_id=["r"]), id="list-run-id"),
    pytest.param(_with("run_started", snapshot=[]), id="snapshot-not-object"),
    pytest.param(_with("run_started", snapshot=None), id="snapshot-null"),
    pytest.param(_with("run_ended", kind="checkpoint"), id="unknown-kind"),
    pytest.param(_with("run_ended", kind=None), id="null-kind"),
    pytest.param(_with("run_ended", kind="Run_Ended"), id="kind-wrong-case"),
    pytest.param(_with("run_ended", stop_reason="timeout"), id="unknown-stop-reason"),
    pytest.param(_with("run_ended", stop_reason="STEP_LIMIT"), id="enum-name-not-value"),
    pytest.param(_with("run_ended", stop_reason=None), id="null-stop-reason"),
    pytest.param(_with("intent_action", intent_kind="tool"), id="unknown-intent-kind"),
    pytest.param(_with("intent_action", replay="sometimes"), id="unknown-replay"),
    pytest.param(_with("intent_action", replay=["never"]), id="unhashable-enum-value"),
    pytest.param(_with("step_action", decision="maybe"), id="unknown-decision"),
    pytest.param(_with("step_action", action_status="ok"), id="unknown-action-status"),
]


@pytest.mark.parametrize("line", CORRUPT_LINES)
def test_corrupt_lines_are_rejected(line: str) -> None:
    with pytest.raises(CorruptLog) as caught:
        loads(line)
    assert type(caught.value) is CorruptLog
    assert isinstance(caught.value, ValueError)


def test_duplicate_keys_are_named_once_however_many_keys_the_line_has() -> None:
    # Each repeated key named once, in order, on a line of many keys.
    keys = [f"k{n}" for n in range(20_000)]
    line = "{" + ", ".join(f'"{key}": 0' for key in [*keys, "k7", "k7", "k9"]) + "}"
    with pytest.raises(CorruptLog, match=re.escape("duplicate keys ['k7', 'k9']")):
        loads(line)


def test_invalid_utf8_bytes_are_rejected() -> None:
    raw = dumps(EXPECTED["run_ended"]).encode("utf-8").replace(b"x.py", b"x\xff.py")
    with pytest.raises(CorruptLog):
        loads(raw)


@pytest.mark.parametrize("schema", ["polyloop/2", "polyloop/0", "polyloop/2.0", "polyloop/10"])
def test_other_major_is_schema_major_mismatch(schema: str) -> None:
    line = _with("run_ended", schema=schema)
    with pytest.raises(SchemaMajorMismatch) as caught:
        loads(line, location="runs/x.jsonl:4")
    error = caught.value
    assert type(error) is SchemaMajorMismatch
    assert not isinstance(error, CorruptLog)
    assert isinstance(error, PolyLoopError)
    assert error.location == "runs/x.jsonl:4"
    assert error.run_id == RUN
    assert schema in str(error)
    assert "runs/x.jsonl:4" in str(error)


def test_other_major_wins_over_unknown_kind_and_fields() -> None:
    # A later major may have new kinds and fields: say "other major", not "corrupt".
    line = line_of({"schema": "polyloop/2", "kind": "checkpoint", "what": 1})
    with pytest.raises(SchemaMajorMismatch):
        loads(line)


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("not json", id="bad-json"),
        pytest.param("{}", id="empty-object"),
        pytest.param(_with("run_ended", steps="3"), id="mistyped"),
    ],
)
def test_location_is_reported(line: str) -> None:
    with pytest.raises(CorruptLog) as caught:
        loads(line, location="store/run.jsonl:17")
    assert caught.value.location == "store/run.jsonl:17"
    assert "store/run.jsonl:17" in str(caught.value)


def test_run_id_is_reported_when_readable() -> None:
    with pytest.raises(CorruptLog) as caught:
        loads(_with("run_ended", steps="3"))
    assert caught.value.run_id == RUN
    assert repr(RUN) in str(caught.value)
    assert "steps" in str(caught.value)


def test_decode_rejects_a_non_mapping() -> None:
    with pytest.raises(CorruptLog):
        decode([1, 2], location="row 3")  # type: ignore[arg-type]


# -- forward compatibility ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(EXPECTED))
def test_unknown_extra_fields_are_ignored(name: str) -> None:
    line = _with(name, added_in_1_4={"anything": [1, 2]}, flag=True)
    assert loads(line) == EXPECTED[name]


@pytest.mark.parametrize("schema", ["polyloop/1.7", "polyloop/1.0", "polyloop/1"])
def test_minor_versions_of_major_1_decode(schema: str) -> None:
    assert loads(_with("step_action", schema=schema)) == EXPECTED["step_action"]


# -- versioned fixtures: what was written by v1 must decode forever ------------------------


def test_fixture_folder_holds_one_file_per_expected_record() -> None:
    names = {path.stem for path in FIXTURES.glob("*.json")}
    assert names == set(EXPECTED)
    assert (FIXTURES / "README.md").is_file()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fixture_decodes_to_expected_record(name: str) -> None:
    raw = (FIXTURES / f"{name}.json").read_bytes()
    text = raw.decode("utf-8")
    assert text.endswith("\n")
    assert text.count("\n") == 1, "one record, one line"
    after = after_of(name)
    assert loads(text.rstrip("\n"), location=f"{name}.json", after=after) == EXPECTED[name]
    assert loads(raw, after=after) == EXPECTED[name]


def test_every_fixture_file_decodes() -> None:
    decoded = {
        path.stem: loads(path.read_bytes(), location=str(path), after=after_of(path.stem))
        for path in sorted(FIXTURES.glob("*.json"))
    }
    assert decoded == EXPECTED


@pytest.mark.parametrize("name", list(EXPECTED))
def test_dumps_still_writes_the_fixture(name: str) -> None:
    """An accidental change of the written format is caught here (the fixture files
    themselves must not be edited: a new format gets new fixtures next to these)."""
    text = (FIXTURES / f"{name}.json").read_bytes().decode("utf-8")
    assert dumps(EXPECTED[name], after=after_of(name)) + "\n" == text


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_field_of_a_record_is_written_and_read(name: str) -> None:
    """The format's field table comes from the record dataclasses: a field added there
    is written and read with no other edit."""
    record = EXPECTED[name]
    # Fields added after the first release are left out while None (record-format.md).
    fields = {
        f.name
        for f in dataclasses.fields(record)
        if not (f.metadata.get("written_when_set") and getattr(record, f.name) is None)
    }
    data = encode(record)
    assert set(data) == {"schema", "kind"} | {"intent_kind" if f == "kind" else f for f in fields}
    assert decode(data) == record


class _Text(str):
    """A str subclass, where a record field holds a str."""


@pytest.mark.parametrize("name", list(EXPECTED))
def test_values_that_merely_convert_encode_like_exact_ones(name: str) -> None:
    """A str subclass, an enum given by its value, an int where a float is expected:
    each is written exactly as the value of the field's own type."""
    record = EXPECTED[name]
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if type(value) is str:
            changes[field.name] = _Text(value)
        elif isinstance(value, enum.Enum):
            changes[field.name] = value.value
        elif type(value) is float and value.is_integer():
            changes[field.name] = int(value)
    assert changes, "every fixture has a field to convert"
    careful = dataclasses.replace(record, **changes)
    assert encode(careful) == encode(record)
    assert dumps(careful) == dumps(record)


# -- dumps never writes a line that loads refuses (SPEC 12.17) ---------------------------


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        pytest.param("step_action", {"done": 1}, id="int-done"),
        pytest.param("step_final", {"final_answer": 42}, id="int-final-answer"),
        pytest.param("step_action", {"truncated_chars": 1.0}, id="float-truncated-chars"),
        pytest.param("run_ended", {"steps": True}, id="bool-steps"),
        pytest.param("intent_action", {"action_text": 7}, id="int-action-text"),
    ],
)
def test_dumps_refuses_what_loads_would_refuse(name: str, changes: dict[str, Any]) -> None:
    record = dataclasses.replace(EXPECTED[name], **changes)  # type: ignore[type-var]
    with pytest.raises(UnloggableValue, match=next(iter(changes))):
        dumps(record)


# -- the written line is canonical JSON ---------------------------------------------------


def _canonical_line(record: Record) -> str:
    """The encoded record as canonical JSON, made safe for line readers."""
    data = encode(record)
    line = json.dumps(
        data, ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":")
    )
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(
            data, ensure_ascii=True, allow_nan=False, sort_keys=True, separators=(",", ":")
        )
    for raw, escaped in {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}.items():
        line = line.replace(raw, escaped)
    return line


@given(st.one_of(intents, results, steps))
def test_dumps_writes_the_canonical_json_of_encode(record: Record) -> None:
    """Sorted keys, no spaces, raw UTF-8, line separators escaped, for any content."""
    assert dumps(record) == _canonical_line(record)


# -- the reply facts added after the first release ---------------------------------------------


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        pytest.param({"finish": "truncated"}, "step.finish must be", id="unknown-finish"),
        pytest.param({"usage": [1, 2]}, "step.usage must be", id="usage-not-an-object"),
        pytest.param({"usage": {"input_tokens": -3}}, "Usage.input_tokens", id="negative-count"),
        pytest.param({"usage": {"output_tokens": 1.5}}, "Usage.output_tokens", id="float-count"),
        pytest.param({"model": 7}, "step.model must be", id="model-not-a-string"),
    ],
)
def test_a_bad_reply_fact_in_a_step_line_is_refused(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(CorruptLog, match=re.escape(says)) as caught:
        loads(_with("step_cut_off", **changes), location="runs/r.jsonl:5")
    assert caught.value.run_id == RUN
    assert caught.value.location == "runs/r.jsonl:5"


def test_usage_counts_a_later_minor_adds_are_ignored() -> None:
    usage = {"input_tokens": 1, "output_tokens": 2, "reasoning_tokens": None, "cached": 9}
    step = loads(_with("step_cut_off", usage=usage))
    assert isinstance(step, StepRecord)
    assert step.usage == Usage(input_tokens=1, output_tokens=2)


def test_a_step_without_the_later_fields_reads_them_as_none() -> None:
    step = loads((FIXTURES / "step_action.json").read_bytes())
    assert isinstance(step, StepRecord)
    assert (step.finish, step.usage, step.model, step.refusal) == (None, None, None, None)


# -- times ---------------------------------------------------------------------------------


def test_a_time_is_written_in_utc_to_the_microsecond_with_a_z() -> None:
    assert encoded("step_timed")["at"] == "2026-12-01T09:30:15.250000Z"
    plus_two = timezone(timedelta(hours=2))
    shifted = dataclasses.replace(EXPECTED["run_ended_timed"], at=_AT.astimezone(plus_two))
    assert encode(shifted)["at"] == "2026-12-01T09:30:15.250000Z"


@pytest.mark.parametrize(
    "text", ["2026-12-01T11:30:15.25+02:00", "2026-12-01T09:30:15.250000+00:00"]
)
def test_a_time_with_any_offset_reads_back_as_the_same_moment_in_utc(text: str) -> None:
    record = loads(_with("run_ended_timed", at=text))
    assert isinstance(record, RunEnded)
    assert record.at == _AT
    assert record.at is not None and record.at.tzinfo is UTC


@pytest.mark.parametrize(
    "value",
    [
        "2026-12-01T09:30:15",  # no offset: which moment it was is unknown
        "2026-12-01",
        "yesterday",
        "2026-13-01T09:30:15Z",
        1764581415,
        True,
        {"t": 1},
    ],
)
def test_a_time_that_is_not_an_rfc_3339_moment_is_refused(value: Any) -> None:
    with pytest.raises(CorruptLog, match=r"run_ended\.at must be null or an RFC 3339"):
        loads(_with("run_ended_timed", at=value))


def test_a_naive_time_is_refused_on_the_way_out() -> None:
    naive = dataclasses.replace(EXPECTED["step_timed"], at=datetime(2026, 12, 1, 9, 30))
    with pytest.raises(UnloggableValue, match=r"step\.at"):
        dumps(naive)


def test_records_without_times_are_written_as_before() -> None:
    for name in ("run_started", "intent_action", "result_action", "step_action", "run_ended"):
        data = encoded(name)
        assert not {"at", "model_duration_s", "action_duration_s", "resumed"} & set(data)
        if name.startswith("result"):
            assert "duration_s" not in data


@pytest.mark.parametrize("name", [name for name in EXPECTED if name.endswith("_timed")])
def test_without_timing_leaves_exactly_the_timing_fields_out(name: str) -> None:
    record = EXPECTED[name]
    timeless = without_timing(record)
    assert timeless != record
    for field in dataclasses.fields(record):
        value = getattr(timeless, field.name)
        if field.name in ("at", "resumed") or field.name.endswith("duration_s"):
            assert value is None, field.name
        else:
            assert value == getattr(record, field.name), field.name


# -- a fork's inherited steps, nested in its start record ----------------------------------


@pytest.mark.parametrize(
    ("inherited", "complaint"),
    [
        ("steps", "run_started.inherited must be null or a list of step records"),
        (["a step"], "run_started.inherited: item 0 is not a step record"),
        ([{"step": 0}], "run_started.inherited: item 0 has no 'run_id'"),
    ],
)
def test_inherited_steps_that_are_not_step_records_are_corrupt(
    inherited: Any, complaint: str
) -> None:
    with pytest.raises(CorruptLog, match=re.escape(complaint)):
        loads(_with("run_started_fork", inherited=inherited))


def test_an_inherited_step_with_a_mistyped_field_names_the_item_and_the_field() -> None:
    data = encoded("run_started_fork")
    steps = data["inherited"]
    assert isinstance(steps, list) and isinstance(steps[1], dict)
    steps[1]["decision"] = "maybe"
    with pytest.raises(CorruptLog, match=r"inherited: item 1: step\.decision must be one of"):
        loads(line_of(data))


def test_inherited_steps_are_checked_on_the_way_out_too() -> None:
    record = EXPECTED["run_started_fork"]
    assert isinstance(record, RunStarted) and record.inherited is not None
    broken = dataclasses.replace(record.inherited[0], step="0")  # type: ignore[arg-type]
    with pytest.raises(UnloggableValue, match=r"item 0: step\.step must be a int"):
        dumps(dataclasses.replace(record, inherited=(broken,)))
