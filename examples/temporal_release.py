"""The release agent the Temporal examples share: its names, then its definition.

A client and a worker agree on two names only: the agent's (``RunInput.agent``) and the
task queue's. They are the first thing here, so that ``temporal_client.py`` imports
them and nothing else: a client never builds a definition, a model or a tool, and
``request_for`` runs on the worker, from the run id and the JSON input the client
sent. ``temporal_worker.py`` and the one-process demo ``temporal_agent.py`` build the
agent with :func:`make_agent`.

The agent deploys a release (``deploy`` needs a person's approval), then reports
(``submit``). Its model is scripted (offline, deterministic), so the examples need no
API key.
"""

from __future__ import annotations

import json
from collections.abc import Callable

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
    Store,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.temporal import Agent
from polyloop.testing import ScriptedModelClient

AGENT = "release"
"""The agent's name: what a client puts in ``RunInput.agent``."""

TASK_QUEUE = "release-agents"
"""The task queue the worker polls and a client starts runs on."""


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


# The scripted model answers call i of every run with SCRIPT[i]: deploy, then report.
SCRIPT = [_call("deploy", env="prod"), _call("submit", answer="deployed to prod")]


def make_tools(note_effect: Callable[[str], None]) -> ToolRegistry:
    """``deploy`` and ``submit``; each calls ``note_effect`` with a line saying what ran."""

    async def deploy(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        note_effect(f"deploy {arguments['env']} ({result_id})")
        return f"deployed to {arguments['env']}"

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        note_effect(f"submit ({result_id})")
        return f"accepted: {arguments['answer']}"

    def schema(name: str) -> dict[str, JSONValue]:
        return {
            "type": "object",
            "properties": {name: {"type": "string"}},
            "required": [name],
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            ToolSpec(
                name="deploy",
                description="Deploy the release to an environment.",
                parameters=schema("env"),
                handler=deploy,
                needs_approval=True,  # the run stops until a person answers
            ),
            ToolSpec(
                name="submit",
                description="Report that the release is done. Ends the task.",
                parameters=schema("answer"),
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


def make_agent(store: Store, note_effect: Callable[[str], None]) -> Agent:
    """The release agent on ``store``, for a worker's :class:`~polyloop.temporal.PolyLoopPlugin`."""
    tools = make_tools(note_effect)
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, name="release"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Refused: {reason}", env_fault="Failed: {detail}"),
    )

    def request_for(run_id: str, input: JSONValue) -> Request:
        # Everything the request depends on comes from the run id and the input, so any
        # worker builds the same request, and a resumed run passes its identity check.
        assert isinstance(input, dict)
        return Request(
            run_id=run_id,
            budget=Budget(max_steps=6, max_valid_steps=6, max_context_chars=20_000),
            executor=tools.executor(),
            tools=tools,
            run_context=(Message.text(Role.SYSTEM, "Deploy the release, then report."),),
            goal_context=(Message.text(Role.USER, f"Release {input['release']}."),),
            injection=Injection(entries={}),
            binding={"release": str(input["release"])},
            model_replay=Replay.ALLOWED,
            observation_template="Observation: {observation}",
            tool_style=ToolStyle.JSON,
            cancel_grace_s=5.0,
        )

    return Agent(name=AGENT, definition=definition, request_for=request_for)
