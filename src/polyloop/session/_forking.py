"""What a fork takes over from its source run: the first completed steps, and their digest.

A fork is a new run whose start record carries copies of the source's first steps, so
that it stands alone: its own log is all that ``resume``, ``show`` and ``verify`` read,
and pruning the source changes nothing for it. The source is read, never claimed: its
completed steps cannot change under a reader, whoever drives it meanwhile.

The fork's snapshot is its own request's, but its inherited steps ran under the source's:
the start record keeps the snapshot the source held at the fork's step (amendments
included), and a fork may not differ from it in how recorded steps read back (record
0074).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from polyloop import _recovery
from polyloop._shared import encodable_json
from polyloop.ports import Store
from polyloop.serialization import encode
from polyloop.session._amending import READS_BACK
from polyloop.types import (
    InvalidRequest,
    JSONValue,
    RunIdentityMismatch,
    RunLog,
    RunNotFound,
    RunStarted,
    StepRecord,
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inheritance:
    """The source run, the step the fork starts at, the source's steps before it, and
    the snapshot the source held at that step."""

    source_run_id: str
    at_step: int
    steps: tuple[StepRecord, ...]
    snapshot: Mapping[str, JSONValue]

    def check(self, run_id: str, current: Mapping[str, JSONValue]) -> None:
        """Refuse a fork whose snapshot ``current`` would read its inherited steps back
        otherwise than they ran: every other key may differ, that is what a fork is for."""
        if not self.steps:
            return
        differences = tuple(
            difference
            for difference in _recovery.identity_differences(self.snapshot, current)
            if difference[0] in READS_BACK
        )
        if differences:
            keys = ", ".join(key for key, _, _ in differences)
            why = "; ".join(READS_BACK[key] for key, _, _ in differences)
            raise RunIdentityMismatch(
                f"cannot fork run {self.source_run_id!r} at step {self.at_step} with another "
                f"{keys} than it held there: {why}",
                run_id=run_id,
                differences=differences,
            )

    def started(self, started: RunStarted) -> RunStarted:
        """``started``, the fork's start record, holding what it inherits."""
        copies = tuple(dataclasses.replace(step, run_id=started.run_id) for step in self.steps)
        return dataclasses.replace(
            started,
            forked_from=self.source_run_id,
            forked_at_step=self.at_step,
            inherited_sha256=inherited_digest(self.steps),
            inherited=copies or None,
            inherited_snapshot=dict(self.snapshot) if copies else None,
        )


def snapshot_held(log: RunLog, at_step: int) -> Mapping[str, JSONValue]:
    """The snapshot the run of ``log`` held at step ``at_step``: what a fork made there
    inherits (raises ``CorruptLog`` for a log whose records cannot follow each other)."""
    return _recovery.snapshot_at(_recovery.read_plan(log), at_step)


def changed_keys(
    inherited: Mapping[str, JSONValue], own: Mapping[str, JSONValue]
) -> tuple[str, ...]:
    """The identity keys in which a fork's own snapshot differs from the one it inherited."""
    return tuple(key for key, _, _ in _recovery.identity_differences(inherited, own))


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
    return Inheritance(
        source_run_id=source_run_id,
        at_step=at_step,
        steps=plan.steps[:at_step],
        snapshot=_recovery.snapshot_at(plan, at_step),
    )
