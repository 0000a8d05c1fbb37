"""Bounded load and soak tests: many concurrent runs on one store, and one very long run.

Figures (peak memory per run, retained memory per step, resume time per logged step) are
printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import answer, close_store, definition, request, tool_call
from kit.store import DURABLE_KINDS, durable_opener
from polyloop import (
    Budget,
    Intent,
    JSONValue,
    ModelCall,
    ModelReply,
    Record,
    Result,
    RunEnded,
    RunLog,
    StepRecord,
    StopReason,
    Store,
    ToolRegistry,
    ToolSpec,
    resume,
    run,
)
from polyloop.serialization import dumps
from polyloop.stores import JsonlStore, MemoryStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

# Slow: load and soak: thousands of runs, and one of 5,000 steps.
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

STEPS = 20


# -- an instant agent -------------------------------------------------------------------


class InstantModel:
    """Calls the no-op tool until the last step, then answers. Keeps nothing it was sent.

    The reply names the run and the call, so a reply that reached the wrong run shows.
    It yields once per call, so that concurrent runs interleave.
    """

    def __init__(self, steps: int, *, on_call: Callable[[ModelCall], None] | None = None) -> None:
        self.steps = steps
        self.on_call = on_call

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "instant", "steps": self.steps}

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.lowlevel.checkpoint()
        if self.on_call is not None:
            self.on_call(call)
        last = call.call_index >= self.steps - 1
        content = answer(f"done {call.run_id}") if last else tool_call("noop")
        return ModelReply(
            call_id=f"{call.run_id}#{call.call_index}", content=content, reasoning=None
        )


async def _noop(arguments: dict[str, Any], *, result_id: str) -> str:
    return f"ok {result_id}"


NOOP_TOOLS = ToolRegistry(
    [
        ToolSpec(
            name="noop", description="Does nothing.", parameters={"type": "object"}, handler=_noop
        )
    ],
    max_observation_chars=1_000,
)


def _request(run_id: str, steps: int) -> Any:
    return request(
        run_id,
        NOOP_TOOLS,
        budget=Budget(max_steps=steps, max_valid_steps=steps, max_context_chars=10**9),
        binding={"who": run_id},
    )


async def _run_many(store: Store, run_ids: Sequence[str], steps: int) -> dict[str, Any]:
    shared = definition(store, model=InstantModel(steps))
    results: dict[str, Any] = {}

    async def one(run_id: str) -> None:
        results[run_id] = await run(shared, _request(run_id, steps))

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    return results


async def _check_isolated(store: Store, results: Mapping[str, Any], steps: int) -> None:
    """Every run finished on its own records: nothing of another run in its log."""
    for run_id, result in results.items():
        assert result.stop_reason is StopReason.FINAL_ANSWER, (run_id, result.detail)
        assert result.step_count == steps
        assert result.final_answer == f"done {run_id}"
        log = await store.read_log(run_id)
        assert {record.run_id for record in log.records} == {run_id}
        # start, (intent, result, intent, result + step) per tool step, 3 for the last, end
        assert len(log.records) == 1 + 5 * (steps - 1) + 3 + 1
        logged_steps = [r for r in log.records if isinstance(r, StepRecord)]
        assert [s.call_id for s in logged_steps] == [f"{run_id}#{k}" for k in range(steps)]
        for k, step in enumerate(logged_steps[:-1]):
            assert step.observation == f"ok {run_id}:{k}:action"
        for record in log.records:
            result_id = getattr(record, "result_id", None)
            assert result_id is None or result_id.startswith(f"{run_id}:")
        assert isinstance(log.records[-1], RunEnded)


# -- 2,000 concurrent runs in memory -----------------------------------------------------

MEMORY_RUNS = 2_000


async def test_2000_concurrent_runs_of_20_steps_in_memory(anyio_backend: str) -> None:
    store = MemoryStore()
    run_ids = [f"mem-{i:04d}" for i in range(MEMORY_RUNS)]
    gc.collect()
    tracemalloc.start()
    began = time.perf_counter()
    try:
        results = await _run_many(store, run_ids, STEPS)
        elapsed = time.perf_counter() - began
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    await _check_isolated(store, results, STEPS)
    per_run_peak, per_run_kept = peak / MEMORY_RUNS, retained / MEMORY_RUNS
    print(
        f"\n{MEMORY_RUNS} runs x {STEPS} steps in memory ({anyio_backend}): "
        f"{elapsed:.1f}s under tracemalloc; peak {peak / 2**20:.1f} MiB = "
        f"{per_run_peak / 1024:.1f} KiB per run; retained after the runs "
        f"{per_run_kept / 1024:.1f} KiB per run (the store's 100 records and the result)"
    )
    # Generous: a run's records and transient state are a few tens of KiB. A leak of the
    # history per call (quadratic) or of whole contexts would blow far past this.
    assert per_run_peak < 512 * 1024


# -- 300 concurrent runs on each durable store ---------------------------------------------

# 300 runs x 20 steps, measured on a busy two-core machine, per backend: JSON lines
# 5-10 s, SQLite 12-17 s, PostgreSQL 12-23 s. All under 30 s, so the full 20 steps stay.
DURABLE_RUNS = 300


@pytest.fixture(params=DURABLE_KINDS)
def open_durable(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return durable_opener(request, tmp_path)


async def test_300_concurrent_runs_of_20_steps_on_each_durable_store(
    open_durable: Callable[[], Store], anyio_backend: str
) -> None:
    store = open_durable()
    run_ids = [f"durable-{i:03d}" for i in range(DURABLE_RUNS)]
    began = time.perf_counter()
    try:
        results = await _run_many(store, run_ids, STEPS)
        elapsed = time.perf_counter() - began
        await _check_isolated(store, results, STEPS)
    finally:
        await close_store(store)
    # A new store object on the same data reads the same logs.
    reopened = open_durable()
    try:
        for run_id in run_ids[:: DURABLE_RUNS // 10]:
            log = await reopened.read_log(run_id)
            assert len(log.records) == 1 + 5 * (STEPS - 1) + 3 + 1
    finally:
        await close_store(reopened)
    print(
        f"\n{DURABLE_RUNS} runs x {STEPS} steps on {type(store).__name__} ({anyio_backend}): "
        f"{elapsed:.1f}s "
        f"({elapsed / (DURABLE_RUNS * STEPS) * 1e3:.2f} ms per step)"
    )


# -- soak: one run of 5,000 steps ----------------------------------------------------------

SOAK_STEPS = 5_000
EARLY, LATE = 1_000, SOAK_STEPS - 1


async def test_one_run_of_5000_steps_keeps_no_more_than_its_history(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Memory grows with the history the run must keep, and by no more per step.

    The loop keeps, per step, its step record and the two transcript messages built from
    it; the store keeps nothing (it is on disk). Traced memory is sampled when the model
    is called for step 1,000 and for the last step. Two checks, both with wide margins:

    * the memory added per step between the two samples is at most twice the memory per
      step at the first sample (which also carries the run's fixed cost); retaining
      anything that grows with the history at every step (a context per call, say)
      makes the later steps cost several times more than the early ones;
    * the memory added per step is below a fixed bound, many times the size of the
      step's own records.
    """
    samples: dict[int, int] = {}

    def sample(call: ModelCall) -> None:
        if call.call_index in (EARLY, LATE):
            gc.collect()
            samples[call.call_index] = tracemalloc.get_traced_memory()[0]

    store = JsonlStore(tmp_path / "runs")
    shared = definition(store, model=InstantModel(SOAK_STEPS, on_call=sample))
    gc.collect()
    tracemalloc.start()
    began = time.perf_counter()
    try:
        result = await run(shared, _request("soak", SOAK_STEPS))
    finally:
        elapsed = time.perf_counter() - began
        tracemalloc.stop()
        await store.aclose()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.step_count == SOAK_STEPS
    log = (tmp_path / "runs" / f"{safe_name('soak')}.jsonl").read_bytes()
    assert log.count(b"\n") == 2 + 4 * (SOAK_STEPS - 1) + 3
    encoded_step = len(log) / SOAK_STEPS  # bytes of one step's records on disk
    early = samples[EARLY] / EARLY
    late = (samples[LATE] - samples[EARLY]) / (LATE - EARLY)
    print(
        f"\nsoak ({anyio_backend}): {SOAK_STEPS} steps on JsonlStore in {elapsed:.1f}s under "
        f"tracemalloc; "
        f"traced memory {samples[EARLY] / 2**20:.2f} MiB at step {EARLY}, "
        f"{samples[LATE] / 2**20:.2f} MiB at step {LATE}; {early:.0f} B per step up to "
        f"{EARLY}, {late:.0f} B per step after it; {encoded_step:.0f} B of log per step"
    )
    assert late <= 2 * early
    assert late <= max(16 * 1024, 8 * encoded_step)


