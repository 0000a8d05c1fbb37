"""Whole runs through ``run`` and ``resume`` on the memory store, under asyncio and Trio."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kit.agent import (
    Ledger,
    answer,
    definition,
    five_step_script,
    kinds,
    make_tools,
    request,
    same_outcome,
    timeless,
    tool_call,
)
from polyloop import (
    ActionStatus,
    Budget,
    DecisionKind,
    FinalAnswer,
    Injection,
    Intent,
    IntentKind,
    InvalidDecision,
    InvalidRequest,
    LeaseLost,
    Message,
    ModelReply,
    Replay,
    Result,
    Role,
    RunAlreadyExists,
    RunEnded,
    RunIdentityMismatch,
    RunNotFound,
    StepRecord,
    StopReason,
    resume,
    run,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash

pytestmark = pytest.mark.anyio


class WriteLog:
    """Passes everything to a memory store and notes the name of every write."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.writes: list[str] = []
        self.calls: list[str] = []  # every call, claim checks and reads included

    def parameters(self) -> Any:
        return self.inner.parameters()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        async def noted(*args: Any) -> Any:
            self.calls.append(name)
            if name not in ("read_log", "claim_run", "release_run", "check_claim"):
                self.writes.append(name)
            return await method(*args)

        return noted


class LosingStore(WriteLog):
    """A ``WriteLog`` whose claim is lost (as if the process slept past its lease)
    from the ``lose_at``-th claim check on."""

    def __init__(self, lose_at: int) -> None:
        super().__init__()
        self.lose_at = lose_at
        self.checks = 0

    async def check_claim(self, run_id: str) -> None:
        self.calls.append("check_claim")
        self.checks += 1
        if self.checks >= self.lose_at:
            raise LeaseLost("this store object's lease ended", run_id=run_id)
        await self.inner.check_claim(run_id)


# -- the exact write sequences ---------------------------------------------------------------


async def test_two_step_tool_run_is_ten_writes() -> None:
    store = WriteLog()
    ledger = Ledger()
    script = [tool_call("double", n=2), tool_call("submit", answer="4")]
    result = await run(definition(store, script=script), request("r", make_tools(ledger)))

    assert result.stop_reason is StopReason.SUBMITTED
    assert store.writes == [
        "start_run",
        "write_intent",
        "write_result",
        "write_intent",
        "write_step",
        "write_intent",
        "write_result",
        "write_intent",
        "write_step",
        "end_run",
    ]
    log = await store.inner.read_log("r")
    assert kinds(log.records) == [
        "RunStarted",
        "Intent:model_call",
        "Result:model_call",
        "Intent:action",
        "Result:action",
        "StepRecord",
        "Intent:model_call",
        "Result:model_call",
        "Intent:action",
        "Result:action",
        "StepRecord",
        "RunEnded",
    ]


SHORT_STEP = ["start_run", "write_intent", "write_result", "write_step", "end_run"]


async def test_every_effect_starts_right_after_its_intent_and_a_claim_check() -> None:
    """Each intent is followed at once by the claim check, and the check by nothing but
    the effect: the next store call is the effect's result."""
    store = WriteLog()
    script = [tool_call("double", n=2), tool_call("submit", answer="4")]
    await run(definition(store, script=script), request("r", make_tools(Ledger())))

    calls = [c for c in store.calls if c not in ("claim_run", "read_log", "release_run")]
    assert calls.count("check_claim") == calls.count("write_intent") == 4
    for i, call in enumerate(calls):
        if call == "write_intent":
            assert calls[i + 1] == "check_claim"
            assert calls[i + 2] in ("write_result", "write_step")


