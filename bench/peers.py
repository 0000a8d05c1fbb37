"""The same loops in LangGraph and in Pydantic AI, for comparison in the same process run.

First the loop of benchmarks 1 and 2 (an instant model, a no-op tool), then the
realistic workload of benchmark 8. Counters in each model function and tool prove that
a peer made as many decisions and tool calls as PolyLoop did. How each is built:
``bench/README.md``, benchmarks 1 and 8.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio.lowlevel

from bench._common import RunStats, Variant, missing, now
from bench.agents import Counter
from bench.workload import GOAL, SUBMITTED, SYSTEM_PROMPT, Counts, decision, observation

# The peers read their tools' argument constraints from the signatures, which name
# ``Field`` as text (postponed annotations), so it must be a name of this module.
# pydantic comes with either peer; both are optional.
with contextlib.suppress(ImportError):
    from pydantic import Field


def langgraph_missing() -> str | None:
    return missing("langgraph") or missing("langgraph.prebuilt")


def langgraph_sqlite_missing() -> str | None:
    return langgraph_missing() or missing("langgraph.checkpoint.sqlite")


def pydantic_ai_missing() -> str | None:
    return missing("pydantic_ai")


def langgraph_variants(
    stack: AsyncExitStack,
    steps: int,
    loops: Sequence[tuple[str, str, str, dict[str, Any]]],
    why_not: Callable[[], str | None] = langgraph_missing,
) -> list[Variant]:
    """A peer variant per ``(key, name, checkpointer, options)`` of :class:`LangGraphLoop`,
    each graph closed with ``stack``; skipped, saying why, without LangGraph."""
    problem = why_not()
    found = []
    for key, name, checkpointer, options in loops:
        if problem is not None:
            found.append(Variant(key, name, "peer", skip=problem))
            continue
        graph = stack.enter_context(contextlib.closing(LangGraphLoop(checkpointer, **options)))
        found.append(Variant(key, name, "peer", functools.partial(graph.run, steps=steps)))
    return found


def pydantic_ai_variant(steps: int) -> Variant:
    """The Pydantic AI peer, or why it cannot run."""
    key, name, problem = "pydantic-ai", "Pydantic AI, FunctionModel", pydantic_ai_missing()
    if problem is not None:
        return Variant(key, name, "peer", skip=problem)
    agent = PydanticAILoop()
    return Variant(key, name, "peer", lambda run_id: agent.run(steps))


async def _search(counts: Counts, tool_s: float, query: str, page: int) -> str:
    """The search tool's work, the same in every peer: wait, count, answer."""
    await anyio.sleep(tool_s)
    counts.executions += 1
    return observation({"query": query, "page": page})


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

    async def run(self, thread_id: str, steps: int) -> RunStats:
        """One run, through the synchronous ``invoke`` (nodes inline, LangGraph's fastest)."""
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


# -- the realistic workload of benchmark 8 (python -m bench throughput) -------------------


def langgraph_postgres_missing() -> str | None:
    return langgraph_missing() or missing("langgraph.checkpoint.postgres")


class LangGraphWorkload:
    """Benchmark 8's workload as a LangGraph graph (a model node, the prebuilt ``ToolNode``
    with ``search`` and ``submit``, an end after ``submit``), driven with ``ainvoke``;
    LangChain checks the tools' arguments against their signatures."""

    def __init__(self, checkpointer: Any, *, steps: int, latency_s: float, tool_s: float) -> None:
        from langchain_core.messages import AIMessage
        from langchain_core.tools import tool
        from langgraph.graph import END, START, MessagesState, StateGraph
        from langgraph.prebuilt import ToolNode

        self.steps = steps
        self.counts = Counts()
        counts = self.counts

        @tool
        async def search(
            query: Annotated[str, Field(min_length=1)], page: Annotated[int, Field(ge=0)]
        ) -> str:
            """Search the corpus; one page of results."""
            return await _search(counts, tool_s, query, page)

        @tool
        async def submit(summary: str) -> str:
            """Submit the summary; ends the task."""
            await anyio.sleep(tool_s)
            counts.executions += 1
            return SUBMITTED

        # ``Any``, not ``MessagesState``: LangGraph reads these hints, and a name imported
        # here is not one it can resolve.
        async def model(state: Any) -> dict[str, Any]:
            await anyio.sleep(latency_s)
            counts.decisions += 1
            index = sum(isinstance(message, AIMessage) for message in state["messages"])
            reply = json.loads(json.dumps(decision(index, steps)))
            call = {
                "name": reply["tool"],
                "args": reply["arguments"],
                "id": f"call-{index}",
                "type": "tool_call",
            }
            return {"messages": [AIMessage(content="", tool_calls=[call])]}

        def after_tools(state: Any) -> str:
            return END if state["messages"][-1].name == "submit" else "model"

        graph = StateGraph(MessagesState)
        graph.add_node("model", model)
        graph.add_node("tools", ToolNode([search, submit]))
        graph.add_edge(START, "model")
        graph.add_edge("model", "tools")
        graph.add_conditional_edges("tools", after_tools, ["model", END])
        self.graph: Any = graph.compile(checkpointer=checkpointer)

    async def run(self, run_id: str) -> None:
        from langchain_core.messages import HumanMessage, SystemMessage

        config: Any = {
            "recursion_limit": 2 * self.steps + 10,
            "configurable": {"thread_id": run_id},
        }
        start = {"messages": [SystemMessage(content=SYSTEM_PROMPT), HumanMessage(content=GOAL)]}
        state = await self.graph.ainvoke(start, config)
        last = state["messages"][-1]
        if last.name != "submit" or last.content != SUBMITTED:
            raise AssertionError(f"the LangGraph run {run_id!r} did not end by submitting")


