"""Records, byte strategies and read-back checks that the fuzz tests share.

``tests/kernel/test_serialization_fuzz.py`` feeds them to the record codec,
``tests/stores/test_fuzz_stores.py`` to the JSON-lines reader and to every store.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kit import record as record_kit
from polyloop.serialization import dumps, encode, loads
from polyloop.stores._jsonl.reader import records_of
from polyloop.testing.store_contract import expected_records, sample_run
from polyloop.types import (
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

RECORD_TYPES = (RunStarted, Intent, Result, StepRecord, RunEnded)
REFUSALS = (CorruptLog, SchemaMajorMismatch)

# Characters that split a line for some reader: str.splitlines() breaks at all of them,
# bytes.splitlines() and universal-newline text mode at \r, JSON-lines readers at \n.
LINE_BREAKERS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
AWKWARD = LINE_BREAKERS + '\x00\t"\\/é\u2603\U0001f600 a'


# -- records --------------------------------------------------------------------------------


def model_intent(run_id: str, k: int, sha: str = "ab", replay: Replay = Replay.NEVER) -> Intent:
    return record_kit.intent(
        run_id, k, IntentKind.MODEL_CALL, {"messages_sha256": sha}, replay=replay
    )


def model_result(run_id: str, k: int, text: str) -> Result:
    payload: JSONValue = {"call_id": f"c{k}", "content": text, "reasoning": None}
    return record_kit.result(run_id, k, IntentKind.MODEL_CALL, payload)


def action_intent(
    run_id: str, k: int, arguments: JSONValue, replay: Replay = Replay.ALLOWED
) -> Intent:
    return record_kit.intent(
        run_id,
        k,
        IntentKind.ACTION,
        {"name": "tool", "arguments": arguments},
        replay=replay,
        action_text="tool(...)",
        history_text="calls the tool",
    )


def action_result(run_id: str, k: int, text: str) -> Result:
    return record_kit.result(
        run_id, k, IntentKind.ACTION, {"status": "executed", "observation": text}
    )


def step_record(run_id: str, k: int, text: str, *, with_action: bool) -> StepRecord:
    if with_action:
        return record_kit.step(
            run_id,
            k,
            call_id=f"c{k}",
            model_output=text,
            reasoning=text,
            history_text=text,
            action_text="tool(...)",
            observation=text,
            duration_s=0.5,
        )
    return record_kit.step(
        run_id,
        k,
        model_output=text,
        decision=DecisionKind.FINAL,
        history_text=text,
        action_text=None,
        observation=None,
        action_status=None,
        final_answer=text,
        duration_s=0.5,
    )


def run_ended(run_id: str, reason: StopReason, steps: int, detail: str | None = None) -> RunEnded:
    return RunEnded(
        run_id=run_id,
        stop_reason=reason,
        final_answer=None,
        steps=steps,
        valid_steps=steps,
        detail=detail,
    )


TIMED_AT = datetime(2026, 12, 1, 21, 40, 5, 123456, tzinfo=UTC)


def _seed_records() -> list[Record]:
    """One of each record shape the kernel writes, with awkward text in them."""
    records = expected_records(sample_run("r", steps=2))
    records += [
        model_intent("r", 2, replay=Replay.ALLOWED),
        model_result("r", 2, AWKWARD),
        step_record("r", 2, AWKWARD, with_action=False),
        action_intent("r", 3, {"deep": [[{"x": [1, -2.5e-300, None, True]}]], "n": 2**70}),
        dataclasses.replace(step_record("r", 3, "\ud800 lone", with_action=True), error="E: x"),
        run_ended("r", StopReason.IN_DOUBT, 3, detail="action r:3:action"),
        RunStarted(run_id="r", snapshot={AWKWARD: [AWKWARD, 1.5, {"": None}]}),
        # The timing fields: a time with microseconds, and durations.
        dataclasses.replace(model_result("r", 4, "timed"), at=TIMED_AT, duration_s=0.75),
        dataclasses.replace(
            step_record("r", 4, "timed", with_action=False),
            at=TIMED_AT,
            model_duration_s=0.75,
        ),
    ]
    return records


SEED_RECORDS = _seed_records()
SEED_LINES = [dumps(record).encode() for record in SEED_RECORDS]
# The JSON-lines store writes a step with its action result as one array line.
SEED_PAIRS = [
    (result, step)
    for result, step in itertools.pairwise(SEED_RECORDS)
    if isinstance(result, Result) and isinstance(step, StepRecord)
]
SEED_PAIR_LINES = [f"[{dumps(result)},{dumps(step)}]".encode() for result, step in SEED_PAIRS]
assert SEED_PAIR_LINES
# What each seed line must read back as.
SEED_LINE_RECORDS: dict[bytes, list[Record]] = {
    **{line: [record] for line, record in zip(SEED_LINES, SEED_RECORDS, strict=True)},
    **{line: list(pair) for line, pair in zip(SEED_PAIR_LINES, SEED_PAIRS, strict=True)},
}


# -- byte strategies ------------------------------------------------------------------------

TOKENS = [
    b'"',
    b"\\",
    b"\\u",
    b"\\ud800",
    b"\\udc00",
    b"\\u0000",
    b"\\u2028",
    b"[",
    b"]",
    b"{",
    b"}",
    b",",
    b":",
    b" ",
    b"\t",
    b"\r",
    b"\n",
    b"0",
    b"-",
    b".5",
    b"e",
    b"1e999",
    b"-1e999",
    b"9" * 40,
    b"1" + b"0" * 400,
    b"1" + b"0" * 5000,
    b"null",
    b"true",
    b"false",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"\xff",
    b"\xc3",
    b"\xed\xa0\x80",
    b"\xe2\x80\xa8",
    b"\xc2\x85",
    b"\xef\xbb\xbf",
    b'"polyloop/2"',
    b'"polyloop/1.9"',
    b'"polyloop/01"',
    b'"polyloop/\xd9\xa1"',
    b'"kind"',
    b'"schema"',
    b'"run_id"',
    b'"step"',
    b'"payload"',
    b'"duration_s"',
    b'"intent_kind"',
    b"[" * 200,
    b"]" * 200,
    b'{"a":' * 60,
    b"[" * 3000,
]
token_soup = st.lists(st.sampled_from(TOKENS) | st.binary(max_size=4), max_size=40).map(b"".join)
MUTATIONS = ("flip", "set", "insert", "delete", "duplicate", "truncate", "swap")
mutation = st.tuples(
    st.sampled_from(MUTATIONS),
    st.integers(0, 2**20),
    st.integers(0, 2**20),
    st.sampled_from(TOKENS) | st.binary(min_size=1, max_size=4),
)


def mutate(line: bytes, ops: Sequence[tuple[str, int, int, bytes]]) -> bytes:
    """Apply byte-level edits to ``line`` (positions wrap around its current length)."""
    data = bytearray(line)
    for op, a, b, token in ops:
        n = len(data)
        i = a % (n + 1)
        if op == "flip" and n:
            data[i % n] ^= 1 << (b % 8)
        elif op == "set" and n:
            data[i % n] = token[0]
        elif op == "insert":
            data[i:i] = token
        elif op == "delete":
            del data[i : i + 1 + b % 16]
        elif op == "duplicate":
            data[i:i] = data[i : i + 1 + b % 64]
        elif op == "truncate":
            del data[i:]
        elif op == "swap" and n:
            j = b % n
            data[i % n], data[j] = data[j], data[i % n]
    return bytes(data)


seed_lines = st.sampled_from(SEED_LINES + SEED_PAIR_LINES)
mutated_lines = st.builds(mutate, seed_lines, st.lists(mutation, min_size=1, max_size=6))

# Up to the digit limit (json.dumps itself refuses more; TOKENS carry longer ones).
big_ints = st.integers(1, 4300).map(lambda digits: int("7" * digits))
# Numbers at the edges of what floats, 64-bit integers and the digit limit can hold.
edge_numbers = st.sampled_from(
    [
        0,
        -0.0,
        2**53 + 1,
        2**63,
        -(2**63) - 1,
        2**64,
        10**308,
        10**309,
        2**1024,
        -(2**1024),
        10**4299,
        1.7976931348623157e308,
        5e-324,
        -5e-324,
    ]
)
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | big_ints
    | edge_numbers
    | st.floats()
    | st.text(alphabet=st.sampled_from(AWKWARD) | st.characters(), max_size=8)
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def field_edits(draw: st.DrawFn) -> bytes:
    """A seed record's JSON object with fields replaced, added or removed, as a line."""
    data: dict[str, Any] = dict(encode(draw(st.sampled_from(SEED_RECORDS))))
    for _ in range(draw(st.integers(1, 3))):
        keys = st.sampled_from(sorted(data))
        key = draw(st.one_of(keys, keys, keys, st.text(max_size=6)))
        if draw(st.booleans()) and key in data:
            del data[key]
        else:
            data[key] = draw(st.one_of(edge_numbers, json_leaves, json_values))
    # allow_nan=True writes NaN/Infinity literals, which the reader must refuse.
    text = json.dumps(data, ensure_ascii=draw(st.booleans()), allow_nan=True)
    if draw(st.booleans()):  # a duplicate key
        text = text[:-1] + ', "kind": ' + json.dumps(draw(json_values), allow_nan=True) + "}"
    return text.encode("utf-8", "surrogatepass")