@pytest.mark.parametrize(("lose_at", "intents"), [(1, 1), (2, 2), (3, 3)])
async def test_a_lost_claim_starts_nothing_and_writes_nothing_more(
    lose_at: int, intents: int
) -> None:
    """The check refuses (lost at the first, second, third effect): the model is not
    called, the tool does not run, and nothing follows the intent, not even an end
    record; ``run`` raises the lease error naming the run."""
    store, ledger = LosingStore(lose_at), Ledger()
    model = ScriptedModelClient([tool_call("double", n=2), tool_call("submit", answer="4")])
    with pytest.raises(LeaseLost) as lost:
        await run(definition(store, model=model), request("r", make_tools(ledger)))
    assert lost.value.run_id == "r"
    assert len(model.calls) == lose_at // 2
    assert len(ledger.calls) == (lose_at - 1) // 2
    assert store.writes[-1] == "write_intent"
    assert store.writes.count("write_intent") == intents
    assert "end_run" not in store.writes


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        pytest.param([answer("42")], StopReason.FINAL_ANSWER, id="final-answer"),
        pytest.param([RuntimeError("model down")], StopReason.MODEL_FAILURE, id="model-failure"),
    ],
)
async def test_short_step_variants_are_three_writes(script: list[Any], reason: StopReason) -> None:
    store = WriteLog()
    result = await run(definition(store, script=script), request("r", make_tools(Ledger())))
    assert result.stop_reason is reason
    assert store.writes == SHORT_STEP


async def test_invalid_decision_is_three_writes_and_the_run_goes_on() -> None:
    store = WriteLog()
    script = ["not json", answer("done")]
    result = await run(definition(store, script=script), request("r", make_tools(Ledger())))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert store.writes == [
        "start_run",
        "write_intent",
        "write_result",
        "write_step",
        "write_intent",
        "write_result",
        "write_step",
        "end_run",
    ]
    invalid = result.steps[0]
    assert invalid.decision is DecisionKind.INVALID
    assert invalid.action_status is None
    assert invalid.observation is not None and "JSON object" in invalid.observation
    assert result.valid_step_count == 0 and result.step_count == 2


async def test_context_limit_stops_before_any_model_call() -> None:
    store = WriteLog()
    model = ScriptedModelClient([answer("never")])
    budget = Budget(max_steps=5, max_valid_steps=5, max_context_chars=10)
    result = await run(
        definition(store, model=model), request("r", make_tools(Ledger()), budget=budget)
    )
    assert result.stop_reason is StopReason.CONTEXT_LIMIT
    assert store.writes == ["start_run", "end_run"]
    assert model.calls == []
    assert result.detail is not None and "max_context_chars=10" in result.detail


async def test_model_failure_step_record_and_detail() -> None:
    store = MemoryStore()
    result = await run(
        definition(store, script=[TimeoutError("gateway timed out")]),
        request("r", make_tools(Ledger())),
    )
    assert result.detail == "TimeoutError: gateway timed out"
    (step,) = result.steps
    assert step.error == "TimeoutError: gateway timed out"
    assert (step.call_id, step.model_output, step.reasoning) == (None, "", None)
    assert step.decision is DecisionKind.INVALID
    assert step.observation is None and step.action_status is None
    log = await store.read_log("r")
    assert isinstance(log.records[-1], RunEnded)
    assert log.records[-1].detail == "TimeoutError: gateway timed out"


async def test_final_answer_is_on_the_step_and_the_result() -> None:
    result = await run(
        definition(MemoryStore(), script=[answer("42")]), request("r", make_tools(Ledger()))
    )
    assert result.final_answer == "42"
    assert result.steps[0].final_answer == "42"
    assert result.steps[0].decision is DecisionKind.FINAL
    assert result.steps[0].action_text is None and result.steps[0].observation is None


# -- stop order through whole runs -------------------------------------------------------------


async def test_last_allowed_step_that_submits_ends_submitted() -> None:
    budget = Budget(max_steps=2, max_valid_steps=2, max_context_chars=100_000)
    script = [tool_call("double", n=1), tool_call("submit", answer="2")]
    result = await run(
        definition(MemoryStore(), script=script), request("r", make_tools(Ledger()), budget=budget)
    )
    assert result.stop_reason is StopReason.SUBMITTED
    assert result.step_count == 2 == result.valid_step_count


