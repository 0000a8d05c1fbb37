"""Tests for polyloop._assembly: segment order, injection slot, tool list, size metric.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polyloop._assembly import (
    Transcript,
    canonical,
    message_json,
    messages_sha256,
    prefix,
    render_injection,
    render_tools,
    size,
    step_messages,
    unknown_channels,
)
from polyloop.types import Injection, JSONValue, Message, Role, TextBlock, ToolStyle

TEMPLATE = "Observation:\n{observation}"

RUN_CONTEXT = (
    Message.text(Role.SYSTEM, "You are a careful agent."),
    Message.text(Role.USER, "Work in /srv/repo."),
)
GOAL_CONTEXT = (Message.text(Role.USER, "Find the failing test."),)

SEARCH: dict[str, JSONValue] = {
    "name": "search",
    "description": "Search the code base.",
    "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string"}},
        "required": ["q"],
    },
    "replay": "allowed",
    "completes": False,
}
SUBMIT: dict[str, JSONValue] = {
    "name": "submit",
    "description": "Hand in the answer. Ünïcode stays.",
    "parameters": {"type": "object"},
    "replay": "never",
    "completes": True,
}

SEARCH_JSON = (
    '{"description":"Search the code base.","name":"search","parameters":'
    '{"properties":{"q":{"type":"string"}},"required":["q"],"type":"object"}}'
)
SUBMIT_JSON = (
    '{"description":"Hand in the answer. Ünïcode stays.","name":"submit",'
    '"parameters":{"type":"object"}}'
)
SEARCH_MARKDOWN = (
    "## search\n"
    "\n"
    "Search the code base.\n"
    "\n"
    "```json\n"
    "{\n"
    '  "properties": {\n'
    '    "q": {\n'
    '      "type": "string"\n'
    "    }\n"
    "  },\n"
    '  "required": [\n'
    '    "q"\n'
    "  ],\n"
    '  "type": "object"\n'
    "}\n"
    "```"
)
SUBMIT_MARKDOWN = (
    '## submit\n\nHand in the answer. Ünïcode stays.\n\n```json\n{\n  "type": "object"\n}\n```'
)

NO_INJECTION = Injection(entries={})


def assemble(
    *,
    run_context: Sequence[Message],
    injection: Injection,
    tools: Sequence[Mapping[str, Any]],
    style: ToolStyle,
    goal_context: Sequence[Message],
    history: Sequence[tuple[str, str | None]],
    template: str = TEMPLATE,
) -> tuple[Message, ...]:
    """The messages of a model call, put together the way the session does it."""
    transcript = Transcript(
        prefix(
            run_context=run_context,
            injection_text=render_injection(injection),
            tools_text=render_tools(tools, style),
            goal_context=goal_context,
        )
    )
    for history_text, observation in history:
        transcript.extend(step_messages(history_text, observation, template))
    return transcript.messages


def dump(messages: Sequence[Message]) -> bytes:
    """A canonical JSON dump of a message list."""
    return json.dumps(
        [message_json(m) for m in messages], ensure_ascii=False, sort_keys=True
    ).encode("utf-8", "surrogatepass")


# -- segment order ------------------------------------------------------------------------


def test_segment_order_with_every_segment() -> None:
    injection = Injection(entries={"system": ("Skill A.", "Skill B.")})
    messages = assemble(
        run_context=RUN_CONTEXT,
        injection=injection,
        tools=[SEARCH, SUBMIT],
        style=ToolStyle.JSON,
        goal_context=GOAL_CONTEXT,
        history=[
            ('{"tool": "search", "q": "test"}', "3 hits"),
            ("I am not sure.", None),
            ('{"tool": "submit"}', "accepted"),
        ],
    )
    assert messages == (
        Message.text(Role.SYSTEM, "You are a careful agent."),
        Message.text(Role.USER, "Work in /srv/repo."),
        Message.text(Role.SYSTEM, "Skill A.\n\nSkill B."),
        Message.text(Role.SYSTEM, SEARCH_JSON + "\n" + SUBMIT_JSON),
        Message.text(Role.USER, "Find the failing test."),
        Message.text(Role.ASSISTANT, '{"tool": "search", "q": "test"}'),
        Message.text(Role.USER, "Observation:\n3 hits"),
        Message.text(Role.ASSISTANT, "I am not sure."),
        Message.text(Role.ASSISTANT, '{"tool": "submit"}'),
        Message.text(Role.USER, "Observation:\naccepted"),
    )


def test_prefix_with_only_tools() -> None:
    messages = prefix(
        run_context=RUN_CONTEXT,
        injection_text=None,
        tools_text="TOOLS",
        goal_context=GOAL_CONTEXT,
    )
    assert messages == (*RUN_CONTEXT, Message.text(Role.SYSTEM, "TOOLS"), *GOAL_CONTEXT)


def test_prefix_with_only_injection() -> None:
    messages = prefix(
        run_context=(),
        injection_text="SKILL",
        tools_text=None,
        goal_context=GOAL_CONTEXT,
    )
    assert messages == (Message.text(Role.SYSTEM, "SKILL"), *GOAL_CONTEXT)


def test_prefix_keeps_injection_before_tools() -> None:
    messages = prefix(run_context=(), injection_text="I", tools_text="T", goal_context=())
    assert [m.content[0].text for m in messages] == ["I", "T"]
    assert all(m.role is Role.SYSTEM for m in messages)


# -- empty injection + no tools: byte identity --------------------------------------------


@pytest.mark.parametrize(
    "injection",
    [
        pytest.param(Injection(entries={}), id="empty-mapping"),
        pytest.param(Injection(entries={"system": ()}), id="empty-system-tuple"),
    ],
)
@pytest.mark.parametrize("style", list(ToolStyle), ids=lambda s: s.value)
def test_empty_injection_and_no_tools_is_plain_concatenation(
    injection: Injection, style: ToolStyle
) -> None:
    history = [("act 1", "obs {1}"), ("think", None), ("act 2", "ünï\u2028code")]
    messages = assemble(
        run_context=RUN_CONTEXT,
        injection=injection,
        tools=[],
        style=style,
        goal_context=GOAL_CONTEXT,
        history=history,
    )
    plain = (
        *RUN_CONTEXT,
        *GOAL_CONTEXT,
        Message.text(Role.ASSISTANT, "act 1"),
        Message.text(Role.USER, TEMPLATE.format(observation="obs {1}")),
        Message.text(Role.ASSISTANT, "think"),
        Message.text(Role.ASSISTANT, "act 2"),
        Message.text(Role.USER, TEMPLATE.format(observation="ünï\u2028code")),
    )
    assert messages == plain
    assert messages_sha256(messages) == messages_sha256(plain)
    assert dump(messages) == dump(plain)
    assert size(messages) == size(plain)


def test_empty_contexts_and_nothing_else_is_empty() -> None:
    messages = assemble(
        run_context=(),
        injection=NO_INJECTION,
        tools=[],
        style=ToolStyle.JSON,
        goal_context=(),
        history=[],
    )
    assert messages == ()
    assert messages_sha256(messages) == hashlib.sha256(b"").hexdigest()


# -- injection ----------------------------------------------------------------------------


def test_injection_entries_make_one_system_message_joined_by_blank_lines() -> None:
    injection = Injection(entries={"system": ("first", "second\nline", "third")})
    assert render_injection(injection) == "first\n\nsecond\nline\n\nthird"
    messages = prefix(
        run_context=(),
        injection_text=render_injection(injection),
        tools_text=None,
        goal_context=(),
    )
    assert messages == (Message.text(Role.SYSTEM, "first\n\nsecond\nline\n\nthird"),)


def test_single_injection_entry_is_verbatim() -> None:
    assert render_injection(Injection(entries={"system": ("only {one}",)})) == "only {one}"


@pytest.mark.parametrize(
    "entries",
    [
        pytest.param({}, id="no-channel"),
        pytest.param({"system": ()}, id="empty-system"),
        pytest.param({"memory": ("ignored",)}, id="only-unknown-channel"),
    ],
)
def test_no_system_entries_means_no_message(entries: dict[str, tuple[str, ...]]) -> None:
    assert render_injection(Injection(entries=entries)) is None


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        pytest.param({}, (), id="none"),
        pytest.param({"system": ("x",)}, (), id="system-only"),
        pytest.param({"system": (), "zeta": (), "alpha": ("a",)}, ("alpha", "zeta"), id="sorted"),
        pytest.param({"System": ("x",)}, ("System",), id="case-sensitive"),
    ],
)
def test_unknown_channels(entries: dict[str, tuple[str, ...]], expected: tuple[str, ...]) -> None:
    assert unknown_channels(Injection(entries=entries)) == expected


# -- the tool list ------------------------------------------------------------------------


def test_render_tools_json() -> None:
    assert render_tools([SEARCH, SUBMIT], ToolStyle.JSON) == SEARCH_JSON + "\n" + SUBMIT_JSON


def test_render_tools_markdown() -> None:
    assert (
        render_tools([SEARCH, SUBMIT], ToolStyle.MARKDOWN)
        == SEARCH_MARKDOWN + "\n\n" + SUBMIT_MARKDOWN
    )


@pytest.mark.parametrize("style", list(ToolStyle), ids=lambda s: s.value)
def test_render_no_tools_is_none(style: ToolStyle) -> None:
    assert render_tools([], style) is None


RENDERED_STYLES = [style for style in ToolStyle if style is not ToolStyle.NATIVE]


def test_the_native_style_renders_no_tool_list() -> None:
    """The model client sends the tools in its API's form; the prompt holds none."""
    assert render_tools([SEARCH, SUBMIT], ToolStyle.NATIVE) is None


