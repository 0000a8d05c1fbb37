"""A child process for the real-kill tests: runs or resumes one agent run, then reports.

    python tests/kit/kill_agent.py STORE RUN_ID run|resume SIDE_FILE

STORE is ``jsonl:DIR``, ``sqlite:FILE`` or a ``postgresql://`` conninfo. The tools are
slow enough that a SIGKILL from the parent lands inside them most of the time. Every tool
execution is appended (and fsynced) to SIDE_FILE as ``<tool> <result id>`` the moment it
starts, which is how the parent proves that no ``Replay.NEVER`` action ran twice. On
success the child prints the run's result as one JSON line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import anyio

from kit import child_agent
from polyloop import (
    Definition,
    Replay,
    Request,
    RunLocked,
    RunResult,
    Store,
    ToolRegistry,
    ToolSpec,
    resume,
    run,
    serialization,
)
from polyloop.testing import ScriptedModelClient, without_timing

SCRIPT = [json.dumps({"tool": "fetch", "arguments": {"n": n}}) for n in range(1, 5)] + [
    json.dumps({"tool": "record", "arguments": {"total": 10}}),
    json.dumps({"tool": "fetch", "arguments": {"n": 5}}),
    json.dumps({"tool": "submit", "arguments": {"total": 15}}),
]


def tools(side_file: str, gate: Callable[[], Awaitable[None]] | None = None) -> ToolRegistry:
    """The run's tools; ``record`` first waits for ``gate``, if given."""

    def note(line: str) -> None:
        child_agent.append_synced(side_file, line)

    async def fetch(arguments: dict[str, Any], *, result_id: str) -> str:
        note(f"fetch {result_id}")
        await anyio.sleep(0.05)
        return f"value {arguments['n']}"

    async def record(arguments: dict[str, Any], *, result_id: str) -> str:
        if gate is not None:
            await gate()
        note(f"record {result_id}")
        return f"recorded {arguments['total']}"

    async def submit(arguments: dict[str, Any], *, result_id: str) -> str:
        note(f"submit {result_id}")
        return f"submitted {arguments['total']}"

    number = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    total = {"type": "object", "properties": {"total": {"type": "integer"}}, "required": ["total"]}
    return ToolRegistry(
        [
            ToolSpec(
                name="fetch",
                description="Fetch a value (safe to repeat).",
                parameters=number,
                handler=fetch,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="record",
                description="Record a total (never repeat).",
                parameters=total,
                handler=record,
                replay=Replay.NEVER,
            ),
            ToolSpec(
                name="submit",
                description="Submit (never repeat).",
                parameters=total,
                handler=submit,
                replay=Replay.NEVER,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


def build(
    store: Store, run_id: str, side_file: str, gate: Callable[[], Awaitable[None]] | None = None
) -> tuple[Definition, Request]:
    model = ScriptedModelClient(SCRIPT, delay=0.03, name="kill-test")
    registry = tools(side_file, gate)
    return child_agent.build(
        store, run_id, model, registry, max_steps=20, instructions="Fetch, record, submit."
    )


def summary(result: RunResult) -> dict[str, Any]:
    return {
        "stop_reason": result.stop_reason.value,
        "final_answer": result.final_answer,
        "detail": result.detail,
        "steps": [serialization.encode(without_timing(step)) for step in result.steps],
    }


async def main(spec: str, run_id: str, mode: str, side_file: str) -> None:
    store = child_agent.open_store(spec)
    try:
        if mode == "run":
            result = await run(*build(store, run_id, side_file))
        else:
            # A killed PostgreSQL worker's lease holds its runs for a few seconds more.
            with anyio.fail_after(30):
                while True:
                    try:
                        result = await resume(*build(store, run_id, side_file))
                        break
                    except RunLocked:
                        await anyio.sleep(0.1)
    finally:
        await store.aclose()  # type: ignore[attr-defined]
    print(json.dumps(summary(result)), flush=True)


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5])
