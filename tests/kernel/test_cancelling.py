"""A person's cancel (``polyloop.cancel``, issue 44 part 3): a durable request that fences
every later intent and proposal, the run's end ``CANCELLED_BY_REQUEST`` naming who asked,
and the answers it refuses; on the memory store, under asyncio and Trio.

The memory store's claims belong to one store object, so "another owner" is another
task driving the run through the same object: ``cancel`` then meets ``RunLocked``, as it
would meet a live worker of another process. The hosts' tests run on every store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import answer, cancel_when, definition, request, tool_call
from kit.hosting import KINDS, Opener, Till, eventually, serving, tools
from polyloop import (
    Agent,
    CancelRequest,
    CancelRequested,
    EventKind,
    Intent,
    InvalidRequest,
    JSONValue,
    ModelCall,
    ModelReply,
    NotAwaitingApproval,
    NotInDoubt,
    Proposal,
    Ready,
    Replay,
    Request,
    RunEnded,
    RunLocked,
    RunNotFound,
    RunResult,
    RunState,
    StepRecord,
    StopReason,
    Store,
    approve,
    cancel,
    reject,
    run_status,
    settle,
)
from polyloop.stores import MemoryStore
from polyloop.testing import RecordingSink, ScriptedModelClient

pytestmark = pytest.mark.anyio

TWO_PAYMENTS = [tool_call("pay", n=1), tool_call("pay", n=2), answer("paid")]
WHY = "wrong customer: stop before it pays anyone else"


class Ledger(Till):
    """The outside world of ``pay``: also every call of the tool and of its probe."""

    def __init__(self, *, shut: bool = False) -> None:
        super().__init__(shut=shut)
        self.calls: list[str] = []
        self.probed: list[str] = []

    async def pay(self, arguments: dict[str, Any], *, result_id: str) -> str:
        self.calls.append(result_id)
        return await super().pay(arguments, result_id=result_id)

    async def probe(self, arguments: dict[str, Any], *, result_id: str) -> Any:
        self.probed.append(result_id)
        return await super().probe(arguments, result_id=result_id)


class GatedModel:
    """The scripted model, whose call ``index`` waits for :meth:`open` once it started."""

    def __init__(self, script: list[Any], index: int) -> None:
        self.inner = ScriptedModelClient(script)
        self.index = index
        self.entered = anyio.Event()
        self.gate = anyio.Event()

    def parameters(self) -> dict[str, JSONValue]:
        return dict(self.inner.parameters())

    async def call(self, call: ModelCall) -> ModelReply:
        if call.call_index == self.index:
            self.entered.set()
            await self.gate.wait()
        return await self.inner.call(call)


def payer(
    store: Store,
    ledger: Ledger,
    *,
    script: list[Any] = TWO_PAYMENTS,
    model: Any = None,
    events: Any = None,
    **options: Any,
) -> Agent:
    """An agent whose runs pay as ``script`` says; ``options`` go to ``kit.hosting.tools``."""
    registry = tools(ledger, **options)

    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, registry)

    built = definition(store, script=script, model=model, events=events)
    return Agent(name="payer", definition=built, request_for=request_for)


async def _records(store: Store, run_id: str = "r") -> tuple[Any, ...]:
    return (await store.read_log(run_id)).records


def _ended_by_request(end: Any, *, by: str = "dana", why: str = WHY) -> None:
    assert isinstance(end, RunEnded)
    assert end.stop_reason is StopReason.CANCELLED_BY_REQUEST
    assert end.is_final
    assert (end.cancelled_by, end.detail) == (by, why)


# -- a run nobody drives ends at once ----------------------------------------------------


async def _never_driven(store: Store, ledger: Ledger) -> Agent:
    agent = payer(store, ledger)
    await agent.start("r", {})
    return agent


async def _awaiting_approval(store: Store, ledger: Ledger) -> Agent:
    agent = payer(store, ledger, needs_approval=True)
    assert (await agent.run("r", {})).stop_reason is StopReason.AWAITING_APPROVAL
    return agent


async def _in_doubt(store: Store, ledger: Ledger) -> Agent:
    agent = payer(store, ledger)
    await cancel_when(ledger.entered, lambda: agent.run("r", {}))
    assert (await agent.run("r", {})).stop_reason is StopReason.IN_DOUBT
    return agent


async def _left_cancelled(store: Store, ledger: Ledger) -> Agent:
    agent = payer(store, ledger, replay=Replay.ALLOWED)
    await cancel_when(ledger.entered, lambda: agent.run("r", {}))
    assert (await run_status(store, "r")).state is RunState.RESUMABLE
    return agent


SITUATIONS = {
    "started-never-driven": (_never_driven, RunState.RESUMABLE),
    "awaiting-approval": (_awaiting_approval, RunState.AWAITING_APPROVAL),
    "in-doubt": (_in_doubt, RunState.IN_DOUBT),
    "cancelled-by-its-process": (_left_cancelled, RunState.RESUMABLE),
}


@pytest.mark.parametrize("situation", list(SITUATIONS))
async def test_a_cancel_of_a_run_nobody_drives_ends_it_at_once_and_for_good(
    situation: str,
) -> None:
    store, ledger = MemoryStore(), Ledger(shut=True)
    build, state = SITUATIONS[situation]
    agent = await build(store, ledger)
    assert (await run_status(store, "r")).state is state
    before, calls = await _records(store), list(ledger.calls)

    status = await cancel(store, "r", by="dana", reason=WHY)

    assert status.state is RunState.FINISHED
    assert (status.stop_reason, status.detail) == (StopReason.CANCELLED_BY_REQUEST, WHY)
    records = await _records(store)
    assert records[: len(before)] == before and len(records) == len(before) + 1
    _ended_by_request(records[-1])
    stored = await store.describe_run("r")
    assert stored is not None and stored.finished and stored.cancel_requested
    assert not stored.claimed  # the claim cancel took was given up
    asked = await store.read_cancel("r")
    assert asked is not None and (asked.by, asked.reason) == ("dana", WHY)
    # Final: resuming returns what is on record and runs nothing, whatever the run was.
    ledger.open()
    result = await agent.run("r", {})
    assert (result.stop_reason, result.detail) == (StopReason.CANCELLED_BY_REQUEST, WHY)
    assert await _records(store) == records
    assert ledger.calls == calls and ledger.paid == []


async def test_a_finished_run_is_left_as_it_is_and_a_second_cancel_changes_nothing() -> None:
    store, ledger = MemoryStore(), Ledger()
    agent = payer(store, ledger)
    assert (await agent.run("r", {})).stop_reason is StopReason.FINAL_ANSWER
    records = await _records(store)
    status = await cancel(store, "r", by="dana", reason=WHY)
    assert (status.state, status.stop_reason) == (RunState.FINISHED, StopReason.FINAL_ANSWER)
    assert await _records(store) == records
    assert await store.read_cancel("r") is None  # nothing written, not even the request

    other = "r2"
    await agent.start(other, {})
    await cancel(store, other, by="dana", reason=WHY)
    ended = await _records(store, other)
    status = await cancel(store, other, by="eve", reason="me too")
    assert status.stop_reason is StopReason.CANCELLED_BY_REQUEST
    assert await _records(store, other) == ended
    asked = await store.read_cancel(other)
    assert asked is not None and asked.by == "dana"  # a run keeps its first request


# -- a run another task drives ends at its next intent -----------------------------------


async def _beside(
    agent: Agent, entered: anyio.Event, during: Callable[[], Awaitable[None]]
) -> RunResult:
    """Drive the run ``r`` in a task of its own and, once ``entered`` fires, await
    ``during`` beside it; the run's result."""
    results: list[RunResult] = []

    async def drive() -> None:
        results.append(await agent.run("r", {}))

    async with anyio.create_task_group() as group:
        group.start_soon(drive)
        await entered.wait()
        await during()
    [result] = results
    return result


