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

Both are pure, synchronous and immutable, never act on a reply that did not end
normally (:func:`polyloop.reject_incomplete`), and tell the model precisely what was
wrong with a reply they cannot use. An interpreter for the native tool calls of model
APIs is planned; it needs native tool calls in the kernel first.
"""

from polyloop.interpreters._code_block import CodeBlockInterpreter
from polyloop.interpreters._json_tool_call import JsonToolCallInterpreter

__all__ = ("CodeBlockInterpreter", "JsonToolCallInterpreter")


def _claim_public_home() -> None:
    # Defined in private modules to keep each language in its own file; their public
    # home is here, and reprs, pickles and docs should say so.
    for cls in (CodeBlockInterpreter, JsonToolCallInterpreter):
        cls.__module__ = __name__


_claim_public_home()
