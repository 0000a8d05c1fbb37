"""Hostile input, end to end: what a model or a caller can hand the library.

Every case states what must hold: a clear error or a clear refusal to the model, nothing
lost (the model output is recorded whole, the log reads back, ``resume`` of the finished
run returns the same result) and nothing written that should not be (no action intent
for an action that cannot run, no record for a request that cannot be logged).

Cases that concern "every store" run on the memory, JSON-lines, SQLite and PostgreSQL
stores, under asyncio and Trio. Hostile run ids, planted files and raw or tampered logs
are the stores' part: ``tests/stores/test_untrusted_input_stores.py``.
"""

from __future__ import annotations

import json
import socket
import urllib.request
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from kit.agent import (
    Ledger,
    answer,
    definition,
    make_tools,
    request,
    same_outcome,
    timeless,
    tool_call,
)
from kit.store import STORE_KINDS, Stores, sampled, stores_fixture
from polyloop import (
    Action,
    ActionStatus,
    Budget,
    Decision,
    DecisionKind,
    Intent,
    IntentKind,
    Interpreter,
    InvalidRequest,
    JSONValue,
    ModelReply,
    Result,
    RunEnded,
    RunResult,
    StepRecord,
    StopReason,
    ToolRegistry,
    ToolSpec,
    resume,
    run,
)
from polyloop._recovery import RecoveryState, read_plan
from polyloop.stores import MemoryStore
from polyloop.testing import JsonActionInterpreter, ScriptedModelClient

pytestmark = pytest.mark.anyio

REFUSED = "Refused: "  # the not_executed template of kit.agent.TEXTS, before {reason}


# -- stores ------------------------------------------------------------------------------------


# What the kernel refuses is refused alike on every store: quick on the memory store and
# SQLite. What a store keeps and reads back is each store's own: every store, quick.
stores = stores_fixture(sampled(STORE_KINDS))


async def run_then_resume(
    stores: Stores,
    run_id: str,
    script: Sequence[Any],
    tools: ToolRegistry,
    interpreter: Interpreter | None = None,
    **overrides: Any,
) -> tuple[RunResult, list[Any]]:
    """Run to the end, check the log reads back, resume the finished run on a new object.

    Returns the result and the records as read back from the store.
    """
    store = stores.open()
    result = await run(
        definition(store, script=script, interpreter=interpreter),
        request(run_id, tools, **overrides),
    )
    log = await store.read_log(run_id)
    plan = read_plan(log)
    assert plan.state is RecoveryState.FINISHED
    assert {record.run_id for record in log.records} == {run_id}
    logged_steps = [record for record in log.records if isinstance(record, StepRecord)]
    assert timeless(logged_steps) == timeless(result.steps)
    again_on = await stores.reopen(store)
    again = await resume(
        definition(again_on, script=script, interpreter=interpreter),
        request(run_id, tools, **overrides),
    )
    assert again.resumed
    assert same_outcome(result, again)
    return result, list(log.records)


def action_intents(records: Sequence[Any]) -> list[Intent]:
    return [r for r in records if isinstance(r, Intent) and r.kind is IntentKind.ACTION]


def model_results(records: Sequence[Any]) -> list[Result]:
    return [r for r in records if isinstance(r, Result) and r.kind is IntentKind.MODEL_CALL]


def same_text(a: str | None, b: str) -> bool:
    """Equality without a multi-megabyte assertion diff when it fails."""
    return a is not None and len(a) == len(b) and a == b


# -- model output ------------------------------------------------------------------------------


async def test_empty_model_output_is_an_invalid_step_and_the_run_goes_on(stores: Stores) -> None:
    result, records = await run_then_resume(stores, "r", ["", answer("ok")], make_tools(Ledger()))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    first = result.steps[0]
    assert first.model_output == "" and first.decision is DecisionKind.INVALID
    assert first.error is None  # an empty reply is the model's answer, not a failure
    assert model_results(records)[0].payload["content"] == ""  # type: ignore[index]


