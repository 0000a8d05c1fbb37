"""What a shared commit of a database store writes, decided once for both dialects before
anything is sent; each sends the plan its own way."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from polyloop.stores._writes import Claim, Write, cancel_refusal, check_order, kept_cancel
from polyloop.types import PolyLoopError, RunLocked, StoreError

# One outcome per write of a batch: None (committed) or the error its caller sees.
Errors = list[BaseException | None]


@dataclass(eq=False)
class RunPlan:
    """One run's writes in a batch (each with its index), its claim and first seq, and
    what they mean together: the first's ``start``, the last's end, any one's flags."""

    run_id: str
    claim: Claim
    first_seq: int
    writes: list[tuple[int, Write]] = field(default_factory=list)
    start: bool = False
    ends: bool = False
    final: bool = False
    reason: str | None = None
    barrier: bool = False
    fenced: bool = False
    announce: bool = False

    @property
    def next_seq(self) -> int:
        return self.first_seq + sum(len(write.rows) for _, write in self.writes)

    def add(self, index: int, write: Write) -> None:
        if not self.writes:
            self.start = write.start
        self.writes.append((index, write))
        self.ends, self.final, self.reason = write.end, write.final, write.reason
        self.barrier, self.fenced = self.barrier or write.barrier, self.fenced or write.fenced
        self.announce = self.announce or write.announce

    def fenced_out(self, row: Sequence[Any] | None) -> PolyLoopError:
        """Why the fence moved no row for the run, given its row now (its epoch, whether
        it finished, its next seq, and its cancel request's by, reason and time; ``None``
        when gone): a fenced write yields to a request."""
        if row is None or row[0] != self.claim.epoch:
            reason = "another writer claimed the run since this store object did"
            return RunLocked(reason, run_id=self.run_id)
        try:
            check_order(self.run_id, start=self.start, started=True, finished=bool(row[1]))
        except PolyLoopError as refusal:
            return refusal
        if self.fenced and row[5] is not None:
            return cancel_refusal(kept_cancel(self.run_id, *row[3:6]))
        return StoreError("the run's rows moved on without this writer", run_id=self.run_id)

    def rows(self) -> Iterator[tuple[int, str, str]]:
        """(seq, kind, body) of every row, numbered from :attr:`first_seq`."""
        seq = self.first_seq
        for _, write in self.writes:
            for kind, body in write.rows:
                yield seq, kind, body
                seq += 1


@dataclass(eq=False)
class Plan:
    """A batch as it will be sent: each run's writes, and every write's outcome so far."""

    errors: Errors
    runs: dict[str, RunPlan] = field(default_factory=dict)

    @property
    def barrier(self) -> bool:
        return any(run.barrier for run in self.runs.values())

    def refuse(self, run: RunPlan, error: BaseException) -> None:
        """Every write of ``run`` that has no outcome yet ends with ``error``."""
        for index, _ in run.writes:
            if self.errors[index] is None:
                self.errors[index] = error

    def written(self, run: RunPlan) -> bool:
        return all(self.errors[index] is None for index, _ in run.writes)

    def settle(self) -> list[str]:
        """Move the claim of every run written whole on; the runs that ended with it."""
        ended = []
        for run in self.runs.values():
            if self.written(run):
                run.claim.next_seq = run.next_seq
                run.claim.finished = run.final if run.ends else run.claim.finished
                if run.ends:
                    ended.append(run.run_id)
        return ended

    def _accept(self, index: int, write: Write, claim: Claim) -> None:
        run = self.runs.get(write.run_id)
        started = claim.next_seq > 0 if run is None else True
        finished = claim.finished if run is None else run.ends and run.final
        check_order(write.run_id, start=write.start, started=started, finished=finished)
        if run is None:
            run = self.runs[write.run_id] = RunPlan(write.run_id, claim, claim.next_seq)
        elif run.ends:  # an earlier write of this batch ends the run, and its claim
            raise RunLocked("the run's claim ends with its end record", run_id=write.run_id)
        run.add(index, write)


def plan(writes: Sequence[Write], admit: Callable[[int], Claim]) -> Plan:
    """The plan of a batch; ``admit(index)`` returns the claim of a write, or raises."""
    result: Plan = Plan([None] * len(writes))
    for index, write in enumerate(writes):
        try:
            result._accept(index, write, admit(index))
        except PolyLoopError as exc:
            result.errors[index] = exc
    return result
