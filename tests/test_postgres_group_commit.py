"""Group commit in the PostgreSQL store, against a real server, under asyncio and Trio.

Writes of different runs that wait at the same moment share one commit; each caller
returns only after the commit that holds its rows; an item refused or failing on its
own fails alone; a connection lost in the middle of a batch fails every run of that
connection and a new store object resumes them; a cancellation before a batch starts
writes nothing; a batch holding a barrier always commits with ``synchronous_commit`` on.

The tests watch commits through the store's private probe, which the batch thread calls
just before each statement, and steer batches by keeping the only writer connection busy.
Every run is claimed before its writes are queued: a claim needs the writer connection,
which a held batch keeps busy.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import psycopg
import pytest
from psycopg import sql

import pg
from agent_kit import (
    InterruptedModel,
    Ledger,
    definition,
    make_tools,
    request,
    same_outcome,
    six_step_script,
)
from polyloop import Replay, RunResult, resume, run
from polyloop.stores import PostgresStore, _postgres, _postgres_sql
from polyloop.testing.store_contract import (
    DurableStoreContract,
    apply,
    expected_records,
    sample_run,
)
from polyloop.types import Record, RunAlreadyExists, RunLocked, RunStarted, StoreError

pytestmark = pytest.mark.anyio

Rows = tuple[tuple[str, str], ...]
Call = Callable[[], Awaitable[object]]
BARRIER_KINDS = frozenset({"run_started", "intent"})
WAIT_S = 30


@dataclass(frozen=True)
class Commit:
    """One statement (one transaction) as the batch thread saw it just before sending it;
    a statement the server refused is one too."""

    setting: str  # SHOW synchronous_commit on the connection, inside the transaction if open
    rows: Rows  # (run id, kind) of every row the statement carries
    sent: tuple[str, ...]  # the SQL of the statements that make up the transaction

    @property
    def barrier(self) -> bool:
        return any(kind in BARRIER_KINDS for _, kind in self.rows)

    @property
    def lazy(self) -> bool:
        return any("synchronous_commit" in text for text in self.sent)


class Probe:
    """Watches a store's commits from its batch thread.

    ``commits`` holds every commit (see :class:`Commit`). :meth:`hold` makes the next
    commit wait for :meth:`release`; :meth:`kill_at` ends the server session at the
    commit that holds a row of the given run.
    """

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.commits: list[Commit] = []
        self.entered = threading.Event()
        self._go = threading.Event()
        self._holding = False
        self._kill: str | None = None

    def hold(self) -> None:
        self.entered.clear()
        self._go.clear()
        self._holding = True

    def release(self) -> None:
        self._go.set()

    def kill_at(self, run_id: str) -> None:
        self._kill = run_id

    def __call__(self, conn: psycopg.Connection[Any], rows: Rows, sent: tuple[str, ...]) -> None:
        if self._holding:
            self._holding = False
            self.entered.set()
            assert self._go.wait(WAIT_S)
        if self._kill is not None and any(run_id == self._kill for run_id, _ in rows):
            self._kill = None
            _terminate(self.conninfo, conn.info.backend_pid)
            return
        row = conn.execute("SHOW synchronous_commit").fetchone()
        assert row is not None
        self.commits.append(Commit(str(row[0]), rows, sent))


def _terminate(conninfo: str, pid: int) -> None:
    """End a server session and wait until it is gone (its locks with it)."""
    with pg.admin(conninfo) as conn:
        row = conn.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
    assert row == (True,)


@pytest.fixture
def probe(postgres_conninfo: str) -> Probe:
    return Probe(postgres_conninfo)


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The run ids of every batch any store commits during the test, batch by batch."""
    seen: list[list[str]] = []
    original = PostgresStore._commit_batch

    def spy(self: PostgresStore, writer: Any, items: Any) -> Any:
        seen.append([item.slot.run_id for item in items])
        return original(self, writer, items)

    monkeypatch.setattr(PostgresStore, "_commit_batch", spy)
    return seen


def watched(conninfo: str, probe: Probe, **options: Any) -> PostgresStore:
    store = PostgresStore(conninfo, **options)
    store._commit_probe = probe
    return store


