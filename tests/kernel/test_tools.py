"""Tests for polyloop.tools: the registry, its validation and the executor it derives."""

from __future__ import annotations

import copy
import dataclasses
import math
import socket
import urllib.request
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyloop.ports import Action, ActionExecutor, ActionOutcome
from polyloop.tools import EnvironmentFault, ToolRegistry, ToolSpec
from polyloop.types import ActionStatus, InvalidRequest, JSONValue, Replay

pytestmark = pytest.mark.anyio

SEARCH_SCHEMA: dict[str, JSONValue] = {
    "type": "object",
    "properties": {"q": {"type": "string", "maxLength": 10}},
    "required": ["q"],
    "additionalProperties": False,
}


class Recorder:
    """A tool handler that remembers every call and answers with a fixed value."""

    def __init__(self, reply: object = "ok") -> None:
        self.reply = reply
        self.calls: list[tuple[dict[str, JSONValue], str]] = []

    async def __call__(self, arguments: dict[str, JSONValue], *, result_id: str) -> Any:
        self.calls.append((arguments, result_id))
        return self.reply


def spec(name: str, handler: Any = None, **fields: Any) -> ToolSpec:
    fields.setdefault("parameters", {"type": "object"})
    return ToolSpec(
        name=name,
        description=f"the {name} tool",
        handler=handler if handler is not None else Recorder(),
        **fields,
    )


def action(payload: Any) -> Action:
    return Action(payload=payload, action_text="text", history_text="history")


def call(name: str, arguments: Any) -> Action:
    return action({"name": name, "arguments": arguments})


# --- construction ---------------------------------------------------------------------


def test_names_follow_registration_order() -> None:
    registry = ToolRegistry([spec("zeta"), spec("alpha"), spec("mid")], max_observation_chars=100)
    assert registry.names == ("zeta", "alpha", "mid")
    assert len(registry) == 3
    assert "alpha" in registry
    assert "beta" not in registry
    assert 3 not in registry
    assert registry.max_observation_chars == 100
    assert repr(registry) == (
        "ToolRegistry(names=('zeta', 'alpha', 'mid'), max_observation_chars=100)"
    )


def test_empty_registry_is_allowed() -> None:
    registry = ToolRegistry([], max_observation_chars=1)
    assert registry.names == ()
    assert registry.describe() == []


def test_subset_keeps_registration_order_and_limit() -> None:
    registry = ToolRegistry([spec("a"), spec("b"), spec("c"), spec("d")], max_observation_chars=7)
    sub = registry.subset(["d", "b", "d"])
    assert sub.names == ("b", "d")
    assert sub.max_observation_chars == 7
    assert registry.names == ("a", "b", "c", "d")
    assert registry.subset([]).names == ()


def test_subset_refuses_unknown_names() -> None:
    registry = ToolRegistry([spec("a"), spec("b")], max_observation_chars=7)
    with pytest.raises(InvalidRequest, match=r"unknown tools 'nope'.*known tools: 'a', 'b'"):
        registry.subset(["a", "nope"])


def test_subset_refuses_a_single_string() -> None:
    registry = ToolRegistry([spec("ab")], max_observation_chars=7)
    with pytest.raises(InvalidRequest, match="iterable of names"):
        registry.subset("ab")


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="'twice' is registered twice"):
        ToolRegistry([spec("twice"), spec("once"), spec("twice")], max_observation_chars=5)


@pytest.mark.parametrize("name", ["", 3, None])
def test_empty_or_non_string_names_are_refused(name: Any) -> None:
    with pytest.raises(InvalidRequest, match="non-empty string"):
        ToolRegistry([spec(name)], max_observation_chars=5)


def test_entries_must_be_tool_specs() -> None:
    with pytest.raises(InvalidRequest, match="ToolSpec values, got dict"):
        ToolRegistry([{"name": "x"}], max_observation_chars=5)  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("description", None, "description must be a string"),
        ("handler", "not callable", "handler must be an async function"),
        ("handler", lambda arguments, *, result_id: "sync", "handler must be an async function"),
        ("replay", "never", "replay must be a Replay"),
        ("completes", 1, "completes must be a bool"),
    ],
)
def test_bad_spec_fields_are_refused(field: str, value: Any, message: str) -> None:
    bad = dataclasses.replace(spec("tool"), **{field: value})
    with pytest.raises(InvalidRequest, match=f"tool 'tool': {message}"):
        ToolRegistry([bad], max_observation_chars=5)


