"""The contract every :class:`~polyloop.ports.Store` keeps, as reusable pytest classes.

Subclass :class:`StoreContract` in a test module and provide a ``store_factory``
fixture: a callable that returns a *new* store object over the *same* data each time it
is called (the same directory, file or database). Every test then runs against your
store, under each ``anyio_backend`` your test session parametrizes::

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store_factory(self, tmp_path):
            return lambda: MyStore(tmp_path / "runs")

Every write goes through a claim (``claim_run``), as ``run`` and ``resume`` make them;
:func:`apply` claims the run before it writes. Durable stores subclass
:class:`DurableStoreContract` instead, which adds reopening and the claim across store
objects and processes. Its ``store_reference`` fixture returns
``("package.module:callable", [json args])``: a child process imports the callable and
calls it with the arguments to open the same data.

The tests need pytest and anyio's pytest plugin (installed with anyio).
"""

from __future__ import annotations

import json
import random
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from polyloop.ports import FollowableStore, ManagedStore, PagedStore, RunPage, Store, StoredRun
from polyloop.types import (
    ActionStatus,
    CancelRequest,
    CancelRequested,
    DecisionKind,
    Intent,
    IntentKind,
    InvalidRequest,
    Proposal,
    Record,
    Replay,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLocked,
    RunNotFound,
    RunStarted,
    Settlement,
    StepRecord,
    StopReason,
    StoreError,
    Verdict,
)

__all__ = ("DurableStoreContract", "StoreContract", "sample_run")

StoreFactory = Callable[[], Store]

# Run ids that must stay opaque: separators, traversal, NUL, non-ASCII, great length.
AWKWARD_RUN_IDS = (
    "../escape",
    "../../etc/passwd",
    "/absolute/path",
    "a/b",
    "a/b\\c",
    "\x00",
    "nul\x00byte",
    "snow\u2603man\U0001f600",
    "x" * 10_000,
    "'; DROP TABLE runs; --",
    ".",
    "..",
)


def sample_run(run_id: str, *, steps: int = 2, ended: bool = True) -> list[tuple[str, Any]]:
    """The writes of a plausible run, as ``(method name, arguments)`` pairs, in order."""
    writes: list[tuple[str, Any]] = [
        (
            "start_run",
            (
                RunStarted(
                    run_id=run_id,
                    snapshot={
                        "model.name": "m",
                        "budget.max_steps": 9,
                        "nested": {"list": [1, 2.5, None]},
                    },
                ),
            ),
        ),
    ]
    for k in range(steps):
        model_id, action_id = f"{run_id}:{k}:model", f"{run_id}:{k}:action"
        writes += [
            (
                "write_intent",
                (
                    Intent(
                        run_id=run_id,
                        result_id=model_id,
                        kind=IntentKind.MODEL_CALL,
                        step=k,
                        call_index=k,
                        replay=Replay.NEVER,
                        payload={"messages_sha256": "ab"},
                    ),
                ),
            ),
            (
                "write_result",
                (
                    Result(
                        run_id=run_id,
                        result_id=model_id,
                        kind=IntentKind.MODEL_CALL,
                        payload={"call_id": f"c{k}", "content": "é\u2028\ud800", "reasoning": None},
                    ),
                ),
            ),
            (
                "write_intent",
                (
                    Intent(
                        run_id=run_id,
                        result_id=action_id,
                        kind=IntentKind.ACTION,
                        step=k,
                        call_index=k,
                        replay=Replay.ALLOWED,
                        payload={"name": "t", "arguments": {"n": k}},
                        action_text="t(n)",
                        history_text="call t",
                    ),
                ),
            ),
            (
                "write_step",
                (
                    _step(run_id, k),
                    Result(
                        run_id=run_id,
                        result_id=action_id,
                        kind=IntentKind.ACTION,
                        payload={"status": "executed", "observation": f"o{k}"},
                    ),
                ),
            ),
        ]
    if ended:
        writes.append(
            (
                "end_run",
                (
                    RunEnded(
                        run_id=run_id,
                        stop_reason=StopReason.SUBMITTED,
                        final_answer=None,
                        steps=steps,
                        valid_steps=steps,
                        detail=None,
                    ),
                ),
            )
        )
    return writes


