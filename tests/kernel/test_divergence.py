"""Tests for polyloop.testing._divergence: the first message a re-driven run sends otherwise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kit.record import step
from polyloop._assembly import step_messages
from polyloop.testing._divergence import QUOTE_CHARS, first_difference, recorded_history
from polyloop.types import Message, Role, ToolCallBlock

TEMPLATE = "Observation: {observation}"
PREFIX = (Message.text(Role.SYSTEM, "Be careful."), Message.text(Role.USER, "Double 1."))
STEPS = [
    step(k=0, history_text="double(1)", observation="2"),
    step(k=1, history_text="I refuse", observation=None),
    step(k=2, history_text="double(2)", observation="4"),
]


def sent_at(before: int, template: str = TEMPLATE) -> list[Message]:
    """What the loop sends at step ``before`` of STEPS, built as the loop builds it."""
    messages = list(PREFIX)
    for record in STEPS[:before]:
        messages += step_messages(record.history_text, record.observation, template)
    return messages


def test_the_recorded_history_names_each_message_by_its_step_and_part() -> None:
    history = recorded_history(STEPS, TEMPLATE, before=3)
    assert [(said.step, said.part) for said in history] == [
        (0, "reply"),
        (0, "observation"),
        (1, "reply"),  # a step without an observation adds its reply alone
        (2, "reply"),
        (2, "observation"),
    ]
    assert [said.message for said in history] == sent_at(3)[len(PREFIX) :]
    assert recorded_history(STEPS, TEMPLATE, before=0) == []


@pytest.mark.parametrize(
    ("before", "sent", "reason"),
    [
        (
            1,
            sent_at(1, "Seen: {observation}"),
            "message 3 (the observation of step 0) differs at character 21: recorded "
            '{"content":[{"text":"Observation: 2","type":"text"}],"role":…, '
            'sent {"content":[{"text":"Seen: 2","type":"text"}],"role":"user"}',
        ),
        (
            3,
            [Message.text(Role.SYSTEM, "Be hasty."), *sent_at(3)[1:]],
            "the 2 messages before the history (run context, injected text, tool list, "
            "goal) differ from the recorded run's, whose log keeps only their digest; "
            "the 5 of the history are the same",
        ),
        (
            0,
            [Message.text(Role.SYSTEM, "Be hasty.")],
            "the 1 messages before the history (run context, injected text, tool list, "
            "goal) differ from the recorded run's, whose log keeps only their digest; "
            "no history yet",
        ),
        (
            3,
            sent_at(3)[:4],
            "4 messages were sent where the recorded run's history alone held 5",
        ),
        (
            2,
            [*sent_at(1), Message.text(Role.ASSISTANT, "I obey")],
            "message 4 (the reply of step 1) differs at character 23: recorded "
            '{"content":[{"text":"I refuse","type":"text"}],"role":"assis…, '
            'sent {"content":[{"text":"I obey","type":"text"}],"role":"assista…',
        ),
    ],
)
def test_the_first_difference_is_named_and_quoted(
    before: int, sent: list[Message], reason: str
) -> None:
    assert first_difference(recorded_history(STEPS, TEMPLATE, before), sent) == reason


def test_a_long_message_is_quoted_around_its_first_difference_only() -> None:
    recorded = [step(k=0, history_text="x", observation="a" * 500 + "b" + "a" * 500)]
    changed = step_messages("x", "a" * 500 + "c" + "a" * 500, TEMPLATE)
    reason = first_difference(recorded_history(recorded, TEMPLATE, 1), [*PREFIX, *changed])
    at = len('{"content":[{"text":"Observation: ') + 500
    half = "a" * (QUOTE_CHARS // 2)
    assert reason.startswith(f"message 3 (the observation of step 0) differs at character {at}")
    assert f"recorded …{half}b{half[:-1]}…, sent …{half}c{half[:-1]}…" in reason


def test_a_native_tool_call_is_compared_with_its_call_and_result() -> None:
    call = ToolCallBlock(call_id="c1", name="double", arguments={"n": 1})
    recorded = [step(k=0, history_text="", observation="2", tool_call=call)]
    other = ToolCallBlock(call_id="c1", name="double", arguments={"n": 2})
    reason = first_difference(
        recorded_history(recorded, TEMPLATE, 1),
        [*PREFIX, *step_messages("", "2", TEMPLATE, other)],
    )
    assert reason.startswith("message 2 (the reply of step 0) differs at character ")
    assert '"arguments":{"n":1}' in reason and '"arguments":{"n":2}' in reason


texts = st.text(alphabet="ab ", max_size=8)


@given(
    prefix=st.lists(texts, min_size=1, max_size=3),
    replies=st.lists(texts, min_size=1, max_size=4),
    data=st.data(),
)
def test_a_change_to_any_history_message_is_found_at_its_index(
    prefix: list[str], replies: list[str], data: st.DataObject
) -> None:
    records = [step(k=k, history_text=text, observation=text) for k, text in enumerate(replies)]
    history = recorded_history(records, TEMPLATE, len(records))
    sent = [Message.text(Role.SYSTEM, text) for text in prefix] + [s.message for s in history]
    assert "before the history" in first_difference(history, sent)
    index = data.draw(st.integers(min_value=0, max_value=len(history) - 1))
    changed = list(sent)
    changed[len(prefix) + index] = Message.text(Role.ASSISTANT, "changed!")
    said = history[index]
    assert first_difference(history, changed).startswith(
        f"message {len(prefix) + index} (the {said.part} of step {said.step}) differs"
    )
