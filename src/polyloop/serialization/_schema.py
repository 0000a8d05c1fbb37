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
    StepRecord,
    StopReason,
    ToolCallBlock,
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
        # "time", "steps" (step records nested in another record), or an enum
    )
    optional: bool  # null is a value
    defaulted: bool  # may be missing: added after the first release of the major
    written_when_set: bool  # left out of a written record while it is None
    # The check's converter and writer, chosen once from ``check`` (see _converters).
    convert: Callable[[Any], Any] = dataclasses.field(repr=False, compare=False)
    write: Callable[[Any], Any] = dataclasses.field(repr=False, compare=False)
    # The two in one for the writing direction: a held value as the JSON object carries
    # it, or Mismatch. None for the fields whose values are walked as payloads.
    emit: Callable[[Any], Any] | None = dataclasses.field(repr=False, compare=False)
    # The type whose values the JSON object carries unchanged (``str`` for a "str"
    # field): a value of exactly that type passes the check as it is. A type no value
    # has for every other check.
    as_is: type[Any] = dataclasses.field(repr=False, compare=False)


class Mismatch(Exception):
    """A value a check refuses: ``expected`` says what the check wanted, or ``detail``
    what is wrong inside a value of the right shape."""

    def __init__(self, expected: str, *, detail: str | None = None) -> None:
        super().__init__(expected)
        self.expected = expected
        self.detail = detail


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
    "tuple[StepRecord, ...]": "steps",
    **{
        cls.__name__: cls
        for cls in (ActionStatus, DecisionKind, FinishReason, IntentKind, Replay, StopReason)
    },
}


def _field(spec: dataclasses.Field[Any]) -> Field:
    annotation = str(spec.type)
    base = annotation.removesuffix(" | None")
    check = _CHECKS[base]
    convert, write = _converters(check)
    walked = check in ("json", "object", "tool_call")
    return Field(
        name=spec.name,
        # "kind" is the record's own kind in the JSON object; the intent kind of an
        # intent or result goes under another key.
        key="intent_kind" if spec.name == "kind" else spec.name,
        check=check,
        # A JSON value holds null itself; one written only when set is left out as None.
        optional=base != annotation
        or (check == "json" and bool(spec.metadata.get("written_when_set"))),
        defaulted=spec.default is not dataclasses.MISSING,
        written_when_set=bool(spec.metadata.get("written_when_set")),
        convert=convert,
        write=write,
        emit=None if walked else _emitter(check, convert, write),
        as_is=_AS_IS.get(check, _Converted) if isinstance(check, str) else _Converted,
    )


class _Converted:
    """The type of no field value: a field whose values are all converted or walked."""


# The checks that hold a value of exactly this type as it is (a bool is not a count,
# and a float field holds an integer as a float: neither type is passed as it is).
_AS_IS: dict[str, type[Any]] = {"str": str, "int": int, "bool": bool, "float": float}


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
    error: Callable[[str], Exception],
) -> Any:
    """``value`` as the record holds it (an enum as its member), or ``error(reason)``."""
    if value is None and field.optional:
        return None
    try:
        return field.convert(value)
    except Mismatch as mismatch:
        if mismatch.detail is not None:
            raise error(f"{kind}.{field.name}: {mismatch.detail}") from None
        expected = mismatch.expected
    if field.optional:
        expected = f"null or {expected}"
    raise error(f"{kind}.{field.name} must be {expected}, not {value!r:.80}")


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


# Each check is a converter (the value as the record holds it, or Mismatch) and a
# writer (the held value as the JSON object carries it), chosen once per field: the
# codec runs for every record written and read, so it looks nothing up per value.


def _converters(check: Check) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    if isinstance(check, type):
        return _enum_converter(check), _enum_value
    return _BY_NAME[check]


def _enum_converter(cls: type[enum.Enum]) -> Callable[[Any], Any]:
    expected = f"one of {[m.value for m in cls]}"

    def convert(value: Any) -> Any:
        try:
            return cls(value)
        except ValueError:
            raise Mismatch(expected) from None

    return convert


def _enum_value(member: enum.Enum) -> Any:
    return member.value


