"""A payment that answers for its own key: a worker dies mid-payment, and no person is needed.

What it shows
    * a keyed effect: ``pay`` (replay never) inserts its payment into a ``payments`` table
      under the call's ``result_id``, which the table keeps unique;
    * its probe, ``ToolSpec(..., reconcile=...)``: asked about a payment whose outcome a
      crash lost, it atomically either finds the payment under the key (the payment ran)
      or writes a tombstone under the key (it did not, and now never will: a late attempt
      with that key fails on the unique key);
    * two crashes, each in a worker process that dies (``os._exit``) inside ``pay``, and
      the next ``start_or_resume`` that settles the run without a person:
        - after the payment, before its step was written: the probe finds the payment,
          the run records it as the step's result and finishes without paying again;
        - after the payment was announced, before anything was paid: the probe voids
          the key, the model is told the payment did not go through, and it pays again,
          under the next step's key. Either way the table holds exactly one payment.

The model is the scripted double from :mod:`polyloop.testing`: it pays until an
observation says it has paid, then submits. Everything is deterministic and offline.

How to run it::

    python examples/payments_probe.py                        # both stories, in a temp dir
    python examples/payments_probe.py --dir demo --backend trio

    # By hand, one worker at a time (the story does exactly this):
    python examples/payments_probe.py --dir demo --run-id invoice-1 --crash after-paying
    python examples/payments_probe.py --dir demo --run-id invoice-1

``--dir`` holds the store (``runs.db``) and the payments table (``payments.db``).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import closing
from pathlib import Path

import anyio
import anyio.to_thread

from polyloop import (
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
    RunResult,
    TextBlock,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    start_or_resume,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import SqliteStore
from polyloop.testing import ScriptedModelClient

CRASH_STATUS = 3
AMOUNT = 5
CRASHES = {
    "after-paying": "the worker died after paying, before the step was written",
    "before-paying": "the worker died after announcing the payment, before paying",
}
STORIES = (("invoice-1", "after-paying"), ("invoice-2", "before-paying"))


# -- the payments table: one row per result id, a payment or a tombstone ---------------------


class Payments:
    """The application's payments, in a SQLite file of its own (not the run store).

    ``result_id`` is UNIQUE: a key holds one payment, or one tombstone that voids it.
    Every method blocks; the tools call them through ``anyio.to_thread``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with closing(self._connect()) as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS payments ("
                " result_id TEXT NOT NULL UNIQUE,"
                " state TEXT NOT NULL CHECK (state IN ('paid', 'void')),"
                " amount INTEGER)"
            )

    def _connect(self) -> sqlite3.Connection:
        # Autocommit: each statement is its own transaction unless BEGIN says otherwise.
        return sqlite3.connect(self.path, isolation_level=None, timeout=10)

    def pay(self, result_id: str, amount: int) -> None:
        """Pay under ``result_id``; ``sqlite3.IntegrityError`` if the key already has a row
        (paid already, or voided by the probe)."""
        with closing(self._connect()) as db:
            db.execute(
                "INSERT INTO payments (result_id, state, amount) VALUES (?, 'paid', ?)",
                (result_id, amount),
            )

    def paid_or_void(self, result_id: str) -> tuple[str, int | None]:
        """The row under ``result_id``, written as a tombstone first if there was none.

        One transaction: whichever of this and a late payment reaches the key first wins,
        and the other finds the key taken.
        """
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "INSERT INTO payments (result_id, state) VALUES (?, 'void')"
                " ON CONFLICT (result_id) DO NOTHING",
                (result_id,),
            )
            state, amount = db.execute(
                "SELECT state, amount FROM payments WHERE result_id = ?", (result_id,)
            ).fetchone()
            db.execute("COMMIT")
            return state, amount

    def rows(self) -> list[tuple[str, str, int | None]]:
        with closing(self._connect()) as db:
            return db.execute(
                "SELECT result_id, state, amount FROM payments ORDER BY result_id"
            ).fetchall()


# -- the tools --------------------------------------------------------------------------------


def paid_text(amount: int | None, result_id: str) -> str:
    return f"paid {amount} under {result_id}"


