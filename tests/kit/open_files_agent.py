"""A child process for the open-file tests: runs under a lowered open-file limit.

    python tests/kit/open_files_agent.py STORE BACKEND LIMIT many N
    python tests/kit/open_files_agent.py STORE BACKEND LIMIT exhaust RUN_ID
    python tests/kit/open_files_agent.py STORE BACKEND LIMIT exhaust-first RUN_ID

STORE is ``jsonl:DIR``, ``sqlite:FILE`` or a ``postgresql://`` conninfo; the limit is
lowered (soft and hard) before the store is opened. ``many`` drives N runs at once, each
waiting on its model so that they all overlap, and prints how many completed, the
errors and the peak number of open descriptors. ``exhaust`` starts one run whose second
model call fills every free descriptor, so the next store operation meets the limit
(``exhaust-first``: they are filled before the run, so the store's first use meets it);
it prints the error, frees the descriptors, resumes the run (or runs it, if nothing
was written) and prints how it ended. The output is one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import anyio

from kit import child_agent
from polyloop import (
    Definition,
    Request,
    Store,
    StoreError,
    ToolRegistry,
    ToolSpec,
    resume,
    run,
)
from polyloop.ports import ModelCall
from polyloop.testing import ScriptedModelClient

STEPS = 2
NOOP = json.dumps({"tool": "noop", "arguments": {}})
FINISH = json.dumps({"tool": "finish", "arguments": {}})
HELD: list[int] = []  # the descriptors ``exhaust`` fills


def fill_descriptors() -> None:
    while True:
        try:
            HELD.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return


def free_descriptors() -> None:
    while HELD:
        os.close(HELD.pop())


def build(store: Store, run_id: str, *, exhaust: bool) -> tuple[Definition, Request]:
    async def noop(arguments: dict[str, Any], *, result_id: str) -> str:
        return "ok"

    def script(call: ModelCall) -> str:
        if exhaust and call.call_index == 1 and not HELD:
            fill_descriptors()
        return FINISH if call.call_index >= STEPS - 1 else NOOP

    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    registry = ToolRegistry(
        [
            ToolSpec(name="noop", description="Nothing.", parameters=empty, handler=noop),
            ToolSpec(
                name="finish", description="Done.", parameters=empty, handler=noop, completes=True
            ),
        ],
        max_observation_chars=1_000,
    )
    model = ScriptedModelClient(script, delay=0.05, name="open-files")
    return child_agent.build(
        store, run_id, model, registry, max_steps=10, instructions="Call noop, then finish."
    )


async def many(store: Store, count: int) -> dict[str, Any]:
    completed, errors, peak = 0, [], 0

    async def one(index: int) -> None:
        nonlocal completed
        try:
            result = await run(*build(store, f"run-{index}", exhaust=False))
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        completed += result.stop_reason.value == "submitted"

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(os.listdir("/proc/self/fd")))
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as outer:
        outer.start_soon(watch)
        async with anyio.create_task_group() as group:
            for index in range(count):
                group.start_soon(one, index)
        outer.cancel_scope.cancel()
    return {"completed": completed, "errors": sorted(set(errors))[:5], "peak_fds": peak}


async def exhaust(store: Store, run_id: str, *, first: bool) -> dict[str, Any]:
    if first:
        fill_descriptors()
    try:
        await run(*build(store, run_id, exhaust=not first))
    except StoreError as exc:
        error = str(exc)
    else:
        error = None
    free_descriptors()
    log = await store.read_log(run_id)
    drive = resume if log.records else run
    result = await drive(*build(store, run_id, exhaust=False))
    return {
        "error": error,
        "stop_reason": result.stop_reason.value,
        "steps": result.step_count,
        "resumed": result.resumed,
    }


async def main(spec: str, limit: str, mode: str, argument: str) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(limit), int(limit)))
    store = child_agent.open_store(spec)
    try:
        if mode == "many":
            outcome = await many(store, int(argument))
        else:
            outcome = await exhaust(store, argument, first=mode == "exhaust-first")
    finally:
        await store.aclose()  # type: ignore[attr-defined]
    print(json.dumps(outcome), flush=True)


if __name__ == "__main__":
    spec, backend, limit, mode, argument = sys.argv[1:6]
    anyio.run(main, spec, limit, mode, argument, backend=backend)