async def test_a_cancel_while_a_tool_runs_lets_it_finish_and_refuses_the_next_intent() -> None:
    store, ledger, sink = MemoryStore(), Ledger(shut=True), RecordingSink()
    model = ScriptedModelClient(TWO_PAYMENTS)
    agent = payer(store, ledger, model=model, events=sink)

    async def cancelling() -> None:
        # The driver holds the claim: the request is kept for it, and it goes on.
        status = await cancel(store, "r", by="dana", reason=WHY)
        assert (status.state, status.ready) == (RunState.RUNNING, Ready.CANCEL_REQUESTED)
        assert ledger.paid == [] and ledger.running == 1
        assert await store.read_cancel("r") is not None
        ledger.open()

    result = await _beside(agent, ledger.entered, cancelling)
    assert (result.stop_reason, result.detail) == (StopReason.CANCELLED_BY_REQUEST, WHY)
    assert result.step_count == 1 and result.valid_step_count == 1
    # The running payment finished and was recorded; nothing after it was announced.
    assert ledger.calls == ledger.paid == ["r:0:action"]
    assert len(model.calls) == 1
    records = await _records(store)
    assert [type(record) for record in records[-2:]] == [StepRecord, RunEnded]
    assert records[-2].observation == "paid 1"
    assert sum(isinstance(record, Intent) for record in records) == 2  # model 0, action 0
    _ended_by_request(records[-1])
    ended = [event for event in sink.events if event.kind is EventKind.RUN_ENDED]
    assert [event.record for event in ended] == [records[-1]]
    status = await run_status(store, "r")
    assert (status.state, status.stop_reason) == (RunState.FINISHED, result.stop_reason)
    again = await agent.run("r", {})
    assert again.stop_reason is StopReason.CANCELLED_BY_REQUEST
    assert ledger.calls == ["r:0:action"]