NUMERIC_FIELDS = (
    "step",
    "call_index",
    "truncated_chars",
    "duration_s",
    "model_duration_s",
    "steps",
    "valid_steps",
)


@st.composite
def numeric_edits(draw: st.DrawFn) -> bytes:
    """A seed record with one of its number fields set to a number at some edge."""
    record = draw(
        st.sampled_from([r for r in SEED_RECORDS if any(f in encode(r) for f in NUMERIC_FIELDS)])
    )
    data: dict[str, Any] = dict(encode(record))
    field = draw(st.sampled_from([f for f in NUMERIC_FIELDS if f in data]))
    data[field] = draw(edge_numbers | st.integers() | st.floats())
    return json.dumps(data, allow_nan=True).encode()


any_line = (
    st.binary(max_size=400)
    | token_soup
    | mutated_lines
    | field_edits()
    | numeric_edits()
    | seed_lines
)


# -- the properties -------------------------------------------------------------------------


def read_line(data: bytes | str) -> Record | None:
    """``loads(data)``: a record, or ``None`` when it is refused the two allowed ways.

    Any other exception propagates and fails the test.
    """
    try:
        record = loads(data, location="here:1")
    except REFUSALS as exc:
        refused: CorruptLog | SchemaMajorMismatch = exc
    else:
        assert isinstance(record, RECORD_TYPES)
        return record
    assert refused.location == "here:1", f"the error does not say where: {refused!r}"
    return None


