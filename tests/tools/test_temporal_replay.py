"""Workflows already running keep running: their recorded histories replay on this code.

``tests/fixtures/temporal_histories/`` holds the histories of ``AgentRun`` workflows
recorded before the workflow read its activities' results as frozen values (they were
dicts then): a run through three approvals, one rejected, that continued as new after
each (``continued-1`` to ``-4``, the later ones starting from the carried status), a
model call in doubt settled by the update, and an approval whose deadline rejected it.
A worker replays a history whenever it picks a running workflow up again, so a change
in what the workflow reads from its history, or in the commands it issues, fails here
first. Replaying needs no server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from kit.agent import Ledger, definition, make_tools, request
from polyloop.session import Request
from polyloop.stores import MemoryStore
from polyloop.temporal import Agent, PolyLoopPlugin
from polyloop.types import JSONValue

HISTORIES = Path(__file__).resolve().parent.parent / "fixtures" / "temporal_histories"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _plugin() -> PolyLoopPlugin:
    # Replaying runs no activity; the agent is there because the plugin needs one.
    tools = make_tools(Ledger())

    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, tools)

    agent = Agent(
        name="a", definition=definition(MemoryStore(), script=[]), request_for=request_for
    )
    return PolyLoopPlugin([agent])


# Each history and its workflow id, the run id it was recorded with.
RECORDED = {
    "continued-1": "replay-continued",
    "continued-2": "replay-continued",
    "continued-3": "replay-continued",
    "continued-4": "replay-continued",
    "deadline": "replay-deadline",
    "model-call-in-doubt": "replay-model-doubt",
}


def test_every_recorded_history_is_replayed() -> None:
    assert sorted(path.stem for path in HISTORIES.glob("*.json")) == sorted(RECORDED)


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(RECORDED))
async def test_a_history_recorded_before_the_values_became_frozen_replays(name: str) -> None:
    history = WorkflowHistory.from_json(
        RECORDED[name], (HISTORIES / f"{name}.json").read_text(encoding="utf-8")
    )
    # The plugin registers the workflow, passing PolyLoop through the sandbox.
    replayer = Replayer(workflows=[], plugins=[_plugin()])
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None, replayed.replay_failure
