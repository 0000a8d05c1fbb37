"""An agent starts a run durably, records itself and the run's input in the start record,
and drives runs of its own; under asyncio and Trio (``polyloop.Agent``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from polyloop import (
    Agent,
    InvalidRequest,
    JSONValue,
    Message,
    Request,
    Role,
    RunIdentityMismatch,
    RunLocked,
    RunStarted,
    RunState,
    StopReason,
    resume,
    run,
    run_status,
)
from polyloop.stores import MemoryStore, SqliteStore

pytestmark = pytest.mark.anyio

SCRIPT = [tool_call("double", n=2), answer("4")]


def agent_over(store: Any, *, name: str = "doubler", script: list[str] = SCRIPT) -> Agent:
    tools = make_tools(Ledger())

    def request_for(run_id: str, input: JSONValue) -> Request:
        assert isinstance(input, dict)
        goal = (Message.text(Role.USER, f"Double {input['n']}."),) if "n" in input else ()
        return request(run_id, tools, **({"goal_context": goal} if goal else {}))

    return Agent(name=name, definition=definition(store, script=script), request_for=request_for)


async def test_run_drives_a_new_run_and_records_the_agent_and_its_input() -> None:
    store = MemoryStore()
    result = await agent_over(store).run("r1", {"n": 2, "tags": ("a", None)})
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.final_answer == "4"
    assert result.resumed is False
    started = (await store.read_log("r1")).records[0]
    assert isinstance(started, RunStarted)
    assert started.agent == "doubler"
    assert started.input == {"n": 2, "tags": ["a", None]}  # as the log holds it


async def test_start_writes_only_the_start_record_and_run_then_goes_on() -> None:
    store = MemoryStore()
    agent = agent_over(store)
    await agent.start("r1", {"n": 2})
    records = (await store.read_log("r1")).records
    assert [type(record) for record in records] == [RunStarted]
    assert (await run_status(store, "r1")).state is RunState.RESUMABLE
    result = await agent.run("r1", {"n": 2})
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.resumed is True


async def test_a_retried_start_changes_nothing() -> None:
    store = MemoryStore()
    agent = agent_over(store)
    await agent.start("r1", {"n": 2})
    before = (await store.read_log("r1")).records
    await agent.start("r1", {"n": 2})
    assert (await store.read_log("r1")).records == before


@pytest.mark.parametrize("call", ["start", "run"])
async def test_another_input_for_a_started_run_is_refused_naming_it(call: str) -> None:
    store = MemoryStore()
    agent = agent_over(store)
    await agent.start("r1", {"same": "snapshot", "v": 1})
    before = (await store.read_log("r1")).records
    with pytest.raises(RunIdentityMismatch) as caught:
        await getattr(agent, call)("r1", {"same": "snapshot", "v": 2})
    assert caught.value.run_id == "r1"
    assert caught.value.differences == (
        ("agent.input", {"same": "snapshot", "v": 1}, {"same": "snapshot", "v": 2}),
    )
    assert (await store.read_log("r1")).records == before


async def test_a_run_of_another_agent_is_refused_naming_both() -> None:
    store = MemoryStore()
    await agent_over(store, name="first").start("r1", {})
    with pytest.raises(RunIdentityMismatch) as caught:
        await agent_over(store, name="second").run("r1", {})
    assert caught.value.differences == (("agent.name", "first", "second"),)


async def test_a_run_started_without_an_agent_is_not_taken_by_one() -> None:
    store = MemoryStore()
    agent = agent_over(store)
    # Started by plain code: no agent in its start record.
    await run(agent.definition, await agent.request("plain", {}))
    with pytest.raises(RunIdentityMismatch) as caught:
        await agent.run("plain", {})
    assert caught.value.differences == (
        ("agent.input", None, {}),
        ("agent.name", None, "doubler"),
    )


async def test_plain_resume_still_drives_an_agent_s_run() -> None:
    store = MemoryStore()
    agent = agent_over(store)
    await agent.start("r1", {})
    result = await resume(agent.definition, await agent.request("r1", {}))
    assert result.stop_reason is StopReason.FINAL_ANSWER


async def test_a_coroutine_request_for_is_awaited() -> None:
    store = MemoryStore()
    plain = agent_over(store)

    async def request_for(run_id: str, input: JSONValue) -> Request:
        return await plain.request(run_id, input)

    agent = Agent(name="doubler", definition=plain.definition, request_for=request_for)
    assert (await agent.run("r1", {})).final_answer == "4"


@pytest.mark.parametrize(
    ("value", "words"),
    [(math.nan, "NaN"), ({"n": math.inf}, "input.n"), ({1: "x"}, "key"), (object(), "object")],
)
async def test_an_input_the_log_cannot_hold_is_refused_before_anything_is_written(
    value: Any, words: str
) -> None:
    store = MemoryStore()
    agent = agent_over(store)
    for call in (agent.start, agent.run):
        with pytest.raises(InvalidRequest) as caught:
            await call("r1", value)
        assert caught.value.run_id == "r1"
        assert "doubler" in str(caught.value)
        assert words.lower() in str(caught.value).lower()
    assert (await store.read_log("r1")).records == ()


async def test_a_request_for_another_run_is_refused() -> None:
    store = MemoryStore()
    plain = agent_over(store)
    agent = Agent(
        name="doubler",
        definition=plain.definition,
        request_for=lambda run_id, input: plain.request_for("other", input),
    )
    with pytest.raises(InvalidRequest, match="'other'") as caught:
        await agent.start("r1", {})
    assert caught.value.run_id == "r1"
    assert (await store.read_log("r1")).records == ()
    assert (await store.read_log("other")).records == ()


@pytest.mark.parametrize("name", ["", None, 3])
def test_an_agent_needs_a_name(name: Any) -> None:
    with pytest.raises(InvalidRequest, match="name"):
        Agent(name=name, definition=agent_over(MemoryStore()).definition, request_for=print)


async def test_start_while_another_writer_holds_the_run(tmp_path: Path) -> None:
    async with (
        SqliteStore(tmp_path / "runs.db") as first,
        SqliteStore(tmp_path / "runs.db") as other,
    ):
        agent = agent_over(first)
        await agent.start("r1", {})
        await first.claim_run("r1")  # a worker drives it now
        # A retried start while it is driven: the log answers, nothing is written.
        await agent_over(other).start("r1", {})
        with pytest.raises(RunIdentityMismatch):
            await agent_over(other).start("r1", {"n": 3})
        await first.claim_run("r2")  # claimed, nothing written yet
        with pytest.raises(RunLocked):
            await agent_over(other).start("r2", {})
        await first.release_run("r1")
        await first.release_run("r2")
        assert [type(r) for r in (await other.read_log("r1")).records] == [RunStarted]
