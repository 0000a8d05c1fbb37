"""Benchmark 5: does one step cost more late in a long run than early on?

How a step is timed, and the target: ``bench/README.md``, benchmark 5.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel

from bench._common import Context, Row, median, now, settle, target
from bench.agents import GOAL_TEXT, SYSTEM_TEXT, Agent
from polyloop import Message, Role
from polyloop.stores import MemoryStore

TITLE = "5. Per-step cost early and late in one run"
COLUMNS = [
    ("name", "loop"),
    ("step", "step"),
    ("us_per_step", "us/step"),
    ("ratio_to_first", "x first point", 2),
    ("list_build_us", "message-list build us", 2),
    ("repeats", "runs"),
]
LIMIT = 2.0


def run(ctx: Context) -> dict[str, Any]:
    rows: list[Row] = anyio.run(_measure, ctx)
    first, last = ctx.sizes.scale_points[0], ctx.sizes.scale_points[-1]
    poly = {r["step"]: r for r in rows if r["key"].startswith("polyloop")}
    ratio = poly[last]["us_per_step"] / poly[first]["us_per_step"]
    targets = [
        target(
            f"per-step overhead at step {last:,} <= 2x that at step {first}",
            ratio,
            LIMIT,
            what=f"PolyLoop us/step around step {last} / around step {first}",
        )
    ]
    return {"title": TITLE, "columns": COLUMNS, "rows": rows, "targets": targets}


async def _measure(ctx: Context) -> list[Row]:
    points, window = ctx.sizes.scale_points, ctx.sizes.scale_window
    steps = max(points) + window + 2
    poly: dict[int, list[float]] = {p: [] for p in points}
    hand: dict[int, list[float]] = {p: [] for p in points}
    for repeat in range(ctx.sizes.scale_repeats):
        stamps: list[float] = []
        agent = Agent(MemoryStore(), steps=steps, stamps=stamps)
        settle()
        result = await agent.run(f"scale-{repeat}", steps)
        if result.step_count != steps or len(stamps) != steps:
            raise AssertionError(f"the scale run made {len(stamps)} calls, not {steps}")
        settle()
        hand_stamps = await _handwritten_stamps(steps)
        for point in points:
            poly[point].append(_window(stamps, point, window))
            hand[point].append(_window(hand_stamps, point, window))
    rows: list[Row] = []
    for key, name, values in (
        ("polyloop", "PolyLoop, MemoryStore", poly),
        ("floor", "hand-written asyncio loop", hand),
    ):
        first = median(values[points[0]])
        for point in points:
            value = median(values[point])
            rows.append(
                {
                    "key": f"{key}-{point}",
                    "name": name,
                    "step": point,
                    "us_per_step": value,
                    "ratio_to_first": value / first,
                    "repeats": len(values[point]),
                    "list_build_us": _list_build_us(point) if key == "polyloop" else None,
                }
            )
    return rows


def _window(stamps: list[float], point: int, window: int) -> float:
    """Median microseconds between consecutive model calls around step ``point``."""
    lo, hi = max(point - window, 0), min(point + window, len(stamps) - 2)
    gaps = [stamps[k + 1] - stamps[k] for k in range(lo, hi + 1)]
    return median(gaps) * 1e6


async def _handwritten_stamps(steps: int) -> list[float]:
    """Call times of the hand-written loop (same shape as the instant model's)."""
    stamps: list[float] = []
    history = [("system", SYSTEM_TEXT), ("user", GOAL_TEXT)]
    for index in range(steps):
        stamps.append(now())
        await anyio.lowlevel.checkpoint()
        history.append(("assistant", "noop" if index < steps - 1 else "final"))
        history.append(("user", "ok"))
    return stamps


def _list_build_us(step: int) -> float:
    """Microseconds to build the tuple of messages a model call gets at ``step``."""
    history = [Message.text(Role.SYSTEM, SYSTEM_TEXT)] * (2 + 2 * step)
    loops = max(10, 20_000 // (step + 1))
    began = now()
    for _ in range(loops):
        tuple(history)
    return (now() - began) / loops * 1e6
