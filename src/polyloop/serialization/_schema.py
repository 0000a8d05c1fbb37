"""The record format: its schema name and major, each kind's fields, and their checks.

For every field: the check its value passes on the way out and on the way back in, the
name it has in the JSON object, and whether an older record may lack it. Writing and
reading share these tables, so that the writer refuses exactly what the reader would
refuse, and a field is named, checked and defaulted in one place.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Any

from polyloop.types import (
    ActionStatus,
    CorruptLog,
    DecisionKind,
    Intent,
    IntentKind,
    Replay,
    Result,
    RunEnded,
    RunStarted,
    SchemaMajorMismatch,
    StepRecord,
    StopReason,
    UnloggableValue,
)

SCHEMA = "polyloop/1"
_MAJOR = 1
_SCHEMA_PATTERN = re.compile(r"polyloop/(0|[1-9][0-9]*)(?:\.[0-9]+)?", re.ASCII)

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
