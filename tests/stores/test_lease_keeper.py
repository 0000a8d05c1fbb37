"""The lease keeper on a fake clock: the real keeper thread, driven one pause at a time.

Every deadline is read from a clock the test sets, and every pause of the keeper ends
only when the test lets it, moving that clock on by the pause. The database is a fake on
the same clock. So each renewal, each question to the event loop and each loss happens
exactly where the test puts it, however busy the machine is.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from polyloop import InvalidRequest, LeaseLost
from polyloop.stores import PostgresStore, SqliteStore
from polyloop.stores._lease import Lease, LeasePhase

pytestmark = pytest.mark.anyio

# Renewals every 4 s of the fake clock, retries every 1 s, an effect margin of 4 s: all
# exact in binary, so no phase boundary depends on rounding.
LEASE_S = 12.0
PAUSE, RETRY = LEASE_S / 3, LEASE_S / 12
STALL_WARNING = "event loop took"


class FakeTime:
    """The clock the lease reads and the pauses its keeper takes: a pause ends when the
    test releases it, and moves the clock on by its length."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []  # every pause the keeper began
        self.keeper_reads = 0  # clock readings on the keeper thread
        self._released = 0
        self._stopping = False
        self._changed = threading.Condition()

    def clock(self) -> float:
        with self._changed:
            if threading.current_thread().name == "polyloop-lease":
                self.keeper_reads += 1
                self._changed.notify_all()
            return self.now

    def wait(self, seconds: float) -> bool:
        """The keeper's pause: True once the test stops it."""
        with self._changed:
            self.pauses.append(seconds)
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._released >= len(self.pauses) or self._stopping)
            if self._stopping:
                return True
            self.now += seconds
            return False

    def release(self) -> None:
        """End the keeper's pause, once it has begun one."""
        with self._changed:
            self._until(lambda: len(self.pauses) > self._released)
            self._released += 1
            self._changed.notify_all()

    def paused(self) -> None:
        """Until the keeper, released, has begun its next pause."""
        with self._changed:
            self._until(lambda: len(self.pauses) > self._released)

    def stall(self, seconds: float) -> None:
        """Called on the event loop, which it holds: release the keeper, and once it has
        asked the loop for a sign of life (and read the clock for it), let time pass."""
        reads = self.keeper_reads
        self.release()
        with self._changed:
            self._until(lambda: self.keeper_reads > reads)
            self.now += seconds

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def _until(self, ready: Callable[[], bool]) -> None:
        assert self._changed.wait_for(ready, timeout=10), "the keeper never got there"


class FakeDatabase:
    """The owners table on the fake clock: it renews a lease that has not ended there."""

    def __init__(self, time: FakeTime, failures: int) -> None:
        self.time = time
        self.failures = failures  # renewals that get no answer, before any that do
        self.expires: dict[str, float] = {}
        self.renewals: list[str] = []

    def renew(self, owner_id: str) -> bool:
        self.renewals.append(owner_id)
        if self.failures:
            self.failures -= 1
            raise OSError("the server did not answer")
        if self.time.now >= self.expires.get(owner_id, -math.inf):
            return False
        self.expires[owner_id] = self.time.now + LEASE_S
        return True

    def take_over(self, owner_id: str) -> None:
        """Another owner takes this one's runs: its lease ends in the database."""
        self.expires[owner_id] = -math.inf


class FakeTimeLease(Lease):
    """The library's lease, reading the fake clock and pausing on the fake time."""

    def __init__(self, time: FakeTime, database: FakeDatabase) -> None:
        super().__init__(LEASE_S, database.renew)
        self.time = time

    def clock(self) -> float:
        return self.time.clock()

    def pause(self, seconds: float) -> bool:
        return self.time.wait(seconds)


class Rig:
    def __init__(self, failures: int = 0) -> None:
        self.time = FakeTime()
        self.database = FakeDatabase(self.time, failures)
        self.lease = FakeTimeLease(self.time, self.database)

    def register(self) -> tuple[str, int]:
        """Register the owner the next claim would use (on the event loop)."""
        owner_id, generation, _ = self.lease.current()
        self.database.expires[owner_id] = self.time.now + LEASE_S
        self.lease.registered(owner_id, self.time.now, anyio.lowlevel.current_token())
        return owner_id, generation

    async def step(self, times: int = 1) -> None:
        """Let the keeper run ``times`` rounds, the event loop free to answer it."""
        for _ in range(times):
            await anyio.to_thread.run_sync(self.time.release)
            await anyio.to_thread.run_sync(self.time.paused)