@pytest.mark.parametrize("parameters", [[], "object", None, ("type", "object")])
def test_parameters_must_be_a_dict(parameters: Any) -> None:
    with pytest.raises(InvalidRequest, match="tool 'p': parameters must be a JSON Schema dict"):
        ToolRegistry([spec("p", parameters=parameters)], max_observation_chars=5)


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "objekt"},
        {"type": "object", "properties": 3},
        {"type": "object", "required": "q"},
        {"type": "object", "properties": {"q": {"minLength": -1}}},
    ],
)
def test_invalid_schemas_are_refused(parameters: dict[str, JSONValue]) -> None:
    with pytest.raises(InvalidRequest, match="tool 'bad': parameters is not a valid JSON Schema"):
        ToolRegistry([spec("ok"), spec("bad", parameters=parameters)], max_observation_chars=5)


@pytest.mark.parametrize("top_type", ["array", "string", ["object", "null"]])
def test_top_level_type_must_be_object(top_type: JSONValue) -> None:
    with pytest.raises(InvalidRequest, match="tool 'arr': the schema's top-level type"):
        ToolRegistry([spec("arr", parameters={"type": top_type})], max_observation_chars=5)


def test_schemas_without_a_top_level_type_are_accepted() -> None:
    registry = ToolRegistry(
        [spec("free", parameters={}), spec("props", parameters={"properties": {}})],
        max_observation_chars=5,
    )
    assert registry.names == ("free", "props")


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"n": {"type": "number", "maximum": math.inf}}},
        {"type": "object", "properties": {"n": {"enum": [math.nan]}}},
        {"type": "object", "required": ("a",)},
        {"type": "object", 1: "x"},
    ],
)
def test_schemas_must_be_plain_json(parameters: Any) -> None:
    with pytest.raises(InvalidRequest, match="tool 'odd'"):
        ToolRegistry([spec("odd", parameters=parameters)], max_observation_chars=5)


@pytest.mark.parametrize("limit", [0, -1, True, False, 1.5, "10", None])
def test_bad_max_observation_chars_is_refused(limit: Any) -> None:
    with pytest.raises(InvalidRequest, match="max_observation_chars must be an int >= 1"):
        ToolRegistry([spec("a")], max_observation_chars=limit)


def test_registry_cannot_be_mutated() -> None:
    registry = ToolRegistry([spec("a")], max_observation_chars=5)
    with pytest.raises(AttributeError, match="immutable"):
        registry._max_observation_chars = 9
    with pytest.raises(AttributeError, match="immutable"):
        registry.extra = 1
    assert registry.max_observation_chars == 5
    assert copy.deepcopy(registry) is registry


def test_tool_spec_defaults_and_frozenness() -> None:
    made = spec("a")
    assert made.replay is Replay.NEVER
    assert made.completes is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.name = "b"  # type: ignore[misc]


def test_registries_compare_by_content() -> None:
    handler = Recorder()
    first = ToolRegistry([spec("a", handler)], max_observation_chars=5)
    assert first == ToolRegistry([spec("a", handler)], max_observation_chars=5)
    assert first != ToolRegistry([spec("a", handler)], max_observation_chars=6)
    assert first != ToolRegistry([spec("a", Recorder())], max_observation_chars=5)


# --- describe, get, completion --------------------------------------------------------


def test_describe_lists_every_tool_in_order() -> None:
    registry = ToolRegistry(
        [
            spec("search", parameters=SEARCH_SCHEMA),
            spec("submit", replay=Replay.ALLOWED, completes=True),
        ],
        max_observation_chars=5,
    )
    assert registry.describe() == [
        {
            "name": "search",
            "description": "the search tool",
            "parameters": SEARCH_SCHEMA,
            "replay": "never",
            "completes": False,
        },
        {
            "name": "submit",
            "description": "the submit tool",
            "parameters": {"type": "object"},
            "replay": "allowed",
            "completes": True,
        },
    ]


def test_mutating_describe_output_does_not_change_the_registry() -> None:
    registry = ToolRegistry([spec("search", parameters=SEARCH_SCHEMA)], max_observation_chars=5)
    before = registry.describe()
    described = registry.describe()
    assert isinstance(described, list)
    entry = described[0]
    assert isinstance(entry, dict)
    entry["name"] = "renamed"
    entry["parameters"]["properties"]["q"]["type"] = "integer"  # type: ignore[call-overload,index]
    described.append({"name": "extra"})
    assert registry.describe() == before
    assert registry.validate("search", {"q": 3}) is not None
    assert registry.validate("search", {"q": "x"}) is None


