"""A tool's probe settles an action in doubt (issue 31), on the memory store: what the
loop asks, when, under which check, what it writes, and what it does with each answer.

The tools (``kit.probe``) pay into an outside ledger keyed by result id: a payment
under a key, or a tombstone that makes a later payment under that key fail. Its probe
finds the payment (it ran) or writes the tombstone (it did not, and never will).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import answer, definition, request, tool_call
from kit.probe import NOT_PAID, KeyVoided, Payments, tools
from polyloop import (
    Action,
    ActionStatus,
    EventKind,
    InvalidRequest,
    LeaseLost,
    Reconciled,
    ReconcilingExecutor,
    Replay,
    RunEnded,
    RunState,
    Settlement,
    StopReason,
    recover,
    resume,
    run,
    run_status,
    settle,
    start_or_resume,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, RecordingSink, SimulatedCrash

pytestmark = pytest.mark.anyio

RUN = "r"
PAY = f"{RUN}:1:action"
# Double 1, pay 5, answer; where the payment did not happen, the model pays again.
SCRIPT = [tool_call("double", n=1), tool_call("pay", n=5), answer("done")]
AGAIN = [tool_call("double", n=1), tool_call("pay", n=5), tool_call("pay", n=5), answer("done")]
# The writes of SCRIPT up to and including the pay intent (start, then two per model
# call, one per step and one per action intent).
AFTER_PAY_INTENT = 8


class ProcessDied(BaseException):
    """Stands in for the death of the process: nothing in the library catches it."""


def die() -> None:
    raise ProcessDied


def probed(payments: Payments) -> list[str]:
    return [key for _, key in payments.probed]


async def crashed_after_paying(store: MemoryStore, payments: Payments) -> None:
    """The first attempt paid, then died before its step landed."""
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=AFTER_PAY_INTENT), script=SCRIPT),
            request(RUN, tools(payments)),
        )
    await store.release_run(RUN)
    assert payments.paid() == [PAY]


async def died_before_paying(store: MemoryStore, payments: Payments) -> None:
    """The first attempt announced the payment, then died before the handler paid."""
    payments.before_paying = die
    with pytest.raises(ProcessDied):
        await run(definition(store, script=AGAIN), request(RUN, tools(payments)))
    await store.release_run(RUN)
    assert payments.paid() == []


async def ended_in_doubt(store: MemoryStore, payments: Payments) -> None:
    """Crashed after paying, then resumed by tools with no probe: it ends in doubt."""
    await crashed_after_paying(store, payments)
    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments, None)))
    assert result.stop_reason is StopReason.IN_DOUBT


def settlements(records: Any) -> list[Settlement]:
    return [record for record in records if isinstance(record, Settlement)]


# -- what the probe's answers do --------------------------------------------------------------


async def test_a_probe_that_finds_the_payment_finishes_the_run_without_paying_again() -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)
    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments)))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert payments.paid() == [PAY] and probed(payments) == [PAY]
    step = result.steps[1]
    assert step.observation == "paid 5"
    assert step.action_status is ActionStatus.EXECUTED and not step.observation_synthesized
    assert step.settled_by == "reconcile:pay"
    assert result.valid_step_count == 2 and result.reconcile_failures == 0
    [settlement] = settlements((await store.read_log(RUN)).records)
    assert settlement.by == "reconcile:pay" and settlement.by_probe and settlement.ran
    assert settlement.duration_s is not None and settlement.duration_s >= 0
    assert (await run_status(store, RUN)).reconciled_steps == (1,)


async def test_a_probe_that_voids_the_key_tells_the_model_which_pays_once_under_a_new_key() -> None:
    store, payments = MemoryStore(), Payments()
    await died_before_paying(store, payments)
    result = await resume(definition(store, script=AGAIN), request(RUN, tools(payments)))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert probed(payments) == [PAY]
    assert payments.paid() == [f"{RUN}:2:action"]
    assert payments.tombstones == {PAY}
    voided, paid = result.steps[1], result.steps[2]
    assert voided.action_status is ActionStatus.NOT_EXECUTED and voided.observation_synthesized
    assert voided.observation == "Refused: " + NOT_PAID.format(key=PAY)
    assert voided.settled_by == "reconcile:pay"
    assert paid.observation == "paid 5" and paid.settled_by is None
    assert result.valid_step_count == 2


async def test_a_late_attempt_under_a_voided_key_fails_on_the_key() -> None:
    payments = Payments()
    assert await payments.finds({"n": 5}, result_id=PAY) == Reconciled(
        ran=False, observation=NOT_PAID.format(key=PAY)
    )
    with pytest.raises(KeyVoided, match="was voided"):
        await payments.pay({"n": 5}, result_id=PAY)
    assert payments.paid() == []


@pytest.mark.parametrize("answer_", [None, "raises", "not reconciled", "ran is not a bool"])
async def test_a_probe_that_cannot_tell_leaves_the_run_in_doubt_for_a_person(answer_: Any) -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)

    async def probe(arguments: dict[str, Any], *, result_id: str) -> Any:
        if answer_ == "raises":
            raise ConnectionError("the bank did not answer")
        if answer_ == "not reconciled":
            return "yes"
        if answer_ == "ran is not a bool":
            return Reconciled(ran="yes", observation="x")  # type: ignore[arg-type]
        return None

    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments, probe)))
    assert result.stop_reason is StopReason.IN_DOUBT
    assert result.reconcile_failures == (0 if answer_ is None else 1)
    expected = {
        None: "the probe of tool 'pay' could not tell",
        "raises": "the probe of tool 'pay' failed: ConnectionError: the bank did not answer",
        "not reconciled": "the probe of tool 'pay' failed: TypeError: the probe of tool 'pay' "
        "returned 'yes'",
        "ran is not a bool": "the probe of tool 'pay' failed: TypeError: the probe of tool 'pay' "
        "returned Reconciled(ran='yes'",
    }[answer_]
    assert result.detail is not None and expected in result.detail
    assert PAY in result.detail
    log = await store.read_log(RUN)
    assert settlements(log.records) == []
    assert isinstance(log.records[-1], RunEnded) and log.records[-1].detail == result.detail
    # A person can still settle it, and the run goes on as before probes existed.
    await settle(store, RUN, by="carol", ran=True, observation="paid 5")
    done = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments, probe)))
    assert done.stop_reason is StopReason.FINAL_ANSWER and done.steps[1].settled_by == "carol"
    assert payments.paid() == [PAY]
    assert (await run_status(store, RUN)).reconciled_steps == ()


async def test_a_probe_added_after_the_run_ended_in_doubt_settles_it() -> None:
    store, payments = MemoryStore(), Payments()
    await ended_in_doubt(store, payments)
    assert (await run_status(store, RUN)).state is RunState.IN_DOUBT
    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments)))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.steps[1].settled_by == "reconcile:pay" and payments.paid() == [PAY]
    records = (await store.read_log(RUN)).records
    ends = [record.stop_reason for record in records if isinstance(record, RunEnded)]
    assert ends == [StopReason.IN_DOUBT, StopReason.FINAL_ANSWER]


async def test_resuming_a_run_in_doubt_whose_probe_still_cannot_tell_writes_nothing() -> None:
    store, payments = MemoryStore(), Payments()
    await ended_in_doubt(store, payments)
    before = (await store.read_log(RUN)).records

    async def fails(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        raise RuntimeError("ledger offline")

    sink = RecordingSink()
    result = await resume(
        definition(store, script=SCRIPT, events=sink), request(RUN, tools(payments, fails))
    )
    assert result.stop_reason is StopReason.IN_DOUBT and result.resumed
    assert result.reconcile_failures == 1
    assert result.detail is not None and "RuntimeError: ledger offline" in result.detail
    assert (await store.read_log(RUN)).records == before
    assert sink.events == []  # nothing happened to the run: no resumed event, no end


async def test_a_run_in_doubt_with_no_probe_is_resumed_as_before() -> None:
    store, payments = MemoryStore(), Payments()
    await ended_in_doubt(store, payments)
    before = (await store.read_log(RUN)).records
    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments, None)))
    assert result.stop_reason is StopReason.IN_DOUBT and result.reconcile_failures == 0
    assert (await store.read_log(RUN)).records == before
    assert probed(payments) == []


async def test_a_replayable_action_is_run_again_and_its_probe_is_not_asked() -> None:
    store, payments = MemoryStore(), Payments()
    payments.before_paying = die
    with pytest.raises(ProcessDied):
        await run(
            definition(store, script=SCRIPT), request(RUN, tools(payments, replay=Replay.ALLOWED))
        )
    await store.release_run(RUN)
    result = await resume(
        definition(store, script=SCRIPT), request(RUN, tools(payments, replay=Replay.ALLOWED))
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert probed(payments) == [] and payments.paid() == [PAY]


# -- when it is asked -------------------------------------------------------------------------


async def test_start_or_resume_and_recover_ask_the_probe_too() -> None:
    first, second, payments = MemoryStore(), MemoryStore(), Payments()
    await crashed_after_paying(first, payments)
    result = await start_or_resume(definition(first, script=SCRIPT), request(RUN, tools(payments)))
    assert result.steps[1].settled_by == "reconcile:pay"

    others = Payments()
    await ended_in_doubt(second, others)
    [recovered] = await recover(
        definition(second, script=SCRIPT),
        second,
        lambda run_id: request(run_id, tools(others)),
        max_concurrent=1,
    )
    assert recovered.result is not None
    assert recovered.result.stop_reason is StopReason.FINAL_ANSWER
    assert probed(others) == [PAY] and others.paid() == [PAY]


class LostLease(MemoryStore):
    """A memory store whose claim check says the lease is gone, once ``lost`` is set."""

    lost = False

    async def check_claim(self, run_id: str) -> None:
        if self.lost:
            raise LeaseLost("the lease ran out", run_id=run_id)
        await super().check_claim(run_id)


async def test_the_probe_runs_only_while_the_claim_holds() -> None:
    store, payments = LostLease(), Payments()
    await crashed_after_paying(store, payments)
    before = (await store.read_log(RUN)).records
    store.lost = True
    with pytest.raises(LeaseLost):
        await resume(definition(store, script=SCRIPT), request(RUN, tools(payments)))
    assert probed(payments) == []
    assert (await store.read_log(RUN)).records == before


# -- cancellation -----------------------------------------------------------------------------


def held_probe(entered: anyio.Event) -> Any:
    async def probe(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    return probe


async def cancelled_while_probing(store: MemoryStore, payments: Payments) -> None:
    entered = anyio.Event()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(
                resume,
                definition(store, script=SCRIPT),
                request(RUN, tools(payments, held_probe(entered))),
            )
            await entered.wait()
            scope.cancel()
    assert scope.cancelled_caught


async def test_cancelled_while_probing_a_run_that_ended_in_doubt_leaves_its_log_as_it_was() -> None:
    store, payments = MemoryStore(), Payments()
    await ended_in_doubt(store, payments)
    before = (await store.read_log(RUN)).records
    await cancelled_while_probing(store, payments)
    assert (await store.read_log(RUN)).records == before
    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments)))
    assert result.stop_reason is StopReason.FINAL_ANSWER and payments.paid() == [PAY]


async def test_cancelled_while_probing_after_a_crash_ends_cancelled_and_asks_again_later() -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)
    await cancelled_while_probing(store, payments)
    last = (await store.read_log(RUN)).records[-1]
    assert isinstance(last, RunEnded) and last.stop_reason is StopReason.CANCELLED
    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments)))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.steps[1].settled_by == "reconcile:pay" and payments.paid() == [PAY]


# -- a probe that never answers ---------------------------------------------------------------

# Long enough for the probes that answer, short enough that a hung one ends the test fast.
TINY_TIMEOUT_S = 0.05
TIMED_OUT = (
    f"the probe of tool 'pay' failed: TimeoutError: it did not answer within "
    f"{TINY_TIMEOUT_S:g} s and was cancelled"
)


async def crashed_run_after_paying(store: MemoryStore, payments: Payments, run_id: str) -> None:
    """``run_id`` paid, then its process died before the step landed."""
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=AFTER_PAY_INTENT), script=SCRIPT),
            request(run_id, tools(payments)),
        )
    await store.release_run(run_id)


async def test_recover_returns_when_a_probe_hangs_and_leaves_only_that_run_in_doubt() -> None:
    store, payments = MemoryStore(), Payments()
    for run_id in ("a", "hung", "z"):
        await crashed_run_after_paying(store, payments, run_id)
    payments.hangs_on = {"hung:1:action"}
    # A guard against a hang, never reached when the probe's own timeout works.
    with anyio.fail_after(30):
        report = await recover(
            definition(store, script=SCRIPT),
            store,
            lambda run_id: request(run_id, tools(payments, probe_timeout_s=TINY_TIMEOUT_S)),
            max_concurrent=1,
        )
    results = {item.run_id: item.result for item in report}
    assert set(results) == {"a", "hung", "z"} and all(item.error is None for item in report)
    for run_id in ("a", "z"):
        done = results[run_id]
        assert done is not None and done.stop_reason is StopReason.FINAL_ANSWER
        assert done.steps[1].settled_by == "reconcile:pay" and done.reconcile_failures == 0
    hung = results["hung"]
    assert hung is not None and hung.stop_reason is StopReason.IN_DOUBT
    assert hung.reconcile_failures == 1
    assert hung.detail is not None and TIMED_OUT in hung.detail
    assert payments.cancelled == ["hung:1:action"]
    log = await store.read_log("hung")
    assert settlements(log.records) == []
    assert isinstance(log.records[-1], RunEnded) and log.records[-1].detail == hung.detail
    # A person settles it as any other run in doubt, and it goes on.
    await settle(store, "hung", by="carol", ran=True, observation="paid 5")
    done = await resume(definition(store, script=SCRIPT), request("hung", tools(payments)))
    assert done.stop_reason is StopReason.FINAL_ANSWER and done.steps[1].settled_by == "carol"
    assert sorted(payments.paid()) == ["a:1:action", "hung:1:action", "z:1:action"]


async def test_an_answer_a_probe_gives_after_its_timeout_cancelled_it_is_not_taken() -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)

    async def stubborn(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            # Swallows its cancellation, against the contract, to answer anyway.
            return Reconciled(ran=True, observation="paid 5")
        raise AssertionError("unreachable")

    with anyio.fail_after(30):  # a guard against a hang, as above
        result = await resume(
            definition(store, script=SCRIPT),
            request(RUN, tools(payments, stubborn, probe_timeout_s=TINY_TIMEOUT_S)),
        )
    assert result.stop_reason is StopReason.IN_DOUBT and result.reconcile_failures == 1
    assert result.detail is not None and TIMED_OUT in result.detail
    assert settlements((await store.read_log(RUN)).records) == []


async def test_a_cancellation_from_outside_a_probe_is_not_taken_for_its_timeout() -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)
    returned = False
    with anyio.CancelScope() as outside:

        async def probe(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
            outside.cancel()  # the caller gives up while the probe waits, well within its time
            await payments.finds(arguments, result_id=result_id)
            raise AssertionError("unreachable")

        payments.hangs_on = {PAY}
        registry = tools(payments, probe, probe_timeout_s=TINY_TIMEOUT_S)
        await resume(definition(store, script=SCRIPT), request(RUN, registry))
        returned = True
    assert outside.cancelled_caught and not returned
    assert probed(payments) == [PAY]
    records = (await store.read_log(RUN)).records
    last = records[-1]
    assert isinstance(last, RunEnded) and last.stop_reason is StopReason.CANCELLED
    assert "TimeoutError" not in (last.detail or "") and settlements(records) == []


# -- what observers see -----------------------------------------------------------------------


async def test_the_settled_step_event_carries_the_probe_settlement() -> None:
    store, payments, sink = MemoryStore(), Payments(), RecordingSink()
    await crashed_after_paying(store, payments)
    await resume(definition(store, script=SCRIPT, events=sink), request(RUN, tools(payments)))
    resumed = next(event for event in sink.events if event.kind is EventKind.RUN_RESUMED)
    assert any(isinstance(record, Settlement) for record in resumed.logged)
    settled = [event for event in sink.events if event.settlement is not None]
    assert [(event.kind, event.step) for event in settled] == [(EventKind.STEP_FINISHED, 1)]
    assert settled[0].settlement is not None and settled[0].settlement.by == "reconcile:pay"


# -- the registry's side ----------------------------------------------------------------------


async def test_a_probe_must_be_an_async_function() -> None:
    def probe(arguments: dict[str, Any], *, result_id: str) -> None:
        return None

    with pytest.raises(InvalidRequest, match="tool 'pay': reconcile must be None or an async"):
        tools(Payments(), probe)


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan, math.inf, True, "30", None])
async def test_a_probe_timeout_must_be_a_positive_finite_number_of_seconds(seconds: Any) -> None:
    with pytest.raises(InvalidRequest, match="tool 'pay': reconcile_timeout_s must be a positive"):
        tools(Payments(), probe_timeout_s=seconds)


async def test_a_probe_waits_30_s_by_default_and_its_timeout_is_no_part_of_the_run() -> None:
    payments = Payments()
    registry = tools(payments)
    spec = registry.get("pay")
    assert spec is not None and spec.reconcile_timeout_s == 30.0
    # What the model is shown and the run's snapshot records is the same for any timeout.
    assert tools(payments, probe_timeout_s=0.5).describe() == registry.describe()
    assert tools(payments, None).describe() == registry.describe()


async def test_the_registry_executor_asks_only_tools_with_a_probe_and_cuts_their_answer() -> None:
    payments = Payments()

    async def wordy(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        return Reconciled(ran=True, observation="x" * 20_000)

    executor = tools(payments, wordy).executor()
    assert isinstance(executor, ReconcilingExecutor)
    pay = Action(payload={"name": "pay", "arguments": {"n": 5}}, action_text="", history_text="")
    double = dataclasses.replace(pay, payload={"name": "double", "arguments": {"n": 1}})
    assert executor.reconciles(pay) and not executor.reconciles(double)
    assert not executor.reconciles(dataclasses.replace(pay, payload="not a call"))
    assert await executor.reconcile(double, result_id="k") is None
    answered = await executor.reconcile(pay, result_id="k")
    assert answered == Reconciled(ran=True, observation="x" * 10_000)


async def test_the_probe_gets_its_own_copy_of_the_recorded_arguments() -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)
    seen: list[dict[str, Any]] = []

    async def editing(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        seen.append(dict(arguments))
        arguments["n"] = 999
        return Reconciled(ran=True, observation="paid 5")

    result = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments, editing)))
    assert seen == [{"n": 5}]
    assert result.steps[1].action_text is not None and "999" not in result.steps[1].action_text


async def test_a_crash_before_the_settlement_is_written_asks_the_probe_again() -> None:
    store, payments = MemoryStore(), Payments()
    await crashed_after_paying(store, payments)
    with pytest.raises(SimulatedCrash):  # the settlement is the first write refused
        await resume(
            definition(FaultyStore(store, fail_after_writes=0), script=SCRIPT),
            request(RUN, tools(payments)),
        )
    await store.release_run(RUN)
    assert (await run_status(store, RUN)).state is RunState.IN_DOUBT
    done = await resume(definition(store, script=SCRIPT), request(RUN, tools(payments)))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert probed(payments) == [PAY, PAY]  # the same key, asked twice
    assert payments.paid() == [PAY]
