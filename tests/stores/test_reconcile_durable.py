"""A run settled by its tool's own probe, on every store under asyncio and Trio (issue 31).

The ``pay`` tool (replay never allowed) writes to an outside ledger keyed by result id,
and its probe either finds the payment (it ran) or writes a tombstone for the key (it
did not, and a late attempt with that key fails). A crash after every write of the first
attempt, and another after every write of the resume that asks the probe, each followed
by a resume on a fresh store object: the run always finishes, one payment is made, and
the trajectory is the uninterrupted run's (with, where the probe said "did not run", the
refused call the model then makes again). A probe that cannot tell leaves the run in
doubt for a person, exactly as before probes existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import TEXTS, answer, definition, request, tool_call
from kit.probe import NOT_PAID, KeyVoided, Payments, tools
from kit.review import plain_steps
from kit.store import STORE_KINDS, durable_opener, sampled
from kit.sweep import every_point
from polyloop import (
    ActionStatus,
    ModelCall,
    Replay,
    RunEnded,
    RunResult,
    Settlement,
    StepRecord,
    StopReason,
    Store,
    TextBlock,
    recover,
    run_status,
    settle,
    start_or_resume,
)
from polyloop._recovery import RecoveryState, read_plan
from polyloop.cli import main
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

pytestmark = pytest.mark.anyio

RUN = "r"
PAY_INTENT = 8  # start; double: 4 writes; pay: model intent, its result, the action's intent
FIRST_WRITES = 13  # the above; pay's step; the answer: 3 writes; the end
PAYING = "paying"  # a crash inside pay's handler, after its intent, before it pays


def customer(call: ModelCall) -> str:
    """Double 1, pay 5, and pay again if told the payment did not happen; then answer."""
    if call.call_index == 0:
        return tool_call("double", n=1)
    if call.call_index == 1 or _refused(call):
        return tool_call("pay", n=5)
    return answer("done")


def _refused(call: ModelCall) -> bool:
    last = call.messages[-1].content
    refusal = TEXTS.not_executed.split("{", 1)[0]
    return any(isinstance(b, TextBlock) and refusal in b.text for b in last)


@dataclasses.dataclass
class Worker:
    """Drives the run one process at a time over one store: each attempt opens a new
    store object (the memory store has only its one), and one may crash after a given
    number of its writes, or inside pay's handler, before it pays."""

    open_store: Callable[[], Store]
    payments: Payments
    kind: str

    @property
    def durable(self) -> bool:
        return self.kind != "memory"

    async def attempt(
        self, *, crash_after: int | str | None = None, probe: str | None = "finds"
    ) -> RunResult | None:
        """The run's result, or ``None`` if this attempt crashed."""
        self.payments.attempt += 1
        store = self.open_store()
        target: Store = store
        if crash_after is not None:
            faulty = FaultyStore(store, fail_after_writes=FIRST_WRITES * 4)
            if crash_after == PAYING:
                self.payments.before_paying = _dies(faulty)
            else:
                assert isinstance(crash_after, int)
                faulty.fail_after_writes = crash_after
            target = faulty
        try:
            return await start_or_resume(
                definition(target, model=ScriptedModelClient(customer)),
                request(RUN, tools(self.payments, probe), model_replay=Replay.ALLOWED),
            )
        except SimulatedCrash:
            return None
        finally:
            self.payments.before_paying = None
            if self.durable:
                await store.aclose()  # type: ignore[attr-defined]

    async def read(self, operation: Callable[[Store], Any]) -> Any:
        store = self.open_store()
        try:
            return await operation(store)
        finally:
            if self.durable:
                await store.aclose()  # type: ignore[attr-defined]

    async def records(self) -> tuple[Any, ...]:
        return await self.read(lambda store: _records(store))

    async def in_doubt_about(self) -> str | None:
        """The key of the action the log is in doubt about now, if any (the log verifies)."""
        plan = read_plan(await self.read(lambda store: store.read_log(RUN)))
        if plan.state is not RecoveryState.IN_DOUBT:
            return None
        assert plan.open_intent is not None
        return plan.open_intent.result_id


def _dies(faulty: FaultyStore) -> Callable[[], None]:
    """What the process dying inside the handler looks like: nothing more is written."""

    def die() -> None:
        faulty.fail_after_writes = faulty.writes
        raise SimulatedCrash("simulated crash inside pay, before it paid")

    return die


async def _records(store: Store) -> tuple[Any, ...]:
    return (await store.read_log(RUN)).records


@pytest.fixture(params=sampled(STORE_KINDS))
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Worker:
    return _worker(request, tmp_path)


def _worker(request: pytest.FixtureRequest, tmp_path: Path) -> Worker:
    if request.param == "memory":
        memory = MemoryStore()
        return Worker(lambda: memory, Payments(), request.param)
    return Worker(durable_opener(request, tmp_path), Payments(), request.param)