def test_caller_edits_to_the_schema_after_construction_change_nothing() -> None:
    schema = copy.deepcopy(SEARCH_SCHEMA)
    registry = ToolRegistry([spec("search", parameters=schema)], max_observation_chars=5)
    schema["properties"]["q"]["type"] = "integer"  # type: ignore[call-overload,index]
    schema["required"] = []
    assert registry.validate("search", {}) is not None
    assert registry.validate("search", {"q": "x"}) is None
    got = registry.get("search")
    assert got is not None
    assert got.parameters == SEARCH_SCHEMA


def test_get_returns_the_spec_or_none() -> None:
    handler = Recorder()
    registry = ToolRegistry(
        [spec("search", handler, parameters=SEARCH_SCHEMA, replay=Replay.ALLOWED)],
        max_observation_chars=5,
    )
    got = registry.get("search")
    assert got == spec("search", handler, parameters=SEARCH_SCHEMA, replay=Replay.ALLOWED)
    assert registry.get("missing") is None
    assert got is not None
    got.parameters["type"] = "array"  # type: ignore[index]
    assert registry.describe()[0]["parameters"]["type"] == "object"  # type: ignore[call-overload,index]


def test_annotations_are_described_only_when_set() -> None:
    hints: dict[str, JSONValue] = {"source": "mcp", "hints": {"readOnlyHint": True}}
    registry = ToolRegistry(
        [spec("plain"), spec("mounted", annotations=hints)], max_observation_chars=5
    )
    plain, mounted = registry.describe()  # type: ignore[misc]
    assert "annotations" not in plain
    assert mounted["annotations"] == hints
    # Private copies: edits on either side change nothing in the registry.
    hints["source"] = "edited"
    got = registry.get("mounted")
    assert got is not None and got.annotations is not None
    got.annotations["source"] = "edited too"  # type: ignore[index]
    assert registry.describe()[1]["annotations"]["source"] == "mcp"  # type: ignore[call-overload,index]
    assert registry != ToolRegistry(
        [spec("plain"), spec("mounted", handler=got.handler)], max_observation_chars=5
    )


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        (["a"], "annotations must be a dict or None"),
        ({"x": float("nan")}, "annotations"),
        ({1: "x"}, "annotations"),
    ],
)
def test_bad_annotations_are_refused(annotations: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        ToolRegistry([spec("a", annotations=annotations)], max_observation_chars=5)


def test_marks_completion() -> None:
    registry = ToolRegistry(
        [spec("search"), spec("submit", completes=True)], max_observation_chars=5
    )
    assert registry.marks_completion("submit") is True
    assert registry.marks_completion("search") is False
    assert registry.marks_completion("missing") is False


# --- validate -------------------------------------------------------------------------


@pytest.fixture
def search_registry() -> ToolRegistry:
    return ToolRegistry(
        [spec("search", parameters=SEARCH_SCHEMA), spec("other")], max_observation_chars=50
    )


def test_valid_arguments_pass(search_registry: ToolRegistry) -> None:
    assert search_registry.validate("search", {"q": "cats"}) is None
    assert search_registry.validate("other", {"anything": [1, 2]}) is None


def test_wrong_type_is_refused_with_its_path(search_registry: ToolRegistry) -> None:
    reason = search_registry.validate("search", {"q": 3})
    assert reason is not None
    assert "'search'" in reason
    assert "$.q" in reason
    assert "3 is not of type 'string'" in reason


def test_missing_required_property_is_refused(search_registry: ToolRegistry) -> None:
    reason = search_registry.validate("search", {})
    assert reason is not None
    assert "'q' is a required property" in reason


def test_extra_property_is_refused(search_registry: ToolRegistry) -> None:
    reason = search_registry.validate("search", {"q": "cats", "zzz": 1})
    assert reason is not None
    assert "Additional properties are not allowed" in reason
    assert "'zzz'" in reason


def test_huge_arguments_give_a_bounded_reason(search_registry: ToolRegistry) -> None:
    huge = "x" * 1_000_000
    too_long = search_registry.validate("search", {"q": huge})
    assert too_long is not None
    assert "$.q" in too_long
    assert "is too long" in too_long
    assert len(too_long) < 2_000
    extra_key = search_registry.validate("search", {"q": "a", huge: 1})
    assert extra_key is not None
    assert len(extra_key) < 2_000


def test_unknown_tool_is_named_with_the_known_ones(search_registry: ToolRegistry) -> None:
    reason = search_registry.validate("serach", {"q": "cats"})
    assert reason is not None
    assert "unknown tool 'serach'" in reason
    assert "'search', 'other'" in reason
    long_name = search_registry.validate("n" * 100_000, {})
    assert long_name is not None
    assert len(long_name) < 1_000


@pytest.mark.parametrize("arguments", [[], "q", None, 3, {1: "x"}])
def test_arguments_must_be_an_object(search_registry: ToolRegistry, arguments: Any) -> None:
    reason = search_registry.validate("other", arguments)
    assert reason is not None
    assert "must be a JSON object" in reason


@pytest.mark.parametrize("value", [math.nan, math.inf, ("a", "b"), {"x"}])
def test_arguments_must_be_plain_json(search_registry: ToolRegistry, value: Any) -> None:
    reason = search_registry.validate("other", {"v": value})
    assert reason is not None
    assert "not plain JSON" in reason


def test_non_string_tool_name_is_refused(search_registry: ToolRegistry) -> None:
    reason = search_registry.validate(["search"], {})  # type: ignore[arg-type]
    assert reason is not None
    assert "must be a string" in reason


def test_local_references_are_followed() -> None:
    schema: dict[str, JSONValue] = {
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/count"}},
        "$defs": {"count": {"type": "integer", "minimum": 0}},
    }
    registry = ToolRegistry([spec("count", parameters=schema)], max_observation_chars=5)
    assert registry.validate("count", {"n": 4}) is None
    reason = registry.validate("count", {"n": -1})
    assert reason is not None
    assert "$.n" in reason


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError("the tool registry tried to reach the network")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


REMOTE_SCHEMAS: list[dict[str, JSONValue]] = [
    {"type": "object", "properties": {"q": {"$ref": "https://example.com/x.json"}}},
    {
        "$id": "https://example.com/root.json",
        "type": "object",
        "properties": {"q": {"$ref": "other.json#/q"}},
    },
    {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}},
]


