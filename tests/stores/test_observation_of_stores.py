"""One copy of each observation, on every store (record 0063): a step record written with
its action's result names the result's observation instead of copying it, and every
reader (``read_log``, ``verify``, ``show``, forks, offline replay) sees the step the run
wrote; the log is shorter by about the observations."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from kit.agent import definition, request, tool_call
from kit.replay import offline, plain_steps
from kit.store import DURABLE_KINDS, STORE_KINDS, Stores, stores_fixture
from polyloop import (
    ActionStatus,
    CorruptLog,
    Intent,
    JSONValue,
    Record,
    Result,
    RunEnded,
    RunLog,
    RunResult,
    RunStarted,
    StepRecord,
    Store,
    ToolRegistry,
    ToolSpec,
    fork,
    run,
)
from polyloop.cli import main
from polyloop.serialization import dumps, encode, loads
from polyloop.session._forking import inherited_digest
from polyloop.stores import JsonlStore, MemoryStore, SqliteStore
from polyloop.stores._jsonl.reader import decode_line, line
from polyloop.stores._paths import safe_name
from polyloop.testing.store_contract import StoreContract
from polyloop.types import Review

pytestmark = pytest.mark.anyio

OBSERVATION_CHARS = 3_000
RUN = "src"
# Three looked-up pages (one call refused by the tool's schema: its observation is
# wrapped in the text that says so), a reply that is not JSON, and a submit.
SCRIPT = [
    tool_call("lookup", page=0),
    tool_call("lookup", page="one"),
    tool_call("lookup", page=1),
    "this is not JSON",
    tool_call("lookup", page=2),
    tool_call("submit", answer="done"),
]
REFERRED = 4  # the steps whose observation is their result's: three pages and the submit


def page(number: int) -> str:
    """A page of about 3 KB, different for every page."""
    head = f"page {number}: "
    return head + ("lorem ipsum dolor sit amet " * 120)[: OBSERVATION_CHARS - len(head)]


def tools() -> ToolRegistry:
    async def lookup(arguments: dict[str, Any], *, result_id: str) -> str:
        return page(arguments["page"])

    async def submit(arguments: dict[str, Any], *, result_id: str) -> str:
        return f"accepted {arguments['answer']}"

    page_schema = {"type": "object", "properties": {"page": {"type": "integer"}}}
    answer_schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    return ToolRegistry(
        [
            ToolSpec(name="lookup", description="A page.", parameters=page_schema, handler=lookup),
            ToolSpec(
                name="submit",
                description="Submit.",
                parameters=answer_schema,
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=OBSERVATION_CHARS,
    )


async def record(store: Store, run_id: str = RUN) -> RunResult:
    return await run(definition(store, script=SCRIPT), request(run_id, tools()))


stores = stores_fixture(STORE_KINDS)


# -- what is on disk ---------------------------------------------------------------------------


def held_lines(stores: Stores, run_id: str = RUN) -> list[bytes]:
    """The run's records as a durable store holds them: its JSONL lines, or its row bodies."""
    if stores.kind == "jsonl":
        return (stores.jsonl_dir / f"{safe_name(run_id)}.jsonl").read_bytes().splitlines()
    query = "SELECT body FROM {} WHERE run_id = %s ORDER BY seq"
    if stores.kind == "sqlite":
        with sqlite3.connect(stores.sqlite_path) as db:
            rows = db.execute(query.format("records").replace("%s", "?"), (run_id,)).fetchall()
    else:
        assert stores.place is not None
        conninfo, schema = stores.place
        with psycopg.connect(conninfo) as db:
            rows = db.execute(query.format(f"{schema}.records"), (run_id,)).fetchall()
    return [body.encode() for (body,) in rows]


def step_objects(stores: Stores) -> list[dict[str, Any]]:
    """The step records' JSON objects as held, each without its neighbours."""
    steps = []
    for held in held_lines(stores):
        value = json.loads(held)
        for data in value if isinstance(value, list) else [value]:
            if data["kind"] == "step":
                steps.append(data)
    return steps