def ten_megabytes() -> str:
    # Plain prose, with every character class the codec escapes or keeps as it is
    # (quotes, backslashes, non-ASCII, a line separator, newlines) at both ends.
    special = 'line "quoted" \\ é 中 😀 \u2028 tab\t\n'
    prose = "the quick brown fox jumps over the lazy dog "
    body = prose * (10_000_000 // len(prose) + 1)
    return (special + body)[: 10_000_000 - len(special)] + special


# Ten megabytes go through each store once (not once per backend: a durable store takes
# about two seconds for them); the backends alternate so that both carry the case.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("anyio_backend", "kind"),
    [("asyncio", "memory"), ("trio", "jsonl"), ("asyncio", "sqlite"), ("trio", "postgresql")],
)
async def test_ten_megabytes_of_model_output_are_recorded_whole(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    stores = Stores.of(kind, request, tmp_path)
    try:
        await ten_megabytes_through(stores)
    finally:
        await stores.close_all()


async def ten_megabytes_through(stores: Stores) -> None:
    content = ten_megabytes()
    result, records = await run_then_resume(stores, "big", [content], make_tools(Ledger()))
    # Not JSON: an invalid step; its 10 MB then exceed the context budget.
    assert result.stop_reason is StopReason.CONTEXT_LIMIT
    (step,) = result.steps
    assert same_text(step.model_output, content)
    assert same_text(step.history_text, content)
    (reply,) = model_results(records)
    assert isinstance(reply.payload, dict)
    assert same_text(reply.payload["content"], content)  # type: ignore[arg-type]


@pytest.mark.parametrize("stores", STORE_KINDS, indirect=True)
async def test_lone_surrogates_in_model_output_are_recorded_and_read_back(
    stores: Stores,
) -> None:
    script = ["high \ud800 alone", "\udfff", '{"answer": "raw \ud800 in an answer"}']
    result, records = await run_then_resume(stores, "r", script, make_tools(Ledger()))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [step.model_output for step in result.steps] == script
    assert result.final_answer == "raw \ud800 in an answer"
    assert isinstance(records[-1], RunEnded)
    assert records[-1].final_answer == "raw \ud800 in an answer"


CONTROL = "".join(chr(code) for code in range(0x20)) + "\x7f"


@pytest.mark.parametrize("stores", STORE_KINDS, indirect=True)
async def test_control_characters_in_model_output_are_recorded_and_read_back(
    stores: Stores,
) -> None:
    script = [f"before{CONTROL}after", answer(CONTROL)]
    result, _ = await run_then_resume(stores, "r", script, make_tools(Ledger()))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.steps[0].model_output == script[0]
    assert result.steps[0].decision is DecisionKind.INVALID
    assert result.final_answer == CONTROL  # raw NUL and friends, through every store


NON_FINITE = {
    "nan": '{"tool": "double", "arguments": {"n": NaN}}',
    "infinity": '{"tool": "double", "arguments": {"n": Infinity}}',
    "minus-infinity": '{"tool": "double", "arguments": {"n": -Infinity}}',
    "overflow": '{"tool": "double", "arguments": {"n": 1e400}}',
}


class LenientInterpreter:
    """Reads replies as the test double does, but with Python's own lenient JSON parser.

    Every interpreter PolyLoop ships refuses NaN and Infinity itself; one of your own
    may not, and the loop must still refuse what it cannot record.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "lenient-json"}

    def interpret(self, reply: ModelReply) -> Decision:
        try:
            data = json.loads(reply.content)
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("tool"), str):
            name = data["tool"]
            return Action(
                payload={"name": name, "arguments": data.get("arguments", {})},
                action_text=name,
                history_text=reply.content,
            )
        return JsonActionInterpreter().interpret(reply)


async def test_non_finite_numbers_in_arguments_are_refused_without_an_action_intent(
    stores: Stores,
) -> None:
    ledger = Ledger()
    # json.loads turns all four into float nan/inf; a 5,000-digit integer it refuses
    # itself, so that reply is an invalid decision rather than an action.
    huge_int = '{"tool": "double", "arguments": {"n": ' + "7" * 5_000 + "}}"
    script = [*NON_FINITE.values(), huge_int, tool_call("double", n=2), answer("4")]
    result, records = await run_then_resume(
        stores, "r", script, make_tools(ledger), interpreter=LenientInterpreter()
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    refused = result.steps[:4]
    for step in refused:
        assert step.action_status is ActionStatus.NOT_EXECUTED
        assert step.observation is not None and step.observation.startswith(REFUSED)
        assert "not a JSON number" in step.observation
        assert step.observation_synthesized
    assert result.steps[4].decision is DecisionKind.INVALID
    assert [step.model_output for step in result.steps] == script
    # Only the one valid call announced an action and ran.
    assert [intent.step for intent in action_intents(records)] == [5]
    assert ledger.calls == [("double", "r:5:action")]


def nested(depth: int) -> str:
    return '{"tool": "double", "arguments": {"n": ' + "[" * depth + "]" * depth + "}}"


async def test_arguments_nested_deeper_than_the_codec_allows_are_refused(
    stores: Stores,
) -> None:
    ledger = Ledger()
    script = [nested(300), answer("x")]
    result, records = await run_then_resume(stores, "r", script, make_tools(ledger))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    step = result.steps[0]
    assert step.action_status is ActionStatus.NOT_EXECUTED
    assert "nested more than 256 levels" in (step.observation or "")
    assert step.model_output == script[0]
    assert action_intents(records) == [] and ledger.calls == []


async def test_arguments_nested_a_thousand_deep_are_refused_not_a_crash(
    stores: Stores,
) -> None:
    ledger = Ledger()
    script = [nested(1_000), answer("x")]
    result, records = await run_then_resume(stores, "r", script, make_tools(ledger))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    step = result.steps[0]
    assert step.model_output == script[0]
    assert step.decision is DecisionKind.INVALID or (
        step.action_status is ActionStatus.NOT_EXECUTED
    )
    assert action_intents(records) == [] and ledger.calls == []


async def test_a_tool_outside_the_runs_subset_is_refused(stores: Stores) -> None:
    ledger = Ledger()
    tools = make_tools(ledger).subset(["double"])
    script = [tool_call("submit", answer="x"), tool_call("double", n=2), answer("4")]
    model = ScriptedModelClient(script)
    store = stores.open()
    result = await run(definition(store, model=model), request("r", tools))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    refused = result.steps[0]
    assert refused.action_status is ActionStatus.NOT_EXECUTED
    assert "unknown tool 'submit'" in (refused.observation or "")
    assert ledger.calls == [("double", "r:1:action")]
    assert [step.model_output for step in result.steps] == script
    shown = "".join(block.text for message in model.calls[0].messages for block in message.content)
    assert '"name":"double"' in shown and '"name":"submit"' not in shown
    log = await store.read_log("r")
    read_plan(log)
    again = await resume(definition(await stores.reopen(store), script=script), request("r", tools))
    assert same_outcome(result, again)


# -- tool arguments ----------------------------------------------------------------------------

MEGABYTE = "x" * 1_000_000
# Room for a megabyte of arguments in the context, so that the run goes on after them.
ROOMY = Budget(max_steps=20, max_valid_steps=20, max_context_chars=10_000_000)
NOTE_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 10, "pattern": "^[a-z]*$"}},
    "required": ["text"],
    "additionalProperties": False,
}


def tools_with_note(ledger: Ledger) -> ToolRegistry:
    """``make_tools`` plus ``note``; a limit high enough that no refusal is cut by it."""

    async def note(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("note", result_id))
        return "noted"

    base = make_tools(ledger)
    specs = [spec for name in base.names if (spec := base.get(name)) is not None]
    return ToolRegistry(
        [
            *specs,
            ToolSpec(name="note", description="Note a word.", parameters=NOTE_SCHEMA, handler=note),
        ],
        max_observation_chars=10_000_000,
    )


BAD_ARGUMENTS = {
    "missing-required": ("double", {}),
    "string-for-integer": ("double", {"n": "seven"}),
    "float-for-integer": ("double", {"n": 1.5}),
    "bool-for-integer": ("double", {"n": True}),
    "null-for-integer": ("double", {"n": None}),
    "list-for-integer": ("double", {"n": [1]}),
    "extra-property": ("double", {"n": 1, "extra": True}),
    "megabyte-string-for-integer": ("double", {"n": MEGABYTE}),
    "megabyte-extra-key": ("double", {"n": 1, MEGABYTE: 1}),
    "megabyte-too-long": ("note", {"text": MEGABYTE}),
    "megabyte-pattern": ("note", {"text": "A" * 1_000_000}),
    "megabyte-tool-name": (MEGABYTE, {}),
    "arguments-not-an-object": ("double", [1]),
}


@pytest.mark.parametrize(
    ("name", "arguments"), list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS)
)
async def test_bad_arguments_are_refused_with_a_bounded_reason(name: str, arguments: Any) -> None:
    ledger = Ledger()
    call = json.dumps({"tool": name, "arguments": arguments})
    result = await run(
        definition(MemoryStore(), script=[call, answer("x")]),
        request("r", tools_with_note(ledger), budget=ROOMY),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    step = result.steps[0]
    assert step.action_status is ActionStatus.NOT_EXECUTED
    assert ledger.calls == []
    assert step.observation is not None and step.observation.startswith(REFUSED)
    reason = step.observation[len(REFUSED) :]
    assert len(reason) < 2_000, reason[:300]
    assert step.truncated_chars == 0  # bounded by itself, not by the observation limit
    assert step.model_output == call  # the megabyte is still on record, whole


REMOTE_SCHEMAS = {
    "top-level-ref": {"$ref": "https://example.invalid/schema.json"},
    "property-ref": {
        "type": "object",
        "properties": {"n": {"$ref": "https://example.invalid/n.json#/$defs/n"}},
    },
    "relative-to-remote-id": {
        "$id": "https://example.invalid/root.json",
        "type": "object",
        "properties": {"n": {"$ref": "other.json"}},
    },
    "http-ref": {"$ref": "http://127.0.0.1:9/schema.json"},
}


def network_trap(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make every way out to the network fail and note it; returns the notes."""
    attempts: list[str] = []

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            attempts.append(what)
            raise AssertionError(f"network access attempted: {what}")

        return refused

    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("socket.connect_ex"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(urllib.request, "urlopen", refuse("urlopen"))
    return attempts


def test_the_network_trap_catches_a_plain_jsonschema_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control: jsonschema left to its defaults does try to fetch, and the trap sees it."""
    attempts = network_trap(monkeypatch)
    plain = Draft202012Validator(REMOTE_SCHEMAS["top-level-ref"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jsonschema warns that it fetches remote refs
        with pytest.raises(Exception, match="Unresolvable"):
            plain.is_valid({"n": 1})
    assert attempts == ["urlopen"]


@pytest.mark.parametrize("schema", list(REMOTE_SCHEMAS.values()), ids=list(REMOTE_SCHEMAS))
async def test_a_remote_ref_is_never_fetched_and_the_call_is_refused(
    schema: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = network_trap(monkeypatch)
    ran: list[str] = []

    async def handler(arguments: dict[str, Any], *, result_id: str) -> str:
        ran.append(result_id)
        return "ran"

    tools = ToolRegistry(
        [ToolSpec(name="t", description="", parameters=schema, handler=handler)],
        max_observation_chars=10_000,
    )
    result = await run(
        definition(MemoryStore(), script=[tool_call("t", n=1), answer("x")]), request("r", tools)
    )
    assert attempts == []
    assert ran == []
    step = result.steps[0]
    assert step.action_status is ActionStatus.NOT_EXECUTED
    assert "cannot be checked" in (step.observation or "")
    assert result.stop_reason is StopReason.FINAL_ANSWER


# -- observation limit -------------------------------------------------------------------------

LIMIT = 100
SIZES = (0, 1, LIMIT - 1, LIMIT, LIMIT + 1, 10 * LIMIT, 1_000_000)


async def test_observations_are_cut_to_the_limit_and_the_cut_is_counted() -> None:
    """Bound: an executed observation is at most ``max_observation_chars`` characters.

    A refusal is cut to the limit too and then wrapped in the ``not_executed`` template,
    so its observation is at most the limit plus the template's own text.
    """
    produced: list[str] = []

    async def echo(arguments: dict[str, Any], *, result_id: str) -> str:
        text = arguments["char"] * arguments["size"]
        produced.append(text)
        return text

    async def explode(arguments: dict[str, Any], *, result_id: str) -> str:
        raise ValueError("z" * 5_000)

    echo_schema = {
        "type": "object",
        "properties": {"size": {"type": "integer"}, "char": {"type": "string"}},
        "required": ["size", "char"],
        "additionalProperties": False,
    }
    tools = ToolRegistry(
        [
            ToolSpec(name="echo", description="", parameters=echo_schema, handler=echo),
            ToolSpec(name="explode", description="", parameters={}, handler=explode),
        ],
        max_observation_chars=LIMIT,
    )
    calls = [tool_call("echo", size=size, char=char) for size in SIZES for char in ("y", "é", "😀")]
    refusal = tool_call("echo", size="x" * 5_000, char="y")
    script = [*calls, tool_call("explode"), refusal, answer("x")]
    budget = Budget(
        max_steps=len(script), max_valid_steps=len(script), max_context_chars=10_000_000
    )
    result = await run(definition(MemoryStore(), script=script), request("r", tools, budget=budget))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    executed = result.steps[: len(calls)]
    for step, original in zip(executed, produced, strict=True):
        assert step.action_status is ActionStatus.EXECUTED
        assert step.observation is not None
        assert len(step.observation) <= LIMIT
        assert step.observation == original[:LIMIT]
        assert step.truncated_chars == max(0, len(original) - LIMIT)
    exploded = result.steps[len(calls)]
    assert exploded.observation is not None and len(exploded.observation) == LIMIT
    assert exploded.observation.startswith("ValueError: zzz")
    assert exploded.truncated_chars == len("ValueError: ") + 5_000 - LIMIT
    refused = result.steps[len(calls) + 1]
    assert refused.action_status is ActionStatus.NOT_EXECUTED
    assert refused.observation is not None
    assert len(refused.observation) <= LIMIT + len(REFUSED)


SNAPSHOT_VALUES = {"nan": float("nan"), "infinity": float("inf"), "huge-int": 10**4_999}


class ParametrizedModel(ScriptedModelClient):
    """A scripted model that reports one extra reproducibility parameter."""

    def __init__(self, value: Any) -> None:
        super().__init__([answer("x")])
        self.value = value

    def parameters(self) -> dict[str, Any]:
        return {**super().parameters(), "temperature": self.value}


async def test_an_unloggable_snapshot_parameter_is_refused_before_anything_is_written(
    stores: Stores,
) -> None:
    store = stores.open()
    for name, value in SNAPSHOT_VALUES.items():
        model = ParametrizedModel(value)
        for drive in (run, resume):
            with pytest.raises(InvalidRequest, match="snapshot"):
                await drive(definition(store, model=model), request(name, make_tools(Ledger())))
        assert model.calls == []
        assert (await store.read_log(name)).records == ()
    if stores.kind == "jsonl":
        # read_log above looked for the files; nothing was ever created.
        assert not stores.jsonl_dir.exists() or list(stores.jsonl_dir.iterdir()) == []
