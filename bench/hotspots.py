"""``--profile``: where a PolyLoop step spends its time (cProfile), then the pieces of a
step timed one by one without the profiler, which turns its shares into microseconds.

Profiling slows every Python call down, so the profile gives shares of a step, not
durations; and it counts each resumption of a coroutine as a call.
"""

from __future__ import annotations

import contextlib
import cProfile
import inspect
import pstats
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import anyio

from bench._common import Context, now
from bench._sampling import source_name
from bench.agents import Agent
from bench.report import print_table
from polyloop.ports import Action
from polyloop.stores import MemoryStore

TOP = 20
SHARE_COLUMNS = [("own_pct", "own time %", 1), ("calls_per_step", "calls/step", 2)]
PIECE_COLUMNS = [
    ("piece", "piece"),
    ("us_per_call", "us/call", 2),
    ("calls_per_step", "calls/step", 0),
    ("us_per_step", "us/step", 2),
]


def run(ctx: Context) -> dict[str, Any]:
    report: dict[str, Any] = {}
    steps = ctx.sizes.overhead_steps
    for kind in ("memory", "jsonl"):
        profiler = cProfile.Profile()
        anyio.run(_runs, ctx, kind, steps, profiler)
        stats = pstats.Stats(profiler)
        report[kind] = _summarise(stats, steps * 5)
        for what, key, count in (("function", "functions", TOP), ("file", "files", 12)):
            print_table(
                f"Profile of PolyLoop on {kind}: share of own time per {what}",
                [(what, what), *SHARE_COLUMNS],
                [
                    {**item, "own_pct": item["own_share"] * 100}
                    for item in report[kind][key][:count]
                ],
            )
    report["pieces"] = pieces(ctx)
    print_table(
        "Pieces of a step, timed one by one (median of 5 batches)", PIECE_COLUMNS, report["pieces"]
    )
    return report


async def _runs(ctx: Context, kind: str, steps: int, profiler: cProfile.Profile) -> None:
    async with contextlib.AsyncExitStack() as stack:
        agent = Agent(await ctx.open_store(stack, kind), steps=steps)
        await agent.run("profile-warmup", steps)
        profiler.enable()
        for index in range(5):
            await agent.run(f"profile-{index}", steps)
        profiler.disable()


def _summarise(stats: pstats.Stats, total_steps: int) -> dict[str, Any]:
    raw: Any = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values())
    functions = []
    per_file: dict[str, float] = defaultdict(float)
    for (filename, line, name), (_, calls, own, cumulative, _) in raw.items():
        short = source_name(filename)
        per_file[short] += own
        functions.append(
            {
                "function": f"{short}:{line}({name})",
                "calls_per_step": calls / total_steps,
                "own_share": own / total,
                "cumulative_share": cumulative / total,
            }
        )
    functions.sort(key=lambda f: f["own_share"], reverse=True)
    files = sorted(
        ({"file": f, "own_share": t / total} for f, t in per_file.items()),
        key=lambda f: f["own_share"],
        reverse=True,
    )
    return {"functions": functions[:TOP], "files": files[:TOP]}


# -- what single pieces of a step cost, timed one by one --------------------------------------


def pieces(ctx: Context) -> list[dict[str, Any]]:
    """Microseconds per call of the pieces a step is made of, and how often a step calls
    them (some are private parts of the kernel, timed as the kernel calls them)."""
    return anyio.run(_pieces)


async def _pieces() -> list[dict[str, Any]]:
    import hashlib

    import anyio.lowlevel
    import anyio.to_thread

    from polyloop import _assembly
    from polyloop.serialization import dumps, encode, loads, plain

    store = MemoryStore()
    agent = Agent(store, steps=None)
    await agent.run("pieces", 2)
    records = list((await store.read_log("pieces")).records[6:11])
    lines = [dumps(record) for record in records]
    executor = agent.tools.executor()
    action = Action(
        payload={"name": "noop", "arguments": {}}, action_text="noop()", history_text="noop"
    )
    history = [records[4]] * 200  # any objects: only the copy is timed

    def extend() -> None:
        transcript = _assembly.Transcript(())
        transcript.extend(_assembly.step_messages("noop", "ok", "Observation: {observation}"))

    once_a_step = {
        "loggability check of the action payload (every action step)": lambda: plain(
            action.payload, owner="Intent", field="payload"
        ),
        "encode of the action intent (inside dumps, durable stores)": lambda: encode(records[2]),
        "dumps of one step's five records (durable stores only)": lambda: list(map(dumps, records)),
        "loads of one step's five records (resume, per logged step)": lambda: list(
            map(loads, lines)
        ),
        "ToolRegistry.validate('noop', {})": lambda: agent.tools.validate("noop", {}),
        "registry executor: execute the no-op tool (validation included)": lambda: executor.execute(
            action, result_id="pieces:0:action"
        ),
        "tuple() of the message list at step 100 (the model call's copy)": lambda: tuple(history),
        "sha256 copy + hexdigest (the intent's messages digest)": lambda: (
            hashlib.sha256(b"x").copy().hexdigest()
        ),
        "transcript: append one step's two messages (size + digest)": extend,
        "one suspension of the instant model (anyio checkpoint)": anyio.lowlevel.checkpoint,
    }
    rows = [await _piece(name, work) for name, work in once_a_step.items()]
    hop = "one worker-thread round trip (anyio.to_thread.run_sync of a no-op)"
    rows.append(await _piece(hop, lambda: anyio.to_thread.run_sync(int), per_step=4, loops=300))
    return rows


async def _piece(
    name: str, work: Callable[[], Any], *, per_step: int = 1, loops: int = 2_000
) -> dict[str, Any]:
    """What ``work`` costs a call (awaited if it is a coroutine function): the median of
    five batches of ``loops`` calls, in microseconds; and a step, which calls it ``per_step``
    times."""
    sync = not inspect.isawaitable(first := work())
    if not sync:
        await first
    samples = []
    for _ in range(5):
        began = now()
        for _ in range(loops):
            if sync:
                work()
            else:
                await work()
        samples.append((now() - began) / loops * 1e6)
    value = sorted(samples)[len(samples) // 2]
    return {
        "piece": name,
        "us_per_call": value,
        "calls_per_step": per_step,
        "us_per_step": value * per_step,
    }
