"""A one-step agent whose model call or tool can be held open, for the two-writer tests.

Worker A drives the run and is held at a chosen point; worker B (another store object
over the same data, in this process or a child process) tries to resume the run
meanwhile. Every effect, whoever runs it, is counted in a ledger: a list in this
process, or lines appended to a file across processes.

Run as a script, this module is worker B in a child process::

    python tests/kit/one_writer.py KIND LOCATION SCHEMA RUN_ID REPLAY LEDGER

It prints ``locked`` if the resume was refused with ``RunLocked``, else the stop reason.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from polyloop import (
    Budget,
    Definition,
    Injection,
    Message,
    ModelCall,
    ModelReply,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunLocked,
    Store,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    resume,
)
from polyloop.testing import JsonActionInterpreter

TEXTS = ObservationTexts(not_executed="Refused: {reason}", env_fault="Fault: {detail}")
SCRIPT = ('{"tool": "slow", "arguments": {"n": 1}}',)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

Note = Callable[[str], None]


class Gate:
    """Holds one effect open: ``entered`` is set when it starts, and it waits for ``go``."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.go = anyio.Event()

    async def hold(self) -> None:
        self.entered.set()
        await self.go.wait()


class Model:
    """Answers from :data:`SCRIPT`; notes each call, and is held by ``gate`` if given."""

    def __init__(self, note: Note, gate: Gate | None = None) -> None:
        self.note = note
        self.gate = gate

    def parameters(self) -> dict[str, Any]:
        return {"name": "one-writer"}

    async def call(self, call: ModelCall) -> ModelReply:
        self.note(f"model {call.result_id}")
        if self.gate is not None:
            await self.gate.hold()
        return ModelReply(
            call_id=f"c{call.call_index}", content=SCRIPT[call.call_index], reasoning=None
        )


def tools(note: Note, replay: Replay, gate: Gate | None = None) -> ToolRegistry:
    """One tool, ``slow``, that completes the run; held by ``gate`` if given."""

    async def slow(arguments: dict[str, Any], *, result_id: str) -> str:
        note(f"tool {result_id}")
        if gate is not None:
            await gate.hold()
        return f"done {arguments['n']}"

    return ToolRegistry(
        [
            ToolSpec(
                name="slow",
                description="A slow tool that completes the run.",
                parameters=SCHEMA,
                handler=slow,
                replay=replay,
                completes=True,
            )
        ],
        max_observation_chars=1_000,
    )


def definition(store: Store, note: Note, gate: Gate | None = None) -> Definition:
    return Definition(
        model=Model(note, gate),
        interpreter=JsonActionInterpreter(),
        store=store,
        events=NullSink(),
        texts=TEXTS,
    )


def request(run_id: str, registry: ToolRegistry, replay: Replay) -> Request:
    return Request(
        run_id=run_id,
        budget=Budget(max_steps=3, max_valid_steps=3, max_context_chars=10_000),
        executor=registry.executor(),
        tools=registry,
        run_context=(Message.text(Role.SYSTEM, "Call the slow tool."),),
        goal_context=(Message.text(Role.USER, "Go."),),
        injection=Injection(entries={}),
        binding={},
        model_replay=replay,
        observation_template="Observation: {observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=5.0,
    )


def open_store(kind: str, location: str, schema: str) -> Store:
    if kind == "jsonl":
        from polyloop.stores import JsonlStore

        return JsonlStore(location)
    if kind == "sqlite":
        from polyloop.stores import SqliteStore

        return SqliteStore(location)
    from polyloop.stores import PostgresStore

    return PostgresStore(location, schema=schema)


def file_note(path: str) -> Note:
    def note(what: str) -> None:
        with Path(path).open("a", encoding="utf-8") as ledger:
            ledger.write(f"{what}\n")

    return note


async def _second_worker(argv: list[str]) -> str:
    kind, location, schema, run_id, replay, ledger = argv
    store = open_store(kind, location, schema)
    note = file_note(ledger)
    try:
        result = await resume(
            definition(store, note), request(run_id, tools(note, Replay(replay)), Replay(replay))
        )
    except RunLocked:
        return "locked"
    finally:
        await store.aclose()  # type: ignore[attr-defined]
    return result.stop_reason.value


if __name__ == "__main__":
    print(anyio.run(_second_worker, sys.argv[1:]))