async def _uninterrupted() -> RunResult:
    async with MemoryStore() as store:
        return await start_or_resume(
            definition(store, model=ScriptedModelClient(customer)),
            request(RUN, tools(Payments()), model_replay=Replay.ALLOWED),
        )


def _expected(reference: RunResult, voided: Sequence[str] = ()) -> list[StepRecord]:
    """What the run's steps must be: the uninterrupted run's, timing and settlers aside.

    For each key in ``voided`` (a payment the probe said never happened) the payment's
    step is refused with the probe's reason, and the model, told so, pays again in the
    next step: the uninterrupted steps from the payment on move one step later.
    """
    double, paid, answered = plain_steps(reference.steps)
    refusals = [
        dataclasses.replace(
            paid,
            step=paid.step + i,
            call_id=f"{RUN}/{paid.step + i}",
            observation=TEXTS.not_executed.format(reason=NOT_PAID.format(key=key)),
            observation_synthesized=True,
            action_status=ActionStatus.NOT_EXECUTED,
        )
        for i, key in enumerate(voided)
    ]
    later = [
        dataclasses.replace(
            step, step=step.step + len(voided), call_id=f"{RUN}/{step.step + len(voided)}"
        )
        for step in (paid, answered)
    ]
    return [double, *refusals, *later]


def _voided_keys(payments: Payments) -> list[str]:
    return sorted(payments.tombstones, key=lambda key: int(key.split(":")[1]))


async def _assert_finished_once(
    worker: Worker, result: RunResult | None, *, ended_in_doubt: int = 0
) -> None:
    """The run ended with its answer, one payment was made, and no key that a probe
    voided can be paid late; the log verifies (a settlement written twice would not) and
    holds ``ended_in_doubt`` in-doubt ends before the final one."""
    assert result is not None
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert list(worker.payments.payments.values()) == [5]
    entered = worker.payments.entered
    assert len(entered) == len(set(entered)), f"pay ran twice under one key: {entered}"
    for key in worker.payments.tombstones:
        assert key not in worker.payments.payments
        with pytest.raises(KeyVoided):
            await worker.payments.pay({"n": 5}, result_id=key)
    assert await worker.in_doubt_about() is None
    ends = [r.stop_reason for r in await worker.records() if isinstance(r, RunEnded)]
    assert ends == [StopReason.IN_DOUBT] * ended_in_doubt + [StopReason.FINAL_ANSWER]


# Crash points of the first attempt, in the order they happen: after write k, and, for
# PAYING, inside pay after its intent (write 8) but before the payment. The two that
# leave the payment in doubt run on every store; the others are sampled unless the slow
# set runs.
IN_DOUBT_POINTS = [PAYING, PAY_INTENT]
OTHER_POINTS = [k for k in range(FIRST_WRITES) if k != PAY_INTENT]


@pytest.mark.parametrize("point", IN_DOUBT_POINTS)
async def test_a_crash_that_leaves_the_payment_in_doubt_is_settled_by_the_probe(
    worker: Worker, point: int | str
) -> None:
    await _crash_and_resume(worker, point)


@pytest.mark.parametrize("point", every_point(OTHER_POINTS))
async def test_a_crash_after_any_other_write_needs_no_probe(worker: Worker, point: int) -> None:
    await _crash_and_resume(worker, point)


async def _crash_and_resume(worker: Worker, point: int | str) -> None:
    """The first attempt crashes at ``point``; one resume with the probe finishes the run
    as the uninterrupted run ends, asking the probe only if the payment was in doubt."""
    assert await worker.attempt(crash_after=point) is None
    result = await worker.attempt()
    await _assert_finished_once(worker, result)
    assert result is not None
    in_doubt = point in IN_DOUBT_POINTS
    voided = ["r:1:action"] if point == PAYING else []
    assert _voided_keys(worker.payments) == voided
    assert plain_steps(result.steps) == _expected(await _uninterrupted(), voided)
    assert worker.payments.probed == ([(2, "r:1:action")] if in_doubt else [])
    settlements = await _settlements(worker)
    status = await worker.read(lambda store: run_status(store, RUN))
    if not in_doubt:
        assert settlements == []
        assert status.reconciled_steps == ()
        return
    (settlement,) = settlements
    assert settlement.result_id == "r:1:action"
    assert settlement.by == "reconcile:pay" and settlement.by_probe
    assert settlement.ran is (point == PAY_INTENT)
    assert settlement.duration_s is not None and settlement.duration_s >= 0
    assert result.steps[1].settled_by == "reconcile:pay"
    assert status.reconciled_steps == (1,)


