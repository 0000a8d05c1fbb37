"""Every interpreter PolyLoop ships keeps the interpreter contract, the command line's too."""

from __future__ import annotations

import pytest

from polyloop import Interpreter, ModelReply, ToolCallBlock
from polyloop.cli._agent import TextToolInterpreter
from polyloop.interpreters import (
    CodeBlockInterpreter,
    JsonToolCallInterpreter,
    NativeToolCallInterpreter,
)
from polyloop.testing import JsonActionInterpreter
from polyloop.testing.interpreter_contract import InterpreterContract


def replies(*texts: str) -> list[ModelReply]:
    return [ModelReply(call_id=None, content=text, reasoning=None) for text in texts]


TOOL_CALL = '{"tool": "search", "arguments": {"query": "anyio", "limit": 3}}'


class TestJsonToolCallInterpreter(InterpreterContract):
    @pytest.fixture
    def interpreter(self) -> Interpreter:
        return JsonToolCallInterpreter()

    @pytest.fixture
    def valid_replies(self) -> list[ModelReply]:
        return replies(TOOL_CALL, f"I will search.\n```json\n{TOOL_CALL}\n```")


class TestCodeBlockInterpreter(InterpreterContract):
    @pytest.fixture
    def interpreter(self) -> Interpreter:
        return CodeBlockInterpreter(aliases=("py",), final_marker="FINAL ANSWER:")

    @pytest.fixture
    def valid_replies(self) -> list[ModelReply]:
        return replies("```python\nprint(1 + 1)\n```", "Let me look.\n```py\nimport os\n```\n")


class TestJsonActionInterpreter(InterpreterContract):
    @pytest.fixture
    def interpreter(self) -> Interpreter:
        return JsonActionInterpreter()

    @pytest.fixture
    def valid_replies(self) -> list[ModelReply]:
        return replies(TOOL_CALL)


class TestTextToolInterpreter(InterpreterContract):
    @pytest.fixture
    def interpreter(self) -> Interpreter:
        return TextToolInterpreter()

    @pytest.fixture
    def valid_replies(self) -> list[ModelReply]:
        return replies(
            TOOL_CALL, f"Reading the files.\n```json\n{TOOL_CALL}\n```", f"x {TOOL_CALL}"
        )


class TestNativeToolCallInterpreter(InterpreterContract):
    @pytest.fixture
    def interpreter(self) -> Interpreter:
        return NativeToolCallInterpreter()

    @pytest.fixture
    def valid_replies(self) -> list[ModelReply]:
        search = ToolCallBlock(call_id="c1", name="search", arguments={"query": "anyio"})
        return [
            ModelReply(call_id=None, content="", reasoning=None, tool_calls=(search,)),
            ModelReply(call_id="x", content="Looking.", reasoning=None, tool_calls=(search,)),
        ]
