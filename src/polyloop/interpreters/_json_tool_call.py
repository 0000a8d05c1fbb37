"""The JSON tool-call action language: one JSON object per reply.

Read by :func:`polyloop._json_decisions.read_exactly`, which the test double and the
demo agent share in their looser readings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polyloop._json_decisions import read_exactly
from polyloop.ports import Decision, ModelReply
from polyloop.types import JSONValue


@dataclass(frozen=True, slots=True, kw_only=True)
class JsonToolCallInterpreter:
    """Reads a decision written as one JSON object.

    The action language:

    * ``{"tool": NAME, "arguments": {...}}`` calls the tool ``NAME``: an
      :class:`~polyloop.Action` whose payload is ``{"name": NAME, "arguments": {...}}``,
      the shape :meth:`polyloop.ToolRegistry.executor` runs. ``"arguments"`` may be left
      out for a tool that takes none (it is then ``{}``).
    * ``{"answer": TEXT}`` answers: a :class:`~polyloop.FinalAnswer`.
    * The object stands alone in the reply (whitespace around it is fine), or it is the
      whole content of the reply's one fenced code block, tagged ``json`` or untagged;
      text before and after that block is allowed and ignored, so the model may explain
      itself. Text around an object that is *not* in a block is refused: without the
      fence it is guesswork where the object starts and ends.
    * Nothing else is accepted: keys other than those above, a key named twice in one
      object (anywhere, the arguments included), a second object, a second block, a
      block in another language, an unclosed block. Each is an
      :class:`~polyloop.InvalidDecision` whose feedback names the fault (with the line
      and column of the reply where there is one) and restates the format.

    A reply that did not end normally (cut off, filtered, refused) is never read: see
    :func:`polyloop.reject_incomplete`.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        """``{"kind": "json-tool-call", "version": 1}``: this language has no settings."""
        return {"kind": "json-tool-call", "version": 1}

    def interpret(self, reply: ModelReply) -> Decision:
        """The action, answer or correction that ``reply`` amounts to."""
        return read_exactly(reply)
