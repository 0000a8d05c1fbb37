"""Small pieces that several layers need, each written once.

The record format's name and the kind string of each record; the limits of a value a
record may carry; canonical JSON; the plain-value check and copy; how an exception
reads in a record; the error for a missing optional package; the trace id of a run.
This module sits below :mod:`polyloop.types` and imports only the standard library and
:mod:`polyloop._errors`, so the kernel and the stores can share it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from polyloop._errors import UnloggableValue

# How a settlement's ``by`` begins when a tool's probe wrote it rather than a person.
RECONCILE_PREFIX = "reconcile:"

__all__ = (
    "FORMAT",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "RECONCILE_PREFIX",
    "RECORD_KINDS",
    "call_text",
    "canonical_json",
    "exception_text",
    "install_hint",
    "needs_extra",
    "plain_copy",
    "record_kind",
)

FORMAT = "polyloop/1"
"""The record format, name and major: the ``schema`` of every record, and store metadata."""

RECORD_KINDS: Mapping[str, str] = MappingProxyType(
    {
        "RunStarted": "run_started",
        "Intent": "intent",
        "Result": "result",
        "StepRecord": "step",
        "RunEnded": "run_ended",
        "Proposal": "proposal",
        "Verdict": "verdict",
        "Settlement": "settlement",
        "Amended": "amended",
    }
)
"""The ``kind`` of each record class of :mod:`polyloop.types`, by class name.

Keyed by name because this module sits below the module that defines the classes.
"""

MAX_INT_DIGITS = 4_300
"""The longest integer a record may hold: what Python's JSON reader accepts by default."""

MAX_DEPTH = 256
"""How deeply a payload or snapshot may nest.

Deep enough for any real payload, and shallow enough that the reader (bound by the
interpreter's recursion limit) always reads back what was written.
"""

_TOO_LONG = 10**MAX_INT_DIGITS  # the smallest integer with MAX_INT_DIGITS + 1 digits
_LONG_ENOUGH = 2**62  # a machine-size bound: cheaper to compare than _TOO_LONG
_TYPES_MODULE = "polyloop.types"


def record_kind(record: object) -> str:
    """The ``kind`` of a record; :class:`~polyloop.types.UnloggableValue` for anything else.

    Only the record classes themselves count, not subclasses: a subclass could carry
    fields that no reader of the format knows about.
    """
    cls = type(record)
    kind = RECORD_KINDS.get(cls.__qualname__) if cls.__module__ == _TYPES_MODULE else None
    if kind is None:
        raise UnloggableValue(f"not a record: {cls.__name__}")
    return kind


def install_hint(extra: str) -> str:
    """How to add an extra: PolyLoop is installed from its checkout, not from an index."""
    return f"in the PolyLoop checkout, run pip install -e '.[{extra}]'"


@contextlib.contextmanager
def needs_extra(feature: str, extra: str) -> Iterator[None]:
    """Around the imports of an optional package: a missing one says which extra to install.

    Still a ``ModuleNotFoundError`` (chained from the original, same ``name``), so code
    that catches ``ImportError`` keeps working.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        message = f"{feature} needs the {extra} extra: {install_hint(extra)}"
        raise ModuleNotFoundError(message, name=exc.name, path=exc.path) from exc


def run_trace_ids(run_id: str) -> tuple[int, int]:
    """The OpenTelemetry trace id and parent span id of every attempt of ``run_id``.

    SHA-256 of ``polyloop run``, a NUL byte and the run id (UTF-8): the first 16 bytes
    are the trace id, the next 8 the span id, each read big-endian; an id of 0 (invalid
    in OpenTelemetry) becomes 1. Derived from the run id alone, so every process finds
    the same run's trace; the prefix keeps it apart from other hashes of the same id.
    A lone surrogate, which UTF-8 cannot encode, is hashed as the three bytes
    ``surrogatepass`` gives it: bytes no other string encodes to, so such an id still
    has a trace of its own, and every other id keeps the trace it always had.
    """
    text = f"polyloop run\x00{run_id}"
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


# Built once: json.dumps with options builds a new encoder on every call, and
# JSONEncoder.encode builds its C encoder anew on every call too. What is encoded is a
# plain copy or a value built by the library, never one that holds itself, so the
# encoder need not look for cycles.
def _canonical_encoder(*, ascii: bool) -> Callable[[Any], str]:
    encoder = json.JSONEncoder(
        ensure_ascii=ascii,
        allow_nan=False,
        sort_keys=True,
        separators=(",", ":"),
        check_circular=False,
    )
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # a Python without json's C accelerator: the same, built per call
        return encoder.encode
    # What JSONEncoder.encode runs for these settings (no indent), built once.
    escape = json.encoder.encode_basestring_ascii if ascii else json.encoder.encode_basestring
    iterencode = make(
        None,  # no cycle markers: check_circular is off
        encoder.default,
        escape,
        None,  # no indent
        encoder.key_separator,
        encoder.item_separator,
        encoder.sort_keys,
        encoder.skipkeys,
        encoder.allow_nan,
    )
    return lambda value: "".join(iterencode(value, 0))


_CANONICAL = _canonical_encoder(ascii=False)
_CANONICAL_ASCII = _canonical_encoder(ascii=True)


def canonical_json(value: Any, *, ascii: bool = False) -> str:
    """``value`` as canonical JSON: sorted keys, no spaces, no ``NaN`` or infinities.

    Raises ``ValueError`` for a non-finite number, ``TypeError`` for a value JSON has no
    type for, and ``RecursionError`` for one that contains itself. With ``ascii``,
    every character beyond ASCII is escaped.
    """
    return (_CANONICAL_ASCII if ascii else _CANONICAL)(value)


def encodable_json(value: Any) -> str:
    """:func:`canonical_json` of ``value``, in its all-ASCII form when it holds a lone
    surrogate: text that UTF-8 always encodes and that reads back to the same value.

    This is the text the codec writes a record as (before it escapes line breakers), so
    anything hashed or stored through it holds the same bytes the log does.
    """
    text = canonical_json(value)
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return canonical_json(value, ascii=True)
    return text


# What json.dumps(arguments, ensure_ascii=False, sort_keys=True) builds on every call.
_CALL_ARGUMENTS = json.JSONEncoder(ensure_ascii=False, sort_keys=True)


def call_text(name: str, arguments: Any) -> str:
    """A tool call as an action's text reads it: ``name({"key": "value"})``.

    Written once, so a call a person edited reads exactly as the model's own would.
    """
    return f"{name}({_CALL_ARGUMENTS.encode(arguments)})"


def exception_text(exc: BaseException) -> str:
    """``"ExceptionClass: message"``: how a record names a failure. Never raises."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure itself
        message = "<the exception's message could not be rendered>"
    return f"{type(exc).__name__}: {message}"


