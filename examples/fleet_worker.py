"""A fleet of worker processes on one PostgreSQL database; one is killed, its runs recovered.

What it shows
    * the shape of a worker process: at start-up it calls ``recover`` to pick up the
      unfinished runs that nobody drives (those of a worker that died), then drives the
      jobs assigned to it with ``start_or_resume``, a bounded number at once (a task group
      and a capacity limiter), and calls ``recover`` once more when its jobs are done;
    * several such processes sharing one :class:`~polyloop.stores.PostgresStore` schema:
      every job is one run, and the run's claim keeps it to one writer, whichever worker
      reaches it;
    * a worker killed with SIGKILL in the middle of its runs, then restarted: ``recover``
      resumes the runs the dead one left unfinished (in the new process at its start, or
      in a survivor at the end of its jobs, whichever comes first), and the new process
      starts the jobs the dead one never reached;
    * a ``Replay.NEVER`` tool, ``pay``, whose every execution is a row of a ledger kept
      outside the store (a table in another schema, committed before ``pay`` returns):
      no invoice is ever paid twice. A run killed inside ``pay`` ends ``in_doubt`` (the
      payment may have gone out or not: someone must look), and only such runs do;
    * with ``--probe``, the same fleet where ``pay`` has a probe (``ToolSpec.reconcile``)
      and the ledger a unique key on the payment's result id: a run killed inside ``pay``
      is settled by the probe when it is resumed, which either finds the payment (it
      ran) or writes a tombstone for its key (it did not, and now never will: a late
      attempt with that key fails on the key). No run is left in doubt, and the model
      pays again, under a new key, what the probe says was not paid.

Each job is an invoice. The model is the scripted double from :mod:`polyloop.testing`
(deterministic, offline, 30 ms a call): it checks the invoice, then pays the amount due.

How to run it::

    python examples/fleet_worker.py fleet                         # 4 workers, 40 invoices
    python examples/fleet_worker.py fleet --jobs 400 --kill       # kill worker 0 mid-flight
    python examples/fleet_worker.py fleet --kill --schema demo --keep
    python examples/fleet_worker.py fleet --jobs 400 --kill --probe   # no run left in doubt

``fleet`` is the supervisor: it seeds the jobs, starts the worker processes, kills
worker 0 with ``--kill`` once it has paid a third of its invoices, restarts it, and
prints a report. ``seed`` and ``worker`` are the two steps it runs, for running a fleet
by hand (give ``--probe`` to both, or to neither)::

    python examples/fleet_worker.py seed --schema demo --jobs 40 --workers 2
    python examples/fleet_worker.py worker --schema demo --slot 0 &
    python examples/fleet_worker.py worker --schema demo --slot 1

The connection string comes from ``--conninfo``, else the environment variable
``POLYLOOP_TEST_POSTGRES``, else ``postgresql://postgres@127.0.0.1:5432/test``. The runs
live in the schema ``--schema`` (for ``fleet``, a new one each time, dropped at the end
unless ``--keep``), the jobs and the ledger in the schema of that name plus ``_app``.
Needs the ``postgres`` extra, and ``trio`` for ``--backend trio``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import psycopg
from psycopg import errors, sql

from polyloop import (
    Budget,
    Definition,
    Injection,
    IntentKind,
    JSONValue,
    Message,
    ModelCall,
    NullSink,
    ObservationTexts,
    Reconciled,
    Replay,
    Request,
    Role,
    RunLocked,
    RunState,
    RunStatus,
    StopReason,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    recover,
    run_status,
    start_or_resume,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import PostgresStore
from polyloop.testing import ScriptedModelClient

ENV_VAR = "POLYLOOP_TEST_POSTGRES"
DEFAULT_CONNINFO = "postgresql://postgres@127.0.0.1:5432/test"
THIS_FILE = str(Path(__file__).resolve())
T = TypeVar("T")

MODEL_DELAY_S = 0.03  # a fast model
CHECK_DELAY_S = 0.01  # a lookup in the accounting system
BANK_DELAY_S = 0.04  # the bank confirms a transfer after it has been made
LOCKED_RETRY_S = 0.1
LOCKED_RETRIES = 100  # 10 s: then the job is left to whoever holds its run
OBSERVATION_PREFIX = "Observation: "
PAY_STEP = 1  # the step at which every run first calls pay; its result id is "<run>:1:action"


# -- the application's own tables: the jobs and the payments ledger -----------------------------


@dataclass(frozen=True)
class Job:
    run_id: str  # the invoice number is the run id
    slot: int  # the worker the job is assigned to
    amount_cents: int


class PaymentRefused(Exception):
    """A payment whose key is already on the ledger: a probe voided it, or it was paid."""


class AppTables:
    """The application's tables, in their own schema beside the store's.

    ``payments`` is the ledger of the ``pay`` tool: one row per execution, committed
    before the tool returns. Seeded ``keyed``, it has a unique key on the result id and
    may hold tombstones (``voided`` rows, written by the probe, which are not payments);
    otherwise it deliberately has no key, so that a payment made twice would show as two
    rows. Blocking psycopg calls; the async code runs them in threads.
    """

    def __init__(self, conninfo: str, schema: str) -> None:
        self.schema = f"{schema}_app"
        self._conn = psycopg.connect(conninfo, autocommit=True)
        self._jobs = sql.Identifier(self.schema, "jobs")
        self._payments = sql.Identifier(self.schema, "payments")

    def close(self) -> None:
        self._conn.close()

    def seed(self, jobs: int, workers: int, *, keyed: bool = False) -> None:
        """Create the tables and ``jobs`` invoices, assigned to the workers in turn."""
        self._conn.execute(
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
        )
        self._conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (run_id text PRIMARY KEY, slot int NOT NULL, "
                "amount_cents int NOT NULL)"
            ).format(self._jobs)
        )
        self._conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (result_id text NOT NULL, invoice text NOT NULL, "
                "slot int NOT NULL, pid int NOT NULL, amount_cents int NOT NULL, "
                "voided boolean NOT NULL DEFAULT false, "
                "paid_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(self._payments)
        )
        if keyed:
            self._conn.execute(
                sql.SQL("CREATE UNIQUE INDEX IF NOT EXISTS payments_key ON {} (result_id)").format(
                    self._payments
                )
            )
        with self._conn.cursor() as cursor:
            cursor.executemany(
                sql.SQL("INSERT INTO {} VALUES (%s, %s, %s) ON CONFLICT DO NOTHING").format(
                    self._jobs
                ),
                [(f"INV-{i:04d}", i % workers, 1_000 + i * 7_919 % 90_000) for i in range(jobs)],
            )

    def jobs(self) -> dict[str, Job]:
        rows = self._conn.execute(
            sql.SQL("SELECT run_id, slot, amount_cents FROM {} ORDER BY run_id").format(self._jobs)
        )
        return {run_id: Job(run_id, slot, amount) for run_id, slot, amount in rows}

    def pay(self, result_id: str, invoice: str, slot: int, amount_cents: int) -> None:
        try:
            self._conn.execute(
                sql.SQL(
                    "INSERT INTO {} (result_id, invoice, slot, pid, amount_cents) "
                    "VALUES (%s, %s, %s, %s, %s)"
                ).format(self._payments),
                (result_id, invoice, slot, os.getpid(), amount_cents),
            )
        except errors.UniqueViolation:
            raise PaymentRefused(
                f"payment {result_id} of {invoice} refused: its key is already on the ledger"
            ) from None

    def find_or_void(self, result_id: str, invoice: str, slot: int) -> int | None:
        """The amount paid under ``result_id``, or ``None`` once the key is void.

        Atomic on the unique key: either the payment's row is there, or this writes a
        tombstone under the key, after which a late payment with that key fails. A
        tombstone found (an earlier probe's) is the same answer: never paid.
        """
        voided = self._conn.execute(
            sql.SQL(
                "INSERT INTO {} (result_id, invoice, slot, pid, amount_cents, voided) "
                "VALUES (%s, %s, %s, %s, 0, true) ON CONFLICT (result_id) DO NOTHING "
                "RETURNING result_id"
            ).format(self._payments),
            (result_id, invoice, slot, os.getpid()),
        ).fetchone()
        if voided is not None:
            return None
        row = self._conn.execute(
            sql.SQL("SELECT voided, amount_cents FROM {} WHERE result_id = %s").format(
                self._payments
            ),
            (result_id,),
        ).fetchone()
        assert row is not None, result_id  # rows are never deleted
        return None if row[0] else int(row[1])

    def payments_by_slot(self) -> Counter[int]:
        rows = self._conn.execute(
            sql.SQL("SELECT slot, count(*) FROM {} WHERE NOT voided GROUP BY slot").format(
                self._payments
            )
        )
        return Counter(dict(rows.fetchall()))

    def payment_counts(self) -> Counter[str]:
        """How many times each result id was paid, across every worker process."""
        return self._count_payments_by("result_id")

    def invoice_payments(self) -> Counter[str]:
        """How many times each invoice was paid, under whatever result id."""
        return self._count_payments_by("invoice")

    def voided_keys(self) -> set[str]:
        """The result ids a probe voided (tombstones, not payments)."""
        rows = self._conn.execute(
            sql.SQL("SELECT result_id FROM {} WHERE voided").format(self._payments)
        )
        return {result_id for (result_id,) in rows}

    def _count_payments_by(self, column: str) -> Counter[str]:
        rows = self._conn.execute(
            sql.SQL("SELECT {}, count(*) FROM {} WHERE NOT voided GROUP BY 1").format(
                sql.Identifier(column), self._payments
            )
        )
        return Counter(dict(rows.fetchall()))

    def drop(self, store_schema: str) -> None:
        for name in (store_schema, self.schema):
            self._conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
            )


async def in_thread(func: Callable[..., T], *args: object) -> T:
    return await anyio.to_thread.run_sync(func, *args)


# -- the agent: model, tools, definition, request -----------------------------------------------


def script(call: ModelCall) -> str:
    """The scripted model: check the invoice, then pay what the check said is due (again,
    if it is told the payment was not made)."""
    invoice = call.binding["invoice"]
    if call.call_index == 0:
        return json.dumps({"tool": "check_invoice", "arguments": {"invoice": invoice}})
    due = amount_due(call.messages)
    return json.dumps({"tool": "pay", "arguments": {"invoice": invoice, "amount_cents": due}})


def amount_due(messages: tuple[Message, ...]) -> int:
    """The amount in the check's observation, the last one that is a bare number."""
    for message in reversed(messages):
        text = "".join(getattr(block, "text", "") for block in message.content)
        number = text.removeprefix(OBSERVATION_PREFIX)
        if text.startswith(OBSERVATION_PREFIX) and number.isdigit():
            return int(number)
    raise ValueError("no observation of check_invoice in the conversation")


def paid_text(amount_cents: int) -> str:
    return f"paid {amount_cents} cents"


def make_tools(jobs: dict[str, Job], app: AppTables, slot: int, *, probe: bool) -> ToolRegistry:
    async def check_invoice(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        await anyio.sleep(CHECK_DELAY_S)
        return str(jobs[str(arguments["invoice"])].amount_cents)

    async def pay(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        amount = arguments["amount_cents"]
        assert isinstance(amount, int)
        # The transfer is made (its ledger row committed) before the bank confirms it: a
        # worker killed in between has paid, but its run's log cannot know.
        await in_thread(app.pay, result_id, str(arguments["invoice"]), slot, amount)
        await anyio.sleep(BANK_DELAY_S)
        return paid_text(amount)

    async def pay_probe(arguments: dict[str, JSONValue], *, result_id: str) -> Reconciled:
        # Asked only about a pay whose run died inside it: was that key paid?
        paid = await in_thread(app.find_or_void, result_id, str(arguments["invoice"]), slot)
        if paid is None:
            return Reconciled(ran=False, observation="the payment was not made")
        return Reconciled(ran=True, observation=paid_text(paid))

    def schema(**properties: JSONValue) -> dict[str, JSONValue]:
        return {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            ToolSpec(
                name="check_invoice",
                description="The amount due on an invoice, in cents.",
                parameters=schema(invoice={"type": "string"}),
                handler=check_invoice,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="pay",
                description="Pay an invoice. Ends the task.",
                parameters=schema(invoice={"type": "string"}, amount_cents={"type": "integer"}),
                handler=pay,
                replay=Replay.NEVER,
                completes=True,
                reconcile=pay_probe if probe else None,
            ),
        ],
        max_observation_chars=200,
    )


def make_definition(store: PostgresStore) -> Definition:
    return Definition(
        model=ScriptedModelClient(script, delay=MODEL_DELAY_S, name="invoices"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(
            not_executed="Refused: {reason}", env_fault="Environment failure: {detail}"
        ),
    )


def make_request(job: Job, tools: ToolRegistry) -> Request:
    """The same job always gives the same request, which is what resuming requires."""
    return Request(
        run_id=job.run_id,
        budget=Budget(max_steps=4, max_valid_steps=4, max_context_chars=10_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "Check the invoice, then pay what is due."),),
        goal_context=(Message.text(Role.USER, f"Pay invoice {job.run_id}."),),
        injection=Injection(entries={}),
        binding={"invoice": job.run_id},
        model_replay=Replay.ALLOWED,
        observation_template=OBSERVATION_PREFIX + "{observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )


RequestFor = Callable[[str], Request]


def open_store(conninfo: str, schema: str) -> PostgresStore:
    # Small pools: a fleet of processes shares the server's connection limit.
    return PostgresStore(conninfo, schema=schema, pool_size=2, max_writer_connections=4)


# -- a worker process ---------------------------------------------------------------------------


@dataclass
class Sweep:
    """What one ``recover`` call of a worker did."""

    recovered: list[str] = field(default_factory=list)  # resumed to their end
    left_alone: int = 0  # a live writer held them
    seconds: float = 0.0
    done_at: float = 0.0  # time.time(), to compare with the supervisor's clock


@dataclass
class WorkerSummary:
    """What a worker process prints as its last line (one JSON object)."""

    slot: int
    pid: int
    at_start: Sweep
    at_end: Sweep
    jobs: dict[str, int]  # "started", "resumed" (or read from the log), "left to others"


async def sweep(
    definition: Definition, store: PostgresStore, request_for: RequestFor, concurrency: int
) -> Sweep:
    started = time.monotonic()
    report = await recover(definition, store, request_for, max_concurrent=concurrency)
    outcome = Sweep(seconds=time.monotonic() - started, done_at=time.time())
    for entry in report:
        if entry.result is not None:
            outcome.recovered.append(entry.run_id)
        elif isinstance(entry.error, RunLocked):
            outcome.left_alone += 1
        else:
            raise RuntimeError(f"run {entry.run_id} was not recovered") from entry.error
    return outcome


async def drive_jobs(
    definition: Definition, jobs: list[Job], request_for: RequestFor, concurrency: int
) -> Counter[str]:
    """Drive every job to its end, at most ``concurrency`` at once."""
    counts: Counter[str] = Counter()
    limiter = anyio.CapacityLimiter(concurrency)

    async def drive(job: Job) -> None:
        for _ in range(LOCKED_RETRIES):
            try:
                async with limiter:
                    result = await start_or_resume(definition, request_for(job.run_id))
            except RunLocked:
                # Another worker's recover() drives it, or the server has not yet closed
                # the session of a worker that died: either way the claim goes soon.
                await anyio.sleep(LOCKED_RETRY_S)
                continue
            counts["resumed" if result.resumed else "started"] += 1
            return
        counts["left to others"] += 1

    async with anyio.create_task_group() as group:
        for job in jobs:
            group.start_soon(drive, job)
    return counts


async def work(
    conninfo: str, schema: str, slot: int, concurrency: int, *, probe: bool = False
) -> WorkerSummary:
    app = await in_thread(AppTables, conninfo, schema)
    try:
        jobs = await in_thread(app.jobs)
        tools = make_tools(jobs, app, slot, probe=probe)

        def request_for(run_id: str) -> Request:
            return make_request(jobs[run_id], tools)

        async with open_store(conninfo, schema) as store:
            definition = make_definition(store)
            at_start = await sweep(definition, store, request_for, concurrency)
            mine = [job for job in jobs.values() if job.slot == slot]
            counts = await drive_jobs(definition, mine, request_for, concurrency)
            at_end = await sweep(definition, store, request_for, concurrency)
    finally:
        app.close()
    return WorkerSummary(slot, os.getpid(), at_start, at_end, dict(counts))


# -- the supervisor -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    conninfo: str
    schema: str
    jobs: int = 40
    workers: int = 4
    concurrency: int = 16
    backend: str = "asyncio"
    probe: bool = False  # pay has a probe, and the ledger a unique key


@dataclass
class WorkerProcess:
    slot: int
    process: anyio.abc.Process
    summary: WorkerSummary | None = None  # None until it exits normally; stays None if killed

    @classmethod
    async def start(cls, settings: Settings, slot: int) -> WorkerProcess:
        process = await anyio.open_process(
            [
                sys.executable,
                THIS_FILE,
                "worker",
                "--schema",
                settings.schema,
                "--slot",
                str(slot),
                "--concurrency",
                str(settings.concurrency),
                "--backend",
                settings.backend,
                *(["--probe"] if settings.probe else []),
            ],
            stdin=subprocess.DEVNULL,
            stderr=None,  # a worker's errors go to our stderr
            env={**os.environ, ENV_VAR: settings.conninfo},  # not on the command line
        )
        return cls(slot, process)

    async def collect(self) -> None:
        """Wait for the process to end and read its summary; raise if it failed."""
        async with self.process:  # a cancelled supervisor kills the process
            assert self.process.stdout is not None
            output = b"".join([chunk async for chunk in self.process.stdout])
            status = await self.process.wait()
        if status == -signal.SIGKILL:
            return
        if status != 0:
            raise RuntimeError(f"worker {self.slot} exited with status {status}")
        data = json.loads(output.decode().strip().splitlines()[-1])
        self.summary = WorkerSummary(
            slot=data["slot"],
            pid=data["pid"],
            at_start=Sweep(**data["at_start"]),
            at_end=Sweep(**data["at_end"]),
            jobs=data["jobs"],
        )


@dataclass(frozen=True)
class Recovery:
    who: str  # which worker, and which of its two recover() calls
    runs: int  # how many of the dead worker's runs it resumed
    seconds: float  # how long the call took
    done_at: float  # time.time() when it returned


@dataclass
class FleetReport:
    settings: Settings
    kill: bool  # whether a kill was asked for
    victim: int | None = None  # the slot killed, if the kill landed
    payments_before_kill: int = 0
    orphans: tuple[str, ...] = ()  # the victim's runs left unfinished when it died
    inside_pay: tuple[str, ...] = ()  # of those, the ones killed between pay's intent and result
    victim_runs: frozenset[str] = frozenset()  # every run of the victim's slot
    killed_at: float = 0.0  # time.time()
    summaries: list[WorkerSummary] = field(default_factory=list)  # of the workers not killed
    stop_reasons: Counter[str] = field(default_factory=Counter)
    in_doubt: tuple[str, ...] = ()
    reconciled: tuple[str, ...] = ()  # the runs a probe settled
    unfinished: int = 0
    payments: Counter[str] = field(default_factory=Counter)  # result id -> executions
    invoice_payments: Counter[str] = field(default_factory=Counter)  # invoice -> executions
    voided: frozenset[str] = frozenset()  # result ids a probe voided

    def add_orphans_recovered_before_the_count(self) -> None:
        """Add the victim's runs that a live worker resumed to their end before they were
        counted: the kill left them unfinished too."""
        recovered = {
            run_id
            for summary in self.summaries
            for run_id in summary.at_start.recovered + summary.at_end.recovered
        }
        missed = (recovered & self.victim_runs) - set(self.orphans)
        self.orphans += tuple(sorted(missed))

    def recoveries(self) -> list[Recovery]:
        """The ``recover`` calls that resumed the dead worker's runs, each run counted once."""
        left, found = set(self.orphans), []
        sweeps = [
            (summary, phase, sweep)
            for summary in self.summaries
            for phase, sweep in (
                ("at its start", summary.at_start),
                ("at the end of its jobs", summary.at_end),
            )
        ]
        for summary, phase, sweep in sorted(sweeps, key=lambda item: item[2].done_at):
            runs = left & set(sweep.recovered)
            if runs:
                left -= runs
                restarted = "the restarted " if summary.slot == self.victim else ""
                found.append(
                    Recovery(
                        f"{restarted}worker {summary.slot} {phase}",
                        len(runs),
                        sweep.seconds,
                        sweep.done_at,
                    )
                )
        return found

    def recovery_s(self) -> float:
        """From the kill until the last of the dead worker's runs was recovered."""
        return max((r.done_at for r in self.recoveries()), default=self.killed_at) - self.killed_at

    def problems(self) -> list[str]:
        found = []
        if self.unfinished:
            found.append(f"{self.unfinished} runs unfinished")
        if any(count > 1 for count in self.invoice_payments.values()):
            found.append("an invoice was paid twice")
        if self.settings.probe:
            if self.in_doubt:
                found.append(f"{len(self.in_doubt)} runs in doubt although pay has a probe")
            if not set(self.inside_pay) <= set(self.reconciled):
                found.append("runs killed inside 'pay' that the probe did not settle")
        elif set(self.in_doubt) != set(self.inside_pay):
            found.append("runs in doubt other than those killed inside 'pay'")
        if sum(recovery.runs for recovery in self.recoveries()) != len(self.orphans):
            found.append("runs of the dead worker that recover() did not resume")
        return found


async def kill_mid_flight(victim: WorkerProcess, app: AppTables, after_payments: int) -> int | None:
    """SIGKILL the victim right after its payment number ``after_payments`` or a later one.

    Right after a payment, the run that made it is inside ``pay``, waiting for the bank,
    so the kill leaves at least that run in doubt. Returns how many payments the victim
    had made, or ``None`` if it ended first.
    """
    seen = 0
    while True:
        paid = (await in_thread(app.payments_by_slot))[victim.slot]
        if paid >= after_payments and paid > seen:
            victim.process.send_signal(signal.SIGKILL)
            return paid
        if victim.process.returncode is not None:
            return None
        seen = paid
        await anyio.sleep(0.005)


async def left_by_the_kill(store: PostgresStore, run_ids: set[str]) -> list[RunStatus]:
    """The runs among ``run_ids`` the kill left unfinished, once their claims are gone.

    A dead worker's claims go when the server closes its sessions, which it does as
    soon as it notices the closed connections; until then the runs read as running.
    Another worker's ``recover()`` may already have taken some of them up: a run that
    ended in doubt can only have been left by the kill, so it counts here; one already
    resumed to a normal end shows up later, in that worker's report.
    """
    with anyio.fail_after(30):
        while True:
            listed = [run for run in await store.list_runs() if run.run_id in run_ids]
            if not any(run.claimed for run in listed):
                statuses = [await run_status(store, run.run_id) for run in listed]
                return [status for status in statuses if status.state is not RunState.FINISHED]
            await anyio.sleep(0.01)


def inside_never_tool(status: RunStatus) -> bool:
    intent = status.open_intent
    return intent is not None and intent.kind is IntentKind.ACTION and intent.replay is Replay.NEVER


async def kill_and_restart(
    victim: WorkerProcess,
    settings: Settings,
    jobs: dict[str, Job],
    app: AppTables,
    store: PostgresStore,
    report: FleetReport,
) -> WorkerProcess | None:
    """Kill the victim mid-flight, note what it left, and start a new process in its slot."""
    mine = {job.run_id for job in jobs.values() if job.slot == victim.slot}
    paid = await kill_mid_flight(victim, app, after_payments=max(1, len(mine) // 3))
    if paid is None:
        return None
    report.killed_at = time.time()
    report.victim, report.payments_before_kill = victim.slot, paid
    report.victim_runs = frozenset(mine)
    orphans = await left_by_the_kill(store, mine)
    report.orphans = tuple(status.run_id for status in orphans)
    report.inside_pay = tuple(status.run_id for status in orphans if inside_never_tool(status))
    return await WorkerProcess.start(settings, victim.slot)


async def read_outcome(store: PostgresStore, jobs: dict[str, Job], report: FleetReport) -> None:
    """How every run ended, read from the store once the fleet is gone."""
    listed = await store.list_runs()
    report.unfinished = len(jobs) - len(listed)  # jobs never started
    for run in listed:
        status = await run_status(store, run.run_id)
        if status.state is RunState.IN_DOUBT:
            report.in_doubt += (run.run_id,)
        if status.reconciled_steps:
            report.reconciled += (run.run_id,)
        ended = status.state in (RunState.FINISHED, RunState.IN_DOUBT)
        if ended and status.stop_reason is not None:
            report.stop_reasons[status.stop_reason.value] += 1
        else:
            report.unfinished += 1


async def run_fleet(settings: Settings, *, kill: bool) -> FleetReport:
    """Seed, run the workers (killing and restarting worker 0 if asked), and report."""
    report = FleetReport(settings, kill)
    app = await in_thread(AppTables, settings.conninfo, settings.schema)
    try:
        await in_thread(partial(app.seed, settings.jobs, settings.workers, keyed=settings.probe))
        jobs = await in_thread(app.jobs)
        async with open_store(settings.conninfo, settings.schema) as store:
            workers = [
                await WorkerProcess.start(settings, slot) for slot in range(settings.workers)
            ]
            async with anyio.create_task_group() as group:
                for worker in workers:
                    group.start_soon(worker.collect)
                if kill:
                    restarted = await kill_and_restart(
                        workers[0], settings, jobs, app, store, report
                    )
                    if restarted is not None:
                        workers.append(restarted)
                        group.start_soon(restarted.collect)
            report.summaries = [w.summary for w in workers if w.summary is not None]
            report.add_orphans_recovered_before_the_count()
            await read_outcome(store, jobs, report)
        report.payments = await in_thread(app.payment_counts)
        report.invoice_payments = await in_thread(app.invoice_payments)
        report.voided = frozenset(await in_thread(app.voided_keys))
    finally:
        app.close()
    return report


def pay_key(run_id: str) -> str:
    """The result id of a run's first call of pay."""
    return f"{run_id}:{PAY_STEP}:action"


def print_report(report: FleetReport) -> None:
    settings = report.settings
    print(
        f"fleet {settings.schema}: {settings.jobs} invoices, {settings.workers} worker "
        f"processes, up to {settings.concurrency} runs at once in each"
    )
    if report.victim is not None:
        print(
            f"  worker {report.victim} killed (SIGKILL) after {report.payments_before_kill} "
            f"payments: {len(report.orphans)} runs left unfinished, "
            f"{len(report.inside_pay)} of them inside 'pay'"
        )
        recoveries = report.recoveries()
        if recoveries:
            print(
                "  recover() resumed them: "
                + ", ".join(f"{r.runs} in {r.who} ({r.seconds:.2f} s)" for r in recoveries)
                + f"; all ended {report.recovery_s():.2f} s after the kill"
            )
    elif report.kill:
        print("  worker 0 ended before it could be killed")
    reasons = report.stop_reasons
    finished = sum(reasons.values())
    print(
        f"runs: {finished} finished ({reasons[StopReason.SUBMITTED.value]} submitted, "
        f"{reasons[StopReason.IN_DOUBT.value]} in doubt), {report.unfinished} unfinished"
    )
    if report.in_doubt:
        exact = set(report.in_doubt) == set(report.inside_pay)
        print(f"  in doubt: {'exactly ' if exact else 'NOT only '}the runs killed inside 'pay'")
    if report.reconciled:
        voided = sum(1 for run_id in report.reconciled if pay_key(run_id) in report.voided)
        print(
            f"  settled by the probe: {len(report.reconciled)} runs "
            f"({len(report.reconciled) - voided} had paid, {voided} had not: paid again)"
        )
    twice = sorted(invoice for invoice, n in report.invoice_payments.items() if n > 1)
    in_doubt_paid = sum(1 for run_id in report.in_doubt if report.payments[pay_key(run_id)])
    print(
        f"payments: {sum(report.payments.values())} on the ledger, "
        + (f"made twice: {', '.join(twice)}" if twice else "none made twice")
        + (
            f"; in-doubt runs that had paid: {in_doubt_paid} of {len(report.in_doubt)}"
            if report.in_doubt
            else ""
        )
    )


# -- the command line ---------------------------------------------------------------------------


async def fleet_main(settings: Settings, *, kill: bool, keep: bool) -> list[str]:
    try:
        report = await run_fleet(settings, kill=kill)
    finally:
        if not keep:
            app = await in_thread(AppTables, settings.conninfo, settings.schema)
            await in_thread(app.drop, settings.schema)
            app.close()
    print_report(report)
    if keep:
        print(f"kept the schemas {settings.schema} and {settings.schema}_app")
    return report.problems()


async def seed_main(conninfo: str, schema: str, jobs: int, workers: int, probe: bool) -> None:
    app = await in_thread(AppTables, conninfo, schema)
    try:
        await in_thread(partial(app.seed, jobs, workers, keyed=probe))
    finally:
        app.close()
    print(f"seeded {jobs} invoices for {workers} workers in {schema}_app.jobs")


async def worker_main(conninfo: str, schema: str, slot: int, concurrency: int, probe: bool) -> None:
    summary = await work(conninfo, schema, slot, concurrency, probe=probe)
    print(json.dumps(asdict(summary)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fleet = commands.add_parser("fleet", help="seed, run a fleet of workers, report")
    seed = commands.add_parser("seed", help="create the job and ledger tables, add jobs")
    worker = commands.add_parser("worker", help="run one worker process")
    for command in (fleet, seed, worker):
        command.add_argument(
            "--conninfo",
            default=os.environ.get(ENV_VAR) or DEFAULT_CONNINFO,
            help="libpq connection string or URL of the database",
        )
    fleet.add_argument(
        "--schema",
        default=f"fleet_{uuid.uuid4().hex[:8]}",
        help="schema of the runs (default: a new one, dropped at the end)",
    )
    for command in (seed, worker):
        command.add_argument("--schema", required=True, help="schema of the runs")
    for command in (fleet, seed):
        command.add_argument("--jobs", type=int, default=40, help="how many invoices")
        command.add_argument("--workers", type=int, default=4, help="how many workers")
    for command in (fleet, worker):
        command.add_argument(
            "--concurrency", type=int, default=16, help="runs one worker drives at once"
        )
        command.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    fleet.add_argument(
        "--kill", action="store_true", help="SIGKILL worker 0 mid-flight, then restart it"
    )
    fleet.add_argument("--keep", action="store_true", help="keep the schemas")
    for command in (fleet, seed, worker):
        command.add_argument(
            "--probe",
            action="store_true",
            help="give pay a probe and the ledger a unique key: no run is left in doubt",
        )
    worker.add_argument("--slot", type=int, required=True, help="which jobs are this worker's")
    args = parser.parse_args()

    if args.command == "seed":
        anyio.run(seed_main, args.conninfo, args.schema, args.jobs, args.workers, args.probe)
    elif args.command == "worker":
        anyio.run(
            worker_main,
            args.conninfo,
            args.schema,
            args.slot,
            args.concurrency,
            args.probe,
            backend=args.backend,
        )
    else:
        settings = Settings(
            args.conninfo,
            args.schema,
            args.jobs,
            args.workers,
            args.concurrency,
            args.backend,
            args.probe,
        )
        problems = anyio.run(
            partial(fleet_main, settings, kill=args.kill, keep=args.keep), backend=args.backend
        )
        if problems:
            sys.exit("problems: " + "; ".join(problems))


if __name__ == "__main__":
    main()
