"""The demo agent: a small data set, four tools, a text interpreter, a scripted model.

The task: how many units were sold across every region of the bundled data set? The
agent lists the data files, reads each one, adds the numbers with a calculator and
submits the total. The scripted model takes exactly that path, with one detour: its
first calculator call writes words where the tool's JSON Schema wants arithmetic, the
registry refuses it, and the model tries again. A real model behind an OpenAI-compatible
server gets the same tools, prompt and interpreter.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from polyloop._json_decisions import Finding, LenientReading, first_object
from polyloop.ports import Decision, ModelReply
from polyloop.session import ObservationTexts, Request
from polyloop.tools import ToolRegistry, ToolSpec
from polyloop.types import Budget, Injection, JSONValue, Message, Replay, Role, ToolStyle

SYSTEM_PROMPT = """You are a careful data assistant working with tools.
Every reply must contain exactly one JSON object, on its own or in a ```json block:
  {"tool": "<tool name>", "arguments": {...}}   to call one tool, or
  {"answer": "<text>"}                          to answer without a tool.
The tools and the JSON Schemas of their arguments are listed below. Read the data with
the tools, do every calculation with the calculator, and finish by calling submit."""

GOAL = (
    "How many units were sold in total, across all regions and months in the data "
    "files? Submit that total."
)

TEXTS = ObservationTexts(
    not_executed="Refused, the tool did not run: {reason}",
    env_fault="Environment failure: {detail}",
)

_EMPTY_OBJECT: dict[str, JSONValue] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


def load_data() -> dict[str, str]:
    """The bundled data files, by name."""
    folder = resources.files("polyloop.cli").joinpath("demo_data")
    return {
        item.name: item.read_text(encoding="utf-8")
        for item in sorted(folder.iterdir(), key=lambda item: item.name)
        if item.name.endswith(".csv")
    }


def units(text: str) -> list[int]:
    """The ``units`` column of one data file."""
    return [int(row["units"]) for row in csv.DictReader(io.StringIO(text))]


@dataclass
class Ledger:
    """Every tool execution in this process, by the result id the kernel allocated."""

    result_ids: list[str] = field(default_factory=list)

    def steps(self) -> list[int]:
        """The step of each execution (the result id is ``<run>:<step>:action``)."""
        return [int(result_id.rsplit(":", 2)[-2]) for result_id in self.result_ids]


# -- tools -----------------------------------------------------------------------------------


def build_tools(data: Mapping[str, str], ledger: Ledger) -> ToolRegistry:
    """``list_files``, ``read_file`` and ``calculator`` (safe to repeat) and ``submit``."""
    expected = sum(sum(units(text)) for text in data.values())

    async def list_files(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        ledger.result_ids.append(result_id)
        return "\n".join(data)

    async def read_file(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        ledger.result_ids.append(result_id)
        name = str(arguments["name"])
        if name not in data:
            raise FileNotFoundError(f"no data file {name!r}; the files are {', '.join(data)}")
        return data[name]

    async def calculator(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        ledger.result_ids.append(result_id)
        return _number(evaluate(str(arguments["expression"])))

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        ledger.result_ids.append(result_id)
        total = arguments["total"]
        verdict = "correct" if total == expected else f"the data add up to {expected}"
        return f"Submitted total {total} ({verdict})."

    return ToolRegistry(
        [
            ToolSpec(
                name="list_files",
                description="List the data files.",
                parameters=_EMPTY_OBJECT,
                handler=list_files,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="read_file",
                description="Read one data file (CSV) by name.",
                parameters=_object({"name": {"type": "string", "minLength": 1}}),
                handler=read_file,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="calculator",
                description="Evaluate arithmetic: numbers, + - * /, parentheses.",
                parameters=_object(
                    {
                        "expression": {
                            "type": "string",
                            "maxLength": 500,
                            "pattern": r"^[0-9+\-*/(). ]+$",
                        }
                    }
                ),
                handler=calculator,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="submit",
                description="Submit the final total. Ends the task.",
                parameters=_object({"total": {"type": "integer"}}),
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=4_000,
    )


def _object(properties: dict[str, JSONValue]) -> dict[str, JSONValue]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> float | int:
    """Evaluate ``+ - * /`` arithmetic on numbers; ``ValueError`` for anything else."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.expr) -> float | int:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        result: float | int = _BINARY[type(node.op)](_value(node.left), _value(node.right))
        return result
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        negated: float | int = _UNARY[type(node.op)](_value(node.operand))
        return negated
    raise ValueError(f"unsupported in an expression: {ast.unparse(node)!r}")


def _number(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# -- the interpreter ------------------------------------------------------------------------


class TextToolInterpreter:
    """Reads the decision from the model's text.

    The first fenced ``json`` block that holds a JSON object wins; without one, the first
    JSON object anywhere in the text. ``{"tool": NAME, "arguments": {...}}`` is an
    action, ``{"answer": TEXT}`` a final answer; anything else is fed back as a
    correction that restates the format.
    """

    FEEDBACK = (
        "Your reply held no usable decision. Reply with exactly one JSON object: "
        '{"tool": "<name>", "arguments": {...}} or {"answer": "<text>"}.'
    )

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "polyloop-cli-text", "version": 1}

    def interpret(self, reply: ModelReply) -> Decision:
        return _READING.interpret(reply)


_READING = LenientReading(finding=Finding.FIRST_IN_TEXT, feedback=TextToolInterpreter.FEEDBACK)

find_object = first_object
"""The decision object of a reply (see :class:`TextToolInterpreter`), if any."""


# -- the scripted model ------------------------------------------------------------------------


def script(data: Mapping[str, str]) -> list[str]:
    """What the scripted model replies at each call: prose around a fenced JSON call."""
    numbers = [n for text in data.values() for n in units(text)]
    replies = [_say("Let me see which data files there are.", "list_files")]
    replies += [_say(f"Reading {name}.", "read_file", name=name) for name in data]
    replies += [
        _say("Now I add up every units column.", "calculator", expression="the sum of all units"),
        _say(
            "The calculator takes arithmetic only; here is the sum written out.",
            "calculator",
            expression=" + ".join(str(n) for n in numbers),
        ),
        _say(f"The total is {sum(numbers)}.", "submit", total=sum(numbers)),
    ]
    return replies


def _say(prose: str, tool: str, **arguments: JSONValue) -> str:
    call = json.dumps({"tool": tool, "arguments": arguments})
    return f"{prose}\n```json\n{call}\n```"


# -- the request -------------------------------------------------------------------------------


def build_request(run_id: str, tools: ToolRegistry) -> Request:
    """The demo's request; the same for a run and its resume."""
    return Request(
        run_id=run_id,
        budget=Budget(max_steps=16, max_valid_steps=12, max_context_chars=60_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, SYSTEM_PROMPT),),
        goal_context=(Message.text(Role.USER, GOAL),),
        injection=Injection(entries={}),
        binding={},
        model_replay=Replay.ALLOWED,
        observation_template="Tool result:\n{observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=5.0,
    )
