"""The loop under test in benchmarks 1-7, built three ways: PolyLoop, and hand-written floors.

Every loop does the same work per step: one call to an instant model (it suspends once,
as a client awaiting a reply would, and answers at once), then, unless the model
answered, one call to a no-op tool whose observation goes back into the history. The
floors are the cheapest honest way to write that loop by hand (``bench/README.md``,
benchmarks 1-3). Beside them, the definition and request every benchmark's runs share.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from bench._common import RunStats, each, now
from polyloop import (
    Budget,
    Definition,
    Injection,
    Intent,
    IntentKind,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Result,
    Role,
    RunResult,
    StepRecord,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    run,
)
from polyloop.ports import Action, ActionOutcome, FinalAnswer, ModelCall, ModelReply, Store
from polyloop.serialization import dumps
from polyloop.stores import MemoryStore
from polyloop.types import ActionStatus, JSONValue

TOOL_REPLY = ModelReply(call_id=None, content="noop", reasoning=None)
FINAL_REPLY = ModelReply(call_id=None, content="final", reasoning=None)
NOOP_ACTION = Action(
    payload={"name": "noop", "arguments": {}}, action_text="noop()", history_text="noop"
)
FINAL_ANSWER = FinalAnswer(answer="done", history_text="final")
TEXTS = ObservationTexts(not_executed="Refused: {reason}", env_fault="Fault: {detail}")


def object_schema(**properties: JSONValue) -> dict[str, JSONValue]:
    """The JSON Schema of a tool's arguments: these properties, each required, no others."""
    required: dict[str, JSONValue] = {"required": list(properties)} if properties else {}
    return {"type": "object", "properties": properties, **required, "additionalProperties": False}


NOOP_SCHEMA = object_schema()
SYSTEM_TEXT = "You are a benchmark agent."
GOAL_TEXT = "Call the tool until told to stop."
OBSERVATION_TEMPLATE = "Observation: {observation}"


def definition(model: Any, interpreter: Any, store: Store) -> Definition:
    """What every benchmark's PolyLoop runs share but the model, interpreter and store."""
    return Definition(
        model=model, interpreter=interpreter, store=store, events=NullSink(), texts=TEXTS
    )


def request(
    run_id: str,
    tools: ToolRegistry,
    executor: Any,
    *,
    max_steps: int,
    max_context_chars: int = 10**12,
    system: str = SYSTEM_TEXT,
    goal: str = GOAL_TEXT,
    model_replay: Replay = Replay.NEVER,
) -> Request:
    """A run of every benchmark's shape: one system and one goal message, JSON tool calls,
    no injection, ``max_steps`` steps (valid or not)."""
    return Request(
        run_id=run_id,
        budget=Budget(
            max_steps=max_steps, max_valid_steps=max_steps, max_context_chars=max_context_chars
        ),
        executor=executor,
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, system),),
        goal_context=(Message.text(Role.USER, goal),),
        injection=Injection(entries={}),
        binding={},
        model_replay=model_replay,
        observation_template=OBSERVATION_TEMPLATE,
        tool_style=ToolStyle.JSON,
        cancel_grace_s=5.0,
    )


class Counter:
    """Counts calls (decisions or tool executions) across runs."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class InstantModel:
    """A model client that calls the tool on every call but the last of a run.

    ``steps`` is the number of decisions per run; ``None`` means it never answers (the
    budget stops the run). One instance may serve many concurrent runs. With
    ``stamps``, the time of every call is kept (the scale benchmark reads step times
    from them).
    """

    def __init__(self, steps: int | None, *, stamps: list[float] | None = None) -> None:
        self.steps = steps
        self.decisions = Counter()
        self.stamps = stamps

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "bench-instant", "steps": self.steps}

    async def call(self, call: ModelCall) -> ModelReply:
        self.decisions.n += 1
        if self.stamps is not None:
            self.stamps.append(now())
        await anyio.lowlevel.checkpoint()
        if self.steps is not None and call.call_index >= self.steps - 1:
            return FINAL_REPLY
        return TOOL_REPLY


class InstantInterpreter:
    """Maps the instant model's two replies to prebuilt decisions: no parsing cost."""

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "bench-instant"}

    def interpret(self, reply: ModelReply) -> Action | FinalAnswer:
        return FINAL_ANSWER if reply.content == "final" else NOOP_ACTION


