"""A run going on under a changed definition, as a person accepted it (issue 48): the
amendment record, what is refused, and a crash at every write of the amending resume;
the durable stories on every store."""

from __future__ import annotations

from typing import Any

import pytest

from kit.agent import Ledger, definition, request
from kit.amending import DEPLOY_FIX, DEPLOYED, FIXED_PROMPT, deployed_request
from kit.review import approval_script, payment_script, review_tools
from kit.store import STORE_KINDS, Stores, sampled, stores_fixture
from kit.sweep import every_point
from polyloop import (
    Agent,
    Amended,
    Amendment,
    AmendmentRefused,
    InvalidRequest,
    JSONValue,
    Message,
    Replay,
    Request,
    Role,
    RunIdentityMismatch,
    RunLog,
    RunState,
    StepRecord,
    StopReason,
    Store,
    ToolStyle,
    approve,
    fork,
    recover,
    resume,
    run,
    run_status,
    start_or_resume,
)
from polyloop._recovery import read_plan, snapshot_at
from polyloop.cli._view import review_facts
from polyloop.session._agents import resume_as
from polyloop.stores import MemoryStore
from polyloop.testing import (
    FaultyStore,
    RecordedExecutor,
    RecordedModelClient,
    SimulatedCrash,
)

pytestmark = pytest.mark.anyio

stores = stores_fixture(sampled(STORE_KINDS))


def _system(text: str) -> tuple[Message, ...]:
    return (Message.text(Role.SYSTEM, text),)


async def _paused(store: Store, ledger: Ledger) -> None:
    result = await run(
        definition(store, script=approval_script()), request("r", review_tools(ledger))
    )
    assert result.stop_reason is StopReason.AWAITING_APPROVAL


def _amendments(records: Any) -> list[Amended]:
    return [record for record in records if isinstance(record, Amended)]


async def test_a_run_awaiting_approval_goes_on_under_an_amended_definition(
    stores: Stores,
) -> None:
    store, ledger = stores.open(), Ledger()
    await _paused(store, ledger)
    before = (await store.read_log("r")).records
    deployed = definition(store, script=approval_script())

    # Without an amendment the new release is refused, as it always was, and writes nothing.
    with pytest.raises(RunIdentityMismatch) as refused:
        await resume(deployed, deployed_request(ledger))
    assert [key for key, _, _ in refused.value.differences] == ["run_context.sha256", "tools"]
    assert (await store.read_log("r")).records == before

    # With one, the amendment is the one record written, and the run still waits.
    waiting = await resume(deployed, deployed_request(ledger), amend=DEPLOY_FIX)
    assert waiting.stop_reason is StopReason.AWAITING_APPROVAL
    log = await store.read_log("r")
    assert log.records[: len(before)] == before and len(log.records) == len(before) + 1
    (amended,) = _amendments(log.records)
    assert (amended.step, amended.by, amended.reason) == (1, DEPLOY_FIX.by, DEPLOY_FIX.reason)
    assert sorted(amended.changes) == ["run_context.sha256", "tools"]
    _, recorded_tools, new_tools = amended.differences[1]
    assert "change ticket" in str(new_tools) and "change ticket" not in str(recorded_tools)
    assert amended.at is not None
    assert (await run_status(store, "r")).state is RunState.AWAITING_APPROVAL

    # The approval then runs the tool once, under the new release, with no amendment.
    await approve(store, "r", by="alice")
    store = await stores.reopen(store)
    done = await resume(definition(store, script=approval_script()), deployed_request(ledger))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    assert [name for name, _ in ledger.calls].count("deploy") == 1
    log = await store.read_log("r")
    assert len(_amendments(log.records)) == 1

    # What `show` prints of it: the author, the reason and the keys.
    assert review_facts([amended]) == [
        (
            "amended",
            f"by {DEPLOY_FIX.by} at {amended.at.isoformat()}: {DEPLOY_FIX.reason} "
            "(changed run_context.sha256, tools)",
        )
    ]

    # The release it left behind is now the one that differs.
    with pytest.raises(RunIdentityMismatch):
        await resume(
            definition(store, script=approval_script()), request("r", review_tools(ledger))
        )