async def test_a_cancel_during_a_model_call_keeps_its_reply_and_refuses_its_proposal() -> None:
    store, ledger = MemoryStore(), Ledger()
    model = GatedModel(TWO_PAYMENTS, index=0)
    agent = payer(store, ledger, model=model, needs_approval=True)

    async def cancelling() -> None:
        await cancel(store, "r", by="dana", reason=WHY)
        model.gate.set()

    result = await _beside(agent, model.entered, cancelling)
    assert result.stop_reason is StopReason.CANCELLED_BY_REQUEST
    records = await _records(store)
    kinds = [type(record).__name__ for record in records]
    assert kinds == ["RunStarted", "Intent", "Result", "RunEnded"]  # the reply, no proposal
    assert not any(isinstance(record, Proposal) for record in records)
    _ended_by_request(records[-1])
    assert (await run_status(store, "r")).proposal is None
    assert ledger.calls == []


async def test_a_process_cancellation_still_ends_cancelled_and_resumable() -> None:
    store, ledger = MemoryStore(), Ledger(shut=True)
    agent = payer(store, ledger, replay=Replay.ALLOWED)
    await cancel_when(ledger.entered, lambda: agent.run("r", {}))
    end = (await _records(store))[-1]
    assert isinstance(end, RunEnded)
    assert (end.stop_reason, end.cancelled_by, end.is_final) == (StopReason.CANCELLED, None, False)
    assert (await run_status(store, "r")).state is RunState.RESUMABLE
    assert await store.read_cancel("r") is None
    ledger.open()
    assert (await agent.run("r", {})).stop_reason is StopReason.FINAL_ANSWER


# -- resume, and a replayed effect --------------------------------------------------------


async def test_resume_ends_a_run_with_a_request_before_its_probe_is_asked() -> None:
    store, ledger = MemoryStore(), Ledger(shut=True)
    await _in_doubt(store, ledger)
    # Kept while nobody could end the run (as when its writer stopped right after).
    await store.request_cancel(CancelRequest(run_id="r", by="dana", reason=WHY))
    probing = payer(store, ledger, probe=True)
    result = await probing.run("r", {})
    assert (result.stop_reason, result.detail) == (StopReason.CANCELLED_BY_REQUEST, WHY)
    assert ledger.probed == [] and ledger.paid == []
    _ended_by_request((await _records(store))[-1])