# The writes of the resume that asks the probe: the settlement, the settled step, then
# the rest of the run (for a payment that did not happen, the model's second payment).
RESUME_WRITES = {PAY_INTENT: 6, PAYING: 10}
SECOND_CRASHES = every_point(
    [
        *((first, j) for first in IN_DOUBT_POINTS for j in range(RESUME_WRITES[first])),
        (PAYING, PAYING),  # the second payment dies in its handler too
    ]
)


@pytest.mark.parametrize(("first", "second"), SECOND_CRASHES)
async def test_a_crash_after_every_write_of_the_resume_that_asks_the_probe(
    worker: Worker, first: int | str, second: int | str
) -> None:
    assert await worker.attempt(crash_after=first) is None
    asked: list[tuple[int, str]] = []
    for crash_after in (second, None):
        key = await worker.in_doubt_about()
        if key is not None:
            asked.append((worker.payments.attempt + 1, key))
        result = await worker.attempt(crash_after=crash_after)
        assert (result is None) is (crash_after is not None)
    await _assert_finished_once(worker, result)
    assert result is not None
    # Asked exactly once by each attempt that found a payment in doubt, and by no other.
    assert worker.payments.probed == asked
    voided = _voided_keys(worker.payments)
    assert voided == (["r:1:action"] if first == PAYING else []) + (
        ["r:2:action"] if second == PAYING else []
    )
    assert plain_steps(result.steps) == _expected(await _uninterrupted(), voided)
    settled = [s.result_id for s in await _settlements(worker)]
    assert sorted(settled) == sorted({key for _, key in asked})  # one settlement per key
    assert all(
        result.steps[int(key.split(":")[1])].settled_by == "reconcile:pay" for key in settled
    )


@pytest.mark.parametrize("probe", ["cannot_tell", "fails"])
async def test_a_probe_that_cannot_tell_leaves_the_run_in_doubt_for_a_person(
    worker: Worker, probe: str
) -> None:
    assert await worker.attempt(crash_after=PAY_INTENT) is None
    doubt = await worker.attempt(probe=probe)
    assert doubt is not None and doubt.stop_reason is StopReason.IN_DOUBT
    assert doubt.reconcile_failures == (1 if probe == "fails" else 0)
    assert doubt.detail is not None
    said = "failed: ConnectionError" if probe == "fails" else "could not tell"
    assert f"the probe of tool 'pay' {said}" in doubt.detail
    assert await _settlements(worker) == []
    assert await worker.in_doubt_about() == "r:1:action"

    await worker.read(lambda store: settle(store, RUN, by="carol", ran=True, observation="paid 5"))
    result = await worker.attempt(probe=probe)
    await _assert_finished_once(worker, result, ended_in_doubt=1)
    assert result is not None
    assert plain_steps(result.steps) == _expected(await _uninterrupted())
    assert result.steps[1].settled_by == "carol"
    assert worker.payments.probed == [(2, "r:1:action")]  # not asked once a person answered


