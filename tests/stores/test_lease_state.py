"""The lease state machine on a fake clock: every transition in a table, and a property
that no effect may start once the database could have ended the lease.

The machine is plain data (``polyloop.stores._lease.LeaseState``): these tests have no event
loop, no thread and no database. The clock is a number the test passes in.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyloop.stores._lease import LeasePhase, LeaseState, effect_margin

LEASE_S = 12.0  # a margin of 4 s, renewals every 4 s


def _granted_at_zero() -> LeaseState:
    return LeaseState.granted(LEASE_S, 0.0)


# (what happened, as (event, clock reading) pairs; when to look; phase then)
TRANSITIONS = [
    ("just granted", [], 0.0, LeasePhase.HELD),
    ("granted, a third of a lease on", [], 4.0, LeasePhase.HELD),
    ("granted, less than the margin left", [], 8.5, LeasePhase.LATE),
    ("granted, deadline reached", [], 12.0, LeasePhase.LOST),
    ("renewal out", [("sent", 4.0)], 4.5, LeasePhase.RENEWING),
    (
        "renewal confirmed: counted from its sending",
        [("sent", 4.0), ("confirmed", 4.2)],
        11.9,
        LeasePhase.HELD,
    ),
    (
        "renewal confirmed, then the margin reached",
        [("sent", 4.0), ("confirmed", 4.2)],
        12.5,
        LeasePhase.LATE,
    ),
    (
        "renewal confirmed, then its deadline",
        [("sent", 4.0), ("confirmed", 4.2)],
        16.0,
        LeasePhase.LOST,
    ),
    (
        "renewal failed once: stands as it was",
        [("sent", 4.0), ("failed", 5.0)],
        6.0,
        LeasePhase.HELD,
    ),
    (
        "renewal failed twice: late",
        [("sent", 4.0), ("failed", 5.0), ("sent", 6.0), ("failed", 7.0)],
        9.0,
        LeasePhase.LATE,
    ),
    ("late, then renewed: held again", [("sent", 8.5), ("confirmed", 9.0)], 9.5, LeasePhase.HELD),
    ("renewal out while late: still late", [("sent", 9.0)], 9.5, LeasePhase.LATE),
    (
        "refused by the database: lost at once",
        [("sent", 4.0), ("refused", 4.1)],
        4.2,
        LeasePhase.LOST,
    ),
    (
        "the loop stalled past the deadline, then the renewal went out",
        [("sent", 13.0)],
        13.0,
        LeasePhase.LOST,
    ),
    (
        "process stopped while its renewal was out; the answer came after the deadline",
        [("sent", 11.0), ("confirmed", 30.0)],
        30.0,
        LeasePhase.LOST,
    ),
    (
        "lost stays lost, whatever is confirmed later",
        [("sent", 4.0), ("refused", 4.1), ("sent", 5.0), ("confirmed", 5.1)],
        5.2,
        LeasePhase.LOST,
    ),
    ("an answer with no renewal out changes nothing", [("confirmed", 2.0)], 9.0, LeasePhase.LATE),
]


def _apply(state: LeaseState, event: str, now: float) -> LeaseState:
    if event == "sent":
        return state.renewal_sent(now)
    if event == "confirmed":
        return state.renewal_confirmed(now)
    if event == "refused":
        return state.renewal_refused(now)
    assert event == "failed"
    return state.renewal_failed(now)


@pytest.mark.parametrize(
    ("events", "now", "phase"),
    [pytest.param(events, now, phase, id=name) for name, events, now, phase in TRANSITIONS],
)
def test_each_transition_on_a_fake_clock(
    events: list[tuple[str, float]], now: float, phase: LeasePhase
) -> None:
    state = _granted_at_zero()
    for event, at in events:
        state = _apply(state, event, at)
    assert state.phase(now) is phase


def test_the_margin_is_one_renewal_interval() -> None:
    assert effect_margin(LEASE_S) == pytest.approx(LEASE_S / 3)
    state = _granted_at_zero()
    assert state.phase(LEASE_S - effect_margin(LEASE_S) - 1e-9) is LeasePhase.HELD
    assert state.phase(LEASE_S - effect_margin(LEASE_S) + 1e-9) is LeasePhase.LATE
    assert state.phase(LEASE_S) is LeasePhase.LOST


# -- the property: the owner never believes in a lease the database has ended -------------


@dataclass
class _Database:
    """The database's side of one owner's lease: until when it holds there, and the
    renewal it has been sent but not yet run (the wire may delay it)."""

    expires_at: float
    pending_sent_at: float | None = None
    answer: bool | None = None  # the answer it gave, on its way back


_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["wait", "send", "database runs it", "answer arrives", "answer lost"]),
        st.floats(min_value=0.0, max_value=LEASE_S * 1.5, allow_nan=False),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(steps=_STEPS)
def test_no_effect_may_start_once_the_database_could_have_ended_the_lease(
    steps: list[tuple[str, float]],
) -> None:
    """Whatever the timing of renewals, their answers, stalls and pauses: whenever the
    owner says an effect may start, the database still holds the lease for at least the
    margin, so no other owner can have taken a run over; and a lost lease stays lost."""
    now = 0.0
    owner = _granted_at_zero()
    database = _Database(expires_at=LEASE_S)  # it ran the registration at 0 or later
    was_lost = False
    for action, amount in steps:
        if action == "wait":
            now += amount  # time passes: a slow loop, a stopped process, a paused machine
        elif action == "send" and database.pending_sent_at is None:
            owner = owner.renewal_sent(now)
            database.pending_sent_at, database.answer = now, None
        elif action == "database runs it" and database.pending_sent_at is not None:
            now += amount / 10  # it runs no earlier than it was sent
            renewed = now < database.expires_at
            if renewed:
                database.expires_at = now + LEASE_S
            database.answer, database.pending_sent_at = renewed, None
        elif action == "answer arrives" and database.answer is not None:
            now += amount / 10
            if database.answer:
                owner = owner.renewal_confirmed(now)
            else:
                owner = owner.renewal_refused(now)
            database.answer = None
        elif action == "answer lost" and (
            database.answer is not None or database.pending_sent_at is not None
        ):
            owner = owner.renewal_failed(now)
            database.answer, database.pending_sent_at = None, None
        phase = owner.phase(now)
        if phase in (LeasePhase.HELD, LeasePhase.RENEWING):  # an effect may start
            assert database.expires_at - now >= effect_margin(LEASE_S)
        if phase is not LeasePhase.LOST:  # a write may go
            assert database.expires_at > now
        lost = phase is LeasePhase.LOST
        assert not (was_lost and not lost), "a lost lease came back"
        was_lost = was_lost or lost
