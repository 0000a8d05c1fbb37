"""What the docs promise about a tool's probe, one promise a test: a probe that cannot
tell or fails leaves the run in doubt (and a person may still settle it), a probe added
after a run ended in doubt settles it on the next start, only a ``NEVER`` action is
probed, and the probe waits for the claim check like any effect.

Each run crashes right after its payment's intent is durable (the store refuses every
later write), in memory, and is resumed on the same store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agent_kit import NUMBER_SCHEMA, answer, definition, request, tool_call
from polyloop import (
    Intent,
    IntentKind,
    JSONValue,
    LeaseLost,
    Reconciled,
    Replay,
    RunState,
    Settlement,
    StopReason,
    ToolRegistry,
    ToolSpec,
    resume,
    run,
    run_status,
    settle,
    start_or_resume,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio

RUN_ID = "r"
SCRIPT = [tool_call("pay", n=5), answer("paid")]
Probe = Callable[..., Awaitable[Reconciled | None]]


class CrashAfterPaymentIntent(FaultyStore):
    """Crashes (refuses every later write) once the first action intent is durable."""

    async def write_intent(self, intent: Intent) -> None:
        await super().write_intent(intent)
        if intent.kind is IntentKind.ACTION:
            self.fail_after_writes = self.writes


class RefusingClaims(FaultyStore):
    """Every write passes; the claim check before an effect says the lease is lost."""

    async def check_claim(self, run_id: str) -> None:
        raise LeaseLost("the lease ended", run_id=run_id)


class Pay:
    """``pay`` and its probe, counting what each did."""

    def __init__(self, probe: Probe | None, replay: Replay = Replay.NEVER) -> None:
        self.paid: list[str] = []
        self.asked: list[str] = []
        self._probe = probe
        self._replay = replay

    async def pay(self, arguments: dict[str, JSONValue], *, result_id: str) -> str:
        self.paid.append(result_id)
        return f"paid {arguments['n']}"

    async def probe(self, arguments: dict[str, JSONValue], *, result_id: str) -> Any:
        self.asked.append(result_id)
        assert self._probe is not None
        return await self._probe(arguments, result_id=result_id)

    def tools(self) -> ToolRegistry:
        spec = ToolSpec(
            name="pay",
            description="Pay an amount.",
            parameters=NUMBER_SCHEMA,
            handler=self.pay,
            replay=self._replay,
            reconcile=self.probe if self._probe is not None else None,
        )
        return ToolRegistry([spec], max_observation_chars=1_000)


async def crashed_in_pay(
    store: MemoryStore, tools: Pay, leaves: RunState = RunState.IN_DOUBT
) -> None:
    """Start the run and crash it right after the payment's intent (the payment ran)."""
    with pytest.raises(SimulatedCrash):
        await run(
            definition(CrashAfterPaymentIntent(store, fail_after_writes=10**6), script=SCRIPT),
            request(RUN_ID, tools.tools()),
        )
    assert (await run_status(store, RUN_ID)).state is leaves


async def cannot_tell(arguments: dict[str, JSONValue], *, result_id: str) -> None:
    return None


async def bank_down(arguments: dict[str, JSONValue], *, result_id: str) -> None:
    raise RuntimeError("the bank did not answer")


