"""A host of agents (``polyloop.serve_agents``) drives every run of its agents that can
go on, leaves every other run alone, and drains at a step boundary; under asyncio and
Trio, on the memory store and the durable ones."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import definition, request
from kit.hosting import KINDS, SCRIPT, Opener, Till, eventually, payer, serving, tools
from polyloop import (
    Agent,
    Amended,
    Amendment,
    InvalidRequest,
    Message,
    Replay,
    Role,
    RunEnded,
    RunState,
    StepRecord,
    StopReason,
    approve,
    run,
    run_status,
    serve_agents,
)
from polyloop.session import _draining
from polyloop.session._agents import resume_as
from polyloop.session._draining import DETAIL
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio


@pytest.fixture(params=KINDS)
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    opened = Opener.of(request, tmp_path)
    yield opened
    await opened.aclose()


async def _state(store: Any, run_id: str) -> RunState:
    return (await run_status(store, run_id)).state


async def test_a_started_run_is_driven_to_its_end(opener: Opener) -> None:
    store, till = opener(), Till()
    agent = payer(store, till)
    await agent.start("r1", {"n": 2})
    async with serving(agent) as host:
        await eventually(lambda: _finished(store, "r1"), what="r1 finishing")
    status = await run_status(store, "r1")
    assert status.stop_reason is StopReason.FINAL_ANSWER
    assert till.paid == ["r1:0:action"]
    events = [facts["event"] for facts in host.records.of("r1")]
    assert events == ["driving", "stopped"]
    assert host.records.of("r1", "driving")[0]["why"] == "new"
    assert host.records.of("r1", "stopped")[0]["stop_reason"] == "final_answer"


async def _finished(store: Any, run_id: str) -> bool:
    return await _state(store, run_id) is RunState.FINISHED


async def test_an_approval_lets_the_run_go_on(opener: Opener) -> None:
    store, till = opener(), Till()
    agent = payer(store, till, needs_approval=True)
    await agent.start("r1", {})
    async with serving(agent, poll_s=0.05) as host:
        await eventually(
            lambda: _is(store, "r1", RunState.AWAITING_APPROVAL), what="r1 waiting for approval"
        )
        await anyio.sleep(0.2)  # a few polls: the waiting run is left as it is
        assert till.paid == []
        assert [facts["event"] for facts in host.records.of("r1")] == ["driving", "stopped"]
        await approve(store, "r1", by="ann")
        took = await eventually(lambda: _finished(store, "r1"), what="r1 going on")
    assert till.paid == ["r1:0:action"]
    assert took < 10.0  # about a poll interval; the bound is generous for slow machines
    assert [facts["why"] for facts in host.records.of("r1", "driving")] == ["new", "approved"]


async def _is(store: Any, run_id: str, state: RunState) -> bool:
    return await _state(store, run_id) is state


async def test_runs_of_other_agents_and_plain_runs_are_left_alone(opener: Opener) -> None:
    store, till = opener(), Till()
    hosted = payer(store, till)
    other = payer(store, till, name="other")
    await other.start("foreign", {})
    # A plain run (no agent) that a crash left unfinished, after its first two writes.
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=2), script=SCRIPT),
            request("plain", tools(till)),
        )
    before = {run_id: await store.read_log(run_id) for run_id in ("foreign", "plain")}
    await hosted.start("mine", {})
    async with serving(hosted) as host:
        await eventually(lambda: _finished(store, "mine"), what="mine finishing")
        await anyio.sleep(0.2)
    for run_id, log in before.items():
        assert await store.read_log(run_id) == log
        assert host.records.of(run_id) == []
    assert till.paid == ["mine:0:action"]


async def test_a_run_whose_identity_changed_is_reported_once_and_left_alone(
    opener: Opener,
) -> None:
    store, till = opener(), Till()
    await payer(store, till).start("r1", {})
    before = await store.read_log("r1")
    changed = payer(store, till, script=[*SCRIPT, "one more reply"])  # another model script
    async with serving(changed) as host:
        await eventually(
            lambda: _said(host.records, "r1", "refused"), what="the mismatch being reported"
        )
        await anyio.sleep(0.3)  # many polls: nothing more is said or done
    refused = host.records.of("r1", "refused")
    assert len(refused) == 1
    assert "model.script_sha256" in refused[0]["message"]
    assert host.records.of("r1", "stopped") == []
    assert await store.read_log("r1") == before
    assert till.paid == []


async def _said(records: Any, run_id: str, event: str) -> bool:
    return bool(records.of(run_id, event))


async def test_no_more_runs_than_the_concurrency_are_driven_at_once(opener: Opener) -> None:
    store, till = opener(), Till(shut=True)
    agent = payer(store, till)
    for index in range(5):
        await agent.start(f"r{index}", {})
    async with serving(agent, concurrency=2):
        await eventually(_two_running(till), what="two runs paying")
        await anyio.sleep(0.2)  # more polls: the other runs wait for a free slot
        assert till.running == 2
        till.open()
        for index in range(5):
            await eventually(lambda i=index: _finished(store, f"r{i}"), what=f"r{index}")  # type: ignore[misc]
    assert till.most == 2
    assert sorted(till.paid) == sorted(f"r{index}:0:action" for index in range(5))


def _two_running(till: Till) -> Any:
    async def check() -> bool:
        return till.running == 2

    return check


async def test_draining_stops_a_run_at_its_next_step_boundary(opener: Opener) -> None:
    store, till = opener(), Till(shut=True)
    agent = payer(store, till)
    await agent.start("r1", {})
    async with serving(agent) as host:
        await till.entered.wait()
        host.stop()
        await anyio.sleep(0.2)
        assert not host.done.is_set()  # the tool is never cut in half
        till.open()
        with anyio.fail_after(10):
            await host.done.wait()
    records = (await store.read_log("r1")).records
    assert isinstance(records[-2], StepRecord) and records[-2].step == 0
    assert isinstance(records[-1], RunEnded)
    assert records[-1].stop_reason is StopReason.CANCELLED
    assert records[-1].detail == DETAIL
    assert await _state(store, "r1") is RunState.RESUMABLE  # its claim was given up
    # A second host, with a store object of its own, finishes it; nothing is paid twice.
    second = payer(opener(), till)
    async with serving(second) as host:
        await eventually(lambda: _finished(store, "r1"), what="r1 finishing")
    assert till.paid == ["r1:0:action"]
    assert [facts["why"] for facts in host.records.of("r1", "driving")] == ["interrupted"]


async def test_what_still_runs_after_the_drain_grace_is_cancelled(opener: Opener) -> None:
    store, till = opener(), Till(shut=True)
    agent = payer(store, till, replay=Replay.ALLOWED)
    await agent.start("r1", {})
    async with serving(agent, drain_grace_s=0.1) as host:
        await till.entered.wait()
        host.stop()
        with anyio.fail_after(10):
            await host.done.wait()
    records = (await store.read_log("r1")).records
    assert isinstance(records[-1], RunEnded)
    assert records[-1].stop_reason is StopReason.CANCELLED
    assert await _state(store, "r1") is RunState.RESUMABLE
    till.open()
    async with serving(payer(opener(), till, replay=Replay.ALLOWED)):
        await eventually(lambda: _finished(store, "r1"), what="r1 finishing")
    assert till.paid == ["r1:0:action"]


async def test_a_doubt_a_probe_can_settle_is_settled_and_the_run_finishes(
    opener: Opener,
) -> None:
    store, till = opener(), Till()
    # Killed right after the payment's intent: the payment may or may not have happened.
    crashing = payer(FaultyStore(store, fail_after_writes=4), till, probe=True)
    with pytest.raises(SimulatedCrash):
        await crashing.run("r1", {})
    assert till.paid == ["r1:0:action"]
    assert await _state(store, "r1") is RunState.IN_DOUBT
    async with serving(payer(store, till, probe=True)) as host:
        await eventually(lambda: _finished(store, "r1"), what="r1 finishing")
    assert till.paid == ["r1:0:action"]  # settled by the probe, not paid again
    assert [facts["why"] for facts in host.records.of("r1", "driving")] == ["probe"]


async def test_a_doubt_without_a_probe_waits_for_a_person(opener: Opener) -> None:
    store, till = opener(), Till()
    crashing = payer(FaultyStore(store, fail_after_writes=4), till)
    with pytest.raises(SimulatedCrash):
        await crashing.run("r1", {})
    async with serving(payer(store, till)) as host:
        await eventually(
            lambda: _said(host.records, "r1", "stopped"), what="the doubt being recorded"
        )
        await anyio.sleep(0.2)
    status = await run_status(store, "r1")
    assert status.state is RunState.IN_DOUBT
    assert status.stop_reason is StopReason.IN_DOUBT
    assert [facts["event"] for facts in host.records.of("r1")] == ["driving", "stopped"]
    assert host.records.of("r1", "driving")[0]["why"] == "interrupted"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"agents": []}, "one or more"),
        ({"concurrency": 0}, "concurrency"),
        ({"concurrency": True}, "concurrency"),
        ({"poll_s": 0}, "poll_s"),
        ({"poll_s": float("nan")}, "poll_s"),
        ({"drain_grace_s": -1}, "drain_grace_s"),
    ],
)
async def test_arguments_it_cannot_serve_with_are_refused(
    arguments: dict[str, Any], message: str
) -> None:
    agent = payer(MemoryStore(), Till())
    given: dict[str, Any] = {"agents": agent, "concurrency": 1, **arguments}
    with pytest.raises(InvalidRequest, match=message):
        await serve_agents(given.pop("agents"), **given)


async def test_two_agents_of_one_name_are_refused() -> None:
    store = MemoryStore()
    twins = [payer(store, Till()), payer(store, Till())]
    with pytest.raises(InvalidRequest, match="two hosted agents are named 'payer'"):
        await serve_agents(twins, concurrency=1)


async def test_a_mapping_of_agents_on_two_stores_is_served() -> None:
    first, second, till = MemoryStore(), MemoryStore(), Till()
    agents: dict[str, Agent] = {
        "a": payer(first, till, name="a"),
        "b": payer(second, till, name="b"),
    }
    await agents["a"].start("r1", {})
    await agents["b"].start("r2", {})
    async with serving(agents):
        await eventually(lambda: _finished(first, "r1"), what="r1 finishing")
        await eventually(lambda: _finished(second, "r2"), what="r2 finishing")
    assert sorted(till.paid) == ["r1:0:action", "r2:0:action"]


@pytest.mark.parametrize("needs_approval", [False, True], ids=["finished", "awaiting"])
async def test_a_run_another_host_stopped_meanwhile_is_not_said_to_be_driven(
    needs_approval: bool,
) -> None:
    # A host that took a run from an older listing finds it finished, or waiting for a
    # person, once it holds the claim: it reads the log, writes nothing, says nothing.
    store, till = MemoryStore(), Till()
    agent = payer(store, till, needs_approval=needs_approval)
    first = await agent.run("r1", {})
    before = await store.read_log("r1")
    said: list[str] = []
    with _draining.watching(_draining.Drain(), said.append):
        again = await resume_as(agent, await agent.request("r1", {}), {})
    assert again.stop_reason is first.stop_reason
    assert said == []
    assert await store.read_log("r1") == before


async def test_a_deploy_whose_agent_accepts_the_change_moves_a_waiting_run_on(
    opener: Opener,
) -> None:
    store, till = opener(), Till()
    paused = await payer(store, till, needs_approval=True).run("r1", {})
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    await approve(store, "r1", by="ann")
    registry = tools(till, needs_approval=True)
    prompt = (Message.text(Role.SYSTEM, "You are a careful agent. Pay only once."),)
    deployed = Agent(
        name="payer",
        definition=definition(store, script=SCRIPT),
        request_for=lambda run_id, input: request(run_id, registry, run_context=prompt),
        amend=Amendment(by="ops", reason="release 2.4", accept=("run_context.sha256",)),
    )
    async with serving(deployed):
        await eventually(lambda: _finished(store, "r1"), what="r1 going on")
    assert till.paid == ["r1:0:action"]
    log = await store.read_log("r1")
    (amended,) = [record for record in log.records if isinstance(record, Amended)]
    assert (amended.by, amended.reason, list(amended.changes)) == (
        "ops",
        "release 2.4",
        ["run_context.sha256"],
    )