@pytest.mark.parametrize("style", RENDERED_STYLES, ids=lambda s: s.value)
def test_render_tools_shows_only_name_description_parameters(style: ToolStyle) -> None:
    plain = {"name": "t", "description": "d", "parameters": {"type": "object"}}
    extended = {**plain, "replay": "allowed", "completes": True, "secret": "xyzzy"}
    text = render_tools([extended], style)
    assert text == render_tools([plain], style)
    assert text is not None
    for hidden in ("replay", "allowed", "completes", "secret", "xyzzy"):
        assert hidden not in text


def test_render_tools_keeps_registration_order() -> None:
    text = render_tools([SUBMIT, SEARCH], ToolStyle.JSON)
    assert text == SUBMIT_JSON + "\n" + SEARCH_JSON


# -- steps and the observation template ---------------------------------------------------


def test_step_without_observation_adds_only_the_assistant_message() -> None:
    assert step_messages("final: 42", None, TEMPLATE) == (
        Message.text(Role.ASSISTANT, "final: 42"),
    )


def test_step_with_empty_observation_still_adds_the_user_message() -> None:
    assert step_messages("a", "", "<{observation}>") == (
        Message.text(Role.ASSISTANT, "a"),
        Message.text(Role.USER, "<>"),
    )


def test_braces_in_observation_are_kept_verbatim() -> None:
    observation = '{"x": {observation}} {0} {} {{ }} %s'
    messages = step_messages("act", observation, "[{observation}]")
    assert messages[1] == Message.text(Role.USER, f"[{observation}]")


