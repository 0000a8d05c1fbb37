"""Tools from an MCP server, mounted in a registry and run durably.

What it shows
    * a tiny Model Context Protocol server, built with the official SDK's ``MCPServer``
      (the same file started with ``--serve``), reached over stdio;
    * ``mcp_tools(session, trusted=True, overrides=...)``: the server's read-only tool
      may be called again after a crash, its ``submit`` tool may not and ends the task;
    * the result id PolyLoop allocates for each call reaching the server in the
      request's ``_meta``, where a server can use it as an idempotency key;
    * a durable run on a SQLite file; the session is opened around the run and closed
      after it, by the caller.

How to run it (needs ``pip install -e ".[mcp,trio]"``)::

    python examples/mcp_tools.py                    # asyncio
    python examples/mcp_tools.py --backend trio
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import anyio
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

from polyloop import (
    Budget,
    Definition,
    Injection,
    JSONValue,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    ToolRegistry,
    ToolStyle,
    run,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.mcp import RESULT_ID_META_KEY, ToolOverride, mcp_tools
from polyloop.stores import SqliteStore
from polyloop.testing import ScriptedModelClient


def serve() -> None:
    """The MCP server: what a third party would ship."""
    server = MCPServer("calculator", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def multiply(a: int, b: int) -> str:
        """Multiply two integers."""
        return str(a * b)

    @server.tool(annotations=ToolAnnotations(destructive_hint=True))
    def submit(answer: int, ctx: Context) -> str:
        """Submit the final answer. Ends the task."""
        key = (ctx.request_context.meta or {}).get(RESULT_ID_META_KEY)
        return f"accepted {answer} (idempotency key {key})"

    server.run("stdio")


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


SCRIPT = [_call("multiply", a=7, b=24), _call("submit", answer=168)]


async def main(database: Path) -> None:
    server = StdioServerParameters(command=sys.executable, args=[__file__, "--serve"])
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        # Our own server, so its annotations are trusted; submit ends the task.
        specs = await mcp_tools(
            session, trusted=True, overrides={"submit": ToolOverride(completes=True)}
        )
        tools = ToolRegistry(specs, max_observation_chars=2_000)
        for spec in specs:
            ends = ", completes" if spec.completes else ""
            print(f"mounted {spec.name}: replay {spec.replay.value}{ends}")

        async with SqliteStore(database) as store:
            result = await run(
                Definition(
                    model=ScriptedModelClient(SCRIPT),
                    interpreter=JsonToolCallInterpreter(),
                    store=store,
                    events=NullSink(),
                    texts=ObservationTexts(
                        not_executed="Refused: {reason}", env_fault="Failed: {detail}"
                    ),
                ),
                Request(
                    run_id="mcp-demo",
                    budget=Budget(max_steps=5, max_valid_steps=5, max_context_chars=50_000),
                    executor=tools.executor(),
                    tools=tools,
                    run_context=(Message.text(Role.SYSTEM, "You are a careful calculator."),),
                    goal_context=(Message.text(Role.USER, "What is 7 times 24? Submit it."),),
                    injection=Injection(entries={}),
                    binding={},
                    model_replay=Replay.NEVER,
                    observation_template="Observation: {observation}",
                    tool_style=ToolStyle.JSON,
                    cancel_grace_s=5.0,
                ),
            )
    for step in result.steps:
        print(f"  step {step.step}: {step.action_text} -> {step.observation}")
    print(f"stop reason: {result.stop_reason.value} after {result.step_count} steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--serve", action="store_true", help="be the MCP server (stdio)")
    args = parser.parse_args()
    if args.serve:
        serve()
    else:
        with tempfile.TemporaryDirectory() as folder:
            anyio.run(main, Path(folder) / "runs.db", backend=args.backend)
