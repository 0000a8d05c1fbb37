"""A web application that shows a run live to its own front end, with ``polyloop.follow``.

What it shows
    * ``events``: the few lines an application needs to serve a run's records as
      server-sent events. Each record goes out with its position as the event's id; a
      browser that reconnects (a reload, a dropped connection, a restarted server) sends
      the last id it saw back as ``Last-Event-ID``, and the stream goes on from exactly
      there, no record missed and none twice;
    * ``PAGE``: the front end, a few lines of JavaScript around ``EventSource``, which
      closes the stream once a final end record arrives;
    * a run driven beside the server on the same SQLite file, one step a second, and
      started or resumed each time the program starts: stop the program mid-run, start
      it again, and an open page picks the run up where it stopped.

How to run it::

    python examples/follow_app.py --db runs.db     # then open http://127.0.0.1:8000/runs/demo

Needs the ``web`` extra (Starlette and Hypercorn); asyncio only, for brevity.
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import signal
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import polyloop
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
    RunEnded,
    RunNotFound,
    StopReason,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    serialization,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import SqliteStore
from polyloop.testing import ScriptedModelClient

# A stop a later resume goes on from: the stream ends, and the page waits for more.
RESUMABLE = {StopReason.CANCELLED, StopReason.IN_DOUBT, StopReason.AWAITING_APPROVAL}


async def records(store: polyloop.Store, run_id: str, after: int) -> AsyncIterator[str]:
    """The run's records after position ``after``, as server-sent events."""
    try:
        async with aclosing(polyloop.follow(store, run_id, after=after)) as followed:
            async for item in followed:
                record = serialization.encode(item.record)
                yield f"id: {item.position}\ndata: {json.dumps(record)}\n\n"
                if isinstance(item.record, RunEnded) and item.record.stop_reason not in RESUMABLE:
                    yield "event: end\ndata: {}\n\n"
    except RunNotFound as exc:
        yield f"event: missing\ndata: {json.dumps(str(exc))}\n\n"


def create_app(store: polyloop.Store) -> Starlette:
    async def events(request: HttpRequest) -> Response:
        last_seen = request.headers.get("last-event-id", "0")  # sent back on a reconnect
        if not last_seen.isdigit():
            return PlainTextResponse("Last-Event-ID is a record's position", status_code=400)
        stream = records(store, request.path_params["run_id"], int(last_seen))
        return StreamingResponse(stream, media_type="text/event-stream")

    async def page(request: HttpRequest) -> Response:
        run_id = request.path_params["run_id"]
        return HTMLResponse(
            PAGE.replace("TITLE", html.escape(run_id)).replace(
                "RUN_ID", html.escape(json.dumps(run_id))
            )
        )

    return Starlette(routes=[Route("/runs/{run_id}", page), Route("/runs/{run_id}/events", events)])


PAGE = """<!doctype html>
<meta charset="utf-8"><title>TITLE</title>
<h1>TITLE</h1><ol id="records"></ol>
<script data-run="RUN_ID">
const runId = JSON.parse(document.currentScript.dataset.run);
const source = new EventSource(`/runs/${encodeURIComponent(runId)}/events`);
source.onmessage = (event) => {
  const record = JSON.parse(event.data);
  const item = document.createElement("li");
  item.value = Number(event.lastEventId);
  item.textContent = `${record.kind}: ${record.observation ?? record.stop_reason ?? ""}`;
  document.getElementById("records").append(item);
};
source.addEventListener("end", () => source.close());
</script>
"""

# -- the run the page shows: a scripted model counting down, one step a second -------------


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


SCRIPT = [_call("count", n=n) for n in (3, 2, 1)] + [_call("submit", answer="lift-off")]


def make_tools() -> ToolRegistry:
    async def count(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        return f"{arguments['n']}..."

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        return f"accepted: {arguments['answer']}"

    def schema(name: str, kind: str) -> dict[str, JSONValue]:
        return {"type": "object", "properties": {name: {"type": kind}}, "required": [name]}

    return ToolRegistry(
        [
            ToolSpec(
                name="count",
                description="Say a number.",
                parameters=schema("n", "integer"),
                handler=count,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="submit",
                description="Hand the answer in.",
                parameters=schema("answer", "string"),
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


async def drive(store: SqliteStore, run_id: str, pace: float) -> None:
    tools = make_tools()
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, delay=pace),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Refused: {reason}", env_fault="Failed: {detail}"),
    )
    request = Request(
        run_id=run_id,
        budget=Budget(max_steps=8, max_valid_steps=8, max_context_chars=20_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "Count down, then submit."),),
        goal_context=(Message.text(Role.USER, "Count down from 3."),),
        injection=Injection(entries={}),
        binding={},
        model_replay=Replay.ALLOWED,
        observation_template="{observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=5.0,
    )
    await polyloop.start_or_resume(definition, request)


async def main(db: Path, port: int, run_id: str, pace: float) -> None:
    async with SqliteStore(db) as store:
        config = Config()
        config.bind = [f"127.0.0.1:{port}"]
        config.accesslog = None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        print(f"serving http://127.0.0.1:{port}/runs/{run_id}", flush=True)
        driving = asyncio.create_task(drive(store, run_id, pace))
        await serve(create_app(store), config, shutdown_trigger=stop.wait)
        driving.cancel()  # a run stopped mid-way ends cancelled and goes on next time
        await asyncio.gather(driving, return_exceptions=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, required=True, help="the SQLite file of the run")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--run-id", default="demo")
    parser.add_argument("--pace", type=float, default=1.0, help="seconds a model call takes")
    args = parser.parse_args()
    asyncio.run(main(args.db, args.port, args.run_id, args.pace))
