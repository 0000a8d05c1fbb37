"""The in-memory store: fast, isolated per object, and gone with the process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import anyio

from polyloop import types
from polyloop._shared import FORMAT
from polyloop.ports import StoredRun
from polyloop.stores._engine import Archive, check_cutoff, finished, prune_runs
from polyloop.stores._port import StoreBase
from polyloop.stores._writes import (
    WriterState,
    announces_effect,
    cancel_refusal,
    check_order,
    claimed_already,
    no_run,
    not_claimed,
    taken,
)


class MemoryStore(StoreBase):
    """Keeps every run in this process's memory. NOT recoverable across processes.

    A run survives a failure inside the process (``resume`` with the same store object
    continues it), not its end; a claim only keeps out a second driver through this object.

    Cancellation, for every method: no method waits but :meth:`prune`, so each completes
    or does not start; ``prune`` deletes each run whole or not at all."""

    __slots__ = ("_cancels", "_claims", "_grown", "_runs", "_state", "_updated")

    def __init__(self) -> None:
        self._runs: dict[str, list[types.Record]] = {}
        self._cancels: dict[str, types.CancelRequest] = {}
        self._updated: dict[str, float] = {}  # time.time() of the last write
        self._claims: set[str] = set()
        self._grown: dict[str, anyio.Event] = {}  # set, and replaced, when a run changes
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

    async def request_cancel(self, request: types.CancelRequest) -> None:
        """Keep the run's first cancel request; its intents and proposals are refused."""
        self._state.check_open(request.run_id)
        if request.run_id not in self._runs:
            raise no_run(request.run_id)
        if request.run_id not in self._cancels:
            self._cancels[request.run_id] = taken(request)
            self._updated[request.run_id] = time.time()

    async def read_cancel(self, run_id: str) -> types.CancelRequest | None:
        """The run's cancel request, or ``None``."""
        self._state.check_open(run_id)
        return self._cancels.get(run_id)

    async def read_log(self, run_id: str) -> types.RunLog:
        """Every record of ``run_id``, in write order."""
        self._state.check_open(run_id)
        return types.RunLog(run_id=run_id, records=tuple(self._runs.get(run_id, ())))

    async def read_after(self, run_id: str, after: int) -> tuple[types.Record, ...]:
        """The records of ``run_id`` after position ``after``; ``RunNotFound`` if none."""
        self._state.check_open(run_id)
        if run_id not in self._runs:
            raise no_run(run_id)
        return tuple(self._runs[run_id][after:])

    @asynccontextmanager
    async def appended(self, run_id: str) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """Wake the block's ``wait`` on the run's next write or deletion."""
        grown = self._grown.setdefault(run_id, anyio.Event())

        async def wait() -> None:
            nonlocal grown
            await grown.wait()
            grown = self._grown.setdefault(run_id, anyio.Event())

        yield wait

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run, in the order the runs started (only unfinished ones if asked)."""
        self._state.check_open(None)
        listed = (self._stored(run_id) for run_id in self._runs)
        return tuple(run for run in listed if not (unfinished_only and run.finished))

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run as :meth:`list_runs` lists it, or ``None``."""
        self._state.check_open(run_id)
        return self._stored(run_id) if run_id in self._runs else None

    async def prune(self, *, finished_before: datetime, archive: Archive = None) -> tuple[str, ...]:
        """Delete the finished runs last written before ``finished_before``; their ids."""
        cutoff = check_cutoff(finished_before)
        stale = [run_id for run_id, at in self._updated.items() if at < cutoff.timestamp()]
        candidates = [run_id for run_id in stale if finished(self._runs[run_id])]
        return await prune_runs(self, candidates, archive=archive, delete=self._delete)

    async def _delete(self, run_id: str) -> bool:
        self._claims.discard(run_id)
        del self._runs[run_id], self._updated[run_id]
        self._cancels.pop(run_id, None)
        self._wake(run_id)
        return True

    async def aclose(self) -> None:
        """Give up every claim and refuse further use; idempotent."""
        self._state.closed = True
        self._claims.clear()

    def _stored(self, run_id: str) -> StoredRun:
        return StoredRun(
            run_id=run_id,
            finished=finished(self._runs[run_id]),
            claimed=run_id in self._claims,
            updated_at=datetime.fromtimestamp(self._updated[run_id], UTC),
            cancel_requested=run_id in self._cancels,
        )

    def _check_claimed(self, run_id: str) -> None:
        self._state.check_open(run_id)
        if run_id not in self._claims:
            raise not_claimed(run_id)

    async def _write(
        self, *records: types.Record, start: bool = False, barrier: bool = False
    ) -> None:
        """Append to a claimed run, in the order every store keeps; an end gives up the claim."""
        run_id = records[0].run_id
        self._check_claimed(run_id)
        kept = self._runs.get(run_id, [])
        check_order(run_id, start=start, started=bool(kept), finished=finished(kept))
        if run_id in self._cancels and announces_effect(records):
            raise cancel_refusal(self._cancels[run_id])
        self._runs.setdefault(run_id, []).extend(records)
        self._updated[run_id] = time.time()
        if isinstance(records[-1], types.RunEnded):
            self._claims.discard(run_id)
        self._wake(run_id)

    def _wake(self, run_id: str) -> None:
        if (grown := self._grown.pop(run_id, None)) is not None:
            grown.set()

    def __repr__(self) -> str:
        return f"MemoryStore(runs={len(self._runs)})"
