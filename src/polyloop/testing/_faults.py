"""A store wrapper that simulates a crash of the process after a given number of writes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import ParamSpec

from polyloop.ports import Store
from polyloop.types import (
    CancelRequest,
    Intent,
    JSONValue,
    Result,
    Review,
    RunEnded,
    RunLog,
    RunStarted,
    StepRecord,
)

_Args = ParamSpec("_Args")


class SimulatedCrash(Exception):
    """Raised by :class:`FaultyStore` in place of the write that would follow the crash."""


class FaultyStore:
    """Passes writes to ``inner`` until ``fail_after_writes`` of them have landed.

    Write number ``fail_after_writes + 1`` and every later one raise
    :class:`SimulatedCrash` without reaching ``inner``, as if the process had died right
    after write ``fail_after_writes``. Reads, claims, releases and cancel requests always
    pass (none writes a record of the run). :meth:`parameters` is the inner store's, so
    the run can be resumed on ``inner`` (or a fresh store on the same data).
    """

    def __init__(self, inner: Store, *, fail_after_writes: int) -> None:
        self.inner = inner
        self.fail_after_writes = fail_after_writes
        self.writes = 0

    @property
    def crashed(self) -> bool:
        return self.writes >= self.fail_after_writes

    def parameters(self) -> Mapping[str, JSONValue]:
        return self.inner.parameters()

    async def _write(
        self, write: Callable[_Args, Awaitable[None]], *args: _Args.args, **kwargs: _Args.kwargs
    ) -> None:
        # Every write passes here, so a subclass changes how the crash comes in one place.
        if self.crashed:
            raise SimulatedCrash(f"simulated crash after write {self.fail_after_writes}")
        self.writes += 1
        await write(*args, **kwargs)

    async def claim_run(self, run_id: str) -> None:
        await self.inner.claim_run(run_id)

    async def release_run(self, run_id: str) -> None:
        await self.inner.release_run(run_id)

    async def check_claim(self, run_id: str) -> None:
        await self.inner.check_claim(run_id)

    async def request_cancel(self, request: CancelRequest) -> None:
        await self.inner.request_cancel(request)  # another party's write, not the run's

    async def read_cancel(self, run_id: str) -> CancelRequest | None:
        return await self.inner.read_cancel(run_id)

    async def start_run(self, record: RunStarted) -> None:
        await self._write(self.inner.start_run, record)

    async def write_intent(self, intent: Intent) -> None:
        await self._write(self.inner.write_intent, intent)

    async def write_result(self, result: Result) -> None:
        await self._write(self.inner.write_result, result)

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        await self._write(self.inner.write_step, step, action_result)

    async def write_review(self, record: Review) -> None:
        await self._write(self.inner.write_review, record)

    async def read_log(self, run_id: str) -> RunLog:
        return await self.inner.read_log(run_id)

    async def end_run(self, record: RunEnded) -> None:
        await self._write(self.inner.end_run, record)
