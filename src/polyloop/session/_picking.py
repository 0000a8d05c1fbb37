"""Which listed runs a host drives, and why: pure, over a store's listing and a log's plan.

A host (``polyloop worker``, :func:`polyloop.serve_agents`) lists a store's unfinished
runs, reads the log of each that changed, and asks :func:`choose` what to do with it.
A run goes on when nothing but a host is missing, for the reason
:func:`polyloop._recovery.ready` gives (the one ``run_status`` reports as
``RunStatus.ready``): it was started and never driven, a person answered what it waited
on, its tool's probe can settle its doubt, or the process driving it stopped; or
someone asked for it to be cancelled, and driving it ends it at once, even while it
waits for a person. It is left alone when someone else drives it, when its agent is not
hosted here (or it names none), and when it waits for a person.
"""

from __future__ import annotations

import enum
from collections.abc import Collection

from polyloop._recovery import Plan, RecoveryState, ready, waits_for_person
from polyloop.ports import StoredRun


class Choice(enum.StrEnum):
    """What a host does with a listed run, named by why. A run is driven for one of the
    reasons of :class:`~polyloop.types.Ready`, under the same name."""

    NEW = "new"
    APPROVED = "approved"
    REJECTED = "rejected"
    SETTLED = "settled"
    PROBE = "probe"
    INTERRUPTED = "interrupted"
    FINISHED = "finished"
    DRIVEN_HERE = "driven_here"
    CLAIMED = "claimed"
    NOT_STARTED = "not_started"
    NO_AGENT = "no_agent"
    NOT_HOSTED = "not_hosted"
    AWAITS_APPROVAL = "awaits_approval"
    AWAITS_SETTLEMENT = "awaits_settlement"
    CANCEL_REQUESTED = "cancel_requested"

    @property
    def drives(self) -> bool:
        """Whether the host drives the run."""
        return self in _DRIVES

    @property
    def waits_for_person(self) -> bool:
        """Whether the run is left waiting for a person's answer."""
        return self in (Choice.AWAITS_APPROVAL, Choice.AWAITS_SETTLEMENT)

    @property
    def text(self) -> str:
        """The reason in words, for a log line."""
        return _TEXTS[self]


_DRIVES = frozenset(
    {
        Choice.NEW,
        Choice.APPROVED,
        Choice.REJECTED,
        Choice.SETTLED,
        Choice.PROBE,
        Choice.INTERRUPTED,
        Choice.CANCEL_REQUESTED,
    }
)

_TEXTS = {
    Choice.NEW: "started and never driven",
    Choice.APPROVED: "a person approved the action it waited on",
    Choice.REJECTED: "a person rejected the action it waited on",
    Choice.SETTLED: "what became of the effect in doubt is settled",
    Choice.PROBE: "in doubt, and its tool's probe can settle it",
    Choice.INTERRUPTED: "left unfinished by a process that stopped",
    Choice.FINISHED: "finished",
    Choice.DRIVEN_HERE: "driven by this host already",
    Choice.CLAIMED: "a live writer holds it",
    Choice.NOT_STARTED: "no start record yet",
    Choice.NO_AGENT: "started without an agent",
    Choice.NOT_HOSTED: "its agent is not hosted here",
    Choice.AWAITS_APPROVAL: "waits for a person to approve or reject an action",
    Choice.AWAITS_SETTLEMENT: "in doubt: waits for a person to settle it",
    Choice.CANCEL_REQUESTED: "a person asked for it to be cancelled: it ends now",
}


def choose(
    stored: StoredRun,
    plan: Plan,
    *,
    hosted: Collection[str],
    has_probe: bool,
    driven_here: bool = False,
) -> Choice:
    """What a host of the agents named ``hosted`` does with ``stored``, whose log reads
    as ``plan``. ``has_probe`` says whether the run's tool can settle its doubt (asked
    only of a run in doubt); ``driven_here`` whether this host drives it already."""
    if driven_here:
        return Choice.DRIVEN_HERE
    if stored.finished or plan.state is RecoveryState.FINISHED:
        return Choice.FINISHED
    if stored.claimed:
        return Choice.CLAIMED
    if plan.started is None:
        return Choice.NOT_STARTED
    if plan.started.agent is None:
        return Choice.NO_AGENT
    if plan.started.agent not in hosted:
        return Choice.NOT_HOSTED
    if stored.cancel_requested:
        # Even a run that waits for a person: driving it ends it, before anything runs.
        return Choice.CANCEL_REQUESTED
    # The probe asked here is the hosted tool's own: it may settle a doubt an earlier
    # attempt could not (the system behind it was down, or the tool had no probe then).
    why = ready(plan, probe=has_probe)
    if why is not None:
        return Choice(why.value)
    # Until the log ends with the wait's end record, the wait is not on record (a
    # process stopped first): driving it records the wait.
    if not waits_for_person(plan):
        return Choice.INTERRUPTED
    if plan.state is RecoveryState.AWAITING_APPROVAL:
        return Choice.AWAITS_APPROVAL
    return Choice.AWAITS_SETTLEMENT