@pytest.mark.parametrize("schema", REMOTE_SCHEMAS)
def test_unresolvable_references_are_refused_without_fetching(
    no_network: list[object], schema: dict[str, JSONValue]
) -> None:
    registry = ToolRegistry([spec("fetch", parameters=schema)], max_observation_chars=500)
    reason = registry.validate("fetch", {"q": 1})
    assert reason is not None
    assert "cannot be checked" in reason
    assert no_network == []


async def test_executor_refuses_remote_references_without_fetching(
    no_network: list[object],
) -> None:
    handler = Recorder()
    registry = ToolRegistry(
        [spec("fetch", handler, parameters=REMOTE_SCHEMAS[0])], max_observation_chars=500
    )
    outcome = await registry.executor().execute(call("fetch", {"q": 1}), result_id="r")
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert "https://example.com/x.json" in outcome.observation
    assert handler.calls == []
    assert no_network == []


def test_endlessly_recursive_schema_is_refused_not_raised() -> None:
    registry = ToolRegistry(
        [spec("loop", parameters={"type": "object", "$ref": "#"})], max_observation_chars=500
    )
    reason = registry.validate("loop", {})
    assert reason is not None
    assert "cannot be checked" in reason


@pytest.mark.parametrize(
    ("parameters", "accepted"),
    [
        ({"type": "object"}, True),
        ({"type": "object", "properties": {}, "additionalProperties": False}, True),
        (SEARCH_SCHEMA, False),
        ({"type": "object", "minProperties": 1}, False),
        ({"type": "object", "$ref": "#"}, False),
        ({"not": {"type": "object"}}, False),
    ],
)
def test_empty_arguments_get_the_schema_verdict_on_every_call(
    parameters: dict[str, JSONValue], accepted: bool
) -> None:
    # The verdict on {}, refusals included, is the one jsonschema gives, call after call.
    registry = ToolRegistry([spec("t", parameters=parameters)], max_observation_chars=500)
    first = registry.validate("t", {})
    assert (first is None) == accepted
    assert [registry.validate("t", {}) for _ in range(3)] == [first] * 3


