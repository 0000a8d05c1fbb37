"""The in-memory store: fast, isolated per object, and gone with the process."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from polyloop import types
from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._common import ClosedOnExit, WriterState, step_records
from polyloop.stores._engine import check_cutoff, prune_runs
from polyloop.stores._refusals import check_order, claimed_already, not_claimed


class MemoryStore(ClosedOnExit):
    """Keeps every run in this process's memory. NOT recoverable across processes.

    A run written here survives a failure inside the process (``resume`` with the same
    store object continues it) but not the end of the process. Choosing this store is
    the visible way of saying that a run needs no crash recovery; there is no default
    store. Records are kept as the objects written, so reads are exact and cheap.

    No other store object sees these runs, so a claim here only keeps out a second
    driver of the same run through this object.

    Cancellation, for every method: no method waits but :meth:`prune`, so each completes
    or does not start; ``prune`` deletes each run whole or not at all.
    """

    __slots__ = ("_claims", "_runs", "_state", "_updated")

    def __init__(self) -> None:
        self._runs: dict[str, list[types.Record]] = {}
        self._updated: dict[str, float] = {}  # time.time() of the last write
        self._claims: set[str] = set()
        self._state = WriterState()  # only whether it is closed: no write here fails

    def parameters(self) -> Mapping[str, types.JSONValue]:
        return {"kind": "memory", "format": FORMAT}

    async def claim_run(self, run_id: str) -> None:
        """Become the run's writer; ``RunLocked`` if this object already is."""
        self._state.check_open(run_id)
        if run_id in self._claims:
            raise claimed_already(run_id)
        self._claims.add(run_id)

    async def release_run(self, run_id: str) -> None:
        """Give up the claim on the run, if this store object holds it."""
        self._claims.discard(run_id)

    async def check_claim(self, run_id: str) -> None:
        """Pass if this store object holds the run's claim: a claim here has no lease."""
        self._check_claimed(run_id)

    async def start_run(self, record: types.RunStarted) -> None:
        """Keep the first record of a run."""
        self._keep(record, start=True)

    async def write_intent(self, intent: types.Intent) -> None:
        """Keep an intent (memory is as durable as this store gets)."""
        self._keep(intent)

    async def write_result(self, result: types.Result) -> None:
        """Keep a model result."""
        self._keep(result)

    async def write_step(self, step: types.StepRecord, action_result: types.Result | None) -> None:
        """Keep a step and its action result together."""
        self._keep(*step_records(step, action_result))

    async def write_review(self, record: types.Review) -> None:
        """Keep a proposal, a verdict or a settlement."""
        self._keep(record)

    async def read_log(self, run_id: str) -> types.RunLog:
        """Every record of ``run_id``, in write order."""
        self._state.check_open(run_id)
        return types.RunLog(run_id=run_id, records=tuple(self._runs.get(run_id, ())))

    async def end_run(self, record: types.RunEnded) -> None:
        """Keep the end record and give up the claim."""
        self._keep(record)
        self._claims.discard(record.run_id)

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run, in the order the runs started (only unfinished ones if asked)."""
        self._state.check_open(None)
        listed = (self._stored(run_id) for run_id in self._runs)
        return tuple(run for run in listed if not (unfinished_only and run.finished))

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it, or ``None``."""
        self._state.check_open(run_id)
        return self._stored(run_id) if run_id in self._runs else None

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the finished runs last written before ``finished_before``; their ids. An
        unfinished, in-doubt or claimed run stays; ``archive`` gets each log first."""
        cutoff = check_cutoff(finished_before)
        candidates = [
            run_id
            for run_id, records in self._runs.items()
            if _finished(records) and self._updated[run_id] < cutoff.timestamp()
        ]
        return await prune_runs(self, candidates, archive=archive, delete=self._delete)

    async def _delete(self, run_id: str) -> bool:
        self._claims.discard(run_id)
        del self._runs[run_id], self._updated[run_id]
        return True

    async def aclose(self) -> None:
        """Give up every claim and refuse further use; idempotent."""
        self._state.closed = True
        self._claims.clear()

    def _stored(self, run_id: str) -> StoredRun:
        return StoredRun(
            run_id=run_id,
            finished=_finished(self._runs[run_id]),
            claimed=run_id in self._claims,
            updated_at=datetime.fromtimestamp(self._updated[run_id], UTC),
        )

    def _check_claimed(self, run_id: str) -> None:
        self._state.check_open(run_id)
        if run_id not in self._claims:
            raise not_claimed(run_id)

    def _keep(self, *records: types.Record, start: bool = False) -> None:
        """Append to a claimed run, in the order every store keeps."""
        run_id = records[0].run_id
        self._check_claimed(run_id)
        kept = self._runs.get(run_id, [])
        check_order(run_id, start=start, started=bool(kept), finished=_finished(kept))
        self._runs.setdefault(run_id, []).extend(records)
        self._updated[run_id] = time.time()

    def __repr__(self) -> str:
        return f"MemoryStore(runs={len(self._runs)})"


def _finished(records: list[types.Record]) -> bool:
    return bool(records) and isinstance(records[-1], types.RunEnded) and records[-1].is_final