Make = Callable[..., Rig]


@pytest.fixture
def rig() -> Iterator[Make]:
    """Makes a lease on fake time; stops its keeper after the test."""
    made: list[Rig] = []

    def make(failures: int = 0) -> Rig:
        made.append(Rig(failures))
        return made[-1]

    yield make
    for each in made:
        each.time.stop()
        each.lease.stop()


async def test_the_keeper_renews_every_third_of_a_lease_while_the_loop_runs(rig: Make) -> None:
    kept = rig()
    owner_id, generation = kept.register()
    await kept.step(6)  # two leases' worth
    assert kept.time.now == 2 * LEASE_S
    assert kept.database.renewals == [owner_id] * 6
    assert kept.time.pauses == [PAUSE] * 7
    assert kept.lease.phase(generation) is LeasePhase.HELD
    kept.lease.check(generation, "r")
    await kept.lease.confirm(generation, "r")


# (renewals without an answer first, taken over by another owner, rounds, then: phase,
# pauses, renewals sent)
ANSWERS = {
    "renewal succeeds": (0, False, 1, LeasePhase.HELD, [PAUSE, PAUSE], 1),
    "fails once: tried again soon": (1, False, 2, LeasePhase.HELD, [PAUSE, RETRY, PAUSE], 2),
    "fails twice": (2, False, 3, LeasePhase.HELD, [PAUSE, RETRY, RETRY, PAUSE], 3),
    "fails until the margin is gone": (6, False, 6, LeasePhase.LATE, [PAUSE] + [RETRY] * 6, 6),
    # At the deadline the keeper sends nothing more: the lease is lost.
    "fails past the deadline": (99, False, 9, LeasePhase.LOST, [PAUSE] + [RETRY] * 8 + [PAUSE], 8),
    "another owner took over: refused": (0, True, 1, LeasePhase.LOST, [PAUSE, PAUSE], 1),
}


@pytest.mark.parametrize(
    ("failures", "taken_over", "rounds", "phase", "pauses", "sent"),
    list(ANSWERS.values()),
    ids=list(ANSWERS),
)
async def test_each_answer_to_a_renewal_moves_the_lease(
    rig: Make,
    failures: int,
    taken_over: bool,
    rounds: int,
    phase: LeasePhase,
    pauses: list[float],
    sent: int,
) -> None:
    kept = rig(failures)
    owner_id, generation = kept.register()
    if taken_over:
        kept.database.take_over(owner_id)
    await kept.step(rounds)
    assert kept.lease.phase(generation) is phase
    assert kept.time.pauses == pauses
    assert kept.database.renewals == [owner_id] * sent
    now_owner, now_generation, registered = kept.lease.current()
    lost = phase is LeasePhase.LOST
    assert (now_owner != owner_id, now_generation, registered) == (
        lost,
        generation + lost,
        not lost,
    )


async def test_a_loop_busy_with_writes_keeps_its_lease_without_answering(rig: Make) -> None:
    """Thousands of ready runs can keep the keeper's no-op waiting for seconds; the
    writes that go on meanwhile show the loop lives, so the keeper renews without it."""
    kept = rig()
    owner_id, generation = kept.register()
    for _ in range(12):  # four leases, and the event loop never yields to the keeper
        kept.lease.beat()
        kept.time.release()
        kept.time.paused()
    assert kept.database.renewals == [owner_id] * 12
    kept.lease.check(generation, "r")


