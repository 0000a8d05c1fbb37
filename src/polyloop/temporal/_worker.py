"""The worker side: agents, the activities that drive runs and write answers, the plugin.

An activity runs on whichever worker polls it, in any process: all it needs is the
agent's :class:`~polyloop.session.Definition` (its store shared by every worker, e.g.
one PostgreSQL database) and ``request_for`` to rebuild the run's request there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError
from temporalio.plugin import SimplePlugin
from temporalio.worker import WorkerConfig, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from polyloop.ports import ManagedStore
from polyloop.serialization import encode
from polyloop.session import (
    Agent,
    Request,
    approve,
    reject,
    run_status,
    settle,
    start_or_resume,
)
from polyloop.temporal._reports import SegmentOutcome, StatusSummary, Waiting
from polyloop.temporal._shown import (
    FINAL_ANSWER_BYTES,
    bounded_record,
    brief,
    fitting,
    json_size,
    shown_detail,
    summary_of,
    when,
)
from polyloop.temporal._values import AnswerInput, AnswerKind, RunInput, SegmentInput
from polyloop.temporal._workflow import (
    ANSWER_ACTIVITY,
    DRIVE_ACTIVITY,
    NOT_RETRYABLE,
    STATUS_ACTIVITY,
    AgentRun,
)
from polyloop.types import (
    JSONValue,
    PolyLoopError,
    RunResult,
    RunState,
    RunStatus,
    Settlement,
    Verdict,
)

__all__ = ("PolyLoopPlugin", "start_agent_run")

DEFAULT_MAX_ATTEMPTS = 10
"""The attempts an activity failing with an error PolyLoop does not know gets by default."""


class _Activities:
    """The activities of one plugin, bound to its agents."""

    def __init__(self, agents: Mapping[str, Agent], max_attempts: int | None) -> None:
        self._agents = dict(agents)
        self._max_attempts = max_attempts

    @activity.defn(name=DRIVE_ACTIVITY)
    async def drive_segment(self, segment: SegmentInput) -> dict[str, JSONValue]:
        """``start_or_resume`` the run, heartbeating until it stops; its outcome, bounded."""
        agent = self._agent(segment.agent, segment.run_id)
        request = await _request(agent, segment)
        with self._mapped_errors(segment.run_id, "the segment"):
            result = await _driven(agent, request, segment.heartbeat_timeout / 3)
            status = await _status(agent, result)
        outcome = _outcome(result, status).to_json()
        return fitting(outcome, segment.run_id, "the segment's outcome")

    @activity.defn(name=ANSWER_ACTIVITY)
    async def answer(self, answer: AnswerInput) -> dict[str, JSONValue]:
        """Write a person's answer to the run's log; the record written, bounded."""
        agent = self._agent(answer.agent, answer.run_id)
        with self._mapped_errors(answer.run_id, "the answer"):
            record = await _answered(agent.definition.store, answer)
        return fitting(bounded_record(record), answer.run_id, "the answer's record")

    @activity.defn(name=STATUS_ACTIVITY)
    async def status(self, segment: SegmentInput) -> dict[str, JSONValue]:
        """The run's status as the store has it now (``AgentRun.redrive``), bounded."""
        agent = self._agent(segment.agent, segment.run_id)
        store = _status_store(agent)
        if store is None:
            raise ApplicationError(
                f"run {segment.run_id!r}: agent {segment.agent!r} has no store that can "
                "describe runs; give it a status_store",
                type="InvalidRequest",
                non_retryable=True,
            )
        with self._mapped_errors(segment.run_id, "reading the status"):
            read = summary_of(await run_status(store, segment.run_id))
        return fitting(read.to_json(), segment.run_id, "the run's status")

    @contextmanager
    def _mapped_errors(self, run_id: str, what: str) -> Iterator[None]:
        """PolyLoop's errors as Temporal failures of the same type; any other error is
        retried until the activity has had ``max_attempts`` attempts, then fails for good."""
        try:
            yield
        except PolyLoopError as err:
            raise _as_application_error(err, run_id) from err
        except Exception as err:
            attempt = activity.info().attempt
            if self._max_attempts is None or attempt < self._max_attempts:
                raise
            raise ApplicationError(
                f"run {run_id!r}: {what} failed {attempt} times; the last error: "
                f"{type(err).__name__}: {brief(str(err))}",
                {"run_id": run_id, "attempts": attempt, "error": type(err).__name__},
                type="AttemptsExhausted",
                non_retryable=True,
            ) from err

    def _agent(self, name: str, run_id: str) -> Agent:
        try:
            return self._agents[name]
        except KeyError:
            raise ApplicationError(
                f"run {run_id!r}: this worker has no agent {name!r} "
                f"(it has {', '.join(map(repr, sorted(self._agents))) or 'none'})",
                type="UnknownAgent",
                non_retryable=True,
            ) from None


