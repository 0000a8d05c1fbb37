"""Worker A of the paused-worker tests: it stops itself right after an intent is durable.

    python tests/kit/paused_worker_agent.py BACKEND CONNINFO RUN_ID STOP_AFTER LEDGER

The worker starts the run ``RUN_ID`` on PostgreSQL, with a lease of :data:`LEASE_S`,
under the AnyIO backend ``BACKEND``. Its store stops the whole process (``SIGSTOP``) the
moment its first intent of kind ``STOP_AFTER`` (``action`` or ``model_call``) has been
written durably: the intent is on record and the effect it announces has not started.
That is where a debugger, a paused virtual machine or a long pause of the host leaves a
worker at the worst moment, and it is reached by the worker's own code, not by timing.

Every effect outside the store is noted in ``LEDGER``, a file all workers append to
(``O_APPEND``, then ``fsync``), as ``<what> <worker> <result id>``: ``stop A r:0:action``
just before A stops itself, ``model A r:0:model`` when a model is called, ``pay A
r:0:action`` when a payment starts. The ledger, not the store, proves what ran.

Once continued (``SIGCONT``), the worker prints one line and exits: ``<error class>:
<message>`` with status :data:`EXIT_REFUSED` if the store refused it (``RunLocked``, or a
subclass such as ``LeaseLost``), else ``finished <stop reason>`` with status 0.

The parent imports :func:`build` to drive the same run as worker B: the same model,
tools and request, so the snapshot matches and B may resume what A started.
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

from kit import child_agent
from kit.agent import NUMBER_SCHEMA, answer, tool_call
from polyloop import (
    Definition,
    Intent,
    IntentKind,
    ModelCall,
    ModelReply,
    Replay,
    Request,
    RunLocked,
    Store,
    ToolRegistry,
    ToolSpec,
    run,
)
from polyloop.stores import PostgresStore
from polyloop.testing import ScriptedModelClient

# Short, so that a stopped worker loses its run within the test's patience.
LEASE_S = 1.0
# The status of a worker the store refused (EX_TEMPFAIL): neither success nor a crash.
EXIT_REFUSED = 75
# The worker this program is; the parent drives the run as another.
WORKER = "A"
# Pay (a first time, then again once the first payment is settled), then answer.
SCRIPT = (tool_call("pay", n=5), tool_call("pay", n=5), answer("paid once"))


class LedgerModel(ScriptedModelClient):
    """The scripted model, noting in the ledger which worker called it, before it answers."""

    def __init__(self, ledger: str, worker: str) -> None:
        super().__init__(SCRIPT, name="paused-worker")
        self.ledger = ledger
        self.worker = worker

    async def call(self, call: ModelCall) -> ModelReply:
        child_agent.append_synced(self.ledger, f"model {self.worker} {call.result_id}")
        return await super().call(call)


def payment_tools(ledger: str, worker: str) -> ToolRegistry:
    """``pay``, whose replay is never allowed (the default): each payment is noted."""

    async def pay(arguments: dict[str, Any], *, result_id: str) -> str:
        child_agent.append_synced(ledger, f"pay {worker} {result_id}")
        return f"paid {arguments['n']}"

    return ToolRegistry(
        [
            ToolSpec(
                name="pay",
                description="Pay an amount (a real payment: never repeated).",
                parameters=NUMBER_SCHEMA,
                handler=pay,
            )
        ],
        max_observation_chars=1_000,
    )


def build(store: Store, run_id: str, ledger: str, worker: str) -> tuple[Definition, Request]:
    """The run as any worker drives it; the model's replay is never allowed either."""
    return child_agent.build(
        store,
        run_id,
        LedgerModel(ledger, worker),
        payment_tools(ledger, worker),
        max_steps=10,
        instructions="Pay 5, once.",
        model_replay=Replay.NEVER,
    )


class StoppingStore(PostgresStore):
    """A PostgreSQL store whose process stops itself once an intent of one kind is durable.

    The stop comes after ``write_intent`` returned, so the intent is committed and
    flushed, and before the session could start the effect.
    """

    __slots__ = ("_ledger", "_stop_after", "_stopped")

    def __init__(self, conninfo: str, *, stop_after: IntentKind, ledger: str) -> None:
        super().__init__(conninfo, lease_s=LEASE_S)
        self._stop_after = stop_after
        self._ledger = ledger
        self._stopped = False

    async def write_intent(self, intent: Intent) -> None:
        await super().write_intent(intent)
        if intent.kind is self._stop_after and not self._stopped:
            self._stopped = True
            child_agent.append_synced(self._ledger, f"stop {WORKER} {intent.result_id}")
            # This very thread stops before it goes on (a signal sent to the process
            # could be taken by another thread first).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


async def _drive(conninfo: str, run_id: str, stop_after: str, ledger: str) -> tuple[str, int]:
    store = StoppingStore(conninfo, stop_after=IntentKind(stop_after), ledger=ledger)
    try:
        result = await run(*build(store, run_id, ledger, WORKER))
    except RunLocked as exc:
        return f"{type(exc).__name__}: {exc}", EXIT_REFUSED
    finally:
        await store.aclose()
    return f"finished {result.stop_reason.value}", 0


if __name__ == "__main__":
    backend, conninfo, run_id, stop_after, ledger = sys.argv[1:6]
    said, status = anyio.run(_drive, conninfo, run_id, stop_after, ledger, backend=backend)
    print(said, flush=True)
    sys.exit(status)