def test_an_empty_looking_dict_subclass_is_validated_in_full() -> None:
    class Hidden(dict[str, JSONValue]):
        """Claims to be empty while holding a key: must not pass as {}."""

        def __len__(self) -> int:
            return 0

    closed = {"type": "object", "additionalProperties": False}
    registry = ToolRegistry([spec("t", parameters=closed)], max_observation_chars=500)
    assert registry.validate("t", {}) is None
    reason = registry.validate("t", Hidden(x=1))
    assert reason is not None
    assert "Additional properties are not allowed" in reason


# --- executor -------------------------------------------------------------------------


def test_executor_satisfies_the_protocol(search_registry: ToolRegistry) -> None:
    assert isinstance(search_registry.executor(), ActionExecutor)


async def test_handler_gets_arguments_and_result_id() -> None:
    handler = Recorder("found cats")
    executor = ToolRegistry(
        [spec("search", handler, parameters=SEARCH_SCHEMA)], max_observation_chars=50
    ).executor()
    outcome = await executor.execute(call("search", {"q": "cats"}), result_id="r-1")
    assert handler.calls == [({"q": "cats"}, "r-1")]
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation="found cats",
        synthesized=False,
        done=False,
        truncated_chars=0,
    )


async def test_handler_edits_do_not_reach_the_recorded_payload() -> None:
    async def meddle(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        arguments["q"] = "changed"
        return "ok"

    executor = ToolRegistry([spec("search", meddle)], max_observation_chars=50).executor()
    recorded = call("search", {"q": "cats"})
    await executor.execute(recorded, result_id="r")
    assert recorded.payload == {"name": "search", "arguments": {"q": "cats"}}


async def test_handler_exception_becomes_a_synthesized_observation() -> None:
    async def broken(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        raise ValueError("boom")

    executor = ToolRegistry([spec("broken", broken)], max_observation_chars=50).executor()
    outcome = await executor.execute(call("broken", {}), result_id="r")
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation="ValueError: boom",
        synthesized=True,
        done=False,
    )


async def test_an_environment_fault_from_a_handler_is_an_env_fault() -> None:
    async def unreachable(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        raise EnvironmentFault("the server went away")

    registry = ToolRegistry([spec("far", unreachable, completes=True)], max_observation_chars=12)
    outcome = await registry.executor().execute(call("far", {}), result_id="r")
    assert outcome == ActionOutcome(
        status=ActionStatus.ENV_FAULT,
        observation="the server w",
        synthesized=True,
        done=False,
        truncated_chars=len("the server went away") - 12,
    )


async def test_handler_returning_a_non_string_is_a_type_error() -> None:
    executor = ToolRegistry([spec("count", Recorder(42))], max_observation_chars=200).executor()
    outcome = await executor.execute(call("count", {}), result_id="r")
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.observation == "TypeError: tool 'count' returned int, expected str"
    assert outcome.synthesized is True
    assert outcome.done is False


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ("search", "got str"),
        (["search", {}], "got list"),
        (None, "got NoneType"),
        ({"name": "search"}, "missing 'arguments'"),
        ({"arguments": {"q": "a"}}, "missing 'name'"),
        ({"name": "search", "arguments": {"q": "a"}, "extra": 1}, "unexpected 'extra'"),
        ({"name": 3, "arguments": {"q": "a"}}, "'name' must be a string"),
        ({"name": "search", "arguments": ["a"]}, "must be a JSON object"),
        ({"name": "search", "arguments": "q=a"}, "must be a JSON object"),
        ({"name": "search", "arguments": None}, "must be a JSON object"),
    ],
)
async def test_malformed_payloads_are_not_executed(payload: Any, expected: str) -> None:
    handler = Recorder()
    registry = ToolRegistry(
        [spec("search", handler, parameters=SEARCH_SCHEMA)], max_observation_chars=500
    )
    outcome = await registry.executor().execute(action(payload), result_id="r")
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert expected in outcome.observation
    assert outcome.synthesized is True
    assert outcome.done is False
    assert handler.calls == []


@pytest.mark.parametrize(
    ("name", "arguments"),
    [("search", {"q": 3}), ("search", {}), ("search", {"q": "x", "y": 1}), ("nope", {})],
)
async def test_refused_calls_report_the_validate_reason(name: str, arguments: Any) -> None:
    handler = Recorder()
    registry = ToolRegistry(
        [spec("search", handler, parameters=SEARCH_SCHEMA)], max_observation_chars=500
    )
    outcome = await registry.executor().execute(call(name, arguments), result_id="r")
    assert outcome == ActionOutcome(
        status=ActionStatus.NOT_EXECUTED,
        observation=registry.validate(name, arguments) or "",
        synthesized=True,
        done=False,
    )
    assert outcome.observation
    assert handler.calls == []


