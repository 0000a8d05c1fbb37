"""A zombie payment: the worker that lost its run pays late, and the probe's tombstone refuses it.

Worker A drives a run on PostgreSQL with a short lease. Its ``pay`` tool (replay never)
has passed the claim check and is held before it reaches the payments table: it stalls
A's own event loop (the shape of a paused process: a long garbage collection, a frozen
virtual machine), so A's lease keeper cannot renew and A's lease lapses in the database
for real. Worker B, a store object of its own in this test's event loop, takes the run
over with ``recover``. The payment is in doubt, and ``pay``'s probe settles it: it finds
no payment under the key, so it writes a tombstone there and answers "did not run". The
model pays again under the next step's key and the run finishes. Then A goes on: its
held payment fails on the key (``IntegrityError``), and every write it tries is refused
(``LeaseLost``). The payments table, outside the store, holds exactly one payment, and
the log is B's alone and verifies.

Worker A runs in a thread of its own with its own event loop, so that stalling it stops
neither B nor the test. Only PostgreSQL: its claims have leases, so a live but stalled
worker can lose a run to another. SQLite's and JSONL's claims are locks held until the
process ends (research record 0032): a stalled worker keeps its runs, and no zombie can
arise in a process that lives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import pytest

from kit.agent import NUMBER_SCHEMA, answer, definition, request, tool_call
from polyloop import (
    ActionStatus,
    JSONValue,
    LeaseLost,
    Reconciled,
    RunResult,
    RunState,
    StopReason,
    ToolRegistry,
    ToolSpec,
    recover,
    run,
    run_status,
)
from polyloop.cli import main as polyloop_command
from polyloop.stores import PostgresStore

# Slow: a lease lapses in real time.
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

RUN_ID = "r"
LEASE_S = 1.0
HOLD_TIMEOUT_S = 30.0  # A is always let go long before; a bound, not a wait
# Pay; pay again if the first payment did not go through; then answer.
SCRIPT = (tool_call("pay", n=5), tool_call("pay", n=5), answer("paid once"))


# -- the payments table: in a schema of its own, beside the store's ---------------------------


@dataclass(frozen=True)
class Payments:
    """One row per result id: a payment, or the probe's tombstone. Blocking calls."""

    conninfo: str

    def create(self) -> None:
        with psycopg.connect(self.conninfo, autocommit=True) as db:
            db.execute("CREATE SCHEMA ledger")
            db.execute(
                "CREATE TABLE ledger.payments (result_id text PRIMARY KEY,"
                " state text NOT NULL CHECK (state IN ('paid', 'void')),"
                " worker text NOT NULL, amount int)"
            )

    def pay(self, result_id: str, worker: str, amount: int) -> None:
        """``psycopg.errors.UniqueViolation`` (an ``IntegrityError``) if the key is taken."""
        with psycopg.connect(self.conninfo, autocommit=True) as db:
            db.execute(
                "INSERT INTO ledger.payments VALUES (%s, 'paid', %s, %s)",
                (result_id, worker, amount),
            )

    def paid_or_void(self, result_id: str, worker: str) -> str:
        """The state under the key, a tombstone written first if there was nothing.

        The unique key decides between this and a late payment: whichever inserts first
        takes the key, the other finds it taken (read committed: the select that follows
        sees the row that won).
        """
        with psycopg.connect(self.conninfo) as db, db.transaction():
            db.execute(
                "INSERT INTO ledger.payments (result_id, state, worker)"
                " VALUES (%s, 'void', %s) ON CONFLICT (result_id) DO NOTHING",
                (result_id, worker),
            )
            row = db.execute(
                "SELECT state FROM ledger.payments WHERE result_id = %s", (result_id,)
            ).fetchone()
        assert row is not None
        return str(row[0])

    def rows(self) -> list[tuple[str, str, str]]:
        with psycopg.connect(self.conninfo) as db:
            return db.execute(
                "SELECT result_id, state, worker FROM ledger.payments ORDER BY result_id"
            ).fetchall()


# -- the workers ------------------------------------------------------------------------------


@dataclass
class Hold:
    """Where A's payment waits: ``entered`` once it is inside ``pay``, past the claim
    check; it goes on when ``released``. What its late payment met is ``late_attempt``."""

    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    late_attempt: list[BaseException] = field(default_factory=list)


