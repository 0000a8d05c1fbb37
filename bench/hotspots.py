"""``--profile``: where a PolyLoop step spends its time (cProfile), then the pieces of a
step timed one by one without the profiler, which turns its shares into microseconds.

Profiling slows every Python call down, so the profile gives shares of a step, not
durations; and it counts each resumption of a coroutine as a call.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
from collections import defaultdict
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
    """Microseconds per call of the pieces a step is made of, and how often a step calls them.

    Some pieces are private parts of the kernel (the transcript); if they move, the row
    says so instead of failing.
    """
    return anyio.run(_pieces, ctx)


async def _pieces(ctx: Context) -> list[dict[str, Any]]:
    import hashlib

    import anyio.lowlevel
    import anyio.to_thread

    from polyloop import serialization
    from polyloop.serialization import dumps, encode, loads

    store = MemoryStore()
    agent = Agent(store, steps=None)
    await agent.run("pieces", 2)
    records = list((await store.read_log("pieces")).records[6:11])
    intent = records[2]
    lines = [dumps(record) for record in records]
    tools = agent.tools
    executor = tools.executor()
    action = Action(
        payload={"name": "noop", "arguments": {}}, action_text="noop()", history_text="noop"
    )
    history = [records[4]] * 200  # any objects: only the copy is timed

    async def execute() -> None:
        await executor.execute(action, result_id="pieces:0:action")

    async def hop() -> None:
        await anyio.to_thread.run_sync(int)

    rows: list[dict[str, Any]] = []

    async def measure(
        name: str, per_step: float, sync: Any = None, coro: Any = None, loops: int = 2_000
    ) -> None:
        samples = []
        for _ in range(5):
            began = now()
            if sync is not None:
                for _ in range(loops):
                    sync()
            else:
                for _ in range(loops):
                    await coro()
            samples.append((now() - began) / loops * 1e6)
        value = sorted(samples)[len(samples) // 2]
        rows.append(
            {
                "piece": name,
                "us_per_call": value,
                "calls_per_step": per_step,
                "us_per_step": value * per_step,
            }
        )

    check = getattr(serialization, "plain", None)
    if check is not None:
        await measure(
            "loggability check of the action payload (every action step)",
            1,
            lambda: check(action.payload, owner="Intent", field="payload"),
        )
    await measure(
        "encode of the action intent (inside dumps, durable stores)", 1, lambda: encode(intent)
    )
    await measure(
        "dumps of one step's five records (durable stores only)",
        1,
        lambda: [dumps(r) for r in records],
    )
    await measure(
        "loads of one step's five records (resume, per logged step)",
        1,
        lambda: [loads(line) for line in lines],
    )
    await measure("ToolRegistry.validate('noop', {})", 1, lambda: tools.validate("noop", {}))
    await measure(
        "registry executor: execute the no-op tool (validation included)", 1, coro=execute
    )
    await measure(
        "tuple() of the message list at step 100 (the model call's copy)", 1, lambda: tuple(history)
    )
    await measure(
        "sha256 copy + hexdigest (the intent's messages digest)",
        1,
        lambda: hashlib.sha256(b"x").copy().hexdigest(),
    )
    try:
        from polyloop import _assembly

        def extend() -> None:
            transcript = _assembly.Transcript(())
            transcript.extend(_assembly.step_messages("noop", "ok", "Observation: {observation}"))

        await measure("transcript: append one step's two messages (size + digest)", 1, extend)
    except (ImportError, AttributeError, TypeError) as exc:
        rows.append({"piece": f"transcript: not measured ({type(exc).__name__}: {exc})"})
    await measure(
        "one suspension of the instant model (anyio checkpoint)", 1, coro=anyio.lowlevel.checkpoint
    )
    await measure(
        "one worker-thread round trip (anyio.to_thread.run_sync of a no-op)", 4, coro=hop, loops=300
    )
    del ctx
    return rows
