"""What a fork takes over from its source run: the first completed steps, and their digest.

A fork is a new run whose start record carries copies of the source's first steps, so
that it stands alone: its own log is all that ``resume``, ``show`` and ``verify`` read,
and pruning the source changes nothing for it. The source is read, never claimed: its
completed steps cannot change under a reader, whoever drives it meanwhile.
"""

from __future__ import annotations

import dataclasses
import hashlib

from polyloop import _recovery
from polyloop._shared import encodable_json
from polyloop.ports import Store
from polyloop.serialization import encode
from polyloop.types import InvalidRequest, RunNotFound, RunStarted, StepRecord


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inheritance:
    """The source run, the step the fork starts at, and the source's steps before it."""

    source_run_id: str
    at_step: int
    steps: tuple[StepRecord, ...]

    def started(self, started: RunStarted) -> RunStarted:
        """``started``, the fork's start record, holding what it inherits."""
        copies = tuple(dataclasses.replace(step, run_id=started.run_id) for step in self.steps)
        return dataclasses.replace(
            started,
            forked_from=self.source_run_id,
            forked_at_step=self.at_step,
            inherited_sha256=inherited_digest(self.steps),
            inherited=copies or None,
        )


def inherited_digest(steps: tuple[StepRecord, ...]) -> str:
    """The SHA-256 of the source's step records, as a list of their encoded objects.

    Each record is in canonical JSON as the codec writes it: all-ASCII when it holds a
    lone surrogate, which UTF-8 cannot encode. Any other list hashes exactly as its
    canonical JSON, so the digests of forks without one never change.
    """
    text = "[" + ",".join(encodable_json(encode(step)) for step in steps) + "]"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_fork(run_id: str, source_run_id: object, at_step: object) -> None:
    """Refuse, before any I/O, a fork that names no source or no step it could start at."""
    if not isinstance(source_run_id, str) or not source_run_id:
        raise InvalidRequest(
            f"source_run_id must be a non-empty string, not {source_run_id!r:.40}", run_id=run_id
        )
    if source_run_id == run_id:
        raise InvalidRequest("a run cannot be forked onto its own run id", run_id=run_id)
    if isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0:
        raise InvalidRequest(
            f"at_step must be a whole number of at least 0, not {at_step!r:.40}", run_id=run_id
        )


async def read_inheritance(
    store: Store, run_id: str, source_run_id: str, at_step: int
) -> Inheritance:
    """The first ``at_step`` completed steps of ``source_run_id``, read without a claim.

    Raises ``RunNotFound`` (naming the source) if the store has no record of it, and
    ``InvalidRequest`` naming both numbers if it has fewer completed steps.
    """
    plan = _recovery.read_plan(await store.read_log(source_run_id))
    if plan.started is None:
        raise RunNotFound(
            f"cannot fork run {run_id!r} from it: the store holds no record of it",
            run_id=source_run_id,
        )
    complete = len(plan.steps)
    if at_step > complete:
        raise InvalidRequest(
            f"cannot fork at step {at_step}: run {source_run_id!r} has {complete} completed "
            f"steps, so a fork can start at step 0 to {complete}",
            run_id=run_id,
        )
    return Inheritance(source_run_id=source_run_id, at_step=at_step, steps=plan.steps[:at_step])