def started(run_id: str) -> RunStarted:
    record = sample_run(run_id)[0][1][0]
    assert isinstance(record, RunStarted)
    return record


def write(store: PostgresStore, writes: list[tuple[str, Any]]) -> Call:
    """Make ``writes`` on a run that ``store`` has claimed already."""
    return lambda: apply(store, writes, claim=False)


async def claim(store: PostgresStore, *run_ids: str) -> None:
    for run_id in run_ids:
        await store.claim_run(run_id)


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(WAIT_S):
        while True:
            if condition():
                return
            await anyio.sleep(0.002)


async def log_of(store: PostgresStore, run_id: str) -> list[Record]:
    return list((await store.read_log(run_id)).records)


class Busy:
    """Keeps a store's only writer connection busy, so that what comes next queues.

    One write commits in a thread hop of its own and is held at its commit by the
    probe; a second write starts a batch that waits behind it. Every write made until
    :meth:`release` then joins the batch after those two.
    """

    def __init__(self, store: PostgresStore, probe: Probe) -> None:
        self.store = store
        self.probe = probe
        self.runs = [f"busy-{uuid.uuid4().hex[:8]}-{n}" for n in (1, 2)]

    async def start(self, group: anyio.abc.TaskGroup) -> None:
        await claim(self.store, *self.runs)
        self.probe.hold()
        group.start_soon(self.store.start_run, started(self.runs[0]))
        assert await anyio.to_thread.run_sync(self.probe.entered.wait, WAIT_S)
        group.start_soon(self.store.start_run, started(self.runs[1]))
        await until(lambda: self.writer.group._running is not None)

    @property
    def writer(self) -> Any:
        [writer] = self.store._writers
        return writer

    def in_flight(self) -> int:
        return int(self.writer.writing)

    def release(self) -> None:
        self.probe.release()


async def in_one_batch(store: PostgresStore, probe: Probe,
                       calls: list[Call]) -> list[BaseException | None]:
    """Make ``calls`` one after another while the connection is busy: one batch holds
    them all, in that order. Returns each call's exception, or None."""
    outcomes: list[BaseException | None] = [None] * len(calls)

    async def capture(index: int, call: Call) -> None:
        try:
            await call()
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            outcomes[index] = exc

    busy = Busy(store, probe)
    async with anyio.create_task_group() as group:
        await busy.start(group)
        for index, call in enumerate(calls):
            group.start_soon(capture, index, call)
            await until(lambda n=index: busy.in_flight() == 3 + n)
        busy.release()
    return outcomes


# -- shared commits ---------------------------------------------------------------------------


async def _write_at_once_and_check(store: PostgresStore, run_ids: list[str]) -> None:
    """Write a two-step sample run for each id, all at once; each log must be exactly it."""
    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(apply, store, sample_run(run_id, steps=2))
    for run_id in run_ids:
        assert await log_of(store, run_id) == expected_records(sample_run(run_id, steps=2))


async def test_concurrent_runs_share_commits(postgres_conninfo: str, probe: Probe) -> None:
    run_ids = [f"run-{n}" for n in range(50)]
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await _write_at_once_and_check(store, run_ids)
    writes = len(run_ids) * len(sample_run("x", steps=2))
    rows = [row for commit in probe.commits for row in commit.rows]
    assert len(rows) == len(run_ids) * len(expected_records(sample_run("x", steps=2)))
    assert len(probe.commits) <= writes // 5
    assert max(len({run_id for run_id, _ in commit.rows}) for commit in probe.commits) >= 10


@pytest.mark.parametrize("grouped", [True, False], ids=["group", "one-per-write"])
async def test_each_row_is_visible_elsewhere_when_its_call_returns(
    postgres_conninfo: str, grouped: bool
) -> None:
    store = PostgresStore(postgres_conninfo, max_writer_connections=2, _group_commit=grouped)
    async with store, PostgresStore(postgres_conninfo) as reader:

        async def one(run_id: str) -> None:
            writes = sample_run(run_id, steps=2)
            await store.claim_run(run_id)
            for done in range(1, len(writes) + 1):
                await apply(store, writes[done - 1:done], claim=False)
                assert await log_of(reader, run_id) == expected_records(writes[:done])

        async with anyio.create_task_group() as group:
            for n in range(20):
                group.start_soon(one, f"run-{n}")


