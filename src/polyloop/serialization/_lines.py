"""Direct lines: the records of every step printed straight from their fields.

A step writes three or four records, and building a dict for each only to have the JSON
encoder sort and print it again costs more than the rest of the write. Intents, results
and step records are therefore printed here, keys in sorted order, for values of exactly
the types the schema names; any other value raises (:class:`_NotSimple`, ``KeyError`` for
an enum field that holds no member, ``ValueError`` for an integer past the digit limit)
and the record takes the careful path of :func:`polyloop.serialization.dumps` instead.

What is printed here must be byte for byte what the careful path writes: a test compares
the two on arbitrary records, and another checks every field of each kind is named. The
start and end records, written once per run, only ever take the careful path.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable
from typing import Any

from polyloop.serialization._plain import _MAX_DEPTH, _NotSimple
from polyloop.serialization._schema import SCHEMA
from polyloop.types import (
    ActionStatus,
    DecisionKind,
    Intent,
    IntentKind,
    Replay,
    Result,
    StepRecord,
)

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
