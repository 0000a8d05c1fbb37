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

A step record that follows the result of its own action in a log may be written without
the observation that result already holds (``after=``, format ``polyloop/1.1``): it then
reads back only after that result, given as ``after=`` to :func:`loads` or :func:`decode`
(docs/record-format.md).

An amendment record (:class:`~polyloop.types.Amended`, a kind added later) says
``"schema": "polyloop/1.2"``.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from polyloop._shared import FORMAT, encodable_json, plain_copy, record_kind
from polyloop._strict_json import finite_float, refuse_constant, unique_keys, whole_number
from polyloop.serialization._schema import (
    FIELDS,
    RECORD_CLASS,
    Field,
    Mismatch,
    check_schema,
    checked,
)
from polyloop.types import (
    CorruptLog,
    IntentKind,
    JSONValue,
    Record,
    Result,
    StepRecord,
    ToolCallBlock,
    UnloggableValue,
)

__all__ = ("decode", "dumps", "encode", "loads", "plain")

# Line and paragraph separators are legal raw in JSON strings but split lines for
# readers that use str.splitlines(); escaping them keeps every record on one line for all.
_LINE_BREAKERS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}

# A step whose observation is its action result's names the result under this key, in
# place of the text, and says so with the format's first minor (record 0063).
_OBSERVATION_OF = "observation_of"
_REFERRING_FORMAT = f"{FORMAT}.1"
# The amendment record is a kind the first releases of the major do not know: it says so
# with the format's second minor (record 0074), so an older reader's refusal names why.
_AMENDING_FORMAT = f"{FORMAT}.2"
_AMENDED = "amended"


def encode(record: Record, *, after: Record | None = None) -> dict[str, JSONValue]:
    """Encode ``record`` as a JSON-ready dict carrying the schema and the record kind.

    ``after`` is the record the log holds just before this one, if the writer knows it.
    A step record right after its action's result, whose observation is exactly the
    result's, is encoded without it: ``observation_of`` names the result instead, and
    :func:`decode` needs the same ``after`` to read it back. Without ``after`` every
    record is encoded whole.

    Raises :class:`~polyloop.types.UnloggableValue` for a payload or snapshot that
    strict JSON cannot carry back exactly.
    """
    kind = record_kind(record)
    out: dict[str, JSONValue] = {"schema": FORMAT, "kind": kind}
    values, plan = _PLANS[kind]
    for (key, as_is, optional, omitted, emit, field), value in zip(
        plan, values(record), strict=True
    ):
        if type(value) is as_is:  # most fields: text, a count, a flag, written as they are
            out[key] = value
        elif value is None and optional:
            if not omitted:
                out[key] = None
        elif emit is None:
            out[key] = _walked(record, kind, field, value)
        else:
            try:
                out[key] = emit(value)
            except Mismatch:
                # The reader checks every field; refuse here what it would refuse there.
                out[key] = field.write(checked(kind, field, value, _refusal(record)))
    if after is not None and isinstance(record, StepRecord):
        _refer_to(after, record, out)
    elif kind == _AMENDED:
        out["schema"] = _AMENDING_FORMAT
    return out


# Per kind: every field's value in one call, and per field what ``encode`` needs of it,
# unpacked from a tuple rather than read off the field (the codec runs for every record).
_Plan: TypeAlias = tuple[
    Callable[[Record], tuple[Any, ...]],
    tuple[tuple[str, type[Any], bool, bool, Callable[[Any], Any] | None, Field], ...],
]
_PLANS: dict[str, _Plan] = {
    kind: (
        operator.attrgetter(*(field.name for field in fields)),
        tuple((f.key, f.as_is, f.optional, f.written_when_set, f.emit, f) for f in fields),
    )
    for kind, fields in FIELDS.items()
}


def _refer_to(after: Record, step: StepRecord, out: dict[str, JSONValue]) -> None:
    """Replace the step's observation with the name of the result just before it, if
    that result is of the same run, of an action, and holds exactly that observation."""
    if not isinstance(after, Result) or after.kind != IntentKind.ACTION:
        return
    payload = after.payload
    if after.run_id != step.run_id or not isinstance(payload, Mapping):
        return
    held = payload.get("observation")
    if isinstance(held, str) and held == out["observation"] and isinstance(after.result_id, str):
        del out["observation"]
        out[_OBSERVATION_OF] = after.result_id
        out["schema"] = _REFERRING_FORMAT


def _walked(record: Record, kind: str, field: Field, value: Any) -> JSONValue:
    """A payload, snapshot or tool call: values the library did not make, walked."""
    owner, run_id = type(record).__name__, _run_id(record)
    if isinstance(value, ToolCallBlock):
        # The arguments are the model's, not the library's: walked like a payload.
        arguments = plain(value.arguments, owner=owner, field=field.name, run_id=run_id)
        value = ToolCallBlock(call_id=value.call_id, name=value.name, arguments=arguments)
    elif field.check != "tool_call":
        value = plain(value, owner=owner, field=field.name, run_id=run_id)
    value = checked(kind, field, value, _refusal(record))
    return None if value is None else field.write(value)