def _emitter(
    check: Check, convert: Callable[[Any], Any], write: Callable[[Any], Any]
) -> Callable[[Any], Any]:
    # Every record written goes through these, so the held value the record was built
    # with (a member, a UTC time) is recognised by its type before any conversion.
    if isinstance(check, type):
        cls = check

        def emit_member(value: Any) -> Any:
            if type(value) is cls:
                return value._value_  # what .value reads, without the property's call
            return convert(value).value

        return emit_member
    if check == "time":
        return _emit_time
    if write is _same:
        return convert
    return lambda value: write(convert(value))


def _emit_time(value: Any) -> str:
    if type(value) is datetime and value.tzinfo is UTC:
        return value.isoformat(timespec="microseconds")[:-6] + "Z"  # drop "+00:00"
    return plain_time(_to_time(value))


def _same(value: Any) -> Any:
    return value


def _to_usage(value: Any) -> Usage:
    if isinstance(value, Usage):
        return value
    if isinstance(value, dict):
        try:
            return usage_from(value)
        except ValueError as exc:
            raise Mismatch("an object of token counts", detail=str(exc)) from None
    raise Mismatch("an object of token counts")


def _to_tool_call(value: Any) -> ToolCallBlock:
    call = value if isinstance(value, ToolCallBlock) else tool_call_from(value)
    if call is not None and isinstance(call.call_id, str) and isinstance(call.name, str):
        return call
    raise Mismatch('an object with string "call_id" and "name", and "arguments"')


def _to_object(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    raise Mismatch("an object")


def _to_time(value: Any) -> datetime:
    moment = value if isinstance(value, datetime) else time_from(value)
    if moment is not None and moment.utcoffset() is not None:
        return moment.astimezone(UTC)
    raise Mismatch("an RFC 3339 date and time with its offset")


def _to_str(value: Any) -> Any:
    if isinstance(value, str):
        return value
    raise Mismatch("a str")


def _to_int(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):  # a bool is not a count
        return value
    raise Mismatch("a int")


def _to_bool(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    raise Mismatch("a bool")


def _to_float(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise Mismatch("a float")
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float: not a readable duration
        raise Mismatch("a number a float can hold") from None


def _to_steps(value: Any) -> tuple[StepRecord, ...]:
    """Step records held inside another record (a fork's inherited steps), each
    checked field by field as a step record read on its own is: written as an object of
    the step kind's fields, read back from one."""
    if not isinstance(value, list | tuple):
        raise Mismatch("a list of step records")
    return tuple(_nested_step(item, index) for index, item in enumerate(value))


def _nested_step(item: Any, index: int) -> StepRecord:
    if isinstance(item, StepRecord):
        data = {field.key: getattr(item, field.name) for field in FIELDS["step"]}
    elif isinstance(item, dict):
        data = item
    else:
        raise Mismatch("a list of step records", detail=f"item {index} is not a step record")

    def inside(reason: str) -> Mismatch:
        return Mismatch("a list of step records", detail=f"item {index}: {reason}")

    values: dict[str, Any] = {}
    for field in FIELDS["step"]:
        if field.key not in data:
            if field.defaulted:
                continue
            raise Mismatch("a list of step records", detail=f"item {index} has no {field.key!r}")
        values[field.name] = checked("step", field, data[field.key], inside)
    return StepRecord(**values)


def _plain_steps(steps: tuple[StepRecord, ...]) -> list[dict[str, Any]]:
    """How nested step records are written: each as the step kind's fields."""
    return [
        {
            field.key: None if (value := getattr(step, field.name)) is None else field.write(value)
            for field in FIELDS["step"]
            if not (field.written_when_set and getattr(step, field.name) is None)
        }
        for step in steps
    ]


_BY_NAME: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "str": (_to_str, _same),
    "int": (_to_int, _same),
    "bool": (_to_bool, _same),
    "float": (_to_float, _same),
    "json": (_same, _same),
    "object": (_to_object, _same),
    "usage": (_to_usage, plain_usage),
    "tool_call": (_to_tool_call, plain_tool_call),
    "time": (_to_time, plain_time),
    "steps": (_to_steps, _plain_steps),
}

RECORD_CLASS: dict[str, type[Any]] = {
    RECORD_KINDS[cls.__name__]: cls for cls in typing.get_args(Record)
}
FIELDS: dict[str, tuple[Field, ...]] = {
    kind: tuple(_field(spec) for spec in dataclasses.fields(cls))
    for kind, cls in RECORD_CLASS.items()
}
