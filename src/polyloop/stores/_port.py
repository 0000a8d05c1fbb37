"""The store port's write calls, each over one ``_write``, and its context manager: the
same for every store (docs/stores.md#your-own-store)."""

from __future__ import annotations

from typing import Self

from polyloop import types
from polyloop._paging import Paged
from polyloop.types import Record, Result, StepRecord, StoreError


class StoreBase(Paged):
    """The store port's writes over one ``_write``; leaving an ``async with`` block closes it."""

    __slots__ = ()

    async def start_run(self, record: types.RunStarted) -> None:
        """Write the run's first record, a durable barrier."""
        await self._write(record, start=True, barrier=True)

    async def write_intent(self, intent: types.Intent) -> None:
        """Write an intent, a durable barrier."""
        await self._write(intent, barrier=True)

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call; committed, not necessarily durable."""
        await self._write(result)

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write the action result (if any) and the step record in one transaction."""
        records = (step,) if action_result is None else (action_result, step)
        if records[0].run_id != step.run_id:
            reason = f"the action result belongs to run {records[0].run_id!r}"
            raise StoreError(reason, run_id=step.run_id)
        await self._write(*records)

    async def write_review(self, record: types.Review) -> None:
        """Write a proposal, verdict or settlement, a durable barrier like an intent."""
        await self._write(record, barrier=True)

    async def end_run(self, record: types.RunEnded) -> None:
        """Write the run's end record and give up the claim, in one transaction."""
        await self._write(record)

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _write(
        self, *records: Record, start: bool = False, barrier: bool = False
    ) -> None: ...
