"""``run_status`` tells apart, on real logs, why a run nobody drives goes on (``ready``)
and that a run waits for a person; under asyncio and Trio, on every store.

Each test leaves a run in one state the way it happens (``Agent.start``, an answer, a
crash inside a tool, a crash between steps) and reads its status back through a new
store object where the store allows, as another process would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import definition, request
from kit.hosting import KINDS, SCRIPT, Opener, Till, payer, tools
from polyloop import (
    Intent,
    IntentKind,
    Ready,
    Reconciled,
    Replay,
    RunState,
    RunStatus,
    StopReason,
    approve,
    reject,
    run,
    run_status,
    settle,
)
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio

# Writes that land before the run is killed: the start record, the model call's intent
# and result, and the payment's intent (the payment then runs), so it dies inside ``pay``.
INSIDE_PAY = 4
# ... and, one more, after the payment's step record: it dies between two steps.
BETWEEN_STEPS = 5


@pytest.fixture(params=KINDS)
async def opener(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    opened = Opener.of(request, tmp_path)
    yield opened
    await opened.aclose()


async def _status(opener: Opener, run_id: str = "r1") -> RunStatus:
    """The run's status, read through a store object of its own."""
    return await run_status(opener(), run_id)


async def _killed(store: Any, till: Till, after: int, **options: Any) -> None:
    """Run ``r1`` of a payer until ``store`` takes no more writes, as if killed."""
    crashing = payer(FaultyStore(store, fail_after_writes=after), till, **options)
    with pytest.raises(SimulatedCrash):
        await crashing.run("r1", {})


class Unsure(Till):
    """A till whose probe can never tell whether a payment went out."""

    async def probe(self, arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        return None


async def test_a_started_run_is_new_and_names_its_agent(opener: Opener) -> None:
    await payer(opener(), Till()).start("r1", {})
    status = await _status(opener)
    assert (status.state, status.ready, status.agent) == (RunState.RESUMABLE, Ready.NEW, "payer")


async def test_an_approved_or_rejected_run_is_ready_and_a_waiting_one_is_not(
    opener: Opener,
) -> None:
    store, till = opener(), Till()
    agent = payer(store, till, needs_approval=True)
    for run_id in ("yes", "no"):
        result = await agent.run(run_id, {})
        assert result.stop_reason is StopReason.AWAITING_APPROVAL
        waiting = await _status(opener, run_id)
        assert (waiting.state, waiting.ready) == (RunState.AWAITING_APPROVAL, None)
    await approve(store, "yes", by="ann")
    await reject(store, "no", by="bob", reason="not today")
    assert (await _status(opener, "yes")).ready is Ready.APPROVED
    assert (await _status(opener, "no")).ready is Ready.REJECTED
    assert till.paid == []  # answered, and nothing driven yet


async def test_a_doubt_without_a_probe_waits_for_a_person_until_it_is_settled(
    opener: Opener,
) -> None:
    store, till = opener(), Till()
    await _killed(store, till, INSIDE_PAY)
    doubt = await _status(opener)
    assert (doubt.state, doubt.ready) == (RunState.IN_DOUBT, None)
    assert _announced(doubt).reconciles is False  # the tool had no probe to ask
    await settle(store, "r1", by="carol", ran=True, observation="paid 2")
    settled = await _status(opener)
    assert (settled.state, settled.ready) == (RunState.RESUMABLE, Ready.SETTLED)


def _announced(status: RunStatus) -> Intent:
    intent = status.open_intent
    assert intent is not None and intent.kind is IntentKind.ACTION
    assert intent.replay is Replay.NEVER
    return intent


async def test_a_doubt_its_tool_s_probe_will_settle_says_so_and_the_probe_does(
    opener: Opener,
) -> None:
    store, till = opener(), Till()
    agent = payer(store, till, probe=True)
    await _killed(store, till, INSIDE_PAY, probe=True)
    doubt = await _status(opener)
    assert (doubt.state, doubt.ready, doubt.agent) == (RunState.IN_DOUBT, Ready.PROBE, "payer")
    assert _announced(doubt).reconciles is True
    result = await agent.run("r1", {})  # any host of the agent; here, in this process
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert till.paid == ["r1:0:action"]  # settled by the probe, never paid twice
    assert (await _status(opener)).reconciled_steps == (0,)


async def test_a_doubt_the_probe_could_not_settle_waits_for_a_person(opener: Opener) -> None:
    store, till = opener(), Unsure()
    agent = payer(store, till, probe=True)
    await _killed(store, till, INSIDE_PAY, probe=True)
    assert (await _status(opener)).ready is Ready.PROBE
    result = await agent.run("r1", {})
    assert result.stop_reason is StopReason.IN_DOUBT
    asked = await _status(opener)
    assert (asked.state, asked.ready) == (RunState.IN_DOUBT, None)
    assert asked.detail is not None and "could not tell" in asked.detail


async def test_a_run_killed_between_steps_or_cancelled_is_interrupted(opener: Opener) -> None:
    store, till = opener(), Till(shut=True)
    await _killed(store, Till(), BETWEEN_STEPS)
    crashed = await _status(opener)
    assert (crashed.state, crashed.ready, crashed.steps) == (
        RunState.RESUMABLE,
        Ready.INTERRUPTED,
        1,
    )
    agent = payer(store, till, replay=Replay.ALLOWED)
    async with anyio.create_task_group() as group:
        group.start_soon(agent.run, "r2", {})
        await till.entered.wait()
        running = await _status(opener, "r2")
        assert (running.state, running.ready) == (RunState.RUNNING, None)
        group.cancel_scope.cancel()
    cancelled = await _status(opener, "r2")
    assert cancelled.stop_reason is StopReason.CANCELLED
    assert (cancelled.state, cancelled.ready) == (RunState.RESUMABLE, Ready.INTERRUPTED)


async def test_a_run_started_without_an_agent_names_none(opener: Opener) -> None:
    store, till = opener(), Till()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=BETWEEN_STEPS), script=SCRIPT),
            request("plain", tools(till)),
        )
    status = await _status(opener, "plain")
    assert (status.ready, status.agent) == (Ready.INTERRUPTED, None)


async def test_a_finished_run_is_not_ready(opener: Opener) -> None:
    await payer(opener(), Till()).run("r1", {})
    status = await _status(opener)
    assert (status.state, status.ready, status.agent) == (RunState.FINISHED, None, "payer")
