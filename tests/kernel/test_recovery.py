"""Tests for polyloop._recovery: the four recovery states, log checks, identity check.

Logs are built by :class:`LogBuilder`, which writes exactly the records the library
writes (see ``polyloop.session``): per step a model-call intent and its result, then for
an action an action intent and ``write_step(step, action_result)`` (the action result
immediately followed by the step record), or ``write_step(step, None)`` for a step
without an action. A store lands ``write_step`` atomically, so a log is only ever cut
between two *writes*: that is the granularity of the prefixes below.

Pure synchronous code: no coroutines, no fixtures that start resources.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polyloop._recovery import (
    Plan,
    RecoveryState,
    action_result_id,
    identity_differences,
    in_doubt_detail,
    model_result_id,
    read_plan,
    recorded_result,
    snapshot_at,
    valid_step_count,
)
from polyloop.types import (
    ActionStatus,
    Amended,
    CorruptLog,
    DecisionKind,
    Intent,
    IntentKind,
    JSONValue,
    Record,
    Replay,
    Result,
    RunEnded,
    RunLog,
    RunStarted,
    StepRecord,
    StopReason,
)

RUN = "run-1"
SNAPSHOT: dict[str, JSONValue] = {"budget.max_steps": 10, "model.name": "scripted"}

StepKind = Literal[
    "action",  # an action that ran (EXECUTED)
    "refused",  # an announced action the executor refused (NOT_EXECUTED)
    "unloggable",  # an action whose intent could not be recorded: refused, no intent
    "env_fault",  # the environment failed (ENV_FAULT): the run stops
    "final",  # a final answer: the run stops
    "invalid",  # an unusable reply: feedback goes back to the model
    "model_failure",  # the model call raised: the run stops
]
STEP_KINDS: tuple[StepKind, ...] = (
    "action",
    "refused",
    "unloggable",
    "env_fault",
    "final",
    "invalid",
    "model_failure",
)
STOPPING_KINDS = {"env_fault", "final", "model_failure"}
WITH_ACTION_INTENT = {"action", "refused", "env_fault"}

Write = tuple[Record, ...]


class LogBuilder:
    """Produces the writes the library makes, one ``Store`` call per write."""

    def __init__(
        self,
        run_id: str = RUN,
        *,
        model_replay: Replay = Replay.ALLOWED,
        snapshot: dict[str, JSONValue] | None = None,
    ) -> None:
        self.run_id = run_id
        self.model_replay = model_replay
        self.writes: list[Write] = [
            (RunStarted(run_id=run_id, snapshot=dict(snapshot or SNAPSHOT)),)
        ]
        self.steps: list[StepRecord] = []

    # -- the pieces of one step -----------------------------------------------------------

    @property
    def index(self) -> int:
        return len(self.steps)

    def model_intent(self) -> Intent:
        intent = Intent(
            run_id=self.run_id,
            result_id=model_result_id(self.run_id, self.index),
            kind=IntentKind.MODEL_CALL,
            step=self.index,
            call_index=self.index,
            replay=self.model_replay,
            payload={"messages_sha256": f"sha-{self.index}"},
        )
        self.writes.append((intent,))
        return intent

    def model_result(self, kind: StepKind) -> Result:
        payload: JSONValue
        if kind == "model_failure":
            payload = {"error": "TimeoutError: the model did not answer"}
        else:
            payload = {
                "call_id": f"call-{self.index}",
                "content": f"reply {self.index}",
                "reasoning": None,
            }
        result = Result(
            run_id=self.run_id,
            result_id=model_result_id(self.run_id, self.index),
            kind=IntentKind.MODEL_CALL,
            payload=payload,
        )
        self.writes.append((result,))
        return result

    def action_intent(self, replay: Replay) -> Intent:
        intent = Intent(
            run_id=self.run_id,
            result_id=action_result_id(self.run_id, self.index),
            kind=IntentKind.ACTION,
            step=self.index,
            call_index=self.index,
            replay=replay,
            payload={"name": "search", "arguments": {"q": f"q{self.index}"}},
            action_text=f"search(q{self.index})",
            history_text=f"I search q{self.index}.",
        )
        self.writes.append((intent,))
        return intent

    def step_record(self, kind: StepKind) -> StepRecord:
        step = _step_record(self.run_id, self.index, kind)
        if kind in WITH_ACTION_INTENT:
            assert step.action_status is not None
            result = Result(
                run_id=self.run_id,
                result_id=action_result_id(self.run_id, self.index),
                kind=IntentKind.ACTION,
                payload={
                    "status": step.action_status.value,
                    "observation": step.observation,
                    "synthesized": step.observation_synthesized,
                    "done": False,
                    "truncated_chars": 0,
                },
            )
            self.writes.append((result, step))
        else:
            self.writes.append((step,))
        self.steps.append(step)
        return step

    # -- whole steps and ends -------------------------------------------------------------

    def step(self, kind: StepKind, *, replay: Replay = Replay.NEVER) -> StepRecord:
        self.model_intent()
        self.model_result(kind)
        if kind in WITH_ACTION_INTENT:
            self.action_intent(replay)
        return self.step_record(kind)

    def end(
        self, reason: StopReason, *, steps: int | None = None, detail: str | None = None
    ) -> RunEnded:
        last = self.steps[-1] if self.steps else None
        final = last.final_answer if reason is StopReason.FINAL_ANSWER and last else None
        end = RunEnded(
            run_id=self.run_id,
            stop_reason=reason,
            final_answer=final,
            steps=len(self.steps) if steps is None else steps,
            valid_steps=valid_step_count(tuple(self.steps)),
            detail=detail,
        )
        self.writes.append((end,))
        return end

    def stop_reason(self) -> StopReason:
        """The reason the library would end with after the last step."""
        if not self.steps:
            return StopReason.CONTEXT_LIMIT
        return {
            "model_failure": StopReason.MODEL_FAILURE,
            "env_fault": StopReason.ENV_FAILURE,
            "final": StopReason.FINAL_ANSWER,
        }.get(_kind_of(self.steps[-1]), StopReason.STEP_LIMIT)

    @property
    def records(self) -> list[Record]:
        return [record for write in self.writes for record in write]

    def log(self) -> RunLog:
        return RunLog(run_id=self.run_id, records=tuple(self.records))


def _step_record(run_id: str, index: int, kind: StepKind) -> StepRecord:
    common: dict[str, Any] = {
        "run_id": run_id,
        "step": index,
        "call_id": f"call-{index}",
        "model_output": f"reply {index}",
        "reasoning": None,
        "action_text": None,
        "observation": None,
        "observation_synthesized": False,
        "action_status": None,
        "done": False,
        "truncated_chars": 0,
        "error": None,
        "duration_s": 0.25,
    }
    if kind in ("action", "refused", "env_fault", "unloggable"):
        status = {
            "action": ActionStatus.EXECUTED,
            "refused": ActionStatus.NOT_EXECUTED,
            "unloggable": ActionStatus.NOT_EXECUTED,
            "env_fault": ActionStatus.ENV_FAULT,
        }[kind]
        observation = {
            "action": "3 hits",
            "refused": "refused: unknown tool",
            "unloggable": "refused: NaN at arguments.x",
            "env_fault": "environment failed: ConnectionError",
        }[kind]
        common.update(
            decision=DecisionKind.ACTION,
            history_text=f"I search q{index}.",
            action_text=f"search(q{index})",
            observation=observation,
            observation_synthesized=kind != "action",
            action_status=status,
        )
    elif kind == "final":
        common.update(
            decision=DecisionKind.FINAL, history_text="The answer is 42.", final_answer="42"
        )
    elif kind == "invalid":
        common.update(
            decision=DecisionKind.INVALID,
            history_text="garbage",
            observation="reply with JSON",
            observation_synthesized=True,
        )
    else:
        common.update(
            call_id=None,
            model_output="",
            decision=DecisionKind.INVALID,
            history_text="",
            error="TimeoutError: the model did not answer",
        )
    return StepRecord(**common)


def _kind_of(step: StepRecord) -> StepKind:
    if step.error is not None:
        return "model_failure"
    if step.decision is DecisionKind.FINAL:
        return "final"
    if step.decision is DecisionKind.INVALID:
        return "invalid"
    if step.action_status is ActionStatus.ENV_FAULT:
        return "env_fault"
    if step.action_status is ActionStatus.EXECUTED:
        return "action"
    return "refused"


def build_log(
    run_id: str,
    steps_spec: Sequence[StepKind],
    *,
    model_replay: Replay = Replay.ALLOWED,
    action_replay: Replay = Replay.NEVER,
    end: StopReason | Literal["auto"] | None = "auto",
) -> list[Record]:
    """Exactly what the library writes for ``steps_spec``, then an end record.

    ``end="auto"`` ends the run the way the library would after the last step;
    ``None`` leaves the log unended (a crash after the last write).
    """
    builder = LogBuilder(run_id, model_replay=model_replay)
    for kind in steps_spec:
        builder.step(kind, replay=action_replay)
    if end == "auto":
        builder.end(builder.stop_reason())
    elif end is not None:
        builder.end(end)
    return builder.records


def plan_of(records: Sequence[Record], run_id: str = RUN) -> Plan:
    return read_plan(RunLog(run_id=run_id, records=tuple(records)))


def steps_in(records: Sequence[Record]) -> tuple[StepRecord, ...]:
    return tuple(r for r in records if isinstance(r, StepRecord))


# -- the builder itself writes what the spec pins ------------------------------------------


def test_builder_writes_the_pinned_record_sequence() -> None:
    records = build_log(RUN, ["action", "action"], end=StopReason.SUBMITTED)
    assert [type(r).__name__ for r in records] == [
        "RunStarted",
        "Intent",
        "Result",
        "Intent",
        "Result",
        "StepRecord",
        "Intent",
        "Result",
        "Intent",
        "Result",
        "StepRecord",
        "RunEnded",
    ]
    short = build_log(RUN, ["final"])
    assert [type(r).__name__ for r in short] == [
        "RunStarted",
        "Intent",
        "Result",
        "StepRecord",
        "RunEnded",
    ]
    assert plan_of(records).state is RecoveryState.FINISHED


# -- the four states ------------------------------------------------------------------------


def test_empty_log_is_fresh() -> None:
    plan = plan_of([])
    assert plan == Plan(state=RecoveryState.FRESH)
    assert plan.started is None


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        pytest.param(["action", "final"], StopReason.FINAL_ANSWER, id="final-answer"),
        pytest.param(["invalid", "model_failure"], StopReason.MODEL_FAILURE, id="model-failure"),
        pytest.param(["action", "env_fault"], StopReason.ENV_FAILURE, id="env-failure"),
        pytest.param(["action", "refused", "invalid"], StopReason.STEP_LIMIT, id="step-limit"),
        pytest.param([], StopReason.CONTEXT_LIMIT, id="context-limit-before-any-step"),
        pytest.param(["action"], StopReason.SUBMITTED, id="submitted"),
    ],
)
def test_log_ending_with_a_final_end_is_finished(spec: list[StepKind], reason: StopReason) -> None:
    builder = LogBuilder()
    for kind in spec:
        builder.step(kind)
    end = builder.end(reason, detail="why it ended")
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.FINISHED
    assert plan.ended == end
    assert plan.steps == tuple(builder.steps)
    assert plan.started == builder.writes[0][0]

    result = recorded_result(plan)
    assert result.resumed is True
    assert result.run_id == RUN
    assert result.stop_reason is reason
    assert result.steps == tuple(builder.steps)
    assert result.step_count == len(spec)
    assert result.valid_step_count == spec.count("action")
    assert result.detail == "why it ended"
    assert result.final_answer == ("42" if reason is StopReason.FINAL_ANSWER else None)
    assert result.event_failures == 0


def test_recorded_result_needs_an_end() -> None:
    plan = plan_of(build_log(RUN, ["action"], end=None))
    with pytest.raises(ValueError, match="no end record"):
        recorded_result(plan)


@pytest.mark.parametrize(
    ("replay", "state"),
    [
        pytest.param(Replay.NEVER, RecoveryState.IN_DOUBT, id="never-in-doubt"),
        pytest.param(Replay.ALLOWED, RecoveryState.RESUMABLE, id="allowed-resumable"),
    ],
)
def test_open_model_call_intent(replay: Replay, state: RecoveryState) -> None:
    builder = LogBuilder(model_replay=replay)
    builder.step("action")
    intent = builder.model_intent()
    plan = read_plan(builder.log())
    assert plan.state is state
    assert plan.open_intent == intent
    assert plan.model_result is None
    assert plan.steps == tuple(builder.steps)
    assert plan.ended is None


def test_model_result_without_action_intent_is_resumable() -> None:
    builder = LogBuilder(model_replay=Replay.NEVER)  # the model call is done: no doubt
    builder.step("invalid")
    builder.model_intent()
    result = builder.model_result("action")
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.RESUMABLE
    assert plan.model_result == result
    assert plan.open_intent is None
    assert len(plan.steps) == 1


@pytest.mark.parametrize(
    ("replay", "state"),
    [
        pytest.param(Replay.NEVER, RecoveryState.IN_DOUBT, id="never-in-doubt"),
        pytest.param(Replay.ALLOWED, RecoveryState.RESUMABLE, id="allowed-resumable"),
    ],
)
def test_open_action_intent(replay: Replay, state: RecoveryState) -> None:
    builder = LogBuilder()
    builder.model_intent()
    result = builder.model_result("action")
    intent = builder.action_intent(replay)
    plan = read_plan(builder.log())
    assert plan.state is state
    assert plan.open_intent == intent
    assert plan.model_result == result
    assert plan.steps == ()
    assert plan.last_action is None


@pytest.mark.parametrize(
    ("spec", "last_has_action"),
    [
        pytest.param(["action"], True, id="one-action"),
        pytest.param(["invalid", "action"], True, id="action-last"),
        pytest.param(["action", "invalid"], False, id="invalid-last"),
        pytest.param(["action", "unloggable"], False, id="unloggable-last-has-no-intent"),
        pytest.param(["invalid", "refused"], True, id="refused-last"),
        pytest.param(["action", "final"], False, id="final-last"),
        pytest.param(["model_failure"], False, id="model-failure-last"),
    ],
)
def test_completed_steps_only_is_resumable(spec: list[StepKind], last_has_action: bool) -> None:
    builder = LogBuilder(model_replay=Replay.NEVER)
    intents: list[Intent | None] = []
    for kind in spec:
        builder.step(kind, replay=Replay.NEVER)
        last_write = builder.writes[-2][0] if kind in WITH_ACTION_INTENT else None
        intents.append(last_write if isinstance(last_write, Intent) else None)
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.RESUMABLE
    assert plan.steps == tuple(builder.steps)
    assert plan.open_intent is None
    assert plan.model_result is None
    assert plan.ended is None
    if last_has_action:
        assert plan.last_action is not None
        assert plan.last_action == intents[-1]
        assert plan.last_action.kind is IntentKind.ACTION
        assert plan.last_action.step == len(spec) - 1
    else:
        assert plan.last_action is None


def test_start_record_only_is_resumable() -> None:
    builder = LogBuilder()
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.RESUMABLE
    assert plan.started == RunStarted(run_id=RUN, snapshot=SNAPSHOT)
    assert plan.steps == ()
    assert plan.last_action is None


def test_cancelled_end_is_resumable() -> None:
    builder = LogBuilder()
    builder.step("action")
    end = builder.end(StopReason.CANCELLED, detail="the run was cancelled")
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.RESUMABLE
    assert plan.ended == end
    assert len(plan.steps) == 1


def test_cancelled_end_with_open_never_intent_is_in_doubt() -> None:
    builder = LogBuilder(model_replay=Replay.NEVER)
    builder.step("action")
    intent = builder.model_intent()
    builder.end(StopReason.CANCELLED, detail="the run was cancelled")
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.IN_DOUBT
    assert plan.open_intent == intent


def test_cancelled_end_may_disagree_with_the_step_count() -> None:
    # A cancellation during a step write of unknown fate: only final ends are held to it.
    builder = LogBuilder()
    builder.step("action")
    builder.end(StopReason.CANCELLED, steps=2)
    assert read_plan(builder.log()).state is RecoveryState.RESUMABLE


def test_records_after_a_cancelled_end_are_a_resumed_run() -> None:
    builder = LogBuilder()
    builder.step("action")
    builder.model_intent()  # cancelled during the model call (replay allowed)
    builder.end(StopReason.CANCELLED)
    # resumed: the intent on disk is reused, its result lands under the same id
    builder.model_result("action")
    builder.action_intent(Replay.ALLOWED)
    builder.step_record("action")
    builder.end(StopReason.CANCELLED)  # cancelled again between steps
    builder.step("final")
    end = builder.end(StopReason.FINAL_ANSWER)
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.FINISHED
    assert plan.ended == end
    assert plan.steps == tuple(builder.steps)
    assert [s.step for s in plan.steps] == [0, 1, 2]
    assert recorded_result(plan).final_answer == "42"


def test_resumed_run_still_open_after_cancel_is_resumable() -> None:
    builder = LogBuilder()
    builder.step("action")
    builder.end(StopReason.CANCELLED)
    builder.model_intent()
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.RESUMABLE
    assert plan.ended is None  # the cancelled end no longer ends the log
    assert plan.open_intent is not None


def test_an_in_doubt_end_leaves_the_run_in_doubt_until_a_settlement() -> None:
    builder = LogBuilder()
    builder.step("action")
    builder.model_intent()
    builder.model_result("action")
    intent = builder.action_intent(Replay.NEVER)
    assert read_plan(builder.log()).state is RecoveryState.IN_DOUBT
    detail = in_doubt_detail(intent)
    builder.end(StopReason.IN_DOUBT, detail=detail)
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.IN_DOUBT
    assert plan.ended is not None and plan.ended.stop_reason is StopReason.IN_DOUBT
    result = recorded_result(plan)
    assert result.stop_reason is StopReason.IN_DOUBT
    assert result.detail == detail
    assert result.step_count == 1


def test_in_doubt_detail_names_kind_and_result_id() -> None:
    builder = LogBuilder()
    intent = builder.model_intent()
    detail = in_doubt_detail(intent)
    assert "model_call" in detail
    assert repr(f"{RUN}:0:model") in detail


def test_result_ids() -> None:
    assert model_result_id("r", 3) == "r:3:model"
    assert action_result_id("r", 0) == "r:0:action"


def test_valid_step_count() -> None:
    steps = tuple(
        _step_record(RUN, i, kind)
        for i, kind in enumerate(["action", "refused", "invalid", "action", "env_fault"])
    )
    assert valid_step_count(steps) == 2
    assert valid_step_count(()) == 0


# -- corrupt logs -------------------------------------------------------------------------


def _full() -> list[Record]:
    """A complete two-step log: indices 0 start, 1-5 step 0, 6-10 step 1, 11 end."""
    return build_log(RUN, ["action", "action"], end=StopReason.STEP_LIMIT)


def _replace(records: list[Record], index: int, **changes: Any) -> list[Record]:
    out = list(records)
    out[index] = dataclasses.replace(out[index], **changes)  # type: ignore[type-var]
    return out


def _corrupt_cases() -> list[Any]:
    full = _full()
    one_step_open = build_log(RUN, ["action"], end=None)
    return [
        pytest.param(full[1:], 0, id="first-record-not-run-started"),
        pytest.param([full[0], full[0], *full[1:]], 1, id="second-run-started"),
        pytest.param(
            [*full[:6], RunStarted(run_id=RUN, snapshot={}), *full[6:]],
            6,
            id="run-started-mid-log",
        ),
        pytest.param(_replace(full, 3, run_id="other"), 3, id="record-of-another-run"),
        pytest.param(_replace(full, 0, run_id="other"), 0, id="start-of-another-run"),
        pytest.param([*full, full[-1]], 12, id="second-end-after-final-end"),
        pytest.param([*build_log(RUN, ["final"]), *full[6:8]], 5, id="intent-after-final-end"),
        pytest.param(_replace(full, 10, step=2), 10, id="step-record-skips-a-number"),
        pytest.param(_replace(full, 5, step=1), 5, id="step-record-ahead"),
        pytest.param(full[:1] + full[2:], 1, id="result-without-intent"),
        pytest.param([*full[:3], full[2], *full[3:]], 3, id="second-result-for-one-intent"),
        pytest.param(
            [
                *full[:3],
                Result(
                    run_id=RUN, result_id=f"{RUN}:0:model", kind=IntentKind.ACTION, payload=None
                ),
            ],
            3,
            id="result-of-the-wrong-kind",
        ),
        pytest.param(full[:1] + full[3:], 1, id="action-intent-before-model-result"),
        pytest.param(full[:2] + full[3:], 2, id="action-intent-while-model-intent-open"),
        pytest.param(_replace(full, 1, result_id=f"{RUN}:0:action"), 1, id="model-intent-wrong-id"),
        pytest.param(
            _replace(full, 3, result_id=f"{RUN}:1:action"), 3, id="action-intent-wrong-id"
        ),
        pytest.param(
            _replace(full, 1, result_id="other:0:model"), 1, id="model-intent-other-run-id"
        ),
        pytest.param(_replace(full, 6, step=0, call_index=0), 6, id="intent-for-a-past-step"),
        pytest.param(_replace(full, 1, call_index=1), 1, id="intent-wrong-call-index"),
        pytest.param([*full[:5], *full[6:]], 5, id="action-result-followed-by-next-intent"),
        pytest.param([*one_step_open[:5], full[-1]], 5, id="end-between-action-result-and-step"),
        pytest.param(one_step_open[:5], 4, id="action-result-not-followed-by-its-step"),
        pytest.param([*full[:4], full[5]], 4, id="step-record-while-action-intent-open"),
        pytest.param([*full[:2], full[5]], 2, id="step-record-without-model-result"),
        pytest.param(_replace(full, 11, steps=3), 11, id="end-counts-too-many-steps"),
        pytest.param(_replace(full, 11, steps=1), 11, id="end-counts-too-few-steps"),
        pytest.param([*full[:3], full[1]], 3, id="second-model-call-in-one-step"),
        pytest.param([*full[:6], full[1]], 6, id="model-intent-of-the-finished-step"),
    ]


@pytest.mark.parametrize(("records", "bad_index"), _corrupt_cases())
def test_corrupt_log(records: list[Record], bad_index: int) -> None:
    with pytest.raises(CorruptLog) as caught:
        plan_of(records)
    error = caught.value
    assert error.location == f"record {bad_index}"
    assert error.run_id == RUN
    assert f"record {bad_index}" in str(error)
    assert repr(RUN) in str(error)


def test_log_of_another_run_id_is_corrupt_at_its_first_record() -> None:
    records = build_log("run-2", ["action"])
    with pytest.raises(CorruptLog) as caught:
        plan_of(records, run_id=RUN)
    assert caught.value.location == "record 0"
    assert caught.value.run_id == RUN


def test_every_corrupt_case_is_valid_before_the_bad_record() -> None:
    """Each mutated log reads fine up to (not including) its bad record, so the cases
    above fail for the reason their ids give, not for an earlier one."""
    for case in _corrupt_cases():
        records, bad_index = case.values
        if bad_index == 0:
            continue
        before = records[:bad_index]
        if isinstance(before[-1], Result) and before[-1].kind is IntentKind.ACTION:
            # The prefix itself is cut inside write_step: its only problem is that.
            with pytest.raises(CorruptLog, match="not followed by its step record"):
                plan_of(before)
        else:
            plan_of(before)


# -- identity_differences -----------------------------------------------------------------


def test_equal_snapshots_have_no_difference() -> None:
    snapshot: dict[str, JSONValue] = {"a": 1, "b": {"x": [1, 2]}, "c": None}
    assert identity_differences(snapshot, dict(snapshot)) == ()
    assert identity_differences({}, {}) == ()


def test_one_differing_key() -> None:
    recorded: dict[str, JSONValue] = {"budget.max_steps": 10, "model.name": "m"}
    current: dict[str, JSONValue] = {"budget.max_steps": 12, "model.name": "m"}
    assert identity_differences(recorded, current) == (("budget.max_steps", 10, 12),)


def test_key_missing_on_either_side_reads_none() -> None:
    assert identity_differences({"a": 1, "b": 2}, {"a": 1}) == (("b", 2, None),)
    assert identity_differences({"a": 1}, {"a": 1, "b": 2}) == (("b", None, 2),)


def test_key_missing_differs_from_key_with_null() -> None:
    assert identity_differences({"b": None}, {}) == (("b", None, None),)


def test_tuple_equals_list() -> None:
    assert identity_differences({"a": [1, [2, 3]]}, {"a": (1, (2, 3))}) == ()  # type: ignore[dict-item]


def test_nested_key_order_does_not_matter() -> None:
    assert identity_differences({"a": {"x": 1, "y": 2}}, {"a": {"y": 2, "x": 1}}) == ()


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param(1, 1.0, id="int-float"),
        pytest.param(1, True, id="int-bool"),
        pytest.param(1.0, True, id="float-bool"),
        pytest.param(0, False, id="zero-false"),
        pytest.param("1", 1, id="str-int"),
        pytest.param([1], [1.0], id="nested-int-float"),
        pytest.param({"k": 1}, {"k": True}, id="nested-int-bool"),
    ],
)
def test_numbers_of_different_types_differ(before: JSONValue, after: JSONValue) -> None:
    assert identity_differences({"k": before}, {"k": after}) == (("k", before, after),)


def test_differences_are_sorted_by_key() -> None:
    recorded: dict[str, JSONValue] = {"z": 1, "b": 1, "m": 1, "same": 0}
    current: dict[str, JSONValue] = {"a": 2, "z": 2, "m": 2, "same": 0}
    assert identity_differences(recorded, current) == (
        ("a", None, 2),
        ("b", 1, None),
        ("m", 1, 2),
        ("z", 1, 2),
    )


# -- property: every prefix of every valid log --------------------------------------------

Interruption = Literal["none", "crash", "cancel"]
CUT_POINTS = ("model_intent", "model_result", "action_intent", "after_step")


def _interrupt(builder: LogBuilder, how: Interruption, open_intent: Intent | None) -> bool:
    """Crash or cancel here (``how``), then resume; True if the resume ended in doubt.

    A crash leaves no record; a cancellation leaves a CANCELLED end. Either way the
    resumed run either ends IN_DOUBT (an open intent that may not be replayed) or goes
    on writing exactly what an uninterrupted run would have written.
    """
    if how == "none":
        return False
    if how == "cancel":
        builder.end(StopReason.CANCELLED, detail="the run was cancelled")
    if open_intent is not None and open_intent.replay is Replay.NEVER:
        builder.end(StopReason.IN_DOUBT, detail=in_doubt_detail(open_intent))
        return True
    return False


@st.composite
def valid_logs(draw: st.DrawFn) -> LogBuilder:
    """A log the library could have written, crashes and cancellations included."""
    builder = LogBuilder(model_replay=draw(st.sampled_from(Replay)))
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(STEP_KINDS))
        replay = draw(st.sampled_from(Replay))
        how: Interruption = draw(st.sampled_from(["none", "none", "crash", "cancel"]))
        where = draw(st.sampled_from(CUT_POINTS))
        at: dict[str, Interruption] = {p: how if p == where else "none" for p in CUT_POINTS}
        if _interrupt(builder, at["model_intent"], builder.model_intent()):
            return builder
        builder.model_result(kind)
        if _interrupt(builder, at["model_result"], None):
            return builder
        if kind in WITH_ACTION_INTENT and _interrupt(
            builder, at["action_intent"], builder.action_intent(replay)
        ):
            return builder
        builder.step_record(kind)
        _interrupt(builder, at["after_step"], None)
        if kind in STOPPING_KINDS:
            break
    ending = draw(st.sampled_from(["unended", "ended", "cancelled", "cancelled-then-ended"]))
    if ending in ("cancelled", "cancelled-then-ended"):
        builder.end(StopReason.CANCELLED, detail="the run was cancelled")
    if ending in ("ended", "cancelled-then-ended"):
        builder.end(builder.stop_reason(), detail="done")
    return builder


def _open_intents(records: Sequence[Record]) -> list[Intent]:
    answered = {r.result_id for r in records if isinstance(r, Result)}
    return [r for r in records if isinstance(r, Intent) and r.result_id not in answered]


@given(valid_logs())
def test_every_prefix_of_a_valid_log_reads(builder: LogBuilder) -> None:
    writes = builder.writes
    for cut in range(len(writes) + 1):
        records = [record for write in writes[:cut] for record in write]
        plan = plan_of(records)  # never raises

        if not records:
            assert plan.state is RecoveryState.FRESH
            continue
        assert plan.state is not RecoveryState.FRESH
        assert plan.started == records[0]

        steps = steps_in(records)
        assert plan.steps == steps
        assert len(plan.steps) == sum(isinstance(r, StepRecord) for r in records)

        open_intents = _open_intents(records)
        assert len(open_intents) <= 1
        open_intent = open_intents[-1] if open_intents else None
        assert plan.open_intent == open_intent

        finished = any(isinstance(r, RunEnded) and r.is_final for r in records)
        assert finished == (plan.state is RecoveryState.FINISHED)
        in_doubt = open_intent is not None and open_intent.replay is Replay.NEVER and not finished
        assert in_doubt == (plan.state is RecoveryState.IN_DOUBT)
        if not finished and not in_doubt:
            assert plan.state is RecoveryState.RESUMABLE
        if finished:
            last = records[-1]
            assert isinstance(last, RunEnded)
            assert plan.ended == last
            assert recorded_result(plan).step_count == len(steps)


@given(valid_logs())
def test_splitting_write_step_is_always_corrupt(builder: LogBuilder) -> None:
    """A log cut inside the atomic ``write_step`` (action result without its step
    record) is never resumed on a guess."""
    for cut, write in enumerate(builder.writes):
        if len(write) != 2:
            continue
        records = [r for w in builder.writes[:cut] for r in w] + [write[0]]
        with pytest.raises(CorruptLog) as caught:
            plan_of(records)
        assert caught.value.location == f"record {len(records) - 1}"


# -- a fork's start record holds its first steps -----------------------------------------------


def _inherited(run_id: str, count: int) -> tuple[StepRecord, ...]:
    return tuple(
        StepRecord(
            run_id=run_id,
            step=index,
            call_id=None,
            model_output="x",
            reasoning=None,
            decision=DecisionKind.FINAL if index == count - 1 else DecisionKind.INVALID,
            history_text="x",
            action_text=None,
            observation=None,
            observation_synthesized=False,
            action_status=None,
            done=False,
            truncated_chars=0,
            error=None,
            final_answer=None,
            duration_s=0.1,
        )
        for index in range(count)
    )


def _fork_start(**changes: Any) -> RunStarted:
    fields: dict[str, Any] = {
        "run_id": RUN,
        "snapshot": SNAPSHOT,
        "forked_from": "source",
        "forked_at_step": 2,
        "inherited_sha256": "ab" * 32,
        "inherited": _inherited(RUN, 2),
    }
    return RunStarted(**{**fields, **changes})


def test_a_fork_s_inherited_steps_are_its_first_steps() -> None:
    plan = read_plan(RunLog(run_id=RUN, records=(_fork_start(),)))
    assert plan.state is RecoveryState.RESUMABLE
    assert [step.step for step in plan.steps] == [0, 1]
    at_zero = _fork_start(forked_at_step=0, inherited=None)
    assert read_plan(RunLog(run_id=RUN, records=(at_zero,))).steps == ()
    # The next step of a fork is its step at_step, with that step's result ids.
    model = Intent(
        run_id=RUN,
        result_id=model_result_id(RUN, 2),
        kind=IntentKind.MODEL_CALL,
        step=2,
        call_index=2,
        replay=Replay.ALLOWED,
        payload={},
    )
    assert read_plan(RunLog(run_id=RUN, records=(_fork_start(), model))).open_intent == model


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"forked_from": None}, "must name its source, its step and its digest"),
        ({"inherited_sha256": None}, "must name its source, its step and its digest"),
        ({"forked_at_step": 3}, "a fork at step 3 whose start record holds 2 inherited steps"),
        ({"inherited": _inherited("other", 2)}, "inherited step 0 is step 0 of run 'other'"),
        (
            {"inherited": tuple(reversed(_inherited(RUN, 2)))},
            "inherited step 0 is step 1 of run 'run-1'",
        ),
        (
            {"forked_from": None, "forked_at_step": None, "inherited_sha256": None},
            "must name its source, its step and its digest",
        ),
    ],
)
def test_a_fork_s_start_record_that_does_not_add_up_is_corrupt(
    changes: dict[str, Any], problem: str
) -> None:
    with pytest.raises(CorruptLog, match=problem) as info:
        read_plan(RunLog(run_id=RUN, records=(_fork_start(**changes),)))
    assert info.value.location == "record 0"


# -- amendments (issue 48): the snapshot a run goes on under ------------------------------


def _amended(step: int, changes: dict[str, JSONValue], run_id: str = RUN) -> Amended:
    return Amended(run_id=run_id, step=step, by="ops", reason="release 2.4", changes=changes)


def test_a_log_without_amendments_goes_on_under_its_start_snapshot() -> None:
    builder = LogBuilder()
    builder.step("action")
    plan = read_plan(builder.log())
    assert plan.snapshot == SNAPSHOT and plan.amendments == ()
    assert snapshot_at(plan, 1) == SNAPSHOT


def test_amendments_fold_into_the_snapshot_in_log_order() -> None:
    builder = LogBuilder()
    first = _amended(0, {"model.name": {"recorded": "scripted", "amended": "v2"}})
    builder.writes.append((first,))
    builder.step("action")
    second = _amended(
        1,
        {
            "model.name": {"recorded": "v2", "amended": "v3"},
            "binding.region": {"amended": "eu"},
            "budget.max_steps": {"recorded": 10},
        },
    )
    builder.writes.append((second,))
    builder.step("action")
    plan = read_plan(builder.log())
    assert plan.state is RecoveryState.RESUMABLE and len(plan.steps) == 2
    assert plan.amendments == (first, second)
    assert plan.snapshot == {"model.name": "v3", "binding.region": "eu"}
    assert snapshot_at(plan, 0) == {**SNAPSHOT, "model.name": "v2"}
    assert snapshot_at(plan, 1) == plan.snapshot
    assert second.differences == (
        ("binding.region", None, "eu"),
        ("budget.max_steps", 10, None),
        ("model.name", "v2", "v3"),
    )


def test_an_amendment_leaves_a_paused_run_paused() -> None:
    builder = LogBuilder()
    builder.step("action")
    builder.end(StopReason.CANCELLED)
    builder.writes.append((_amended(1, {"model.name": {"recorded": "scripted", "amended": "x"}}),))
    plan = read_plan(builder.log())
    assert plan.ended is not None and plan.ended.stop_reason is StopReason.CANCELLED
    assert plan.snapshot["model.name"] == "x"


@pytest.mark.parametrize(
    ("changes", "step", "problem"),
    [
        ({"model.name": {"recorded": "other", "amended": "x"}}, 0, "does not start from"),
        ({"model.name": {"amended": "x"}}, 0, "does not start from"),
        ({"binding.new": {"recorded": "a", "amended": "x"}}, 0, "does not start from"),
        ({"model.name": {"recorded": "scripted", "amended": "scripted"}}, 0, "does not change"),
        ({"model.name": "x"}, 0, "is not an object"),
        ({"model.name": {"was": "scripted"}}, 0, "is not an object"),
        ({}, 0, "changes nothing"),
        ({"model.name": {"recorded": "scripted", "amended": "x"}}, 3, "at step 3 where step 0"),
    ],
)
def test_an_amendment_that_does_not_chain_from_the_snapshot_is_corrupt(
    changes: dict[str, JSONValue], step: int, problem: str
) -> None:
    builder = LogBuilder()
    builder.writes.append((_amended(step, changes),))
    with pytest.raises(CorruptLog, match=problem) as raised:
        read_plan(builder.log())
    assert raised.value.location == "record 1"


def test_nothing_follows_a_final_end_not_even_an_amendment() -> None:
    builder = LogBuilder()
    builder.step("final")
    builder.end(StopReason.FINAL_ANSWER)
    builder.writes.append((_amended(1, {"model.name": {"recorded": "scripted", "amended": "x"}}),))
    with pytest.raises(CorruptLog, match="after the end record"):
        read_plan(builder.log())
