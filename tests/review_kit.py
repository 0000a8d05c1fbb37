"""Builders for the tests of a person in the loop: a tool that needs approval, a tool
whose replay is never allowed, and the scripts that call them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import anyio.lowlevel

from agent_kit import ANSWER_SCHEMA, NUMBER_SCHEMA, Ledger, answer, tool_call
from polyloop import (
    Proposal,
    Replay,
    RunLog,
    Settlement,
    StepRecord,
    ToolRegistry,
    ToolSpec,
    Verdict,
)

ENV_SCHEMA = {
    "type": "object",
    "properties": {"env": {"type": "string", "enum": ["staging", "prod"]}},
    "required": ["env"],
    "additionalProperties": False,
}


def review_tools(ledger: Ledger, *, needs_approval: bool = True) -> ToolRegistry:
    """``double`` (replay allowed), ``deploy`` (needs approval unless told otherwise),
    ``pay`` (replay never allowed) and ``submit`` (completes)."""

    def handler(name: str, render: Any) -> Any:
        async def run(arguments: dict[str, Any], *, result_id: str) -> str:
            ledger.calls.append((name, result_id))
            await anyio.lowlevel.checkpoint()
            return str(render(arguments))

        return run

    return ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=NUMBER_SCHEMA,
                handler=handler("double", lambda a: a["n"] * 2),
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="deploy",
                description="Deploy the build to an environment.",
                parameters=ENV_SCHEMA,
                handler=handler("deploy", lambda a: f"deployed to {a['env']}"),
                needs_approval=needs_approval,
            ),
            ToolSpec(
                name="pay",
                description="Pay an amount.",
                parameters=NUMBER_SCHEMA,
                handler=handler("pay", lambda a: f"paid {a['n']}"),
            ),
            ToolSpec(
                name="submit",
                description="Submit the answer.",
                parameters=ANSWER_SCHEMA,
                handler=handler("submit", lambda a: f"accepted {a['answer']}"),
                replay=Replay.ALLOWED,
                completes=True,
            ),
        ],
        max_observation_chars=10_000,
    )


def observed(payload: Any) -> str:
    """What the tool of ``payload`` returns when it runs: what a person who checked would
    report for a call in doubt."""
    name, arguments = payload["name"], payload["arguments"]
    return {
        "double": lambda: str(arguments.get("n", 0) * 2),
        "deploy": lambda: f"deployed to {arguments.get('env')}",
        "pay": lambda: f"paid {arguments.get('n')}",
        "submit": lambda: f"accepted {arguments.get('answer')}",
    }[name]()


def approval_script() -> list[str]:
    """Double, deploy to prod (needs approval), then answer."""
    return [tool_call("double", n=1), tool_call("deploy", env="prod"), answer("done")]


def payment_script() -> list[str]:
    """Double, pay (never replayed), then answer."""
    return [tool_call("double", n=1), tool_call("pay", n=5), answer("done")]


def reviews(log: RunLog) -> list[Proposal | Verdict | Settlement]:
    return [r for r in log.records if isinstance(r, Proposal | Verdict | Settlement)]


def plain_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """Step records without timing or who settled them: what two runs share."""
    cleared = {
        f.name: None
        for f in dataclasses.fields(StepRecord)
        if f.metadata.get("timing") or f.name in ("duration_s", "settled_by")
    }
    return [dataclasses.replace(step, **cleared) for step in steps]