async def test_step_limit_and_valid_step_limit() -> None:
    tools = make_tools(Ledger())
    looping = [tool_call("double", n=1)] * 10
    by_steps = await run(
        definition(MemoryStore(), script=looping),
        request(
            "a", tools, budget=Budget(max_steps=3, max_valid_steps=10, max_context_chars=100_000)
        ),
    )
    assert (by_steps.stop_reason, by_steps.step_count) == (StopReason.STEP_LIMIT, 3)
    by_valid = await run(
        definition(MemoryStore(), script=looping),
        request(
            "b", tools, budget=Budget(max_steps=10, max_valid_steps=2, max_context_chars=100_000)
        ),
    )
    assert (by_valid.stop_reason, by_valid.valid_step_count) == (StopReason.VALID_STEP_LIMIT, 2)


async def test_refused_and_invalid_steps_do_not_count_as_valid() -> None:
    script = [tool_call("double", n="x"), "garbage", tool_call("nope"), answer("ok")]
    result = await run(definition(MemoryStore(), script=script), request("r", make_tools(Ledger())))
    assert result.step_count == 4
    assert result.valid_step_count == 0
    refused = result.steps[0]
    assert refused.action_status is ActionStatus.NOT_EXECUTED
    assert refused.observation is not None and refused.observation.startswith("Refused: ")
    assert refused.observation_synthesized


async def test_a_tool_that_raises_counts_as_a_valid_step() -> None:
    from polyloop import ToolRegistry, ToolSpec

    async def broken(arguments: dict[str, Any], *, result_id: str) -> str:
        raise ValueError("cannot parse")

    tools = ToolRegistry(
        [ToolSpec(name="broken", description="", parameters={}, handler=broken)],
        max_observation_chars=1000,
    )
    budget = Budget(max_steps=10, max_valid_steps=2, max_context_chars=100_000)
    result = await run(
        definition(MemoryStore(), script=[tool_call("broken")] * 5),
        request("r", tools, budget=budget),
    )
    assert result.stop_reason is StopReason.VALID_STEP_LIMIT
    assert result.steps[0].observation == "ValueError: cannot parse"
    assert result.steps[0].observation_synthesized