def test_template_escapes_are_applied_to_the_template_only() -> None:
    messages = step_messages("act", "{{x}}", "{{literal}} {observation}")
    assert messages[1].content[0].text == "{literal} {{x}}"


# -- size and Transcript ------------------------------------------------------------------


def test_size_sums_block_sizes() -> None:
    messages = [
        Message(role=Role.USER, content=(TextBlock(text="abc"), TextBlock(text="de"))),
        Message.text(Role.ASSISTANT, "ü\U0001f600"),  # characters, not bytes
        Message(role=Role.SYSTEM, content=()),
        Message.text(Role.USER, ""),
    ]
    assert size(messages) == 3 + 2 + 2
    assert size([]) == 0


def test_messages_sha256_is_sha_of_canonical_lines() -> None:
    messages = [Message.text(Role.USER, "hi"), Message.text(Role.ASSISTANT, "ünï")]
    lines = b"".join(canonical(message_json(m)) + b"\n" for m in messages)
    assert messages_sha256(messages) == hashlib.sha256(lines).hexdigest()
    assert canonical(message_json(messages[0])) == (
        b'{"content":[{"text":"hi","type":"text"}],"role":"user"}'
    )


def test_messages_sha256_depends_on_role_and_split() -> None:
    one = [Message.text(Role.USER, "ab")]
    assert messages_sha256(one) != messages_sha256([Message.text(Role.ASSISTANT, "ab")])
    assert messages_sha256(one) != messages_sha256(
        [Message(role=Role.USER, content=(TextBlock(text="a"), TextBlock(text="b")))]
    )
    assert messages_sha256(one) != messages_sha256(
        [Message.text(Role.USER, "a"), Message.text(Role.USER, "b")]
    )


