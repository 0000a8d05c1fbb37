"""One writer per run while two workers are alive: claim before read, and the fences.

Worker A drives a run and is held at a chosen point (inside the model call, inside the
tool, or before or after any of its store writes); worker B, another store object over
the same data (the same object for the memory store), resumes the run meanwhile. B must
get ``RunLocked`` before it reads, decides or executes anything; A must end normally;
the log must read back valid; and no effect may have run twice.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import one_writer, pg
from kit.sweep import every_point
from polyloop import (
    Replay,
    RunLocked,
    RunResult,
    RunState,
    StopReason,
    Store,
    resume,
    run,
    run_status,
)
from polyloop.stores import MemoryStore, PostgresStore
from polyloop.testing.store_contract import apply, sample_run

pytestmark = pytest.mark.anyio

KINDS = ["memory", "jsonl", "sqlite", "postgresql"]
# The records of the one-step run, in order.
RECORDS = ["RunStarted", "Intent", "Result", "Intent", "Result", "StepRecord", "RunEnded"]
# The store calls of the one-step run, in order.
WRITES = ["start_run", "write_intent", "write_result", "write_intent", "write_step", "end_run"]


class Stores:
    """Opens store objects over one set of data (the memory store: one shared object)."""

    def __init__(self, kind: str, location: str, schema: str) -> None:
        self.kind, self.location, self.schema = kind, location, schema
        self._memory = MemoryStore()
        self.opened: list[Any] = []

    def open(self) -> Store:
        store: Store = (
            self._memory
            if self.kind == "memory"
            else one_writer.open_store(self.kind, self.location, self.schema)
        )
        self.opened.append(store)
        return store

    async def close(self) -> None:
        for store in self.opened:
            await store.aclose()  # type: ignore[attr-defined]


@pytest.fixture(params=KINDS)
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    kind = request.param
    location, schema = str(tmp_path / "runs"), ""
    if kind == "sqlite":
        location = str(tmp_path / "runs.db")
    elif kind == "postgresql":
        location = request.getfixturevalue("postgres_shared")
        schema = request.getfixturevalue("postgres_schemas")()
    return Stores(kind, location, schema)


class Held:
    """A store wrapper that holds the run at one write: before it, or once it landed."""

    def __init__(self, inner: Store, at: int, *, after: bool) -> None:
        self.inner = inner
        self.at, self.after = at, after
        self.gate = one_writer.Gate()
        self.count = 0

    def parameters(self) -> Any:
        return self.inner.parameters()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name not in WRITES:
            return method

        async def held(*args: Any) -> Any:
            self.count += 1
            if self.count == self.at and not self.after:
                await self.gate.hold()
            outcome = await method(*args)
            if self.count == self.at and self.after:
                await self.gate.hold()
            return outcome

        return held


async def _while_held(
    stores: Stores,
    a_store: Store,
    gate: one_writer.Gate,
    replay: Replay,
    ledger: list[str],
    *,
    a_gates: dict[str, one_writer.Gate],
) -> tuple[RunResult, RunResult | RunLocked]:
    """Run A until ``gate`` holds it, resume through B, let A go; both outcomes."""
    note = ledger.append
    registry = one_writer.tools(note, replay, a_gates.get("tool"))
    a_definition = one_writer.definition(a_store, note, a_gates.get("model"))
    outcomes: dict[str, Any] = {}

    async def worker_a() -> None:
        outcomes["a"] = await run(a_definition, one_writer.request("r", registry, replay))

    async with anyio.create_task_group() as group:
        group.start_soon(worker_a)
        with anyio.fail_after(10):
            await gate.entered.wait()
        b_store = stores.open()
        try:
            outcomes["b"] = await resume(
                one_writer.definition(b_store, note),
                one_writer.request("r", one_writer.tools(note, replay), replay),
            )
        except RunLocked as exc:
            outcomes["b"] = exc
        gate.go.set()
    return outcomes["a"], outcomes["b"]


async def _check_log(stores: Stores, replay: Replay = Replay.ALLOWED) -> None:
    """The log reads back whole and valid, and a later resume only reads it."""
    reader = stores.open()
    status = await run_status(reader, "r")  # type: ignore[arg-type]
    assert status.state is RunState.FINISHED
    assert status.stop_reason is StopReason.SUBMITTED
    log = await reader.read_log("r")
    assert [type(record).__name__ for record in log.records] == RECORDS
    later = await resume(
        one_writer.definition(reader, lambda _: None),
        one_writer.request("r", one_writer.tools(lambda _: None, replay), replay),
    )
    assert later.stop_reason is StopReason.SUBMITTED
    assert (await reader.read_log("r")).records == log.records


@pytest.mark.parametrize("effect", ["model call", "tool allowed", "tool never"])
async def test_a_second_worker_never_touches_a_run_a_live_worker_drives(
    stores: Stores, effect: str
) -> None:
    """The reproductions: B resumes while A is inside its model call or its tool."""
    gate = one_writer.Gate()
    replay = Replay.NEVER if effect == "tool never" else Replay.ALLOWED
    ledger: list[str] = []
    where = "model" if effect == "model call" else "tool"
    a, b = await _while_held(stores, stores.open(), gate, replay, ledger, a_gates={where: gate})
    assert isinstance(b, RunLocked) and b.run_id == "r"
    assert a.stop_reason is StopReason.SUBMITTED and a.step_count == 1
    # A alone ran each effect, once.
    assert ledger == ["model r:0:model", "tool r:0:action"]
    await _check_log(stores, replay)
    await stores.close()


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize(
    "at",
    every_point(range(1, len(WRITES) + 1)),
    ids=[f"{n}-{name}" for n, name in enumerate(WRITES, start=1)],
)
async def test_every_point_of_a_step_keeps_the_second_worker_out(
    stores: Stores, at: int, after: bool
) -> None:
    """B resumes while A is held before or after each of its writes, in this process."""
    a_store = Held(stores.open(), at, after=after)
    ledger: list[str] = []
    a, b = await _while_held(
        stores,
        a_store,
        a_store.gate,
        Replay.ALLOWED,
        ledger,  # type: ignore[arg-type]
        a_gates={},
    )
    assert a.stop_reason is StopReason.SUBMITTED
    if WRITES[at - 1] == "end_run" and after:
        # A's end record landed, and with it A gave the claim up: B may claim the run,
        # and finds it finished, so it only reads the recorded result.
        assert isinstance(b, RunResult) and b.stop_reason is StopReason.SUBMITTED
    else:
        assert isinstance(b, RunLocked)
    assert ledger == ["model r:0:model", "tool r:0:action"]
    await _check_log(stores)
    await stores.close()


# Where A is held while B, in a child process, resumes: inside an effect, or before or
# after one of A's writes.
POINTS = [("model", 0, False), ("tool", 0, False)] + [
    ("write", at, after) for at in range(1, len(WRITES) + 1) for after in (False, True)
]
POINT_IDS = ["inside the model call", "inside the tool"] + [
    f"{'after' if after else 'before'} {at}-{WRITES[at - 1]}" for _, at, after in POINTS[2:]
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "sqlite", "postgresql"])
@pytest.mark.parametrize("point", POINTS, ids=POINT_IDS)
async def test_a_second_worker_in_another_process_is_kept_out(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, point: tuple[str, int, bool]
) -> None:
    """As above, with B in a child process; every effect is counted in a file."""
    location, schema = str(tmp_path / ("runs.db" if kind == "sqlite" else "runs")), ""
    if kind == "postgresql":
        location = request.getfixturevalue("postgres_shared")
        schema = request.getfixturevalue("postgres_schemas")()
    stores = Stores(kind, location, schema)
    where, at, after = point
    gate = one_writer.Gate()
    a_store: Any = stores.open()
    if where == "write":
        a_store = Held(a_store, at, after=after)
        gate = a_store.gate
    ledger = tmp_path / "ledger"
    note = one_writer.file_note(str(ledger))
    registry = one_writer.tools(note, Replay.ALLOWED, gate if where == "tool" else None)
    definition = one_writer.definition(a_store, note, gate if where == "model" else None)
    outcome: dict[str, RunResult] = {}

    async def worker_a() -> None:
        outcome["a"] = await run(definition, one_writer.request("r", registry, Replay.ALLOWED))

    async with anyio.create_task_group() as group:
        group.start_soon(worker_a)
        with anyio.fail_after(10):
            await gate.entered.wait()
        child = await anyio.run_process(
            [
                sys.executable,
                one_writer.__file__,
                kind,
                location,
                schema,
                "r",
                "allowed",
                str(ledger),
            ],
            check=False,
        )
        gate.go.set()
    assert child.returncode == 0, child.stderr.decode(errors="replace")
    # Once A's end record landed, A has given the claim up: B only reads the result.
    finished = where == "write" and at == len(WRITES) and after
    assert child.stdout.decode().strip() == ("submitted" if finished else "locked")
    assert outcome["a"].stop_reason is StopReason.SUBMITTED
    assert ledger.read_text().splitlines() == ["model r:0:model", "tool r:0:action"]
    await _check_log(stores)
    await stores.close()


# -- PostgreSQL: a claim lives on a connection ----------------------------------------------


def _terminate_sessions(conninfo: str) -> int:
    """End the writer and owner sessions of this test's database: what the server does
    when a worker's host loses the network, or its process dies."""
    with pg.admin(conninfo) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name IN ('polyloop-writer', 'polyloop-owner')"
        ).fetchall()
    return len(rows)


