"""The contract every :class:`~polyloop.ports.Interpreter` keeps, as reusable pytest classes.

Subclass :class:`InterpreterContract` in a test module and provide an ``interpreter``
fixture: the interpreter under test. Provide ``valid_replies`` too, replies your
interpreter turns into actions, so the suite can check that a cut-off, filtered or
refused copy of each is never acted on::

    class TestMyInterpreter(InterpreterContract):
        @pytest.fixture
        def interpreter(self):
            return MyInterpreter()

        @pytest.fixture
        def valid_replies(self):
            return [ModelReply(call_id=None, content="CALL search(q)", reasoning=None)]

Without ``valid_replies`` (the default is none), that test is skipped; arbitrary texts
are still checked. The interpreter is synchronous, so the tests are too: no
``anyio_backend`` is needed.

The tests need pytest and Hypothesis (``pip install hypothesis``), which draws the
arbitrary texts; this module imports it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyloop.ports import Action, Decision, FinalAnswer, Interpreter, InvalidDecision, ModelReply
from polyloop.serialization import plain
from polyloop.testing._contract_checks import assert_plain_parameters
from polyloop.types import FinishReason

__all__ = ("InterpreterContract", "assert_well_formed_decision", "reply_texts")

_TEXTS = {
    Action: ("action_text", "history_text"),
    FinalAnswer: ("answer", "history_text"),
    InvalidDecision: ("feedback", "history_text"),
}

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def reply_texts() -> st.SearchStrategy[str]:
    """Texts a model might send: anything at all, and the shapes interpreters look for.

    JSON objects with the keys a tool call or an answer uses, and fenced blocks, make
    the strategy reach past the first "not a decision" branch of most interpreters.
    """
    decision_object = st.fixed_dictionaries(
        {},
        optional={"tool": st.text() | _JSON, "arguments": _JSON, "answer": st.text() | _JSON},
    ).map(json.dumps)
    # Numbers Python's parser reads but a strict JSON log cannot carry back.
    odd_number = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-2E+999", "0.5"])
    odd_call = odd_number.map(lambda number: f'{{"tool": "t", "arguments": {{"n": {number}}}}}')
    fence = st.sampled_from(["", "json", "python", "bash", "py"])
    fenced = st.tuples(st.text(max_size=20), fence, st.text() | decision_object | odd_call).map(
        lambda parts: f"{parts[0]}\n```{parts[1]}\n{parts[2]}\n```\n"
    )
    return st.text() | decision_object | odd_call | fenced


def assert_well_formed_decision(decision: object) -> Decision:
    """``decision`` is one of the three branches, with string texts and a plain payload."""
    assert not inspect.isawaitable(decision), "interpret() must be synchronous"
    assert isinstance(decision, Action | FinalAnswer | InvalidDecision), (
        f"interpret() returned {type(decision).__name__}, "
        f"not Action, FinalAnswer or InvalidDecision"
    )
    for name in _TEXTS[type(decision)]:
        assert isinstance(getattr(decision, name), str), f"{type(decision).__name__}.{name}"
    if isinstance(decision, Action):
        # The payload is written to the log before the action runs: strict JSON only.
        plain(decision.payload, owner="Action", field="payload")
    return decision


def _reply(text: str, **fields: object) -> ModelReply:
    return ModelReply(call_id=None, content=text, reasoning=None, **fields)  # type: ignore[arg-type]


# Ways a reply can end without ending normally; none of them may be acted on.
INCOMPLETE = (
    {"finish": FinishReason.LENGTH},
    {"finish": FinishReason.CONTENT_FILTER},
    {"finish": FinishReason.REFUSAL},
    {"refusal": "I can't help with that."},
    {"finish": FinishReason.STOP, "refusal": "I can't help with that."},
)

_HYPOTHESIS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class InterpreterContract:
    """Tests every interpreter passes. Provide ``interpreter`` and ``valid_replies``."""

    @pytest.fixture
    def valid_replies(self) -> Sequence[ModelReply]:
        return ()

    def test_satisfies_the_seam(self, interpreter: Interpreter) -> None:
        assert isinstance(interpreter, Interpreter)
        assert not inspect.iscoroutinefunction(interpreter.interpret)

    def test_parameters_are_plain_json_and_stable(
        self, interpreter: Interpreter, valid_replies: Sequence[ModelReply]
    ) -> None:
        params = assert_plain_parameters(interpreter.parameters())
        for reply in [*valid_replies, _reply("not a decision")]:
            interpreter.interpret(reply)
        assert dict(interpreter.parameters()) == params

    def test_valid_replies_are_actions(
        self, interpreter: Interpreter, valid_replies: Sequence[ModelReply]
    ) -> None:
        for reply in valid_replies:
            decision = assert_well_formed_decision(interpreter.interpret(reply))
            assert isinstance(decision, Action), f"{reply.content!r} gave {decision!r}"

    def test_a_reply_that_did_not_end_normally_is_never_an_action(
        self, interpreter: Interpreter, valid_replies: Sequence[ModelReply]
    ) -> None:
        if not valid_replies:
            pytest.skip("no valid_replies: nothing known to be an action to cut off")
        for reply in valid_replies:
            for fields in INCOMPLETE:
                cut = dataclasses.replace(reply, **fields)
                decision = assert_well_formed_decision(interpreter.interpret(cut))
                assert not isinstance(decision, Action), f"{fields} was acted on: {decision!r}"

    def test_any_text_gives_a_well_formed_decision_and_the_same_one_again(
        self, interpreter: Interpreter
    ) -> None:
        @_HYPOTHESIS
        @given(reply_texts())
        def check(text: str) -> None:
            decision = assert_well_formed_decision(interpreter.interpret(_reply(text)))
            assert interpreter.interpret(_reply(text)) == decision, "interpret() is not pure"

        check()

    def test_any_text_that_did_not_end_normally_is_never_an_action(
        self, interpreter: Interpreter
    ) -> None:
        @_HYPOTHESIS
        @given(reply_texts(), st.sampled_from(INCOMPLETE))
        def check(text: str, fields: dict[str, object]) -> None:
            decision = assert_well_formed_decision(interpreter.interpret(_reply(text, **fields)))
            assert not isinstance(decision, Action), f"{fields} was acted on: {decision!r}"

        check()
