"""A Temporal worker process for the fleet tests: PolyLoop runs that pay, on PostgreSQL.

    python tests/kit/temporal_worker_agent.py ADDRESS QUEUE CONNINFO LEDGER NAME MODE [stop]

The worker connects to the Temporal server at ``ADDRESS``, serves the task queue
``QUEUE`` with :class:`~polyloop.temporal.PolyLoopPlugin` and one agent, ``payer``, whose
runs live in the PostgreSQL database ``CONNINFO`` with a lease of :data:`LEASE_S`. A run
pays once, then answers. ``MODE`` says what the ``pay`` tool is: ``never`` (its replay is
never allowed), ``allowed`` (replay allowed) or ``approval`` (never replayed, and a
person must approve it first).

Every effect outside the store is noted in ``LEDGER``, a file all workers append to
(``O_APPEND``, then ``fsync``), as ``<what> <worker NAME> <result id or run id>``:

* ``ready A -`` once the worker polls its queue, ``stopped A -`` once it has shut down;
* ``model A r:1:model`` when a model is called, ``pay A r:0:action`` when a payment is
  made (the line *is* the payment: the ledger is the truth a person settles with);
* ``stop A r:0:action`` when, with ``stop``, the process stops itself (``SIGSTOP``) right
  after its first payment intent is durable, before the payment could start;
* ``end A r <outcome>`` when a run segment ends on this worker: the stop reason, or the
  class of the error it raised (``LeaseLost``...), or ``Cancelled``.

The model asks for the payment until the ledger shows one for its run, then answers:
the same decision on every worker, whatever happened before. ``SIGTERM`` shuts the
worker down gracefully (the ``Worker`` context exits), as a deployment stopping a
process does.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import anyio
from temporalio.client import Client
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    Worker,
)

from kit import child_agent
from kit.agent import NUMBER_SCHEMA, answer, definition, request, tool_call
from polyloop import (
    Budget,
    Intent,
    IntentKind,
    Message,
    ModelCall,
    ModelReply,
    Replay,
    Request,
    Role,
    ToolRegistry,
    ToolSpec,
)
from polyloop.stores import PostgresStore
from polyloop.temporal import Agent, PolyLoopPlugin
from polyloop.testing import ScriptedModelClient

AGENT = "payer"
# Short, so that a stopped worker loses its runs within the tests' patience.
LEASE_S = 2.0
# How long a model call and a payment take: long enough for a kill to land inside.
MODEL_S = 0.05
PAY_S = 0.4


def ledger_lines(ledger: str) -> list[str]:
    try:
        with open(ledger) as file:
            return file.read().splitlines()
    except FileNotFoundError:
        return []


def paid(ledger: str, run_id: str) -> bool:
    """Whether the ledger holds a payment of run ``run_id``."""
    prefix = f"{run_id}:"
    return any(
        line.startswith("pay ") and line.split()[2].startswith(prefix)
        for line in ledger_lines(ledger)
    )


class PayingModel(ScriptedModelClient):
    """Asks for the payment until the ledger has one for the run, then answers."""

    def __init__(self, ledger: str, worker: str) -> None:
        super().__init__(self._decide, name="temporal-payer")
        self.ledger = ledger
        self.worker = worker

    async def call(self, call: ModelCall) -> ModelReply:
        await anyio.sleep(MODEL_S)
        content = await anyio.to_thread.run_sync(self._decide, call)
        return ModelReply(
            call_id=f"{call.run_id}/{call.call_index}", content=content, reasoning=None
        )

    def _decide(self, call: ModelCall) -> str:
        child_agent.append_synced(self.ledger, f"model {self.worker} {call.result_id}")
        return answer("paid") if paid(self.ledger, call.run_id) else tool_call("pay", n=5)


def payment_tools(ledger: str, worker: str, mode: str) -> ToolRegistry:
    async def pay(arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.to_thread.run_sync(
            child_agent.append_synced, ledger, f"pay {worker} {result_id}"
        )
        await anyio.sleep(PAY_S)  # the payment is made; its answer is still on the way
        return f"paid {arguments['n']}"

    return ToolRegistry(
        [
            ToolSpec(
                name="pay",
                description="Pay an amount (a real payment).",
                parameters=NUMBER_SCHEMA,
                handler=pay,
                replay=Replay.ALLOWED if mode == "allowed" else Replay.NEVER,
                needs_approval=mode == "approval",
            )
        ],
        max_observation_chars=1_000,
    )


class StoppingStore(PostgresStore):
    """Stops its whole process once, right after the first payment intent is durable."""

    __slots__ = ("_ledger", "_stop", "_worker")

    def __init__(self, conninfo: str, *, ledger: str, worker: str, stop: bool) -> None:
        super().__init__(conninfo, lease_s=LEASE_S)
        self._ledger, self._worker, self._stop = ledger, worker, stop

    async def write_intent(self, intent: Intent) -> None:
        await super().write_intent(intent)
        if self._stop and intent.kind is IntentKind.ACTION:
            self._stop = False
            child_agent.append_synced(self._ledger, f"stop {self._worker} {intent.result_id}")
            # This very thread stops before it goes on (a signal sent to the process
            # could be taken by another thread first).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


class _NoteEnds(Interceptor):
    """Notes in the ledger how each run segment on this worker ended."""

    def __init__(self, ledger: str, worker: str) -> None:
        self.ledger, self.worker = ledger, worker

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        outer = self

        class Noting(ActivityInboundInterceptor):
            async def execute_activity(self, input: ExecuteActivityInput) -> Any:
                run_id = getattr(input.args[0], "run_id", "?") if input.args else "?"
                outcome = "Cancelled"
                try:
                    result = await super().execute_activity(input)
                    outcome = str(result.get("stop_reason", "ok"))
                    return result
                except Exception as err:
                    outcome = getattr(err, "type", None) or type(err).__name__
                    raise
                finally:
                    # Synchronous on purpose: it must be noted even while cancelled.
                    child_agent.append_synced(
                        outer.ledger, f"end {outer.worker} {run_id} {outcome}"
                    )

        return Noting(next)


async def serve(
    address: str, queue: str, conninfo: str, ledger: str, name: str, mode: str, stop: bool
) -> None:
    client = await Client.connect(address)
    store = StoppingStore(conninfo, ledger=ledger, worker=name, stop=stop)
    tools = payment_tools(ledger, name, mode)

    def request_for(run_id: str, input: Any) -> Request:
        return request(
            run_id,
            tools,
            budget=Budget(max_steps=10, max_valid_steps=10, max_context_chars=100_000),
            run_context=(Message.text(Role.SYSTEM, "Pay 5, once."),),
            goal_context=(Message.text(Role.USER, "Go."),),
            binding={},
            model_replay=Replay.ALLOWED,
            cancel_grace_s=2.0,
        )

    agent = Agent(
        name=AGENT,
        definition=definition(store, model=PayingModel(ledger, name)),
        request_for=request_for,
    )
    plugin = PolyLoopPlugin([agent], max_concurrent_runs=16)
    try:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async with Worker(
                client, task_queue=queue, plugins=[plugin], interceptors=[_NoteEnds(ledger, name)]
            ):
                child_agent.append_synced(ledger, f"ready {name} -")
                async for _ in signals:
                    break
    finally:
        await store.aclose()
    child_agent.append_synced(ledger, f"stopped {name} -")


if __name__ == "__main__":
    address, queue, conninfo, ledger, name, mode = sys.argv[1:7]
    anyio.run(serve, address, queue, conninfo, ledger, name, mode, sys.argv[7:] == ["stop"])
