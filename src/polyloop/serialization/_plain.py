"""The plain-value walk: a payload or snapshot copied as plain JSON types, or refused.

Payloads and snapshots come from code the library does not own, so before a record is
written each is copied as the JSON types it would read back as, and anything strict JSON
cannot carry back exactly is refused with an :class:`~polyloop.types.UnloggableValue`
that names the path to it. Also here: the depth and digit limits of a written value, and
:class:`_NotSimple`, which every quick path raises to hand a value to the careful one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from polyloop.types import JSONValue, UnloggableValue

_MAX_INT_DIGITS = 4_300
# Deep enough for any real payload, shallow enough that the reader (whose limit is the
# interpreter's recursion limit) always reads back what was written.
_MAX_DEPTH = 256


class _NotSimple(Exception):
    """Raised by a quick path for anything it leaves to the careful one.

    :func:`_copy_simple` and the direct lines raise it; the careful path then checks,
    converts or refuses the value.
    """


def _copy_simple(item: Any, depth: int) -> JSONValue:
    """The result of :func:`_walk_plain` for values made of exact JSON types only.

    Payloads are almost always such values, and this walk does not build the path of
    every node, which the careful walk needs only to name a refused one. Anything else
    (subclasses, other mappings, values to refuse) raises :class:`_NotSimple`.
    """
    if depth > _MAX_DEPTH:
        raise _NotSimple
    if item is None or type(item) is str or type(item) is bool:
        return item
    if type(item) is int:
        if item.bit_length() > 14_000:
            raise _NotSimple
        return item
    if type(item) is float:
        if not math.isfinite(item):
            raise _NotSimple
        return item
    kind = type(item)
    if kind is dict:
        # Keys of a dict are distinct, so the careful walk's duplicate check cannot fire.
        result: dict[str, JSONValue] = {}
        for key, sub in item.items():
            if type(key) is not str:
                raise _NotSimple
            result[key] = _copy_simple(sub, depth + 1)
        return result
    if kind is list or kind is tuple:
        return [_copy_simple(sub, depth + 1) for sub in item]
    raise _NotSimple


def _walk_plain(value: Any, owner: str, field: str, run_id: str | None) -> JSONValue:
    """A deep copy of ``value`` as plain JSON types, or UnloggableValue naming the path."""
    try:
        return _copy_simple(value, 0)
    except _NotSimple:
        pass  # the careful walk below copies it, or names the path of what it refuses

    def walk(item: Any, path: str, depth: int = 0) -> JSONValue:
        if depth > _MAX_DEPTH:
            raise _refuse(f"{field} is nested more than {_MAX_DEPTH} levels deep")
        if item is None or isinstance(item, (bool, str)):
            return item
        if isinstance(item, int):
            # JSON readers in Python refuse integers of more than 4,300 digits by
            # default, so such a number would be written and never read back.
            if item.bit_length() > 14_000 and _too_many_digits(item):
                raise _refuse(f"integer of more than {_MAX_INT_DIGITS} digits at {path}")
            return int(item)
        if isinstance(item, float):
            if not math.isfinite(item):
                raise _refuse(f"{item!r} at {path} is not a JSON number")
            return float(item)
        if isinstance(item, Mapping):
            result: dict[str, JSONValue] = {}
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise _refuse(f"key {key!r} at {path} is not a string")
                if key in result:
                    raise _refuse(f"key {key!r} appears twice at {path}")
                result[key] = walk(sub, f"{path}.{key}", depth + 1)
            return result
        if isinstance(item, (list, tuple)):
            return [walk(sub, f"{path}[{i}]", depth + 1) for i, sub in enumerate(item)]
        raise _refuse(f"{type(item).__name__} at {path} is not a JSON value")

    def _refuse(reason: str) -> UnloggableValue:
        return UnloggableValue(f"{owner}: {reason}", run_id=run_id)

    return walk(value, field)


def _too_many_digits(number: int) -> bool:
    try:
        return len(str(abs(number))) > _MAX_INT_DIGITS
    except ValueError:  # str() itself refuses past the interpreter's limit
        return True
