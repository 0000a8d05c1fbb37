"""Native tool calls for tests: scripted replies that call tools through the API's form."""

from __future__ import annotations

import hashlib
from typing import Any

from polyloop import ModelCall, ModelReply, ToolCallBlock, ToolStyle
from polyloop._assembly import messages_sha256
from polyloop.interpreters import NativeToolCallInterpreter
from polyloop.testing import ScriptedModelClient


def call(name: str, call_id: str | None = None, text: str = "", **arguments: Any) -> ModelReply:
    """A reply making one native tool call (``text`` beside it)."""
    block = ToolCallBlock(call_id=call_id or f"call-{name}", name=name, arguments=arguments)
    return ModelReply(call_id=None, content=text, reasoning=None, tool_calls=(block,))


def native_script() -> list[ModelReply]:
    """The five-step run of the agent kit, in native tool calls: two doublings (one with
    arguments the schema refuses), a reply with no call, a doubling and a submit."""
    return [
        call("double", "c0", n=1),
        call("double", "c1", text="Trying a word.", n="two"),
        ModelReply(call_id=None, content="", reasoning=None),
        call("double", "c3", n=3),
        call("submit", "c4", answer="6"),
    ]


class HashingModel(ScriptedModelClient):
    """A scripted model that keeps the digest of the messages of every call."""

    def __init__(self, script: list[ModelReply]) -> None:
        super().__init__(script)
        self.digests: list[str] = []
        self.tool_lists: list[tuple[Any, ...]] = []

    async def call(self, call: ModelCall) -> ModelReply:
        self.digests.append(messages_sha256(call.messages))
        self.tool_lists.append(call.tools)
        return await super().call(call)


NATIVE = {"tool_style": ToolStyle.NATIVE}
INTERPRETER = NativeToolCallInterpreter(answer_in_text=False)


def digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()
