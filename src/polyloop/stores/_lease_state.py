"""A lease as one explicit state machine: held, renewing, late, lost.

This is the owner's own view of its lease, on one clock of this process, as plain data:
no thread, no database, no event loop. :class:`~polyloop.stores._lease.Lease` drives it
from the keeper thread and asks it before every write and every effect.

The one rule the machine keeps: its ``deadline`` is never later than the moment the
database can end the lease. A renewal counts from when it was *sent*, not from when its
answer came, because the database counts from when it ran the statement, which is no
earlier. So while the clock reads before ``deadline``, no other owner can have taken
over a run held under this lease.

The phases, by the clock reading ``now`` (research record 0031 draws the timeline):

* ``HELD``: at least :func:`effect_margin` left and no renewal out; an effect may start.
* ``RENEWING``: a renewal is out, with at least the margin left; an effect may start.
* ``LATE``: less than the margin left (renewals failed, or the event loop stalled);
  writes may still land (the database fences them), but no effect may start.
* ``LOST``: the deadline passed, or the database refused a renewal. Final: no answer
  that comes later brings it back, and nothing more may be written under it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

__all__ = ("LeasePhase", "LeaseState", "effect_margin")

# What part of a lease must be left for an effect to start: one renewal interval, so an
# effect starts only while the lease has survived at most one missed renewal.
_MARGIN_FRACTION = 1 / 3


def effect_margin(lease_s: float) -> float:
    """How much of its lease an owner must have left to start an effect."""
    return lease_s * _MARGIN_FRACTION


class LeasePhase(enum.Enum):
    """Where a lease stands at one clock reading."""

    HELD = "held"
    RENEWING = "renewing"
    LATE = "late"
    LOST = "lost"


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseState:
    """One owner identity's lease: until when it surely holds, and the renewal out.

    ``deadline`` is a reading of the owner's clock before which the database cannot
    have ended the lease; ``renewal_sent_at`` is when the renewal now awaiting its
    answer was sent (``None`` when none is out); ``lost`` is final.
    """

    lease_s: float
    deadline: float
    renewal_sent_at: float | None = None
    lost: bool = False

    @classmethod
    def granted(cls, lease_s: float, sent_at: float) -> LeaseState:
        """The lease the database granted to a registration sent at ``sent_at``."""
        return cls(lease_s=lease_s, deadline=sent_at + lease_s)

    def phase(self, now: float) -> LeasePhase:
        """The phase at clock reading ``now``."""
        if self.lost or now >= self.deadline:
            return LeasePhase.LOST
        if self.deadline - now < effect_margin(self.lease_s):
            return LeasePhase.LATE
        if self.renewal_sent_at is not None:
            return LeasePhase.RENEWING
        return LeasePhase.HELD

    def may_write(self, now: float) -> bool:
        """Whether a write may be sent under this lease at ``now``."""
        return self.phase(now) is not LeasePhase.LOST

    def may_start_effect(self, now: float) -> bool:
        """Whether an effect (a model call, an action) may start under this lease at ``now``."""
        return self.phase(now) in (LeasePhase.HELD, LeasePhase.RENEWING)

    def remaining(self, now: float) -> float:
        """How long the lease surely holds from ``now`` (0 once lost)."""
        return 0.0 if self.phase(now) is LeasePhase.LOST else self.deadline - now

    # -- transitions: each takes the clock reading at which it happens ---------------------

    def renewal_sent(self, now: float) -> LeaseState:
        """A renewal was sent at ``now`` (a renewal sent once the lease is lost is moot)."""
        if self.phase(now) is LeasePhase.LOST:
            return self._lost()
        return dataclasses.replace(self, renewal_sent_at=now)

    def renewal_confirmed(self, now: float) -> LeaseState:
        """The database extended the lease, and said so at ``now``.

        The new deadline counts from when the renewal was sent. An answer that comes
        after the deadline passed changes nothing: the lease was lost meanwhile, and
        whoever looked in that time was told so.
        """
        if self.phase(now) is LeasePhase.LOST:
            return self._lost()
        sent_at = self.renewal_sent_at
        if sent_at is None:
            return self
        deadline = max(self.deadline, sent_at + self.lease_s)
        return dataclasses.replace(self, deadline=deadline, renewal_sent_at=None)

    def renewal_refused(self, now: float) -> LeaseState:
        """The database answered that the lease had already ended there."""
        return self._lost()

    def renewal_failed(self, now: float) -> LeaseState:
        """The renewal got no answer (an error, a lost connection, a deadline): the
        lease stands as it was, and may still be renewed before its deadline."""
        if self.phase(now) is LeasePhase.LOST:
            return self._lost()
        return dataclasses.replace(self, renewal_sent_at=None)

    def _lost(self) -> LeaseState:
        return dataclasses.replace(self, lost=True, renewal_sent_at=None)