def _step(run_id: str, k: int) -> StepRecord:
    return StepRecord(
        run_id=run_id,
        step=k,
        call_id=f"c{k}",
        model_output="line one\nline two \U0001f600",
        reasoning="why",
        decision=DecisionKind.ACTION,
        history_text="call t",
        action_text="t(n)",
        observation=f"o{k}",
        observation_synthesized=False,
        action_status=ActionStatus.EXECUTED,
        done=False,
        truncated_chars=0,
        error=None,
        duration_s=0.25,
    )


def expected_records(writes: list[tuple[str, Any]]) -> list[Record]:
    """What ``read_log`` must return after ``writes``: a step's action result first."""
    records: list[Record] = []
    for method, args in writes:
        if method == "write_step":
            step, result = args
            records += [result, step] if result is not None else [step]
        else:
            records.append(args[0])
    return records


async def apply(store: Store, writes: list[tuple[str, Any]], *, claim: bool = True) -> None:
    """Make ``writes`` through ``store``; with ``claim``, claim their run first."""
    if claim and writes:
        await store.claim_run(writes[0][1][0].run_id)
    for method, args in writes:
        await getattr(store, method)(*args)


async def close(store: Store) -> None:
    aclose = getattr(store, "aclose", None)
    if aclose is not None:
        await aclose()


def awaiting_run(run_id: str) -> list[tuple[str, Any]]:
    """The writes of a run that stopped at step 1 to wait for a person's approval."""
    writes = sample_run(run_id, steps=2, ended=False)[:7]  # up to step 1's model result
    _, (intent,) = sample_run(run_id, steps=2)[7]
    proposal = Proposal(
        run_id=run_id,
        result_id=intent.result_id,
        step=1,
        replay=Replay.NEVER,
        payload=intent.payload,
        action_text="t(n)",
        history_text="call t",
        description="Does t.",
        at=datetime(2026, 12, 1, 22, 0, tzinfo=UTC),
    )
    return [
        *writes,
        ("write_review", (proposal,)),
        ("end_run", (_end(run_id, StopReason.AWAITING_APPROVAL, 1),)),
    ]


def in_doubt_run(run_id: str) -> list[tuple[str, Any]]:
    """The writes of a run that ended in doubt about step 1's action."""
    writes = sample_run(run_id, steps=2, ended=False)[:7]
    _, (intent,) = sample_run(run_id, steps=2)[7]
    never = Intent(**{**_fields(intent), "replay": Replay.NEVER})
    return [
        *writes,
        ("write_intent", (never,)),
        ("end_run", (_end(run_id, StopReason.IN_DOUBT, 1),)),
    ]


