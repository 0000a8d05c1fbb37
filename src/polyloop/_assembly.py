"""Context assembly: the order of the segments, the injection slot, the size metric.

The messages of a model call are, in this order: the run context; one system message
with the injected entries (only if there is one); one system message with the tool list
(only if there are tools and the tool style renders them); the goal context; then, per
finished step, the assistant's history text and, if the step produced one, the
observation wrapped in the template. A step that answered a native tool call keeps the
call as a block of the assistant message and its observation as the call's result.

With nothing injected and no tools the result is exactly ``run_context + goal_context +
history``: an experiment's baseline must not change because an empty slot exists.

:class:`Transcript` keeps the message list, its size and its digest up to date one step
at a time, so the work per step does not grow with the length of the history beyond
copying the list that the model call needs anyway.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from polyloop._shared import canonical_json
from polyloop.types import (
    ContentBlock,
    Injection,
    JSONValue,
    Message,
    Role,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    ToolStyle,
)

SYSTEM_CHANNEL = "system"


def render_injection(injection: Injection) -> str | None:
    """The text of the injection message, or ``None`` when nothing is injected."""
    entries = injection.entries.get(SYSTEM_CHANNEL, ())
    return "\n\n".join(entries) if entries else None


def unknown_channels(injection: Injection) -> tuple[str, ...]:
    """Channels that nothing reads today (sorted); entries there would be lost silently."""
    return tuple(sorted(key for key in injection.entries if key != SYSTEM_CHANNEL))


def render_tools(tools: Sequence[Mapping[str, Any]], style: ToolStyle) -> str | None:
    """The text of the tool-list message, or ``None`` when there is none to show.

    Only what the model needs is shown: name, description and the parameter schema. The
    native style shows nothing: the model client sends the tools in its API's form.
    """
    if not tools or style is ToolStyle.NATIVE:
        return None
    if style is ToolStyle.JSON:
        return "\n".join(
            canonical_json(
                {
                    "name": tool["name"],
                    "description": tool["description"],
                    "parameters": tool["parameters"],
                }
            )
            for tool in tools
        )
    return "\n\n".join(
        f"## {tool['name']}\n\n{tool['description']}\n\n"
        f"```json\n{_indented(tool['parameters'])}\n```"
        for tool in tools
    )


def prefix(
    *,
    run_context: Sequence[Message],
    injection_text: str | None,
    tools_text: str | None,
    goal_context: Sequence[Message],
) -> tuple[Message, ...]:
    """The messages that come before the history, in their fixed order."""
    slots = [
        Message.text(Role.SYSTEM, text) for text in (injection_text, tools_text) if text is not None
    ]
    return (*run_context, *slots, *goal_context)


def step_messages(
    history_text: str,
    observation: str | None,
    template: str,
    tool_call: ToolCallBlock | None = None,
) -> tuple[Message, ...]:
    """The messages one finished step adds to the history.

    With a native ``tool_call``, the assistant message holds the call after its text (no
    text block when the text is empty, as APIs send such a reply), and the observation
    answers the call as its result.
    """
    if tool_call is None:
        said: tuple[ContentBlock, ...] = (TextBlock(text=history_text),)
    else:
        said = (TextBlock(text=history_text), tool_call) if history_text else (tool_call,)
    spoken = Message(role=Role.ASSISTANT, content=said)
    if observation is None:
        return (spoken,)
    seen = template.format(observation=observation)
    answer: ContentBlock = (
        TextBlock(text=seen)
        if tool_call is None
        else ToolResultBlock(call_id=tool_call.call_id, text=seen)
    )
    return (spoken, Message(role=Role.USER, content=(answer,)))


def size(messages: Iterable[Message]) -> int:
    """The context-size metric: the sum of the sizes of every block of every message."""
    return sum(block.size() for message in messages for block in message.content)


def canonical(value: JSONValue) -> bytes:
    """Canonical JSON bytes of ``value``: what identity hashes are computed over."""
    # Lone surrogates are hashed, not refused: the hash must not fail on any text.
    return canonical_json(value).encode("utf-8", "surrogatepass")


def message_json(message: Message) -> JSONValue:
    """A message as plain JSON (role and typed blocks)."""
    return {"role": message.role.value, "content": [block_json(b) for b in message.content]}


def block_json(block: ContentBlock) -> JSONValue:
    """A content block as plain JSON, tagged with its type."""
    if isinstance(block, ToolCallBlock):
        return {
            "type": "tool_call",
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.arguments,
        }
    if isinstance(block, ToolResultBlock):
        return {"type": "tool_result", "call_id": block.call_id, "text": block.text}
    return {"type": "text", "text": block.text}


def messages_sha256(messages: Iterable[Message]) -> str:
    """The sha256 of a message sequence, as :class:`Transcript` computes it."""
    digest = hashlib.sha256()
    for message in messages:
        _digest_line(digest.update, message)
    return digest.hexdigest()


def _digest_line(update: Callable[[bytes], object], message: Message) -> None:
    """Feed a digest (its ``update``) the message's line: its canonical JSON and a line
    break, in two parts, so that a long observation is not copied again to join them."""
    update(canonical(message_json(message)))
    update(b"\n")


class Transcript:
    """The growing message list of one run, with its size and digest kept current."""

    __slots__ = ("_digest", "_messages", "_size")

    def __init__(self, messages: Iterable[Message] = ()) -> None:
        self._messages: list[Message] = []
        self._size = 0
        self._digest = hashlib.sha256()
        self.extend(messages)

    def extend(self, messages: Iterable[Message]) -> None:
        """Append messages, updating size and digest with the new ones only."""
        for message in messages:
            self._messages.append(message)
            for block in message.content:
                self._size += block.size()
            _digest_line(self._digest.update, message)

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    @property
    def size(self) -> int:
        return self._size

    def sha256(self) -> str:
        """Equal to :func:`messages_sha256` of :attr:`messages`."""
        return self._digest.copy().hexdigest()


def _indented(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ": "), indent=2)