async def _request(agent: Agent, segment: SegmentInput) -> Request:
    """The run's request, built from the client's input; an error here is the input's,
    which no other attempt can cure, so it fails the workflow at once."""
    try:
        return await agent.request(segment.run_id, segment.input)
    except PolyLoopError as err:
        raise _as_application_error(err, segment.run_id) from err
    except Exception as err:
        raise ApplicationError(
            f"run {segment.run_id!r}: request_for of agent {segment.agent!r} could not "
            f"build the request from the run's input: {type(err).__name__}: {brief(str(err))}",
            {"run_id": segment.run_id, "error": type(err).__name__},
            type="RequestNotBuilt",
            non_retryable=True,
        ) from err


def _outcome(result: RunResult, status: StatusSummary) -> SegmentOutcome:
    """What the workflow needs of a segment: the stop, the counts and a bounded summary.

    A final answer too large to carry is left out (``final_answer_omitted``): the run's
    end record in the log holds it.
    """
    answer = result.final_answer
    omitted = answer is not None and json_size(answer) > FINAL_ANSWER_BYTES
    return SegmentOutcome(
        run_id=result.run_id,
        stop_reason=result.stop_reason,
        final_answer=None if omitted else answer,
        final_answer_omitted=omitted,
        steps=result.step_count,
        valid_steps=result.valid_step_count,
        detail=shown_detail(result.detail),
        resumed=result.resumed,
        status=status,
    )


async def _answered(store: Any, answer: AnswerInput) -> Verdict | Settlement:
    """Write the answer, naming the proposal or intent it answers: PolyLoop refuses it,
    and writes nothing, if that one is no longer open."""
    if answer.kind is AnswerKind.APPROVE:
        return await approve(
            store,
            answer.run_id,
            by=answer.by,
            arguments=answer.arguments,
            result_id=answer.result_id,
        )
    if answer.kind is AnswerKind.REJECT:
        return await reject(
            store,
            answer.run_id,
            by=answer.by,
            reason=answer.reason or "",
            result_id=answer.result_id,
        )
    return await settle(
        store,
        answer.run_id,
        by=answer.by,
        ran=bool(answer.ran),
        observation=answer.observation or "",
        result_id=answer.result_id,
    )


async def _driven(agent: Agent, request: Request, every: float) -> RunResult:
    """Drive the run in a child task beside a heartbeat, so a cancellation of the
    activity reaches the run as an AnyIO cancellation (the kernel writes its end record).
    A run resumed goes on under the agent's amendment, if it has one."""
    outcome: list[RunResult] = []
    failure: list[Exception] = []

    async def drive() -> None:
        try:
            outcome.append(await start_or_resume(agent.definition, request, amend=agent.amend))
        except Exception as err:  # noqa: BLE001 - re-raised below, unwrapped
            # Raised as itself, not inside an exception group, so it maps to its type.
            failure.append(err)
        group.cancel_scope.cancel()

    async def heartbeat() -> None:
        while True:
            activity.heartbeat()
            await anyio.sleep(every)

    async with anyio.create_task_group() as group:
        group.start_soon(drive)
        group.start_soon(heartbeat)
    if failure:
        raise failure[0]
    return outcome[0]


def _status_store(agent: Agent) -> ManagedStore | None:
    store = agent.status_store
    if store is None and isinstance(agent.definition.store, ManagedStore):
        store = agent.definition.store
    return store


async def _status(agent: Agent, result: RunResult) -> StatusSummary:
    store = _status_store(agent)
    if store is None:
        return _status_of_result(result)
    return summary_of(await run_status(store, result.run_id))


def status_json(status: RunStatus) -> dict[str, Any]:
    """A :class:`~polyloop.types.RunStatus` as JSON: records as the log encodes them."""
    return {
        "run_id": status.run_id,
        "state": status.state.value,
        "stop_reason": status.stop_reason.value if status.stop_reason is not None else None,
        "detail": status.detail,
        "steps": status.steps,
        "valid_steps": status.valid_steps,
        "open_intent": encode(status.open_intent) if status.open_intent is not None else None,
        "proposal": encode(status.proposal) if status.proposal is not None else None,
        "last_record_at": when(status.last_record_at),
        "owner": status.owner,
        "lease_expires_at": when(status.lease_expires_at),
    }


def _status_of_result(result: RunResult) -> StatusSummary:
    # Without a store that can describe runs, the result alone: no records to show.
    waiting = Waiting.after(result.stop_reason)
    return StatusSummary(
        run_id=result.run_id,
        state=waiting.state if waiting is not None else RunState.FINISHED,
        stop_reason=result.stop_reason,
        detail=shown_detail(result.detail),
        steps=result.step_count,
        valid_steps=result.valid_step_count,
    )


