"""The record codec on benchmark 8's records: what writing a step's records costs.

    python -m bench codec
    python -m bench codec --repeats 5 --rounds 20   # quicker, noisier

One run of benchmark 8's workload (``bench/workload.py``: ten steps, a 3 KB observation
a step) is made on ``MemoryStore``, its records are read back, and then encoded again
and again, without any store: ``dumps`` (what a database store does with each record it
writes, on the event loop), and its two halves, ``encode`` (the checked dict) and
canonical JSON. Each figure is the best of ``--repeats`` timings of ``--rounds`` passes
over the run's records, divided by its ten steps: microseconds of one core per step,
for the records of one step. Nothing here touches a disk or a thread.
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


def measure(*, repeats: int, rounds: int) -> dict[str, float]:
    records = anyio.run(recorded_run)
    encoded = [serialization.encode(record) for record in records]
    return {
        "records": len(records),
        "bytes_per_step": sum(len(serialization.dumps(r)) for r in records) / STEPS,
        "dumps_us_per_step": per_step_us(
            serialization.dumps, records, repeats=repeats, rounds=rounds
        ),
        "encode_us_per_step": per_step_us(
            serialization.encode, records, repeats=repeats, rounds=rounds
        ),
        "canonical_json_us_per_step": per_step_us(
            canonical_json, encoded, repeats=repeats, rounds=rounds
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench codec", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    figures = measure(repeats=args.repeats, rounds=args.rounds)
    print(f"{figures['records']:.0f} records, {figures['bytes_per_step']:,.0f} bytes a step")
    for name in ("dumps", "encode", "canonical_json"):
        print(f"{name:>15}: {figures[f'{name}_us_per_step']:6.1f} us a step")
    return 0
