"""Which snapshot each step of a run ran under, for ``show`` (text, JSON and HTML).

A run's snapshot is its start record's until an amendment changes it (record 0074): the
steps from the amendment's step on run under the amended one. A fork's inherited steps
ran in its source, under the snapshot its start record says the source held there.
"""

from __future__ import annotations

from collections.abc import Mapping

from polyloop.cli._view import RunView
from polyloop.session._amending import held_snapshots
from polyloop.session._forking import changed_keys
from polyloop.types import Amended, JSONValue, StepRecord


def amendments(view: RunView) -> list[Amended]:
    """The run's amendments, in log order."""
    return [record for record in view.log.records if isinstance(record, Amended)]


def snapshots(view: RunView) -> list[Mapping[str, JSONValue]]:
    """The start record's snapshot, then the one each amendment left, in log order."""
    return held_snapshots(view.snapshot, amendments(view))


def snapshot_index(view: RunView, step: StepRecord) -> int | None:
    """How many of the run's amendments ``step`` ran under (its index in
    :func:`snapshots`); ``None`` for a step a fork inherited, which ran in its source."""
    if view.is_inherited(step):
        return None
    return sum(1 for amended in amendments(view) if amended.step <= step.step)


def snapshots_json(view: RunView) -> dict[str, JSONValue]:
    """``show --json``'s snapshot keys: every snapshot the run held, the one it goes on
    under now, and a fork's inherited one (``null`` for any other run)."""
    held: list[JSONValue] = [dict(snapshot) for snapshot in snapshots(view)]
    started = view.started
    inherited = None if started is None else started.inherited_snapshot
    return {
        "snapshots": held,
        "effective_snapshot": held[-1],
        "inherited_snapshot": None if inherited is None else dict(inherited),
    }


def step_snapshot_text(view: RunView, step: StepRecord) -> str | None:
    """The snapshot ``step`` ran under, in words, for a run that has more than one;
    ``None`` otherwise (and for an inherited step, whose line says where it ran)."""
    index = snapshot_index(view, step)
    if index is None or not amendments(view):
        return None
    if index == 0:
        return "the start record's, before any amendment"
    amended = amendments(view)[index - 1]
    return f"as amended at step {amended.step} by {amended.by}"


def fork_snapshot_text(view: RunView) -> str | None:
    """How a fork's own snapshot differs from the one its source held where it was made;
    ``None`` for a fork that does not say (it inherited nothing, or predates the field)."""
    started = view.started
    if started is None or started.inherited_snapshot is None:
        return None
    differing = changed_keys(started.inherited_snapshot, started.snapshot)
    source = f"run {started.forked_from!r} held at step {started.forked_at_step}"
    if not differing:
        return f"the snapshot {source}"
    return f"differs from the snapshot {source} in {', '.join(differing)}"
