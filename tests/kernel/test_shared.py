"""Tests for polyloop._shared: the pieces the kernel and the stores share.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from types import MappingProxyType
from typing import Any

import pytest

from polyloop import _shared
from polyloop._shared import (
    FORMAT,
    MAX_DEPTH,
    MAX_INT_DIGITS,
    RECORD_KINDS,
    canonical_json,
    exception_text,
    plain_copy,
    record_kind,
)
from polyloop.serialization import encode
from polyloop.types import Record, Result, RunEnded, StopReason, UnloggableValue, run_trace_id


def test_every_record_class_has_one_kind() -> None:
    classes = typing.get_args(Record)
    assert set(RECORD_KINDS) == {cls.__name__ for cls in classes}
    assert len(set(RECORD_KINDS.values())) == len(RECORD_KINDS)


def test_record_kind_names_records_only() -> None:
    ended = RunEnded(
        run_id="r",
        stop_reason=StopReason.FINAL_ANSWER,
        final_answer="x",
        steps=1,
        valid_steps=0,
        detail=None,
    )
    assert record_kind(ended) == "run_ended"
    assert encode(ended)["kind"] == "run_ended"
    assert encode(ended)["schema"] == FORMAT == "polyloop/1"

    @dataclasses.dataclass(frozen=True)
    class RunEnded2(RunEnded):  # a subclass could carry fields no reader knows
        pass

    class Impostor:
        __qualname__ = "RunEnded"

    for other in (RunEnded2(**dataclasses.asdict(ended)), {"kind": "run_ended"}, Impostor()):
        with pytest.raises(UnloggableValue, match="not a record"):
            record_kind(other)


def test_canonical_json() -> None:
    value = {"b": [1, 2.5, None], "a": "ü\u2028", "c": {"z": True, "y": False}}
    assert canonical_json(value) == '{"a":"ü\u2028","b":[1,2.5,null],"c":{"y":false,"z":true}}'
    assert canonical_json(value, ascii=True).isascii()
    with pytest.raises(ValueError, match="not JSON compliant"):
        canonical_json({"x": math.nan})


def test_canonical_json_reads_the_same_without_json_s_c_encoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The encoder is built once from json's C encoder; a Python without it encodes
    # through JSONEncoder itself, to the same text and the same errors.
    values: list[Any] = [{"b": [1, 2.5, None], "a": "ü\u2028\ud800"}, 'x"', 10**30, []]
    monkeypatch.setattr(json.encoder, "c_make_encoder", None)
    for ascii in (False, True):
        without = _shared._canonical_encoder(ascii=ascii)
        for value in values:
            assert without(value) == canonical_json(value, ascii=ascii)
        for bad, error in ((math.inf, ValueError), ({"x": {1j}}, TypeError)):
            with pytest.raises(error):
                without(bad)
            with pytest.raises(error):
                canonical_json(bad, ascii=ascii)


def test_exception_text() -> None:
    assert exception_text(KeyError("k")) == "KeyError: 'k'"

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert exception_text(Unprintable()).startswith("Unprintable: <")


def test_plain_copy_is_a_deep_copy_of_plain_types() -> None:
    original: dict[str, Any] = {"a": [1, {"b": "c"}], "d": (1.5, True)}
    copied = plain_copy(original)
    assert copied == {"a": [1, {"b": "c"}], "d": [1.5, True]}
    copied["a"][1]["b"] = "changed"
    assert original["a"][1]["b"] == "c"
    assert plain_copy(MappingProxyType({"k": 1})) == {"k": 1}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"x": [0, math.nan]}, "nan is not a JSON number at value.x[1]"),
        ({"x": {1: "y"}}, "key 1 is not a string at value.x"),
        ({"x": [10**MAX_INT_DIGITS]}, f"more than {MAX_INT_DIGITS} digits at value.x[0]"),
        ({"x": {"y": {1, 2}}}, "set is not a JSON value at value.x.y"),
    ],
)
def test_plain_copy_names_the_path_to_what_it_refuses(value: Any, problem: str) -> None:
    with pytest.raises(UnloggableValue) as refused:
        plain_copy(value)
    assert problem in str(refused.value)


def test_the_digit_limit_is_exact() -> None:
    longest = 10**MAX_INT_DIGITS - 1
    assert plain_copy([longest, -longest]) == [longest, -longest]
    with pytest.raises(UnloggableValue):
        plain_copy(-(10**MAX_INT_DIGITS))


@pytest.mark.parametrize("shift", [-1, 0, 1])
def test_integers_around_the_machine_size_copy_exactly(shift: int) -> None:
    # Small integers take a shorter way through the copy than long ones: both must agree.
    for value in (2**62 + shift, -(2**62) + shift, 2**63 + shift, -(2**64) + shift):
        copied = plain_copy({"n": [value]})
        assert copied == {"n": [value]} and type(copied["n"][0]) is int


def test_an_int_subclass_is_copied_as_a_plain_int() -> None:
    class Count(int):
        pass

    copied = plain_copy([Count(3), True])
    assert copied == [3, True] and [type(item) for item in copied] == [int, bool]


def test_the_depth_limit() -> None:
    nested: Any = "leaf"
    for _ in range(MAX_DEPTH):
        nested = [nested]
    assert plain_copy(nested) == nested
    with pytest.raises(UnloggableValue, match=f"payload is nested more than {MAX_DEPTH}"):
        plain_copy([nested], root="payload")


def test_the_depth_limit_holds_for_a_leaf_of_an_object_too() -> None:
    # A text, flag or null inside an object is copied without a call of its own: it
    # must still count as one level deeper than the object.
    for leaf in ("leaf", True, None):
        nested: Any = leaf
        for _ in range(MAX_DEPTH):
            nested = {"k": nested}
        assert plain_copy(nested) == nested
        with pytest.raises(UnloggableValue, match=f"nested more than {MAX_DEPTH}"):
            plain_copy({"k": nested})


def test_strict_takes_only_what_json_loads_returns() -> None:
    assert plain_copy({"a": [1]}, strict=True) == {"a": [1]}
    for value in ({"a": (1,)}, MappingProxyType({"a": 1}), {"a": MappingProxyType({})}):
        with pytest.raises(UnloggableValue, match="is not a JSON value"):
            plain_copy(value, strict=True)


def test_the_result_payload_refusal_names_its_run() -> None:
    with pytest.raises(UnloggableValue) as refused:
        encode(
            Result(
                run_id="r-1",
                result_id="r-1:0:action",
                kind="action",  # type: ignore[arg-type]
                payload={"v": math.inf},
            )
        )
    assert refused.value.run_id == "r-1"
    assert "Result: inf is not a JSON number at payload.v" in str(refused.value)


# Trace ids already exported and stored by tracing back ends: they must never change.
KNOWN_TRACE_IDS = {
    "r": "1f26af82544b159f9afeb419bb836f30",
    "exp-7/task-12#3": "45a453c486b59e85390bbb635286e8ff",
    "café ☕": "3dafec1e161a8125eaeb11025be762f7",
}


@pytest.mark.parametrize(("run_id", "trace_id"), sorted(KNOWN_TRACE_IDS.items()))
def test_the_trace_id_of_a_run_id_never_changes(run_id: str, trace_id: str) -> None:
    assert run_trace_id(run_id) == trace_id


def test_a_run_id_holding_a_lone_surrogate_has_a_trace_id_of_its_own() -> None:
    # Half an emoji from a model's reply can end up in a run id: the id is hashed with
    # the surrogate kept as its own three bytes, so no other run id shares its trace.
    run_id = "id \ud83d"
    digest = hashlib.sha256(f"polyloop run\x00{run_id}".encode("utf-8", "surrogatepass"))
    assert run_trace_id(run_id) == digest.hexdigest()[:32]
    assert run_trace_id(run_id) == run_trace_id("id \ud83d")
    others = {run_trace_id(other) for other in ("id \\ud83d", "id \ufffd", "id ", "id \ud83e")}
    assert run_trace_id(run_id) not in others and len(others) == 4
