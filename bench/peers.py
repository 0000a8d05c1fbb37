"""The same loop in LangGraph and in Pydantic AI, for comparison in the same process run.

Both peers get the same script as PolyLoop: ``steps`` model decisions, a call to a no-op
tool on each but the last, then a final text. No network, no real model. Counters in
the model function and in the tool prove that each peer really made as many decisions
and tool calls as PolyLoop did.

LangGraph: a ``StateGraph`` over ``MessagesState`` with a model node (it returns an
``AIMessage`` carrying a tool call, or the final text) and the prebuilt ``ToolNode``,
joined by ``tools_condition`` so that the graph loops until the model stops calling the
tool. It is driven with the synchronous ``invoke``, its fastest path (nodes run inline,
no event loop in between). Variants: no checkpointer, ``InMemorySaver``, and
``SqliteSaver`` on a file (with LangGraph's default durability, which writes
checkpoints in the background, and with ``durability="sync"``, which waits for each).

Pydantic AI: ``Agent(FunctionModel(fn))`` with one trivial ``async`` tool; ``fn`` is an
``async`` function that suspends once (like PolyLoop's instant model) and returns a
``ToolCallPart`` or, on the last turn, a ``TextPart``. Driven with ``agent.run(...)``
with the request limit raised above the number of steps.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import anyio.lowlevel

from bench._common import RunStats, missing, now
from bench.agents import Counter


def langgraph_missing() -> str | None:
    return missing("langgraph") or missing("langgraph.prebuilt")


def langgraph_sqlite_missing() -> str | None:
    return langgraph_missing() or missing("langgraph.checkpoint.sqlite")


def pydantic_ai_missing() -> str | None:
    return missing("pydantic_ai")


class LangGraphLoop:
    """A compiled model-node + tool-node graph; ``checkpointer`` is ``none``, ``memory``
    or ``sqlite`` (a database file at ``path``)."""

    def __init__(
        self, checkpointer: str, *, path: Path | None = None, durability: str | None = None
    ) -> None:
        from langchain_core.messages import AIMessage
        from langchain_core.tools import tool
        from langgraph.graph import START, MessagesState, StateGraph
        from langgraph.prebuilt import ToolNode, tools_condition

        self.decisions = Counter()
        self.executions = Counter()
        self.durability = durability
        self._turn = 0
        self._steps = 0
        self._connection: sqlite3.Connection | None = None
        executions = self.executions

        @tool
        def noop() -> str:
            """Do nothing."""
            executions.n += 1
            return "ok"

        def model(state: MessagesState) -> dict[str, Any]:
            self.decisions.n += 1
            turn, self._turn = self._turn, self._turn + 1
            if turn >= self._steps - 1:
                return {"messages": [AIMessage(content="done")]}
            call = {"name": "noop", "args": {}, "id": f"call-{turn}", "type": "tool_call"}
            return {"messages": [AIMessage(content="", tool_calls=[call])]}

        graph = StateGraph(MessagesState)
        graph.add_node("model", model)
        graph.add_node("tools", ToolNode([noop]))
        graph.add_edge(START, "model")
        graph.add_conditional_edges("model", tools_condition)
        graph.add_edge("tools", "model")
        self.graph = graph.compile(checkpointer=self._checkpointer(checkpointer, path))

    def _checkpointer(self, kind: str, path: Path | None) -> Any:
        if kind == "none":
            return None
        if kind == "memory":
            from langgraph.checkpoint.memory import InMemorySaver

            return InMemorySaver()
        if kind == "sqlite":
            from langgraph.checkpoint.sqlite import SqliteSaver

            if path is None:
                raise ValueError("the SQLite checkpointer needs a file")
            self._connection = sqlite3.connect(path, check_same_thread=False)
            return SqliteSaver(self._connection)
        raise ValueError(f"unknown checkpointer {kind!r}")

    def run(self, thread_id: str, steps: int) -> RunStats:
        from langchain_core.messages import HumanMessage

        self._turn, self._steps = 0, steps
        decisions, executions = self.decisions.n, self.executions.n
        config: Any = {"recursion_limit": 4 * steps + 10, "configurable": {"thread_id": thread_id}}
        extra: Any = {"durability": self.durability} if self.durability else {}
        graph: Any = self.graph
        began = now()
        state = graph.invoke({"messages": [HumanMessage(content="go")]}, config, **extra)
        seconds = now() - began
        if state["messages"][-1].content != "done":
            raise AssertionError("the LangGraph run did not end with the final text")
        return RunStats(seconds, self.decisions.n - decisions, self.executions.n - executions)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class PydanticAILoop:
    """``Agent(FunctionModel(...))`` with one trivial tool."""

    def __init__(self) -> None:
        from pydantic_ai import Agent
        from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
        from pydantic_ai.models.function import AgentInfo, FunctionModel

        self.decisions = Counter()
        self.executions = Counter()
        self._turn = 0
        self._steps = 0

        async def decide(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            self.decisions.n += 1
            turn, self._turn = self._turn, self._turn + 1
            await anyio.lowlevel.checkpoint()
            if turn >= self._steps - 1:
                return ModelResponse(parts=[TextPart("done")])
            return ModelResponse(
                parts=[ToolCallPart(tool_name="noop", args={}, tool_call_id=f"call-{turn}")]
            )

        self.agent: Any = Agent(FunctionModel(decide))
        executions = self.executions

        @self.agent.tool_plain
        async def noop() -> str:
            """Do nothing."""
            executions.n += 1
            return "ok"

    async def run(self, steps: int) -> RunStats:
        from pydantic_ai.usage import UsageLimits

        self._turn, self._steps = 0, steps
        decisions, executions = self.decisions.n, self.executions.n
        limits = UsageLimits(request_limit=steps + 10, tool_calls_limit=None)
        began = now()
        result = await self.agent.run("go", usage_limits=limits)
        seconds = now() - began
        if result.output != "done":
            raise AssertionError("the Pydantic AI run did not end with the final text")
        return RunStats(seconds, self.decisions.n - decisions, self.executions.n - executions)
