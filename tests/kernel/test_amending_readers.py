"""What sees an amendment besides the resume that writes it (issue 48): forks made before
and after it, the event sink, and an agent's retried start after a deploy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kit.agent import Ledger, definition, request
from kit.amending import DEPLOY_FIX, deployed_request
from kit.review import approval_script, deploy_twice_script, review_tools
from kit.store import STORE_KINDS, Stores, sampled, stores_fixture
from polyloop import (
    Agent,
    Amended,
    Amendment,
    AmendmentRefused,
    Event,
    EventKind,
    JSONValue,
    Request,
    RunIdentityMismatch,
    RunResult,
    RunStarted,
    StopReason,
    Store,
    ToolStyle,
    approve,
    fork,
    resume,
    run,
)
from polyloop._recovery import identity_differences, read_plan, snapshot_at
from polyloop.session._agents import resume_as
from polyloop.stores import MemoryStore
from polyloop.testing import RecordingSink, ScriptedModelClient

pytestmark = pytest.mark.anyio

stores = stores_fixture(sampled(STORE_KINDS))


def _first(ledger: Ledger, run_id: str = "r") -> Request:
    """The request as first released."""
    return request(run_id, review_tools(ledger))


def _started(records: Any) -> RunStarted:
    started = records[0]
    assert isinstance(started, RunStarted)
    return started


# -- forks before and after an amendment --------------------------------------------------


async def _amended_at_step_2(store: Store, ledger: Ledger) -> ScriptedModelClient:
    """``r`` deploys twice: its steps 0 and 1 run under the first release, the second
    deploy waits, the new release is accepted then (an amendment at step 2), and steps 2
    and 3 run under it. Returns the model that answered every call of ``r``."""
    model = ScriptedModelClient(deploy_twice_script())
    defined = definition(store, model=model)
    assert (await run(defined, _first(ledger))).stop_reason is StopReason.AWAITING_APPROVAL
    await approve(store, "r", by="alice")
    waiting = await resume(defined, _first(ledger))
    assert waiting.stop_reason is StopReason.AWAITING_APPROVAL
    await resume(defined, deployed_request(ledger), amend=DEPLOY_FIX)
    await approve(store, "r", by="alice")
    done = await resume(defined, deployed_request(ledger))
    assert done.stop_reason is StopReason.FINAL_ANSWER and done.step_count == 4
    return model


async def _fork(
    store: Store, forked: Request, at_step: int
) -> tuple[RunResult, ScriptedModelClient, Mapping[str, JSONValue]]:
    """``forked`` forked from ``r`` at ``at_step``: its result, the model that answered
    it and the snapshot its start record says it inherited."""
    model = ScriptedModelClient(deploy_twice_script())
    result = await fork(definition(store, model=model), forked, source_run_id="r", at_step=at_step)
    held = _started((await store.read_log(forked.run_id)).records).inherited_snapshot
    assert held is not None
    return result, model, held


async def test_forks_before_and_after_the_amendment_go_on_under_the_snapshot_at_their_step(
    stores: Stores,
) -> None:
    store, ledger = stores.open(), Ledger()
    source_model = await _amended_at_step_2(store, ledger)
    sent = {call.call_index: call.messages for call in source_model.calls}
    plan = read_plan(await store.read_log("r"))
    first_release, amended = _started((await store.read_log("r")).records).snapshot, plan.snapshot
    assert [a.step for a in plan.amendments] == [2]
    assert snapshot_at(plan, 1) == first_release and snapshot_at(plan, 3) == amended

    # Before the amendment: the first release is what held at step 1. A fork under it
    # sends the source's call of step 1 and goes on as the source did.
    before, model, held = await _fork(store, _first(ledger, "f1"), 1)
    assert before.stop_reason is StopReason.AWAITING_APPROVAL
    assert model.calls[0].call_index == 1 and model.calls[0].messages == sent[1]
    assert identity_differences(held, first_release) == ()
    assert identity_differences(held, _started((await store.read_log("f1")).records).snapshot) == ()
    await approve(store, "f1", by="alice")
    again = await resume(definition(store, model=model), _first(ledger, "f1"))
    assert again.stop_reason is StopReason.AWAITING_APPROVAL and again.step_count == 2
    assert ("deploy", "f1:1:action") in ledger.calls

    # After it: the amended snapshot held at step 3, and a fork under it sends the
    # source's call of step 3, which ran under the amendment, and finishes as it did.
    after, model, held = await _fork(store, deployed_request(ledger, "f3"), 3)
    assert after.stop_reason is StopReason.FINAL_ANSWER
    assert model.calls[0].call_index == 3 and model.calls[0].messages == sent[3]
    assert identity_differences(held, amended) == ()
    assert [(name, rid) for name, rid in ledger.calls if rid.startswith("f3")] == []

    # A fork at step 1 onto the new release is a fork onto another definition: allowed,
    # and its start record keeps what it differs from.
    onto, model, held = await _fork(store, deployed_request(ledger, "g1"), 1)
    assert onto.stop_reason is StopReason.AWAITING_APPROVAL
    assert model.calls[0].messages != sent[1]
    own = _started((await store.read_log("g1")).records).snapshot
    assert [key for key, _, _ in identity_differences(held, own)] == [
        "run_context.sha256",
        "tools",
    ]


async def test_a_fork_that_would_read_its_inherited_steps_otherwise_is_refused(
    stores: Stores,
) -> None:
    store, ledger = stores.open(), Ledger()
    await _amended_at_step_2(store, ledger)
    for overrides in (
        {"tool_style": ToolStyle.MARKDOWN},
        {"observation_template": "Seen: {observation}"},
    ):
        with pytest.raises(RunIdentityMismatch) as refused:
            await fork(
                definition(store, script=deploy_twice_script()),
                deployed_request(ledger, "bad", **overrides),
                source_run_id="r",
                at_step=3,
            )
        assert [key for key, _, _ in refused.value.differences] == list(overrides)
        assert refused.value.run_id == "bad" and "cannot fork run 'r' at step 3" in str(
            refused.value
        )
        assert (await store.read_log("bad")).records == ()
    # Nothing inherited, nothing to read back: a fork at step 0 is a new run.
    zero = await fork(
        definition(store, script=deploy_twice_script()),
        deployed_request(ledger, "zero", tool_style=ToolStyle.MARKDOWN),
        source_run_id="r",
        at_step=0,
    )
    assert zero.step_count >= 1
    assert _started((await store.read_log("zero")).records).inherited_snapshot is None


# -- the event sink hears of it -----------------------------------------------------------


async def _paused(store: Store, ledger: Ledger) -> None:
    result = await run(definition(store, script=approval_script()), _first(ledger))
    assert result.stop_reason is StopReason.AWAITING_APPROVAL


def _amended_in(records: Any) -> Amended:
    (amended,) = [record for record in records if isinstance(record, Amended)]
    return amended


async def test_the_sink_hears_the_amendment_of_a_waiting_run_once_it_is_written() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    sink = RecordingSink()
    defined = definition(store, script=approval_script(), events=sink)
    waiting = await resume(defined, deployed_request(ledger), amend=DEPLOY_FIX)
    assert waiting.stop_reason is StopReason.AWAITING_APPROVAL
    # Nothing else happens: the run still waits, and the amendment is the one event.
    (event,) = sink.events
    assert event.kind is EventKind.RUN_AMENDED and event.kind.value == "run_amended"
    assert event.record == _amended_in((await store.read_log("r")).records)
    assert (event.run_id, event.step) == ("r", 1)
    # Resumed again under the same release: nothing to amend, nothing heard.
    await resume(defined, deployed_request(ledger), amend=DEPLOY_FIX)
    assert len(sink.events) == 1


async def test_the_amendment_event_comes_before_the_resume_it_lets_go_on() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await approve(store, "r", by="alice")
    sink = RecordingSink()
    done = await resume(
        definition(store, script=approval_script(), events=sink),
        deployed_request(ledger),
        amend=DEPLOY_FIX,
    )
    assert done.stop_reason is StopReason.FINAL_ANSWER and done.event_failures == 0
    assert [event.kind for event in sink.events] == [
        EventKind.RUN_AMENDED,
        EventKind.RUN_RESUMED,
        EventKind.STEP_FINISHED,
        EventKind.STEP_FINISHED,
        EventKind.RUN_ENDED,
    ]
    # The resume's log, handed to the sink, already holds the amendment.
    amended = sink.events[0].record
    assert isinstance(amended, Amended) and amended in sink.events[1].logged


class _FailsOnAmendments(RecordingSink):
    async def emit(self, event: Event) -> None:
        if event.kind is EventKind.RUN_AMENDED:
            raise RuntimeError("this sink cannot take amendments")
        await super().emit(event)


async def test_a_sink_failing_on_the_amendment_is_counted_and_the_run_goes_on() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    sink = _FailsOnAmendments()
    defined = definition(store, script=approval_script(), events=sink)
    waiting = await resume(defined, deployed_request(ledger), amend=DEPLOY_FIX)
    assert waiting.stop_reason is StopReason.AWAITING_APPROVAL and waiting.event_failures == 1
    assert sink.events == []
    _amended_in((await store.read_log("r")).records)  # written, whatever the sink did


# -- an agent's retried start after a deploy ----------------------------------------------


def _agent(store: Store, ledger: Ledger, *, deployed: bool, amend: Amendment | None) -> Agent:
    def request_for(run_id: str, input: JSONValue) -> Request:
        return deployed_request(ledger, run_id) if deployed else _first(ledger, run_id)

    return Agent(
        name="deployer",
        definition=definition(store, script=approval_script()),
        request_for=request_for,
        amend=amend,
    )


async def test_a_start_retried_after_a_deploy_goes_through_under_the_agents_amendment(
    stores: Stores,
) -> None:
    store, ledger = stores.open(), Ledger()
    await _agent(store, ledger, deployed=False, amend=None).start("r", {"ticket": 7})
    paused = await _agent(store, ledger, deployed=False, amend=None).run("r", {"ticket": 7})
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    before = (await store.read_log("r")).records

    # The new release without a policy is refused, as before.
    with pytest.raises(RunIdentityMismatch) as refused:
        await _agent(store, ledger, deployed=True, amend=None).start("r", {"ticket": 7})
    assert [key for key, _, _ in refused.value.differences] == ["run_context.sha256", "tools"]
    # A policy that accepts less is refused for the rest.
    tools_only = Amendment(by="ops", reason="tools only", accept=("tools",))
    with pytest.raises(RunIdentityMismatch) as refused:
        await _agent(store, ledger, deployed=True, amend=tools_only).start("r", {"ticket": 7})
    assert [key for key, _, _ in refused.value.differences] == ["run_context.sha256"]
    # Another input is another run, whatever the policy.
    with pytest.raises(RunIdentityMismatch):
        await _agent(store, ledger, deployed=True, amend=DEPLOY_FIX).start("r", {"ticket": 8})

    # With the agent's amendment the retried start is safe, and writes nothing ...
    deployed = _agent(store, ledger, deployed=True, amend=DEPLOY_FIX)
    await deployed.start("r", {"ticket": 7})
    assert (await store.read_log("r")).records == before
    # ... the host that drives the run on records the amendment, once.
    await approve(store, "r", by="alice")
    done = await resume_as(deployed, await deployed.request("r", {"ticket": 7}), {"ticket": 7})
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert _amended_in((await store.read_log("r")).records).by == DEPLOY_FIX.by
    await deployed.start("r", {"ticket": 7})  # and a start retried after that, too


async def test_a_retried_start_refuses_what_the_waiting_proposal_forbids() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _agent(store, ledger, deployed=False, amend=None).run("r", {})
    changed = Amendment(by="ops", reason="trust deploys", accept=("tools",))

    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, review_tools(ledger, needs_approval=False))

    agent = Agent(
        name="deployer",
        definition=definition(store, script=approval_script()),
        request_for=request_for,
        amend=changed,
    )
    with pytest.raises(AmendmentRefused, match="proposal 'r:1:action' awaits approval"):
        await agent.start("r", {})
