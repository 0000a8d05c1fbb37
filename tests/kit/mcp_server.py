"""A real MCP server for the tests, built on the SDK's own server API.

Run as a script: ``python tests/kit/mcp_server.py --transport stdio|http --record FILE``.
Over HTTP it binds an ephemeral port on 127.0.0.1 and prints ``port N`` on stdout once
it listens. Every call is appended to the record file as one JSON line, with the
PolyLoop result id it found in the request's ``_meta``, so a test can tell what the
server received, how often, and whether a call was cancelled.

``--changed schema`` serves ``lookup`` with another input schema, ``--changed
annotations`` serves ``put`` with other annotations: a server upgraded between a crash
and the resume.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import (
    AudioContent,
    BlobResourceContents,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    ToolAnnotations,
)

RESULT_ID_KEY = "polyloop/result_id"


def build_server(record: Path, *, changed: str | None) -> MCPServer:
    server = MCPServer("polyloop-test-server", log_level="WARNING")

    def note(event: str, tool: str, ctx: Context | None, **details: Any) -> None:
        meta = ctx.request_context.meta if ctx is not None else None
        line = {
            "event": event,
            "tool": tool,
            "result_id": (meta or {}).get(RESULT_ID_KEY),
            **details,
        }
        # One short append per event: the test reads the file while the server runs.
        with record.open("a", encoding="utf-8") as file:
            file.write(json.dumps(line) + "\n")

    if changed == "schema":

        @server.tool(
            name="lookup",
            description="Look a key up.",
            annotations=ToolAnnotations(read_only_hint=True),
        )
        def lookup_changed(key: str, version: int, ctx: Context) -> str:
            note("call", "lookup", ctx, arguments={"key": key, "version": version})
            return f"value of {key}"

    else:

        @server.tool(
            name="lookup",
            description="Look a key up.",
            annotations=ToolAnnotations(read_only_hint=True),
        )
        def lookup(key: str, ctx: Context) -> str:
            note("call", "lookup", ctx, arguments={"key": key})
            return f"value of {key}"

    @server.tool(
        name="put",
        description="Store a value under a key.",
        annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=changed != "annotations"),
    )
    def put(key: str, value: str, ctx: Context) -> str:
        note("call", "put", ctx, arguments={"key": key, "value": value})
        return f"stored {key}"

    @server.tool(
        name="send",
        description="Send a message (it cannot be unsent).",
        annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False),
    )
    def send(text: str, ctx: Context) -> str:
        note("call", "send", ctx, arguments={"text": text})
        return f"sent {text!r}"

    @server.tool(name="plain", description="A tool with no annotations.")
    def plain(n: int, ctx: Context) -> str:
        note("call", "plain", ctx, arguments={"n": n})
        return str(n + 1)

    @server.tool(
        name="slow",
        description="Wait, then answer.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    async def slow(seconds: float, ctx: Context) -> str:
        note("call", "slow", ctx, arguments={"seconds": seconds})
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            note("cancelled", "slow", ctx)
            raise
        return "woke up"

    @server.tool(name="fail", description="Always fails.")
    def fail(reason: str, ctx: Context) -> str:
        note("call", "fail", ctx, arguments={"reason": reason})
        raise ToolError(f"could not do it: {reason}")

    @server.tool(
        name="media",
        description="Answer with text and other content.",
        annotations=ToolAnnotations(read_only_hint=True),
    )
    def media(ctx: Context) -> list[Any]:
        note("call", "media", ctx, arguments={})
        four = base64.b64encode(b"\x89PNG").decode()
        return [
            TextContent(text="here is what I found"),
            ImageContent(data=four, mime_type="image/png"),
            AudioContent(data=base64.b64encode(b"RIFF0000").decode(), mime_type="audio/wav"),
            EmbeddedResource(
                resource=BlobResourceContents(
                    uri="file:///report.pdf", mime_type="application/pdf", blob=four
                )
            ),
            ResourceLink(name="notes", uri="file:///notes.txt", mime_type="text/plain"),
        ]

    return server


async def serve_http(server: MCPServer) -> None:
    app = server.streamable_http_app(host="127.0.0.1")
    # Bound and listening here, so the port can be announced before uvicorn takes the
    # socket over: a client that connects early waits in the backlog.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    print(f"port {listener.getsockname()[1]}", flush=True)
    web = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    await web.serve(sockets=[listener])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["stdio", "http"], required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--changed", choices=["schema", "annotations"])
    args = parser.parse_args()
    server = build_server(args.record, changed=args.changed)
    if args.transport == "stdio":
        server.run("stdio")
    else:
        # uvicorn runs on asyncio only.
        anyio.run(serve_http, server, backend="asyncio")
    sys.exit(0)


if __name__ == "__main__":
    main()
