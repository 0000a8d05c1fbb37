"""Faults at the seams: a model, an executor, an interpreter or an event sink misbehaving.

What each kind of fault must lead to (SPEC sections 4 and 5.5, research-wiki/0003):

* model client raises or returns something of the wrong type: ``MODEL_FAILURE``, the
  error recorded as ``"ExceptionClass: message"`` (``TypeError: ...`` for a wrong type);
* executor raises or returns something of the wrong type: ``ENV_FAILURE``, the detail
  being the ``env_fault`` text around ``"ExceptionClass: message"``;
* interpreter raises or returns a wrong type: the exception propagates out of ``run``
  (``TypeError`` for a wrong type), no step record is written for that step, the log
  stays resumable and ``resume`` with a fixed interpreter finishes the run;
* a model call, an action or an event sink that never returns: the caller's deadline
  cancels the run, the log ends ``CANCELLED``, the cancellation propagates, and a later
  ``resume`` with a working seam finishes the run.

An event sink must not block: the kernel awaits every ``emit``, so a sink that hangs
holds the run until the caller's deadline cancels it. The end record is written before
the final ``RUN_ENDED`` event, so even a sink that also hangs on that event costs at most
``cancel_grace_s`` more, and the log still ends ``CANCELLED``.

In every case the log reads back (``read_log`` and ``_recovery.read_plan`` do not raise).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, same_outcome, tool_call
from kit.store import Stores
from polyloop import (
    Action,
    ActionOutcome,
    ActionStatus,
    Event,
    EventKind,
    FinalAnswer,
    IntentKind,
    InvalidDecision,
    ModelCall,
    ModelReply,
    Replay,
    Result,
    RunEnded,
    RunResult,
    StepRecord,
    StopReason,
    ToolRegistry,
    resume,
    run,
)
from polyloop._recovery import RecoveryState, read_plan
from polyloop.stores import MemoryStore
from polyloop.testing import JsonActionInterpreter

pytestmark = pytest.mark.anyio

SCRIPT = [tool_call("double", n=2), answer("4")]
DEADLINE_S = 0.2
GRACE_S = 1.0


# -- stores and seams --------------------------------------------------------------------------


async def _stores(kind: str, tmp_path: Path) -> AsyncIterator[Stores]:
    kit = Stores(kind, tmp_path)
    try:
        yield kit
    finally:
        await kit.close_all()


@pytest.fixture(params=["memory", "jsonl"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    """A volatile and a durable store: enough to show that a fault's log reads back."""
    async for kit in _stores(request.param, tmp_path):
        yield kit


@pytest.fixture(params=["memory", "jsonl", "sqlite"])
async def cancel_stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    """The stores a cancelled run is checked on (the end record is written in a thread)."""
    async for kit in _stores(request.param, tmp_path):
        yield kit


Fault = Callable[[], Awaitable[Any]]


class SeamModel:
    """Answers ``SCRIPT`` by call index; call ``at`` is answered by ``fault`` instead.

    Its parameters do not depend on the fault, so a run started with a faulty model can be
    resumed with a working one.
    """

    def __init__(self, fault: Fault | None = None, *, at: int = 0) -> None:
        self.fault = fault
        self.at = at
        self.calls: list[int] = []

    def parameters(self) -> dict[str, Any]:
        return {"kind": "seam-test-model"}

    async def call(self, call: ModelCall) -> ModelReply:
        self.calls.append(call.call_index)
        if self.fault is not None and call.call_index == self.at:
            reply: ModelReply = await self.fault()
            return reply
        await anyio.lowlevel.checkpoint()
        return ModelReply(
            call_id=f"c{call.call_index}", content=SCRIPT[call.call_index], reasoning=None
        )


class SeamExecutor:
    """Runs actions through ``tools``, except that ``fault`` answers every execution."""

    def __init__(
        self, tools: ToolRegistry, fault: Fault | None = None, *, replay: Replay = Replay.ALLOWED
    ) -> None:
        self.inner = tools.executor()
        self.fault = fault
        self.policy = replay
        self.executions: list[str] = []

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        self.executions.append(result_id)
        if self.fault is not None:
            outcome: ActionOutcome = await self.fault()
            return outcome
        return await self.inner.execute(action, result_id=result_id)

    def replay(self, action: Action) -> Replay:
        return self.policy


