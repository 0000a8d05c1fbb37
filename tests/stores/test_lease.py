"""The lease keeper's answers to writes and effects, on a fake clock.

Every deadline is read from a clock the test sets, and the keeper thread is stopped as
soon as it starts: each renewal below is sent by the test, so the outcome never depends
on how busy the machine is.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from polyloop import LeaseLost
from polyloop.stores._lease import Lease
from polyloop.stores._lease_state import LeasePhase

pytestmark = pytest.mark.anyio

LEASE_S = 2.4  # a margin of 0.8 of the fake clock's seconds


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _registered(clock: FakeClock, renew: object = None) -> tuple[Lease, str, int]:
    answers = renew if callable(renew) else (lambda owner_id: True)
    lease = Lease(LEASE_S, answers, clock=clock)
    owner_id, generation, _ = lease.current()
    lease.registered(owner_id, clock(), anyio.lowlevel.current_token())
    lease.stop()  # the keeper renews on real time; here the test renews, by hand
    return lease, owner_id, generation


async def test_an_effect_starts_while_the_lease_is_held_and_never_after_its_deadline() -> None:
    clock = FakeClock()
    lease, owner_id, generation = _registered(clock)
    try:
        await lease.confirm(generation, "r")
        clock.now = LEASE_S + 0.01  # the process was stopped past its lease
        with pytest.raises(LeaseLost, match="lease ended") as lost:
            await lease.confirm(generation, "r")
        assert lost.value.run_id == "r"
        with pytest.raises(LeaseLost):
            lease.check(generation, "r")  # nor is anything written
        new_owner, new_generation, registered = lease.current()
        assert (new_owner != owner_id, new_generation, registered) == (True, generation + 1, False)
    finally:
        lease.stop()


async def test_a_late_lease_lets_writes_through_but_holds_effects_until_renewed() -> None:
    clock = FakeClock()
    lease, owner_id, generation = _registered(clock)
    try:
        clock.now = LEASE_S - 0.7  # less than the margin left: late
        assert lease.phase(generation) is LeasePhase.LATE
        lease.check(generation, "r")  # a write still goes: the database fences it
        started = anyio.Event()

        async def effect() -> None:
            await lease.confirm(generation, "r")
            started.set()

        async with anyio.create_task_group() as group:
            group.start_soon(effect)
            await anyio.sleep(LEASE_S / 12)
            assert not started.is_set()  # waiting for the renewal
            assert await anyio.to_thread.run_sync(lease._renew_once, owner_id)
            with anyio.fail_after(5):
                await started.wait()
        assert lease.phase(generation) is LeasePhase.HELD
    finally:
        lease.stop()


async def test_a_late_lease_that_runs_out_while_an_effect_waits_refuses_it() -> None:
    clock = FakeClock()
    lease, _, generation = _registered(clock)
    try:
        clock.now = LEASE_S - 0.7
        async with anyio.create_task_group() as group:

            async def run_out() -> None:
                await anyio.sleep(LEASE_S / 12)
                clock.now = LEASE_S  # no renewal came in time

            group.start_soon(run_out)
            with anyio.fail_after(5), pytest.raises(LeaseLost):
                await lease.confirm(generation, "r")
    finally:
        lease.stop()


@pytest.mark.parametrize(
    ("answer", "phase"),
    [("renewed", LeasePhase.HELD), ("refused", LeasePhase.LOST), ("no answer", LeasePhase.HELD)],
)
async def test_each_answer_to_a_renewal_moves_the_lease(answer: str, phase: LeasePhase) -> None:
    """Renewed: the deadline counts from the renewal's sending. Refused (the database
    ended the lease, another owner may hold the runs): lost at once. No answer: the
    lease stands as it was, and is tried again soon."""

    def renew(owner_id: str) -> bool:
        if answer == "no answer":
            raise OSError("the server did not answer")
        return answer == "renewed"

    clock = FakeClock()
    lease, owner_id, generation = _registered(clock, renew)
    try:
        clock.now = LEASE_S / 3
        answered = await anyio.to_thread.run_sync(lease._renew_once, owner_id)
        assert answered is (answer != "no answer")
        assert lease.phase(generation) is phase
        clock.now = LEASE_S + 0.1  # renewed at LEASE_S / 3: holds; otherwise ended
        held = lease.phase(generation) is not LeasePhase.LOST
        assert held is (answer == "renewed")
    finally:
        lease.stop()
