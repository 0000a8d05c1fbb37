"""Re-driving a recorded run offline (issue 32, item 3), on the memory store: the recorded
model and executor give back the recorded trajectory, and say at which step a changed
template, run context or interpreter first makes the run ask for something else."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.replay import ANSWERED, ThreeIsFour, copied, offline, plain_steps, record, without_run
from polyloop import (
    Action,
    ActionStatus,
    CorruptLog,
    Decision,
    DecisionKind,
    InvalidDecision,
    Message,
    ModelCall,
    ModelReply,
    PolyLoopError,
    Replay,
    Result,
    Role,
    RunLog,
    RunNotFound,
    StepRecord,
    StopReason,
    fork,
    run,
)
from polyloop.stores import MemoryStore
from polyloop.testing import (
    RecordedExecutor,
    RecordedModelClient,
    RecordedModelFailure,
    ReplayDiverged,
    ScriptedModelClient,
)

pytestmark = pytest.mark.anyio


async def recorded_log(script: list[object] | None = None) -> tuple[MemoryStore, RunLog]:
    store = MemoryStore()
    await record(store) if script is None else await record(store, script=script)
    return store, await store.read_log("src")


async def test_a_re_driven_run_takes_the_recorded_trajectory_and_runs_nothing() -> None:
    _, log = await recorded_log()
    (defined, redriven), model, executor = offline(log)
    result = await run(defined, redriven)
    assert result.run_id == "again" and result.stop_reason is StopReason.SUBMITTED
    again = await defined.store.read_log("again")
    # Every record after the start, the intents' replay policies and the replies'
    # reported usage, model and refusal among them, as recorded (timing and run id aside).
    assert without_run(again.records, "again") == without_run(log.records, "src")
    assert plain_steps(result.steps) == plain_steps(_steps_of(log))
    assert [step.decision for step in result.steps] == [
        DecisionKind.ACTION,
        DecisionKind.ACTION,
        DecisionKind.INVALID,
        DecisionKind.INVALID,
        DecisionKind.ACTION,
        DecisionKind.ACTION,
    ]
    assert result.steps[1].action_status is ActionStatus.NOT_EXECUTED
    assert result.steps[2].refusal == "I will not double that."
    assert [call.call_index for call in model.calls] == [0, 1, 2, 3, 4, 5]
    assert executor.executions == [f"again:{step}:action" for step in (0, 1, 4, 5)]
    assert model.divergences == [] and executor.divergences == []
    model.check()
    executor.check()


async def test_the_recorded_intents_replay_policy_is_given_back() -> None:
    store = MemoryStore()
    await run(
        definition(store, script=[tool_call("double", n=1), answer("2")]),
        request("src", make_tools(Ledger(), replay=Replay.ALLOWED)),
    )
    log = await store.read_log("src")
    executor = RecordedExecutor.from_log(log)
    recorded = Action(
        payload={"name": "double", "arguments": {"n": 1}}, action_text="", history_text=""
    )
    other = Action(
        payload={"name": "double", "arguments": {"n": 2}}, action_text="", history_text=""
    )
    assert executor.replay(recorded) is Replay.ALLOWED
    assert executor.replay(other) is Replay.NEVER
    (defined, redriven), _, _ = offline(log)
    await run(defined, redriven)
    again = await defined.store.read_log("again")
    assert without_run(again.records, "again") == without_run(log.records, "src")


async def test_a_recorded_model_failure_is_raised_again_with_the_same_text() -> None:
    _, log = await recorded_log([tool_call("double", n=1), RuntimeError("the model is down")])
    (defined, redriven), model, _ = offline(log)
    result = await run(defined, redriven)
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail == "RuntimeError: the model is down"
    assert result.steps[1].error == "RuntimeError: the model is down"
    again = await defined.store.read_log("again")
    assert without_run(again.records, "again") == without_run(log.records, "src")
    assert model.divergences == []
    with pytest.raises(RecordedModelFailure, match="the model is down") as raised:
        await model.call(_call("x", 1, model.calls[1].messages))
    assert type(raised.value).__name__ == "RuntimeError"


async def test_a_changed_observation_template_fails_at_the_first_step_that_differs() -> None:
    _, log = await recorded_log()
    (defined, redriven), model, _ = offline(log, observation_template="Seen: {observation}")
    result = await run(defined, redriven)
    # Step 0 sends no observation yet, so it is the same; step 1 sends step 0's.
    assert result.stop_reason is StopReason.MODEL_FAILURE and result.step_count == 2
    assert plain_steps(result.steps[:1]) == plain_steps(_steps_of(log)[:1])
    assert result.detail is not None and result.detail.startswith(
        "ReplayDiverged: run 'again', step 1 (re-driving run 'src'): the messages differ"
    )
    # The first message that differs, quoted around its first differing character.
    assert (
        ": message 4 (the observation of step 0) differs at character 21: "
        'recorded {"content":[{"text":"Observation: 2 (src:0:action)","type":"…, '
        'sent {"content":[{"text":"Seen: 2 (src:0:action)","type":"text"}]… (sha256 '
    ) in result.detail
    assert [d.step for d in model.divergences] == [1]
    with pytest.raises(ReplayDiverged, match=r"step 1 \(re-driving run 'src'\)") as raised:
        model.check()
    assert (raised.value.run_id, raised.value.recorded_run_id) == ("again", "src")


async def test_a_changed_run_context_fails_at_step_0() -> None:
    _, log = await recorded_log()
    context = (Message.text(Role.SYSTEM, "You are a hasty agent."),)
    (defined, redriven), model, executor = offline(log, run_context=context)
    result = await run(defined, redriven)
    assert result.stop_reason is StopReason.MODEL_FAILURE and result.step_count == 1
    assert result.detail is not None and "run 'again', step 0" in result.detail
    assert (
        "the 3 messages before the history (run context, injected text, tool list, goal) "
        "differ from the recorded run's, whose log keeps only their digest; no history yet"
    ) in result.detail
    assert [d.step for d in model.divergences] == [0] and executor.executions == []


async def test_an_interpreter_that_decides_differently_is_refused_at_that_step() -> None:
    _, log = await recorded_log()
    (defined, redriven), model, executor = offline(log, interpreter=ThreeIsFour())
    result = await run(defined, redriven)
    # Step 4 asked for double(3) and the new interpreter makes it double(4): refused.
    assert plain_steps(result.steps[:4]) == plain_steps(_steps_of(log)[:4])
    refused = result.steps[4]
    assert refused.action_status is ActionStatus.NOT_EXECUTED
    assert refused.observation is not None
    assert "ReplayDiverged: run 'again', step 4 (re-driving run 'src')" in refused.observation
    assert "performed another action at it" in refused.observation
    assert [d.step for d in executor.divergences] == [4]
    with pytest.raises(ReplayDiverged, match="step 4"):
        executor.check()
    # The refusal is what step 5 sends, so the run stops there.
    assert result.stop_reason is StopReason.MODEL_FAILURE and result.step_count == 6
    assert [d.step for d in model.divergences] == [5]


async def test_an_action_where_the_recorded_run_had_none_is_refused_naming_the_step() -> None:
    _, log = await recorded_log(ANSWERED)

    (defined, redriven), _, executor = offline(log, interpreter=NotJsonIsAnAction())
    result = await run(defined, redriven)
    assert result.steps[1].action_status is ActionStatus.NOT_EXECUTED
    assert "step 1 (re-driving run 'src'): the recorded run performed no action at it" in (
        result.steps[1].observation or ""
    )
    assert [d.step for d in executor.divergences] == [1]


class NotJsonIsAnAction(ThreeIsFour):
    """Decides as the JSON interpreter does, but acts on a reply that is not JSON."""

    def interpret(self, reply: ModelReply) -> Decision:
        decision = super().interpret(reply)
        if isinstance(decision, InvalidDecision):
            payload = {"name": "double", "arguments": {"n": 0}}
            return Action(payload=payload, action_text="double(0)", history_text=reply.content)
        return decision


async def test_a_call_past_the_recorded_steps_names_the_step() -> None:
    _, log = await recorded_log(ANSWERED)
    model = RecordedModelClient.from_log(log)
    with pytest.raises(ReplayDiverged, match=r"run 'x', step 3 .*steps 0 to 2 only"):
        await model.call(_call("x", 3, ()))
    executor = RecordedExecutor.from_log(log)
    outcome = await executor.execute(
        Action(payload={"name": "double", "arguments": {"n": 1}}, action_text="", history_text=""),
        result_id="x:7:action",
    )
    assert outcome.status is ActionStatus.NOT_EXECUTED and "run 'x', step 7" in outcome.observation


async def test_a_fork_is_re_driven_offline_from_its_first_own_step() -> None:
    store = MemoryStore()
    await record(store, script=[tool_call("double", n=1), tool_call("double", n=2), answer("4")])
    forked = await fork(
        definition(
            store, script=["inherited", "inherited", "no", tool_call("double", n=5), answer("10")]
        ),
        request("f", make_tools(Ledger())),
        source_run_id="src",
        at_step=2,
    )
    assert forked.final_answer == "10"
    log = await store.read_log("f")
    model, executor = RecordedModelClient.from_log(log), RecordedExecutor.from_log(log)
    offline_store = await copied(log)
    result = await fork(
        definition(offline_store, model=model),
        request("again", make_tools(Ledger()), executor=executor),
        source_run_id="f",
        at_step=2,
    )
    assert plain_steps(result.steps) == plain_steps(forked.steps)
    assert [call.call_index for call in model.calls] == [2, 3, 4]
    assert executor.executions == ["again:3:action"]
    again = await offline_store.read_log("again")
    assert without_run(again.records, "again") == without_run(log.records, "f")
    # Driven from step 0 instead, the first call asks for a step the fork inherited.
    (defined, redriven), inherited, _ = offline(log)
    started = await run(defined, redriven)
    assert started.stop_reason is StopReason.MODEL_FAILURE
    assert started.detail is not None and re.search(
        r"step 0 \(re-driving run 'f'\): the recorded run is a fork of run 'src' at step 2",
        started.detail,
    )
    assert [d.step for d in inherited.divergences] == [0]


async def test_a_divergence_is_an_assertion_that_names_both_runs_and_pickles() -> None:
    error = ReplayDiverged("it differs", run_id="again", recorded_run_id="src", step=3)
    assert isinstance(error, AssertionError) and not isinstance(error, PolyLoopError)
    assert str(error) == "run 'again', step 3 (re-driving run 'src'): it differs"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.run_id, copy.recorded_run_id, copy.step, str(copy)) == (
        "again",
        "src",
        3,
        str(error),
    )


async def test_what_the_recorded_doubles_refuse_to_be_built_from() -> None:
    with pytest.raises(RunNotFound, match="no record"):
        RecordedModelClient.from_log(RunLog(run_id="nope", records=()))
    with pytest.raises(RunNotFound, match="no record"):
        RecordedExecutor.from_log(RunLog(run_id="nope", records=()))
    _, log = await recorded_log(ANSWERED)
    bad_model = _broken(log, "src:0:model", {"error": "no exception's text"})
    with pytest.raises(CorruptLog, match="'src:0:model' holds an error that is not"):
        RecordedModelClient.from_log(bad_model)
    bad_reply = _broken(log, "src:1:model", {"content": 7})
    with pytest.raises(CorruptLog, match="'src:1:model' holds no reply"):
        RecordedModelClient.from_log(bad_reply)
    outcome = {"status": "ran", "observation": "x", "synthesized": False, "done": False}
    with pytest.raises(CorruptLog, match="'src:0:action' holds no outcome: 'ran' is not"):
        RecordedExecutor.from_log(_broken(log, "src:0:action", outcome))
    typed = {"status": "executed", "observation": 1, "synthesized": False, "done": False}
    with pytest.raises(CorruptLog, match=r"'src:0:action' holds no outcome: .*observation"):
        RecordedExecutor.from_log(_broken(log, "src:0:action", typed))


async def test_one_recorded_client_serves_runs_of_any_run_id() -> None:
    _, log = await recorded_log(ANSWERED)
    source_model = ScriptedModelClient(ANSWERED)
    await run(definition(MemoryStore(), model=source_model), request("a", make_tools(Ledger())))
    model = RecordedModelClient.from_log(log)
    for run_id in ("one", "two"):
        reply = await model.call(_call(run_id, 0, source_model.calls[0].messages))
        assert reply.content == tool_call("double", n=1) and reply.call_id == "src/0"
    assert model.parameters() == {"kind": "recorded", "recorded_run_id": "src"}


def _call(run_id: str, index: int, messages: tuple[Message, ...]) -> ModelCall:
    return ModelCall(
        messages=messages,
        call_index=index,
        run_id=run_id,
        result_id=f"{run_id}:{index}:model",
        binding={},
    )


def _steps_of(log: RunLog) -> list[StepRecord]:
    return [record for record in log.records if isinstance(record, StepRecord)]


def _broken(log: RunLog, result_id: str, payload: object) -> RunLog:
    """``log`` with another payload in the result ``result_id``."""
    records = tuple(
        dataclasses.replace(record, payload=payload)  # type: ignore[arg-type]
        if isinstance(record, Result) and record.result_id == result_id
        else record
        for record in log.records
    )
    return RunLog(run_id=log.run_id, records=records)