def raising(exc: BaseException) -> Fault:
    async def fault() -> Any:
        await anyio.lowlevel.checkpoint()
        raise exc

    return fault


def returning(value: Any) -> Fault:
    async def fault() -> Any:
        await anyio.lowlevel.checkpoint()
        return value

    return fault


async def hanging() -> Any:
    await anyio.sleep_forever()


class Hang:
    """A fault that hangs forever, and notes when the run reached it."""

    def __init__(self) -> None:
        self.reached = anyio.Event()

    async def __call__(self) -> Any:
        self.reached.set()
        await anyio.sleep_forever()


async def under_deadline(
    kind: str, drive: Callable[[], Awaitable[Any]], *, armed: anyio.Event | None = None
) -> float:
    """Drive a run under the caller's deadline; check the cancellation came out of it.

    With ``armed``, the deadline starts when that event is set (the run reached the seam
    under test), not when the run starts: a slow start on a busy machine must not let the
    deadline fire before the seam, which is not what these tests are about.
    Returns the seconds the run took to give up once the deadline counted.
    """
    finished: list[bool] = []
    began = [time.monotonic()]

    async def noted() -> None:
        await drive()
        finished.append(True)

    async def arm(scope: anyio.CancelScope, event: anyio.Event) -> None:
        with anyio.move_on_after(60):  # a run that never gets there still ends
            await event.wait()
        began[0] = time.monotonic()
        scope.deadline = anyio.current_time() + DEADLINE_S

    async def within(
        deadline: AbstractContextManager[anyio.CancelScope], group: anyio.abc.TaskGroup
    ) -> anyio.CancelScope:
        with deadline as scope:
            if armed is not None:
                group.start_soon(arm, scope, armed)
            await noted()
        return scope

    delay = None if armed is not None else DEADLINE_S
    async with anyio.create_task_group() as group:
        if kind == "fail_after":
            with pytest.raises(TimeoutError):
                await within(anyio.fail_after(delay), group)
        else:
            scope = await within(anyio.move_on_after(delay), group)
            assert scope.cancelled_caught, "the run swallowed the cancellation"
    assert not finished, "the run returned instead of being cancelled"
    return time.monotonic() - began[0]


async def reads_back(store: Any, run_id: str = "r") -> tuple[list[Any], RecoveryState]:
    log = await store.read_log(run_id)
    return list(log.records), read_plan(log).state


async def uninterrupted() -> RunResult:
    tools = make_tools(Ledger())
    return await run(
        definition(MemoryStore(), model=SeamModel()),
        request("r", tools, executor=SeamExecutor(tools)),
    )


# -- the model client --------------------------------------------------------------------------


class GatewayExploded(Exception):
    """An exception class of the caller's own."""


MODEL_ERRORS = {
    "runtime": RuntimeError("model down"),
    "timeout": TimeoutError("gateway timed out"),
    "connection-reset": ConnectionResetError("peer reset"),
    "key": KeyError("choices"),
    "empty-message": ValueError(),
    "custom-class": GatewayExploded("quota exhausted"),
    "exception-group": ExceptionGroup("several", [ValueError("a"), OSError("b")]),
    "surrogate-message": RuntimeError("bad \ud800 bytes"),
    "long-message": RuntimeError("m" * 100_000),
}


@pytest.mark.parametrize("exc", list(MODEL_ERRORS.values()), ids=list(MODEL_ERRORS))
async def test_a_raising_model_ends_the_run_with_model_failure(
    stores: Stores, exc: Exception
) -> None:
    store = stores.open()
    tools = make_tools(Ledger())
    result = await run(definition(store, model=SeamModel(raising(exc))), request("r", tools))
    expected = f"{type(exc).__name__}: {exc}"
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail == expected
    (step,) = result.steps
    assert step.error == expected
    assert (step.call_id, step.model_output, step.action_status) == (None, "", None)
    records, state = await reads_back(store)
    assert state is RecoveryState.FINISHED
    model_result = records[2]
    assert isinstance(model_result, Result) and model_result.payload == {"error": expected}
    again = await resume(
        definition(await stores.reopen(store), model=SeamModel()), request("r", tools)
    )
    assert same_outcome(result, again)