async def test_executor_exception_and_fault_end_with_env_failure() -> None:
    class Exploding:
        async def execute(self, action: Any, *, result_id: str) -> Any:
            raise OSError("sandbox gone")

        def replay(self, action: Any) -> Replay:
            return Replay.NEVER

    tools = make_tools(Ledger())
    result = await run(
        definition(MemoryStore(), script=[tool_call("double", n=1)]),
        request("r", tools, executor=Exploding()),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE
    assert result.detail == "Fault: OSError: sandbox gone"
    assert result.steps[0].action_status is ActionStatus.ENV_FAULT
    assert result.steps[0].observation == "Fault: OSError: sandbox gone"


async def test_environment_done_signal_ends_the_run() -> None:
    from polyloop import ActionOutcome
    from polyloop.testing import ScriptedEnvironment

    env = ScriptedEnvironment(
        [
            ActionOutcome(
                status=ActionStatus.EXECUTED, observation="ok", synthesized=False, done=False
            ),
            ActionOutcome(
                status=ActionStatus.EXECUTED, observation="all done", synthesized=False, done=True
            ),
        ]
    )
    script = [tool_call("anything"), tool_call("anything")]
    result = await run(
        definition(MemoryStore(), script=script), request("r", make_tools(Ledger()), executor=env)
    )
    assert result.stop_reason is StopReason.ENV_DONE
    assert [s.done for s in result.steps] == [False, True]


# -- context the model sees -------------------------------------------------------------------


async def test_model_sees_plain_context_when_nothing_is_injected_and_no_tools() -> None:
    from polyloop import ToolRegistry

    model = ScriptedModelClient(["garbage", answer("x")])
    empty = ToolRegistry([], max_observation_chars=100)
    req = request("r", empty)
    await run(definition(MemoryStore(), model=model), req)
    first, second = model.calls
    assert first.messages == req.run_context + req.goal_context
    assert second.messages == (
        *req.run_context,
        *req.goal_context,
        Message.text(Role.ASSISTANT, "garbage"),
        Message.text(Role.USER, "Observation: " + second.messages[-1].content[0].text[13:]),
    )
    assert first.binding == {"episode": "e1"}
    assert (first.call_index, second.call_index) == (0, 1)
    assert first.result_id == "r:0:model"


async def test_injection_and_tools_take_their_slots() -> None:
    model = ScriptedModelClient([answer("x")])
    req = request(
        "r", make_tools(Ledger()), injection=Injection(entries={"system": ("Skill A", "Skill B")})
    )
    await run(definition(MemoryStore(), model=model), req)
    roles = [m.role for m in model.calls[0].messages]
    texts = [m.content[0].text for m in model.calls[0].messages]
    assert roles == [Role.SYSTEM, Role.SYSTEM, Role.SYSTEM, Role.USER]
    assert texts[1] == "Skill A\n\nSkill B"
    assert '"name":"double"' in texts[2] and '"name":"submit"' in texts[2]


# -- recovery -------------------------------------------------------------------------------


async def _uninterrupted(replay: Replay) -> Any:
    ledger = Ledger()
    tools = make_tools(ledger, replay=replay)
    return await run(
        definition(MemoryStore(), script=five_step_script()),
        request("r", tools, model_replay=replay),
    )


async def _crash_then_resume(k: int, replay: Replay) -> tuple[Any, Ledger, MemoryStore]:
    ledger = Ledger()
    tools = make_tools(ledger, replay=replay)
    inner = MemoryStore()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(inner, fail_after_writes=k), script=five_step_script()),
            request("r", tools, model_replay=replay),
        )
    resumed = await resume(
        definition(inner, script=five_step_script()), request("r", tools, model_replay=replay)
    )
    return resumed, ledger, inner


# The five-step run makes 1 + 4 + 4 + 3 + 4 + 4 + 1 = 21 writes; a crash after the last
# one cannot happen, so k runs over every write before it.
TOTAL_WRITES = 21


async def test_five_step_run_write_count() -> None:
    store = WriteLog()
    await run(definition(store, script=five_step_script()), request("r", make_tools(Ledger())))
    assert len(store.writes) == TOTAL_WRITES


@pytest.mark.parametrize("k", range(1, TOTAL_WRITES))
async def test_crash_after_every_write_resumes_to_the_same_run(k: int) -> None:
    expected = await _uninterrupted(Replay.ALLOWED)
    resumed, ledger, store = await _crash_then_resume(k, Replay.ALLOWED)
    assert resumed.resumed
    assert same_outcome(resumed, expected)
    # A replayed action reuses the result id it was announced with.
    assert {rid for _, rid in ledger.calls} <= {f"r:{i}:action" for i in range(5)}
    log = await store.read_log("r")
    assert isinstance(log.records[-1], RunEnded)
    assert log.records[-1].stop_reason is StopReason.SUBMITTED


def _open_intent_after(k: int) -> bool:
    """Whether write k of the five-step run is an intent (so a crash leaves it open)."""
    return k in _INTENT_WRITES


# Writes that are intents: model intents at 2, 6, 10, 13, 17; action intents at 4, 8, 15, 19.
_INTENT_WRITES = {2, 4, 6, 8, 10, 13, 15, 17, 19}


