"""Tests for polyloop._strict_json: the one strict reading of JSON numbers and keys.

The log reader, the interpreters and the command line all read through it; these tests
pin what each refusal carries, and that each of those readers refuses alike.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import json

import pytest

from polyloop._strict_json import (
    STRICT_JSON,
    STRICT_NUMBERS,
    FloatOverflow,
    IntegerTooLong,
    NotJsonNumber,
    RepeatedKey,
)
from polyloop.cli._common import edited_arguments
from polyloop.serialization import loads
from polyloop.types import CorruptLog

LONG = "7" * 5_000


@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity"])
def test_the_words_json_has_no_number_for_are_refused(word: str) -> None:
    with pytest.raises(NotJsonNumber) as refused:
        STRICT_NUMBERS.decode(f'{{"n": {word}}}')
    assert refused.value.word == word
    assert str(refused.value) == f"{word} is not a JSON number"


@pytest.mark.parametrize("text", ["1e400", "-1e400", "1" * 400 + ".0"])
def test_a_number_beyond_a_float_is_refused_with_its_text(text: str) -> None:
    with pytest.raises(FloatOverflow) as refused:
        STRICT_NUMBERS.decode(f"[{text}]")
    assert refused.value.text == text


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_too_long_to_read_is_refused_with_its_length(sign: str) -> None:
    with pytest.raises(IntegerTooLong) as refused:
        STRICT_NUMBERS.decode(sign + LONG)
    assert refused.value.digits == 5_000


def test_numbers_json_can_carry_read_as_usual() -> None:
    text = '{"a": 1.5e300, "b": -12, "c": [0, 0.0, 1e-400]}'
    assert STRICT_JSON.decode(text) == json.loads(text)


def test_a_repeated_key_is_refused_by_the_strict_reader_only() -> None:
    text = '{"b": 1, "a": 2, "a": 3, "b": 4, "c": {"d": 5}}'
    with pytest.raises(RepeatedKey) as refused:
        STRICT_JSON.decode(text)
    assert refused.value.keys == ("b", "a")  # in the order each first appears
    assert str(refused.value) == "duplicate keys ['a', 'b']"
    assert STRICT_NUMBERS.decode(text) == {"b": 4, "a": 3, "c": {"d": 5}}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("NaN", "NaN is not a JSON number"),
        ("1e400", "1e400 overflows a float"),
        (LONG, "an integer of 5000 digits"),
    ],
)
def test_the_log_reader_refuses_the_same_numbers(value: str, problem: str) -> None:
    with pytest.raises(CorruptLog, match=f"not a JSON record: {problem}"):
        loads(f'{{"schema": "polyloop/1", "kind": "intent", "n": {value}}}')


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("NaN", "the arguments hold NaN, which"),
        ("1e400", "the arguments hold the number 1e400, which"),
        (LONG, "the arguments hold a whole number of 5000 digits, which"),
        ("[" * 100_000 + "]" * 100_000, "the arguments hold JSON nested too deeply, which"),
    ],
)
def test_arguments_a_person_edits_are_refused_saying_what_they_hold(value: str, shown: str) -> None:
    with pytest.raises(ValueError, match="which the log cannot carry") as refused:
        edited_arguments(f'{{"n": {value}}}')
    assert shown in str(refused.value)