def payment_tools(payments: Payments, worker: str, hold: Hold | None = None) -> ToolRegistry:
    """``pay`` (replay never) with its probe; with ``hold``, the first payment stalls."""

    async def pay(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        amount = arguments["n"]
        assert isinstance(amount, int)
        if hold is not None and not hold.entered.is_set():
            hold.entered.set()
            # Blocks this worker's event loop on purpose: its lease keeper cannot renew.
            hold.released.wait(HOLD_TIMEOUT_S)
            try:
                await anyio.to_thread.run_sync(payments.pay, result_id, worker, amount)
            except psycopg.IntegrityError as exc:
                hold.late_attempt.append(exc)
                raise
        else:
            await anyio.to_thread.run_sync(payments.pay, result_id, worker, amount)
        return f"paid {amount}"

    async def probe(arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
        state = await anyio.to_thread.run_sync(payments.paid_or_void, result_id, worker)
        if state == "paid":
            return Reconciled(ran=True, observation=f"paid {arguments['n']}")
        return Reconciled(ran=False, observation="the payment did not go through")

    return ToolRegistry(
        [
            ToolSpec(
                name="pay",
                description="Pay an amount (a real payment: never repeated).",
                parameters=NUMBER_SCHEMA,
                handler=pay,
                reconcile=probe,
            )
        ],
        max_observation_chars=1_000,
    )


def worker_a(conninfo: str, payments: Payments, hold: Hold, backend: str) -> BaseException:
    """Worker A, in this thread and an event loop of its own: what its run raised."""

    async def drive() -> BaseException:
        async with PostgresStore(conninfo, lease_s=LEASE_S) as store:
            tools = payment_tools(payments, "A", hold)
            try:
                result = await run(definition(store, script=SCRIPT), request(RUN_ID, tools))
            except Exception as exc:  # noqa: BLE001 - what A met is the test's subject
                return exc
        raise AssertionError(f"worker A finished its run: {result.stop_reason}")

    return anyio.run(drive, backend=backend)


async def until_nobody_holds(store: PostgresStore) -> None:
    """Until A's lease has lapsed in the database (its clock decides: poll it)."""
    with anyio.fail_after(LEASE_S * 10):
        while (stored := await store.describe_run(RUN_ID)) is None or stored.claimed:  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def take_over(conninfo: str, payments: Payments) -> tuple[RunResult, Any]:
    """Worker B: recover the run A left; its result and the log it leaves."""
    async with PostgresStore(conninfo, lease_s=LEASE_S) as store:
        await until_nobody_holds(store)
        tools = payment_tools(payments, "B")
        (recovered,) = await recover(
            definition(store, script=SCRIPT),
            store,
            lambda run_id: request(run_id, tools),
            max_concurrent=1,
        )
        assert recovered.error is None, recovered.error
        assert recovered.result is not None
        return recovered.result, await store.read_log(RUN_ID)


@pytest.fixture
def payments(postgres_conninfo: str) -> Payments:
    table = Payments(postgres_conninfo)
    table.create()
    return table


async def test_a_zombie_payment_fails_on_the_probes_tombstone_and_one_payment_is_made(
    postgres_conninfo: str, payments: Payments, anyio_backend: str
) -> None:
    hold = Hold()
    a_met: list[BaseException] = []

    async def drive_a() -> None:
        a_met.append(
            await anyio.to_thread.run_sync(
                partial(worker_a, postgres_conninfo, payments, hold, anyio_backend)
            )
        )

    async with anyio.create_task_group() as group:
        group.start_soon(drive_a)
        try:
            entered = partial(hold.entered.wait, HOLD_TIMEOUT_S)
            assert await anyio.to_thread.run_sync(entered), "worker A never reached pay"
            # A is inside pay, past the claim check, and has paid nothing.
            assert await anyio.to_thread.run_sync(payments.rows) == []
            finished, left_by_b = await take_over(postgres_conninfo, payments)
        finally:
            hold.released.set()  # A goes on whatever happened, so the group can end

    # B: the probe voided A's key, the model paid again under the next one, and finished.
    assert finished.stop_reason is StopReason.FINAL_ANSWER
    assert finished.reconcile_failures == 0
    voided, paid, answered = finished.steps
    assert voided.action_status is ActionStatus.NOT_EXECUTED
    assert voided.settled_by == "reconcile:pay"
    assert voided.observation is not None and "did not go through" in voided.observation
    assert paid.action_status is ActionStatus.EXECUTED
    assert answered.final_answer == "paid once"
    # A: its late payment failed on the key, and its next write was refused.
    (late,) = hold.late_attempt
    assert isinstance(late, psycopg.errors.UniqueViolation), late
    (met,) = a_met
    assert isinstance(met, LeaseLost), met
    assert met.run_id == RUN_ID
    # Outside the store: one payment, B's, and A's key holds the tombstone.
    assert await anyio.to_thread.run_sync(payments.rows) == [
        ("r:0:action", "void", "B"),
        ("r:1:action", "paid", "B"),
    ]
    # The log is B's alone, and it verifies.
    verified = await anyio.to_thread.run_sync(
        polyloop_command, ["verify", postgres_conninfo, RUN_ID]
    )
    assert verified == 0, "polyloop verify found the log damaged"
    async with PostgresStore(postgres_conninfo) as reader:
        assert await reader.read_log(RUN_ID) == left_by_b  # A wrote nothing after B
        status = await run_status(reader, RUN_ID)
    assert status.state is RunState.FINISHED
    assert status.reconciled_steps == (0,)