@pytest.mark.parametrize("k", range(1, TOTAL_WRITES))
async def test_crash_with_replay_never_is_in_doubt_exactly_between_intent_and_result(
    k: int,
) -> None:
    expected = await _uninterrupted(Replay.NEVER)
    resumed, ledger, store = await _crash_then_resume(k, Replay.NEVER)
    if _open_intent_after(k):
        assert resumed.stop_reason is StopReason.IN_DOUBT
        assert resumed.detail is not None and "r:" in resumed.detail
        log = await store.read_log("r")
        open_intent = log.records[-2]
        assert isinstance(open_intent, Intent)
        assert open_intent.result_id in resumed.detail
        assert open_intent.kind.value in resumed.detail
    else:
        assert same_outcome(resumed, expected)
    # Whatever happened, no action ran twice.
    assert all(ledger.count(rid) <= 1 for _, rid in ledger.calls)


async def test_intent_writes_are_where_the_test_says() -> None:
    store = WriteLog()
    await run(definition(store, script=five_step_script()), request("r", make_tools(Ledger())))
    intents = {i + 1 for i, name in enumerate(store.writes) if name == "write_intent"}
    assert intents == _INTENT_WRITES


async def test_allowed_model_replay_writes_no_second_intent() -> None:
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)
    inner = MemoryStore()
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(inner, fail_after_writes=2), script=[answer("a")]),
            request("r", tools, model_replay=Replay.ALLOWED),
        )
    await resume(
        definition(inner, script=[answer("a")]), request("r", tools, model_replay=Replay.ALLOWED)
    )
    log = await inner.read_log("r")
    model_intents = [
        r for r in log.records if isinstance(r, Intent) and r.kind is IntentKind.MODEL_CALL
    ]
    assert len(model_intents) == 1
    results = [r for r in log.records if isinstance(r, Result)]
    assert [r.result_id for r in results] == ["r:0:model"]


class _Lenient:
    """An interpreter whose rules changed after the crash: everything is now final."""

    def parameters(self) -> dict[str, Any]:
        from polyloop.testing import JsonActionInterpreter

        return dict(JsonActionInterpreter().parameters())

    def interpret(self, reply: ModelReply) -> FinalAnswer | InvalidDecision:
        return FinalAnswer(answer="changed", history_text=reply.content)


async def test_changing_the_interpreter_does_not_change_completed_steps() -> None:
    tools = make_tools(Ledger())
    before = await run(definition(MemoryStore(), script=five_step_script()), request("r", tools))
    inner = MemoryStore()
    with pytest.raises(SimulatedCrash):
        # Crash right after the step record of step 2 (write 12).
        await run(
            definition(FaultyStore(inner, fail_after_writes=12), script=five_step_script()),
            request("r", tools),
        )
    after = await resume(
        definition(inner, script=five_step_script(), interpreter=_Lenient()), request("r", tools)
    )
    assert timeless(after.steps[:3]) == timeless(before.steps[:3])
    assert after.steps[3].decision is DecisionKind.FINAL
    assert after.final_answer == "changed"


async def test_interrupted_step_without_action_intent_is_interpreted_again() -> None:
    tools = make_tools(Ledger())
    inner = MemoryStore()
    with pytest.raises(SimulatedCrash):
        # Write 3 is the model result of step 0; the action intent never landed.
        await run(
            definition(FaultyStore(inner, fail_after_writes=3), script=five_step_script()),
            request("r", tools),
        )
    after = await resume(
        definition(inner, script=five_step_script(), interpreter=_Lenient()), request("r", tools)
    )
    assert after.steps[0].decision is DecisionKind.FINAL
    assert after.stop_reason is StopReason.FINAL_ANSWER


async def test_interrupted_action_is_replayed_as_recorded_not_reinterpreted() -> None:
    ledger = Ledger()
    tools = make_tools(ledger, replay=Replay.ALLOWED)
    inner = MemoryStore()
    with pytest.raises(SimulatedCrash):
        # Write 4 is the action intent of step 0.
        await run(
            definition(FaultyStore(inner, fail_after_writes=4), script=five_step_script()),
            request("r", tools),
        )
    after = await resume(
        definition(inner, script=five_step_script(), interpreter=_Lenient()), request("r", tools)
    )
    assert after.steps[0].decision is DecisionKind.ACTION
    assert after.steps[0].action_text == 'double({"n": 1})'
    assert ledger.calls == [("double", "r:0:action"), ("double", "r:0:action")]