class UnprintableError(Exception):
    """An exception whose message cannot be produced (a broken ``__str__``)."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


async def test_a_model_exception_with_a_broken_str_is_still_a_model_failure() -> None:
    store = MemoryStore()
    result = await run(
        definition(store, model=SeamModel(raising(UnprintableError()))),
        request("r", make_tools(Ledger())),
    )
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and result.detail.startswith("UnprintableError")
    _, state = await reads_back(store)
    assert state is RecoveryState.FINISHED


WRONG_REPLIES = {
    "a-str": "just text",
    "a-dict": {"content": "x", "call_id": None, "reasoning": None},
    "none": None,
    "int-content": ModelReply(call_id="c", content=5, reasoning=None),  # type: ignore[arg-type]
    "bytes-content": ModelReply(call_id="c", content=b"x", reasoning=None),  # type: ignore[arg-type]
    "none-content": ModelReply(call_id="c", content=None, reasoning=None),  # type: ignore[arg-type]
    "int-call-id": ModelReply(call_id=7, content="x", reasoning=None),  # type: ignore[arg-type]
    "list-reasoning": ModelReply(call_id="c", content="x", reasoning=["r"]),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("reply", list(WRONG_REPLIES.values()), ids=list(WRONG_REPLIES))
async def test_a_model_returning_a_wrong_type_is_a_model_failure(
    stores: Stores, reply: Any
) -> None:
    store = stores.open()
    tools = make_tools(Ledger())
    result = await run(definition(store, model=SeamModel(returning(reply))), request("r", tools))
    assert result.stop_reason is StopReason.MODEL_FAILURE
    assert result.detail is not None and result.detail.startswith("TypeError: ")
    assert result.steps[0].error == result.detail
    assert result.steps[0].model_output == ""
    _, state = await reads_back(store)
    assert state is RecoveryState.FINISHED
    again = await resume(
        definition(await stores.reopen(store), model=SeamModel()), request("r", tools)
    )
    assert same_outcome(result, again)


@pytest.mark.parametrize("deadline", ["fail_after", "move_on_after"])
async def test_a_hanging_model_is_cancelled_by_the_callers_deadline_and_resumes(
    cancel_stores: Stores, deadline: str
) -> None:
    store = cancel_stores.open()
    tools = make_tools(Ledger())
    hang = Hang()
    hung = SeamModel(hang)
    tasks_before = len(anyio.get_running_tasks())

    async def drive() -> None:
        await run(
            definition(store, model=hung),
            request("r", tools, model_replay=Replay.ALLOWED, cancel_grace_s=GRACE_S),
        )

    elapsed = await under_deadline(deadline, drive, armed=hang.reached)
    assert elapsed < DEADLINE_S + GRACE_S
    assert len(anyio.get_running_tasks()) == tasks_before
    records, state = await reads_back(store)
    assert isinstance(records[-1], RunEnded)
    assert records[-1].stop_reason is StopReason.CANCELLED
    assert state is RecoveryState.RESUMABLE

    working = SeamModel()
    later = await resume(
        definition(await cancel_stores.reopen(store), model=working),
        request("r", tools, model_replay=Replay.ALLOWED, cancel_grace_s=GRACE_S),
    )
    assert later.stop_reason is StopReason.FINAL_ANSWER and later.final_answer == "4"
    assert working.calls == [0, 1]  # the interrupted call was made again, under its id
    assert same_outcome(later, await uninterrupted())


async def test_a_hanging_model_call_that_may_not_be_repeated_resumes_in_doubt() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    await under_deadline(
        "move_on_after",
        lambda: run(definition(store, model=SeamModel(hanging)), request("r", tools)),
    )
    working = SeamModel()
    later = await resume(definition(store, model=working), request("r", tools))
    assert later.stop_reason is StopReason.IN_DOUBT
    assert later.detail is not None and "r:0:model" in later.detail
    assert working.calls == []


# -- the executor ------------------------------------------------------------------------------

EXECUTOR_ERRORS = {
    "runtime": RuntimeError("sandbox crashed"),
    "os": OSError("container gone"),
    "key": KeyError("stdout"),
    "custom-class": GatewayExploded("no quota"),
    "exception-group": ExceptionGroup("several", [ValueError("a")]),
}


@pytest.mark.parametrize("exc", list(EXECUTOR_ERRORS.values()), ids=list(EXECUTOR_ERRORS))
async def test_a_raising_executor_ends_the_run_with_env_failure(
    stores: Stores, exc: Exception
) -> None:
    store = stores.open()
    ledger = Ledger()
    tools = make_tools(ledger)
    result = await run(
        definition(store, model=SeamModel()),
        request("r", tools, executor=SeamExecutor(tools, raising(exc))),
    )
    expected = f"{type(exc).__name__}: {exc}"
    assert result.stop_reason is StopReason.ENV_FAILURE
    assert result.detail == f"Fault: {expected}"
    (step,) = result.steps
    assert step.action_status is ActionStatus.ENV_FAULT
    assert step.observation == f"Fault: {expected}" and step.observation_synthesized
    records, state = await reads_back(store)
    assert state is RecoveryState.FINISHED
    (outcome,) = [r for r in records if isinstance(r, Result) and r.kind is IntentKind.ACTION]
    assert isinstance(outcome.payload, dict)
    assert outcome.payload["status"] == "env_fault"
    assert outcome.payload["observation"] == expected
    assert ledger.calls == []
    again = await resume(
        definition(await stores.reopen(store), model=SeamModel()),
        request("r", tools, executor=SeamExecutor(tools)),
    )
    assert same_outcome(result, again)


async def test_an_executor_exception_with_a_broken_str_is_still_an_env_failure() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    result = await run(
        definition(store, model=SeamModel()),
        request("r", tools, executor=SeamExecutor(tools, raising(UnprintableError()))),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE
    assert result.detail is not None and "UnprintableError" in result.detail
    _, state = await reads_back(store)
    assert state is RecoveryState.FINISHED


def outcome(**changes: Any) -> ActionOutcome:
    fields: dict[str, Any] = {
        "status": ActionStatus.EXECUTED,
        "observation": "ok",
        "synthesized": False,
        "done": False,
        "truncated_chars": 0,
    }
    fields.update(changes)
    return ActionOutcome(**fields)


WRONG_OUTCOMES = {
    "none": (None, "NoneType"),
    "a-str": ("ok", "str"),
    "a-dict": ({"status": "executed", "observation": "ok"}, "dict"),
    "done-is-1": (outcome(done=1), "done"),
    "done-is-none": (outcome(done=None), "done"),
    "negative-truncated-chars": (outcome(truncated_chars=-1), "truncated_chars"),
    "bool-truncated-chars": (outcome(truncated_chars=True), "truncated_chars"),
    "float-truncated-chars": (outcome(truncated_chars=1.5), "truncated_chars"),
    "status-as-text": (outcome(status="executed"), "status"),
    "observation-none": (outcome(observation=None), "observation"),
    "synthesized-as-text": (outcome(synthesized="no"), "synthesized"),
}


@pytest.mark.parametrize(
    ("value", "named"), list(WRONG_OUTCOMES.values()), ids=list(WRONG_OUTCOMES)
)
async def test_an_executor_returning_a_wrong_type_is_an_env_failure(
    stores: Stores, value: Any, named: str
) -> None:
    store = stores.open()
    tools = make_tools(Ledger())
    result = await run(
        definition(store, model=SeamModel()),
        request("r", tools, executor=SeamExecutor(tools, returning(value))),
    )
    assert result.stop_reason is StopReason.ENV_FAILURE
    assert result.detail is not None and result.detail.startswith("Fault: TypeError: ")
    assert named in result.detail
    step = result.steps[0]
    assert step.action_status is ActionStatus.ENV_FAULT
    assert (step.done, step.truncated_chars) == (False, 0)  # nothing of the bad outcome kept
    _, state = await reads_back(store)
    assert state is RecoveryState.FINISHED
    again = await resume(
        definition(await stores.reopen(store), model=SeamModel()),
        request("r", tools, executor=SeamExecutor(tools)),
    )
    assert same_outcome(result, again)


@pytest.mark.parametrize("deadline", ["fail_after", "move_on_after"])
async def test_a_hanging_executor_is_cancelled_by_the_callers_deadline_and_resumes(
    cancel_stores: Stores, deadline: str
) -> None:
    store = cancel_stores.open()
    tools = make_tools(Ledger())
    hang = Hang()
    hung = SeamExecutor(tools, hang)

    async def drive() -> None:
        await run(
            definition(store, model=SeamModel()),
            request("r", tools, executor=hung, cancel_grace_s=GRACE_S),
        )

    elapsed = await under_deadline(deadline, drive, armed=hang.reached)
    assert elapsed < DEADLINE_S + GRACE_S
    assert hung.executions == ["r:0:action"]
    records, state = await reads_back(store)
    assert isinstance(records[-1], RunEnded)
    assert records[-1].stop_reason is StopReason.CANCELLED
    assert state is RecoveryState.RESUMABLE  # the open action intent may be replayed

    working = SeamExecutor(tools)
    later = await resume(
        definition(await cancel_stores.reopen(store), model=SeamModel()),
        request("r", tools, executor=working, cancel_grace_s=GRACE_S),
    )
    assert later.stop_reason is StopReason.FINAL_ANSWER
    assert working.executions == ["r:0:action"]  # replayed under the announced id
    assert same_outcome(later, await uninterrupted())


async def test_a_hanging_action_that_may_not_be_repeated_resumes_in_doubt() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    await under_deadline(
        "move_on_after",
        lambda: run(
            definition(store, model=SeamModel()),
            request("r", tools, executor=SeamExecutor(tools, hanging, replay=Replay.NEVER)),
        ),
    )
    working = SeamExecutor(tools, replay=Replay.NEVER)
    later = await resume(
        definition(store, model=SeamModel()), request("r", tools, executor=working)
    )
    assert later.stop_reason is StopReason.IN_DOUBT
    assert later.detail is not None and "r:0:action" in later.detail
    assert working.executions == []


# -- the interpreter ---------------------------------------------------------------------------


class BrokenAtAnswer(JsonActionInterpreter):
    """The example interpreter, except on the reply that answers: there ``fault`` decides.

    It reports the example interpreter's parameters, so the run resumes with the fixed
    (plain) interpreter under the same identity.
    """

    def __init__(self, fault: Callable[[ModelReply], Any]) -> None:
        self.fault = fault

    def interpret(self, reply: ModelReply) -> Any:
        if reply.content == SCRIPT[1]:
            return self.fault(reply)
        return super().interpret(reply)


class InterpreterBug(Exception):
    """A bug in the caller's interpreter."""


