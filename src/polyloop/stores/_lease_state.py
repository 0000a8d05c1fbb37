"""An owner's own view of its lease as one state machine: held, renewing, late, lost.

Plain data on one clock of this process, driven by :class:`~polyloop.stores._lease.Lease`.
A renewal counts from when it was sent, so the ``deadline`` is never later than the moment
the database can end the lease. Research record 0031 draws the timeline."""

from __future__ import annotations

import dataclasses
import enum


def effect_margin(lease_s: float) -> float:
    """How much of its lease an owner must have left to start an effect: one renewal
    interval, so an effect starts only while at most one renewal was missed."""
    return lease_s / 3


class LeasePhase(enum.Enum):
    """``HELD`` and ``RENEWING`` (a renewal out) have the margin left: effects may start.
    ``LATE`` has less: writes go (the database fences them), effects wait. ``LOST`` is
    final: nothing more is written under the lease."""

    HELD = "held"
    RENEWING = "renewing"
    LATE = "late"
    LOST = "lost"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeaseState:
    """One owner identity's lease: the clock reading before which the database cannot
    have ended it, when the renewal now out was sent, and whether it is lost."""

    lease_s: float
    deadline: float
    renewal_sent_at: float | None = None
    lost: bool = False

    @classmethod
    def granted(cls, lease_s: float, sent_at: float) -> LeaseState:
        """The lease granted to a registration sent at ``sent_at``."""
        return cls(lease_s=lease_s, deadline=sent_at + lease_s)

    def phase(self, now: float) -> LeasePhase:
        if self.lost or now >= self.deadline:
            return LeasePhase.LOST
        if self.deadline - now < effect_margin(self.lease_s):
            return LeasePhase.LATE
        return LeasePhase.HELD if self.renewal_sent_at is None else LeasePhase.RENEWING

    def renewal_sent(self, now: float) -> LeaseState:
        return self._lost_at(now) or dataclasses.replace(self, renewal_sent_at=now)

    def renewal_confirmed(self, now: float) -> LeaseState:
        """Extended from the sending; an answer after the deadline is too late."""
        sent_at = self.renewal_sent_at
        until = self.deadline if sent_at is None else max(self.deadline, sent_at + self.lease_s)
        return self._lost_at(now) or dataclasses.replace(self, deadline=until, renewal_sent_at=None)

    def renewal_refused(self, now: float) -> LeaseState:
        """The database had already ended the lease."""
        return dataclasses.replace(self, lost=True, renewal_sent_at=None)

    def renewal_failed(self, now: float) -> LeaseState:
        """No answer came: the lease stands as it was until its deadline."""
        return self._lost_at(now) or dataclasses.replace(self, renewal_sent_at=None)

    def _lost_at(self, now: float) -> LeaseState | None:
        return self.renewal_refused(now) if self.phase(now) is LeasePhase.LOST else None
