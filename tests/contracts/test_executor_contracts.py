"""The executors PolyLoop ships keep the action-executor contract: a registry's and the double."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from kit.replay import echo_log
from polyloop import Action, ActionExecutor, ActionOutcome, ActionStatus, Reconciled, Replay
from polyloop.testing import RecordedExecutor, ScriptedEnvironment
from polyloop.testing.executor_contract import ActionExecutorContract
from polyloop.tools import EnvironmentFault, ToolRegistry, ToolSpec
from polyloop.types import JSONValue


def call(name: str, **arguments: JSONValue) -> Action:
    return Action(
        payload={"name": name, "arguments": arguments},
        action_text=f"{name}({arguments})",
        history_text=f"call {name}",
    )


GOOD = call("echo", text="hello")
REFUSED = call("echo", text=3)  # the schema wants a string
FAULTING = call("broken")
TEXT_SCHEMA: dict[str, JSONValue] = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


class Tools:
    """A registry whose handlers note the result ids they are given."""

    def __init__(self, *, echo_waits: bool = False) -> None:
        self.result_ids: list[str] = []
        self._echo_waits = echo_waits

    async def echo(self, arguments: dict[str, JSONValue], *, result_id: str) -> str:
        self.result_ids.append(result_id)
        if self._echo_waits:
            await anyio.sleep_forever()
        return str(arguments["text"])

    async def probe(self, arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
        ran = result_id in self.result_ids
        return Reconciled(ran=ran, observation=str(arguments.get("text")))

    async def broken(self, arguments: dict[str, JSONValue], *, result_id: str) -> str:
        self.result_ids.append(result_id)
        raise EnvironmentFault("the sandbox is gone")

    def executor(self) -> ActionExecutor:
        specs = [
            ToolSpec(
                name="echo",
                description="Say the text back.",
                parameters=TEXT_SCHEMA,
                handler=self.echo,
                replay=Replay.ALLOWED,
                reconcile=self.probe,
            ),
            ToolSpec(
                name="broken",
                description="Fail as a broken environment does.",
                parameters={"type": "object"},
                handler=self.broken,
            ),
        ]
        return ToolRegistry(specs, max_observation_chars=1000).executor()


class TestRegistryExecutor(ActionExecutorContract):
    @pytest.fixture
    def tools(self) -> Tools:
        return Tools()

    @pytest.fixture
    def executor(self, tools: Tools) -> ActionExecutor:
        return tools.executor()

    @pytest.fixture
    def good_action(self) -> Action:
        return GOOD

    @pytest.fixture
    def refused_action(self) -> Action:
        return REFUSED

    @pytest.fixture
    def faulting_action(self) -> Action:
        return FAULTING

    @pytest.fixture
    def slow_executor(self) -> ActionExecutor:
        return Tools(echo_waits=True).executor()

    @pytest.fixture
    def seen_result_ids(self, tools: Tools) -> object:
        return lambda: tools.result_ids


def scripted_outcome(action: Action, step: int) -> ActionOutcome:
    """What a scripted environment answers, by the action's tool."""
    assert isinstance(action.payload, dict)
    status = {
        "echo": ActionStatus.EXECUTED,
        "broken": ActionStatus.ENV_FAULT,
    }.get(str(action.payload["name"]), ActionStatus.NOT_EXECUTED)
    return ActionOutcome(status=status, observation=f"step {step}", synthesized=False, done=False)


class TestScriptedEnvironment(ActionExecutorContract):
    @pytest.fixture
    def environment(self) -> ScriptedEnvironment:
        return ScriptedEnvironment(scripted_outcome, replay=Replay.ALLOWED)

    @pytest.fixture
    def executor(self, environment: ScriptedEnvironment) -> ActionExecutor:
        return environment

    @pytest.fixture
    def good_action(self) -> Action:
        return GOOD

    @pytest.fixture
    def refused_action(self) -> Action:
        return call("unknown")

    @pytest.fixture
    def faulting_action(self) -> Action:
        return FAULTING

    @pytest.fixture
    def slow_executor(self) -> ActionExecutor:
        return ScriptedEnvironment(scripted_outcome, delay=60)

    @pytest.fixture
    def seen_result_ids(self, environment: ScriptedEnvironment) -> object:
        return lambda: environment.executions


class TestRecordedExecutor(ActionExecutorContract):
    """Answering from a recorded run that performed ``GOOD`` at steps 0 to 3; any other
    action is one it did not perform, and so refuses."""

    @pytest.fixture
    async def log(self) -> object:
        log, _ = await echo_log(4)
        return log

    @pytest.fixture
    def recorded(self, log: Any) -> RecordedExecutor:
        return RecordedExecutor.from_log(log)

    @pytest.fixture
    def executor(self, recorded: RecordedExecutor) -> ActionExecutor:
        return recorded

    @pytest.fixture
    def good_action(self) -> Action:
        return GOOD

    @pytest.fixture
    def refused_action(self) -> Action:
        return REFUSED

    @pytest.fixture
    def slow_executor(self, log: Any) -> ActionExecutor:
        return RecordedExecutor.from_log(log, delay=60)

    @pytest.fixture
    def seen_result_ids(self, recorded: RecordedExecutor) -> object:
        return lambda: recorded.executions