def whole_form(stores: Stores, held: list[bytes]) -> list[bytes]:
    """The same records as the format wrote them before record 0063: each one whole."""
    if stores.kind == "jsonl":
        records = [decode_line(piece, "here") for piece in held]
        return [line(*(dumps(r) for r in pieces)).rstrip(b"\n") for pieces in records]
    whole, before = [], None
    for body in held:
        before = loads(body, after=before)
        whole.append(dumps(before).encode())
    return whole


async def test_every_store_reads_back_the_very_steps_the_run_wrote(stores: Stores) -> None:
    store = stores.open()
    result = await record(store)
    log = await (await stores.reopen(store)).read_log(RUN)
    steps = [r for r in log.records if isinstance(r, StepRecord)]
    assert steps == list(result.steps)  # times included: nothing is read back differently
    assert [s.observation for s in steps if s.action_status is ActionStatus.EXECUTED] == [
        page(0),
        page(1),
        page(2),
        "accepted done",
    ]
    if stores.kind == "memory":
        return  # records are held as objects: nothing is encoded
    held = step_objects(stores)
    named = [data.get("observation_of") for data in held]
    assert named == [f"{RUN}:{k}:action" if k in (0, 2, 4, 5) else None for k in range(6)]
    # The refused call's step keeps its own text (the wrapped reason); so does the reply
    # that is not JSON, which ran no action.
    assert held[1]["observation"].startswith("Refused: arguments for tool 'lookup'")
    assert held[3]["observation"] is not None and "observation_of" not in held[3]


