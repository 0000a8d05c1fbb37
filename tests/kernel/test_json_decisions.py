"""The JSON action language is read in one place, three ways.

The ready-made interpreter reads it exactly; the test double (the whole reply) and the
demo agent of the command line (the first object in the text) read it loosely. These
tests pin where the three agree and the few places they are meant to differ.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import pytest

from polyloop import Action, FinalAnswer, InvalidDecision, ModelReply
from polyloop.cli._agent import TextToolInterpreter
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.ports import Decision, Interpreter
from polyloop.testing import JsonActionInterpreter

EXACT = JsonToolCallInterpreter()
DOUBLE = JsonActionInterpreter()
DEMO = TextToolInterpreter()


def read(interpreter: Interpreter, text: str) -> Decision:
    return interpreter.interpret(ModelReply(call_id=None, content=text, reasoning=None))


@pytest.mark.parametrize(
    "text",
    [
        '{"tool": "add", "arguments": {"b": 2, "a": "é"}}',
        '  {"tool": "list"}\n',
        '{"answer": "done"}',
    ],
)
def test_all_three_read_a_well_formed_reply_alike(text: str) -> None:
    decisions = [read(interpreter, text) for interpreter in (EXACT, DOUBLE, DEMO)]
    assert decisions[0] == decisions[1] == decisions[2]
    assert isinstance(decisions[0], Action | FinalAnswer)


def test_the_action_text_is_the_kernels_call_text() -> None:
    action = read(DOUBLE, '{"tool": "add", "arguments": {"b": 2, "a": "é"}}')
    assert isinstance(action, Action)
    assert action.action_text == 'add({"a": "é", "b": 2})'


@pytest.mark.parametrize(
    "text",
    [
        '{"tool": "add", "arguments": {}, "why": "because"}',  # a key the language lacks
        '{"tool": "add", "arguments": {"n": 1, "n": 2}}',  # a key named twice
        '{"tool": "add", "arguments": [1, 2]}',  # arguments that are not an object
        '{"tool": "add", "answer": "both"}',  # a call and an answer
    ],
)
def test_the_loose_readings_act_where_the_exact_one_refuses(text: str) -> None:
    assert isinstance(read(EXACT, text), InvalidDecision)
    assert isinstance(read(DOUBLE, text), Action)
    assert isinstance(read(DEMO, text), Action)


@pytest.mark.parametrize(
    "text",
    [
        '{"tool": 7, "answer": "x"}',  # a "tool" key makes it a call, and 7 names none
        '{"n": NaN}',
        '{"tool": "add", "arguments": {"n": 1e400}}',
        '{"tool": "add", "arguments": {"n": ' + "7" * 5_000 + "}}",
        "no object at all",
    ],
)
def test_every_reading_refuses_what_names_no_decision(text: str) -> None:
    for interpreter, feedback in (
        (DOUBLE, JsonActionInterpreter.FEEDBACK),
        (DEMO, TextToolInterpreter.FEEDBACK),
    ):
        refused = read(interpreter, text)
        assert isinstance(refused, InvalidDecision)
        assert refused.feedback == feedback
    assert isinstance(read(EXACT, text), InvalidDecision)


def test_only_the_whole_reply_counts_for_the_double() -> None:
    fenced = 'Sure.\n```json\n{"tool": "add", "arguments": {}}\n```'
    assert isinstance(read(DOUBLE, fenced), InvalidDecision)
    assert isinstance(read(EXACT, fenced), Action)
    assert isinstance(read(DEMO, fenced), Action)
    prose = 'I will call {"tool": "add"} now.'
    assert isinstance(read(DEMO, prose), Action)
    assert isinstance(read(EXACT, prose), InvalidDecision)
    assert isinstance(read(DOUBLE, prose), InvalidDecision)


def test_a_reply_nested_beyond_the_parser_is_a_correction_for_the_demo() -> None:
    deep = '{"tool": "add", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    refused = read(DEMO, deep)
    assert isinstance(refused, InvalidDecision)
    assert refused.feedback == TextToolInterpreter.FEEDBACK