def _fields(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


def _end(run_id: str, reason: StopReason, steps: int) -> RunEnded:
    return RunEnded(
        run_id=run_id,
        stop_reason=reason,
        final_answer=None,
        steps=steps,
        valid_steps=steps,
        detail=reason.value,
    )


def _cancel(run_id: str, by: str = "alice", reason: str = "wrong customer") -> CancelRequest:
    return CancelRequest(run_id=run_id, by=by, reason=reason, at=datetime(2026, 12, 6, tzinfo=UTC))


def _intent(run_id: str, k: int) -> Intent:
    _, (intent,) = sample_run(run_id, steps=1)[1]
    return Intent(**{**_fields(intent), "result_id": f"{run_id}:{k}:model", "step": k})


def _cancelled_end(run_id: str, steps: int) -> RunEnded:
    return RunEnded(
        run_id=run_id,
        stop_reason=StopReason.CANCELLED,
        final_answer=None,
        steps=steps,
        valid_steps=steps,
        detail="cancelled",
    )


class _FollowableChecks:
    """What :class:`StoreContract` checks of a store that can be followed cheaply
    (:class:`~polyloop.ports.FollowableStore`); skipped for one that cannot."""

    async def test_a_followable_store_reads_after_every_position(
        self, store_factory: StoreFactory
    ) -> None:
        """``read_after`` is the tail of ``read_log`` from every position on, the step
        right after its action's result included; a run with no record is not found."""
        store = store_factory()
        if not isinstance(store, FollowableStore):
            await close(store)
            pytest.skip("not a FollowableStore: follow reads its whole log on a timer")
        await apply(store, sample_run("r1", steps=2))
        records = (await store.read_log("r1")).records
        for after in range(len(records) + 2):
            assert await store.read_after("r1", after) == records[after:], after
        with pytest.raises(RunNotFound):
            await store.read_after("never-written", 0)
        await close(store)

    async def test_a_followable_store_wakes_its_watchers_on_a_write(
        self, store_factory: StoreFactory
    ) -> None:
        """``appended``'s ``wait`` returns once a record of the run was written since the
        block began, even if it was written before ``wait`` was called."""
        store = store_factory()
        if not isinstance(store, FollowableStore):
            await close(store)
            pytest.skip("not a FollowableStore: follow reads its whole log on a timer")
        writes = sample_run("r1", steps=1)
        await apply(store, writes[:1])
        async with store.appended("r1") as wait:
            for method, args in writes[1:3]:
                await getattr(store, method)(*args)
                with anyio.fail_after(10):
                    await wait()
        assert len(await store.read_after("r1", 1)) == 2
        await close(store)


class _PagedChecks:
    """What :class:`StoreContract` checks of a store that lists a page of its runs
    (:class:`~polyloop.ports.PagedStore`); skipped for one that cannot."""

    async def _paged(self, store_factory: StoreFactory, count: int) -> Any:
        """A store holding ``count`` runs ``p0``, ``p1``... written one after another,
        every third one left unfinished."""
        store = store_factory()
        if not isinstance(store, PagedStore):
            await close(store)
            pytest.skip("not a PagedStore: a page is derived from list_runs")
        for n in range(count):
            await apply(store, sample_run(f"p{n}", steps=1, ended=n % 3 != 1))
        return store

    async def test_a_paged_store_pages_through_its_runs_most_recent_first(
        self, store_factory: StoreFactory
    ) -> None:
        """Following ``older`` from the first page visits every run once, in the order
        of ``list_runs`` sorted by time, newest first; ``newer`` leads back the same
        way; each filter keeps exactly the runs it names."""
        store = await self._paged(store_factory, 8)
        listed = await store.list_runs()
        expected = _by_time(listed)
        assert sorted(run.run_id for run in expected) == [f"p{n}" for n in range(8)]
        pages = await _walk(store, older=True)
        assert [run for page in pages for run in page.runs] == expected
        assert pages[0].newer is None and pages[-1].older is None
        back = await _walk(store, older=False, start=pages[-1].newer)
        assert [run for page in back for run in page.runs] == expected[:6]
        for finished in (True, False):
            kept = [run for run in expected if run.finished is finished]
            found = await _walk(store, older=True, finished=finished)
            assert [run for page in found for run in page.runs] == kept
        since = expected[4].updated_at
        found = await _walk(store, older=True, updated_since=since)
        assert [run for page in found for run in page.runs] == expected[:5]
        until = await store.page_runs(limit=9, updated_before=since)
        assert until.runs == tuple(expected[5:])
        await close(store)

    async def test_a_paged_store_keeps_its_cursors_while_runs_are_added(
        self, store_factory: StoreFactory
    ) -> None:
        """A page after a cursor starts after the run it was taken from, however many
        runs came since; a bad request is refused in words."""
        store = await self._paged(store_factory, 4)
        expected = _by_time(await store.list_runs())
        first = await store.page_runs(limit=2)
        assert first.older is not None
        await apply(store, sample_run("p-new", steps=1))
        second = await store.page_runs(limit=2, after=first.older)
        assert list(second.runs) == expected[2:] and second.older is None
        assert (await store.page_runs(limit=1)).runs[0].run_id == "p-new"
        for wrong in ({"limit": 0}, {"limit": 1, "after": "[", "before": None}):
            with pytest.raises(InvalidRequest):
                await store.page_runs(**wrong)
        with pytest.raises(InvalidRequest):
            await store.page_runs(limit=1, after=first.older, before=first.older)
        await close(store)


async def _walk(
    store: PagedStore, *, older: bool, start: str | None = None, **filters: Any
) -> list[RunPage]:
    """The pages of ``store``, 3 runs each, from the first on (``older``) or up from the
    page before ``start``."""
    pages: list[RunPage] = []
    where = start
    while True:
        after, before = (where, None) if older else (None, where)
        page = await store.page_runs(limit=3, after=after, before=before, **filters)
        pages.append(page)
        where = page.older if older else page.newer
        if where is None:
            return pages if older else pages[::-1]


def _by_time(runs: tuple[StoredRun, ...]) -> list[StoredRun]:
    by_id = sorted(runs, key=lambda run: run.run_id)
    return sorted(by_id, key=lambda run: run.updated_at or datetime.min, reverse=True)


@pytest.mark.anyio
class StoreContract(_FollowableChecks, _PagedChecks):
    """Tests every store passes. Provide a ``store_factory`` fixture.

    Stores that also offer listing (:class:`~polyloop.ports.ManagedStore`) are checked
    for it too.
    """

    async def test_unknown_run_reads_empty(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        log = await store.read_log("never-written")
        assert log.run_id == "never-written"
        assert log.records == ()
        await close(store)

    async def test_records_round_trip_in_write_order(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        writes = sample_run("r1", steps=3)
        await apply(store, writes)
        log = await store.read_log("r1")
        assert list(log.records) == expected_records(writes)
        await close(store)

    async def test_step_without_action_result(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        writes = sample_run("r1", steps=1, ended=False)
        step = _step("r1", 1)
        writes += [("write_step", (step, None))]
        await apply(store, writes)
        log = await store.read_log("r1")
        assert log.records[-1] == step
        assert log.records[-2] == expected_records(writes)[-2]
        await close(store)

    async def test_start_run_refuses_an_existing_run(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        writes = sample_run("r1", steps=0, ended=False)
        await apply(store, writes)
        with pytest.raises(RunAlreadyExists):
            await apply(store, writes, claim=False)
        await store.release_run("r1")
        with pytest.raises(RunAlreadyExists):
            await apply(store, writes)
        assert list((await store.read_log("r1")).records) == expected_records(writes)
        await close(store)

    async def test_write_to_a_run_never_started_is_refused(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        _, (intent,) = sample_run("ghost", steps=1)[1]
        await store.claim_run("ghost")
        with pytest.raises(StoreError):
            await store.write_intent(intent)
        assert (await store.read_log("ghost")).records == ()
        await close(store)

    async def test_every_write_needs_the_claim(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        writes = sample_run("r1", steps=1)
        for method, args in writes:
            with pytest.raises(RunLocked) as refused:
                await getattr(store, method)(*args)
            assert refused.value.run_id == "r1"
        assert (await store.read_log("r1")).records == ()
        await apply(store, writes[:2])
        await store.release_run("r1")
        for method, args in writes[2:]:
            with pytest.raises(RunLocked):
                await getattr(store, method)(*args)
        assert list((await store.read_log("r1")).records) == expected_records(writes[:2])
        await close(store)

    async def test_an_effect_may_start_only_under_the_claim(
        self, store_factory: StoreFactory
    ) -> None:
        """``check_claim`` passes while this object holds the run's claim, and refuses
        once the claim is given up, ended or closed: an effect must not start then."""
        store = store_factory()
        with pytest.raises(RunLocked) as refused:
            await store.check_claim("r1")
        assert refused.value.run_id == "r1"
        writes = sample_run("r1", steps=1, ended=False)
        await apply(store, writes[:2])
        await store.check_claim("r1")
        await store.release_run("r1")
        with pytest.raises(RunLocked):
            await store.check_claim("r1")
        await store.claim_run("r1")
        await store.check_claim("r1")
        await store.end_run(_cancelled_end("r1", 0))
        with pytest.raises(RunLocked):
            await store.check_claim("r1")
        await store.claim_run("r1")
        await close(store)
        with pytest.raises((StoreError, RunLocked)) as closed:
            await store.check_claim("r1")
        assert closed.value.run_id == "r1"

    async def test_one_claim_per_run_even_through_one_store_object(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        await store.claim_run("r1")
        with pytest.raises(RunLocked) as locked:
            await store.claim_run("r1")
        assert locked.value.run_id == "r1"
        await store.claim_run("r2")  # other runs are not affected
        await store.release_run("r1")
        await store.release_run("r1")  # releasing what is not held does nothing
        await store.claim_run("r1")
        await apply(store, sample_run("r1", steps=1), claim=False)
        await close(store)

    async def test_end_run_gives_the_claim_up(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        writes = sample_run("r1", steps=1, ended=False)
        await apply(store, [*writes, ("end_run", (_cancelled_end("r1", 1),))])
        _, (intent,) = sample_run("r1", steps=2)[5]
        with pytest.raises(RunLocked):
            await store.write_intent(intent)
        # A cancelled run goes on once claimed again.
        await store.claim_run("r1")
        await store.write_intent(intent)
        assert (await store.read_log("r1")).records[-1] == intent
        await close(store)

    async def test_nothing_follows_a_final_end_record(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        writes = sample_run("r1", steps=1)
        await apply(store, writes)
        await store.claim_run("r1")  # a finished run may be claimed, and read
        for method, args in sample_run("r1", steps=2)[5:]:
            with pytest.raises(StoreError) as refused:
                await getattr(store, method)(*args)
            assert refused.value.run_id == "r1"
        assert list((await store.read_log("r1")).records) == expected_records(writes)
        await close(store)

    async def test_a_paused_run_takes_a_verdict_and_goes_on(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        writes = awaiting_run("r1")
        await apply(store, writes)
        verdict = Verdict(
            run_id="r1",
            result_id="r1:1:action",
            approved=True,
            by="alice",
            payload={"name": "t", "arguments": {"n": 1}},
            reason=None,
        )
        with pytest.raises(RunLocked):  # the end record gave the claim up
            await store.write_review(verdict)
        if isinstance(store, ManagedStore):
            described = await store.describe_run("r1")
            assert described is not None and not described.finished
        await apply(store, [("write_review", (verdict,)), *sample_run("r1", steps=2)[7:]])
        log = await store.read_log("r1")
        expected = [*expected_records(writes), verdict]
        expected += expected_records(sample_run("r1", steps=2)[7:])
        assert list(log.records) == expected
        await close(store)

    async def test_an_in_doubt_end_is_reopened_by_a_settlement(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        writes = in_doubt_run("r1")
        await apply(store, writes)
        if isinstance(store, ManagedStore):
            unfinished = await store.list_runs(unfinished_only=True)
            assert [run.run_id for run in unfinished] == ["r1"]
        settlement = Settlement(
            run_id="r1",
            result_id="r1:1:action",
            ran=True,
            observation="o1",
            by="carol",
            at=datetime(2026, 12, 1, 22, 0, tzinfo=UTC),
        )
        rest = [("write_review", (settlement,)), *sample_run("r1", steps=2)[8:]]
        await apply(store, rest)
        log = await store.read_log("r1")
        assert list(log.records) == expected_records(writes) + expected_records(rest)
        await store.claim_run("r1")
        with pytest.raises(StoreError):  # the final end record closes it for good
            await store.write_review(settlement)
        await close(store)

    async def test_awkward_run_ids_stay_opaque_and_isolated(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        for run_id in AWKWARD_RUN_IDS:
            await apply(store, sample_run(run_id, steps=1))
        for run_id in AWKWARD_RUN_IDS:
            log = await store.read_log(run_id)
            assert list(log.records) == expected_records(sample_run(run_id, steps=1))
        if isinstance(store, ManagedStore):
            listed = await store.list_runs()
            assert sorted(run.run_id for run in listed) == sorted(AWKWARD_RUN_IDS)
        await close(store)

    async def test_concurrent_runs_stay_isolated(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        run_ids = [f"run-{i}" for i in range(100)]
        async with anyio.create_task_group() as group:
            for run_id in run_ids:
                group.start_soon(apply, store, sample_run(run_id, steps=2))
        for run_id in run_ids:
            log = await store.read_log(run_id)
            assert list(log.records) == expected_records(sample_run(run_id, steps=2))
        await close(store)

    async def test_parameters_are_plain_json_without_instance_details(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        params = dict(store.parameters())
        assert json.loads(json.dumps(params)) == params
        assert params == dict(store_factory().parameters())
        await close(store)

    async def test_aclose_is_idempotent(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        async with store:  # type: ignore[attr-defined]
            await apply(store, sample_run("r1", steps=1))
        await close(store)
        await close(store)

    async def test_listing_tells_finished_unfinished_and_claimed_runs(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        if not isinstance(store, ManagedStore):
            pytest.skip("the store offers no listing")
        assert await store.list_runs() == ()
        before = datetime.now(UTC) - timedelta(seconds=5)
        await apply(store, sample_run("done", steps=1))
        await apply(store, sample_run("open", steps=1, ended=False))
        await apply(
            store,
            [
                *sample_run("paused", steps=1, ended=False),
                ("end_run", (_cancelled_end("paused", 1),)),
            ],
        )
        await store.release_run("open")
        await store.claim_run("live")  # claimed, never started: not a run
        await apply(store, sample_run("busy", steps=0, ended=False))
        listed = {run.run_id: run for run in await store.list_runs()}
        assert sorted(listed) == ["busy", "done", "open", "paused"]
        assert {run_id for run_id, run in listed.items() if run.finished} == {"done"}
        assert {run_id for run_id, run in listed.items() if run.claimed} == {"busy"}
        for run in listed.values():
            assert run.updated_at is None or run.updated_at >= before
        unfinished = await store.list_runs(unfinished_only=True)
        assert sorted(run.run_id for run in unfinished) == ["busy", "open", "paused"]
        assert await store.describe_run("busy") == listed["busy"]
        assert await store.describe_run("done") == listed["done"]
        assert await store.describe_run("live") is None
        assert await store.describe_run("nobody") is None
        await store.release_run("live")
        await store.release_run("busy")
        described = await store.describe_run("busy")
        assert described is not None and not described.claimed
        assert (await store.read_log("live")).records == ()
        await close(store)

    async def test_a_cancel_request_needs_a_started_run_and_no_claim(
        self, store_factory: StoreFactory
    ) -> None:
        store = store_factory()
        with pytest.raises(RunNotFound) as missing:
            await store.request_cancel(_cancel("nobody"))
        assert missing.value.run_id == "nobody"
        await store.claim_run("claimed")  # claimed, never started: the run has no record
        with pytest.raises(RunNotFound):
            await store.request_cancel(_cancel("claimed"))
        assert await store.read_cancel("nobody") is None
        assert await store.read_cancel("claimed") is None
        await store.release_run("claimed")
        await apply(store, sample_run("r1", steps=1, ended=False))
        await store.release_run("r1")
        await store.request_cancel(_cancel("r1"))  # nobody holds the claim: taken all the same
        assert await store.read_cancel("r1") == _cancel("r1")
        await close(store)

    async def test_a_cancel_request_refuses_intents_and_proposals_alone(
        self, store_factory: StoreFactory
    ) -> None:
        """After a request no intent or proposal is written, and the refusal leaves the
        store object writing the run: the running effect's result, its step, the end."""
        store = store_factory()
        writes = awaiting_run("r1")
        await apply(store, writes[:2])  # the run's start and its first model call's intent
        assert await store.read_cancel("r1") is None
        await store.request_cancel(_cancel("r1"))
        await store.request_cancel(_cancel("r1", by="bob", reason="later"))  # changes nothing
        assert await store.read_cancel("r1") == _cancel("r1")
        before = (await store.read_log("r1")).records
        for method, record in (writes[3], writes[-2]):  # an action's intent, a proposal
            with pytest.raises(CancelRequested) as refused:
                await getattr(store, method)(*record)
            assert (refused.value.run_id, refused.value.by) == ("r1", "alice")
            assert refused.value.why == "wrong customer"
        assert (await store.read_log("r1")).records == before
        await store.check_claim("r1")  # the claim stays with its owner
        end = replace(_end("r1", StopReason.CANCELLED_BY_REQUEST, 1), cancelled_by="alice")
        rest = [writes[2], ("write_step", (_step("r1", 0), None)), ("end_run", (end,))]
        await apply(store, rest, claim=False)
        assert list((await store.read_log("r1")).records) == [*before, *expected_records(rest)]
        await close(store)

    async def test_a_cancel_request_shows_in_the_listing(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        if not isinstance(store, ManagedStore):
            pytest.skip("the store offers no listing")
        await apply(store, sample_run("asked", steps=1, ended=False))
        await apply(store, sample_run("other", steps=1, ended=False))
        before = await store.describe_run("asked")
        assert before is not None and not before.cancel_requested
        await anyio.sleep(0.05)  # past the clock's step: a poller sees the row change
        await store.request_cancel(_cancel("asked"))
        listed = {run.run_id: run for run in await store.list_runs(unfinished_only=True)}
        assert listed["asked"].cancel_requested and not listed["other"].cancel_requested
        assert listed["asked"].claimed and not listed["asked"].finished
        assert await store.describe_run("asked") == listed["asked"]
        if before.updated_at is not None:
            assert listed["asked"].updated_at is not None
            assert listed["asked"].updated_at > before.updated_at
        await close(store)

    async def test_prune_deletes_only_old_finished_runs_and_archives_them(
        self, store_factory: StoreFactory, tmp_path: Path
    ) -> None:
        store = store_factory()
        if not isinstance(store, ManagedStore):
            pytest.skip("the store offers no listing")
        old = sample_run("old", steps=1)
        await apply(store, old)
        await apply(
            store,
            [
                *sample_run("doubt", steps=1, ended=False),
                (
                    "end_run",
                    (
                        RunEnded(
                            run_id="doubt",
                            stop_reason=StopReason.IN_DOUBT,
                            final_answer=None,
                            steps=1,
                            valid_steps=1,
                            detail="in doubt",
                        ),
                    ),
                ),
            ],
        )
        await apply(store, sample_run("open", steps=1, ended=False))
        await store.release_run("open")
        await apply(store, sample_run("held", steps=1))
        await store.claim_run("held")  # finished, but a worker holds it now
        await anyio.sleep(0.05)
        cutoff = datetime.now(UTC)
        await anyio.sleep(0.05)
        await apply(store, sample_run("new", steps=1))
        archive = tmp_path / "archive"
        assert await store.prune(finished_before=cutoff, archive=archive) == ("old",)
        assert sorted(run.run_id for run in await store.list_runs()) == [
            "doubt",
            "held",
            "new",
            "open",
        ]
        assert await store.describe_run("old") is None
        assert (await store.read_log("old")).records == ()
        from polyloop.stores import JsonlStore

        async with JsonlStore(archive) as archived:
            assert list((await archived.read_log("old")).records) == expected_records(old)
            assert [run.run_id for run in await archived.list_runs()] == ["old"]
        # Nothing older is left; the id is free for a new run.
        assert await store.prune(finished_before=cutoff) == ()
        await apply(store, sample_run("old", steps=0, ended=False))
        await close(store)


class DurableStoreContract(StoreContract):
    """Tests for stores whose runs survive the store object and the process.

    Provide ``store_factory`` and ``store_reference`` fixtures.
    """

    async def test_a_new_store_object_reads_what_another_wrote(
        self, store_factory: StoreFactory
    ) -> None:
        first = store_factory()
        writes = sample_run("r1", steps=2)
        await apply(first, writes)
        await close(first)
        second = store_factory()
        assert list((await second.read_log("r1")).records) == expected_records(writes)
        await close(second)

    async def test_a_record_of_a_person_is_read_by_a_new_store_object(
        self, store_factory: StoreFactory
    ) -> None:
        first = store_factory()
        writes = awaiting_run("r1")
        await apply(first, writes)
        await close(first)
        second = store_factory()
        assert list((await second.read_log("r1")).records) == expected_records(writes)
        await close(second)

    async def test_second_writer_in_this_process_is_locked_out(
        self, store_factory: StoreFactory
    ) -> None:
        holder, other = store_factory(), store_factory()
        writes = sample_run("r1", steps=1, ended=False)
        await apply(holder, writes[:2])
        with pytest.raises(RunLocked) as locked:
            await other.claim_run("r1")
        assert locked.value.run_id == "r1"
        with pytest.raises(RunLocked):
            await apply(other, writes[2:3], claim=False)
        # Readers are never locked out, and the holder may go on writing.
        assert len((await other.read_log("r1")).records) == 2
        await apply(holder, writes[2:], claim=False)
        await close(holder)
        # Closing the holder gives its claim up.
        await apply(other, [("end_run", (_cancelled_end("r1", 1),))])
        await close(other)

    async def test_a_claim_on_a_new_id_keeps_other_writers_out(
        self, store_factory: StoreFactory
    ) -> None:
        holder, other = store_factory(), store_factory()
        await holder.claim_run("new")
        with pytest.raises(RunLocked):
            await other.claim_run("new")
        with pytest.raises(RunLocked):
            await apply(other, sample_run("new", steps=0, ended=False), claim=False)
        await holder.release_run("new")
        await apply(other, sample_run("new", steps=0, ended=False))
        await close(holder)
        await close(other)

    async def test_end_run_releases_the_lock(self, store_factory: StoreFactory) -> None:
        holder, other = store_factory(), store_factory()
        writes = sample_run("r1", steps=1, ended=False)
        await apply(holder, [*writes, ("end_run", (_cancelled_end("r1", 1),))])
        # A cancelled run is resumed later, possibly through another store object.
        _, (intent,) = sample_run("r1", steps=2)[5]
        await apply(other, [("write_intent", (intent,))])
        await close(holder)
        await close(other)

    async def test_the_claim_is_visible_to_other_store_objects(
        self, store_factory: StoreFactory
    ) -> None:
        holder, watcher = store_factory(), store_factory()
        if not isinstance(watcher, ManagedStore):
            pytest.skip("the store offers no listing")
        await apply(holder, sample_run("r1", steps=1, ended=False))
        seen = await watcher.describe_run("r1")
        assert seen is not None and seen.claimed and not seen.finished
        # Asking does not get in the holder's way, nor in a claimant's once it is free.
        for _ in range(20):
            await watcher.list_runs(unfinished_only=True)
        await apply(holder, [("end_run", (_cancelled_end("r1", 1),))], claim=False)
        seen = await watcher.describe_run("r1")
        assert seen is not None and not seen.claimed
        await watcher.claim_run("r1")
        await close(holder)
        await close(watcher)

    async def test_a_cancel_request_reaches_every_store_object(
        self, store_factory: StoreFactory
    ) -> None:
        owner, other = store_factory(), store_factory()
        writes = sample_run("r1", steps=1, ended=False)
        await apply(owner, writes[:3])
        await other.request_cancel(_cancel("r1"))  # the owner holds the claim
        with pytest.raises(CancelRequested):
            await owner.write_intent(writes[3][1][0])
        await apply(owner, [("end_run", (_cancelled_end("r1", 1),))], claim=False)
        await close(owner)
        await close(other)
        reopened = store_factory()
        assert await reopened.read_cancel("r1") == _cancel("r1")
        if isinstance(reopened, ManagedStore):
            described = await reopened.describe_run("r1")
            assert described is not None and described.cancel_requested
        await reopened.claim_run("r1")  # a resumed run is fenced as well
        with pytest.raises(CancelRequested):
            await reopened.write_intent(writes[3][1][0])
        assert list((await reopened.read_log("r1")).records) == [
            *expected_records(writes[:3]),
            _cancelled_end("r1", 1),
        ]
        await close(reopened)

    async def test_no_intent_lands_after_a_cancel_request_returned(
        self, store_factory: StoreFactory
    ) -> None:
        """A request and a stream of intents race from two store objects: an intent
        begun after the request returned is always refused, and the log holds exactly
        the intents that were let through."""
        owner, asker = store_factory(), store_factory()
        for round_ in range(20):
            run_id = f"race-{round_}"
            await apply(owner, sample_run(run_id, steps=0, ended=False))
            attempts, returned = await _race(owner, asker, run_id)
            assert not [began for began, landed in attempts if landed and began > returned]
            assert attempts[-1][1] is False
            logged = [r for r in (await asker.read_log(run_id)).records if isinstance(r, Intent)]
            assert len(logged) == sum(landed for _, landed in attempts)
            await owner.end_run(_cancelled_end(run_id, 0))
        await close(owner)
        await close(asker)

    async def test_second_writer_in_another_process_is_locked_out(
        self, store_factory: StoreFactory, store_reference: tuple[str, list[Any]]
    ) -> None:
        holder = store_factory()
        await apply(holder, sample_run("r1", steps=0, ended=False))
        outcome = await _write_from_child(store_reference, "r1")
        assert outcome == "locked"
        await close(holder)
        assert await _write_from_child(store_reference, "r1") == "written"


async def _race(owner: Store, asker: Store, run_id: str) -> tuple[list[tuple[float, bool]], float]:
    """Write intents through ``owner`` until refused while ``asker`` requests a cancel:
    when each intent began and whether it landed, and when the request returned."""
    attempts: list[tuple[float, bool]] = []
    returned = float("inf")

    async def write_intents() -> None:
        for k in range(10_000):
            began = time.monotonic()
            try:
                await owner.write_intent(_intent(run_id, k))
            except CancelRequested:
                attempts.append((began, False))
                return
            attempts.append((began, True))

    async def ask() -> None:
        nonlocal returned
        await anyio.sleep(random.uniform(0, 0.03))
        await asker.request_cancel(_cancel(run_id))
        returned = time.monotonic()

    async with anyio.create_task_group() as group:
        group.start_soon(write_intents)
        group.start_soon(ask)
    return attempts, returned


_CHILD = textwrap.dedent(
    """
    import importlib, json, sys
    import anyio
    from polyloop.testing.store_contract import sample_run
    from polyloop.types import RunLocked

    reference, args, run_id = json.loads(sys.argv[1])
    module, _, name = reference.partition(":")
    factory = getattr(importlib.import_module(module), name)

    async def main():
        store = factory(*args)
        _, (intent,) = sample_run(run_id, steps=1)[1]
        try:
            await store.claim_run(run_id)
            await store.write_intent(intent)
        except RunLocked:
            print("locked")
        else:
            print("written")
        finally:
            aclose = getattr(store, "aclose", None)
            if aclose is not None:
                await aclose()

    anyio.run(main)
    """
)


async def _write_from_child(reference: tuple[str, list[Any]], run_id: str) -> str:
    argument = json.dumps([reference[0], reference[1], run_id])
    done = await anyio.run_process([sys.executable, "-c", _CHILD, argument], check=False)
    if done.returncode != 0:
        raise AssertionError(f"child process failed: {done.stderr.decode(errors='replace')}")
    return done.stdout.decode().strip()