async def test_several_writes_of_one_run_in_one_batch_get_consecutive_seqs(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    writes = sample_run("m", steps=2)
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await apply(store, writes[:1])
        calls = [write(store, [one]) for one in writes[1:9]]
        assert await in_one_batch(store, probe, calls) == [None] * len(calls)
        assert ["m"] * len(calls) in batches
        await apply(store, writes[9:], claim=False)
        assert await log_of(store, "m") == expected_records(writes)


async def test_runs_ended_in_one_batch_are_unlocked_once_it_commits(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    runs = {run_id: sample_run(run_id, steps=1) for run_id in ("e1", "e2", "open")}
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        for writes in runs.values():
            await apply(store, writes[:-1])
        calls = [write(store, runs[run_id][-1:]) for run_id in ("e1", "e2")]
        assert await in_one_batch(store, probe, calls) == [None, None]
        assert ["e1", "e2"] in batches
        async with PostgresStore(postgres_conninfo) as other:
            for run_id in ("e1", "e2"):
                await other.claim_run(run_id)
                with pytest.raises(StoreError, match="has ended"):  # a final end
                    await other.write_intent(_postgres_intent(run_id))
            with pytest.raises(RunLocked):  # the run still open keeps its lock
                await other.claim_run("open")


def _postgres_intent(run_id: str) -> Any:
    return sample_run(run_id, steps=2)[5][1][0]


class Statements:
    """Every statement the store's writer connections execute, in order (the probe's own
    ``SHOW`` left out)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[str] = []
        opened = _postgres._open_writer

        def open_writer(conninfo: str, *args: Any, **options: Any) -> psycopg.Connection[Any]:
            conn = opened(conninfo, *args, **options)
            execute = conn.execute

            def counted(query: Any, *args: Any, **kwargs: Any) -> Any:
                text = query if isinstance(query, str) else query.as_string(conn)
                if text != "SHOW synchronous_commit":
                    self.sent.append(text)
                return execute(query, *args, **kwargs)

            conn.execute = counted  # type: ignore[method-assign]
            return conn

        monkeypatch.setattr(_postgres, "_open_writer", open_writer)


async def test_a_batch_of_more_than_a_thousand_rows_is_one_statement(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each run writes one step with its action result (two rows) in the batch.
    run_ids = [f"wide-{n:03d}" for n in range(600)]
    steps = {run_id: sample_run(run_id, steps=1)[4] for run_id in run_ids}
    statements = Statements(monkeypatch)
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(apply, store, [("start_run", (started(run_id),))])
        busy = Busy(store, probe)
        async with anyio.create_task_group() as group:
            await busy.start(group)
            for run_id in run_ids:
                group.start_soon(write(store, [steps[run_id]]))
            await until(lambda: busy.in_flight() == 2 + len(run_ids))
            sent_before = len(statements.sent)
            commits_before = len(probe.commits)
            busy.release()
        assert sorted(run_ids) in [sorted(batch) for batch in batches]
        [wide] = [commit for commit in probe.commits[commits_before:]
                  if len(commit.rows) > 2]
        assert len(wide.rows) == 2 * len(run_ids) > 1000
        assert len(wide.sent) == 1
        # What the connection really executed meanwhile: the two held writes, one
        # statement each, then the wide batch in one statement.
        assert statements.sent[sent_before:] == [
            commit.sent[0] for commit in probe.commits[commits_before:]]
        assert len(probe.commits[commits_before:]) == 3
        for run_id in run_ids:
            assert await log_of(store, run_id) == expected_records(
                [("start_run", (started(run_id),)), steps[run_id]])


# -- durability of barriers --------------------------------------------------------------------


async def test_barriers_commit_with_synchronous_commit_on(
    postgres_conninfo: str, probe: Probe
) -> None:
    # Whether the setting really is off inside a lazy statement's own transaction (and
    # only there) is checked below, on the store's own statements.
    async with watched(postgres_conninfo, probe, max_writer_connections=2) as store:
        await apply(store, sample_run("alone", steps=2))
        async with anyio.create_task_group() as group:
            for n in range(20):
                group.start_soon(apply, store, sample_run(f"run-{n}", steps=2))
    for commit in probe.commits:
        assert commit.lazy is not commit.barrier, commit
        if commit.barrier:
            assert commit.setting == "on", commit
    assert any(commit.barrier and len(commit.rows) > 1 for commit in probe.commits)
    assert any(not commit.barrier for commit in probe.commits)
    assert all(len(commit.sent) == 1 for commit in probe.commits)


async def test_a_lazy_write_turns_synchronous_commit_off_for_its_own_transaction(
    postgres_conninfo: str,
) -> None:
    writes = sample_run("r", steps=1)
    async with PostgresStore(postgres_conninfo) as store:
        await apply(store, writes[:1])  # creates the schema and the run's row
        queries = store._queries
    # The store's own statements, appending the run's intent as its claim would; the
    # claim above has been given up, so its epoch is still the run's.
    key = _postgres_sql.run_key("r")
    kind, body = _postgres_sql.record_row(writes[1][1][0])
    runs = sql.Identifier("polyloop", "runs")

    def settings() -> list[tuple[str, bool]]:
        with pg.admin(postgres_conninfo) as conn:
            row = conn.execute(sql.SQL("SELECT epoch FROM {} WHERE run_key = %s").format(runs),
                               (key,)).fetchone()
            assert row is not None
            params = {"run_keys": [key], "epochs": [row[0]], "first_seqs": [1],
                      "next_seqs": [2], "finals": [False], "ends": [False],
                      "reasons": [None], "row_keys": [key], "seqs": [1], "row_ids": ["r"],
                      "kinds": [kind], "bodies": [body]}
            seen = []
            for query in (queries.write, queries.lazy_write):
                conn.execute("BEGIN")
                admitted = conn.execute(query, params).fetchall()
                seen.append((_setting(conn), admitted == [(key,)]))
                conn.execute("ROLLBACK")
            admitted = conn.execute(queries.lazy_write, params).fetchall()  # alone
            seen.append((_setting(conn), admitted == [(key,)]))
            return seen

    # Barrier: on. Lazy: off inside its transaction, and on again once it committed.
    assert await anyio.to_thread.run_sync(settings) == [("on", True), ("off", True),
                                                          ("on", True)]
    async with PostgresStore(postgres_conninfo) as store:
        assert await log_of(store, "r") == expected_records(writes[:2])


def _setting(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SHOW synchronous_commit").fetchone()
    assert row is not None
    return str(row[0])


# -- refusals and failures ---------------------------------------------------------------------


async def test_items_refused_on_their_own_do_not_fail_their_neighbours(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    async with PostgresStore(postgres_conninfo) as other:
        await apply(other, [("start_run", (started("existing"),))])
    holder = PostgresStore(postgres_conninfo)
    await apply(holder, [("start_run", (started("held"),))])
    ongoing = sample_run("ongoing", steps=1)
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await apply(store, ongoing[:1])
        await claim(store, "existing", "fresh-a", "never", "fresh-b")
        with pytest.raises(RunLocked):
            await store.claim_run("held")
        outcomes = await in_one_batch(store, probe, [
            lambda: store.start_run(started("existing")),
            lambda: store.start_run(started("fresh-a")),
            lambda: store.start_run(started("held")),
            write(store, ongoing[1:2]),
            write(store, sample_run("never", steps=1)[1:2]),
            lambda: store.start_run(started("fresh-b")),
        ])
        assert ["existing", "fresh-a", "held", "ongoing", "never", "fresh-b"] in batches
        assert [type(outcome) for outcome in outcomes] == [
            RunAlreadyExists, type(None), RunLocked, type(None), StoreError, type(None)]
        assert "never started" in str(outcomes[4])
        assert probe.commits[-1].rows == (
            ("fresh-a", "run_started"), ("ongoing", "intent"), ("fresh-b", "run_started"))
        for run_id in ("fresh-a", "fresh-b"):
            assert await log_of(store, run_id) == [started(run_id)]
        assert await log_of(store, "ongoing") == expected_records(ongoing[:2])
        assert await log_of(store, "never") == []
        assert await log_of(store, "existing") == [started("existing")]
        # A refusal leaves the claims as they were: this store object still holds the
        # runs it claimed, and once it gives them up another store object writes them
        # while this one is still open.
        async with PostgresStore(postgres_conninfo) as third:
            for run_id in ("never", "existing"):
                with pytest.raises(RunLocked):
                    await third.claim_run(run_id)
                await store.release_run(run_id)
            await apply(third, [("start_run", (started("never"),))])
            await apply(third, sample_run("existing", steps=1)[1:2])
    await holder.aclose()


async def _conflicting_row(conninfo: str, run_id: str, seq: int) -> None:
    """A row at ``seq`` that no store wrote: the store's own row there will clash."""
    records = sql.Identifier("polyloop", "records")
    query = sql.SQL("INSERT INTO {} (run_key, seq, run_id, kind, body) "
                    "VALUES (%s, %s, %s, 'intent', '{{}}')").format(records)
    with pg.admin(conninfo) as conn:
        conn.execute(query, (_postgres_sql.run_key(run_id), seq, run_id))


async def _row_count(conninfo: str, run_id: str) -> int:
    records = sql.Identifier("polyloop", "records")
    query = sql.SQL("SELECT count(*) FROM {} WHERE run_key = %s").format(records)
    with pg.admin(conninfo) as conn:
        row = conn.execute(query, (_postgres_sql.run_key(run_id),)).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_row_the_server_refuses_fails_alone(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    runs = {run_id: sample_run(run_id, steps=1) for run_id in ("a", "bad", "b")}
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        for writes in runs.values():
            await apply(store, writes[:1])
        await _conflicting_row(postgres_conninfo, "bad", 1)
        outcomes = await in_one_batch(store, probe, [
            write(store, runs["a"][1:2]),
            write(store, runs["bad"][1:2]),
            write(store, runs["bad"][2:3]),  # the same run: it fails with it, no gap
            write(store, runs["b"][1:2]),
        ])
        assert ["a", "bad", "bad", "b"] in batches
        assert outcomes[0] is None
        assert outcomes[3] is None
        for outcome in outcomes[1:3]:
            assert isinstance(outcome, StoreError)
            assert isinstance(outcome.__cause__, psycopg.errors.UniqueViolation)
        # The batch's one statement was refused; then each run went again on its own.
        tried = [commit.rows for commit in probe.commits[-4:]]
        assert tried == [
            (("a", "intent"), ("bad", "intent"), ("bad", "result"), ("b", "intent")),
            (("a", "intent"),),
            (("bad", "intent"), ("bad", "result")),
            (("b", "intent"),),
        ]
        for commit in probe.commits[-4:]:
            assert commit.setting == "on"
            assert not commit.lazy
            assert len(commit.sent) == 1
        # The connection goes on serving its other runs; the failed run stays refused.
        for run_id in ("a", "b"):
            await apply(store, runs[run_id][2:], claim=False)
            assert await log_of(store, run_id) == expected_records(runs[run_id])
        with pytest.raises(StoreError, match="earlier write"):
            await apply(store, runs["bad"][2:3], claim=False)
        # Nothing of "bad" was written: its start and the clashing row, no more.
        assert await _row_count(postgres_conninfo, "bad") == 2


async def test_a_connection_lost_mid_batch_fails_its_runs_and_a_new_store_resumes_them(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    runs = {f"r{n}": sample_run(f"r{n}", steps=2) for n in range(5)}
    store = watched(postgres_conninfo, probe, max_writer_connections=1)
    for writes in runs.values():
        await apply(store, writes[:3])
    probe.kill_at("r1")
    outcomes = await in_one_batch(
        store, probe, [write(store, runs[f"r{n}"][3:4]) for n in range(1, 5)])
    assert ["r1", "r2", "r3", "r4"] in batches
    for outcome in outcomes:
        assert isinstance(outcome, StoreError)
        assert isinstance(outcome.__cause__, psycopg.OperationalError)
    # The runs of the batch stay refused through this store object, claims included.
    with pytest.raises(StoreError, match="earlier write"):
        await apply(store, runs["r1"][3:4], claim=False)
    with pytest.raises(StoreError, match="earlier write"):
        await store.claim_run("r1")
    # r0 was not in the batch: its claim lives with the owner, not on the connection, so
    # it goes on through a new writer connection.
    await apply(store, runs["r0"][3:4], claim=False)
    await store.aclose()

    async with PostgresStore(postgres_conninfo) as fresh:
        for run_id, writes in runs.items():
            landed = 4 if run_id == "r0" else 3
            assert await log_of(fresh, run_id) == expected_records(writes[:landed])
            await apply(fresh, writes[landed:])
            assert await log_of(fresh, run_id) == expected_records(writes)


async def _kill_writers(conninfo: str) -> None:
    """End every writer session of the database."""

    def kill() -> None:
        with pg.admin(conninfo) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = %s",
                ("polyloop-writer",),
            )

    await anyio.to_thread.run_sync(kill)


async def test_concurrent_runs_on_a_lost_connection_resume_like_uninterrupted_ones(
    postgres_conninfo: str,
) -> None:
    script = six_step_script()
    run_ids = [f"k{n}" for n in range(6)]
    store = PostgresStore(postgres_conninfo, max_writer_connections=1)
    failures: dict[str, BaseException] = {}

    async def one(run_id: str) -> None:
        model = None
        if run_id == "k0":
            model = InterruptedModel(script, at=2,
                                     before=lambda _: _kill_writers(postgres_conninfo))
        tools = make_tools(Ledger(), replay=Replay.ALLOWED)
        try:
            await run(definition(store, model=model, script=script),
                      request(run_id, tools, model_replay=Replay.ALLOWED))
        except StoreError as exc:
            failures[run_id] = exc

    async with anyio.create_task_group() as group:
        for run_id in run_ids:
            group.start_soon(one, run_id)
    # The runs whose writes were on the connection when it went failed; the others went
    # on through a new one. Either way each ends below like an uninterrupted run.
    for failure in failures.values():
        assert isinstance(failure.__cause__, psycopg.OperationalError)
    await store.aclose()

    async def finish(opened: PostgresStore, run_id: str, *, again: bool) -> RunResult:
        tools = make_tools(Ledger(), replay=Replay.ALLOWED)
        go = resume if again else run
        return await go(definition(opened, script=script),
                        request(run_id, tools, model_replay=Replay.ALLOWED))

    async with PostgresStore(postgres_conninfo) as fresh:
        resumed = [await finish(fresh, run_id, again=True) for run_id in run_ids]
    async with PostgresStore(postgres_conninfo, schema="reference") as reference:
        expected = [await finish(reference, run_id, again=False) for run_id in run_ids]
    for result, reference_result in zip(resumed, expected, strict=True):
        assert result.resumed
        assert same_outcome(result, reference_result)


# -- cancellation -------------------------------------------------------------------------------


async def test_cancelled_before_its_batch_starts_writes_nothing_and_reraises(
    postgres_conninfo: str, probe: Probe
) -> None:
    reached = False
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        busy = Busy(store, probe)
        await claim(store, "neighbour", "z")
        async with anyio.create_task_group() as group:
            await busy.start(group)
            group.start_soon(store.start_run, started("neighbour"))
            await until(lambda: busy.in_flight() == 3)
            with anyio.CancelScope() as scope:

                async def cancel_when_queued() -> None:
                    await until(lambda: busy.in_flight() == 4)
                    scope.cancel()

                group.start_soon(cancel_when_queued)
                await store.start_run(started("z"))
                reached = True
            assert busy.in_flight() == 3  # withdrawn while the others still wait
            busy.release()
        assert scope.cancelled_caught
        assert not reached
        assert await log_of(store, "z") == []
        assert await log_of(store, "neighbour") == [started("neighbour")]
        assert all(run_id != "z" for commit in probe.commits for run_id, _ in commit.rows)
        # The claim is as it was: still this store object's, and the run still new.
        async with PostgresStore(postgres_conninfo) as other:
            with pytest.raises(RunLocked):
                await other.claim_run("z")
        await store.start_run(started("z"))
        assert await log_of(store, "z") == [started("z")]


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "in-a-batch"])
async def test_cancelled_once_its_batch_started_commits_then_reraises(
    postgres_conninfo: str, probe: Probe, alone: bool
) -> None:
    reached = False
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:
        await claim(store, "busy", "z")
        async with anyio.create_task_group() as group:
            probe.hold()
            if not alone:  # a write held at its commit; z's batch starts behind it
                group.start_soon(store.start_run, started("busy"))
                assert await anyio.to_thread.run_sync(probe.entered.wait, WAIT_S)
            with anyio.CancelScope() as scope:

                async def cancel_when_started() -> None:
                    if alone:
                        assert await anyio.to_thread.run_sync(probe.entered.wait, WAIT_S)
                    else:
                        await until(lambda: store._writers[0].group._running is not None)
                    scope.cancel()
                    await anyio.sleep(0.05)  # cancelled, yet still waiting for the commit
                    probe.release()

                group.start_soon(cancel_when_started)
                await store.start_run(started("z"))
                reached = True
        assert scope.cancelled_caught
        assert not reached
        assert await log_of(store, "z") == [started("z")]


async def test_a_leader_cancelled_as_its_batch_starts_still_commits_its_neighbours(
    postgres_conninfo: str, probe: Probe, batches: list[list[str]]
) -> None:
    # The task that runs a batch is cancelled right after the batch started, before its
    # worker thread does (asyncio reaches that point; Trio cannot be cancelled there).
    run_ids = ["lead", "n1", "n2", "n3"]
    scopes = {run_id: anyio.CancelScope() for run_id in run_ids}
    outcomes: dict[str, str] = {}
    async with watched(postgres_conninfo, probe, max_writer_connections=1) as store:

        async def start(run_id: str) -> None:
            with scopes[run_id]:
                try:
                    await store.start_run(started(run_id))
                except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                    outcomes[run_id] = type(exc).__name__
                else:
                    outcomes[run_id] = "written"
                return
            outcomes[run_id] = "cancelled"

        async def cancel_the_leader(group: Any) -> None:
            while group._running is None:
                await anyio.lowlevel.checkpoint()
            leader = group._running.entries[0].item.slot.run_id
            scopes[leader].cancel()

        await claim(store, "busy", *run_ids)
        async with anyio.create_task_group() as tasks:
            probe.hold()
            tasks.start_soon(store.start_run, started("busy"))
            assert await anyio.to_thread.run_sync(probe.entered.wait, WAIT_S)
            tasks.start_soon(cancel_the_leader, store._writers[0].group)
            for run_id in run_ids:
                tasks.start_soon(start, run_id)
            # Every caller has an outcome already (the batch fell apart) or waits for it.
            await until(lambda: len(outcomes) == 4 or store._writers[0].writing == 5)
            await anyio.sleep(0.05)
            probe.release()
        assert sorted(outcomes.values()) == ["cancelled", "written", "written", "written"]
        assert sorted(run_ids) in [sorted(batch) for batch in batches]
        for run_id in run_ids:  # the batch committed every item, the cancelled one's too
            assert await log_of(store, run_id) == [started(run_id)]


# -- without group commit ----------------------------------------------------------------------


class TestContractWithoutGroupCommit(DurableStoreContract):
    @pytest.fixture
    def store_factory(self, postgres_conninfo: str) -> Callable[[], PostgresStore]:
        return lambda: PostgresStore(postgres_conninfo, _group_commit=False)

    @pytest.fixture
    def store_reference(self, postgres_conninfo: str) -> tuple[str, list[Any]]:
        return ("polyloop.stores:PostgresStore", [postgres_conninfo])
