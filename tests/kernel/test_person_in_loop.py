"""Approval before a risky tool runs, and settling a run that ended in doubt (issue 19),
on the memory store: the records, the pauses, the refusals and what resume makes of
each answer."""

from __future__ import annotations

import pytest

from kit.agent import Ledger, definition, kinds, request
from kit.review import (
    approval_script,
    approval_story,
    payment_script,
    plain_steps,
    review_tools,
    reviews,
    settlement_story,
)
from polyloop import (
    ActionStatus,
    Intent,
    InvalidRequest,
    NotAwaitingApproval,
    NotInDoubt,
    Proposal,
    RunLocked,
    RunNotFound,
    RunState,
    Settlement,
    StopReason,
    ToolRegistry,
    Verdict,
    approve,
    reject,
    resume,
    run,
    run_status,
    settle,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

pytestmark = pytest.mark.anyio


async def _paused(store: MemoryStore, ledger: Ledger) -> None:
    result = await run(
        definition(store, script=approval_script()), request("r", review_tools(ledger))
    )
    assert result.stop_reason is StopReason.AWAITING_APPROVAL
    assert result.step_count == 1


async def _resume(store: MemoryStore, ledger: Ledger, *, needs_approval: bool = True) -> object:
    return await resume(
        definition(store, script=approval_script()),
        request("r", review_tools(ledger, needs_approval=needs_approval)),
    )


async def test_a_tool_that_needs_approval_pauses_the_run_before_anything_runs() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    assert [name for name, _ in ledger.calls] == ["double"]
    log = await store.read_log("r")
    assert kinds(log.records)[-4:] == [
        "Intent:model_call",
        "Result:model_call",
        "Proposal",
        "RunEnded",
    ]
    status = await run_status(store, "r")
    assert status.state is RunState.AWAITING_APPROVAL
    assert status.proposal is not None
    assert status.proposal.payload == {"name": "deploy", "arguments": {"env": "prod"}}
    assert status.proposal.description == "Deploy the build to an environment."
    assert status.proposal.at is not None
    assert status.stop_reason is StopReason.AWAITING_APPROVAL


async def test_resuming_a_run_that_still_waits_writes_nothing() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    before = await store.read_log("r")
    result = await _resume(store, ledger)
    assert result.stop_reason is StopReason.AWAITING_APPROVAL  # type: ignore[attr-defined]
    assert await store.read_log("r") == before


async def test_approved_runs_once_and_the_trajectory_equals_an_auto_approved_run() -> None:
    reference_ledger = Ledger()
    reference = await run(
        definition(MemoryStore(), script=approval_script()),
        request("r", review_tools(reference_ledger, needs_approval=False)),
    )
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    verdict = await approve(store, "r", by="alice")
    assert verdict.approved and verdict.by == "alice" and verdict.at is not None
    assert (await run_status(store, "r")).state is RunState.RESUMABLE
    with pytest.raises(NotAwaitingApproval, match="already approved by 'alice'"):
        await approve(store, "r", by="bob")
    result = await _resume(store, ledger)
    assert result.stop_reason is StopReason.FINAL_ANSWER  # type: ignore[attr-defined]
    assert plain_steps(result.steps) == plain_steps(reference.steps)  # type: ignore[attr-defined]
    assert ledger.calls == reference_ledger.calls
    with pytest.raises(NotAwaitingApproval, match="finished: final_answer"):
        await approve(store, "r", by="bob")


async def test_approved_with_edited_arguments_runs_those_arguments() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    before = await store.read_log("r")
    with pytest.raises(InvalidRequest, match="do not match its schema"):
        await approve(store, "r", by="alice", arguments={"env": "moon"})
    assert await store.read_log("r") == before  # refused: nothing written
    await approve(store, "r", by="alice", arguments={"env": "staging"})
    result = await _resume(store, ledger)
    assert result.steps[1].observation == "deployed to staging"  # type: ignore[attr-defined]
    assert [name for name, _ in ledger.calls] == ["double", "deploy"]


async def test_rejected_never_runs_and_the_reason_is_the_observation() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await reject(store, "r", by="bob", reason="not on a Friday")
    with pytest.raises(NotAwaitingApproval, match="already rejected by 'bob'"):
        await reject(store, "r", by="bob", reason="again")
    result = await _resume(store, ledger)
    step = result.steps[1]  # type: ignore[attr-defined]
    assert step.action_status is ActionStatus.NOT_EXECUTED
    assert step.observation == "Refused: not on a Friday"
    assert result.valid_step_count == 1  # type: ignore[attr-defined]
    assert [name for name, _ in ledger.calls] == ["double"]


async def test_a_verdict_is_refused_for_a_run_that_waits_for_none() -> None:
    store, ledger = MemoryStore(), Ledger()
    with pytest.raises(RunNotFound):
        await approve(store, "nope", by="alice")
    await run(definition(store, script=payment_script()), request("r", review_tools(ledger)))
    before = await store.read_log("r")
    with pytest.raises(NotAwaitingApproval, match="waits for no approval"):
        await approve(store, "r", by="alice")
    with pytest.raises(InvalidRequest, match="by must be a non-empty string"):
        await approve(store, "r", by=" ")
    with pytest.raises(InvalidRequest, match="reason must be"):
        await reject(store, "r", by="bob", reason="")
    assert await store.read_log("r") == before


async def test_a_verdict_is_refused_while_a_worker_holds_the_run() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await store.claim_run("r")
    with pytest.raises(RunLocked):
        await approve(store, "r", by="alice")
    await store.release_run("r")
    assert len(reviews(await store.read_log("r"))) == 1


async def _crash_paying(store: MemoryStore, tools: ToolRegistry, writes: int) -> None:
    """Run the payment script to a simulated crash after ``writes`` writes.

    The crashed worker's claim on the run is released, as the end of its process would.
    """
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=writes), script=payment_script()),
            request("r", tools),
        )
    await store.release_run("r")


