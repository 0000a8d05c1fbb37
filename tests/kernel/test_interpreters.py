"""The ready-made interpreters of ``polyloop.interpreters``: each action language, every
way a reply can fail to be a decision (each with its own feedback), replies that did not
end normally, and whole runs on the memory store under asyncio and Trio."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import polyloop.interpreters
from kit.agent import Ledger, definition, make_tools, request
from polyloop import (
    Action,
    ActionOutcome,
    ActionStatus,
    DecisionKind,
    FinalAnswer,
    FinishReason,
    Interpreter,
    InvalidDecision,
    InvalidRequest,
    ModelReply,
    Replay,
    RunStarted,
    StopReason,
    ToolRegistry,
    run,
)
from polyloop.interpreters import CodeBlockInterpreter, JsonToolCallInterpreter
from polyloop.stores import MemoryStore
from polyloop.testing import ScriptedModelClient

pytestmark = pytest.mark.anyio

JSON = JsonToolCallInterpreter()
CODE = CodeBlockInterpreter(language="python", final_marker="FINAL:")
JSON_FORMAT = "Reply with one JSON object, on its own or inside one ```json block"
CODE_FORMAT = "Reply with exactly one ```python block holding the code to run"


def reply(content: str, **facts: Any) -> ModelReply:
    return ModelReply(call_id="c", content=content, reasoning=None, **facts)


def problem(decision: Any, format_sentence: str) -> str:
    """The part of a feedback that names the fault (the format sentence follows it)."""
    assert isinstance(decision, InvalidDecision), decision
    said, _, _ = decision.feedback.partition(format_sentence)
    return said.strip()


# -- JsonToolCallInterpreter: what it accepts ------------------------------------------------

CALL = {"name": "add", "arguments": {"a": 1, "b": 2}}
ACCEPTED_CALLS = [
    ("bare", '{"tool": "add", "arguments": {"a": 1, "b": 2}}'),
    ("bare with whitespace", '\n  {"tool": "add", "arguments": {"a": 1, "b": 2}}  \n'),
    ("pretty-printed", '{\n  "tool": "add",\n  "arguments": {\n    "a": 1,\n    "b": 2\n  }\n}'),
    ("json fence", '```json\n{"tool": "add", "arguments": {"a": 1, "b": 2}}\n```'),
    ("JSON fence, upper case", '```JSON\n{"tool": "add", "arguments": {"a": 1, "b": 2}}\n```'),
    ("untagged fence", '```\n{"tool": "add", "arguments": {"a": 1, "b": 2}}\n```'),
    (
        "prose around a fence",
        'I will add them.\n```json\n{"tool": "add", "arguments": {"a": 1, "b": 2}}\n```\n'
        "Then I will see.",
    ),
    ("four-backtick fence", '````json\n{"tool": "add", "arguments": {"a": 1, "b": 2}}\n````'),
    ("CRLF line ends", '```json\r\n{"tool": "add", "arguments": {"a": 1, "b": 2}}\r\n```\r\n'),
]


@pytest.mark.parametrize(("case", "text"), ACCEPTED_CALLS, ids=[c for c, _ in ACCEPTED_CALLS])
def test_json_tool_calls_it_accepts(case: str, text: str) -> None:
    decision = JSON.interpret(reply(text))
    assert decision == Action(payload=CALL, action_text='add({"a": 1, "b": 2})', history_text=text)


def test_json_arguments_may_be_left_out_for_a_tool_without_any() -> None:
    decision = JSON.interpret(reply('{"tool": "list_files"}'))
    assert isinstance(decision, Action)
    assert decision.payload == {"name": "list_files", "arguments": {}}
    assert decision.action_text == "list_files({})"


def test_json_answers_it_accepts() -> None:
    for text in ('{"answer": "42"}', 'Done.\n```json\n{"answer": "42"}\n```'):
        assert JSON.interpret(reply(text)) == FinalAnswer(answer="42", history_text=text)


def test_json_action_payload_is_what_the_registry_executor_runs() -> None:
    tools = make_tools(Ledger())
    decision = JSON.interpret(reply('```json\n{"tool": "double", "arguments": {"n": 4}}\n```'))
    assert isinstance(decision, Action) and isinstance(decision.payload, dict)
    assert set(decision.payload) == {"name", "arguments"}
    assert tools.validate(decision.payload["name"], decision.payload["arguments"]) is None


# -- JsonToolCallInterpreter: every failure, each with its own feedback ----------------------

JSON_FAILURES = [
    ("empty reply", "   ", "Your reply is empty."),
    (
        "not JSON at line and column",
        '{"tool": "add",\n "arguments": {"a": 1,}}',
        "Your reply is not valid JSON: Expecting property name enclosed in double quotes "
        "at line 2, column 23.",
    ),
    ("no JSON at all", "I think the answer is 126.", "Your reply holds no JSON object."),
    (
        "broken JSON after prose",
        'Calling it: {"tool": "add", "arguments": {"a": 1,}}',
        "Your reply holds no valid JSON object: the one starting at line 1, column 13 breaks "
        "off with Expecting property name enclosed in double quotes at line 1, column 50.",
    ),
    (
        "prose before a bare object",
        'Sure! {"tool": "add", "arguments": {}}',
        "Your reply has text before the JSON object (which starts at line 1, column 7): send "
        "the object alone, or put it in a ```json block and write text outside the block.",
    ),
    (
        "prose after a bare object",
        '{"tool": "add", "arguments": {}}\nHope that helps.',
        "Your reply goes on after the JSON, at line 2, column 1: send the object alone, or "
        "put it in a ```json block and write text outside the block.",
    ),
    (
        "several objects",
        '{"tool": "add", "arguments": {}}\n{"tool": "add", "arguments": {}}',
        "Your reply holds more than one JSON value (the second starts at line 2, column 1); "
        "send exactly one object: one decision per reply.",
    ),
    ("an array", '[{"tool": "add"}]', "Your reply is JSON, but an array, not an object."),
    ("a string", '"add"', "Your reply is JSON, but a string, not an object."),
    ("a number", "42", "Your reply is JSON, but a number, not an object."),
    ("null", "null", "Your reply is JSON, but null, not an object."),
    (
        "neither tool nor answer",
        '{"name": "add", "args": {}}',
        "Your JSON object has neither \"tool\" nor \"answer\" (its keys are 'args', 'name').",
    ),
    ("an empty object", "{}", 'Your JSON object has neither "tool" nor "answer" (it is empty).'),
    (
        "both tool and answer",
        '{"tool": "add", "arguments": {}, "answer": "3"}',
        'Your JSON object has both "tool" and "answer": send a tool call or an answer, not both.',
    ),
    (
        "tool name not a string",
        '{"tool": ["add"], "arguments": {}}',
        '"tool" must be the tool\'s name as a string, not an array.',
    ),
    ("empty tool name", '{"tool": "", "arguments": {}}', '"tool" is empty: name the tool to call.'),
    (
        "arguments not an object",
        '{"tool": "add", "arguments": [1, 2]}',
        '"arguments" must be a JSON object, not an array.',
    ),
    (
        "unexpected key in a tool call",
        '{"thought": "easy", "tool": "add", "arguments": {}}',
        'Your tool call has keys other than "tool" and "arguments": \'thought\'; put the '
        'tool\'s arguments inside "arguments" and any other text outside the JSON.',
    ),
    ("answer not a string", '{"answer": 42}', '"answer" must be a string, not a number.'),
    (
        "unexpected key in an answer",
        '{"answer": "42", "confidence": 0.9}',
        "Your answer object has keys other than \"answer\": 'confidence'; write any other text "
        "outside the JSON.",
    ),
    (
        "NaN",
        '{"tool": "add", "arguments": {"a": NaN}}',
        "Your reply uses NaN, which is not JSON: write numbers as numbers.",
    ),
    (
        "number beyond a float",
        '{"tool": "add", "arguments": {"a": 1e400}}',
        "Your reply holds the number 1e400, too large to use: write a smaller number.",
    ),
    (
        "whole number too long to read",
        '{"tool": "add", "arguments": {"a": -' + "9" * 5000 + "}}",
        "Your reply holds a whole number of 5000 digits, too long to read: write fewer.",
    ),
    (
        "repeated tool key",
        '{"tool": "read_logs", "tool": "delete_logs", "arguments": {}}',
        "Your reply names the key 'tool' twice in one object: give each key once, so that "
        "it is clear which value you mean.",
    ),
    (
        "repeated answer key",
        '{"answer": "a", "answer": "b"}',
        "Your reply names the key 'answer' twice in one object: give each key once, so that "
        "it is clear which value you mean.",
    ),
    (
        "repeated key deep in the arguments",
        '```json\n{"tool": "add", "arguments": {"a": [{"b": 1, "c": 2, "b": 3}]}}\n```',
        "Your code block on line 1 names the key 'b' twice in one object: give each key "
        "once, so that it is clear which value you mean.",
    ),
    ("too deep", "[" * 100_000 + "]" * 100_000, "Your reply holds JSON nested too deeply to read."),
    (
        "unclosed fence",
        'Here:\n```json\n{"tool": "add", "arguments": {}}\n',
        "Your reply opens a code block on line 2 and never closes it: end the block with a "
        "line of three backticks.",
    ),
    (
        "two fenced blocks",
        '```json\n{"answer": "1"}\n```\nor\n```json\n{"answer": "2"}\n```',
        "Your reply holds 2 code blocks (opening on lines 1, 5); send exactly one decision, "
        "in one block.",
    ),
    (
        "fence in another language",
        '```python\n{"tool": "add", "arguments": {}}\n```',
        "Your code block on line 1 is tagged 'python'; a decision goes in a ```json block.",
    ),
    ("empty fence", "```json\n\n```", "Your code block on line 1 is empty."),
    (
        "not JSON inside a fence",
        "Go:\n```json\n{\"tool\": 'add'}\n```",
        "Your code block on line 2 is not valid JSON: Expecting value at line 3, column 10.",
    ),
    (
        "text before the object inside a fence",
        '```json\ncall: {"tool": "add", "arguments": {}}\n```',
        "Your code block on line 1 has text before the JSON object (which starts at line 2, "
        "column 7): send the object alone, or write text outside the block.",
    ),
    (
        "text after the object inside a fence",
        '```json\n{"tool": "add", "arguments": {}}\nthat is all\n```',
        "Your code block on line 1 goes on after the JSON, at line 3, column 1: send the "
        "object alone, or write text outside the block.",
    ),
]


@pytest.mark.parametrize(
    ("case", "text", "said"), JSON_FAILURES, ids=[case for case, _, _ in JSON_FAILURES]
)
def test_json_failures_say_precisely_what_was_wrong(case: str, text: str, said: str) -> None:
    decision = JSON.interpret(reply(text))
    assert isinstance(decision, InvalidDecision)
    assert problem(decision, JSON_FORMAT) == said
    # What to send instead follows, every time; the reply stays in the history as sent.
    assert decision.feedback.endswith('or {"answer": "<text>"} to answer.')
    assert decision.history_text == text


def test_every_json_failure_has_its_own_feedback() -> None:
    said = [problem(JSON.interpret(reply(text)), JSON_FORMAT) for _, text, _ in JSON_FAILURES]
    assert len(set(said)) == len(said)


def test_json_feedback_does_not_echo_a_huge_key_back() -> None:
    decision = JSON.interpret(reply(json.dumps({"k" * 10_000: 1})))
    assert isinstance(decision, InvalidDecision) and len(decision.feedback) < 500


def test_json_prose_full_of_braces_is_read_in_bounded_time() -> None:
    text = 'x {"' * 20_000  # every brace opens a string that runs to the end
    decision = JSON.interpret(reply(text))
    assert isinstance(decision, InvalidDecision)
    assert "holds no valid JSON object" in decision.feedback


# -- CodeBlockInterpreter ---------------------------------------------------------------------


def test_code_block_is_an_action_carrying_its_code() -> None:
    text = "Let me look.\n```python\nprint(open('a.txt').read())\n```\n"
    decision = CODE.interpret(reply(text))
    assert decision == Action(
        payload={"code": "print(open('a.txt').read())\n"},
        action_text="print(open('a.txt').read())",
        history_text=text,
    )


def test_code_block_tags_match_without_case_and_aliases_count() -> None:
    assert isinstance(CODE.interpret(reply("```Python\nx = 1\n```")), Action)
    aliased = CodeBlockInterpreter(language="python", aliases=("py",))
    assert isinstance(aliased.interpret(reply("```py\nx = 1\n```")), Action)
    assert isinstance(aliased.interpret(reply("```python title=x\nx = 1\n```")), Action)


def test_code_block_keeps_the_code_exactly_as_written() -> None:
    code = "def f():\n\n    return '```'\n\nprint(f())\n"
    decision = CODE.interpret(reply(f"```python\n{code}```"))
    assert isinstance(decision, Action) and decision.payload == {"code": code}


def test_code_block_final_marker_answers() -> None:
    for text, answer in [
        ("FINAL: 400", "400"),
        ("  FINAL:\nThe total is 400.\n", "The total is 400."),
        # A reply that starts with the marker is an answer: its block does not run.
        ("FINAL: use this:\n```python\nprint(400)\n```", "use this:\n```python\nprint(400)\n```"),
    ]:
        assert CODE.interpret(reply(text)) == FinalAnswer(answer=answer, history_text=text)


def test_code_block_without_a_final_marker_has_no_answering_reply() -> None:
    environment_decides = CodeBlockInterpreter()
    decision = environment_decides.interpret(reply("FINAL: 400"))
    assert isinstance(decision, InvalidDecision)
    assert decision.feedback == (
        "Your reply holds no code block. Reply with exactly one ```python block holding the "
        "code to run, at the end of your reply (text before the block is fine). No reply ends "
        "the task: the environment says when it is done."
    )


CODE_FAILURES = [
    ("no block", "The total is 400, so I am done.", "Your reply holds no code block."),
    (
        "unclosed block",
        "Running:\n```python\nprint(1)\n",
        "Your code block opened on line 2 is never closed: end it with a line of three backticks.",
    ),
    (
        "two blocks",
        "```python\nx = 1\n```\nthen\n```python\nprint(x)\n```",
        "Your reply holds 2 code blocks (opened on lines 1, 5); send one block with all the "
        "code to run now.",
    ),
    (
        "no language tag",
        "```\nprint(1)\n```",
        "Your code block has no language tag: open it with ```python.",
    ),
    (
        "another language",
        "```javascript\nconsole.log(1)\n```",
        "Your code block is tagged 'javascript', but the code must be python: open the "
        "block with ```python.",
    ),
    ("empty block", "```python\n  \n```", "Your code block is empty: there is no code to run."),
    (
        "text after the block",
        "```python\nprint(2 + 2)\n```\nOutput: 4",
        "Your reply goes on after the code block closes on line 3: end the reply with the "
        "block. The code's output comes back in the next message.",
    ),
    (
        "final marker without an answer",
        "FINAL:   \n",
        "Your reply starts with FINAL: but gives no answer after it.",
    ),
]


@pytest.mark.parametrize(
    ("case", "text", "said"), CODE_FAILURES, ids=[case for case, _, _ in CODE_FAILURES]
)
def test_code_block_failures_say_precisely_what_was_wrong(case: str, text: str, said: str) -> None:
    decision = CODE.interpret(reply(text))
    assert isinstance(decision, InvalidDecision)
    assert problem(decision, CODE_FORMAT) == said
    assert decision.feedback.endswith(
        "To answer instead, start your reply with FINAL: and the answer."
    )
    assert decision.history_text == text


def test_every_code_block_failure_has_its_own_feedback() -> None:
    said = [problem(CODE.interpret(reply(text)), CODE_FORMAT) for _, text, _ in CODE_FAILURES]
    assert len(set(said)) == len(said)


@pytest.mark.parametrize(
    "settings",
    [
        {"language": ""},
        {"language": "two words"},
        {"language": " python"},
        {"language": "py`"},
        {"aliases": ("",)},
        {"aliases": ["py"]},
        {"final_marker": ""},
        {"final_marker": "   "},
    ],
)
def test_code_block_settings_are_checked_when_built(settings: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        CodeBlockInterpreter(**settings)


# -- what both share ---------------------------------------------------------------------------

BOTH = [JSON, CODE]
INCOMPLETE = [
    ({"finish": FinishReason.LENGTH}, "cut off at the length limit"),
    ({"finish": FinishReason.CONTENT_FILTER}, "content filter"),
    ({"finish": FinishReason.REFUSAL}, "refusal"),
    ({"refusal": "I can't help with that."}, "refusal: I can't help with that."),
]


@pytest.mark.parametrize("interpreter", BOTH, ids=lambda i: type(i).__name__)
@pytest.mark.parametrize(("facts", "says"), INCOMPLETE, ids=lambda v: str(v))
def test_a_reply_that_did_not_end_normally_is_never_acted_on(
    interpreter: Interpreter, facts: dict[str, Any], says: str
) -> None:
    # Each reply would be a valid decision had it ended normally.
    for text in ('{"tool": "add", "arguments": {}}', "```python\nprint(1)\n```", "FINAL: 1"):
        decision = interpreter.interpret(reply(text, **facts))
        assert isinstance(decision, InvalidDecision)
        assert says in decision.feedback
        assert decision.history_text == text


def test_parameters_name_the_language_its_version_and_settings() -> None:
    assert JSON.parameters() == {"kind": "json-tool-call", "version": 1}
    assert CodeBlockInterpreter().parameters() == {
        "kind": "code-block",
        "version": 1,
        "language": "python",
        "aliases": [],
        "final_marker": None,
    }
    custom = CodeBlockInterpreter(language="bash", aliases=("sh",), final_marker="ANSWER:")
    assert custom.parameters() == {
        "kind": "code-block",
        "version": 1,
        "language": "bash",
        "aliases": ["sh"],
        "final_marker": "ANSWER:",
    }
    for interpreter in (JSON, custom):
        assert json.loads(json.dumps(interpreter.parameters())) == interpreter.parameters()


def test_interpreters_are_frozen_values_that_satisfy_the_protocol() -> None:
    for interpreter in BOTH:
        assert isinstance(interpreter, Interpreter)
        params = type(interpreter).__dataclass_params__  # type: ignore[attr-defined]
        assert params.frozen and hasattr(type(interpreter), "__slots__")
        assert all(field.kw_only for field in dataclasses.fields(interpreter))
    with pytest.raises(dataclasses.FrozenInstanceError):
        CODE.language = "bash"  # type: ignore[misc]
    assert CodeBlockInterpreter(language="python") == CodeBlockInterpreter()


def test_the_module_docstring_names_every_interpreter() -> None:
    doc = polyloop.interpreters.__doc__ or ""
    for name in polyloop.interpreters.__all__:
        assert f":class:`{name}`" in doc


# -- properties ----------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=20)
_json_values = st.recursive(
    _scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_arguments = st.dictionaries(st.text(max_size=10), _json_values, max_size=5)
_prose = st.text(alphabet=st.characters(blacklist_characters="`\r"), max_size=40).map(
    lambda text: text.replace("\n", " ")
)


def _wrap(body: str, how: str, before: str, after: str) -> str:
    if how == "bare":
        return body
    tag = {"json fence": "json", "untagged fence": ""}[how]
    return f"{before}\n```{tag}\n{body}\n```\n{after}"


@given(
    name=st.text(min_size=1, max_size=30),
    arguments=_arguments,
    how=st.sampled_from(["bare", "json fence", "untagged fence"]),
    indent=st.sampled_from([None, 2]),
    before=_prose,
    after=_prose,
)
def test_any_tool_call_object_is_an_action_with_exactly_its_arguments(
    name: str, arguments: dict[str, Any], how: str, indent: int | None, before: str, after: str
) -> None:
    body = json.dumps({"tool": name, "arguments": arguments}, indent=indent)
    decision = JSON.interpret(reply(_wrap(body, how, before, after)))
    assert isinstance(decision, Action)
    assert decision.payload == {"name": name, "arguments": arguments}


@given(answer=st.text(), how=st.sampled_from(["bare", "json fence", "untagged fence"]))
def test_any_answer_object_is_that_final_answer(answer: str, how: str) -> None:
    decision = JSON.interpret(reply(_wrap(json.dumps({"answer": answer}), how, "", "")))
    assert isinstance(decision, FinalAnswer) and decision.answer == answer


_code_lines = st.lists(
    st.text(alphabet=st.characters(blacklist_characters="`\n\r"), max_size=30), max_size=8
)


@given(lines=_code_lines, before=_prose)
def test_any_code_in_one_block_is_an_action_with_exactly_that_code(
    lines: list[str], before: str
) -> None:
    code = "".join(f"{line}\n" for line in lines)
    decision = CODE.interpret(reply(f"{before}\n```python\n{code}```\n"))
    if not code.strip() or before.lstrip().startswith("FINAL:"):
        assert not isinstance(decision, Action)
    else:
        assert decision == Action(
            payload={"code": code}, action_text=code.strip(), history_text=decision.history_text
        )


@given(text=st.text())
def test_no_text_makes_either_interpreter_raise(text: str) -> None:
    for interpreter in BOTH:
        decision = interpreter.interpret(reply(text))
        assert isinstance(decision, Action | FinalAnswer | InvalidDecision)
        assert decision.history_text == text


# -- whole runs ----------------------------------------------------------------------------------


async def test_a_run_with_the_json_tool_call_interpreter() -> None:
    store, ledger = MemoryStore(), Ledger()
    script = [
        'Doubling first.\n```json\n{"tool": "double", "arguments": {"n": 3,}}\n```',
        'Doubling first.\n```json\n{"tool": "double", "arguments": {"n": 3}}\n```',
        '{"tool": "submit", "arguments": {"answer": "6"}}',
    ]
    result = await run(
        definition(store, script=script, interpreter=JsonToolCallInterpreter()),
        request("json-run", make_tools(ledger)),
    )
    assert result.stop_reason is StopReason.SUBMITTED
    invalid, doubled, submitted = result.steps
    assert invalid.decision is DecisionKind.INVALID
    assert invalid.observation is not None and invalid.observation.startswith(
        "Your code block on line 2 is not valid JSON: Expecting property name enclosed in "
        "double quotes at line 3, column 41."
    )
    assert doubled.action_text == 'double({"n": 3})'
    assert doubled.action_status is ActionStatus.EXECUTED
    assert submitted.action_status is ActionStatus.EXECUTED
    assert ledger.calls == [("double", "json-run:1:action"), ("submit", "json-run:2:action")]
    started = (await store.read_log("json-run")).records[0]
    assert isinstance(started, RunStarted)
    assert started.snapshot["interpreter.kind"] == "json-tool-call"


class ScriptedPython:
    """An executor for code actions that 'runs' the code by looking up its output."""

    def __init__(self, outputs: dict[str, str]) -> None:
        self.outputs = outputs
        self.ran: list[str] = []

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Cancellation: nothing to clean up; there is no await before the answer."""
        assert isinstance(action.payload, dict)
        code = str(action.payload["code"])
        self.ran.append(code)
        return ActionOutcome(
            status=ActionStatus.EXECUTED,
            observation=self.outputs[code],
            synthesized=False,
            done=False,
        )

    def replay(self, action: Action) -> Replay:
        return Replay.NEVER