async def test_a_stuck_loop_renews_nothing_and_wakes_to_a_lost_lease(
    rig: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """No write and no answer from the loop: the keeper renews nothing, the lease runs
    out, and the refusal says the loop held the renewal up, and for how long."""
    kept = rig()
    owner_id, generation = kept.register()
    await kept.step()  # renewed at 4 s: the lease holds until 16 s
    kept.time.stall(LEASE_S + 1)  # the keeper asks at 8 s; the loop answers at 21 s
    assert kept.database.renewals == [owner_id]  # nothing was renewed meanwhile
    with pytest.raises(LeaseLost, match=r"lease ended .* event loop once took 13\.0 s") as lost:
        kept.lease.check(generation, "r")  # the loop's first write after the stall
    assert lost.value.run_id == "r"
    await anyio.to_thread.run_sync(kept.time.paused)
    assert kept.database.renewals == [owner_id]  # nor after: the lease had ended
    assert [r.levelname for r in caplog.records if STALL_WARNING in r.getMessage()] == ["WARNING"]
    assert kept.lease.current()[0] != owner_id


async def test_a_loop_slow_to_answer_is_warned_of_and_keeps_its_lease(
    rig: Make, caplog: pytest.LogCaptureFixture
) -> None:
    kept = rig()
    owner_id, generation = kept.register()
    await kept.step()  # answered at once: nothing to say
    assert STALL_WARNING not in caplog.text
    kept.time.stall(LEASE_S / 2)  # asked at 8 s, answered at 14 s, two before the deadline
    await anyio.to_thread.run_sync(kept.time.paused)
    (warning,) = [r for r in caplog.records if STALL_WARNING in r.getMessage()]
    assert "took 6.0 s" in warning.getMessage()
    assert "raise lease_s above the longest stall" in warning.getMessage()
    assert kept.database.renewals == [owner_id] * 2
    assert kept.lease.phase(generation) is LeasePhase.HELD


@pytest.mark.parametrize("first", ["the event loop", "the keeper"])
async def test_an_owner_stopped_past_its_lease_wakes_refused_under_a_new_id(
    rig: Make, first: str
) -> None:
    """A process stopped (keeper and all) past its lease starts no effect and writes
    nothing once it wakes, whichever thread runs first; its next claim registers a new
    owner id, whose lease the keeper then keeps."""
    kept = rig()
    owner_id, generation = kept.register()
    await kept.step()  # renewed at 4 s: the lease holds until 16 s
    kept.time.now += 2 * LEASE_S
    kept.database.take_over(owner_id)  # meanwhile another worker took the runs
    if first == "the keeper":
        await kept.step()
    with pytest.raises(LeaseLost):
        await kept.lease.confirm(generation, "r")  # no effect starts
    with pytest.raises(LeaseLost):
        kept.lease.check(generation, "r")  # nothing is written
    if first == "the event loop":
        await kept.step()
    assert kept.database.renewals == [owner_id]  # the old identity is never renewed again
    new_owner, new_generation = kept.register()
    assert (new_owner != owner_id, new_generation) == (True, generation + 1)
    await kept.step()
    assert kept.database.renewals == [owner_id, new_owner]
    kept.lease.check(new_generation, "r")
    with pytest.raises(LeaseLost):
        kept.lease.check(generation, "r")  # a lost lease stays lost


async def test_a_late_lease_lets_writes_through_but_holds_effects_until_renewed(
    rig: Make,
) -> None:
    """A database blip costs a pause, not the run."""
    kept = rig(failures=6)
    _, generation = kept.register()
    await kept.step(6)  # every renewal failed: 3 s left, less than the margin
    assert kept.lease.phase(generation) is LeasePhase.LATE
    kept.lease.check(generation, "r")  # a write still goes: the database fences it
    started = anyio.Event()

    async def effect() -> None:
        await kept.lease.confirm(generation, "r")
        started.set()

    async with anyio.create_task_group() as group:
        group.start_soon(effect)
        await anyio.wait_all_tasks_blocked()
        assert not started.is_set()  # waiting for the renewal
        await kept.step()  # renewed at 10 s
        with anyio.fail_after(5):
            await started.wait()
    assert kept.lease.phase(generation) is LeasePhase.HELD


async def test_a_late_lease_that_runs_out_while_an_effect_waits_refuses_it(rig: Make) -> None:
    kept = rig(failures=99)
    _, generation = kept.register()
    await kept.step(6)
    async with anyio.create_task_group() as group:

        async def run_out() -> None:
            await anyio.wait_all_tasks_blocked()
            await kept.step(3)  # no renewal comes, and the deadline passes

        group.start_soon(run_out)
        with anyio.fail_after(5), pytest.raises(LeaseLost):
            await kept.lease.confirm(generation, "r")


def test_lease_s_must_be_a_positive_number() -> None:
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(InvalidRequest, match="lease_s"):
            PostgresStore("postgresql://x@127.0.0.1:1/none", lease_s=bad)  # type: ignore[arg-type]


def test_a_sqlite_store_has_no_lease(tmp_path: Path) -> None:
    """SQLite is a store for one host: its claims are locks, with no lease to set."""
    with pytest.raises(TypeError, match="lease_s"):
        SqliteStore(tmp_path / "runs.db", lease_s=15.0)  # type: ignore[call-arg]
