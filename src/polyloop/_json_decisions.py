"""The JSON action language, read in one place: one object per reply, a tool call or an answer.

``{"tool": NAME, "arguments": {...}}`` calls a tool and ``{"answer": TEXT}`` answers.
The public :class:`polyloop.interpreters.JsonToolCallInterpreter` reads it exactly
(:func:`read_exactly`) and tells the model precisely what was wrong. The test double of
:mod:`polyloop.testing` and the demo agent of the command line read the same language
more loosely, each a :class:`LenientReading`: the object is found another way, keys the
language does not know are ignored, and one fixed feedback answers every fault. Numbers
are read strictly everywhere (:mod:`polyloop._strict_json`).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from polyloop._fences import FencedBlock, clip, scan_fences
from polyloop._shared import call_text
from polyloop._strict_json import (
    STRICT_JSON,
    STRICT_NUMBERS,
    FloatOverflow,
    IntegerTooLong,
    NotJsonNumber,
    RepeatedKey,
)
from polyloop.ports import (
    Action,
    Decision,
    FinalAnswer,
    InvalidDecision,
    ModelReply,
    reject_incomplete,
)

__all__ = ("Finding", "LenientReading", "first_object", "read_exactly")

_FORMAT = (
    "Reply with one JSON object, on its own or inside one ```json block (text around the "
    'block is fine): {"tool": "<name>", "arguments": {...}} to call a tool, or '
    '{"answer": "<text>"} to answer.'
)
_MAX_ATTEMPTS = 64
_BLOCK_TAGS = frozenset({"", "json"})
_TOOL_KEYS = frozenset({"tool", "arguments"})
_ANSWER_KEYS = frozenset({"answer"})


def read_exactly(reply: ModelReply) -> Decision:
    """The decision of ``reply``, read as
    :class:`~polyloop.interpreters.JsonToolCallInterpreter` documents."""
    if (rejected := reject_incomplete(reply)) is not None:
        return rejected  # cut off, filtered or refused: never acted on
    text = reply.content
    found = _find_object(text)
    decided = found if isinstance(found, str) else _decide(found, text, exact=True)
    if isinstance(decided, str):
        return InvalidDecision(feedback=f"{decided} {_FORMAT}", history_text=text)
    return decided


class Finding(enum.Enum):
    """Where a lenient reading looks for the decision object."""

    WHOLE_REPLY = "whole-reply"
    """The whole reply is one JSON value (whitespace around it is fine)."""

    FIRST_IN_TEXT = "first-in-text"
    """The first object in a fenced ``json`` or untagged block, else anywhere in the text."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LenientReading:
    """The JSON action language read loosely, for a test double or a demo.

    Any object found as ``finding`` says is read: a string ``"tool"`` is a call (its
    ``"arguments"`` taken as they are, ``{}`` if missing); without a ``"tool"`` key, a
    string ``"answer"`` answers. Other keys are ignored, a repeated key keeps its last
    value, and everything else is answered with ``feedback``.
    """

    finding: Finding
    feedback: str

    def interpret(self, reply: ModelReply) -> Decision:
        """The action, answer or correction that ``reply`` amounts to."""
        if (rejected := reject_incomplete(reply)) is not None:
            return rejected  # cut off, filtered or refused: never acted on
        text = reply.content
        found = _whole_reply(text) if self.finding is Finding.WHOLE_REPLY else first_object(text)
        decided = None if found is None else _decide(found, text, exact=False)
        if decided is None or isinstance(decided, str):
            return InvalidDecision(feedback=self.feedback, history_text=text)
        return decided


def _whole_reply(text: str) -> dict[str, Any] | None:
    try:
        value = STRICT_NUMBERS.decode(text)
    except (ValueError, RecursionError):  # not JSON, or nested beyond the parser
        return None
    return value if isinstance(value, dict) else None


_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)```", re.DOTALL)


def first_object(text: str) -> dict[str, Any] | None:
    """The first JSON object of a fenced ``json`` or untagged block holding one, else
    the first anywhere in ``text``; ``None`` without one."""
    for block in _FENCED.findall(text):
        found = _first_in(block)
        if found is not None:
            return found
    return _first_in(text)


def _first_in(text: str) -> dict[str, Any] | None:
    start = text.find("{")
    while start >= 0:
        try:
            value, _ = STRICT_NUMBERS.raw_decode(text, start)
        except (ValueError, RecursionError):
            value = None
        if isinstance(value, dict):
            return value
        start = text.find("{", start + 1)
    return None


# -- reading exactly: the one object of a reply, or what is wrong with the reply --------------


def _find_object(text: str) -> dict[str, Any] | str:
    """The reply's one JSON object, or what is wrong with the reply."""
    scan = scan_fences(text)
    if scan.unclosed is not None:
        return (
            f"Your reply opens a code block on line {scan.unclosed.opening_line} and never "
            "closes it: end the block with a line of three backticks."
        )
    if len(scan.blocks) > 1:
        lines = ", ".join(str(block.opening_line) for block in scan.blocks)
        return (
            f"Your reply holds {len(scan.blocks)} code blocks (opening on lines {lines}); "
            "send exactly one decision, in one block."
        )
    if not scan.blocks:
        return _parse(text, first_line=1, block=None)
    [block] = scan.blocks
    if block.tag.lower() not in _BLOCK_TAGS:
        return (
            f"Your code block on line {block.opening_line} is tagged {clip(block.tag)!r}; "
            "a decision goes in a ```json block."
        )
    return _parse(block.body, first_line=block.opening_line + 1, block=block)


