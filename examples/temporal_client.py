"""A Temporal client that starts a release run, approves its deploy and prints the outcome.

What it shows
    * everything a client needs from the agent: its name and its task queue (imported
      from ``temporal_release.py``, which defines both); the definition, the model, the
      tools and the store stay with the workers (``temporal_worker.py``);
    * ``start_agent_run``: the ``AgentRun`` workflow, started under the run id;
    * the ``status`` query until the run stops, and the proposal it shows;
    * the ``approve`` update, naming the proposal by the result id the status showed,
      and its answer, the verdict PolyLoop wrote to the run's log;
    * the workflow's result: how the run ended.

How to run it (a worker must serve the queue, ``temporal_worker.py``)::

    python examples/temporal_client.py --address 127.0.0.1:7233 --run-id release-1.4

A run id is one workflow: starting a run id that was used before is refused, in one line,
with status 2. Needs the ``temporal`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import WorkflowAlreadyStartedError

from polyloop.temporal import AgentRun, ApproveInput, RunInput, start_agent_run
from temporal_release import AGENT, TASK_QUEUE


async def until_it_stops(handle: WorkflowHandle[Any, Any]) -> dict[str, Any]:
    """The run's status once it waits for a person or the workflow ended."""
    while True:
        status: dict[str, Any] = await handle.query(AgentRun.status)
        if status["waiting_for"] is not None or status["ended"] is not None:
            return status
        # A query reads; nothing tells a client that the run stopped: poll.
        await asyncio.sleep(0.1)


async def main(address: str, run_id: str, release: str, by: str) -> int:
    client = await Client.connect(address)
    try:
        handle = await start_agent_run(
            client,
            RunInput(agent=AGENT, run_id=run_id, input={"release": release}),
            task_queue=TASK_QUEUE,
        )
    except WorkflowAlreadyStartedError:
        print(f"run {run_id!r} was started before: pass another --run-id", file=sys.stderr)
        return 2
    print(f"started run {run_id} on task queue {TASK_QUEUE!r}")
    status = await until_it_stops(handle)
    print(f"status: {status['state']} after {status['steps']} steps")
    if status["waiting_for"] != "approval":
        print(f"the run waits for no approval; its status: {status}", file=sys.stderr)
        return 1
    # The proposal as `polyloop pending` shows it, and the result id the answer names.
    proposal = status["proposal"]
    print(f"proposal {proposal['result_id']}: {proposal['call']}")
    verdict = await handle.execute_update(
        AgentRun.approve, ApproveInput(by=by, result_id=proposal["result_id"])
    )
    print(f"approved {verdict['result_id']} (by {verdict['by']})")
    outcome = await handle.result()
    print(f"stop reason: {outcome['stop_reason']} after {outcome['steps']} steps")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", default="127.0.0.1:7233", help="host:port of the Temporal server"
    )
    parser.add_argument("--run-id", help="the run's id, its workflow's id too (default: a new one)")
    parser.add_argument("--release", default="1.4", help="the release to deploy")
    parser.add_argument("--by", default="alice", help="who approves the deploy")
    args = parser.parse_args()
    run_id = args.run_id or f"release-{args.release}-{uuid.uuid4().hex[:8]}"
    status = asyncio.run(main(args.address, run_id, args.release, args.by))
    # The Temporal client's native threads can outlive the event loop, and a short-lived
    # client process may then abort while the interpreter shuts down (a known issue of
    # the Python SDK, temporalio/sdk-python#300). Everything is printed by now: leave
    # without that teardown, so the exit status is the one main returned.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
