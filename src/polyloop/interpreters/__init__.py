"""Ready-made interpreters, each implementing one action language. Name one explicitly.

There is no default interpreter: the action language (how a model's reply says what to
do) belongs to the agent, so :class:`~polyloop.Definition` always names its interpreter.
These are ready to name:

* :class:`JsonToolCallInterpreter`: one JSON object per reply, ``{"tool": NAME,
  "arguments": {...}}`` or ``{"answer": TEXT}``, alone or inside one fenced ``json``
  block; its actions are what :meth:`polyloop.ToolRegistry.executor` runs.
* :class:`CodeBlockInterpreter`: one fenced code block per reply (``python`` unless
  configured otherwise), for agents that act by writing code; its actions carry
  ``{"code": TEXT}`` for an executor of your own.
* :class:`NativeToolCallInterpreter`: the tool calls of the model API itself, for
  requests with ``ToolStyle.NATIVE``; its actions are what the registry's executor runs.

All are pure, synchronous and immutable, never act on a reply that did not end
normally (:func:`polyloop.reject_incomplete`), and tell the model precisely what was
wrong with a reply they cannot use.
"""

from polyloop.interpreters._code_block import CodeBlockInterpreter
from polyloop.interpreters._json_tool_call import JsonToolCallInterpreter
from polyloop.interpreters._native_tool_call import NativeToolCallInterpreter

__all__ = ("CodeBlockInterpreter", "JsonToolCallInterpreter", "NativeToolCallInterpreter")


def _claim_public_home() -> None:
    # Defined in private modules to keep each language in its own file; their public
    # home is here, and reprs, pickles and docs should say so.
    for cls in (CodeBlockInterpreter, JsonToolCallInterpreter, NativeToolCallInterpreter):
        cls.__module__ = __name__


_claim_public_home()