async def _in_doubt(store: MemoryStore, ledger: Ledger) -> None:
    tools = review_tools(ledger)
    # Crash right after the pay intent: the payment ran, its result is lost.
    await _crash_paying(store, tools, 8)
    result = await resume(definition(store, script=payment_script()), request("r", tools))
    assert result.stop_reason is StopReason.IN_DOUBT
    assert [name for name, _ in ledger.calls] == ["double", "pay"]


async def test_a_settled_run_goes_on_as_if_the_action_had_ended_that_way() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _in_doubt(store, ledger)
    status = await run_status(store, "r")
    assert status.state is RunState.IN_DOUBT and status.open_intent is not None
    with pytest.raises(NotInDoubt, match="not 'r:0:action'"):
        await settle(store, "r", by="carol", ran=True, observation="x", result_id="r:0:action")
    settlement = await settle(store, "r", by="carol", ran=True, observation="paid 5")
    assert settlement.result_id == "r:1:action" and settlement.at is not None
    assert (await run_status(store, "r")).state is RunState.RESUMABLE
    with pytest.raises(NotInDoubt, match="already settled by 'carol'"):
        await settle(store, "r", by="dave", ran=False, observation="no")
    result = await resume(
        definition(store, script=payment_script()), request("r", review_tools(ledger))
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    step = result.steps[1]
    assert step.settled_by == "carol"
    assert step.observation == "paid 5" and step.action_status is ActionStatus.EXECUTED
    assert result.valid_step_count == 2
    assert [name for name, _ in ledger.calls] == ["double", "pay"]
    log = await store.read_log("r")
    assert [type(r).__name__ for r in reviews(log)] == ["Settlement"]


async def test_settled_as_not_run_tells_the_model_and_does_not_count() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _in_doubt(store, ledger)
    await settle(store, "r", by="carol", ran=False, observation="the bank refused it")
    result = await resume(
        definition(store, script=payment_script()), request("r", review_tools(ledger))
    )
    step = result.steps[1]
    assert step.action_status is ActionStatus.NOT_EXECUTED
    assert step.observation == "Refused: the bank refused it"
    assert step.observation_synthesized
    assert result.valid_step_count == 1


async def test_settling_a_run_not_in_doubt_is_refused_and_writes_nothing() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    before = await store.read_log("r")
    with pytest.raises(NotInDoubt, match="no effect in doubt"):
        await settle(store, "r", by="carol", ran=True, observation="x")
    with pytest.raises(InvalidRequest, match="ran must be"):
        await settle(store, "r", by="carol", ran=1, observation="x")  # type: ignore[arg-type]
    assert await store.read_log("r") == before


async def _model_call_in_doubt(store: MemoryStore, ledger: Ledger) -> ToolRegistry:
    """A run whose model call of step 1 (replay never) was interrupted, then resumed to
    its in-doubt end: the call may have been made, and charged, or not."""
    tools = review_tools(ledger)
    # Start, step 0 (double: four writes) and step 1's model intent land; then a crash.
    await _crash_paying(store, tools, 6)
    result = await resume(definition(store, script=payment_script()), request("r", tools))
    assert result.stop_reason is StopReason.IN_DOUBT
    assert result.detail is not None and "model_call intent 'r:1:model'" in result.detail
    status = await run_status(store, "r")
    assert status.state is RunState.IN_DOUBT
    assert status.open_intent is not None and status.open_intent.result_id == "r:1:model"
    return tools


async def test_a_model_call_settled_as_not_run_is_made_again_as_a_new_call() -> None:
    store, ledger = MemoryStore(), Ledger()
    tools = await _model_call_in_doubt(store, ledger)
    settlement = await settle(
        store, "r", by="carol", ran=False, observation="never reached", result_id="r:1:model"
    )
    assert (settlement.result_id, settlement.ran) == ("r:1:model", False)
    model = ScriptedModelClient(payment_script())
    result = await resume(definition(store, model=model), request("r", tools))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [call.result_id for call in model.calls] == ["r:1:model2", "r:2:model"]
    assert [name for name, _ in ledger.calls] == ["double", "pay"]
    records = (await store.read_log("r")).records
    intents = [r.result_id for r in records if isinstance(r, Intent)]
    assert intents == [
        "r:0:model",
        "r:0:action",
        "r:1:model",
        "r:1:model2",
        "r:1:action",
        "r:2:model",
    ]
    at = kinds(records).index("Settlement")
    assert kinds(records)[at - 2 : at + 3] == [
        "Intent:model_call",
        "RunEnded",
        "Settlement",
        "Intent:model_call",
        "Result:model_call",
    ]
    assert result.step_count == 3 and result.valid_step_count == 2


async def test_a_model_call_made_again_can_be_in_doubt_again_and_answered_by_its_own_id() -> None:
    store, ledger = MemoryStore(), Ledger()
    tools = await _model_call_in_doubt(store, ledger)
    await settle(store, "r", by="carol", ran=False, observation="x", result_id="r:1:model")
    with pytest.raises(SimulatedCrash):  # the new intent lands, then the worker dies
        await resume(
            definition(FaultyStore(store, fail_after_writes=1), script=payment_script()),
            request("r", tools),
        )
    await store.release_run("r")
    result = await resume(definition(store, script=payment_script()), request("r", tools))
    assert result.detail is not None and "'r:1:model2'" in result.detail
    before = await store.read_log("r")
    with pytest.raises(NotInDoubt, match=r"'r:1:model2', not 'r:1:model'.*no longer open"):
        await settle(store, "r", by="dave", ran=False, observation="x", result_id="r:1:model")
    assert await store.read_log("r") == before
    await settle(store, "r", by="dave", ran=False, observation="x", result_id="r:1:model2")
    model = ScriptedModelClient(payment_script())
    result = await resume(definition(store, model=model), request("r", tools))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert model.calls[0].result_id == "r:1:model3"


async def test_a_model_call_settled_as_run_ends_the_run_without_calling_again() -> None:
    store, ledger = MemoryStore(), Ledger()
    tools = await _model_call_in_doubt(store, ledger)
    await settle(store, "r", by="carol", ran=True, observation="billed, reply lost")
    model = ScriptedModelClient(payment_script())
    result = await resume(definition(store, model=model), request("r", tools))
    assert model.calls == []
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail == (
        "model call 'r:1:model' ran but its reply is not on record; settled by 'carol': "
        "billed, reply lost"
    )
    assert result.steps[-1].error == result.detail and result.step_count == 2
    assert [name for name, _ in ledger.calls] == ["double"]
    status = await run_status(store, "r")
    assert (status.state, status.stop_reason) == (RunState.FINISHED, StopReason.MODEL_FAILURE)
    before = await store.read_log("r")
    again = await resume(definition(store, model=model), request("r", tools))
    assert (again.stop_reason, again.detail) == (StopReason.MODEL_FAILURE, result.detail)
    assert await store.read_log("r") == before and model.calls == []


async def test_a_model_call_in_doubt_is_settled_once_and_only_by_its_own_id() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _model_call_in_doubt(store, ledger)
    before = await store.read_log("r")
    with pytest.raises(NotInDoubt, match=r"'r:1:model', not 'r:0:action'.*no longer open"):
        await settle(store, "r", by="carol", ran=False, observation="x", result_id="r:0:action")
    assert await store.read_log("r") == before
    await settle(store, "r", by="carol", ran=False, observation="x", result_id="r:1:model")
    settled = await store.read_log("r")
    with pytest.raises(NotInDoubt, match="model call 'r:1:model' was already settled by 'carol'"):
        await settle(store, "r", by="dave", ran=True, observation="x", result_id="r:1:model")
    assert await store.read_log("r") == settled
    assert (await run_status(store, "r")).state is RunState.RESUMABLE


async def test_two_people_answering_at_once_exactly_one_wins() -> None:
    import anyio

    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    outcomes: list[object] = []

    async def answer(by: str) -> None:
        try:
            outcomes.append(await approve(store, "r", by=by))
        except (RunLocked, NotAwaitingApproval) as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as group:
        group.start_soon(answer, "alice")
        group.start_soon(answer, "bob")
    assert sum(isinstance(o, Verdict) for o in outcomes) == 1
    assert [type(r).__name__ for r in reviews(await store.read_log("r"))] == [
        "Proposal",
        "Verdict",
    ]


async def test_records_of_a_person_are_kept_in_the_log() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await approve(store, "r", by="alice")
    await _resume(store, ledger)
    kinds_ = [type(r).__name__ for r in reviews(await store.read_log("r"))]
    assert kinds_ == ["Proposal", "Verdict"]
    assert isinstance(reviews(await store.read_log("r"))[0], Proposal)
    assert Settlement.__name__ == "Settlement"


async def test_cancelled_while_recording_a_proposal_the_run_still_waits_after() -> None:
    import anyio

    from kit.agent import SlowStore

    store, ledger = SlowStore("write_review", after=True), Ledger()
    tools = review_tools(ledger)
    with anyio.move_on_after(5) as scope:
        async with anyio.create_task_group() as group:

            async def drive() -> None:
                await run(definition(store, script=approval_script()), request("r", tools))  # type: ignore[arg-type]

            group.start_soon(drive)
            await store.entered.wait()
            group.cancel_scope.cancel()
    assert not scope.cancelled_caught
    log = await store.inner.read_log("r")
    assert kinds(log.records)[-2:] == ["Proposal", "RunEnded"]
    assert log.records[-1].stop_reason is StopReason.CANCELLED  # type: ignore[union-attr]
    result = await resume(definition(store.inner, script=approval_script()), request("r", tools))
    assert result.stop_reason is StopReason.AWAITING_APPROVAL
    assert ledger.calls == [("double", "r:0:action")]


async def test_a_native_tool_call_waits_for_approval_and_resumes_with_the_same_messages() -> None:
    from kit.native import INTERPRETER, NATIVE, HashingModel, call
    from polyloop import ModelReply

    def script() -> list[ModelReply]:
        return [
            call("deploy", "c0", env="prod"),
            ModelReply(call_id=None, content="done", reasoning=None),
        ]

    whole = HashingModel(script())
    reference_tools = review_tools(Ledger(), needs_approval=False)
    reference = await run(
        definition(MemoryStore(), model=whole, interpreter=INTERPRETER),
        request("r", reference_tools, **NATIVE),
    )
    store, ledger = MemoryStore(), Ledger()
    tools = review_tools(ledger)
    first, second = HashingModel(script()), HashingModel(script())
    paused = await run(
        definition(store, model=first, interpreter=INTERPRETER), request("r", tools, **NATIVE)
    )
    assert paused.stop_reason is StopReason.AWAITING_APPROVAL
    status = await run_status(store, "r")
    assert status.proposal is not None and status.proposal.tool_call is not None
    await approve(store, "r", by="alice")
    result = await resume(
        definition(store, model=second, interpreter=INTERPRETER), request("r", tools, **NATIVE)
    )
    assert result.stop_reason is reference.stop_reason
    assert plain_steps(result.steps) == plain_steps(reference.steps)
    assert first.digests + second.digests == whole.digests  # the same messages, each once
    assert [name for name, _ in ledger.calls] == ["deploy"]


async def test_an_edited_approval_records_the_call_that_ran_and_who_edited_it() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await approve(store, "r", by="alice", arguments={"env": "staging"})
    result = await _resume(store, ledger)
    step = result.steps[1]  # type: ignore[attr-defined]
    assert f"{step.action_text} -> {step.observation}" == (
        'deploy({"env": "staging"}) -> deployed to staging'
    )
    assert step.edited_by == "alice"
    assert step.proposed_action_text == 'deploy({"env": "prod"})'
    intents = [r for r in (await store.read_log("r")).records if isinstance(r, Intent)]
    intent = intents[-2]  # the deploy's; the last is the answer's model call
    assert intent.payload == {"name": "deploy", "arguments": {"env": "staging"}}
    assert intent.action_text == 'deploy({"env": "staging"})'
    assert intent.edited_by == "alice"
    assert intent.proposed_action_text == 'deploy({"env": "prod"})'


async def test_an_approval_with_the_proposed_arguments_is_no_edit() -> None:
    store, ledger = MemoryStore(), Ledger()
    await _paused(store, ledger)
    await approve(store, "r", by="alice", arguments={"env": "prod"})
    result = await _resume(store, ledger)
    step = result.steps[1]  # type: ignore[attr-defined]
    assert step.action_text == 'deploy({"env": "prod"})'
    assert step.edited_by is None and step.proposed_action_text is None


async def test_an_edited_native_call_is_the_call_the_model_sees_answered() -> None:
    from kit.native import INTERPRETER, NATIVE, call
    from polyloop import ModelCall, ModelReply, ToolCallBlock, ToolResultBlock
    from polyloop.testing import ScriptedModelClient

    class Recording(ScriptedModelClient):
        def __init__(self, script: list[ModelReply]) -> None:
            super().__init__(script)
            self.calls: list[ModelCall] = []

        async def call(self, call: ModelCall) -> ModelReply:
            self.calls.append(call)
            return await super().call(call)

    def script() -> list[ModelReply]:
        return [
            call("deploy", "c0", env="prod"),
            ModelReply(call_id=None, content="done", reasoning=None),
        ]

    store, ledger = MemoryStore(), Ledger()
    tools = review_tools(ledger)
    first, second = Recording(script()), Recording(script())
    await run(
        definition(store, model=first, interpreter=INTERPRETER), request("r", tools, **NATIVE)
    )
    await approve(store, "r", by="alice", arguments={"env": "staging"})
    result = await resume(
        definition(store, model=second, interpreter=INTERPRETER), request("r", tools, **NATIVE)
    )
    assert [name for name, _ in ledger.calls] == ["deploy"]
    # The model's next request, the first after the deploy ran.
    blocks = [block for message in second.calls[0].messages for block in message.content]
    sent = [b for b in blocks if isinstance(b, ToolCallBlock | ToolResultBlock)]
    assert sent == [
        ToolCallBlock(call_id="c0", name="deploy", arguments={"env": "staging"}),
        ToolResultBlock(call_id="c0", text="Observation: deployed to staging"),
    ]
    step = result.steps[0]
    assert step.tool_call == ToolCallBlock(
        call_id="c0", name="deploy", arguments={"env": "staging"}
    )
    assert step.edited_by == "alice"


async def test_an_answer_for_a_proposal_no_longer_open_is_refused() -> None:
    store = MemoryStore()
    await approval_story(lambda: store)


async def test_a_settlement_for_an_intent_no_longer_open_is_refused() -> None:
    store = MemoryStore()
    await settlement_story(lambda: store)
