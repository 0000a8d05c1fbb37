"""The record format: each kind's fields, read off the record dataclasses, and their checks.

For every field: the check its value passes on the way out and on the way back in, the
key it has in the JSON object, whether ``null`` is a value and whether an older record
may lack it. Writing and reading share this table, so the writer refuses exactly what
the reader would refuse. The table is derived from :mod:`polyloop.types`: a field added
to a record (with a default, as every later field is) is written, read and checked
with no edit here, unless its annotation names a type the format has no check for.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from polyloop._shared import FORMAT, RECORD_KINDS
from polyloop.types import (
    ActionStatus,
    CorruptLog,
    DecisionKind,
    FinishReason,
    IntentKind,
    Record,
    Replay,
    SchemaMajorMismatch,
    StopReason,
    ToolCallBlock,
    UnloggableValue,
    Usage,
)

MAJOR = int(FORMAT.partition("/")[2])
_SCHEMA_PATTERN = re.compile(r"polyloop/(0|[1-9][0-9]*)(?:\.[0-9]+)?", re.ASCII)

Check = str | type[enum.Enum]

USAGE_COUNTS = ("input_tokens", "output_tokens", "reasoning_tokens")


@dataclass(frozen=True, slots=True, kw_only=True)
class Field:
    """One field of a record kind, as the format writes and reads it."""

    name: str  # the attribute of the record
    key: str  # the key in the JSON object
    check: (
        Check  # "str", "int", "bool", "float", "json", "object", "usage", "tool_call",
        # "time", or an enum
    )
    optional: bool  # null is a value
    defaulted: bool  # may be missing: added after the first release of the major
    written_when_set: bool  # left out of a written record while it is None


# Annotations of record fields, as written in polyloop.types, and their checks. "json"
# fields carry values the library did not make itself (payloads), so they are walked.
_CHECKS: dict[str, Check] = {
    "str": "str",
    "int": "int",
    "bool": "bool",
    "float": "float",
    "JSONValue": "json",
    "Mapping[str, JSONValue]": "object",
    "Usage": "usage",
    "ToolCallBlock": "tool_call",
    "datetime": "time",
    **{
        cls.__name__: cls
        for cls in (ActionStatus, DecisionKind, FinishReason, IntentKind, Replay, StopReason)
    },
}


def _field(spec: dataclasses.Field[Any]) -> Field:
    annotation = str(spec.type)
    base = annotation.removesuffix(" | None")
    return Field(
        name=spec.name,
        # "kind" is the record's own kind in the JSON object; the intent kind of an
        # intent or result goes under another key.
        key="intent_kind" if spec.name == "kind" else spec.name,
        check=_CHECKS[base],
        optional=base != annotation,
        defaulted=spec.default is not dataclasses.MISSING,
        written_when_set=bool(spec.metadata.get("written_when_set")),
    )


RECORD_CLASS: dict[str, type[Any]] = {
    RECORD_KINDS[cls.__name__]: cls for cls in typing.get_args(Record)
}
FIELDS: dict[str, tuple[Field, ...]] = {
    kind: tuple(_field(spec) for spec in dataclasses.fields(cls))
    for kind, cls in RECORD_CLASS.items()
}


def check_schema(
    schema: Any, corrupt: Callable[[str], CorruptLog], run_id: str | None, location: str | None
) -> None:
    """Raise unless ``schema`` names a readable version of the format."""
    if not isinstance(schema, str) or not schema.startswith("polyloop/"):
        raise corrupt(f"no polyloop schema field (found {schema!r:.80})")
    match = _SCHEMA_PATTERN.fullmatch(schema)
    if match is None:
        raise corrupt(f"unreadable schema {schema!r:.80}")
    if int(match.group(1)) != MAJOR:
        raise SchemaMajorMismatch(
            f"record format {schema!r} is not readable by this library (reads {FORMAT!r})",
            run_id=run_id,
            location=location,
        )


def checked(
    kind: str,
    field: Field,
    value: Any,
    error: Callable[[str], CorruptLog | UnloggableValue],
) -> Any:
    """``value`` as the record holds it (an enum as its member), or ``error(reason)``."""
    check = field.check
    if value is None and field.optional:
        return None
    if isinstance(check, type):
        try:
            return check(value)
        except ValueError:
            expected = f"one of {[m.value for m in check]}"
    elif check == "json":
        return value
    elif check == "usage":
        if isinstance(value, Usage):
            return value
        if isinstance(value, dict):
            try:
                return usage_from(value)
            except ValueError as exc:
                raise error(f"{kind}.{field.name}: {exc}") from None
        expected = "an object of token counts"
    elif check == "tool_call":
        call = value if isinstance(value, ToolCallBlock) else tool_call_from(value)
        if call is not None and isinstance(call.call_id, str) and isinstance(call.name, str):
            return call
        expected = 'an object with string "call_id" and "name", and "arguments"'
    elif check == "object":
        if isinstance(value, dict):
            return value
        expected = "an object"
    elif check == "time":
        moment = value if isinstance(value, datetime) else time_from(value)
        if moment is not None and moment.utcoffset() is not None:
            return moment.astimezone(UTC)
        expected = "an RFC 3339 date and time with its offset"
    elif not _IS_BASE[check](value):
        expected = f"a {check}"
    elif check != "float":
        return value
    else:
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float: not a readable duration
            expected = "a number a float can hold"
    if field.optional:
        expected = f"null or {expected}"
    raise error(f"{kind}.{field.name} must be {expected}, not {value!r:.80}")


# The scalar checks, one per base name (a bool is an int, but not a number here).
_IS_BASE: dict[str, Callable[[Any], bool]] = {
    "str": lambda value: isinstance(value, str),
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "bool": lambda value: isinstance(value, bool),
    "float": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
}


def usage_from(value: dict[str, Any]) -> Usage:
    """The usage an encoded object holds; ``ValueError`` for a count that is not one.

    Counts a later minor of the format may add are ignored, like unknown fields.
    """
    return Usage(**{name: value.get(name) for name in USAGE_COUNTS})


def plain_usage(usage: Usage) -> dict[str, Any]:
    """How a :class:`Usage` is written: an object of its counts."""
    return {name: getattr(usage, name) for name in USAGE_COUNTS}


def plain_time(moment: datetime) -> str:
    """How a time is written: RFC 3339 in UTC, to the microsecond, with a ``Z``."""
    return moment.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def time_from(value: Any) -> datetime | None:
    """The time an RFC 3339 string holds, or ``None`` if it holds none."""
    if not isinstance(value, str) or "T" not in value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def plain_tool_call(call: ToolCallBlock) -> dict[str, Any]:
    """How a :class:`ToolCallBlock` is written: an object of its three fields."""
    return {"call_id": call.call_id, "name": call.name, "arguments": call.arguments}


def tool_call_from(value: Any) -> ToolCallBlock | None:
    """The tool call an encoded object holds, or ``None`` if it holds none."""
    if not isinstance(value, dict) or not {"call_id", "name", "arguments"} <= set(value):
        return None
    return ToolCallBlock(call_id=value["call_id"], name=value["name"], arguments=value["arguments"])