def _as_application_error(err: PolyLoopError, run_id: str) -> ApplicationError:
    kind = type(err).__name__
    return ApplicationError(
        brief(str(err)),
        {"run_id": err.run_id or run_id, "location": err.location},
        type=kind,
        non_retryable=kind in NOT_RETRYABLE,
    )


class PolyLoopPlugin(SimplePlugin):
    """Registers ``AgentRun`` and its activities on a ``Worker(..., plugins=[plugin])``.

    ``agents`` holds the :class:`~polyloop.Agent` values ``RunInput.agent`` names: a
    sequence of them, or a mapping from each one's name to it.
    ``max_concurrent_runs`` bounds how many run segments (and answers) this worker runs
    at once (the worker's ``max_concurrent_activities``); ``max_runs_per_second`` bounds
    how many the whole task queue starts per second, server-side (the worker's
    ``max_task_queue_activities_per_second``; give every worker of the queue the same
    value). The workflow module is passed through the sandbox.

    ``max_attempts`` (default 10; ``None``: no bound) bounds the attempts of an activity
    (a segment, an answer, a status read) that fails with an error PolyLoop does not
    know: at that attempt the error fails it for good, and the workflow (or the update)
    with it, as ``AttemptsExhausted``. Every attempt counts, one a dead worker lost
    included. PolyLoop's own errors that pass (``RunLocked``, ``LeaseLost``,
    ``StoreError``) are retried without bound; those no attempt can cure are not retried.
    """

    def __init__(
        self,
        agents: Mapping[str, Agent] | Sequence[Agent],
        *,
        max_concurrent_runs: int | None = None,
        max_runs_per_second: float | None = None,
        max_attempts: int | None = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        named = _by_name(agents)
        if max_concurrent_runs is not None and max_concurrent_runs < 1:
            raise ValueError(f"max_concurrent_runs must be at least 1, not {max_concurrent_runs}")
        if max_runs_per_second is not None and not max_runs_per_second > 0:
            raise ValueError(f"max_runs_per_second must be positive, not {max_runs_per_second}")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {max_attempts}")
        self.max_concurrent_runs = max_concurrent_runs
        self.max_runs_per_second = max_runs_per_second
        self.max_attempts = max_attempts
        activities = _Activities(named, max_attempts)
        super().__init__(
            "polyloop.PolyLoopPlugin",
            activities=[activities.drive_segment, activities.answer, activities.status],
            workflows=[AgentRun],
            workflow_runner=_passing_polyloop_through,
        )

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        config = super().configure_worker(config)
        if self.max_concurrent_runs is not None:
            if config.get("tuner") is not None:
                raise ValueError("max_concurrent_runs cannot be combined with a worker tuner")
            config["max_concurrent_activities"] = self.max_concurrent_runs
        if self.max_runs_per_second is not None:
            config["max_task_queue_activities_per_second"] = self.max_runs_per_second
        return config


def _by_name(agents: Mapping[str, Agent] | Sequence[Agent]) -> dict[str, Agent]:
    """The agents by name; a mapping's keys must be its agents' names."""
    pairs = list(agents.items()) if isinstance(agents, Mapping) else [(a.name, a) for a in agents]
    if not pairs or not all(isinstance(agent, Agent) for _, agent in pairs):
        raise ValueError("agents must hold at least one Agent")
    for key, agent in pairs:
        if key != agent.name:
            raise ValueError(f"agents maps {key!r} to the agent named {agent.name!r}")
    named = dict(pairs)
    if len(named) != len(pairs):
        raise ValueError("agents holds two agents of one name")
    return named


def _passing_polyloop_through(runner: WorkflowRunner | None) -> WorkflowRunner:
    if runner is None:
        raise ValueError("PolyLoopPlugin needs a workflow runner")
    if isinstance(runner, SandboxedWorkflowRunner):
        # The workflow module imports only deterministic code; PolyLoop is loaded once,
        # outside the sandbox, instead of again for every workflow run.
        return dataclasses.replace(
            runner, restrictions=runner.restrictions.with_passthrough_modules("polyloop")
        )
    return runner


async def start_agent_run(
    client: Client, input: RunInput, *, task_queue: str, **options: Any
) -> WorkflowHandle[AgentRun, dict[str, Any]]:
    """Start the ``AgentRun`` of ``input``, with the run id as its workflow id.

    A second start of the same run is refused (``WorkflowAlreadyStartedError``) while it
    runs and after it completed; one that failed, was cancelled or terminated may be
    started again, which resumes the run from its log. ``options`` go to
    ``Client.start_workflow``.

    Cancellation: cancelled before the server answered, the workflow may or may not have
    started, and nothing is written to the run's log; starting it again is safe, as a
    second start of a running run is refused.
    """
    options.setdefault("id_reuse_policy", WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY)
    return await client.start_workflow(
        AgentRun.run, input, id=input.run_id, task_queue=task_queue, **options
    )
