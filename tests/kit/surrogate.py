"""Runs holding lone surrogates, and standard streams as strict as a real terminal's.

A model reply ``{"answer": "done \\ud83d"}`` (half an emoji as a JSON escape) decodes to
a string with a lone surrogate; the kernel records it and reads it back on every store.
The command must show such strings without failing to encode them. pytest's own
capture replaces what it cannot encode, which would hide the failure, so
:class:`StrictOutput` gives the command UTF-8 streams that refuse it, as a terminal or
a pipe does.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import anyio.lowlevel
import pytest

from kit.agent import ANSWER_SCHEMA, Ledger, definition, make_tools, request, tool_call
from polyloop import ToolRegistry, ToolSpec, run

HALF = "\ud83d"
# The reply as the server sent it: the surrogate is a JSON escape, the text is ASCII.
HALF_ANSWER = '{"answer": "done \\ud83d"}'
RUN_ID = f"id {HALF}"
# What the command prints for a string holding the surrogate.
SHOWN = "\\ud83d"


class StrictOutput:
    """Standard output and error that refuse what UTF-8 cannot encode.

    Made in the test's body: pytest sets its own streams again once setup is over.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._out = _strict_stream()
        self._err = _strict_stream()
        monkeypatch.setattr(sys, "stdout", self._out)
        monkeypatch.setattr(sys, "stderr", self._err)

    def read(self) -> tuple[str, str]:
        """What was written to each stream since the last read, decoded strictly."""
        return _take(self._out), _take(self._err)


def _strict_stream() -> io.TextIOWrapper:
    return io.TextIOWrapper(
        io.BytesIO(), encoding="utf-8", errors="strict", newline="", write_through=True
    )


def _take(stream: io.TextIOWrapper) -> str:
    buffer = stream.buffer
    assert isinstance(buffer, io.BytesIO)
    data = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return data.decode("utf-8")


def send_tools(ledger: Ledger) -> ToolRegistry:
    """``send``, which needs approval and takes any text, and ``submit``."""

    async def send(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("send", result_id))
        await anyio.lowlevel.checkpoint()
        return "sent"

    tools = make_tools(ledger)
    spec = ToolSpec(
        name="send",
        description="Send a message.",
        parameters=ANSWER_SCHEMA,
        handler=send,
        needs_approval=True,
    )
    kept = [known for name in tools.names if (known := tools.get(name)) is not None]
    return ToolRegistry([*kept, spec], max_observation_chars=10_000)


async def fill(store: Any) -> None:
    """``half`` answered with a lone surrogate; the run :data:`RUN_ID` holds one in its id;
    ``ask`` waits for approval of a call whose argument holds one."""
    async with store:
        tools = send_tools(Ledger())
        await run(definition(store, script=[HALF_ANSWER]), request("half", tools))
        await run(definition(store, script=['{"answer": "ok"}']), request(RUN_ID, tools))
        script = [tool_call("send", answer=f"hi {HALF}")]
        await run(definition(store, script=script), request("ask", tools))
