"""PolyLoop runs driven by Temporal (the ``temporal`` extra; asyncio only).

PolyLoop's log stays the record of every step; Temporal owns dispatch, supervision,
waits and recovery. A run is an :class:`AgentRun` workflow whose id is the run id; a
run *segment* is one activity that calls :func:`polyloop.start_or_resume` and
heartbeats while the run is driven. A run that stops ``AWAITING_APPROVAL`` or
``IN_DOUBT`` makes the workflow wait for the ``approve``/``reject``/``settle`` update,
which writes the answer through :func:`polyloop.approve`/``reject``/``settle``; no
worker is held meanwhile; ``AgentRun.redrive`` picks up an answer written to the log
outside Temporal (the command line). ``AgentRun.status`` mirrors :func:`polyloop.run_status`.

Worker::

    plugin = PolyLoopPlugin(agents=[Agent(name="invoices", definition=..., request_for=...)])
    async with Worker(client, task_queue="agents", plugins=[plugin]):
        ...

Client::

    handle = await start_agent_run(
        client, RunInput(agent="invoices", run_id="INV-1", input={...}), task_queue="agents"
    )
    proposal = (await handle.query(AgentRun.status))["proposal"]
    await handle.execute_update(
        AgentRun.approve, ApproveInput(by="alice", result_id=proposal["result_id"])
    )
    outcome = await handle.result()   # {"stop_reason": ..., "final_answer": ..., ...}

Importing this module imports ``temporalio``; nothing else in the library does.
"""

from __future__ import annotations

from polyloop._shared import needs_extra

with needs_extra("polyloop.temporal", "temporal"):
    import temporalio  # noqa: F401

from polyloop.session import Agent
from polyloop.temporal._values import ApproveInput, RejectInput, RunInput, SettleInput
from polyloop.temporal._worker import PolyLoopPlugin, start_agent_run, status_json
from polyloop.temporal._workflow import AgentRun

__all__ = (
    "Agent",
    "AgentRun",
    "ApproveInput",
    "PolyLoopPlugin",
    "RejectInput",
    "RunInput",
    "SettleInput",
    "start_agent_run",
    "status_json",
)
