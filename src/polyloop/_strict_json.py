"""Reading JSON text strictly: what Python's reader lets through and a log cannot carry.

Python's ``json`` module reads ``NaN`` and ``Infinity`` (not JSON), reads ``1e400`` as
infinity, and keeps the last of two values under one key. Each refusal below is its own
``ValueError`` subclass, so a caller can say precisely what was wrong (an interpreter to
the model, the command line to a person) or report them all as one (a corrupt log line).
Written once, so the log reader, the interpreters and the command line refuse alike.
This module imports only the standard library.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

__all__ = (
    "STRICT_JSON",
    "STRICT_NUMBERS",
    "FloatOverflow",
    "IntegerTooLong",
    "NotJsonNumber",
    "RepeatedKey",
    "finite_float",
    "refuse_constant",
    "unique_keys",
    "whole_number",
)


class NotJsonNumber(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: words Python reads and JSON does not have."""

    def __init__(self, word: str) -> None:
        super().__init__(f"{word} is not a JSON number")
        self.word = word


class FloatOverflow(ValueError):
    """A JSON number too large for a float: Python would read it as infinity."""

    def __init__(self, text: str) -> None:
        super().__init__(f"{text} overflows a float")
        self.text = text


class IntegerTooLong(ValueError):
    """A JSON integer with more digits than Python converts (4,300 unless changed)."""

    def __init__(self, digits: int) -> None:
        super().__init__(f"an integer of {digits} digits is longer than Python reads")
        self.digits = digits


class RepeatedKey(ValueError):
    """An object names a key twice, so which value was meant is guesswork.

    ``keys`` holds every repeated key in the order each first appears.
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        super().__init__(f"duplicate keys {sorted(keys)}")
        self.keys = keys


def refuse_constant(word: str) -> Any:
    """The ``parse_constant`` hook: refuse ``NaN`` and the infinities."""
    raise NotJsonNumber(word)


def finite_float(text: str) -> float:
    """The ``parse_float`` hook: ``1e400`` is JSON, but no log can carry infinity."""
    number = float(text)
    if not math.isfinite(number):
        raise FloatOverflow(text)
    return number


def whole_number(text: str) -> int:
    """The ``parse_int`` hook: an over-long integer refused with its length."""
    try:
        return int(text)
    except ValueError:
        raise IntegerTooLong(len(text.lstrip("-"))) from None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """The ``object_pairs_hook``: refuse an object that names a key twice."""
    result = dict(pairs)
    if len(result) != len(pairs):
        # Counted once: an object of many keys must not cost their square to refuse.
        counts = Counter(key for key, _ in pairs)
        raise RepeatedKey(tuple(key for key, count in counts.items() if count > 1))
    return result


STRICT_NUMBERS = json.JSONDecoder(
    parse_constant=refuse_constant, parse_float=finite_float, parse_int=whole_number
)
"""Refuses what JSON has no number for; a repeated key keeps its last value, as usual."""

STRICT_JSON = json.JSONDecoder(
    parse_constant=refuse_constant,
    parse_float=finite_float,
    parse_int=whole_number,
    object_pairs_hook=unique_keys,
)
"""Refuses what JSON has no number for and objects that name a key twice."""
