"""Owner leases: how a store object serving a fleet keeps its claims, and how it loses them.

A store object that claims runs in a shared database is an *owner*: an id of its own, a
row in the ``owners`` table saying until when its lease holds, and a lock that only a
living process can hold (a PostgreSQL session lock, a ``flock``). Another worker may
take a run over when its owner's lease has ended or its owner's lock is free (the
process died). Every claim moves the run's epoch on, and every write checks the epoch
in its own transaction, so a former owner that wakes up writes nothing.

:class:`Lease` is the owner's side. A keeper thread renews the lease every third of
its length (and again soon after a renewal that failed), but only while the event loop
that uses the store shows it is running: either the store's write path ran on it since
the last renewal (each write calls :meth:`Lease.beat`), or, when no write came, the loop
ran a no-op the keeper sent it. A process whose loop is stuck (a blocking call, a
debugger) or stopped (``SIGSTOP``, a paused machine) stops renewing and its lease runs
out, at most one renewal later than its last write; a loop that merely awaits a long
model call keeps it, and so does a loop so busy with thousands of runs that the no-op
would wait its turn for seconds (research record 0029). The owner
also keeps a deadline of its own, measured from before each renewal was sent, so it
never believes in a lease the database has ended: :mod:`~polyloop.stores._lease_state`
holds that reckoning as a state machine (held, renewing, late, lost) on an injectable
clock. No effect starts unless the lease is held with a margin to spare
(:meth:`Lease.confirm`); once the deadline passes, every claim taken under that lease
is lost for good (writes and effects get ``LeaseLost``) and the store takes a new owner
id for its next claim: a revived process never resumes its old identity.

A loop that is merely overloaded (thousands of runs ready at once) stalls too. The
keeper logs a warning when the loop took a third of a lease or more to run its no-op,
and ``RunLocked`` says how long the loop kept the renewal waiting, so an operator can
tell an overloaded process from a lost database and size the lease or the load.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import anyio
import anyio.from_thread
from anyio.lowlevel import EventLoopToken

from polyloop.stores._lease_state import LeasePhase, LeaseState
from polyloop.types import InvalidRequest, LeaseLost

__all__ = ("Clock", "Lease", "check_lease_s", "lease_clock")

logger = logging.getLogger("polyloop")

Clock = Callable[[], float]

# How many renewals fit in one lease: a renewal may fail or come late twice and the
# lease still holds.
_RENEWALS_PER_LEASE = 3
# How soon a failed renewal is tried again, as a fraction of the lease.
_RETRIES_PER_LEASE = 12
# How often an effect waiting on a late lease looks again, as a fraction of the lease.
_LOOKS_PER_LEASE = 48


def lease_clock() -> float:
    """Seconds on a clock that never goes back and keeps counting while the machine
    sleeps (``CLOCK_BOOTTIME`` where there is one): a process paused or suspended past
    its lease must see that its lease has run out."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def check_lease_s(lease_s: float) -> None:
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not lease_s > 0:
        raise InvalidRequest(f"lease_s must be a positive number of seconds, not {lease_s!r}")


def _nothing() -> None:
    return None