def rewrites_exactly(record: Record) -> None:
    """A record the reader accepted is written back to a line that reads back equal."""
    try:
        line = dumps(record)
    except UnloggableValue:
        # The reader accepts a little more than the writer writes (payloads nested more
        # than 256 levels deep); refusing to write it is the documented behaviour.
        return
    assert "\n" not in line
    assert loads(line) == record


def parse_lines(data: bytes, file_name: str, run_id: str) -> list[Record]:
    """The records of a run file's bytes as the JSON-lines store reads them: its complete
    lines, the unterminated last piece ignored."""
    return records_of(data.split(b"\n")[:-1], file_name, run_id)


def read_file_bytes(data: bytes, run_id: str = "r") -> list[Record] | None:
    """``parse_lines`` on a run file's bytes: the records, or ``None`` when refused."""
    try:
        records = parse_lines(data, "run.jsonl", run_id)
    except REFUSALS as exc:
        refused: CorruptLog | SchemaMajorMismatch = exc
    else:
        assert all(isinstance(r, RECORD_TYPES) and r.run_id == run_id for r in records)
        return records
    where = refused.location
    assert where is not None and where.startswith("run.jsonl:"), f"no line in {refused!r}"
    return None


def fuzz_settings(batch: int) -> settings:
    # derandomize=False even under hypothesis's CI profile: each batch must draw new
    # examples, or a time-bounded run would repeat the first batch until time is up.
    return settings(
        max_examples=batch,
        deadline=None,
        derandomize=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )
