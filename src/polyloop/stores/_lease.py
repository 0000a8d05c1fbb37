"""Owner leases: a state machine on this process's clock (:class:`LeaseState`) and a keeper
thread that renews it while the event loop lives (docs/stores.md#leases-hung-workers)."""

from __future__ import annotations

import dataclasses
import enum
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

from polyloop.types import InvalidRequest, LeaseLost

logger = logging.getLogger("polyloop")

Renew = Callable[[str], bool]

_RENEWALS_PER_LEASE = 3  # a renewal may fail or come late twice and the lease still holds
_RETRIES_PER_LEASE = 12  # a failed renewal is tried again after this part of a lease
_LOOKS_PER_LEASE = 48  # an effect waiting on a late lease looks again this often
_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)
_STALL = (
    "the event loop took %.1f s to let owner %s renew its %g s lease: a stall as long as the "
    "lease loses every run (drive fewer runs per process, or raise lease_s above the longest stall)"
)


def effect_margin(lease_s: float) -> float:
    """What an owner must have left of its lease to start an effect: one renewal interval."""
    return lease_s / _RENEWALS_PER_LEASE


class LeasePhase(enum.Enum):
    """Effects may start while ``HELD`` or ``RENEWING`` (a renewal out); ``LATE``, writes go
    (the database fences them) and effects wait; ``LOST`` is final."""

    HELD = "held"
    RENEWING = "renewing"
    LATE = "late"
    LOST = "lost"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeaseState:
    """One owner identity's lease; a renewal counts from its sending, so the ``deadline``
    is never later than the database's."""

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