async def test_a_run_with_the_code_block_interpreter() -> None:
    store = MemoryStore()
    executor = ScriptedPython({"print(17 * 23)\n": "391\n"})
    script = [
        "Working it out.\n```python\nprint(17 * 23)\n```\nIt should print 391.",
        "Working it out.\n```python\nprint(17 * 23)\n```",
        "FINAL: 391",
    ]
    no_tools = ToolRegistry([], max_observation_chars=1_000)
    interpreter = CodeBlockInterpreter(language="python", final_marker="FINAL:")
    result = await run(
        definition(store, model=ScriptedModelClient(script), interpreter=interpreter),
        request("code-run", no_tools, executor=executor),
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "391"
    assert [step.decision for step in result.steps] == [
        DecisionKind.INVALID,
        DecisionKind.ACTION,
        DecisionKind.FINAL,
    ]
    assert result.steps[0].observation is not None
    assert re.match(r"Your reply goes on after the code block", result.steps[0].observation)
    assert result.steps[1].observation == "391\n"
    assert executor.ran == ["print(17 * 23)\n"]
    started = (await store.read_log("code-run")).records[0]
    assert isinstance(started, RunStarted)
    assert started.snapshot["interpreter.kind"] == "code-block"
    assert started.snapshot["interpreter.final_marker"] == "FINAL:"
