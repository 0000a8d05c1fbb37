"""Encode and decode persisted records: the one way to read a log, now and months later.

A record encodes to a JSON object that carries ``"schema": "polyloop/1"`` and a ``"kind"``.
:func:`dumps` writes it as one line of canonical JSON (sorted keys, no spaces, UTF-8, no
raw newline), :func:`loads` reads such a line back. The codec is strict in both
directions, because a log is only worth keeping if it reads back exactly as written:

* writing refuses what JSON cannot carry back exactly: ``NaN``, infinities, integers
  longer than Python's integer-string limit, keys that are not strings, values that are
  not JSON (:class:`~polyloop.types.UnloggableValue`);
* reading refuses duplicate keys, ``NaN``/``Infinity`` literals, numbers that overflow to
  infinity, missing or mistyped fields and unknown kinds (:class:`~polyloop.types.CorruptLog`),
  and another major of the format (:class:`~polyloop.types.SchemaMajorMismatch`).

Unknown extra fields of the same major are ignored, so later minor versions can add
fields without breaking older readers.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from polyloop.types import (
    ActionStatus,
    CorruptLog,
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Record,
    Replay,
    Result,
    RunEnded,
    RunStarted,
    SchemaMajorMismatch,
    StepRecord,
    StopReason,
    UnloggableValue,
)

__all__ = ("decode", "dumps", "encode", "loads", "plain")

SCHEMA = "polyloop/1"
_MAJOR = 1
_MAX_INT_DIGITS = 4_300
# Deep enough for any real payload, shallow enough that the reader (whose limit is the
# interpreter's recursion limit) always reads back what was written.
_MAX_DEPTH = 256
# Built once: json.dumps with options builds a new encoder on every call.
_CANONICAL = json.JSONEncoder(ensure_ascii=False, allow_nan=False, sort_keys=True,
                              separators=(",", ":"))
_CANONICAL_ASCII = json.JSONEncoder(ensure_ascii=True, allow_nan=False, sort_keys=True,
                                    separators=(",", ":"))
_SCHEMA_PATTERN = re.compile(r"polyloop/(0|[1-9][0-9]*)(?:\.[0-9]+)?", re.ASCII)
# Line and paragraph separators are legal raw in JSON strings but split lines for
# readers that use str.splitlines(); escaping them keeps every record on one line for all.
_LINE_BREAKERS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}

_KIND_OF: dict[type[Any], str] = {
    RunStarted: "run_started",
    Intent: "intent",
    Result: "result",
    StepRecord: "step",
    RunEnded: "run_ended",
}

# Field name -> how its value is checked on the way in and out. "json" fields carry
# values the library did not make itself (payloads, snapshots), so they are walked.
_Check = str | type[enum.Enum]
_FIELDS: dict[str, tuple[tuple[str, _Check], ...]] = {
    "run_started": (("run_id", "str"), ("snapshot", "object")),
    "intent": (
        ("run_id", "str"),
        ("result_id", "str"),
        ("kind", IntentKind),
        ("step", "int"),
        ("call_index", "int"),
        ("replay", Replay),
        ("payload", "json"),
        ("action_text", "str?"),
        ("history_text", "str?"),
    ),
    "result": (
        ("run_id", "str"),
        ("result_id", "str"),
        ("kind", IntentKind),
        ("payload", "json"),
    ),
    "step": (
        ("run_id", "str"),
        ("step", "int"),
        ("call_id", "str?"),
        ("model_output", "str"),
        ("reasoning", "str?"),
        ("decision", DecisionKind),
        ("history_text", "str"),
        ("action_text", "str?"),
        ("observation", "str?"),
        ("observation_synthesized", "bool"),
        ("action_status", ActionStatus),
        ("done", "bool"),
        ("truncated_chars", "int"),
        ("error", "str?"),
        ("final_answer", "str?"),
        ("duration_s", "float?"),
    ),
    "run_ended": (
        ("run_id", "str"),
        ("stop_reason", StopReason),
        ("final_answer", "str?"),
        ("steps", "int"),
        ("valid_steps", "int"),
        ("detail", "str?"),
    ),
}
_OPTIONAL_ENUMS = {("step", "action_status")}
_RECORD_CLASS: dict[str, type[Any]] = {kind: cls for cls, kind in _KIND_OF.items()}
# Fields added after the first release of the major: absent means their default.
_DEFAULTED = {
    ("intent", "action_text"),
    ("intent", "history_text"),
    ("step", "final_answer"),
    ("step", "duration_s"),
}

# Record-level fields that the intent carries under another name in the JSON object,
# because "kind" is the record kind there.
_RENAMED = {("intent", "kind"): "intent_kind", ("result", "kind"): "intent_kind"}


def _json_name(kind: str, field: str) -> str:
    return _RENAMED.get((kind, field), field)


# Per base check, the exact types whose values encode as they are.
_EXACT: dict[str, frozenset[type[Any]]] = {
    "str": frozenset({str}),
    "int": frozenset({int}),
    "bool": frozenset({bool}),
    "float": frozenset({float}),
}
_NONE = frozenset({type(None)})


def _exact_types(check: _Check) -> frozenset[type[Any]]:
    if not isinstance(check, str) or check.rstrip("?") not in _EXACT:
        return frozenset()
    exact = _EXACT[check.rstrip("?")]
    return exact | _NONE if check.endswith("?") else exact


# kind -> (field, name in the JSON object, check, exact types) for each field, in order.
_ENCODING_PLANS: dict[str, tuple[tuple[str, str, _Check, frozenset[type[Any]]], ...]] = {
    kind: tuple((field, _json_name(kind, field), check, _exact_types(check))
                for field, check in fields)
    for kind, fields in _FIELDS.items()
}


def encode(record: Record) -> dict[str, JSONValue]:
    """Encode ``record`` as a JSON-ready dict carrying the schema and the record kind.

    Raises :class:`~polyloop.types.UnloggableValue` for a payload or snapshot that
    strict JSON cannot carry back exactly.
    """
    kind = _KIND_OF.get(type(record))
    if kind is None:
        raise UnloggableValue(f"not a record: {type(record).__name__}")
    run_id = getattr(record, "run_id", None)

    def refuse(reason: str) -> UnloggableValue:
        return UnloggableValue(reason, run_id=run_id if isinstance(run_id, str) else None)

    out: dict[str, JSONValue] = {"schema": SCHEMA, "kind": kind}
    for field, name, check, exact in _ENCODING_PLANS[kind]:
        value = getattr(record, field)
        # Values of exactly the expected type are what the checks below would return
        # unchanged (an enum member: its value), so they skip them.
        if type(value) in exact:
            out[name] = value
            continue
        if type(value) is check:
            out[name] = value.value
            continue
        if check in ("json", "object"):
            value = _plain(value, record, field)
        # The reader checks every typed field; refuse here what it would refuse there.
        value = _checked(kind, field, check, value, refuse)
        if isinstance(value, enum.Enum):
            value = value.value
        out[name] = value
    return out


def plain(
    value: Any, *, owner: str = "value", field: str = "value", run_id: str | None = None
) -> JSONValue:
    """A deep copy of ``value`` as plain JSON types (tuples become lists).

    Raises :class:`~polyloop.types.UnloggableValue` for anything strict JSON cannot carry
    back exactly, naming the path to it: ``owner`` and ``field`` say what the value is
    (``owner="Intent", field="payload"``), ``run_id`` which run it belongs to. This is the
    check :func:`encode` applies to payloads and snapshots, on its own.
    """
    return _walk_plain(value, owner, field, run_id)


def _plain(value: Any, record: Record, field: str) -> JSONValue:
    run_id = getattr(record, "run_id", None)
    return _walk_plain(value, type(record).__name__, field,
                       run_id if isinstance(run_id, str) else None)


class _NotSimple(Exception):
    """Raised by :func:`_copy_simple` for anything it does not copy itself."""


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


def dumps(record: Record) -> str:
    """One line of canonical JSON for ``record`` (no trailing newline).

    The line is valid UTF-8 text: a string holding a lone surrogate is written with
    ASCII escapes instead, so that what is written always reads back.
    """
    direct = _DIRECT_LINES.get(type(record))
    if direct is not None:
        try:
            line = direct(record)
        except (_NotSimple, KeyError, ValueError):
            pass  # a value the careful path must check, convert or refuse
        else:
            return _finished(line, record)
    data = encode(record)
    try:
        line = _CANONICAL.encode(data)
    except (ValueError, RecursionError) as exc:
        raise UnloggableValue(str(exc), run_id=getattr(record, "run_id", None)) from exc
    return _finished(line, record, data)


def _finished(line: str, record: Record, data: dict[str, JSONValue] | None = None) -> str:
    """``line`` made safe to write: valid UTF-8, and no character that splits lines."""
    if line.isascii():
        return line
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return _CANONICAL_ASCII.encode(encode(record) if data is None else data)
    for raw, escaped in _LINE_BREAKERS.items():
        if raw in line:
            line = line.replace(raw, escaped)
    return line


# -- direct lines for the records of every step -------------------------------------------
#
# A step writes three or four records, and building a dict for each only to have the
# JSON encoder sort and print it again costs more than the rest of the write. The three
# kinds a step writes are printed here straight from their fields, keys in sorted order,
# for values of exactly the types the schema names; anything else raises and takes the
# careful path above. The output is byte for byte what that path writes (a test compares
# the two on arbitrary records), and the run_started/run_ended records, written once per
# run, only ever take the careful path.

_quote = json.encoder.encode_basestring  # what the canonical encoder uses for strings


def _text(value: object) -> str:
    if type(value) is str:
        return _quote(value)
    raise _NotSimple


def _optional_text(value: object) -> str:
    if value is None:
        return "null"
    if type(value) is str:
        return _quote(value)
    raise _NotSimple


def _count(value: object) -> str:
    if type(value) is int:
        return int.__repr__(value)  # ValueError past the digit limit: careful path
    raise _NotSimple


def _flag(value: object) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    raise _NotSimple


def _optional_seconds(value: object) -> str:
    if value is None:
        return "null"
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)
    raise _NotSimple


def _json_text(item: Any, depth: int) -> str:
    """Canonical JSON of a payload made of exact JSON types, as the encoder prints it."""
    if depth > _MAX_DEPTH:
        raise _NotSimple
    kind = type(item)
    if kind is str:
        return _quote(item)
    if item is None:
        return "null"
    if kind is bool:
        return "true" if item else "false"
    if kind is int:
        if item.bit_length() > 14_000:
            raise _NotSimple
        return int.__repr__(item)
    if kind is float:
        if not math.isfinite(item):
            raise _NotSimple
        return float.__repr__(item)
    if kind is dict:
        for key in item:
            if type(key) is not str:
                raise _NotSimple
        inner = []
        for key in sorted(item):
            value = item[key]
            # Strings and nulls, most of a payload, without a call each.
            if type(value) is str:
                inner.append(f"{_quote(key)}:{_quote(value)}")
            elif value is None:
                inner.append(f"{_quote(key)}:null")
            else:
                inner.append(f"{_quote(key)}:{_json_text(value, depth + 1)}")
        return "{" + ",".join(inner) + "}"
    if kind is list or kind is tuple:
        return "[" + ",".join([_json_text(sub, depth + 1) for sub in item]) + "]"
    raise _NotSimple


def _quoted_members(enum_type: type[enum.Enum]) -> dict[Any, str]:
    # Keyed by member: a plain string of the same value misses (KeyError, careful path)
    # only if it is not a value at all, and then the careful path refuses it.
    return {member: _quote(member.value) for member in enum_type}


_INTENT_KINDS = _quoted_members(IntentKind)
_REPLAYS = _quoted_members(Replay)
_DECISIONS = _quoted_members(DecisionKind)
_ACTION_STATUSES: dict[Any, str] = {None: "null", **_quoted_members(ActionStatus)}


def _intent_line(r: Intent) -> str:
    return (
        f'{{"action_text":{_optional_text(r.action_text)},"call_index":{_count(r.call_index)},'
        f'"history_text":{_optional_text(r.history_text)},"intent_kind":{_INTENT_KINDS[r.kind]},'
        f'"kind":"intent","payload":{_json_text(r.payload, 0)},"replay":{_REPLAYS[r.replay]},'
        f'"result_id":{_text(r.result_id)},"run_id":{_text(r.run_id)},'
        f'"schema":"{SCHEMA}","step":{_count(r.step)}}}'
    )


def _result_line(r: Result) -> str:
    return (
        f'{{"intent_kind":{_INTENT_KINDS[r.kind]},"kind":"result",'
        f'"payload":{_json_text(r.payload, 0)},"result_id":{_text(r.result_id)},'
        f'"run_id":{_text(r.run_id)},"schema":"{SCHEMA}"}}'
    )


def _step_line(r: StepRecord) -> str:
    return (
        f'{{"action_status":{_ACTION_STATUSES[r.action_status]},'
        f'"action_text":{_optional_text(r.action_text)},"call_id":{_optional_text(r.call_id)},'
        f'"decision":{_DECISIONS[r.decision]},"done":{_flag(r.done)},'
        f'"duration_s":{_optional_seconds(r.duration_s)},"error":{_optional_text(r.error)},'
        f'"final_answer":{_optional_text(r.final_answer)},'
        f'"history_text":{_text(r.history_text)},"kind":"step",'
        f'"model_output":{_text(r.model_output)},"observation":{_optional_text(r.observation)},'
        f'"observation_synthesized":{_flag(r.observation_synthesized)},'
        f'"reasoning":{_optional_text(r.reasoning)},"run_id":{_text(r.run_id)},'
        f'"schema":"{SCHEMA}","step":{_count(r.step)},'
        f'"truncated_chars":{_count(r.truncated_chars)}}}'
    )


_DIRECT_LINES: dict[type[Any], Callable[[Any], str]] = {
    Intent: _intent_line,
    Result: _result_line,
    StepRecord: _step_line,
}


def loads(line: str | bytes, *, location: str | None = None) -> Record:
    """Read one line written by :func:`dumps` back into its record.

    ``location`` (a file and line, a row) is put into any error raised.
    """
    try:
        data = json.loads(
            line,
            object_pairs_hook=_unique_keys,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError) as exc:
        # JSONDecodeError, duplicate keys, NaN literals, over-long integers, bad UTF-8.
        raise CorruptLog(f"not a JSON record: {exc}", location=location) from exc
    return decode(data, location=location)


def decode(data: Mapping[str, Any], *, location: str | None = None) -> Record:
    """Turn an encoded dict back into its record, checking the schema major and fields."""
    if not isinstance(data, Mapping):
        raise CorruptLog(f"a record must be a JSON object, not {type(data).__name__}",
                         location=location)
    run_id = data.get("run_id") if isinstance(data.get("run_id"), str) else None

    def corrupt(reason: str) -> CorruptLog:
        return CorruptLog(reason, run_id=run_id, location=location)

    _check_schema(data.get("schema"), corrupt, run_id, location)
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise corrupt(f"unknown record kind {kind!r}")
    values: dict[str, Any] = {}
    for field, check in _FIELDS[kind]:
        name = _json_name(kind, field)
        if name not in data:
            if (kind, field) in _DEFAULTED:
                continue
            raise corrupt(f"{kind} record has no field {name!r}")
        values[field] = _checked(kind, field, check, data[name], corrupt)
    record: Record = _RECORD_CLASS[kind](**values)
    return record


def _check_schema(
    schema: Any, corrupt: Callable[[str], CorruptLog], run_id: str | None, location: str | None
) -> None:
    if not isinstance(schema, str) or not schema.startswith("polyloop/"):
        raise corrupt(f"no polyloop schema field (found {schema!r:.80})")
    match = _SCHEMA_PATTERN.fullmatch(schema)
    if match is None:
        raise corrupt(f"unreadable schema {schema!r:.80}")
    if int(match.group(1)) != _MAJOR:
        raise SchemaMajorMismatch(
            f"record format {schema!r} is not readable by this library (reads {SCHEMA!r})",
            run_id=run_id,
            location=location,
        )


def _checked(
    kind: str, field: str, check: _Check, value: Any,
    corrupt: Callable[[str], CorruptLog | UnloggableValue],
) -> Any:
    def wrong(expected: str) -> CorruptLog | UnloggableValue:
        return corrupt(f"{kind}.{field} must be {expected}, not {value!r:.80}")

    if isinstance(check, type):
        if type(value) is check:  # already the member: what check(value) would return
            return value
        if value is None and (kind, field) in _OPTIONAL_ENUMS:
            return None
        try:
            return check(value)
        except ValueError:
            raise wrong(f"one of {[m.value for m in check]}") from None
    if check == "json":
        return value
    if check == "object":
        if not isinstance(value, dict):
            raise wrong("an object")
        return value
    optional = check.endswith("?")
    if optional and value is None:
        return None
    base = check.rstrip("?")
    if not _IS_BASE[base](value):
        raise wrong(f"{'null or ' if optional else ''}a {base}")
    if base == "float":
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float: not a readable duration
            raise wrong("a number a float can hold") from None
    return value


# The scalar checks of _checked, one per base name (bool is an int, but not a number here).
_IS_BASE: dict[str, Callable[[Any], bool]] = {
    "str": lambda value: isinstance(value, str),
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "bool": lambda value: isinstance(value, bool),
    "float": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
}


def _too_many_digits(number: int) -> bool:
    try:
        return len(str(abs(number))) > _MAX_INT_DIGITS
    except ValueError:  # str() itself refuses past the interpreter's limit
        return True


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        keys = [key for key, _ in pairs]
        dupes = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"duplicate keys {dupes}")
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value
