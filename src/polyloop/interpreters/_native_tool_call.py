"""The native tool-call action language: the model calls tools through its API."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from polyloop._shared import call_text
from polyloop._strict_json import NotJsonNumber, refuse_constant
from polyloop.ports import (
    Action,
    Decision,
    FinalAnswer,
    InvalidDecision,
    ModelReply,
    reject_incomplete,
)
from polyloop.types import FinishReason, JSONValue

_NAMES_SHOWN = 5
_TOO_LARGE = "hold a number too large or nesting too deep to use"


@dataclass(frozen=True, slots=True, kw_only=True)
class NativeToolCallInterpreter:
    """Reads the native tool calls of a reply, for runs with ``ToolStyle.NATIVE``.

    The action language is the model API's own: the model client hands the tools to the
    API and returns the calls it made in :attr:`~polyloop.ModelReply.tool_calls`.

    * One tool call is an :class:`~polyloop.Action` with the payload ``{"name": NAME,
      "arguments": {...}}`` (what :meth:`polyloop.ToolRegistry.executor` runs); text
      beside the call is kept in the history as the model wrote it. The action carries
      the call, so the history holds it as a tool-call block and the observation as
      the call's result.
    * More than one call is refused (one action per step): nothing runs, and the
      feedback names the calls and asks for one.
    * A call whose arguments are not a JSON object (text the client could not parse,
      or another JSON value, or a value the run's log cannot carry, such as ``1e400``) is
      refused with the reason, and so is a call without a tool name.
    * A reply that ended as a tool call (:attr:`~polyloop.FinishReason.TOOL_CALLS`) but
      carries none is refused: its text is the preamble to a call that did not arrive.
    * A reply without a tool call is a :class:`~polyloop.FinalAnswer` holding its text
      when ``answer_in_text`` is true (the default, as the model APIs mean it); with
      ``answer_in_text=False`` the task ends only through a tool (one marked
      ``completes``, say), and a reply without a call is refused. An empty reply is
      refused either way.

    A reply that did not end normally (cut off, filtered, refused) is never read: see
    :func:`polyloop.reject_incomplete`.
    """

    answer_in_text: bool = True

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "native-tool-call", "version": 1, "answer_in_text": self.answer_in_text}

    def interpret(self, reply: ModelReply) -> Decision:
        if (rejected := reject_incomplete(reply)) is not None:
            return rejected
        calls = reply.tool_calls
        if len(calls) > 1:
            names = ", ".join(call.name or "(no name)" for call in calls[:_NAMES_SHOWN])
            more = f" and {len(calls) - _NAMES_SHOWN} more" if len(calls) > _NAMES_SHOWN else ""
            return self._refuse(
                reply,
                f"You called {len(calls)} tools at once ({names}{more}); nothing was run. "
                "Call one tool per step.",
            )
        if not calls:
            return self._without_call(reply)
        call = calls[0]
        if not call.name:
            return self._refuse(reply, "Your tool call names no tool; nothing was run.")
        if not isinstance(call.arguments, dict):
            return self._refuse(reply, _bad_arguments(call.name, call.arguments))
        return Action(
            payload={"name": call.name, "arguments": call.arguments},
            action_text=call_text(call.name, call.arguments),
            history_text=reply.content,
            tool_call=call,
        )

    def _without_call(self, reply: ModelReply) -> Decision:
        if reply.finish is FinishReason.TOOL_CALLS:
            # The server says the reply ended in a call, yet none came: its text is only
            # the preamble to that call, not an answer.
            return self._refuse(
                reply,
                "Your reply ended as a tool call, but no call came through; nothing was run. "
                "Make the call again.",
            )
        if not reply.content.strip():
            return self._refuse(reply, "Your reply was empty. Call a tool, or answer in text.")
        if self.answer_in_text:
            return FinalAnswer(answer=reply.content, history_text=reply.content)
        return self._refuse(reply, "Your reply called no tool. Every step must call one tool.")

    @staticmethod
    def _refuse(reply: ModelReply, feedback: str) -> InvalidDecision:
        return InvalidDecision(feedback=feedback, history_text=reply.content)


def _bad_arguments(name: str, arguments: JSONValue) -> str:
    if isinstance(arguments, str):
        what = f"{_text_fault(arguments)}: {arguments[:200]!r}"
    else:
        what = f"are a JSON {type(arguments).__name__}, not an object"
    return (
        f"The arguments of your call to {name!r} {what}; nothing was run. "
        "Call the tool again with its arguments as one JSON object."
    )


def _text_fault(text: str) -> str:
    """What is wrong with arguments the client passed on as text."""
    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except (json.JSONDecodeError, NotJsonNumber):
        return "are not valid JSON"
    except (ValueError, RecursionError):  # an integer too long, nesting too deep
        return _TOO_LARGE
    if not isinstance(value, dict):
        return f"are a JSON {type(value).__name__}, not an object"
    # Parsed, yet the client passed it on as text: it holds what the log cannot carry.
    return _TOO_LARGE
