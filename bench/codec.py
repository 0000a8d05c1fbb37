"""Benchmark 11: the record codec on benchmark 8's records, what writing a step's records
costs the event loop of a database store, with no store (``bench/README.md``, 11).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from bench.workload import Workload
from polyloop import serialization
from polyloop._shared import canonical_json
from polyloop.stores import MemoryStore
from polyloop.types import Record

STEPS = 10


async def recorded_run() -> tuple[Record, ...]:
    """The records of one run of benchmark 8's workload, as a store holds them."""
    store = MemoryStore()
    workload = Workload(store, steps=STEPS, latency_s=0.0, tool_s=0.0)
    await workload.run("codec")
    return (await store.read_log("codec")).records


def per_step_us(
    work: Callable[[Any], Any], items: Sequence[Any], *, repeats: int, rounds: int
) -> float:
    """The best of ``repeats`` timings of ``rounds`` passes over ``items``, per step."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(rounds):
            for item in items:
                work(item)
        best = min(best, (time.perf_counter() - start) / rounds)
    return best / STEPS * 1e6


def as_written(record_after: tuple[Record, Record | None]) -> str:
    """A record as a store writes it: after the record before it in the same write, so a
    step after its action's result names the result's observation (record 0063)."""
    record, after = record_after
    return serialization.dumps(record, after=after)


def measure(*, repeats: int, rounds: int) -> dict[str, float]:
    records = anyio.run(recorded_run)
    # Every record is encoded after the one before it, as a store writes a step after its
    # result; the other records ignore what comes before them.
    pairs = list(zip(records, (None, *records[:-1]), strict=True))
    encoded = [serialization.encode(record, after=after) for record, after in pairs]
    return {
        "records": len(records),
        "bytes_per_step": sum(len(as_written(pair).encode()) for pair in pairs) / STEPS,
        "whole_bytes_per_step": sum(len(serialization.dumps(r).encode()) for r in records) / STEPS,
        "dumps_us_per_step": per_step_us(as_written, pairs, repeats=repeats, rounds=rounds),
        "encode_us_per_step": per_step_us(
            lambda pair: serialization.encode(pair[0], after=pair[1]),
            pairs,
            repeats=repeats,
            rounds=rounds,
        ),
        "canonical_json_us_per_step": per_step_us(
            canonical_json, encoded, repeats=repeats, rounds=rounds
        ),
    }


OUTPUT = None
TITLE = "11. The record codec on benchmark 8's records"
COLUMNS = [("name", "work"), ("us_per_step", "us/step", 1)]


def options(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--repeats", type=int, default=15, help="timings; the best is kept")
    parser.add_argument("--rounds", type=int, default=200, help="passes over the records a timing")


def run(args: argparse.Namespace) -> dict[str, Any]:
    figures = measure(repeats=args.repeats, rounds=args.rounds)
    rows = [
        {"name": name, "us_per_step": figures[f"{name}_us_per_step"]}
        for name in ("dumps", "encode", "canonical_json")
    ]
    title = (
        f"{TITLE}: {figures['records']:.0f} records, {figures['bytes_per_step']:,.0f} bytes a "
        f"step ({figures['whole_bytes_per_step']:,.0f} with every record whole)"
    )
    return {"title": title, "columns": COLUMNS, "rows": rows, **figures}