async def found_it(arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
    return Reconciled(ran=True, observation=f"paid {arguments['n']} (found)")


async def test_a_probe_that_cannot_tell_leaves_the_run_in_doubt_and_a_person_settles_it() -> None:
    store, tools = MemoryStore(), Pay(cannot_tell)
    await crashed_in_pay(store, tools)
    in_doubt = await resume(definition(store, script=SCRIPT), request(RUN_ID, tools.tools()))
    assert in_doubt.stop_reason is StopReason.IN_DOUBT
    assert in_doubt.reconcile_failures == 0
    assert "the probe of tool 'pay' could not tell" in (in_doubt.detail or "")
    await settle(store, RUN_ID, by="alice", ran=True, observation="paid 5")
    done = await resume(definition(store, script=SCRIPT), request(RUN_ID, tools.tools()))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert done.steps[0].settled_by == "alice"
    assert tools.paid == ["r:0:action"]  # once, before the crash


async def says_yes(arguments: dict[str, JSONValue], *, result_id: str) -> Any:
    return "yes"


@pytest.mark.parametrize(
    ("probe", "said"),
    [
        (bank_down, "RuntimeError: the bank did not answer"),
        (says_yes, "TypeError: the probe of tool 'pay' returned 'yes'"),
    ],
)
async def test_a_probe_that_raises_counts_as_cannot_tell_and_is_counted(
    probe: Probe, said: str
) -> None:
    store, tools = MemoryStore(), Pay(probe)
    await crashed_in_pay(store, tools)
    in_doubt = await resume(definition(store, script=SCRIPT), request(RUN_ID, tools.tools()))
    assert in_doubt.stop_reason is StopReason.IN_DOUBT
    assert in_doubt.reconcile_failures == 1
    assert said in (in_doubt.detail or "")
    assert tools.paid == ["r:0:action"]


async def test_a_run_that_ended_in_doubt_is_settled_by_a_probe_added_later() -> None:
    store, without = MemoryStore(), Pay(None)
    await crashed_in_pay(store, without)
    ended = await resume(definition(store, script=SCRIPT), request(RUN_ID, without.tools()))
    assert ended.stop_reason is StopReason.IN_DOUBT  # no probe: as before
    # The probe is attached to the very spec the run started with (as to a mounted one).
    asked: list[str] = []

    async def probe(arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
        asked.append(result_id)
        return await found_it(arguments, result_id=result_id)

    spec = without.tools().get("pay")
    assert spec is not None
    tools = ToolRegistry([dataclasses.replace(spec, reconcile=probe)], max_observation_chars=1_000)
    done = await start_or_resume(definition(store, script=SCRIPT), request(RUN_ID, tools))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert asked == ["r:0:action"]
    assert done.steps[0].settled_by == "reconcile:pay"
    assert done.steps[0].observation == "paid 5 (found)"
    assert without.paid == ["r:0:action"]  # once, before the crash
    (settlement,) = [r for r in (await store.read_log(RUN_ID)).records if isinstance(r, Settlement)]
    assert settlement.by_probe and settlement.duration_s is not None


async def test_a_tool_whose_call_may_be_repeated_is_called_again_not_probed() -> None:
    store, tools = MemoryStore(), Pay(found_it, replay=Replay.ALLOWED)
    await crashed_in_pay(store, tools, leaves=RunState.RESUMABLE)
    done = await resume(definition(store, script=SCRIPT), request(RUN_ID, tools.tools()))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert tools.asked == []
    assert tools.paid == ["r:0:action", "r:0:action"]
    assert done.steps[0].settled_by is None


async def test_the_probe_is_not_asked_when_the_claim_check_fails() -> None:
    store, tools = MemoryStore(), Pay(found_it)
    await crashed_in_pay(store, tools)
    before = (await store.read_log(RUN_ID)).records
    with pytest.raises(LeaseLost):
        await resume(
            definition(RefusingClaims(store, fail_after_writes=10**6), script=SCRIPT),
            request(RUN_ID, tools.tools()),
        )
    assert tools.asked == []
    assert (await store.read_log(RUN_ID)).records == before  # nothing written
    assert tools.paid == ["r:0:action"]


async def test_a_crash_before_the_settlement_is_written_asks_the_probe_again() -> None:
    store, tools = MemoryStore(), Pay(found_it)
    await crashed_in_pay(store, tools)
    with pytest.raises(SimulatedCrash):  # the settlement is the first write refused
        await resume(
            definition(FaultyStore(store, fail_after_writes=0), script=SCRIPT),
            request(RUN_ID, tools.tools()),
        )
    assert (await run_status(store, RUN_ID)).state is RunState.IN_DOUBT
    done = await resume(definition(store, script=SCRIPT), request(RUN_ID, tools.tools()))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert tools.asked == ["r:0:action", "r:0:action"]  # the same key, asked twice
    assert tools.paid == ["r:0:action"]