def noop_tools(executions: Counter) -> ToolRegistry:
    """A registry with one tool that does nothing but count (it never suspends)."""

    async def noop(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        executions.n += 1
        return "ok"

    return ToolRegistry(
        [ToolSpec(name="noop", description="Do nothing.", parameters=NOOP_SCHEMA, handler=noop)],
        max_observation_chars=1_000,
    )


class BareExecutor:
    """An action executor without the registry: no payload check, no schema validation.

    Used only to show how much of a step the registry's checks take.
    """

    def __init__(self, executions: Counter) -> None:
        self.executions = executions

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        self.executions.n += 1
        return ActionOutcome(
            status=ActionStatus.EXECUTED, observation="ok", synthesized=False, done=False
        )

    def replay(self, action: Action) -> Replay:
        return Replay.NEVER


class Agent:
    """The PolyLoop side of a benchmark: one model, one tool, one store."""

    def __init__(
        self,
        store: Store,
        *,
        steps: int | None,
        bare: bool = False,
        stamps: list[float] | None = None,
    ) -> None:
        self.model = InstantModel(steps, stamps=stamps)
        self.executions = Counter()
        self.tools = noop_tools(self.executions)
        self.executor: Any = BareExecutor(self.executions) if bare else self.tools.executor()
        self.definition = definition(self.model, InstantInterpreter(), store)

    def request(self, run_id: str, *, max_steps: int) -> Request:
        return request(run_id, self.tools, self.executor, max_steps=max_steps)

    async def run(self, run_id: str, steps: int) -> RunResult:
        return await run(self.definition, self.request(run_id, max_steps=steps + 1))

    async def timed_run(self, run_id: str, steps: int) -> RunStats:
        """One run of ``steps`` decisions, timed from ``run`` to its return."""
        decisions, executions = self.model.decisions.n, self.executions.n
        began = now()
        result = await self.run(run_id, steps)
        seconds = now() - began
        if result.step_count != steps or result.final_answer != "done":
            raise AssertionError(
                f"run {run_id!r} ended {result.stop_reason} after "
                f"{result.step_count} steps, not after {steps}"
            )
        return RunStats(seconds, self.model.decisions.n - decisions, self.executions.n - executions)


# -- the hand-written floors ---------------------------------------------------------------


class HandModel:
    """The floor's model: suspends once, then returns a tool call or the final text."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.decisions = Counter()

    async def call(self, history: list[tuple[str, str]], index: int) -> str | None:
        self.decisions.n += 1
        await anyio.lowlevel.checkpoint()
        return None if index >= self.steps - 1 else "noop"


async def _hand_tool(name: str, executions: Counter) -> str:
    executions.n += 1
    return "ok"


def _barrier(fd: int, data: bytes) -> None:
    """Append ``data`` and make it durable: one of the two barriers of a step."""
    os.write(fd, data)
    os.fsync(fd)


def _record(run_id: str, step: int, kind: str) -> bytes:
    return (json.dumps({"run": run_id, "step": step, "kind": kind}) + "\n").encode()


async def handwritten_memory(steps: int) -> RunStats:
    """Model call, tool, observation appended to a list: nothing else."""
    model, executions = HandModel(steps), Counter()
    began = now()
    history = [("system", SYSTEM_TEXT), ("user", GOAL_TEXT)]
    for index in range(steps):
        tool = await model.call(history, index)
        history.append(("assistant", tool or "final"))
        if tool is None:
            break
        history.append(("user", await _hand_tool(tool, executions)))
    return RunStats(now() - began, model.decisions.n, executions.n)


@dataclass(frozen=True)
class LineSizes:
    """Bytes per line of a step's four records: two barriers, two plain appends."""

    model_intent: int
    model_result: int
    action_intent: int
    step: int

    def line(self, field: str, step: int) -> bytes:
        """A line of the field's size (the step number in it, so lines differ)."""
        head = f"{step} "
        size: int = getattr(self, field)
        return (head + "x" * max(size - len(head) - 1, 0) + "\n").encode()


async def polyloop_line_sizes(steps: int) -> LineSizes:
    """The median length of each kind of line in a JSON-lines log of this agent's run."""
    store = MemoryStore()
    await Agent(store, steps=steps).run("polyloop-bench-probe", steps)
    found: dict[str, list[int]] = {
        name: [] for name in ("model_intent", "model_result", "action_intent", "step")
    }
    pending = 0
    for record in (await store.read_log("polyloop-bench-probe")).records:
        size = len(dumps(record).encode()) + 1
        if isinstance(record, Intent):
            kind = "model_intent" if record.kind is IntentKind.MODEL_CALL else "action_intent"
            found[kind].append(size)
        elif isinstance(record, Result) and record.kind is IntentKind.MODEL_CALL:
            found["model_result"].append(size)
        elif isinstance(record, Result):
            pending = size + 1  # "[result," before the step, "]" after it
        elif isinstance(record, StepRecord):
            found["step"].append(size + pending)
            pending = 0
    return LineSizes(**{name: int(statistics.median(sizes)) for name, sizes in found.items()})


async def handwritten_durable(
    steps: int,
    path: Path,
    *,
    threaded: bool = False,
    model: HandModel | None = None,
    executions: Counter | None = None,
    run_id: str = "run",
    sizes: LineSizes | None = None,
) -> RunStats:
    """The in-memory floor plus two fsync'd appends per step to one file.

    With ``threaded``, each barrier runs in a worker thread, as a store built on AnyIO
    must do to keep the event loop free. With ``sizes``, each step writes lines as long
    as a PolyLoop log's (the model result and the step appended without a sync), so the
    disk moves the same bytes per step as PolyLoop's ``JsonlStore`` does; with both,
    those two appends run in a worker thread too, as every write of ``JsonlStore`` does.
    """
    model = model or HandModel(steps)
    executions = executions or Counter()
    decisions, executed = model.decisions.n, executions.n

    def line(index: int, kind: str) -> bytes:
        if sizes is None:
            return _record(run_id, index, kind)
        return sizes.line(kind, index)

    async def barrier(data: bytes) -> None:
        if threaded:
            await anyio.to_thread.run_sync(_barrier, fd, data)
        else:
            _barrier(fd, data)

    async def append(data: bytes) -> None:
        if threaded:
            await anyio.to_thread.run_sync(os.write, fd, data)
        else:
            os.write(fd, data)

    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        began = now()
        history = [("system", SYSTEM_TEXT), ("user", GOAL_TEXT)]
        for index in range(steps):
            await barrier(line(index, "model_intent" if sizes else "model"))
            tool = await model.call(history, index)
            if sizes is not None:
                await append(line(index, "model_result"))
            history.append(("assistant", tool or "final"))
            if tool is None:
                break
            await barrier(line(index, "action_intent" if sizes else "action"))
            history.append(("user", await _hand_tool(tool, executions)))
            if sizes is not None:
                await append(line(index, "step"))
        seconds = now() - began
    finally:
        os.close(fd)
    return RunStats(seconds, model.decisions.n - decisions, executions.n - executed)


async def handwritten_concurrent(
    runs: int, steps: int, directory: Path, *, sequential: bool = False
) -> RunStats:
    """``runs`` durable loops sharing one model, each with its own file.

    Concurrent: all in one task group. Sequential: one after the other. The barriers
    run in worker threads either way.
    """
    model, executions = HandModel(steps), Counter()

    async def one(index: int) -> None:
        await handwritten_durable(
            steps,
            directory / f"run-{index}.log",
            threaded=True,
            model=model,
            executions=executions,
            run_id=f"run-{index}",
        )

    began = now()
    await each(runs, one, sequential=sequential)
    return RunStats(now() - began, model.decisions.n, executions.n)


async def fsync_floor_run(count: int, path: Path) -> RunStats:
    """``count`` appends of a small record, each followed by ``fsync``, on a new file, timed
    as a whole like every loop, so that the disk's slow syncs count as they do in a run."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        began = now()
        for index in range(count):
            _barrier(fd, _record("fsync-floor", index, "probe"))
        seconds = now() - began
    finally:
        os.close(fd)
    return RunStats(seconds, count, 0)


_SQLITE_ROWS = (
    "CREATE TABLE IF NOT EXISTS records (run_id TEXT NOT NULL, seq INTEGER NOT "
    "NULL, kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq))"
)


class HandSqlite:
    """The in-memory floor plus the four commits of a durable step, hand-written on SQLite,
    as ``SqliteStore`` commits them (``bench/README.md``, benchmark 2). One database kept
    open across runs, as the store keeps its own: a new one would measure only the dearer
    phase in which its write-ahead log still grows (research record 0015)."""

    def __init__(self, path: Path, sizes: LineSizes) -> None:
        import sqlite3  # only this floor needs it

        self.sizes = sizes
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(_SQLITE_ROWS)
        self.level = ""

    def close(self) -> None:
        self.conn.close()

    def _commit(self, wanted: str, run_id: str, seq: int, rows: list[tuple[str, bytes]]) -> int:
        """Insert ``rows`` in one transaction at ``wanted``; the next ``seq``."""
        if self.level != wanted:
            self.conn.execute(f"PRAGMA synchronous={wanted}")
            self.level = wanted
        values = ",".join(["(?, ?, ?, ?)"] * len(rows))
        params: list[Any] = []
        for kind, body in rows:
            params += [run_id, seq, kind, body.decode()]
            seq += 1
        self.conn.execute(f"INSERT INTO records VALUES {values}", params)
        return seq

    @classmethod
    async def fresh_run(cls, path: Path, sizes: LineSizes, run_id: str, steps: int) -> RunStats:
        """One run on a new database, closed after it: only the log's growing phase."""
        floor = cls(path, sizes)
        try:
            return await floor.run(run_id, steps)
        finally:
            floor.close()

    async def run(self, run_id: str, steps: int) -> RunStats:
        model, executions, sizes, commit = HandModel(steps), Counter(), self.sizes, self._commit
        seq = 0
        began = now()
        history = [("system", SYSTEM_TEXT), ("user", GOAL_TEXT)]
        for index in range(steps):
            seq = commit("FULL", run_id, seq, [("intent", sizes.line("model_intent", index))])
            tool = await model.call(history, index)
            seq = commit("NORMAL", run_id, seq, [("result", sizes.line("model_result", index))])
            history.append(("assistant", tool or "final"))
            if tool is None:
                break
            seq = commit("FULL", run_id, seq, [("intent", sizes.line("action_intent", index))])
            history.append(("user", await _hand_tool(tool, executions)))
            step_line = sizes.line("step", index)
            half = len(step_line) // 2
            seq = commit(
                "NORMAL", run_id, seq, [("result", step_line[:half]), ("step", step_line[half:])]
            )
        seconds = now() - began
        return RunStats(seconds, model.decisions.n, executions.n)