@pytest.mark.parametrize("kind", DURABLE_KINDS)
async def test_a_step_adds_about_its_observation_less_to_the_log(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    stores = Stores.of(kind, request, tmp_path)
    try:
        await record(stores.open())
        held = held_lines(stores)
        whole = whole_form(stores, held)
    finally:
        await stores.close_all()
    saved = sum(map(len, whole)) - sum(map(len, held))
    # Each referred step leaves out its observation (about 3 KB; the submit's is short)
    # and names its result instead (about 30 bytes).
    observations = sum(len(page(n)) for n in range(3)) + len("accepted done")
    assert observations - REFERRED * 40 < saved <= observations
    assert sum(map(len, held)) < sum(map(len, whole)) - 3 * (OBSERVATION_CHARS - 40)


# -- readers of a log with referred observations -----------------------------------------------


async def test_forks_and_offline_replay_see_the_steps_the_run_wrote(stores: Stores) -> None:
    store = stores.open()
    source = await record(store)
    log = await store.read_log(RUN)
    forked = await fork(
        definition(store, script=["inherited"] * 3 + [tool_call("submit", answer="again")]),
        request("fork", tools()),
        source_run_id=RUN,
        at_step=3,
    )
    assert forked.steps[:3] == tuple(replace(step, run_id="fork") for step in source.steps[:3])
    started = (await store.read_log("fork")).records[0]
    assert isinstance(started, RunStarted)
    # The digest is of the steps as the source wrote them: each whole, observation included.
    assert started.inherited_sha256 == inherited_digest(source.steps[:3])
    (defined, redriven), model, executor = offline(log, tools=tools())
    again = await run(defined, redriven)
    assert plain_steps(again.steps) == plain_steps(source.steps)
    assert model.divergences == [] and executor.divergences == []


@pytest.mark.parametrize("kind", ["jsonl", "sqlite"])
def test_show_and_verify_read_the_steps_the_run_wrote(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    opened = JsonlStore(tmp_path / "runs") if kind == "jsonl" else SqliteStore(tmp_path / "r.db")
    spelled = f"jsonl:{tmp_path / 'runs'}" if kind == "jsonl" else f"sqlite:{tmp_path / 'r.db'}"

    async def recorded() -> RunResult:
        async with opened as store:
            return await record(store)

    result = anyio.run(recorded)
    assert main(["verify", spelled]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["show", spelled, RUN, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["steps"] == [encode(step) for step in result.steps]
    assert main(["show", spelled, RUN]) == 0
    assert page(2)[:40] in capsys.readouterr().out


# -- a reference that does not hold ----------------------------------------------------------


async def test_a_step_whose_result_is_not_the_record_before_it_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.db"
    async with SqliteStore(path) as store:
        await record(store)
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE records SET body = replace(body, ?, ?) WHERE run_id = ? AND kind = 'step'",
            (f'"observation_of":"{RUN}:2:action"', f'"observation_of":"{RUN}:9:action"', RUN),
        )
        (seq,) = db.execute(
            "SELECT seq FROM records WHERE run_id = ? AND body LIKE ?", (RUN, "%:9:action%")
        ).fetchone()
    async with SqliteStore(path) as store:
        with pytest.raises(CorruptLog) as refused:
            await store.read_log(RUN)
    assert refused.value.run_id == RUN
    assert refused.value.location == f"{path}: run row seq {seq}"
    assert refused.value.reason == (
        f"the step's observation is that of result '{RUN}:9:action', "
        "but the record before it is not that result"
    )


async def test_a_jsonl_step_parted_from_its_result_is_refused(tmp_path: Path) -> None:
    async with JsonlStore(tmp_path) as store:
        await record(store)
    path = tmp_path / f"{safe_name(RUN)}.jsonl"
    lines = path.read_bytes().splitlines()
    number = next(n for n, piece in enumerate(lines) if b"observation_of" in piece)
    result, step = json.loads(lines[number])
    parted = [json.dumps(part, separators=(",", ":")).encode() for part in (result, step)]
    path.write_bytes(b"\n".join([*lines[:number], *parted, *lines[number + 1 :]]) + b"\n")
    async with JsonlStore(tmp_path) as store:
        with pytest.raises(CorruptLog) as refused:
            await store.read_log(RUN)
    assert refused.value.run_id == RUN
    assert refused.value.location == f"{path}:{number + 2}"
    assert "is that of result" in refused.value.reason


# -- a store of one's own, written against the port -------------------------------------------


class LinesStore:
    """A store of one's own as docs/stores.md describes it: each record it is handed is
    kept as the line ``dumps`` writes, and each line read back with ``loads`` alone. The
    claims, cancel requests and listing are a memory store's."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.lines: dict[str, list[str]] = {}

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "lines"}

    def _keep(self, *records: Record) -> None:
        self.lines.setdefault(records[0].run_id, []).extend(dumps(r) for r in records)

    async def start_run(self, record: RunStarted) -> None:
        await self.inner.start_run(record)
        self._keep(record)

    async def write_intent(self, intent: Intent) -> None:
        await self.inner.write_intent(intent)
        self._keep(intent)

    async def write_result(self, result: Result) -> None:
        await self.inner.write_result(result)
        self._keep(result)

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        await self.inner.write_step(step, action_result)
        self._keep(*(r for r in (action_result, step) if r is not None))

    async def write_review(self, record: Review) -> None:
        await self.inner.write_review(record)
        self._keep(record)

    async def end_run(self, record: RunEnded) -> None:
        await self.inner.end_run(record)
        self._keep(record)

    async def read_log(self, run_id: str) -> RunLog:
        records = tuple(loads(line) for line in self.lines.get(run_id, ()))
        return RunLog(run_id=run_id, records=records)

    async def prune(self, *, finished_before: datetime, archive: Any = None) -> tuple[str, ...]:
        pruned = await self.inner.prune(finished_before=finished_before, archive=archive)
        for run_id in pruned:
            del self.lines[run_id]
        return pruned

    async def __aenter__(self) -> LinesStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:  # claims, cancel requests, listing, aclose
        return getattr(self.inner, name)


class TestLinesStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> Callable[[], Store]:
        store = LinesStore()
        return lambda: store  # type: ignore[return-value]


async def test_a_store_that_writes_each_record_with_dumps_reads_back_the_same_steps() -> None:
    store = LinesStore()
    result = await record(store)  # type: ignore[arg-type]
    log = await store.read_log(RUN)
    assert [r for r in log.records if isinstance(r, StepRecord)] == list(result.steps)
    assert all("observation_of" not in line for line in store.lines[RUN])
    assert sum(page(0) in line for line in store.lines[RUN]) == 2  # its result and its step
