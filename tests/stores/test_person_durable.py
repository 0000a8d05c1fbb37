"""A person in the loop on every durable store, under asyncio and Trio (issue 19): a crash
after every write around an approval and around a settlement, each followed by the
restart a real deployment would do, never runs the approved tool twice, never runs a
rejected one, never records two settlements, and ends where an uninterrupted run ends.
Two people answering at once through two store objects: exactly one is recorded."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

from kit.agent import Ledger, close_store, definition, request
from kit.review import (
    approval_script,
    approval_story,
    observed,
    payment_script,
    plain_steps,
    review_tools,
    reviews,
    settlement_story,
)
from kit.store import DURABLE_KINDS, durable_opener, sampled
from kit.sweep import every_point
from polyloop import (
    Intent,
    NotAwaitingApproval,
    NotInDoubt,
    Replay,
    RunLocked,
    RunLog,
    RunResult,
    Settlement,
    StopReason,
    Store,
    Verdict,
    approve,
    reject,
    run_status,
    settle,
    start_or_resume,
)
from polyloop.cli import main
from polyloop.stores import MemoryStore, PostgresStore, SqliteStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

pytestmark = pytest.mark.anyio

APPROVAL_WRITES = 16  # run to the pause: 9; the verdict: 1; the rest of the run: 6
SETTLEMENT_WRITES = 7  # in-doubt end, settlement, the step, one more step, the end
# From step 1's model call on, its model calls never replayed: 4 + 3 writes and the end,
# with an in-doubt end and a settlement for each model call a crash interrupts.
MODEL_CALL_WRITES = 12


@pytest.fixture(params=sampled(DURABLE_KINDS))
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return durable_opener(request, tmp_path)


# Two people answering at once race for the run's claim, each through a store object of
# their own: that is each store's own business, so every store takes it in the quick run.
@pytest.fixture(params=DURABLE_KINDS)
def every_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    return durable_opener(request, tmp_path)


@dataclasses.dataclass
class Life:
    """A run driven to its end through crashes and people, one process at a time.

    Every call (a worker's ``start_or_resume``, a person's answer) opens a new store
    object, as a new process would, and closes it after. The first ``crash_after``
    writes, counted over all calls, land; the next one is a simulated crash, and the
    crashed call's store object is closed like a dead process's.
    """

    open_store: Callable[[], Store]
    ledger: Ledger
    script: list[str]
    crash_after: int | None
    verdict: str = "approve"
    arguments: dict[str, Any] | None = None
    model_replay: Replay = Replay.ALLOWED
    written: int = 0
    crashed: bool = False

    async def call(self, operation: Callable[[Store], Any]) -> Any:
        store = self.open_store()
        faulty = None
        target: Store = store
        if not self.crashed and self.crash_after is not None:
            faulty = FaultyStore(store, fail_after_writes=self.crash_after - self.written)
            target = faulty
        try:
            return await operation(target)
        except SimulatedCrash:
            self.crashed = True
            return None
        finally:
            if faulty is not None:
                self.written += faulty.writes
            await close_store(store)

    async def drive(self, store: Store) -> RunResult:
        tools = review_tools(self.ledger)
        the_request = request("r", tools, model_replay=self.model_replay)
        return await start_or_resume(definition(store, script=self.script), the_request)

    async def answer(self, result: RunResult) -> None:
        if result.stop_reason is StopReason.AWAITING_APPROVAL:
            if self.verdict == "approve":
                await self.call(
                    lambda store: approve(store, "r", by="alice", arguments=self.arguments)
                )
            else:
                await self.call(lambda store: reject(store, "r", by="bob", reason="no"))
            return
        assert result.stop_reason is StopReason.IN_DOUBT
        reader = self.open_store()
        try:
            intent = (await run_status(reader, "r")).open_intent  # type: ignore[arg-type]
        finally:
            await close_store(reader)
        assert intent is not None
        # The person finds out what happened: the ledger is the world (a model call is
        # never in it: the person says it may be made again).
        ran = self.ledger.count(intent.result_id) > 0
        observation = observed(intent.payload) if ran else "never reached"
        await self.call(
            lambda store: settle(
                store,
                "r",
                by="carol",
                ran=ran,
                observation=observation,
                result_id=intent.result_id,
            )
        )

    async def to_the_end(self) -> RunResult:
        for _ in range(12):
            result = await self.call(self.drive)
            if result is None:
                continue  # crashed: the next process starts over from the log
            if result.stop_reason in (StopReason.AWAITING_APPROVAL, StopReason.IN_DOUBT):
                await self.answer(result)
                continue
            return result  # type: ignore[no-any-return]
        raise AssertionError("the run never ended")

    async def read(self) -> RunLog:
        store = self.open_store()
        try:
            return await store.read_log("r")
        finally:
            await close_store(store)


async def _reference(script: list[str]) -> RunResult:
    """The same run, uninterrupted, with nothing waiting for approval."""
    async with MemoryStore() as store:
        tools = review_tools(Ledger(), needs_approval=False)
        return await start_or_resume(
            definition(store, script=script), request("r", tools, model_replay=Replay.ALLOWED)
        )


async def _reviews(open_store: Callable[[], Store]) -> list[Any]:
    store = open_store()
    try:
        return reviews(await store.read_log("r"))
    finally:
        await close_store(store)


async def _two_at_once(
    open_store: Callable[[], Store],
    answer: Callable[[Store, str], Awaitable[object]],
    refused: tuple[type[Exception], ...],
) -> list[object]:
    """Alice and Bob give the same answer at once, each through a store object of their own.

    Returns what each call gave back, or the refusal it met, in the order they finished.
    """
    outcomes: list[object] = []
    stores = [open_store(), open_store()]

    async def one(store: Store, by: str) -> None:
        try:
            outcomes.append(await answer(store, by))
        except refused as exc:
            outcomes.append(exc)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(one, stores[0], "alice")
            group.start_soon(one, stores[1], "bob")
    finally:
        for store in stores:
            await close_store(store)
    return outcomes


@pytest.mark.parametrize("k", every_point(range(APPROVAL_WRITES + 1)))
async def test_a_crash_after_every_write_around_an_approval(
    open_store: Callable[[], Store], k: int
) -> None:
    ledger = Ledger()
    life = Life(open_store, ledger, approval_script(), crash_after=k)
    result = await life.to_the_end()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert ledger.count("r:1:action") == 1  # the approved deploy ran exactly once
    reference = await _reference(approval_script())
    assert plain_steps(result.steps) == plain_steps(reference.steps)
    recorded = await _reviews(open_store)
    assert sum(isinstance(r, Verdict) for r in recorded) == 1
    assert sum(isinstance(r, Settlement) for r in recorded) <= 1


@pytest.mark.parametrize("k", every_point(range(0, APPROVAL_WRITES + 1, 2)))
async def test_a_crash_after_every_other_write_around_a_rejection(
    open_store: Callable[[], Store], k: int
) -> None:
    ledger = Ledger()
    life = Life(open_store, ledger, approval_script(), crash_after=k, verdict="reject")
    result = await life.to_the_end()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert ledger.count("r:1:action") == 0  # the rejected deploy never ran
    assert result.steps[1].observation == "Refused: no"
    recorded = await _reviews(open_store)
    assert [type(r).__name__ for r in recorded] == ["Proposal", "Verdict"]


@pytest.mark.parametrize("k", every_point(range(SETTLEMENT_WRITES + 1)))
async def test_a_crash_after_every_write_around_a_settlement(
    open_store: Callable[[], Store], k: int
) -> None:
    ledger = Ledger()
    # First a crash right after the payment's intent: the payment ran, its result is lost.
    in_doubt = Life(open_store, ledger, payment_script(), crash_after=8)
    assert await in_doubt.call(in_doubt.drive) is None
    assert ledger.count("r:1:action") == 1
    life = Life(open_store, ledger, payment_script(), crash_after=k)
    result = await life.to_the_end()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert ledger.count("r:1:action") == 1  # never paid twice
    assert result.steps[1].settled_by == "carol"
    reference = await _reference(payment_script())
    assert plain_steps(result.steps) == plain_steps(reference.steps)
    recorded = await _reviews(open_store)
    assert [type(r).__name__ for r in recorded] == ["Settlement"]


async def test_two_people_settling_at_once_exactly_one_wins(
    every_store: Callable[[], Store],
) -> None:
    ledger = Ledger()
    in_doubt = Life(every_store, ledger, payment_script(), crash_after=8)
    await in_doubt.call(in_doubt.drive)
    outcomes = await _two_at_once(
        every_store,
        lambda store, by: settle(store, "r", by=by, ran=True, observation="paid 5"),
        (RunLocked, NotInDoubt),
    )
    assert sum(isinstance(o, Settlement) for o in outcomes) == 1
    assert [type(r).__name__ for r in await _reviews(every_store)] == ["Settlement"]


async def test_two_people_approving_at_once_exactly_one_wins(
    every_store: Callable[[], Store],
) -> None:
    life = Life(every_store, Ledger(), approval_script(), crash_after=None)
    paused = await life.call(life.drive)
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    outcomes = await _two_at_once(
        every_store, lambda store, by: approve(store, "r", by=by), (RunLocked, NotAwaitingApproval)
    )
    assert sum(isinstance(o, Verdict) for o in outcomes) == 1
    assert [type(r).__name__ for r in await _reviews(every_store)] == ["Proposal", "Verdict"]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_a_run_in_doubt_in_a_database_of_an_earlier_release_can_be_settled(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    """Earlier releases marked a run that ended in doubt finished in the runs table; a
    store opening such a database reopens those runs, once, so they can be settled."""
    if kind == "sqlite":
        path = tmp_path / "runs.db"

        def open_store() -> Store:
            return SqliteStore(path)

        def as_an_earlier_release() -> None:
            with sqlite3.connect(path) as conn:
                conn.execute("UPDATE runs SET finished = 1")
                conn.execute("DELETE FROM meta WHERE key = 'layout'")
            conn.close()
    else:
        conninfo = request.getfixturevalue("postgres_conninfo")

        def open_store() -> Store:
            return PostgresStore(conninfo)

        def as_an_earlier_release() -> None:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute("UPDATE polyloop.runs SET finished = true")
                conn.execute("UPDATE polyloop.meta SET value = '3' WHERE key = 'layout'")

    ledger = Ledger()
    in_doubt = Life(open_store, ledger, payment_script(), crash_after=8)
    assert await in_doubt.call(in_doubt.drive) is None
    ended = Life(open_store, ledger, payment_script(), crash_after=None)
    result = await ended.call(ended.drive)
    assert result.stop_reason is StopReason.IN_DOUBT
    await anyio.to_thread.run_sync(as_an_earlier_release)

    result = await Life(open_store, ledger, payment_script(), crash_after=None).to_the_end()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert ledger.count("r:1:action") == 1
    assert result.steps[1].settled_by == "carol"


async def test_show_after_a_crash_following_an_edited_approval_names_the_call_that_ran(
    open_store: Callable[[], Store],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worker dies once the intent of the approved (edited) deploy is written: the
    deploy is never replayed, and show names the call that was announced, as edited."""
    ledger = Ledger()
    # To the pause: 9 writes; the verdict: 1; the deploy's intent: 1; its step crashes.
    life = Life(open_store, ledger, approval_script(), crash_after=11)
    life.arguments = {"env": "staging"}
    paused = await life.call(life.drive)
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    await life.answer(paused)
    assert await life.call(life.drive) is None  # crashed after the deploy's intent
    assert ledger.count("r:1:action") == 1
    assert (await life.call(life.drive)).stop_reason is StopReason.IN_DOUBT

    kind = request.node.callspec.params["open_store"]
    if kind == "postgresql":
        conninfo, schema = request.getfixturevalue("postgres_place")
        store = [conninfo, "--schema", schema]
    else:
        store = [
            f"jsonl:{tmp_path / 'runs'}" if kind == "jsonl" else f"sqlite:{tmp_path / 'runs.db'}"
        ]
    capsys.readouterr()
    assert await anyio.to_thread.run_sync(main, ["show", *store, "r", "--json"]) == 0
    doubt = json.loads(capsys.readouterr().out)["in_doubt"]
    assert doubt["arguments"] == {"env": "staging"}
    assert doubt["action_text"] == 'deploy({"env": "staging"})'
    assert doubt["edited_by"] == "alice"
    assert doubt["proposed_action_text"] == 'deploy({"env": "prod"})'
    assert await anyio.to_thread.run_sync(main, ["show", *store, "r"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert 'action deploy({"env": "staging"})' in shown
    assert 'edited by alice before it ran; the model proposed deploy({"env": "prod"})' in shown


@pytest.mark.parametrize("k", every_point(range(MODEL_CALL_WRITES + 1)))
async def test_a_crash_after_every_write_with_model_calls_never_replayed(
    open_store: Callable[[], Store], k: int
) -> None:
    """Every model call a crash interrupts is in doubt; settled as not run, it is made
    again under a new result id, and the run ends as an uninterrupted one does."""
    ledger = Ledger()
    # Start, step 0 and step 1's model intent land, then a crash: that call is in doubt.
    first = Life(open_store, ledger, payment_script(), crash_after=6, model_replay=Replay.NEVER)
    assert await first.call(first.drive) is None
    life = Life(open_store, ledger, payment_script(), crash_after=k, model_replay=Replay.NEVER)
    result = await life.to_the_end()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert ledger.count("r:1:action") == 1  # never paid twice
    reference = await _reference(payment_script())
    assert plain_steps(result.steps) == plain_steps(reference.steps)
    records = (await life.read()).records
    intents = [r.result_id for r in records if isinstance(r, Intent)]
    assert len(intents) == len(set(intents))  # every call made again has an id of its own
    settled = [r for r in records if isinstance(r, Settlement)]
    assert [r.result_id for r in settled][:1] == ["r:1:model"]
    assert all(r.result_id in intents for r in settled)


@pytest.mark.parametrize("ran", [False, True])
async def test_a_model_call_in_doubt_is_answered_once_by_its_own_id(
    open_store: Callable[[], Store], ran: bool
) -> None:
    ledger = Ledger()
    first = Life(open_store, ledger, payment_script(), crash_after=6, model_replay=Replay.NEVER)
    assert await first.call(first.drive) is None
    ended = Life(open_store, ledger, payment_script(), crash_after=None, model_replay=Replay.NEVER)
    result = await ended.call(ended.drive)
    assert result.stop_reason is StopReason.IN_DOUBT and "'r:1:model'" in str(result.detail)
    before = await ended.read()
    with pytest.raises(NotInDoubt, match=r"'r:1:model', not 'r:0:model'"):
        await ended.call(
            lambda store: settle(
                store, "r", by="carol", ran=ran, observation="x", result_id="r:0:model"
            )
        )
    assert await ended.read() == before
    await ended.call(
        lambda store: settle(
            store, "r", by="carol", ran=ran, observation="x", result_id="r:1:model"
        )
    )
    with pytest.raises(NotInDoubt, match="already settled by 'carol'"):
        await ended.call(
            lambda store: settle(
                store, "r", by="dave", ran=not ran, observation="y", result_id="r:1:model"
            )
        )
    model = ScriptedModelClient(payment_script())

    async def resumed(store: Store) -> RunResult:
        tools = review_tools(ledger)
        the_request = request("r", tools, model_replay=Replay.NEVER)
        return await start_or_resume(definition(store, model=model), the_request)

    result = await ended.call(resumed)
    if ran:
        assert result.stop_reason is StopReason.MODEL_FAILURE and model.calls == []
        assert "'r:1:model'" in str(result.detail) and "'carol'" in str(result.detail)
    else:
        assert result.stop_reason is StopReason.FINAL_ANSWER
        assert [call.result_id for call in model.calls] == ["r:1:model2", "r:2:model"]
    assert [type(r).__name__ for r in await _reviews(open_store)] == ["Settlement"]


# -- an answer names the proposal it answers (issue 42) -----------------------------------


async def test_an_answer_for_a_proposal_no_longer_open_is_refused(
    open_store: Callable[[], Store],
) -> None:
    await approval_story(open_store)


async def test_a_settlement_for_an_intent_no_longer_open_is_refused(
    open_store: Callable[[], Store],
) -> None:
    await settlement_story(open_store)
