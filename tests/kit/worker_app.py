"""The application a ``polyloop worker`` process hosts in the tests: ``kit.worker_app:lifespan``.

Its one agent, ``payer``, pays once through a tool and answers, on the SQLite file
``$WORKER_DB``. Each payment is appended to ``$WORKER_LEDGER`` (its result id, after an
``entered`` line when the call starts). With ``$WORKER_GATE`` set, a payment waits until
that file exists; with ``$WORKER_APPROVAL=1`` it needs a person's approval first. The
test process builds the same agent (:func:`agent`) to start runs.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from kit.agent import NUMBER_SCHEMA, definition, request
from kit.hosting import SCRIPT
from polyloop import Agent, JSONValue, Request, Store, ToolRegistry, ToolSpec
from polyloop.stores import SqliteStore


def _note(line: str) -> None:
    with Path(os.environ["WORKER_LEDGER"]).open("a", encoding="utf-8") as ledger:
        ledger.write(line + "\n")


async def _pay(arguments: dict[str, Any], *, result_id: str) -> str:
    await anyio.to_thread.run_sync(_note, f"entered {result_id}")
    gate = os.environ.get("WORKER_GATE")
    # The gate is a file another process creates: there is no event to wait on.
    while gate and not await anyio.Path(gate).exists():  # noqa: ASYNC110
        await anyio.sleep(0.02)
    await anyio.to_thread.run_sync(_note, result_id)
    return f"paid {arguments['n']}"


def agent(store: Store) -> Agent:
    spec = ToolSpec(
        name="pay",
        description="Pay n coins.",
        parameters=NUMBER_SCHEMA,
        handler=_pay,
        needs_approval=os.environ.get("WORKER_APPROVAL") == "1",
    )
    registry = ToolRegistry([spec], max_observation_chars=1_000)

    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, registry)

    return Agent(name="payer", definition=definition(store, script=SCRIPT), request_for=request_for)


@asynccontextmanager
async def lifespan() -> AsyncIterator[list[Agent]]:
    async with SqliteStore(os.environ["WORKER_DB"]) as store:
        yield [agent(store)]