def raise_(exc: Exception) -> Callable[[ModelReply], Any]:
    def fault(reply: ModelReply) -> Any:
        raise exc

    return fault


INTERPRETER_FAULTS: dict[str, tuple[Callable[[ModelReply], Any], type[Exception]]] = {
    "raises-value-error": (raise_(ValueError("cannot parse")), ValueError),
    "raises-key-error": (raise_(KeyError("tool")), KeyError),
    "raises-custom": (raise_(InterpreterBug("oops")), InterpreterBug),
    "returns-none": (lambda reply: None, TypeError),
    "returns-a-str": (lambda reply: "4", TypeError),
    "returns-a-dict": (lambda reply: {"answer": "4"}, TypeError),
    "returns-the-reply": (lambda reply: reply, TypeError),
    "int-answer": (lambda reply: FinalAnswer(answer=4, history_text="x"), TypeError),  # type: ignore[arg-type]
    "none-history": (lambda reply: FinalAnswer(answer="4", history_text=None), TypeError),  # type: ignore[arg-type]
    "none-action-text": (
        lambda reply: Action(
            payload={"name": "double", "arguments": {"n": 1}},
            action_text=None,  # type: ignore[arg-type]
            history_text="x",
        ),
        TypeError,
    ),
    "bytes-feedback": (
        lambda reply: InvalidDecision(
            feedback=b"no",  # type: ignore[arg-type]
            history_text="x",
        ),
        TypeError,
    ),
}