@pytest.mark.slow
@pytest.mark.parametrize("replay", [Replay.ALLOWED, Replay.NEVER], ids=str)
@pytest.mark.parametrize(
    "at",
    [2, 3, 4],
    ids=["after the model intent", "after the model result", "after the action intent"],
)
async def test_terminated_sessions_keep_other_workers_out_and_the_owner_goes_on(
    postgres_conninfo: str, at: int, replay: Replay
) -> None:
    """A's sessions are ended between two of its writes: its lock goes with them, but A
    may still start the effect it announced, so B may not take the run (research record
    0034). A, let go, writes on through new connections (0035) and finishes the run;
    every effect ran once."""
    first = PostgresStore(postgres_conninfo)
    a_store = Held(first, at, after=True)
    ledger: list[str] = []
    note = ledger.append
    registry = one_writer.tools(note, replay)
    outcome: dict[str, Any] = {}
    a_done = anyio.Event()

    async def worker_a() -> None:
        outcome["a"] = await run(
            one_writer.definition(a_store, note),  # type: ignore[arg-type]
            one_writer.request("r", registry, replay),
        )
        a_done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(worker_a)
        with anyio.fail_after(10):
            await a_store.gate.entered.wait()
        assert await anyio.to_thread.run_sync(_terminate_sessions, postgres_conninfo) == 2
        async with PostgresStore(postgres_conninfo) as second:
            with pytest.raises(RunLocked):
                await second.claim_run("r")
            a_store.gate.go.set()
            with anyio.fail_after(10):
                await a_done.wait()
            log = (await second.read_log("r")).records
            status = await run_status(second, "r")
    assert outcome["a"].stop_reason is StopReason.SUBMITTED
    assert status.state is RunState.FINISHED
    assert [type(record).__name__ for record in log] == RECORDS
    assert ledger == ["model r:0:model", "tool r:0:action"]
    await first.aclose()


async def test_a_write_under_a_superseded_claim_epoch_is_refused_atomically(
    postgres_conninfo: str,
) -> None:
    """The second line of defence: each write checks, in its own statement, that the
    run's claim epoch is still the writer's. A claim moved on by someone else (here by
    hand, as a taken-over lease would) refuses the writer with nothing written."""
    async with PostgresStore(postgres_conninfo) as store:
        writes = sample_run("r", steps=1, ended=False)
        await apply(store, writes[:3])
        with pg.admin(postgres_conninfo) as conn:
            conn.execute("UPDATE polyloop.runs SET epoch = epoch + 1")
        before = (await store.read_log("r")).records
        for method, args in writes[3:]:
            with pytest.raises(RunLocked, match="another writer claimed"):
                await getattr(store, method)(*args)
        assert (await store.read_log("r")).records == before