class RequestAfterTheClaim(MemoryStore):
    """A memory store on which a cancel request lands right after the first time a
    driver looks for one: the narrow window between resume's check and a replay."""

    def __init__(self) -> None:
        super().__init__()
        self.looked = 0

    async def read_cancel(self, run_id: str) -> CancelRequest | None:
        self.looked += 1
        found = await super().read_cancel(run_id)
        if self.looked == 1:
            await self.request_cancel(CancelRequest(run_id=run_id, by="dana", reason=WHY))
        return found


async def test_a_request_landing_after_the_claim_stops_a_replayed_effect() -> None:
    store, ledger = RequestAfterTheClaim(), Ledger(shut=True)
    agent = payer(store, ledger, replay=Replay.ALLOWED)
    await cancel_when(ledger.entered, lambda: agent.run("r", {}))  # the action's intent stays
    store.looked, calls = 0, list(ledger.calls)
    ledger.open()  # a replay would pay now
    result = await agent.run("r", {})
    assert result.stop_reason is StopReason.CANCELLED_BY_REQUEST
    assert store.looked == 2  # after the claim, and again right before the replay
    assert ledger.calls == calls  # the replay never started
    _ended_by_request((await _records(store))[-1])


# -- what the person saw ------------------------------------------------------------------


async def _refused(
    store: Store, call: Callable[[], Awaitable[Any]], error: type[Exception], match: str
) -> None:
    """``call`` raises ``error`` and writes nothing: no record, no request."""
    before = await _records(store)
    with pytest.raises(error, match=match):
        await call()
    assert await _records(store) == before
    assert await store.read_cancel("r") is None


async def test_a_cancel_naming_what_the_person_saw_is_checked_under_the_claim() -> None:
    store, ledger = MemoryStore(), Ledger(shut=True)
    await _awaiting_approval(store, ledger)
    waiting = (await run_status(store, "r")).proposal
    assert waiting is not None

    def cancelling(result_id: str) -> Callable[[], Awaitable[Any]]:
        return lambda: cancel(store, "r", by="dana", reason=WHY, result_id=result_id)

    await _refused(store, cancelling("r:5:action"), NotAwaitingApproval, "no longer open")
    status = await cancel(store, "r", by="dana", reason=WHY, result_id=waiting.result_id)
    assert status.stop_reason is StopReason.CANCELLED_BY_REQUEST

    store, ledger = MemoryStore(), Ledger(shut=True)
    await _in_doubt(store, ledger)
    await _refused(store, cancelling("r:1:action"), NotInDoubt, "open intent is 'r:0:action'")
    status = await cancel(store, "r", by="dana", reason=WHY, result_id="r:0:action")
    assert status.stop_reason is StopReason.CANCELLED_BY_REQUEST

    # Approved since the person looked: the proposal they saw is no longer open.
    store, ledger = MemoryStore(), Ledger(shut=True)
    await _awaiting_approval(store, ledger)
    await approve(store, "r", by="ann")
    await _refused(store, cancelling(waiting.result_id), NotAwaitingApproval, "by 'ann'")


async def test_a_cancel_naming_what_the_person_saw_is_refused_while_another_drives() -> None:
    store, ledger = MemoryStore(), Ledger(shut=True)
    agent = payer(store, ledger)
    async with anyio.create_task_group() as group:
        group.start_soon(agent.run, "r", {})
        await ledger.entered.wait()
        with pytest.raises(RunLocked, match="no longer waits on 'r:0:action'"):
            await cancel(store, "r", by="dana", reason=WHY, result_id="r:0:action")
        assert await store.read_cancel("r") is None
        ledger.open()
    status = await run_status(store, "r")
    assert status.stop_reason is StopReason.FINAL_ANSWER  # nothing was asked of it


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"by": ""}, "by must be a non-empty string"),
        ({"by": None}, "by must be a non-empty string"),
        ({"reason": "  "}, "reason must be a non-empty string"),
        ({"result_id": ""}, "result_id must be a non-empty string or None"),
        ({"run_id": ""}, "run_id must be a non-empty string"),
    ],
)
async def test_a_cancel_it_cannot_write_is_refused_before_any_io(
    fields: dict[str, Any], match: str
) -> None:
    store = MemoryStore()
    await store.aclose()  # any I/O would fail with StoreError
    arguments: dict[str, Any] = {"run_id": "r", "by": "dana", "reason": WHY, **fields}
    run_id = arguments.pop("run_id")
    with pytest.raises(InvalidRequest, match=match):
        await cancel(store, run_id, **arguments)