async def _in_doubt_on_pay(stores: Stores, ledger: Ledger) -> Store:
    """A run whose payment ran and whose result was lost: it ends in doubt on ``pay``."""
    store = stores.open()
    tools = review_tools(ledger)
    with pytest.raises(SimulatedCrash):  # right after the pay intent
        await run(
            definition(FaultyStore(store, fail_after_writes=8), script=payment_script()),
            request("r", tools),
        )
    store = await stores.reopen(store)
    if stores.kind == "memory":
        await store.release_run("r")
    result = await resume(definition(store, script=payment_script()), request("r", tools))
    assert result.stop_reason is StopReason.IN_DOUBT
    return store


async def test_a_deploy_that_removes_a_tool_in_doubt_is_refused_naming_the_intent(
    stores: Stores,
) -> None:
    ledger = Ledger()
    store = await _in_doubt_on_pay(stores, ledger)
    before = (await store.read_log("r")).records
    removed = request("r", review_tools(ledger, without=("pay",)))
    amend = Amendment(by="ops", reason="pay moved to its own service", accept=("tools",))
    with pytest.raises(AmendmentRefused) as refused:
        await resume(definition(store, script=payment_script()), removed, amend=amend)
    assert refused.value.key == "tools" and refused.value.run_id == "r"
    assert refused.value.why == "it removes tool 'pay' while its intent 'r:1:action' is in doubt"
    assert "'r:1:action'" in str(refused.value)
    assert (await store.read_log("r")).records == before
    # Its description alone may change: the payment is still the one announced.
    described = request("r", review_tools(ledger, descriptions={"pay": "Pay, in cents."}))
    result = await resume(definition(store, script=payment_script()), described, amend=amend)
    assert result.stop_reason is StopReason.IN_DOUBT
    assert len(_amendments((await store.read_log("r")).records)) == 1
    assert [name for name, _ in ledger.calls].count("pay") == 1


async def test_changing_more_than_the_description_of_a_waiting_tool_is_refused() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    # The deploy no longer needs approval: the proposal waiting on it was asked under it.
    changed = request("r", review_tools(ledger, needs_approval=False))
    amend = Amendment(by="ops", reason="trust deploys", accept=("tools",))
    with pytest.raises(AmendmentRefused, match="proposal 'r:1:action' awaits approval"):
        await resume(definition(store, script=approval_script()), changed, amend=amend)
    assert _amendments((await store.read_log("r")).records) == []


@pytest.mark.parametrize(
    ("key", "overrides"),
    [
        ("model_replay", {"model_replay": Replay.ALLOWED}),
        ("observation_template", {"observation_template": "Seen: {observation}"}),
        ("tool_style", {"tool_style": ToolStyle.MARKDOWN}),
        ("run_id", {}),
        ("store.kind", {}),
    ],
)
async def test_what_may_never_change_is_refused_before_anything_is_read(
    key: str, overrides: dict[str, Any]
) -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    before = await store.read_log("r")
    amend = Amendment(by="ops", reason="why not", accept=(key,))
    with pytest.raises(AmendmentRefused) as refused:
        await resume(
            definition(store, script=approval_script()),
            request("r", review_tools(ledger), **overrides),
            amend=amend,
        )
    assert refused.value.key == key and refused.value.why
    assert isinstance(refused.value, RunIdentityMismatch)
    assert await store.read_log("r") == before


async def test_a_difference_the_amendment_does_not_accept_is_refused_as_without_one() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    before = await store.read_log("r")
    only_tools = Amendment(by="ops", reason="tools only", accept=frozenset({"tools"}))
    with pytest.raises(RunIdentityMismatch) as refused:
        await resume(
            definition(store, script=approval_script()),
            deployed_request(ledger),
            amend=only_tools,
        )
    assert type(refused.value) is RunIdentityMismatch
    assert [key for key, _, _ in refused.value.differences] == ["run_context.sha256"]
    assert await store.read_log("r") == before


async def test_an_amendment_with_nothing_to_amend_writes_nothing() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    before = await store.read_log("r")
    same = request("r", review_tools(ledger))
    result = await start_or_resume(
        definition(store, script=approval_script()), same, amend=DEPLOY_FIX
    )
    assert result.stop_reason is StopReason.AWAITING_APPROVAL
    assert await store.read_log("r") == before