def _run_id(record: Record) -> str | None:
    return record.run_id if isinstance(record.run_id, str) else None


def _refusal(record: Record) -> Callable[[str], UnloggableValue]:
    def refuse(reason: str) -> UnloggableValue:
        return UnloggableValue(reason, run_id=_run_id(record))

    return refuse


def plain(
    value: Any, *, owner: str = "value", field: str = "value", run_id: str | None = None
) -> JSONValue:
    """A deep copy of ``value`` as plain JSON types (tuples become lists).

    Raises :class:`~polyloop.types.UnloggableValue` for anything strict JSON cannot carry
    back exactly, naming the path to it: ``owner`` and ``field`` say what the value is
    (``owner="Intent", field="payload"``), ``run_id`` which run it belongs to. This is the
    check :func:`encode` applies to payloads and snapshots, on its own.
    """
    try:
        copied: JSONValue = plain_copy(value, root=field)
    except UnloggableValue as exc:
        raise UnloggableValue(f"{owner}: {exc.reason}", run_id=run_id) from None
    return copied


def dumps(record: Record, *, after: Record | None = None) -> str:
    """One line of canonical JSON for ``record`` (no trailing newline); ``after`` as for
    :func:`encode`.

    The line is valid UTF-8 text: a string holding a lone surrogate is written with
    ASCII escapes instead, so that what is written always reads back.
    """
    data = encode(record, after=after)
    try:
        line = encodable_json(data)
    except ValueError as exc:  # a float field (not walked like payloads) out of range
        raise UnloggableValue(str(exc), run_id=record.run_id) from exc
    if line.isascii():
        return line
    for raw, escaped in _LINE_BREAKERS.items():
        line = line.replace(raw, escaped)
    return line


def loads(line: str | bytes, *, location: str | None = None, after: Record | None = None) -> Record:
    """Read one line written by :func:`dumps` back into its record.

    ``location`` (a file and line, a row) is put into any error raised; ``after`` is the
    record read just before it in the same log, as for :func:`decode`.
    """
    try:
        data = json.loads(
            line,
            object_pairs_hook=unique_keys,
            parse_constant=refuse_constant,
            parse_float=finite_float,
            parse_int=whole_number,
        )
    except (ValueError, RecursionError) as exc:
        # JSONDecodeError, duplicate keys, NaN literals, over-long integers, bad UTF-8.
        raise CorruptLog(f"not a JSON record: {exc}", location=location) from exc
    return decode(data, location=location, after=after)


def decode(
    data: Mapping[str, Any], *, location: str | None = None, after: Record | None = None
) -> Record:
    """Turn an encoded dict back into its record, checking the schema major and fields.

    ``after`` is the record decoded just before this one from the same log. A step
    record that names its observation's result (``observation_of``) takes the
    observation from it, and is ``CorruptLog`` unless ``after`` is that very result.
    """
    if not isinstance(data, Mapping):
        raise CorruptLog(
            f"a record must be a JSON object, not {type(data).__name__}", location=location
        )
    run_id = data.get("run_id") if isinstance(data.get("run_id"), str) else None

    def corrupt(reason: str) -> CorruptLog:
        return CorruptLog(reason, run_id=run_id, location=location)

    check_schema(data.get("schema"), corrupt, run_id, location)
    kind = data.get("kind")
    if not isinstance(kind, str) or kind not in FIELDS:
        raise corrupt(f"unknown record kind {kind!r}")
    if kind == "step" and _OBSERVATION_OF in data:
        data = {**data, "observation": _referred_observation(data, after, corrupt)}
    values: dict[str, Any] = {}
    for field in FIELDS[kind]:
        if field.key not in data:
            if field.defaulted:
                continue
            raise corrupt(f"{kind} record has no field {field.key!r}")
        values[field.name] = checked(kind, field, data[field.key], corrupt)
    record: Record = RECORD_CLASS[kind](**values)
    return record


def _referred_observation(
    data: Mapping[str, Any], after: Record | None, corrupt: Callable[[str], CorruptLog]
) -> str:
    """The observation a step names by its result: that result must be ``after``."""
    name = data[_OBSERVATION_OF]
    if "observation" in data:
        raise corrupt(f"step record has both 'observation' and {_OBSERVATION_OF!r}")
    if not isinstance(name, str):
        raise corrupt(f"step.{_OBSERVATION_OF} must be a str, not {name!r:.80}")
    if after is None:
        why = "it was read after no record (a reader gives the record before it as after=)"
    elif (
        not isinstance(after, Result)
        or after.result_id != name
        or after.run_id != data.get("run_id")
    ):
        why = "the record before it is not that result"
    elif after.kind != IntentKind.ACTION or not isinstance(after.payload, Mapping):
        why = "that result is not an action's"
    elif not isinstance(observation := after.payload.get("observation"), str):
        why = "that result holds no observation"
    else:
        return observation
    raise corrupt(f"the step's observation is that of result {name!r:.80}, but {why}")
