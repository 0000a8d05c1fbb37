"""``polyloop worker`` processes together: a worker killed inside a payment leaves a
doubt the next worker settles through the tool's probe; two workers share many runs on
one PostgreSQL database, each run driven by one of them at a time; a run a web request
starts is driven by the worker that hosts its agent and left alone by one that does not.

The outside world is the ledger of :mod:`kit.worker_app`, which every process appends
to and syncs, so it tells what happened whatever became of the process that did it.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from kit import worker_process
from kit.hosting import eventually
from kit.worker_process import STORES, WorkerApp, http_served, web_app
from polyloop import (
    Intent,
    IntentKind,
    Replay,
    RunStarted,
    RunState,
    Settlement,
    StopReason,
    run_status,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(params=STORES)
def apps(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., WorkerApp]]:
    with worker_process.apps(request, tmp_path) as make:
        yield make


async def _finished(store: Any, run_id: str) -> bool:
    return (await run_status(store, run_id)).state is RunState.FINISHED


async def test_a_worker_killed_after_paying_leaves_a_doubt_the_next_settles_by_the_probe(
    apps: Callable[..., WorkerApp], anyio_backend: str
) -> None:
    # The payment is made and synced; the call then holds until the process is killed.
    app = apps(gated=True, WORKER_HOLD="after", WORKER_PROBE="1")
    async with app.store() as store:
        await app.agent(store).start("r1", {})
        first = app.worker(backend=anyio_backend)
        await eventually(lambda: app.paid() == ["r1:0:action"], timeout_s=30, what="the payment")
        first.kill()
        assert await first.exit_status() < 0  # killed by the signal, nothing written after
        [*_, last] = (await store.read_log("r1")).records
        assert isinstance(last, Intent)  # the payment was announced; its outcome never was
        assert (last.kind, last.result_id, last.replay) == (
            IntentKind.ACTION,
            "r1:0:action",
            Replay.NEVER,
        )
        second = app.worker(backend=anyio_backend)
        took = await eventually(
            lambda: _finished(store, "r1"), timeout_s=30, what="the next worker finishing r1"
        )
        await second.stop()
        status = await run_status(store, "r1")
        records = (await store.read_log("r1")).records
    print(f"\nkilled -> finished by the next worker: {took:.2f} s")
    assert status.stop_reason is StopReason.FINAL_ANSWER
    assert status.reconciled_steps == (0,)
    [settlement] = [record for record in records if isinstance(record, Settlement)]
    assert (settlement.result_id, settlement.ran, settlement.by) == (
        "r1:0:action",
        True,
        "reconcile:pay",
    )
    # One payment, by the killed worker; the next one only asked the probe.
    assert app.paid() == ["r1:0:action"]
    assert [(entry.what, entry.pid) for entry in app.entries()] == [
        ("entered", first.pid),
        ("paid", first.pid),
        ("probed", second.pid),
    ]
    assert [facts["why"] for facts in first.of("r1", "driving")] == ["new"]
    assert [facts["why"] for facts in second.of("r1", "driving")] == ["probe"]
    assert [facts["stop_reason"] for facts in second.of("r1", "stopped")] == ["final_answer"]


RUNS = 200
PAYMENTS = 2


@pytest.mark.parametrize("apps", ["postgresql"], indirect=True)
async def test_two_workers_on_one_postgresql_database_share_200_runs_one_writer_each(
    apps: Callable[..., WorkerApp], anyio_backend: str
) -> None:
    # A lease long enough that a loaded machine's stalls never hand a run over.
    app = apps(WORKER_PAYMENTS=str(PAYMENTS), WORKER_LEASE_S="15")
    other_backend = "trio" if anyio_backend == "asyncio" else "asyncio"
    workers = [
        app.worker("--concurrency", "8", backend=anyio_backend),
        app.worker("--concurrency", "8", backend=other_backend),
    ]
    await eventually(
        lambda: all(worker.serving() for worker in workers), timeout_s=30, what="both serving"
    )
    runs = [f"run-{index:03}" for index in range(RUNS)]
    began = time.monotonic()
    async with app.store() as store:
        agent = app.agent(store)
        limiter = anyio.CapacityLimiter(8)

        async def start(run_id: str) -> None:
            async with limiter:
                await agent.start(run_id, {"n": PAYMENTS})

        # Started from several tasks at once, as an application's requests would.
        async with anyio.create_task_group() as group:
            for run_id in runs:
                group.start_soon(start, run_id)
        started_s = time.monotonic() - began
        await eventually(lambda: _none_unfinished(store), timeout_s=240, what="every run finishing")
        finished_s = time.monotonic() - began
        for worker in workers:
            await worker.stop()
        statuses = [await run_status(store, run_id) for run_id in runs]
    print(
        f"\n{RUNS} runs of {PAYMENTS + 1} steps on two workers ({anyio_backend}, "
        f"{other_backend}): started in {started_s:.2f} s, all finished after {finished_s:.2f} s"
    )
    assert all(status.state is RunState.FINISHED for status in statuses)
    assert all(status.stop_reason is StopReason.FINAL_ANSWER for status in statuses)
    # The ledger: every step of every run ran once, start to end in one process.
    by_run: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    for entry in app.entries():
        by_run[entry.run_id].append((entry.what, entry.step, entry.pid))
    assert sorted(by_run) == runs
    pids = {worker.pid for worker in workers}
    for run_id, entries in by_run.items():
        steps = [(what, step) for what, step, _ in entries]
        expected = [(what, step) for step in range(PAYMENTS) for what in ("entered", "paid")]
        assert steps == expected, run_id
        assert len({pid for _, _, pid in entries}) == 1, f"{run_id} changed hands: {entries}"
        assert entries[0][2] in pids
    # What the workers said: each run driven once, by one of them, and both drove runs.
    driving = Counter(
        facts["run_id"]
        for worker in workers
        for facts in worker.said()
        if facts["event"] == "driving"
    )
    assert driving == Counter(runs)
    shares = [len([f for f in worker.said() if f["event"] == "driving"]) for worker in workers]
    print(f"runs driven by each worker: {shares}")
    assert all(share > 0 for share in shares)
    for worker in workers:
        ran = {entry.run_id for entry in app.entries() if entry.pid == worker.pid}
        assert ran == {facts["run_id"] for facts in worker.said() if facts["event"] == "driving"}


async def _none_unfinished(store: Any) -> bool:
    return not await store.list_runs(unfinished_only=True)


async def test_a_run_a_web_request_starts_is_driven_by_the_worker_hosting_its_agent(
    apps: Callable[..., WorkerApp], anyio_backend: str
) -> None:
    app = apps()
    # A worker of the same store that hosts another agent only: it must leave the run be.
    foreign = app.worker(target="kit.worker_app:others", backend=anyio_backend)
    await eventually(foreign.serving, timeout_s=30, what="the foreign worker serving")
    async with app.store() as store, http_served(web_app(app.agent(store)), anyio_backend) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post("/runs/web-1", json={"n": 3})
        assert (response.status_code, response.json()) == (
            202,
            {"run_id": "web-1", "agent": "payer"},
        )
        await anyio.sleep(1.0)  # ten of the foreign worker's polls
        [started] = (await store.read_log("web-1")).records
        assert isinstance(started, RunStarted)
        assert (started.agent, started.input) == ("payer", {"n": 3})
        host = app.worker(backend=anyio_backend)
        await eventually(lambda: _finished(store, "web-1"), timeout_s=30, what="web-1 finishing")
        await anyio.sleep(0.5)  # the foreign worker lists the finished run no more
        for worker in (host, foreign):
            await worker.stop()
    assert app.paid() == ["web-1:0:action"]
    assert {entry.pid for entry in app.entries()} == {host.pid}
    assert [facts["event"] for facts in host.of("web-1")] == ["driving", "stopped"]
    assert foreign.of("web-1") == []
    foreign_said = foreign.said()
    assert [facts["event"] for facts in foreign_said] == ["serving", "draining"]
    assert "'other'" in foreign_said[0]["message"]