@pytest.mark.parametrize("worker", ["sqlite"], indirect=True)
async def test_the_command_line_settles_a_run_whose_probe_failed(
    worker: Worker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await worker.attempt(crash_after=PAY_INTENT) is None
    doubt = await worker.attempt(probe="fails")
    assert doubt is not None and doubt.stop_reason is StopReason.IN_DOUBT
    argv = ["settle", f"sqlite:{tmp_path / 'runs.db'}", RUN, "--by", "carol", "--ran"]
    argv += ["--observation", "paid 5"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert "settled r:1:action: ran (by carol)" in capsys.readouterr().out
    result = await worker.attempt(probe="fails")
    await _assert_finished_once(worker, result, ended_in_doubt=1)
    assert result is not None
    assert result.steps[1].settled_by == "carol"
    assert plain_steps(result.steps) == _expected(await _uninterrupted())


async def test_a_run_in_doubt_before_its_tool_had_a_probe_is_settled_by_one_added_later(
    worker: Worker, tmp_path: Path
) -> None:
    assert await worker.attempt(crash_after=PAY_INTENT, probe=None) is None
    ended = await worker.attempt(probe=None)
    assert ended is not None and ended.stop_reason is StopReason.IN_DOUBT
    before = (await worker.records(), _jsonl_bytes(tmp_path))
    assert isinstance(before[0][-1], RunEnded)
    assert bool(before[1]) is (worker.kind == "jsonl")

    for probe, said in (("cannot_tell", "could not tell"), ("fails", "failed")):
        again = await worker.attempt(probe=probe)
        assert again is not None and again.stop_reason is StopReason.IN_DOUBT
        assert again.detail is not None and f"the probe of tool 'pay' {said}" in again.detail
        assert again.reconcile_failures == (1 if probe == "fails" else 0)
        assert (await worker.records(), _jsonl_bytes(tmp_path)) == before  # nothing written

    result = await worker.attempt()
    await _assert_finished_once(worker, result, ended_in_doubt=1)
    assert result is not None
    assert plain_steps(result.steps) == _expected(await _uninterrupted())
    assert result.steps[1].settled_by == "reconcile:pay"
    assert worker.payments.probed == [(3, "r:1:action"), (4, "r:1:action"), (5, "r:1:action")]
    (settlement,) = await _settlements(worker)
    assert settlement.ran and settlement.observation == "paid 5"


# -- a probe that never answers ---------------------------------------------------------------

HUNG = "hung:1:action"


@pytest.fixture
def store_argument(
    worker: Worker, request: pytest.FixtureRequest, tmp_path: Path
) -> list[str] | None:
    """The command line's STORE argument (and schema) for the worker's store; ``None`` for
    memory."""
    if worker.kind == "jsonl":
        return [f"jsonl:{tmp_path / 'runs'}"]
    if worker.kind == "sqlite":
        return [f"sqlite:{tmp_path / 'runs.db'}"]
    if worker.kind == "postgresql":
        conninfo, schema = request.getfixturevalue("postgres_place")
        return [conninfo, "--schema", schema]
    return None


async def _paid_then_crashed(worker: Worker, run_id: str) -> None:
    store = worker.open_store()
    with pytest.raises(SimulatedCrash):
        await start_or_resume(
            definition(
                FaultyStore(store, fail_after_writes=PAY_INTENT),
                model=ScriptedModelClient(customer),
            ),
            request(run_id, tools(worker.payments), model_replay=Replay.ALLOWED),
        )
    if worker.durable:
        await store.aclose()  # type: ignore[attr-defined]
    else:
        await store.release_run(run_id)


async def test_recover_goes_on_past_a_probe_that_never_answers(
    worker: Worker, store_argument: list[str] | None, capsys: pytest.CaptureFixture[str]
) -> None:
    for run_id in ("a", "hung", "z"):
        await _paid_then_crashed(worker, run_id)
    worker.payments.hangs_on = {HUNG}

    async def recovered(store: Store) -> Any:
        def request_for(run_id: str) -> Any:
            registry = tools(worker.payments, probe_timeout_s=0.05)
            return request(run_id, registry, model_replay=Replay.ALLOWED)

        definition_ = definition(store, model=ScriptedModelClient(customer))
        with anyio.fail_after(30):  # a guard against a hang, never reached when it works
            return await recover(definition_, store, request_for, max_concurrent=2)  # type: ignore[arg-type]

    report = await worker.read(recovered)
    results = {item.run_id: item.result for item in report}
    assert set(results) == {"a", "hung", "z"} and all(item.error is None for item in report)
    for run_id in ("a", "z"):
        done = results[run_id]
        assert done is not None and done.stop_reason is StopReason.FINAL_ANSWER
        assert done.steps[1].settled_by == "reconcile:pay"
    hung = results["hung"]
    assert hung is not None and hung.stop_reason is StopReason.IN_DOUBT
    assert hung.reconcile_failures == 1 and hung.detail is not None
    assert "TimeoutError: it did not answer within 0.05 s and was cancelled" in hung.detail
    assert worker.payments.cancelled == [HUNG]
    records = await worker.read(lambda store: store.read_log("hung"))
    assert not any(isinstance(record, Settlement) for record in records.records)

    # The person's answer, from the command line where there is one.
    if store_argument is not None:
        argv = ["settle", *store_argument, "hung", "--by", "carol"]
        argv += ["--ran", "--observation", "paid 5"]
        assert await anyio.to_thread.run_sync(main, argv) == 0
        assert f"settled {HUNG}: ran (by carol)" in capsys.readouterr().out
    else:
        await worker.read(
            lambda store: settle(store, "hung", by="carol", ran=True, observation="paid 5")
        )
    worker.payments.hangs_on = set()
    done = await worker.read(
        lambda store: start_or_resume(
            definition(store, model=ScriptedModelClient(customer)),
            request("hung", tools(worker.payments), model_replay=Replay.ALLOWED),
        )
    )
    assert done.stop_reason is StopReason.FINAL_ANSWER and done.steps[1].settled_by == "carol"
    assert sorted(worker.payments.paid()) == ["a:1:action", HUNG, "z:1:action"]


def _jsonl_bytes(tmp_path: Path) -> dict[str, bytes]:
    """The bytes of every JSONL log under the store's directory (none for other stores)."""
    return {str(p): p.read_bytes() for p in sorted((tmp_path / "runs").rglob("*.jsonl"))}


async def _settlements(worker: Worker) -> list[Settlement]:
    return [r for r in await worker.records() if isinstance(r, Settlement)]