async def test_resume_of_a_finished_run_returns_it_and_writes_nothing() -> None:
    store = WriteLog()
    tools = make_tools(Ledger())
    first = await run(definition(store, script=[answer("7")]), request("r", tools))
    store.writes.clear()
    again = await resume(definition(store, script=[answer("7")]), request("r", tools))
    assert store.writes == []
    assert again.resumed and not first.resumed
    assert same_outcome(first, again)


async def test_run_refuses_an_existing_run_and_resume_an_unknown_one() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    await run(definition(store, script=[answer("1")]), request("r", tools))
    with pytest.raises(RunAlreadyExists) as exists:
        await run(definition(store, script=[answer("1")]), request("r", tools))
    assert exists.value.run_id == "r"
    with pytest.raises(RunNotFound) as missing:
        await resume(definition(store, script=[answer("1")]), request("other", tools))
    assert missing.value.run_id == "other"
    assert (await store.read_log("other")).records == ()


async def test_identity_mismatch_lists_every_differing_key_and_writes_nothing() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    inner_writes = FaultyStore(store, fail_after_writes=3)
    with pytest.raises(SimulatedCrash):
        await run(definition(inner_writes, script=five_step_script()), request("r", tools))
    before = (await store.read_log("r")).records
    changed = request(
        "r",
        tools,
        budget=Budget(max_steps=21, max_valid_steps=20, max_context_chars=100_000),
        binding={"episode": "e2", "extra": "x"},
        observation_template="Obs: {observation}",
    )
    with pytest.raises(RunIdentityMismatch) as mismatch:
        await resume(definition(store, script=["other script"]), changed)
    keys = [key for key, _, _ in mismatch.value.differences]
    assert keys == sorted(
        [
            "binding.episode",
            "binding.extra",
            "budget.max_steps",
            "model.script_sha256",
            "observation_template",
        ]
    )
    assert ("budget.max_steps", 20, 21) in mismatch.value.differences
    assert ("binding.extra", None, "x") in mismatch.value.differences
    for key in keys:
        assert key in str(mismatch.value)
    assert (await store.read_log("r")).records == before


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        pytest.param(
            {"budget": Budget(max_steps=-1, max_valid_steps=1, max_context_chars=1)},
            "budget.max_steps",
            id="negative-budget",
        ),
        pytest.param(
            {"budget": Budget(max_steps=1, max_valid_steps=0, max_context_chars=1)},
            "budget.max_valid_steps",
            id="zero-budget",
        ),
        pytest.param(
            {"observation_template": "Observation:"},
            "{observation}",
            id="template-without-placeholder",
        ),
        pytest.param(
            {"observation_template": "{observation} {other}"},
            "observation_template",
            id="template-with-extra-field",
        ),
        pytest.param({"run_id": ""}, "run_id", id="empty-run-id"),
        pytest.param(
            {"injection": Injection(entries={"user": ("x",)})},
            "injection",
            id="unknown-injection-channel",
        ),
        pytest.param({"binding": {"k": 1}}, "binding", id="non-string-binding"),
        pytest.param({"cancel_grace_s": -1.0}, "cancel_grace_s", id="negative-grace"),
        pytest.param(
            {"run_context": [Message.text(Role.USER, "x")]}, "run_context", id="context-not-a-tuple"
        ),
    ],
)
async def test_invalid_requests_are_refused_before_anything_is_written(
    overrides: dict[str, Any], fragment: str
) -> None:
    store = WriteLog()
    model = ScriptedModelClient([answer("x")])
    req = request("r", make_tools(Ledger()), **overrides)
    for drive in (run, resume):
        with pytest.raises(InvalidRequest) as refused:
            await drive(definition(store, model=model), req)
        assert fragment in str(refused.value)
    assert store.writes == []
    assert model.calls == []