def check_seconds(name: str, value: float) -> None:
    """Refuse an option ``name`` that is not a positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequest(f"{name} must be a positive number of seconds, not {value!r}")


class Lease:
    """One store object's lease (thread-safe); ``renew(owner_id)`` says whether the
    database extended it."""

    def __init__(self, lease_s: float, renew: Renew) -> None:
        check_seconds("lease_s", lease_s)
        self.lease_s = float(lease_s)
        self.description = f"{socket.gethostname()} pid {os.getpid()}"
        self._renew = renew
        self._stopping = threading.Event()
        self._mutex = threading.Lock()
        self._owner_id = uuid.uuid4().hex
        self._generation = 0
        self._state: LeaseState | None = None  # None: the owner is not registered
        self._token: EventLoopToken | None = None
        self._keeper: threading.Thread | None = None
        # For messages: the longest the loop kept a renewal waiting, and since when it waits.
        self._longest_wait_s = 0.0
        self._waiting_since: float | None = None
        self._beats = 0  # counted up by writes on the loop, only compared by the keeper

    def clock(self) -> float:
        """Seconds that count on while the machine sleeps (``CLOCK_BOOTTIME``, where there is
        one): a process suspended past its lease must see that the lease has run out."""
        return time.monotonic() if _BOOTTIME is None else time.clock_gettime(_BOOTTIME)

    def pause(self, seconds: float) -> bool:
        """The keeper's pause between renewals; true once the store is closing."""
        return self._stopping.wait(seconds)

    def current(self) -> tuple[str, int, bool]:
        """The owner id, the generation of claims taken now, and whether it is registered."""
        with self._mutex:
            return self._owner_id, self._generation, self._state is not None

    def registered(self, owner_id: str, sent_at: float, token: EventLoopToken) -> None:
        """``owner_id`` was registered at ``sent_at``: keep it from the loop ``token`` names."""
        with self._mutex:
            if owner_id != self._owner_id:
                return
            self._state, self._token = LeaseState.granted(self.lease_s, sent_at), token
            if self._keeper is None:
                self._keeper = threading.Thread(
                    target=self._keep, name="polyloop-lease", daemon=True
                )
                self._keeper.start()

    def phase(self, generation: int) -> LeasePhase:
        """Where the lease that claims of ``generation`` were taken under stands now."""
        with self._mutex:
            if generation != self._generation or self._state is None:
                return LeasePhase.LOST
            return self._move_locked(self._state, self.clock())

    def beat(self) -> None:
        """The event loop is running: called on it by the store for every write."""
        self._beats += 1

    def check(self, generation: int, run_id: str) -> None:
        """Refuse a write under a claim whose lease has lapsed (``LeaseLost``)."""
        if self.phase(generation) is LeasePhase.LOST:
            raise self._lost_error(run_id)

    async def confirm(self, generation: int, run_id: str) -> None:
        """Return once an effect may start under a claim of ``generation`` (a late lease is
        waited on); ``LeaseLost`` if it ends first. Polled: it reads no database."""
        while (phase := self.phase(generation)) is LeasePhase.LATE:  # noqa: ASYNC110
            await anyio.sleep(self.lease_s / _LOOKS_PER_LEASE)
        if phase is LeasePhase.LOST:
            raise self._lost_error(run_id)

    def stop(self) -> None:
        """Stop renewing (the store is closing); returns once the keeper has stopped."""
        self._stopping.set()
        if self._keeper is not None:
            self._keeper.join(timeout=self.lease_s)

    def _move_locked(self, state: LeaseState, now: float) -> LeasePhase:
        """Keep ``state``; a lost one takes its claims and the owner id with it, for good."""
        self._state = state
        phase = state.phase(now)
        if phase is LeasePhase.LOST:
            self._generation += 1
            self._state = None
            self._owner_id = uuid.uuid4().hex
        return phase

    def _lost_error(self, run_id: str) -> LeaseLost:
        with self._mutex:
            since = self._waiting_since
            stalled = max(self._longest_wait_s, 0.0 if since is None else self.clock() - since)
        hint = ""
        if stalled >= effect_margin(self.lease_s):
            hint = f"; the event loop once took {stalled:.1f} s to let the lease be renewed"
        return LeaseLost(
            f"this store object's lease ended ({self.lease_s:g} s without a renewal{hint}): "
            "another worker may have taken the run over, so nothing more is started or written",
            run_id=run_id,
        )

    def _keep(self) -> None:
        """The keeper thread: renew while the event loop lives, sooner after a failure."""
        pause, beats = self.lease_s / _RENEWALS_PER_LEASE, self._beats
        while not self.pause(pause) and not self._stopping.is_set():
            pause = self.lease_s / _RENEWALS_PER_LEASE
            with self._mutex:
                owner_id, token, registered = self._owner_id, self._token, self._state
            if registered is None or token is None:
                continue
            alive = self._beats != beats or self._loop_answers(owner_id, token)
            if not alive or self._stopping.is_set():
                return  # the loop has finished, or the store is closing (connections may go)
            beats = self._beats
            if not self._renew_once(owner_id):
                pause = self.lease_s / _RETRIES_PER_LEASE

    def _renew_once(self, owner_id: str) -> bool:
        """Send one renewal, unless the lease is lost, and apply its answer; False if none came."""
        with self._mutex:
            if owner_id != self._owner_id or self._state is None:
                return True
            now = self.clock()
            if self._move_locked(self._state.renewal_sent(now), now) is LeasePhase.LOST:
                return True
        answer = LeaseState.renewal_failed
        try:
            renewed = self._renew(owner_id)
            answer = LeaseState.renewal_confirmed if renewed else LeaseState.renewal_refused
        except Exception:
            logger.warning("could not renew the lease of owner %s", owner_id, exc_info=True)
        with self._mutex:
            if owner_id == self._owner_id and self._state is not None:
                now = self.clock()
                self._move_locked(answer(self._state, now), now)
        return answer is not LeaseState.renewal_failed

    def _loop_answers(self, owner_id: str, token: EventLoopToken) -> bool:
        """Wait until the event loop runs a no-op (a stuck loop never does); False if it ended."""
        with self._mutex:
            began = self._waiting_since = self.clock()
        try:
            anyio.from_thread.run_sync(lambda: None, token=token)
        except RuntimeError:
            return False  # the loop has finished: nothing will write any more
        finally:
            with self._mutex:
                waited, self._waiting_since = self.clock() - began, None
                self._longest_wait_s = max(self._longest_wait_s, waited)
        if waited >= self.lease_s / _RENEWALS_PER_LEASE:
            logger.warning(_STALL, waited, owner_id, self.lease_s)
        return True