@asynccontextmanager
async def langgraph_workload(
    checkpointer: str, where: str, *, steps: int, latency_s: float, tool_s: float
) -> AsyncIterator[LangGraphWorkload]:
    """A :class:`LangGraphWorkload` with LangGraph's async checkpointer: ``sqlite`` (a file
    in the directory ``where``) or ``postgres`` (``where`` is ``conninfo#schema``; the
    schema is created here, and its tables by the checkpointer)."""

    def workload(saver: Any) -> LangGraphWorkload:
        return LangGraphWorkload(saver, steps=steps, latency_s=latency_s, tool_s=tool_s)

    if checkpointer == "sqlite":
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        async with AsyncSqliteSaver.from_conn_string(str(Path(where) / "graph.sqlite")) as lite:
            yield workload(lite)
        return
    if checkpointer != "postgres":
        raise ValueError(f"unknown checkpointer {checkpointer!r}")
    import psycopg
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from psycopg import sql
    from psycopg.conninfo import make_conninfo
    from psycopg.rows import dict_row
    from psycopg_pool import AsyncConnectionPool

    conninfo, _, schema = where.partition("#")
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    # The settings LangGraph's documentation gives for a pool; as many connections as
    # PostgresStore may open (4 readers, 8 writers, its owner).
    pool: Any = AsyncConnectionPool(
        make_conninfo(conninfo, options=f"-c search_path={schema}"),
        min_size=1,
        max_size=13,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    async with pool:
        saver = AsyncPostgresSaver(pool)
        await saver.setup()
        yield workload(saver)


class PydanticAIWorkload:
    """Benchmark 8's workload as a Pydantic AI agent, in memory (it has no durable store):
    ``search`` is a tool and ``submit`` the output function, so calling it ends the run."""

    def __init__(self, *, steps: int, latency_s: float, tool_s: float) -> None:
        from pydantic_ai import Agent, ToolOutput
        from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart
        from pydantic_ai.models.function import AgentInfo, FunctionModel
        from pydantic_ai.usage import RequestUsage

        self.steps = steps
        self.counts = Counts()
        counts = self.counts

        async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            await anyio.sleep(latency_s)
            counts.decisions += 1
            index = sum(isinstance(message, ModelResponse) for message in messages)
            reply = decision(index, steps)
            call = ToolCallPart(
                tool_name=reply["tool"],
                args=json.dumps(reply["arguments"]),
                tool_call_id=f"call-{index}",
            )
            # With usage, as a provider's reply carries it: without, FunctionModel would
            # estimate it by splitting the whole transcript into words on every call,
            # a cost of the test model that no real client has.
            return ModelResponse(parts=[call], usage=RequestUsage(input_tokens=1, output_tokens=1))

        async def submit(summary: str) -> str:
            """Submit the summary; ends the task."""
            await anyio.sleep(tool_s)
            counts.executions += 1
            return SUBMITTED

        self.agent: Any = Agent(
            FunctionModel(model),
            output_type=ToolOutput(submit, name="submit"),
            instructions=SYSTEM_PROMPT,
        )

        @self.agent.tool_plain
        async def search(
            query: Annotated[str, Field(min_length=1)], page: Annotated[int, Field(ge=0)]
        ) -> str:
            """Search the corpus; one page of results."""
            return await _search(counts, tool_s, query, page)

    async def run(self, run_id: str) -> None:
        from pydantic_ai.usage import UsageLimits

        limits = UsageLimits(request_limit=self.steps + 10, tool_calls_limit=None)
        result = await self.agent.run(GOAL, usage_limits=limits)
        if result.output != SUBMITTED:
            raise AssertionError(f"the Pydantic AI run {run_id!r} did not end by submitting")