async def test_invalid_observation_texts_are_refused() -> None:
    from polyloop import ObservationTexts

    store = WriteLog()
    texts = ObservationTexts(not_executed="no placeholder", env_fault="{detail}")
    with pytest.raises(InvalidRequest, match=r"texts\.not_executed"):
        await run(
            definition(store, script=[answer("x")], texts=texts), request("r", make_tools(Ledger()))
        )
    assert store.writes == []


async def test_arguments_that_violate_the_schema_are_not_executed() -> None:
    ledger = Ledger()
    script = [tool_call("double", n="seven"), tool_call("double", n=1, extra=True), answer("x")]
    result = await run(definition(MemoryStore(), script=script), request("r", make_tools(ledger)))
    assert ledger.calls == []
    assert [s.action_status for s in result.steps[:2]] == [ActionStatus.NOT_EXECUTED] * 2
    assert all("Refused: " in (s.observation or "") for s in result.steps[:2])


async def test_payload_that_is_not_name_and_arguments_is_not_executed() -> None:
    from polyloop import Action

    class RawPayload:
        def parameters(self) -> dict[str, Any]:
            return {"kind": "raw"}

        def interpret(self, reply: ModelReply) -> Action | FinalAnswer:
            if reply.content == "stop":
                return FinalAnswer(answer="stop", history_text="stop")
            return Action(
                payload={"tool": "double", "args": {"n": 1}},
                action_text="x",
                history_text=reply.content,
            )

    ledger = Ledger()
    result = await run(
        definition(MemoryStore(), script=["go", "stop"], interpreter=RawPayload()),
        request("r", make_tools(ledger)),
    )
    assert ledger.calls == []
    assert result.steps[0].action_status is ActionStatus.NOT_EXECUTED
    assert "name" in (result.steps[0].observation or "")


async def test_an_unloggable_action_payload_is_refused_without_an_intent() -> None:
    from polyloop import Action

    class NanPayload:
        def parameters(self) -> dict[str, Any]:
            return {"kind": "nan"}

        def interpret(self, reply: ModelReply) -> Action | FinalAnswer:
            if reply.content == "stop":
                return FinalAnswer(answer="stop", history_text="stop")
            return Action(
                payload={"name": "double", "arguments": {"n": float("nan")}},
                action_text="x",
                history_text=reply.content,
            )

    store = MemoryStore()
    ledger = Ledger()
    result = await run(
        definition(store, script=["go", "stop"], interpreter=NanPayload()),
        request("r", make_tools(ledger)),
    )
    assert ledger.calls == []
    assert result.steps[0].action_status is ActionStatus.NOT_EXECUTED
    log = await store.read_log("r")
    assert not any(isinstance(r, Intent) and r.kind is IntentKind.ACTION for r in log.records)


async def test_a_model_returning_the_wrong_type_is_a_model_failure() -> None:
    class Wrong:
        def parameters(self) -> dict[str, Any]:
            return {}

        async def call(self, call: Any) -> Any:
            return "a bare string"

    result = await run(definition(MemoryStore(), model=Wrong()), request("r", make_tools(Ledger())))
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and result.detail.startswith("TypeError: ")


async def test_an_empty_call_id_is_recorded_as_none() -> None:
    reply = ModelReply(call_id="", content=answer("x"), reasoning="because")
    result = await run(
        definition(MemoryStore(), script=[reply]), request("r", make_tools(Ledger()))
    )
    assert result.steps[0].call_id is None
    assert result.steps[0].reasoning == "because"


# -- the records are the trajectory --------------------------------------------------------------