# -- resume time against log length --------------------------------------------------------

RESUME_SIZES = (1_000, 5_000, 20_000)


class CountingStore:
    """Passes everything to ``inner`` and counts ``read_log`` calls."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.reads = 0

    def parameters(self) -> Mapping[str, JSONValue]:
        return self.inner.parameters()

    async def read_log(self, run_id: str) -> RunLog:
        self.reads += 1
        return await self.inner.read_log(run_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _step_template() -> list[Record]:
    """The five records the kernel writes for one tool step of the instant agent."""
    store = MemoryStore()
    await run(definition(store, model=InstantModel(2)), _request("template", 2))
    records = list((await store.read_log("template")).records)
    assert [type(r) for r in records[1:6]] == [Intent, Result, Intent, Result, StepRecord]
    return records[1:6]


def _renumbered(template: Sequence[Record], run_id: str, k: int) -> Iterator[str]:
    """The lines of step ``k`` of ``run_id``, copied from ``template``."""
    intent_m, result_m, intent_a, result_a, step = template
    model_id, action_id = f"{run_id}:{k}:model", f"{run_id}:{k}:action"
    yield dumps(
        dataclasses.replace(intent_m, run_id=run_id, result_id=model_id, step=k, call_index=k)
    )
    yield dumps(dataclasses.replace(result_m, run_id=run_id, result_id=model_id))
    yield dumps(
        dataclasses.replace(intent_a, run_id=run_id, result_id=action_id, step=k, call_index=k)
    )
    action = dumps(dataclasses.replace(result_a, run_id=run_id, result_id=action_id))
    yield f"[{action},{dumps(dataclasses.replace(step, run_id=run_id, step=k))}]"


async def _logged_run(directory: Path, template: Sequence[Record], size: int) -> bytes:
    """A JSON-lines log of ``size`` finished steps that stopped before its end record.

    The start record is the genuine one (``run`` through a store that fails every write
    after it), so that ``resume`` finds the same identity; the steps are renumbered
    copies of a real step, written in the store's documented format in bulk.
    """
    run_id = f"resume-{size}"
    store = JsonlStore(directory)
    try:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=1), model=InstantModel(size + 1)),
                _request(run_id, size),
            )
    finally:
        await store.aclose()
    path = directory / f"{safe_name(run_id)}.jsonl"
    started = path.read_bytes()
    assert started.count(b"\n") == 1
    body = "".join(f"{line}\n" for k in range(size) for line in _renumbered(template, run_id, k))
    return started + body.encode("utf-8")


async def test_resume_reads_a_log_once_whatever_its_length(tmp_path: Path) -> None:
    """Every resume reads the whole log once, rebuilds the transcript from the step
    records, finds the budget spent and writes the end record, at 1k, 5k and 20k steps.

    How resume time grows with the log is a speed figure, measured by benchmark 4
    (``bench/recovery.py``), not here: timed assertions fail on a busy machine.
    """
    template = await _step_template()
    directory = tmp_path / "runs"
    for size in RESUME_SIZES:
        run_id = f"resume-{size}"
        path = directory / f"{safe_name(run_id)}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(await _logged_run(directory, template, size))
        store = CountingStore(JsonlStore(directory))
        try:
            result = await resume(
                definition(store, model=InstantModel(size + 1)), _request(run_id, size)
            )
        finally:
            await close_store(store.inner)
        assert result.resumed
        assert result.stop_reason is StopReason.STEP_LIMIT
        assert result.step_count == size
        assert store.reads == 1, f"resume read a log of {size} steps {store.reads} times"
