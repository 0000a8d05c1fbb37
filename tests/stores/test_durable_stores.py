"""Whole runs on every durable store: many at once, and a torn tail at every byte offset."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import (
    Ledger,
    close_store,
    definition,
    make_tools,
    request,
    same_outcome,
    six_step_script,
    tool_call,
    uninterrupted,
)
from kit.store import DURABLE_KINDS, durable_opener
from polyloop import Replay, RunEnded, StepRecord, StopReason, Store, resume, run
from polyloop.stores import JsonlStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_KINDS)
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return durable_opener(request, tmp_path)


@pytest.mark.slow
async def test_300_concurrent_runs_on_one_store_object(open_store: Callable[[], Store]) -> None:
    store = open_store()
    ledger = Ledger()
    tools = make_tools(ledger)
    script = [tool_call("double", n=1), tool_call("submit", answer="2")]
    shared = definition(store, script=script)
    run_ids = [f"many-{i}" for i in range(300)]
    results: dict[str, Any] = {}

    async def one(run_id: str) -> None:
        results[run_id] = await run(shared, request(run_id, tools))

    try:
        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(one, run_id)
        for run_id in run_ids:
            assert results[run_id].stop_reason is StopReason.SUBMITTED
            log = await store.read_log(run_id)
            assert {record.run_id for record in log.records} == {run_id}
            assert len(log.records) == 12  # start, 2 x (intent, result, intent, result, step), end
            steps = [r for r in log.records if isinstance(r, StepRecord)]
            assert f"({run_id}:0:action)" in (steps[0].observation or "")
            assert isinstance(log.records[-1], RunEnded)
    finally:
        await close_store(store)
    assert len(ledger.calls) == 600


# -- a torn last line, cut at every byte --------------------------------------------------

# Write 16 of the six-step run is step 3's step record with its action result: one line
# holding both records, the longest kind of line the store writes.
CRASH_AFTER = 16


@pytest.mark.slow
async def test_a_torn_last_line_at_every_byte_offset_resumes_to_the_same_run(
    tmp_path: Path,
) -> None:
    expected = await uninterrupted(
        lambda: JsonlStore(tmp_path / "clean"), Replay.ALLOWED, six_step_script()
    )
    crashed = tmp_path / "crashed"
    first = JsonlStore(crashed)
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(first, fail_after_writes=CRASH_AFTER), script=six_step_script()),
            request("r", make_tools(Ledger(), replay=Replay.ALLOWED), model_replay=Replay.ALLOWED),
        )
    await first.aclose()
    name = f"{safe_name('r')}.jsonl"
    content = (crashed / name).read_bytes()
    last_start = content.rstrip(b"\n").rfind(b"\n") + 1
    complete_before = await _record_count(crashed, content[:last_start], name, tmp_path)

    for offset in range(1, len(content) - last_start):
        torn = content[: last_start + offset]
        assert not torn.endswith(b"\n")
        assert await _record_count(crashed, torn, name, tmp_path) == complete_before
        where = tmp_path / f"offset-{offset}"
        where.mkdir()
        (where / name).write_bytes(torn)
        store = JsonlStore(where)
        try:
            resumed = await resume(
                definition(store, script=six_step_script()),
                request(
                    "r", make_tools(Ledger(), replay=Replay.ALLOWED), model_replay=Replay.ALLOWED
                ),
            )
        finally:
            await store.aclose()
        assert same_outcome(resumed, expected), offset
        lines = (where / name).read_bytes()
        assert lines.endswith(b"\n")
        assert lines.startswith(content[:last_start])  # the torn bytes were cut, not kept
        shutil.rmtree(where)


async def _record_count(directory: Path, content: bytes, name: str, scratch: Path) -> int:
    probe = scratch / "probe"
    probe.mkdir(exist_ok=True)
    (probe / name).write_bytes(content)
    store = JsonlStore(probe)
    try:
        return len((await store.read_log("r")).records)
    finally:
        await store.aclose()
