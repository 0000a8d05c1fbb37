"""Runs recorded on every store re-driven offline (issue 32, item 3): whatever store a run
was recorded on, its log read back from it re-drives on a memory store to the same
trajectory, and a changed template or interpreter is caught at the step it changes."""

from __future__ import annotations

import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.replay import ThreeIsFour, copied, offline, plain_steps, record, without_run
from kit.store import STORE_KINDS, Stores, sampled, stores_fixture
from polyloop import ActionStatus, RunLog, StepRecord, StopReason, fork, run
from polyloop.testing import RecordedExecutor, RecordedModelClient

pytestmark = pytest.mark.anyio


stores = stores_fixture(sampled(STORE_KINDS))


async def recorded_log(stores: Stores) -> RunLog:
    """A run recorded on the store, read back through a store object opened anew."""
    store = stores.open()
    result = await record(store)
    assert result.stop_reason is StopReason.SUBMITTED
    return await (await stores.reopen(store)).read_log("src")


def steps_of(log: RunLog) -> list[StepRecord]:
    return [record for record in log.records if isinstance(record, StepRecord)]


async def test_a_run_recorded_on_any_store_re_drives_to_the_same_trajectory(
    stores: Stores,
) -> None:
    log = await recorded_log(stores)
    (defined, redriven), model, executor = offline(log)
    result = await run(defined, redriven)
    assert result.stop_reason is StopReason.SUBMITTED and result.run_id == "again"
    again = await defined.store.read_log("again")
    assert without_run(again.records, "again") == without_run(log.records, "src")
    assert plain_steps(result.steps) == plain_steps(steps_of(log))
    assert model.divergences == [] and executor.divergences == []


async def test_a_changed_template_or_interpreter_is_caught_on_a_log_from_any_store(
    stores: Stores,
) -> None:
    log = await recorded_log(stores)
    (defined, redriven), model, _ = offline(log, observation_template="Seen: {observation}")
    templated = await run(defined, redriven)
    assert templated.stop_reason is StopReason.MODEL_FAILURE
    assert templated.detail is not None and "run 'again', step 1 " in templated.detail
    assert [d.step for d in model.divergences] == [1]
    (defined, redriven), _, executor = offline(log, interpreter=ThreeIsFour())
    interpreted = await run(defined, redriven)
    assert interpreted.steps[4].action_status is ActionStatus.NOT_EXECUTED
    assert "run 'again', step 4 " in (interpreted.steps[4].observation or "")
    assert [d.step for d in executor.divergences] == [4]


async def test_a_fork_recorded_on_any_store_re_drives_offline(stores: Stores) -> None:
    store = stores.open()
    await record(store, script=[tool_call("double", n=1), tool_call("double", n=2), answer("4")])
    forked = await fork(
        definition(
            store, script=["inherited", "inherited", tool_call("double", n=5), answer("10")]
        ),
        request("f", make_tools(Ledger())),
        source_run_id="src",
        at_step=2,
    )
    log = await (await stores.reopen(store)).read_log("f")
    model, executor = RecordedModelClient.from_log(log), RecordedExecutor.from_log(log)
    offline_store = await copied(log)
    result = await fork(
        definition(offline_store, model=model),
        request("again", make_tools(Ledger()), executor=executor),
        source_run_id="f",
        at_step=2,
    )
    assert result.final_answer == "10"
    assert plain_steps(result.steps) == plain_steps(forked.steps)
    again = await offline_store.read_log("again")
    assert without_run(again.records, "again") == without_run(log.records, "f")
    assert model.divergences == [] and executor.divergences == []