async def test_a_finished_run_is_not_amended() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await approve(store, "r", by="alice")
    await resume(definition(store, script=approval_script()), request("r", review_tools(ledger)))
    before = await store.read_log("r")
    result = await resume(
        definition(store, script=approval_script()), deployed_request(ledger), amend=DEPLOY_FIX
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert await store.read_log("r") == before


@pytest.mark.parametrize(
    "amend",
    [
        Amendment(by="", reason="who?", accept=("tools",)),
        Amendment(by="ops", reason="a list", accept=["tools"]),  # type: ignore[arg-type]
    ],
)
async def test_a_malformed_amendment_is_an_invalid_request(amend: Amendment) -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    with pytest.raises(InvalidRequest):
        await resume(
            definition(store, script=approval_script()), deployed_request(ledger), amend=amend
        )


# The writes of the amending resume of an approved deploy: the amendment, the deploy's
# intent, its step (with its result), the model call's intent and result, the final step
# and the end. A crash after each of them, then the same resume again.
AMENDING_WRITES = 7


@pytest.mark.parametrize("writes", every_point(range(AMENDING_WRITES + 1)))
async def test_a_crash_at_every_write_of_the_amending_resume_amends_once(
    stores: Stores, writes: int
) -> None:
    store, ledger = stores.open(), Ledger()
    await _paused(store, ledger)
    await approve(store, "r", by="alice")
    faulty = FaultyStore(store, fail_after_writes=writes)
    try:
        result = await resume(
            definition(faulty, script=approval_script()),
            deployed_request(ledger),
            amend=DEPLOY_FIX,
        )
    except SimulatedCrash:
        assert writes < AMENDING_WRITES
        store = await stores.reopen(store)
        if stores.kind == "memory":
            await store.release_run("r")
        amended = _amendments((await store.read_log("r")).records)
        assert len(amended) == (1 if writes >= 1 else 0)
        # Resumed with the amendment again: written once, whether or not it landed.
        result = await resume(
            definition(store, script=approval_script()),
            deployed_request(ledger),
            amend=DEPLOY_FIX,
        )
    else:
        assert writes >= AMENDING_WRITES
    log = await store.read_log("r")
    assert len(_amendments(log.records)) == 1
    deploys = [name for name, _ in ledger.calls].count("deploy")
    if result.stop_reason is StopReason.FINAL_ANSWER:
        assert deploys == 1
    else:  # a crash right after the deploy's intent: it may or may not have run
        assert result.stop_reason is StopReason.IN_DOUBT and deploys <= 1


async def _amended_run(store: Store, ledger: Ledger) -> RunLog:
    """``r`` paused for approval, amended by :data:`DEPLOY_FIX`, approved and finished."""
    await _paused(store, ledger)
    await resume(
        definition(store, script=approval_script()), deployed_request(ledger), amend=DEPLOY_FIX
    )
    await approve(store, "r", by="alice")
    done = await resume(definition(store, script=approval_script()), deployed_request(ledger))
    assert done.stop_reason is StopReason.FINAL_ANSWER
    return await store.read_log("r")


async def test_offline_replay_crosses_the_amendment_under_the_snapshot_of_each_step() -> None:
    log = await _amended_run(MemoryStore(), Ledger())
    model, executor = RecordedModelClient.from_log(log), RecordedExecutor.from_log(log)
    store, tools = MemoryStore(), review_tools(Ledger())
    again = definition(store, model=model)
    # Step 0 is checked against the messages of the snapshot it ran under ...
    paused = await run(again, request("again", tools, executor=executor))
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    await approve(store, "again", by="alice")
    # ... and the steps after the amendment against those of the amended one.
    amended_tools = review_tools(Ledger(), descriptions=DEPLOYED)
    redriven = request("again", amended_tools, executor=executor, run_context=_system(FIXED_PROMPT))
    result = await resume(again, redriven, amend=DEPLOY_FIX)
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert model.divergences == [] and executor.divergences == []
    assert [s.action_text for s in result.steps] == [
        s.action_text for s in log.records if isinstance(s, StepRecord)
    ]
    # Re-driven under the amended snapshot from the start, step 0 is not what was sent.
    model = RecordedModelClient.from_log(log)
    other = MemoryStore()
    wrong = await run(
        definition(other, model=model),
        request("again", amended_tools, executor=executor, run_context=_system(FIXED_PROMPT)),
    )
    assert wrong.stop_reason is StopReason.MODEL_FAILURE
    assert [d.step for d in model.divergences] == [0]


@pytest.mark.parametrize("at_step", [1, 2])
async def test_forks_before_and_after_the_amendment_take_the_steps_as_they_ran(
    at_step: int,
) -> None:
    store, ledger = MemoryStore(), Ledger()
    log = await _amended_run(store, ledger)
    # The snapshot each step ran under: step 0 the recorded one, step 1 on the amended one.
    plan = read_plan(log)
    assert plan.started is not None
    assert snapshot_at(plan, 0) == plan.started.snapshot
    assert snapshot_at(plan, 1) == plan.snapshot != plan.started.snapshot
    forked = await fork(
        definition(store, script=approval_script()[at_step:]),
        deployed_request(ledger, run_id="f"),
        source_run_id="r",
        at_step=at_step,
    )
    source_steps = [s for s in log.records if isinstance(s, StepRecord)]
    assert [s.action_text for s in forked.steps[:at_step]] == [
        s.action_text for s in source_steps[:at_step]
    ]
    # The fork is a run of its own, started under its own request's snapshot: nothing
    # to amend, and a later resume compares with that.
    fork_log = await store.read_log("f")
    assert _amendments(fork_log.records) == []
    fork_snapshot, amended = read_plan(fork_log).snapshot, snapshot_at(plan, 1)
    for key in DEPLOY_FIX.accept:
        assert fork_snapshot[key] == amended[key]


# -- policy in one place: an agent's amendment, for every host (issue 48, item 4) ---------


def _agent(store: Store, ledger: Ledger, *, deployed: bool, amend: Amendment | None) -> Agent:
    """The approval agent as first released, or as deployed with a fixed prompt and deploy
    description, resuming its runs under ``amend``."""

    def request_for(run_id: str, input: JSONValue) -> Request:
        if not deployed:
            return request(run_id, review_tools(ledger))
        tools = review_tools(ledger, descriptions=DEPLOYED)
        return request(run_id, tools, run_context=_system(FIXED_PROMPT))

    return Agent(
        name="deployer",
        definition=definition(store, script=approval_script()),
        request_for=request_for,
        amend=amend,
    )


async def test_an_agents_amendment_moves_its_waiting_run_on_and_the_log_says_so() -> None:
    store, ledger = MemoryStore(), Ledger()
    paused = await _agent(store, ledger, deployed=False, amend=None).run("r", {})
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    await approve(store, "r", by="alice")
    # The release without a policy is refused as before; with one, the run goes on.
    with pytest.raises(RunIdentityMismatch):
        await _agent(store, ledger, deployed=True, amend=None).run("r", {})
    deployed = _agent(store, ledger, deployed=True, amend=DEPLOY_FIX)
    request_now = await deployed.request("r", {})
    done = await resume_as(deployed, request_now, {})
    assert done.stop_reason is StopReason.FINAL_ANSWER
    (amended,) = _amendments((await store.read_log("r")).records)
    assert (amended.by, amended.step) == (DEPLOY_FIX.by, 1)
    assert [name for name, _ in ledger.calls].count("deploy") == 1


async def test_an_agent_may_not_accept_what_may_never_change() -> None:
    amend = Amendment(by="ops", reason="faster", accept=("tools", "model_replay"))
    with pytest.raises(AmendmentRefused) as refused:
        _agent(MemoryStore(), Ledger(), deployed=True, amend=amend)
    assert refused.value.key == "model_replay" and refused.value.run_id is None


async def test_recover_resumes_every_waiting_run_under_the_amendment() -> None:
    store, ledger = MemoryStore(), Ledger()
    for run_id in ("a", "b"):
        await run(
            definition(store, script=approval_script()), request(run_id, review_tools(ledger))
        )
    recovered = await recover(
        definition(store, script=approval_script()),
        store,
        lambda run_id: deployed_request(ledger, run_id=run_id),
        max_concurrent=2,
        amend=DEPLOY_FIX,
    )
    assert [(r.run_id, r.error) for r in recovered] == [("a", None), ("b", None)]
    for run_id in ("a", "b"):
        assert len(_amendments((await store.read_log(run_id)).records)) == 1
        assert (await run_status(store, run_id)).state is RunState.AWAITING_APPROVAL