@pytest.mark.parametrize(
    ("fault", "raises"), list(INTERPRETER_FAULTS.values()), ids=list(INTERPRETER_FAULTS)
)
async def test_a_faulty_interpreter_propagates_writes_no_step_and_resume_finishes(
    stores: Stores, fault: Callable[[ModelReply], Any], raises: type[Exception]
) -> None:
    store = stores.open()
    ledger = Ledger()
    tools = make_tools(ledger)
    with pytest.raises(raises):
        await run(
            definition(store, model=SeamModel(), interpreter=BrokenAtAnswer(fault)),
            request("r", tools),
        )
    records, state = await reads_back(store)
    assert state is RecoveryState.RESUMABLE
    assert [r.step for r in records if isinstance(r, StepRecord)] == [0]
    assert not any(isinstance(r, RunEnded) for r in records)
    last = records[-1]
    assert isinstance(last, Result) and last.result_id == "r:1:model"
    assert ledger.calls == [("double", "r:0:action")]

    model = SeamModel()
    fixed = await resume(
        definition(await stores.reopen(store), model=model, interpreter=JsonActionInterpreter()),
        request("r", tools),
    )
    assert fixed.stop_reason is StopReason.FINAL_ANSWER and fixed.final_answer == "4"
    assert model.calls == []  # the stored reply was interpreted again, not asked for again
    assert ledger.calls == [("double", "r:0:action")]
    assert same_outcome(fixed, await uninterrupted())


