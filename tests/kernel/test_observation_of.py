"""A step record written right after its action's result names the result's observation
rather than copying it (record 0063): the codec writes that form only when it is given
the record before the step, reads it back only after that record, and refuses a step
read after anything else, naming the run and where the step is.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit import record as record_kit
from polyloop.serialization import decode, dumps, encode, loads
from polyloop.types import CorruptLog, IntentKind, Record, Replay, Result, RunEnded, StopReason

RUN = "exp-7/task-12#3"
OBSERVATION = "results for 'topic 0', page 0: " + "lorem ipsum dolor sit amet " * 110
WHERE = "runs.db: run row seq 5"


def action_result(
    observation: object = OBSERVATION, *, run_id: str = RUN, k: int = 0, **payload: object
) -> Result:
    """Step ``k``'s action result, as the loop writes it."""
    fields = {"status": "executed", "observation": observation, "synthesized": False}
    fields |= {"done": False, "truncated_chars": 0} | payload
    return record_kit.result(run_id, k, IntentKind.ACTION, fields)


STEP = record_kit.step(RUN, 0, observation=OBSERVATION)
RESULT = action_result()


def test_a_step_after_its_result_names_the_result_and_reads_back_the_same() -> None:
    line = dumps(STEP, after=RESULT)
    data = json.loads(line)
    assert "observation" not in data
    assert data["observation_of"] == f"{RUN}:0:action"
    assert data["schema"] == "polyloop/1.1"
    # Shorter by the observation, less the result's name, a key three characters longer
    # and a schema two characters longer.
    assert len(dumps(STEP)) - len(line) == len(OBSERVATION) - len(f"{RUN}:0:action") - 5
    assert loads(line, after=RESULT) == STEP
    assert decode(encode(STEP, after=RESULT), after=RESULT) == STEP
    # Read back, the step holds the very text its result holds: the observation once.
    result = loads(dumps(RESULT))
    assert isinstance(result, Result) and isinstance(result.payload, dict)
    read = loads(line, after=result)
    assert read == STEP and read.observation is result.payload["observation"]  # type: ignore[union-attr]


def test_without_the_record_before_it_every_record_is_written_whole() -> None:
    assert json.loads(dumps(STEP))["observation"] == OBSERVATION
    assert dumps(STEP, after=None) == dumps(STEP)
    assert encode(STEP)["schema"] == "polyloop/1"


WHOLE = {
    "a synthesized observation": (
        dataclasses.replace(STEP, observation=f"Not executed: {OBSERVATION}"),
        action_result(status="not_executed", synthesized=True),
    ),
    "one character more": (dataclasses.replace(STEP, observation=OBSERVATION + "."), RESULT),
    "no observation": (dataclasses.replace(STEP, observation=None), RESULT),
    "a model call's result": (
        STEP,
        record_kit.result(RUN, 0, IntentKind.MODEL_CALL, {"content": OBSERVATION}),
    ),
    "a result of another run": (STEP, action_result(run_id="other")),
    "a result without an observation": (STEP, action_result(observation=None)),
    "a result that is an error": (
        STEP,
        record_kit.result(RUN, 0, IntentKind.ACTION, {"error": OBSERVATION}),
    ),
    "an intent": (
        STEP,
        record_kit.intent(RUN, 0, IntentKind.ACTION, {"observation": OBSERVATION}),
    ),
}


@pytest.mark.parametrize(("step", "after"), list(WHOLE.values()), ids=list(WHOLE))
def test_a_step_is_written_whole_unless_the_result_before_it_holds_that_very_text(
    step: Record, after: Record
) -> None:
    assert dumps(step, after=after) == dumps(step)
    assert loads(dumps(step, after=after), after=after) == step


@pytest.mark.parametrize(
    "record",
    [
        RESULT,
        record_kit.intent(RUN, 1, IntentKind.MODEL_CALL, {"messages_sha256": "ab"}),
        RunEnded(
            run_id=RUN,
            stop_reason=StopReason.FINAL_ANSWER,
            final_answer=OBSERVATION,
            steps=1,
            valid_steps=1,
            detail=None,
        ),
    ],
)
def test_no_other_kind_is_written_differently_after_a_result(record: Record) -> None:
    assert dumps(record, after=RESULT) == dumps(record)


REFUSED = {
    "nothing before it": (None, "it was read after no record"),
    "the next step's result": (action_result(k=1), "the record before it is not that result"),
    "a result of another run": (
        action_result(run_id="other"),
        "the record before it is not that result",
    ),
    "the action's intent": (
        record_kit.intent(RUN, 0, IntentKind.ACTION, {"n": 1}, replay=Replay.ALLOWED),
        "the record before it is not that result",
    ),
    "a model call's result under that id": (
        dataclasses.replace(RESULT, kind=IntentKind.MODEL_CALL),
        "that result is not an action's",
    ),
    "a result without an observation": (
        action_result(observation=None),
        "that result holds no observation",
    ),
}


@pytest.mark.parametrize(("after", "why"), list(REFUSED.values()), ids=list(REFUSED))
def test_a_step_read_after_anything_but_its_result_is_a_corrupt_log(
    after: Record | None, why: str
) -> None:
    line = dumps(STEP, after=RESULT)
    with pytest.raises(CorruptLog) as refused:
        loads(line, location=WHERE, after=after)
    assert refused.value.run_id == RUN
    assert refused.value.location == WHERE
    assert refused.value.reason == (
        f"the step's observation is that of result '{RUN}:0:action', but {why}"
        + (" (a reader gives the record before it as after=)" if after is None else "")
    )


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"observation": OBSERVATION}, "step record has both 'observation' and 'observation_of'"),
        ({"observation_of": 7}, "step.observation_of must be a str, not 7"),
    ],
)
def test_a_reference_beside_an_observation_or_not_a_name_is_a_corrupt_log(
    changes: dict[str, object], why: str
) -> None:
    data = {**encode(STEP, after=RESULT), **changes}
    with pytest.raises(CorruptLog) as refused:
        decode(data, location=WHERE, after=RESULT)
    assert (refused.value.run_id, refused.value.location) == (RUN, WHERE)
    assert refused.value.reason == why


# Any text, lone surrogates included (their lines are written in ASCII escapes).
TEXT = st.text(st.characters(blacklist_categories=()), max_size=40)


@given(observed=TEXT, told=TEXT)
def test_any_step_reads_back_the_same_after_its_result(observed: str, told: str) -> None:
    result = action_result(observed)
    step = dataclasses.replace(STEP, observation=told)
    line = dumps(step, after=result)
    assert ("observation_of" in json.loads(line)) == (observed == told)
    assert loads(line, after=loads(dumps(result))) == step