def test_transcript_messages_is_a_snapshot() -> None:
    transcript = Transcript([Message.text(Role.USER, "a")])
    before = transcript.messages
    transcript.extend([Message.text(Role.USER, "b")])
    assert before == (Message.text(Role.USER, "a"),)
    assert len(transcript.messages) == 2
    assert transcript.size == 2


def test_empty_transcript() -> None:
    transcript = Transcript()
    assert transcript.messages == ()
    assert transcript.size == 0
    assert transcript.sha256() == messages_sha256([])


# Any code point: ASCII, control characters, non-ASCII and lone surrogates (which the
# default character strategy leaves out).
characters = st.one_of(
    st.characters(max_codepoint=0x7F),
    st.characters(),
    st.characters(categories=["Cs"]),
)
texts = st.text(alphabet=characters, max_size=30)
blocks = st.builds(TextBlock, text=texts)
message_lists = st.lists(
    st.builds(
        Message,
        role=st.sampled_from(Role),
        content=st.lists(blocks, max_size=3).map(tuple),
    ),
    max_size=12,
)


@given(message_lists, st.lists(st.integers(0, 12), max_size=5))
def test_transcript_matches_full_list(messages: list[Message], cuts: list[int]) -> None:
    transcript = Transcript()
    start = 0
    for cut in sorted(min(c, len(messages)) for c in cuts):
        transcript.extend(messages[start:cut])
        assert transcript.messages == tuple(messages[:cut])
        assert transcript.sha256() == messages_sha256(messages[:cut])
        start = cut
    transcript.extend(messages[start:])
    assert transcript.messages == tuple(messages)
    assert transcript.size == size(messages)
    assert transcript.size == sum(len(b.text) for m in messages for b in m.content)
    assert transcript.sha256() == messages_sha256(messages)
    # sha256() does not consume the digest.
    assert transcript.sha256() == transcript.sha256()


@given(message_lists, message_lists)
def test_transcript_built_at_once_equals_built_in_chunks(
    first: list[Message], second: list[Message]
) -> None:
    chunked = Transcript(first)
    chunked.extend(iter(second))  # any iterable, consumed once
    whole = Transcript([*first, *second])
    assert chunked.messages == whole.messages
    assert chunked.size == whole.size
    assert chunked.sha256() == whole.sha256()


def test_lone_surrogates_are_hashed_not_refused() -> None:
    lone = [Message.text(Role.USER, "a\ud800b")]
    transcript = Transcript(lone)
    assert transcript.sha256() == messages_sha256(lone)
    assert transcript.sha256() != messages_sha256([Message.text(Role.USER, "a\udc00b")])
    assert transcript.size == 3


# The digest is written into every model-call intent: it must never change for the same
# messages, however it is computed. Pinned from the first release's implementation.
PINNED_MESSAGES = [
    Message.text(Role.SYSTEM, "You are a benchmark agent."),
    Message.text(Role.USER, 'Call "the" tool\nü\u2028\ud800'),
    Message(role=Role.ASSISTANT, content=(TextBlock(text="a"), TextBlock(text="b"))),
    Message(role=Role.USER, content=()),
]
PINNED_SHA256 = "a3c8d45a6a46d1fb1c3a9bfa358a0f93a8c1160c39a370d0df0720c3c35e263f"


def test_transcript_digest_is_pinned() -> None:
    assert Transcript(PINNED_MESSAGES).sha256() == PINNED_SHA256
    assert messages_sha256(PINNED_MESSAGES) == PINNED_SHA256


def test_messages_of_unexpected_shapes_are_hashed_as_before() -> None:
    listed = Message(role=Role.USER, content=[TextBlock(text="x")])  # type: ignore[arg-type]
    assert Transcript([listed]).sha256() == messages_sha256([listed])
    with pytest.raises(AttributeError):  # a role without .value is refused, as ever
        Transcript([Message(role="user", content=(TextBlock(text="x"),))])  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # and so is a text without a length
        Transcript([Message(role=Role.USER, content=(TextBlock(text=7),))])  # type: ignore[arg-type]