def _parse(source: str, *, first_line: int, block: FencedBlock | None) -> dict[str, Any] | str:
    where = "Your reply" if block is None else f"Your code block on line {block.opening_line}"

    def at(position: int) -> str:
        line = source.count("\n", 0, position)
        column = position - (source.rfind("\n", 0, position) + 1) + 1
        return f"line {first_line + line}, column {column}"

    start = len(source) - len(source.lstrip())
    if start == len(source):
        return f"{where} is empty."
    try:
        value, end = STRICT_JSON.raw_decode(source, start)
    except json.JSONDecodeError as exc:
        if source[start] in "{[":
            return f"{where} is not valid JSON: {exc.msg} at {at(exc.pos)}."
        return _prose_before_object(source, where, at, fenced=block is not None)
    except FloatOverflow as exc:
        return f"{where} holds the number {exc.text}, too large to use: write a smaller number."
    except IntegerTooLong as exc:
        return (
            f"{where} holds a whole number of {exc.digits} digits, too long to read: write fewer."
        )
    except RepeatedKey as exc:
        return (
            f"{where} names the key {clip(exc.keys[0])!r} twice in one object: give each key "
            "once, so that it is clear which value you mean."
        )
    except NotJsonNumber as exc:
        return f"{where} uses {exc.word}, which is not JSON: write numbers as numbers."
    except RecursionError:
        return f"{where} holds JSON nested too deeply to read."
    rest = len(source) - len(source[end:].lstrip())
    if rest < len(source) and not isinstance(value, dict | list):
        # A reply such as "3 tools left: {...}" starts with a number but is prose.
        return _prose_before_object(source, where, at, fenced=block is not None)
    if rest < len(source):
        if isinstance(_try_decode(source, rest), dict | list):
            return (
                f"{where} holds more than one JSON value (the second starts at {at(rest)}); "
                "send exactly one object: one decision per reply."
            )
        outside = "write text outside the block"
        if block is None:
            outside = f"put it in a ```json block and {outside}"
        return (
            f"{where} goes on after the JSON, at {at(rest)}: send the object alone, or {outside}."
        )
    if not isinstance(value, dict):
        return f"{where} is JSON, but {_kind(value)}, not an object."
    return value


def _try_decode(source: str, position: int) -> object:
    """The JSON value at ``position``, or ``None`` if there is none."""
    try:
        value, _ = STRICT_JSON.raw_decode(source, position)
    except (ValueError, RecursionError):
        return None
    return value


def _prose_before_object(source: str, where: str, at: Callable[[int], str], *, fenced: bool) -> str:
    """What to say about a text that does not start with JSON."""
    instead = "write text outside the block"
    if not fenced:
        instead = f"put it in a ```json block and {instead}"
    brace = source.find("{")
    broken: tuple[int, json.JSONDecodeError] | None = None
    # Each attempt may read to the end of the text; a bound keeps a reply full of
    # braces from costing quadratic time.
    for _ in range(_MAX_ATTEMPTS):
        if brace < 0:
            break
        try:
            value, _ = STRICT_JSON.raw_decode(source, brace)
        except json.JSONDecodeError as exc:
            broken = broken or (brace, exc)
        except (ValueError, RecursionError):
            pass
        else:
            if isinstance(value, dict):
                return (
                    f"{where} has text before the JSON object (which starts at {at(brace)}): "
                    f"send the object alone, or {instead}."
                )
        brace = source.find("{", brace + 1)
    if broken is not None:
        opening, error = broken
        return (
            f"{where} holds no valid JSON object: the one starting at {at(opening)} breaks "
            f"off with {error.msg} at {at(error.pos)}."
        )
    return f"{where} holds no JSON object."


def _kind(value: object) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return "a number"


def _keys(keys: Iterable[str]) -> str:
    shown = sorted(keys)
    listed = ", ".join(repr(clip(str(key))) for key in shown[:5])
    return listed + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")


# -- deciding: what an object found amounts to ------------------------------------------------


def _decide(data: dict[str, Any], text: str, *, exact: bool) -> Decision | str:
    """The decision ``data`` amounts to, or what is wrong with it.

    Read loosely (``exact=False``), only the types of ``"tool"`` and ``"answer"`` count.
    """
    if "tool" in data and "answer" in data and exact:
        return (
            'Your JSON object has both "tool" and "answer": send a tool call or an answer, '
            "not both."
        )
    if "tool" in data:
        return _call(data, text, exact=exact)
    if "answer" not in data:
        keys = f"its keys are {_keys(data)}" if data else "it is empty"
        return f'Your JSON object has neither "tool" nor "answer" ({keys}).'
    if exact and (extra := data.keys() - _ANSWER_KEYS):
        return (
            f'Your answer object has keys other than "answer": {_keys(extra)}; '
            "write any other text outside the JSON."
        )
    answer = data["answer"]
    if not isinstance(answer, str):
        return f'"answer" must be a string, not {_kind(answer)}.'
    return FinalAnswer(answer=answer, history_text=text)


def _call(data: dict[str, Any], text: str, *, exact: bool) -> Decision | str:
    name, arguments = data["tool"], data.get("arguments", {})
    if not isinstance(name, str):
        return f'"tool" must be the tool\'s name as a string, not {_kind(name)}.'
    if exact and (problem := _call_fault(data, name, arguments)):
        return problem
    return Action(
        payload={"name": name, "arguments": arguments},
        action_text=call_text(name, arguments),
        history_text=text,
    )


def _call_fault(data: dict[str, Any], name: str, arguments: object) -> str | None:
    if not name:
        return '"tool" is empty: name the tool to call.'
    if not isinstance(arguments, dict):
        return f'"arguments" must be a JSON object, not {_kind(arguments)}.'
    if extra := data.keys() - _TOOL_KEYS:
        return (
            f'Your tool call has keys other than "tool" and "arguments": {_keys(extra)}; '
            'put the tool\'s arguments inside "arguments" and any other text outside the JSON.'
        )
    return None
