"""A long-running Temporal worker that drives the release agent's runs.

What it shows
    * a worker process of its own: ``Worker(client, task_queue=TASK_QUEUE,
      plugins=[PolyLoopPlugin([agent])])`` on a server named by ``--address``, serving
      until it is told to stop;
    * the store the runs live in, opened once for the process: a SQLite file or a
      PostgreSQL database (``--store``); every worker of the queue must share it;
    * a clean stop: ``SIGINT`` (Ctrl-C) or ``SIGTERM`` leaves the ``Worker`` block,
      which stops polling and cancels a run segment still being driven (the run ends
      that segment ``cancelled`` in its log, and another worker goes on from there),
      then the process exits with status 0.

How to run it (``temporal_client.py`` starts the runs)::

    temporal server start-dev                                   # a server, if none runs
    python examples/temporal_worker.py --address 127.0.0.1:7233 --store runs.db
    python examples/temporal_worker.py --store postgresql://postgres@127.0.0.1:5432/test

It prints ``ready`` once it polls the queue, then one line per tool that ran (``effect:
deploy prod (<run id>:0:action)``), and ``stopped`` when it has shut down. Needs the
``temporal`` extra (and ``postgres`` for a PostgreSQL store).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from polyloop import Store
from polyloop.temporal import PolyLoopPlugin
from temporal_release import TASK_QUEUE, make_agent


def open_store(where: str) -> AbstractAsyncContextManager[Store]:
    """A PostgreSQL store for a ``postgresql://`` address, else a SQLite file."""
    if where.startswith(("postgresql://", "postgres://")):
        from polyloop.stores import PostgresStore  # the postgres extra, only when asked

        return PostgresStore(where)
    from polyloop.stores import SqliteStore

    return SqliteStore(Path(where))


def note_effect(line: str) -> None:
    print(f"effect: {line}", flush=True)


async def serve(address: str, store_at: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    client = await Client.connect(address)
    async with open_store(store_at) as store:
        plugin = PolyLoopPlugin([make_agent(store, note_effect)], max_concurrent_runs=8)
        async with Worker(client, task_queue=TASK_QUEUE, plugins=[plugin]):
            print(f"ready: task queue {TASK_QUEUE!r} on {address}", flush=True)
            await stop.wait()
    print("stopped", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", default="127.0.0.1:7233", help="host:port of the Temporal server"
    )
    parser.add_argument(
        "--store",
        required=True,
        help="where the runs live: a SQLite file, or a postgresql:// connection string",
    )
    args = parser.parse_args()
    asyncio.run(serve(args.address, args.store))