async def test_a_cancel_of_a_run_the_store_does_not_hold_is_run_not_found() -> None:
    store = MemoryStore()
    with pytest.raises(RunNotFound):
        await cancel(store, "nobody", by="dana", reason=WHY)


# -- answers after a request ----------------------------------------------------------------


async def test_answers_are_refused_once_a_cancel_is_requested() -> None:
    store, ledger = MemoryStore(), Ledger(shut=True)
    await _awaiting_approval(store, ledger)
    await store.request_cancel(CancelRequest(run_id="r", by="dana", reason=WHY))
    status = await run_status(store, "r")
    # It waits for no person any more: whoever drives it next ends it.
    assert (status.state, status.ready) == (RunState.AWAITING_APPROVAL, Ready.CANCEL_REQUESTED)
    before = await _records(store)
    with pytest.raises(CancelRequested, match="'dana' asked") as caught:
        await approve(store, "r", by="ann")
    assert (caught.value.by, caught.value.why, caught.value.run_id) == ("dana", WHY, "r")
    with pytest.raises(CancelRequested):
        await reject(store, "r", by="ann", reason="no")
    assert await _records(store) == before
    await cancel(store, "r", by="eve", reason="tidy up")
    with pytest.raises(CancelRequested):
        await approve(store, "r", by="ann")
    _ended_by_request((await _records(store))[-1])  # the first request's who and why

    store, ledger = MemoryStore(), Ledger(shut=True)
    await _in_doubt(store, ledger)
    await store.request_cancel(CancelRequest(run_id="r", by="dana", reason=WHY))
    with pytest.raises(CancelRequested):
        await settle(store, "r", by="ann", ran=False, observation="never paid")
    assert not any(type(record).__name__ == "Settlement" for record in await _records(store))


# -- hosts: every store ---------------------------------------------------------------------


@pytest.fixture(params=KINDS)
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    opened = Opener.of(request, tmp_path)
    yield opened
    await opened.aclose()


async def test_a_host_ends_a_run_cancelled_mid_tool_and_never_drives_it_again(
    opener: Opener,
) -> None:
    store, ledger = opener(), Ledger(shut=True)
    agent = payer(store, ledger)
    await agent.start("r", {})
    async with serving(agent) as host:
        await ledger.entered.wait()
        # From another store object: another process, for the durable stores.
        status = await cancel(opener(), "r", by="dana", reason=WHY)
        assert status.state is RunState.RUNNING
        ledger.open()
        await eventually(lambda: host.records.of("r", "stopped"), what="the run ending")
        await anyio.sleep(0.3)  # fifteen polls: room for a second drive that must not come
    [stopped] = host.records.of("r", "stopped")
    assert stopped["stop_reason"] == StopReason.CANCELLED_BY_REQUEST.value
    assert [facts["why"] for facts in host.records.of("r", "driving")] == ["new"]
    assert ledger.calls == ledger.paid == ["r:0:action"]
    _ended_by_request((await _records(store))[-1])
    assert (await run_status(store, "r")).state is RunState.FINISHED


async def test_a_host_ends_at_once_a_waiting_run_with_a_request(
    opener: Opener,
) -> None:
    store, ledger = opener(), Ledger()
    await _awaiting_approval(store, ledger)
    # A request its writer left unended (it stopped to wait just as the request landed).
    await store.request_cancel(CancelRequest(run_id="r", by="dana", reason=WHY))
    agent = payer(store, ledger, needs_approval=True)
    async with serving(agent) as host:
        await eventually(lambda: host.records.of("r", "stopped"), what="the run ending")
    [driving] = host.records.of("r", "driving")
    assert driving["why"] == "cancel_requested"
    assert ledger.calls == []
    _ended_by_request((await _records(store))[-1])
