"""Fuzzing the record codec (time-bounded byte fuzzers and a property).

``serialization.loads`` is fed arbitrary bytes, token soup and mutated canonical lines.
Whatever it gets, it returns a record or raises ``CorruptLog`` / ``SchemaMajorMismatch``,
nothing else; a record it accepts is written back by ``dumps`` to a line that reads back
equal; and no text, whatever characters it holds, splits a written line for any reader.
The wall-clock budget is shared through ``kit.fuzz_budget`` (``POLYLOOP_FUZZ_SECONDS``; 15 s
with ``CI=true``, 3 s otherwise) with the fuzzers of ``tests/stores/test_fuzz_stores.py``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kit import fuzz_budget
from kit.fuzz import (
    AWKWARD,
    SEED_RECORDS,
    action_intent,
    action_result,
    field_edits,
    fuzz_settings,
    model_result,
    mutated_lines,
    numeric_edits,
    parse_lines,
    read_file_bytes,
    read_line,
    rewrites_exactly,
    run_ended,
    step_record,
    token_soup,
)
from polyloop.serialization import dumps, encode, loads
from polyloop.types import (
    CorruptLog,
    Record,
    RunStarted,
    StepRecord,
    StopReason,
    UnloggableValue,
)

# -- numbers too large for a float field ----------------------------------------------


def test_a_duration_too_large_for_a_float_is_corrupt() -> None:
    line = dumps(step_record("r", 0, "x", with_action=True)).replace(
        '"duration_s":0.5', '"duration_s":1' + "0" * 400
    )
    assert '"duration_s":1000' in line
    with pytest.raises(CorruptLog):
        loads(line)


def test_a_duration_too_large_for_a_float_is_unloggable() -> None:
    step = dataclasses.replace(step_record("r", 0, "x", with_action=True), duration_s=10**400)
    with pytest.raises(UnloggableValue):
        dumps(step)


# -- byte fuzzers (time-bounded) --------------------------------------------------------------


def test_loads_of_arbitrary_input_returns_a_record_or_refuses() -> None:
    @fuzz_settings(300)
    @given(st.binary(max_size=400) | token_soup)
    def raw_bytes(data: bytes) -> None:
        record = read_line(data)
        if record is not None:
            rewrites_exactly(record)

    @fuzz_settings(300)
    @given(st.text(alphabet=st.sampled_from(AWKWARD) | st.characters(), max_size=200))
    def raw_text(data: str) -> None:
        record = read_line(data)
        if record is not None:
            rewrites_exactly(record)

    fuzz_budget.fuzz_for(fuzz_budget.seconds(0.10), raw_bytes)
    fuzz_budget.fuzz_for(fuzz_budget.seconds(0.05), raw_text)


def test_loads_of_mutated_canonical_lines_returns_a_record_or_refuses() -> None:
    @fuzz_settings(300)
    @given(mutated_lines | field_edits() | numeric_edits())
    def mutated(data: bytes) -> None:
        record = read_line(data)
        if record is not None:
            rewrites_exactly(record)

    fuzz_budget.fuzz_for(fuzz_budget.seconds(0.30), mutated)


@pytest.mark.parametrize("field", ["kind", "schema", "run_id", "payload", "snapshot", "step"])
def test_deep_nesting_anywhere_is_refused_or_read(field: str) -> None:
    """Nesting at and around the interpreter's recursion limit never escapes as RecursionError."""
    base = encode(SEED_RECORDS[1] if field != "snapshot" else SEED_RECORDS[0])
    for depth in (*range(200, 1200, 7), 5000, 50_000):
        for opener, closer in (("[", "]"), ('{"k":', "}")):
            nested = opener * depth + "0" + closer * depth
            data = dict(base)
            data[field] = "@@"
            line = json.dumps(data).replace('"@@"', nested)
            read_line(line)
            read_file_bytes(line.encode() + b"\n")
            read_file_bytes(f"[{line},{line}]\n".encode())


# -- the line-breaking characters, through the codec (property) -----------------------------

breaker_texts = st.text(alphabet=st.sampled_from(AWKWARD) | st.characters(), max_size=30)


@settings(max_examples=fuzz_budget.examples(300, floor=50), deadline=None)
@given(breaker_texts, breaker_texts, st.booleans())
def test_any_text_stays_on_one_line_for_every_reader(run_id: str, text: str, pair: bool) -> None:
    records: list[Record] = [
        RunStarted(run_id=run_id, snapshot={text: text}),
        model_result(run_id, 0, text),
        action_intent(run_id, 0, {text: [text]}),
        step_record(run_id, 0, text, with_action=True),
        run_ended(run_id, StopReason.CANCELLED, 0, detail=text),
    ]
    for record in records:
        line = dumps(record)
        if pair and isinstance(record, StepRecord):
            line = f"[{dumps(action_result(run_id, 0, text))},{line}]"
        assert len(line.splitlines()) == 1, "str.splitlines() splits the line"
        encoded = line.encode("utf-8")
        assert len(encoded.splitlines()) == 1, "bytes.splitlines() splits the line"
        assert b"\n" not in encoded
        read = parse_lines(encoded + b"\n", "run.jsonl", run_id)
        assert read[-1] == record