async def test_long_observations_are_cut_exactly() -> None:
    registry = ToolRegistry([spec("long", Recorder("x" * 25))], max_observation_chars=10)
    outcome = await registry.executor().execute(call("long", {}), result_id="r")
    assert outcome.observation == "x" * 10
    assert outcome.truncated_chars == 15
    assert outcome.synthesized is False


async def test_refusals_are_cut_too() -> None:
    registry = ToolRegistry([spec("tool")], max_observation_chars=10)
    reason = registry.validate("missing", {})
    assert reason is not None
    outcome = await registry.executor().execute(call("missing", {}), result_id="r")
    assert outcome.observation == reason[:10]
    assert outcome.truncated_chars == len(reason) - 10


async def test_observation_at_the_limit_is_not_cut() -> None:
    registry = ToolRegistry([spec("exact", Recorder("y" * 10))], max_observation_chars=10)
    outcome = await registry.executor().execute(call("exact", {}), result_id="r")
    assert outcome.observation == "y" * 10
    assert outcome.truncated_chars == 0


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=st.text(max_size=80), limit=st.integers(min_value=1, max_value=100))
async def test_truncation_accounts_for_every_character(text: str, limit: int) -> None:
    registry = ToolRegistry([spec("echo", Recorder(text))], max_observation_chars=limit)
    outcome = await registry.executor().execute(call("echo", {}), result_id="r")
    assert len(outcome.observation) + outcome.truncated_chars == len(text)
    assert len(outcome.observation) <= limit
    assert text.startswith(outcome.observation)


def test_replay_follows_the_named_tool() -> None:
    registry = ToolRegistry(
        [spec("read", replay=Replay.ALLOWED), spec("write")], max_observation_chars=5
    )
    executor = registry.executor()
    assert executor.replay(call("read", {})) is Replay.ALLOWED
    assert executor.replay(call("write", {})) is Replay.NEVER
    assert executor.replay(call("unknown", {})) is Replay.NEVER
    assert executor.replay(action({"name": "read"})) is Replay.NEVER
    assert executor.replay(action("read")) is Replay.NEVER
    assert executor.replay(action({"name": "read", "arguments": {}, "x": 1})) is Replay.NEVER


async def test_cancellation_propagates_out_of_the_handler() -> None:
    started = anyio.Event()
    finished: list[ActionOutcome] = []

    async def slow(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        started.set()
        await anyio.sleep_forever()
        return "unreachable"

    executor = ToolRegistry([spec("slow", slow)], max_observation_chars=50).executor()

    async def run() -> None:
        finished.append(await executor.execute(call("slow", {}), result_id="r"))

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await started.wait()
            scope.cancel()
    assert scope.cancelled_caught
    assert finished == []


async def test_move_on_after_cancels_a_sleeping_handler() -> None:
    reached_after = False

    async def slow(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        await anyio.sleep_forever()
        return "unreachable"

    executor = ToolRegistry([spec("slow", slow)], max_observation_chars=50).executor()
    with anyio.move_on_after(0.01) as scope:
        await executor.execute(call("slow", {}), result_id="r")
        reached_after = True
    assert scope.cancelled_caught
    assert not reached_after


class Halt(BaseException):
    """A BaseException that is not cancellation: it must not become an observation."""


async def test_base_exceptions_are_not_swallowed() -> None:
    async def halting(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        raise Halt

    executor = ToolRegistry([spec("halt", halting)], max_observation_chars=50).executor()
    with pytest.raises(Halt):
        await executor.execute(call("halt", {}), result_id="r")


async def test_an_async_callable_object_or_partial_is_a_handler() -> None:
    """What awaits like an async function is accepted; a plain function is refused when the
    registry is built, not when the model first calls the tool."""
    import functools

    async def shout(arguments: dict[str, Any], *, result_id: str, prefix: str) -> str:
        return prefix + str(arguments["text"]).upper()

    class Shouter:
        async def __call__(self, arguments: dict[str, Any], *, result_id: str) -> str:
            return str(arguments["text"]).upper()

    for handler, expected in ((functools.partial(shout, prefix=">"), ">HI"), (Shouter(), "HI")):
        registry = ToolRegistry([spec("shout", handler)], max_observation_chars=100)
        outcome = await registry.executor().execute(call("shout", {"text": "hi"}), result_id="r")
        assert outcome.observation == expected