class Lease:
    """One store object's lease as an owner of claims (thread-safe).

    ``renew(owner_id)`` is the store's blocking renewal: it extends the owner's lease in
    the database only if the lease has not ended there, and returns whether it did.
    ``clock`` is read for every deadline (a test passes a fake one).
    """

    def __init__(
        self, lease_s: float, renew: Callable[[str], bool], *, clock: Clock = lease_clock
    ) -> None:
        check_lease_s(lease_s)
        self.lease_s = float(lease_s)
        self.clock = clock
        self.description = f"{socket.gethostname()} pid {os.getpid()}"
        self._renew = renew
        self._mutex = threading.Lock()
        self._owner_id = uuid.uuid4().hex
        self._generation = 0
        self._state: LeaseState | None = None  # None: the owner is not registered
        self._token: EventLoopToken | None = None
        self._keeper: threading.Thread | None = None
        self._stopping = threading.Event()
        # The longest the event loop took to run the keeper's no-op, and when the
        # keeper began waiting for it now (None when it is not waiting): for messages.
        self._longest_wait_s = 0.0
        self._waiting_since: float | None = None
        # Counted up on the event loop by every write; read by the keeper thread. An
        # int read or written whole needs no lock: only its change matters.
        self._beats = 0

    def current(self) -> tuple[str, int, bool]:
        """The owner id, the generation claims taken now belong to, and whether the
        owner is registered (its row and lock in place, its lease running)."""
        with self._mutex:
            return self._owner_id, self._generation, self._state is not None

    def registered(self, owner_id: str, sent_at: float, token: EventLoopToken) -> None:
        """The owner row and lock of ``owner_id`` are in place (the registration was sent
        at ``sent_at``, a reading of :attr:`clock`); start keeping them."""
        with self._mutex:
            if owner_id != self._owner_id:
                return
            self._state = LeaseState.granted(self.lease_s, sent_at)
            self._token = token
            if self._keeper is None:
                self._keeper = threading.Thread(
                    target=self._keep, name="polyloop-lease", daemon=True
                )
                self._keeper.start()

    def phase(self, generation: int) -> LeasePhase:
        """Where the lease that claims of ``generation`` were taken under stands now."""
        with self._mutex:
            return self._phase_locked(generation)

    def beat(self) -> None:
        """The event loop is running: called on it by the store for every write."""
        self._beats += 1

    def check(self, generation: int, run_id: str) -> None:
        """Refuse a write under a claim whose lease has lapsed (``LeaseLost``)."""
        with self._mutex:
            if self._phase_locked(generation) is not LeasePhase.LOST:
                return
        raise self._lost_error(run_id)

    async def confirm(self, generation: int, run_id: str) -> None:
        """Return once an effect may start under the claim of ``run_id`` taken under
        ``generation``: the lease is held with the margin to spare. A late lease is
        waited on (its keeper is renewing it) until it is held again or lost.

        Raises ``LeaseLost`` when the lease ended or may end too soon. Reads no database.

        Cancellation: nothing is written or changed; the effect has not started.
        """
        while True:
            phase = self.phase(generation)
            if phase is LeasePhase.HELD or phase is LeasePhase.RENEWING:
                return
            if phase is LeasePhase.LOST:
                raise self._lost_error(run_id)
            await anyio.sleep(self.lease_s / _LOOKS_PER_LEASE)

    def stop(self) -> None:
        """Stop renewing (the store is closing); returns once the keeper has stopped."""
        self._stopping.set()
        keeper = self._keeper
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=self.lease_s)

    def _phase_locked(self, generation: int) -> LeasePhase:
        state = self._state
        if generation != self._generation or state is None:
            return LeasePhase.LOST
        phase = state.phase(self.clock())
        if phase is LeasePhase.LOST:
            self._lapse_locked()
        return phase

    def _lost_error(self, run_id: str) -> LeaseLost:
        with self._mutex:
            stalled = self._longest_wait_s
            if self._waiting_since is not None:
                stalled = max(stalled, self.clock() - self._waiting_since)
        hint = (
            f"; the event loop once took {stalled:.1f} s to let the lease be renewed"
            if stalled >= self.lease_s / _RENEWALS_PER_LEASE
            else ""
        )
        return LeaseLost(
            f"this store object's lease ended ({self.lease_s:g} s without a renewal{hint}): "
            f"another worker may have taken the run over, so nothing more is started or "
            f"written",
            run_id=run_id,
        )

    def _note_answer(self, owner_id: str, waited_s: float) -> None:
        """Warn when the event loop took a third of a lease or more to run the keeper's
        no-op: one more stall of that kind and every run of this owner is lost."""
        with self._mutex:
            self._longest_wait_s = max(self._longest_wait_s, waited_s)
        if waited_s >= self.lease_s / _RENEWALS_PER_LEASE:
            logger.warning(
                "the event loop took %.1f s to let owner %s renew its %g s lease: a stall "
                "as long as the lease loses every run this store object holds (drive "
                "fewer runs per process, or raise lease_s above the longest stall)",
                waited_s,
                owner_id,
                self.lease_s,
            )

    def _lapse_locked(self) -> None:
        """The lease is lost: its claims with it, and the owner id, for good."""
        if self._state is not None:
            self._generation += 1
            self._state = None
            self._owner_id = uuid.uuid4().hex

    def _keep(self) -> None:
        """The keeper thread: renew every third of a lease while the event loop lives,
        and soon again after a renewal that failed (a busy database, a lost connection)
        rather than a third of a lease later."""
        pause = self.lease_s / _RENEWALS_PER_LEASE
        beats = self._beats
        while not self._stopping.wait(pause):
            pause = self.lease_s / _RENEWALS_PER_LEASE
            with self._mutex:
                owner_id, token = self._owner_id, self._token
                registered = self._state is not None
            if not registered or token is None:
                continue
            began = self.clock()
            if self._beats == beats and not self._loop_answers(owner_id, token, began):
                return  # the event loop has finished, or the store is closing
            beats = self._beats
            if self._stopping.is_set():
                return  # the store is closing: its connections may be gone
            if not self._renew_once(owner_id):
                pause = self.lease_s / _RETRIES_PER_LEASE

    def _renew_once(self, owner_id: str) -> bool:
        """Send one renewal and move the lease on by its answer; whether it got one."""
        with self._mutex:
            if owner_id != self._owner_id or self._state is None:
                return True
            self._state = self._state.renewal_sent(self.clock())
        try:
            renewed = self._renew(owner_id)
        except Exception:
            logger.warning("could not renew the lease of owner %s", owner_id, exc_info=True)
            self._answered(owner_id, None)
            return False
        self._answered(owner_id, renewed)
        return True

    def _answered(self, owner_id: str, renewed: bool | None) -> None:
        """Apply a renewal's answer: extended, refused, or none (``None``)."""
        with self._mutex:
            state = self._state
            if owner_id != self._owner_id or state is None:
                return
            now = self.clock()
            if renewed is None:
                state = state.renewal_failed(now)
            elif renewed:
                state = state.renewal_confirmed(now)
            else:
                state = state.renewal_refused(now)
            self._state = state
            if state.phase(now) is LeasePhase.LOST:
                self._lapse_locked()

    def _loop_answers(self, owner_id: str, token: EventLoopToken, began: float) -> bool:
        """Wait until the event loop runs a no-op; ``False`` if it never will."""
        with self._mutex:
            self._waiting_since = began
        try:
            # Blocks while the loop is stuck or stopped: then the lease runs out.
            anyio.from_thread.run_sync(_nothing, token=token)
        except RuntimeError:
            return False  # the event loop has finished; nothing will write any more
        finally:
            with self._mutex:
                self._waiting_since = None
        if self._stopping.is_set():
            return False
        self._note_answer(owner_id, self.clock() - began)
        return True