async def test_step_records_in_the_log_equal_the_result() -> None:
    store = MemoryStore()
    result = await run(
        definition(store, script=five_step_script()), request("r", make_tools(Ledger()))
    )
    log = await store.read_log("r")
    logged = [r for r in log.records if isinstance(r, StepRecord)]
    assert logged == list(result.steps)
    assert all(r.run_id == "r" for r in log.records)
    assert [s.step for s in logged] == list(range(5))
    end = log.records[-1]
    assert isinstance(end, RunEnded)
    assert (end.steps, end.valid_steps) == (result.step_count, result.valid_step_count)


async def test_records_are_frozen_values() -> None:
    result = await run(
        definition(MemoryStore(), script=[answer("x")]), request("r", make_tools(Ledger()))
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.steps[0].step = 3  # type: ignore[misc]


@pytest.mark.parametrize("broken", ["raises", "returns-none"])
async def test_an_executor_without_a_replay_policy_is_an_environment_fault(broken: str) -> None:
    from polyloop import ActionOutcome

    class NoPolicy:
        def __init__(self) -> None:
            self.executed = 0

        async def execute(self, action: Any, *, result_id: str) -> ActionOutcome:
            self.executed += 1
            return ActionOutcome(
                status=ActionStatus.EXECUTED, observation="ran", synthesized=False, done=False
            )

        def replay(self, action: Any) -> Any:
            if broken == "raises":
                raise LookupError("no policy for this action")
            return None

    store, executor = MemoryStore(), NoPolicy()
    result = await run(
        definition(store, script=[tool_call("double", n=1)]),
        request("r", make_tools(Ledger()), executor=executor),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE
    assert executor.executed == 0
    expected = (
        "LookupError: no policy for this action"
        if broken == "raises"
        else "TypeError: the executor's replay() returned NoneType, not Replay"
    )
    assert result.detail == f"Fault: {expected}"
    log = await store.read_log("r")
    assert not any(isinstance(r, Intent) and r.kind is IntentKind.ACTION for r in log.records)


# -- one source for tools ----------------------------------------------------------------------


async def test_an_executor_of_another_registry_is_refused_before_any_io() -> None:
    # The model is shown request.tools; an executor derived from another registry would
    # run tools it never saw and miss the completing tool it was told about.
    ledger = Ledger()
    tools = make_tools(ledger)
    store = WriteLog()
    model = ScriptedModelClient([tool_call("submit", answer="4")])
    for executor in (make_tools(ledger).executor(), tools.subset(["double"]).executor()):
        for drive in (run, resume):
            with pytest.raises(InvalidRequest, match="another ToolRegistry") as refused:
                await drive(definition(store, model=model), request("r", tools, executor=executor))
            assert refused.value.run_id == "r"
    assert store.writes == []
    assert model.calls == []
    assert ledger.calls == []
    # Nothing was claimed either: a request that agrees with itself runs at once.
    result = await run(definition(store, model=model), request("r", tools))
    assert result.stop_reason is StopReason.SUBMITTED


async def test_an_executor_of_an_equal_registry_is_accepted() -> None:
    from polyloop import ToolRegistry

    tools = make_tools(Ledger())
    twin = ToolRegistry(
        [spec for name in tools.names if (spec := tools.get(name))],
        max_observation_chars=tools.max_observation_chars,
    )
    assert twin == tools and twin is not tools
    result = await run(
        definition(MemoryStore(), script=[tool_call("submit", answer="4")]),
        request("r", tools, executor=twin.executor()),
    )
    assert result.stop_reason is StopReason.SUBMITTED


def test_the_values_have_their_public_home_in_session() -> None:
    import pickle
    import typing

    from polyloop import Definition, ObservationTexts, Request, session
    from polyloop.session import _values

    for cls in (Definition, ObservationTexts, Request):
        assert getattr(session, cls.__name__) is getattr(_values, cls.__name__) is cls
        assert cls.__module__ == "polyloop.session"
        assert typing.get_type_hints(cls)  # annotations resolve wherever the class is
    texts = ObservationTexts(not_executed="{reason}", env_fault="{detail}")
    assert pickle.loads(pickle.dumps(texts)) == texts