# -- the event sink ----------------------------------------------------------------------------


class HangingSink:
    """Hangs on the events ``hang_on`` accepts; its parameters never depend on that."""

    def __init__(self, hang_on: Callable[[Event], bool] = lambda event: False) -> None:
        self.hang_on = hang_on
        self.events: list[EventKind] = []

    def parameters(self) -> dict[str, Any]:
        return {"kind": "seam-test-sink"}

    async def emit(self, event: Event) -> None:
        self.events.append(event.kind)
        if self.hang_on(event):
            await anyio.sleep_forever()
        await anyio.lowlevel.checkpoint()


async def test_a_sink_that_hangs_on_a_step_is_cancelled_by_the_deadline() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    sink = HangingSink(lambda event: event.kind is EventKind.STEP_FINISHED)
    elapsed = await under_deadline(
        "move_on_after",
        lambda: run(
            definition(store, model=SeamModel(), events=sink),
            request("r", tools, cancel_grace_s=GRACE_S),
        ),
    )
    assert elapsed < DEADLINE_S + GRACE_S
    records, state = await reads_back(store)
    # The step landed before its event was emitted; the end record after the cancellation.
    assert [r.step for r in records if isinstance(r, StepRecord)] == [0]
    assert isinstance(records[-1], RunEnded)
    assert records[-1].stop_reason is StopReason.CANCELLED
    assert state is RecoveryState.RESUMABLE
    assert sink.events == [EventKind.RUN_STARTED, EventKind.STEP_FINISHED, EventKind.RUN_ENDED]

    later = await resume(
        definition(store, model=SeamModel(), events=HangingSink()),
        request("r", tools, cancel_grace_s=GRACE_S),
    )
    assert later.stop_reason is StopReason.FINAL_ANSWER
    assert same_outcome(later, await uninterrupted())


async def test_a_sink_that_always_hangs_costs_at_most_the_deadline_plus_the_grace() -> None:
    store = MemoryStore()
    tools = make_tools(Ledger())
    sink = HangingSink(lambda event: True)
    elapsed = await under_deadline(
        "fail_after",
        lambda: run(
            definition(store, model=SeamModel(), events=sink),
            request("r", tools, cancel_grace_s=GRACE_S),
        ),
    )
    # RUN_ENDED hangs too, inside the shielded grace: the grace bounds it.
    assert DEADLINE_S + GRACE_S * 0.9 <= elapsed < DEADLINE_S + GRACE_S + 2.0
    records, _ = await reads_back(store)
    assert [type(r).__name__ for r in records] == ["RunStarted", "RunEnded"]
    assert isinstance(records[-1], RunEnded)
    assert records[-1].stop_reason is StopReason.CANCELLED
    assert sink.events == [EventKind.RUN_STARTED, EventKind.RUN_ENDED]

    later = await resume(
        definition(store, model=SeamModel(), events=HangingSink()),
        request("r", tools, cancel_grace_s=GRACE_S),
    )
    assert later.stop_reason is StopReason.FINAL_ANSWER
    assert same_outcome(later, await uninterrupted())