class _Refused(Exception):
    """A value :func:`plain_copy` refuses; the path to it is gathered as the walk unwinds."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.steps: list[str] = []


class _TooDeep(Exception):
    """The value nests deeper than :data:`MAX_DEPTH`."""


def plain_copy(value: Any, *, root: str = "value", strict: bool = False) -> Any:
    """A deep copy of ``value`` made of the JSON types it would read back as.

    Raises :class:`~polyloop.types.UnloggableValue` for anything strict JSON cannot
    carry back exactly (``NaN``, infinities, integers of more than
    :data:`MAX_INT_DIGITS` digits, keys that are not strings, values that are not JSON,
    nesting deeper than :data:`MAX_DEPTH`), naming the path to it from ``root``.

    By default any mapping counts as an object and a tuple as an array, and both are
    copied as the dict and list they read back as. With ``strict``, only dicts and
    lists do: what ``json.loads`` itself would return.
    """
    objects, arrays = (dict, list) if strict else (Mapping, (list, tuple))
    try:
        return _copy(value, 0, objects, arrays)
    except _TooDeep:
        raise UnloggableValue(f"{root} is nested more than {MAX_DEPTH} levels deep") from None
    except _Refused as refused:
        path = root + "".join(reversed(refused.steps))
        raise UnloggableValue(f"{refused.problem} at {path}") from None


def _copy(item: Any, depth: int, objects: Any, arrays: Any) -> Any:
    if depth > MAX_DEPTH:
        raise _TooDeep
    # Most of a payload is text, flags and small numbers of the exact built-in types:
    # those are answered by one type lookup, before the general checks below.
    kind = type(item)
    if kind is str or kind is bool or item is None:
        return item
    if kind is int and -_LONG_ENOUGH < item < _LONG_ENOUGH:
        return item
    if isinstance(item, (str, bool)):
        return item
    # A dict or a list is an object or an array however strict the walk is.
    if kind is dict or isinstance(item, objects):
        return _copy_object(item, depth, objects, arrays)
    if kind is list or isinstance(item, arrays):
        return _copy_array(item, depth, objects, arrays)
    if isinstance(item, int):
        if abs(item) >= _TOO_LONG:
            raise _Refused(f"integer of more than {MAX_INT_DIGITS} digits")
        return int(item)
    if isinstance(item, float):
        if not math.isfinite(item):
            raise _Refused(f"{item!r} is not a JSON number")
        return float(item)
    raise _Refused(f"{type(item).__name__} is not a JSON value")


def _copy_object(item: Any, depth: int, objects: Any, arrays: Any) -> dict[str, Any]:
    copied: dict[str, Any] = {}
    inner = depth + 1
    # A leaf is kept as it is here, as _copy would keep it, unless it is too deep.
    leaves = inner <= MAX_DEPTH
    for key, sub in item.items():
        if not isinstance(key, str):
            raise _Refused(f"key {key!r} is not a string")
        if key in copied:  # a mapping whose items() repeats a key
            raise _Refused(f"key {key!r} appears twice")
        kind = type(sub)
        if leaves and (kind is str or kind is bool or sub is None):
            copied[key] = sub
            continue
        try:
            copied[key] = _copy(sub, inner, objects, arrays)
        except _Refused as refused:
            refused.steps.append(f".{key}")
            raise
    return copied


def _copy_array(item: Any, depth: int, objects: Any, arrays: Any) -> list[Any]:
    items = []
    inner = depth + 1
    for index, sub in enumerate(item):
        try:
            items.append(_copy(sub, inner, objects, arrays))
        except _Refused as refused:
            refused.steps.append(f"[{index}]")
            raise
    return items
