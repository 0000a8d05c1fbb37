"""The in-memory store: fast, isolated per object, and gone with the process."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from polyloop.types import (
    Intent,
    JSONValue,
    Record,
    Result,
    RunAlreadyExists,
    RunEnded,
    RunLog,
    RunStarted,
    StepRecord,
    StoreError,
)

_FORMAT = "polyloop/1"


class MemoryStore:
    """Keeps every run in this process's memory. NOT recoverable across processes.

    A run written here survives a failure inside the process (``resume`` with the same
    store object continues it) but not the end of the process. Choosing this store is
    the visible way of saying that a run needs no crash recovery; there is no default
    store. Records are kept as the objects written, so reads are exact and cheap.
    """

    __slots__ = ("_closed", "_runs")

    def __init__(self) -> None:
        self._runs: dict[str, list[Record]] = {}
        self._closed = False

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "memory", "format": _FORMAT}

    async def start_run(self, record: RunStarted) -> None:
        """Keep the first record of a run.

        Cancellation: the method never waits, so it completes or does not start.
        """
        self._check_open(record.run_id)
        if self._runs.get(record.run_id):
            raise RunAlreadyExists("the run already has records", run_id=record.run_id)
        self._runs[record.run_id] = [record]

    async def write_intent(self, intent: Intent) -> None:
        """Keep an intent (memory is as durable as this store gets).

        Cancellation: the method never waits, so it completes or does not start.
        """
        self._records(intent.run_id).append(intent)

    async def write_result(self, result: Result) -> None:
        """Keep a model result.

        Cancellation: the method never waits, so it completes or does not start.
        """
        self._records(result.run_id).append(result)

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Keep a step and its action result together.

        Cancellation: the method never waits, so both land or neither does.
        """
        records = self._records(step.run_id)
        if action_result is not None:
            if action_result.run_id != step.run_id:
                raise StoreError(
                    f"the action result belongs to run {action_result.run_id!r}",
                    run_id=step.run_id,
                )
            records.extend((action_result, step))
        else:
            records.append(step)

    async def read_log(self, run_id: str) -> RunLog:
        """Every record of ``run_id``, in write order.

        Cancellation: reading changes nothing.
        """
        self._check_open(run_id)
        return RunLog(run_id=run_id, records=tuple(self._runs.get(run_id, ())))

    async def end_run(self, record: RunEnded) -> None:
        """Keep the end record.

        Cancellation: the method never waits, so it completes or does not start.
        """
        self._records(record.run_id).append(record)

    def run_ids(self) -> tuple[str, ...]:
        """The ids of every run this store holds, in the order they started."""
        return tuple(self._runs)

    async def aclose(self) -> None:
        """Refuse further use; idempotent. The records go with the object.

        Cancellation: the method never waits.
        """
        self._closed = True

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self, run_id: str) -> None:
        if self._closed:
            raise StoreError("the store is closed", run_id=run_id)

    def _records(self, run_id: str) -> list[Record]:
        self._check_open(run_id)
        records = self._runs.get(run_id)
        if not records:
            raise StoreError("the run was never started in this store", run_id=run_id)
        return records

    def __repr__(self) -> str:
        return f"MemoryStore(runs={len(self._runs)})"
