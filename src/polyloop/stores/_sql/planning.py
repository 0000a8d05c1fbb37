"""What a shared commit of a database store writes, decided once for both dialects before
anything is sent; each sends the plan its own way."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from polyloop.stores._writes import Claim, Write, check_order, fence_refusal
from polyloop.types import PolyLoopError, RunLocked

# One outcome per write of a batch: None (committed) or the error its caller sees.
Errors = list[BaseException | None]


@dataclass(eq=False)
class RunPlan:
    """One run's writes in a batch (each with its index), its claim and first seq."""

    run_id: str
    claim: Claim
    first_seq: int
    writes: list[tuple[int, Write]] = field(default_factory=list)

    @property
    def next_seq(self) -> int:
        return self.first_seq + sum(len(write.rows) for _, write in self.writes)

    @property
    def start(self) -> bool:
        return self.writes[0][1].start

    @property
    def ends(self) -> bool:
        return self.writes[-1][1].end

    @property
    def final(self) -> bool:
        return self.writes[-1][1].final

    @property
    def reason(self) -> str | None:
        return self.writes[-1][1].reason if self.ends else None

    @property
    def barrier(self) -> bool:
        return any(write.barrier for _, write in self.writes)

    @property
    def fenced(self) -> bool:
        return any(write.fenced for _, write in self.writes)

    @property
    def announce(self) -> bool:
        return any(write.announce for _, write in self.writes)

    def fenced_out(self, row: Sequence[Any] | None) -> PolyLoopError:
        """Why the fence moved no row for the run, given its row now (see ``fence_refusal``)."""
        epoch, start, fenced = self.claim.epoch, self.start, self.fenced
        return fence_refusal(self.run_id, epoch=epoch, row=row, start=start, fenced=fenced)

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
        run.writes.append((index, write))


def plan(writes: Sequence[Write], admit: Callable[[int], Claim]) -> Plan:
    """The plan of a batch; ``admit(index)`` returns the claim of a write, or raises."""
    result: Plan = Plan([None] * len(writes))
    for index, write in enumerate(writes):
        try:
            result._accept(index, write, admit(index))
        except PolyLoopError as exc:
            result.errors[index] = exc
    return result