def make_tools(payments: Payments, crash: str | None) -> ToolRegistry:
    def die_if(where: str) -> None:
        if crash == where:
            print(f"  {CRASHES[where]}", flush=True)
            os._exit(CRASH_STATUS)  # no clean-up at all, as if the process were killed

    async def pay(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        amount = arguments["amount"]
        assert isinstance(amount, int)
        die_if("before-paying")
        await anyio.to_thread.run_sync(payments.pay, result_id, amount)
        die_if("after-paying")
        return paid_text(amount, result_id)

    async def pay_probe(arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
        state, amount = await anyio.to_thread.run_sync(payments.paid_or_void, result_id)
        if state == "paid":
            return Reconciled(ran=True, observation=paid_text(amount, result_id))
        return Reconciled(
            ran=False, observation=f"nothing was paid under {result_id}, and the key is void"
        )

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        return f"accepted {arguments['answer']}"

    def schema(name: str, kind: JSONValue) -> dict[str, JSONValue]:
        return {
            "type": "object",
            "properties": {name: kind},
            "required": [name],
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            ToolSpec(
                name="pay",
                description="Pay the invoice.",
                parameters=schema("amount", {"type": "integer"}),
                handler=pay,  # replay never: a payment must not happen twice
                reconcile=pay_probe,  # ... and it can say whether it did
            ),
            ToolSpec(
                name="submit",
                description="Report that the invoice is paid. Ends the task.",
                parameters=schema("answer", {"type": "string"}),
                handler=submit,
                replay=Replay.ALLOWED,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


# -- the run ----------------------------------------------------------------------------------


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


def model_reply(call: ModelCall) -> str:
    """Pay until the last observation says it is paid, then submit."""
    last = call.messages[-1].content
    said = " ".join(block.text for block in last if isinstance(block, TextBlock))
    if "Result: paid" in said:
        return _call("submit", answer="the invoice is paid")
    return _call("pay", amount=AMOUNT)


def build(store: SqliteStore, run_id: str, tools: ToolRegistry) -> tuple[Definition, Request]:
    definition = Definition(
        model=ScriptedModelClient(model_reply, name="payments-example"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Not executed: {reason}", env_fault="Fault: {detail}"),
    )
    request = Request(
        run_id=run_id,
        budget=Budget(max_steps=8, max_valid_steps=6, max_context_chars=20_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "You pay invoices. Use the tools."),),
        goal_context=(Message.text(Role.USER, f"Pay invoice {run_id}: {AMOUNT}."),),
        injection=Injection(entries={}),
        binding={},
        model_replay=Replay.ALLOWED,
        observation_template="Result: {observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )
    return definition, request


async def drive(directory: Path, run_id: str, crash: str | None) -> RunResult:
    tools = make_tools(Payments(directory / "payments.db"), crash)
    async with SqliteStore(directory / "runs.db") as store:
        return await start_or_resume(*build(store, run_id, tools))


def show(result: RunResult) -> None:
    for step in result.steps:
        settled = f" (settled by {step.settled_by})" if step.settled_by else ""
        print(f"  step {step.step}: {step.action_text} -> {step.observation}{settled}")
    print(f"  {result.run_id}: {result.stop_reason.value} after {result.step_count} steps")


def crash_a_worker(directory: Path, run_id: str, crash: str, backend: str) -> None:
    """Run a worker process that dies inside ``pay``, where ``crash`` says."""
    worker = [sys.executable, __file__, "--dir", str(directory), "--backend", backend]
    died = subprocess.run([*worker, "--run-id", run_id, "--crash", crash], check=False)
    if died.returncode != CRASH_STATUS:
        raise SystemExit(f"the worker for {run_id} should have died, but exited {died.returncode}")


def story(directory: Path, backend: str) -> None:
    for run_id, crash in STORIES:
        print(f"{run_id}: a worker starts the run and pays")
        crash_a_worker(directory, run_id, crash, backend)
        print(f"{run_id}: the next worker resumes it, and the probe answers")
        show(anyio.run(drive, directory, run_id, None, backend=backend))
    rows = Payments(directory / "payments.db").rows()
    print("payments table:", "; ".join(f"{key} {state}" for key, state, _ in rows))
    print(f"payments made: {sum(state == 'paid' for _, state, _ in rows)} for {len(STORIES)} runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the store and the payments live")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--run-id", help="drive this one run only (default: both stories)")
    parser.add_argument("--crash", choices=sorted(CRASHES), help="die inside pay, there")
    args = parser.parse_args()
    if args.run_id is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        show(anyio.run(drive, args.dir, args.run_id, args.crash, backend=args.backend))
    elif args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        story(args.dir, args.backend)
    else:
        with tempfile.TemporaryDirectory() as directory:
            story(Path(directory), args.backend)


if __name__ == "__main__":
    main()
