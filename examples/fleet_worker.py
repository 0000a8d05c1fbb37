"""Invoices paid by a fleet of ``polyloop worker`` processes on one PostgreSQL database.

One agent, ``invoices``: each run pays one invoice with ``pay``, a tool that is never
replayed and has a probe. Each payment is a row of a ledger beside the store, keyed by
its result id, so the probe finds a payment that went out, or voids its key for good.
Kill a worker mid-payment and another one settles the run through the probe: no run is
left in doubt, and no invoice is paid twice. From this directory::

    python fleet_worker.py start --jobs 400      # one run per invoice, driven by nobody yet
    polyloop worker fleet_worker:agents          # in as many terminals as you like
    polyloop runs postgresql://postgres@127.0.0.1:5432/test --schema fleet

The database is ``$POLYLOOP_TEST_POSTGRES`` (or a local one), the store's schema
``$FLEET_SCHEMA`` (``fleet``), the ledger ``<schema>_app.payments``. Needs the
``postgres`` extra. The model is the scripted one of :mod:`polyloop.testing`, 30 ms a call.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio
import psycopg
from psycopg import sql

from polyloop import (
    Agent,
    Budget,
    Definition,
    Injection,
    JSONValue,
    Message,
    ModelCall,
    NullSink,
    ObservationTexts,
    Reconciled,
    Replay,
    Request,
    Role,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import PostgresStore
from polyloop.testing import ScriptedModelClient

CONNINFO = os.environ.get("POLYLOOP_TEST_POSTGRES") or "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = os.environ.get("FLEET_SCHEMA", "fleet")
APP, PAYMENTS = sql.Identifier(f"{SCHEMA}_app"), sql.Identifier(f"{SCHEMA}_app", "payments")
LEDGER = sql.SQL(
    "CREATE SCHEMA IF NOT EXISTS {}; CREATE TABLE IF NOT EXISTS {} (result_id text PRIMARY KEY,"
    " invoice text NOT NULL, cents int NOT NULL, voided bool NOT NULL, pid int NOT NULL)"
).format(APP, PAYMENTS)
# A payment whose key is on the ledger already (paid, or voided by a probe) fails here.
PAY = sql.SQL("INSERT INTO {} VALUES (%s, %s, %s, false, %s)").format(PAYMENTS)
# The probe: the key's payment if it went out, else a tombstone that keeps it from ever going.
FIND_OR_VOID = sql.SQL(
    "INSERT INTO {} AS p VALUES (%s, %s, 0, true, %s) ON CONFLICT (result_id) "
    "DO UPDATE SET pid = p.pid RETURNING voided, cents"
).format(PAYMENTS)


def invoices(store: PostgresStore, ledger: psycopg.Connection) -> Agent:
    """The agent: a run per invoice, its input the amount due in cents."""

    async def pay(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        invoice, cents = arguments["invoice"], arguments["cents"]
        await anyio.to_thread.run_sync(
            ledger.execute, PAY, (result_id, invoice, cents, os.getpid())
        )
        await anyio.sleep(0.04)  # the bank confirms a transfer it has made
        return f"paid {cents} cents"

    async def probe(arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
        row = (result_id, arguments["invoice"], os.getpid())
        found = await anyio.to_thread.run_sync(lambda: ledger.execute(FIND_OR_VOID, row).fetchone())
        if found is None or found[0]:
            return Reconciled(ran=False, observation="the payment was not made")
        return Reconciled(ran=True, observation=f"paid {found[1]} cents")

    spec = ToolSpec(
        name="pay",
        description="Pay an invoice.",
        parameters={"type": "object", "required": ["invoice", "cents"]},
        handler=pay,
        replay=Replay.NEVER,
        completes=True,
        reconcile=probe,
    )
    tools = ToolRegistry([spec], max_observation_chars=200)

    def request_for(run_id: str, input: JSONValue) -> Request:
        assert isinstance(input, dict)
        return Request(
            run_id=run_id,
            budget=Budget(max_steps=4, max_valid_steps=4, max_context_chars=10_000),
            executor=tools.executor(),
            tools=tools,
            run_context=(),
            goal_context=(Message.text(Role.USER, f"Pay invoice {run_id}."),),
            injection=Injection(entries={}),
            binding={"cents": str(input["cents"])},
            model_replay=Replay.ALLOWED,
            observation_template="{observation}",
            tool_style=ToolStyle.JSON,
            cancel_grace_s=2.0,
        )

    def script(call: ModelCall) -> str:  # pays what is due, again if told it was not paid
        due = {"invoice": call.run_id, "cents": int(call.binding["cents"])}
        return json.dumps({"tool": "pay", "arguments": due})

    definition = Definition(
        model=ScriptedModelClient(script, delay=0.03, name="invoices"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Not paid: {reason}", env_fault="Failed: {detail}"),
    )
    return Agent(name="invoices", definition=definition, request_for=request_for)


@asynccontextmanager
async def agents() -> AsyncIterator[list[Agent]]:
    """What ``polyloop worker fleet_worker:agents`` hosts, opened in its own process."""
    connect = partial(psycopg.connect, CONNINFO, autocommit=True)
    ledger = await anyio.to_thread.run_sync(connect)  # blocking calls run off the event loop
    try:
        await anyio.to_thread.run_sync(ledger.execute, LEDGER)
        async with PostgresStore(CONNINFO, schema=SCHEMA, pool_size=2) as store:
            yield [invoices(store, ledger)]
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(ledger.close)


async def start(jobs: int) -> None:
    """One run per invoice, for the workers to drive; a run already started is kept."""
    async with agents() as (agent,):
        for i in range(jobs):
            await agent.start(f"INV-{i:04d}", {"cents": 1_000 + i * 7_919 % 90_000})
    print(f"started {jobs} invoices in schema {SCHEMA}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["start"])
    parser.add_argument("--jobs", type=int, default=40)
    anyio.run(start, parser.parse_args().jobs)
