"""Tests for ToolSpec.from_function (polyloop._typed_tools): tools from typed functions."""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Annotated, Any, Literal

import anyio
import anyio.lowlevel
import pydantic
import pytest

from polyloop.ports import Action, ActionOutcome
from polyloop.tools import ToolRegistry, ToolSpec
from polyloop.types import ActionStatus, InvalidRequest, Replay

pytestmark = pytest.mark.anyio


@dataclasses.dataclass
class Address:
    city: str
    postcode: str | None = None


def ship(
    item: str,
    count: Annotated[int, pydantic.Field(ge=1)],
    to: Address,
    speed: Literal["slow", "fast"] = "slow",
    *,
    result_id: str,
) -> dict[str, object]:
    """Ship an item to an address.

    Each call is one parcel.

    Args:
        item: what to ship.
        count: how many of it.
        to: where it goes.
    """
    return {"item": item, "count": count, "city": to.city, "key": result_id}


def call(name: str, arguments: object) -> Action:
    return Action(
        payload={"name": name, "arguments": arguments}, action_text="text", history_text="history"
    )


def test_the_schema_comes_from_the_hints_and_the_docstring() -> None:
    spec = ToolSpec.from_function(ship, replay=Replay.ALLOWED)
    assert spec.name == "ship"
    assert spec.description == "Ship an item to an address.\n\nEach call is one parcel."
    assert spec.replay is Replay.ALLOWED
    assert spec.parameters == {
        "$defs": {
            "Address": {
                "additionalProperties": False,
                "properties": {
                    "city": {"type": "string"},
                    "postcode": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                },
                "required": ["city"],
                "title": "Address",
                "type": "object",
            }
        },
        "additionalProperties": False,
        "properties": {
            "item": {"description": "what to ship.", "type": "string"},
            "count": {"description": "how many of it.", "minimum": 1, "type": "integer"},
            "to": {"$ref": "#/$defs/Address", "description": "where it goes."},
            "speed": {"default": "slow", "enum": ["slow", "fast"], "type": "string"},
        },
        "required": ["item", "count", "to"],
        "type": "object",
    }


def test_the_schema_is_what_the_registry_describes_and_the_snapshot_records() -> None:
    spec = ToolSpec.from_function(ship)
    (described,) = ToolRegistry([spec], max_observation_chars=100).describe()  # type: ignore[misc]
    assert described["parameters"] == spec.parameters
    assert described["description"] == spec.description


def test_name_and_description_may_be_given() -> None:
    spec = ToolSpec.from_function(ship, name="send", description="Send a parcel.")
    assert (spec.name, spec.description) == ("send", "Send a parcel.")


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"item": "a", "count": "2", "to": {"city": "Oslo"}}, "'2' is not of type 'integer'"),
        ({"item": "a", "count": 0, "to": {"city": "Oslo"}}, "0 is less than the minimum of 1"),
        ({"item": "a", "count": 1, "to": {}}, "'city' is a required property"),
        ({"item": "a", "count": 1, "to": {"city": "Oslo"}, "rush": True}, "'rush' was unexpected"),
        ({"item": "a", "count": 1, "to": {"city": "Oslo"}, "speed": "warp"}, "'warp' is not one"),
    ],
)
async def test_arguments_the_schema_refuses_never_reach_the_function(
    arguments: dict[str, object], reason: str
) -> None:
    called: list[object] = []

    async def record(arguments: dict[str, object], *, result_id: str) -> str:
        called.append(arguments)
        return "ran"

    # The derived schema, with a handler that notes any call that gets through it.
    spec = dataclasses.replace(ToolSpec.from_function(ship), handler=record)
    registry = ToolRegistry([spec], max_observation_chars=500)
    outcome = await registry.executor().execute(call("ship", arguments), result_id="r:0")
    assert outcome.status is ActionStatus.NOT_EXECUTED
    assert reason in outcome.observation
    assert called == []


async def test_the_function_gets_typed_values_and_the_result_id() -> None:
    registry = ToolRegistry([ToolSpec.from_function(ship)], max_observation_chars=500)
    arguments = {"item": "lamp", "count": 2, "to": {"city": "Oslo"}}
    outcome = await registry.executor().execute(call("ship", arguments), result_id="r:3:action")
    # A dict return value is the observation as JSON; ``to.city`` proves ``to`` arrived
    # as an Address, and the result id is passed but is not an argument of the schema.
    assert outcome == ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation='{"item":"lamp","count":2,"city":"Oslo","key":"r:3:action"}',
        synthesized=False,
        done=False,
    )
    assert "result_id" not in ToolSpec.from_function(ship).parameters["properties"]  # type: ignore[operator]


async def test_a_plain_function_runs_on_a_worker_thread_and_a_coroutine_on_the_loop() -> None:
    loop_thread = threading.get_ident()
    seen: dict[str, int] = {}

    def blocking(text: str) -> str:
        seen["plain"] = threading.get_ident()
        return text.upper()

    async def awaiting(text: str) -> str:
        seen["async"] = threading.get_ident()
        await anyio.lowlevel.checkpoint()
        return text.lower()

    registry = ToolRegistry(
        [ToolSpec.from_function(blocking), ToolSpec.from_function(awaiting)],
        max_observation_chars=100,
    )
    executor = registry.executor()
    upper = await executor.execute(call("blocking", {"text": "Hi"}), result_id="r:0")
    lower = await executor.execute(call("awaiting", {"text": "Hi"}), result_id="r:1")
    assert (upper.observation, lower.observation) == ("HI", "hi")
    assert seen["plain"] != loop_thread
    assert seen["async"] == loop_thread


async def test_a_function_that_raises_is_the_tools_own_failure() -> None:
    def divide(a: float, b: float) -> float:
        return a / b

    registry = ToolRegistry([ToolSpec.from_function(divide)], max_observation_chars=100)
    outcome = await registry.executor().execute(call("divide", {"a": 1, "b": 0}), result_id="r")
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.synthesized
    assert outcome.observation == "ZeroDivisionError: float division by zero"


def _variadic(*values: int) -> str:
    return ""


def _keywords(**values: int) -> str:
    return ""


def _positional(value: int, /) -> str:
    return ""


def _unhinted(value) -> str:  # type: ignore[no-untyped-def]
    return ""


def _private(_value: int) -> str:
    return ""


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (_variadic, "tool '_variadic': argument 'values' is variadic"),
        (_keywords, "tool '_keywords': argument 'values' is variadic"),
        (_positional, "tool '_positional': argument 'value' is positional-only"),
        (_unhinted, "tool '_unhinted': argument 'value' has no type hint"),
        (_private, "tool '_private': argument '_value' starts with an underscore"),
    ],
)
def test_a_parameter_that_cannot_be_described_is_refused_by_name(
    function: Any, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        ToolSpec.from_function(function)


def test_a_hint_that_does_not_resolve_is_refused_by_name() -> None:
    def lookup(key: Undefined) -> str:  # type: ignore[name-defined]  # noqa: F821
        return ""

    with pytest.raises(InvalidRequest, match="tool 'lookup': cannot read its signature"):
        ToolSpec.from_function(lookup)


def test_without_the_extra_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "docstring_parser", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs the tools extra: .*\.\[tools\]"):
        ToolSpec.from_function(ship)
