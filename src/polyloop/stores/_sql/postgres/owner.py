"""The claims of a PostgreSQL store object: an owner with a lease, so that a hung worker's
runs can be taken over (docs/stores.md#leases-hung-workers)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from functools import partial

import psycopg
from anyio.lowlevel import EventLoopToken

from polyloop.stores._batching import GroupCommit
from polyloop.stores._lease import Lease, effect_margin
from polyloop.stores._sql.postgres.batch import Committer, Writer
from polyloop.stores._sql.postgres.connection import Link, Settings
from polyloop.stores._sql.postgres.sql import Queries, owner_lock, run_id_column, run_key
from polyloop.stores._writes import Claim, Write, WriterState, claimed_already, not_claimed
from polyloop.types import RunLocked, StoreError

logger = logging.getLogger("polyloop")

# How long a cancelled caller still waits for a started commit: enough for a server that
# answers, and all a silent path adds to a cancelled run's grace.
CANCELLED_WRITE_WAIT_S = 1.0
_GIVEN_UP = "its caller was cancelled and stopped waiting for its commit, whose outcome is unknown"


class SharedClaims:
    """The backend's claim and write calls over an :class:`Owner`, each claimed run
    routed to one writer connection. All but the coroutines and :meth:`holds` block."""

    def __init__(self, settings: Settings, *, ready: Callable[[str], object]) -> None:
        self._settings = settings
        self._queries = Queries(settings.schema)
        self._state = WriterState()  # the runs that failed, and whether the store is closed
        self._owner = Owner(settings, self._queries, self._state)
        self._committer = Committer(self._state, self._queries, self._owner.lease)
        self._writers: list[Writer] = []
        self._ready = ready  # opens the store, if not yet, before a run's first claim

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        with self._state.mutex:
            self._state.check_writable(run_id)
            if self._route(run_id) is not None:
                raise claimed_already(run_id)
            writer = self._pick()
            writer.claiming += 1
        try:
            self._ready(run_id)
            owner_id, generation = self._owner.registered(run_id, token)
            with writer.lock:
                claim = self._take(writer, run_id, owner_id, generation)
                with self._state.mutex:
                    writer.claims[run_id] = claim
        finally:
            with self._state.mutex:
                writer.claiming -= 1

    def release(self, run_id: str) -> None:
        """Give the claim up; a failed run's in a thread of its own (its path may be silent)."""
        with self._state.mutex:
            route = self._route(run_id)
            failed = run_id in self._state.failed
        if route is None:
            return
        if failed:
            give_up = partial(self._give_up, route[0], run_id)
            threading.Thread(target=give_up, name="polyloop-release", daemon=True).start()
        else:
            self._give_up(route[0], run_id)

    def _give_up(self, writer: Writer, run_id: str) -> None:
        with writer.lock, self._state.mutex:  # after any commit of the run in flight
            claim = writer.claims.pop(run_id, None)
        if claim is not None:
            self._owner.release(run_id, claim.epoch)

    def _abandoned(self, write: Write) -> None:
        """A cancelled caller stopped waiting for ``write``'s commit (on the event loop):
        its outcome is unknown, so this object writes nothing more of the run."""
        with self._state.mutex:
            self._state.failed.setdefault(write.run_id, _GIVEN_UP)

    def holds(self, run_id: str) -> bool:
        return self._route(run_id) is not None

    async def confirm(self, run_id: str) -> None:
        with self._state.mutex:
            self._state.check_writable(run_id)
            route = self._route(run_id)
        if route is None:
            raise not_claimed(run_id)
        await self._owner.lease.confirm(route[1].generation, run_id)

    async def submit(self, write: Write) -> None:
        self._owner.lease.beat()
        with self._state.mutex:
            self._state.check_writable(write.run_id)
            route = self._route(write.run_id)
            writer = route[0] if route is not None else self._pick()  # refused in its batch
        await writer.group.submit(write)

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        with self._state.mutex:
            route = self._route(run_id)
        if route is None:
            return False
        writer, claim = route
        params = {"run_key": run_key(run_id), "epoch": claim.epoch, "before": cutoff}
        with writer.lock:
            try:
                row = writer.connected(run_id).execute(self._queries.prune_run, params).fetchone()
            except psycopg.Error as exc:
                raise writer.fail(self._state, run_id, exc) from exc
            gone = bool(row and row[0])
            if gone:
                with self._state.mutex:
                    writer.claims.pop(run_id, None)
        return gone

    def _take(self, writer: Writer, run_id: str, owner_id: str, generation: int) -> Claim:
        """Make ``owner_id`` the run's owner, or ``RunLocked`` naming its live holder."""
        key = run_key(run_id)
        params = {"run_key": key, "run_id": run_id_column(run_id), "owner": owner_id}
        try:
            conn = writer.connected(run_id)
            row = conn.execute(self._queries.claim, params).fetchone()
            holder = None if row else conn.execute(self._queries.holder, (key,)).fetchone()
        except psycopg.Error as exc:
            raise writer.fail(self._state, run_id, exc) from exc
        if row is None:
            who = "another writer"
            if holder:
                who = f"{holder[0]}, whose lease runs until {holder[1]:%Y-%m-%d %H:%M:%S %Z}"
            raise RunLocked(f"the run is held by {who}", run_id=run_id)
        epoch, next_seq, finished = row
        return Claim(run_id, int(epoch), int(next_seq), bool(finished), generation=generation)

    def _route(self, run_id: str) -> tuple[Writer, Claim] | None:
        """The writer and claim of ``run_id``, if this object holds its claim."""
        for writer in self._writers:
            claim = writer.claims.get(run_id)
            if claim is not None:
                return writer, claim
        return None

    def _pick(self) -> Writer:
        """An idle writer, a new one, or the least busy (``state.mutex`` held)."""
        writer = min(self._writers, key=lambda w: len(w.claims) + w.claiming, default=None)
        busy = writer is not None and (writer.claims or writer.claiming)
        if writer is None or (busy and len(self._writers) < self._settings.max_writers):
            writer = Writer(connect=partial(self._settings.connect, "polyloop-writer"))
            writer.group = GroupCommit(
                partial(self._committer.commit, writer),
                abandon=self._abandoned,
                cancelled_wait_s=CANCELLED_WRITE_WAIT_S,
            )
            self._writers.append(writer)
        return writer

    def close_claims(self) -> None:
        """Refuse new work, stop the lease, close the writers, then free the owner's runs."""
        with self._state.mutex:
            self._state.closed = True
            writers, self._writers = self._writers, []
            for writer in writers:
                writer.claims.clear()
        self._owner.lease.stop()
        for writer in writers:
            with writer.lock:  # after the commit in flight, if any
                writer.closed = True
                writer.drop()
        self._owner.close()


class Owner:
    """This store object as an owner of runs: a row of ``owners`` with a lease, and an
    advisory lock held on a connection of its own (used under ``_lock``). Blocking."""

    __slots__ = ("_link", "_lock", "_queries", "_settings", "_state", "lease")

    def __init__(self, settings: Settings, queries: Queries, state: WriterState) -> None:
        self._settings = settings
        self._queries = queries
        self._state = state
        self._lock = threading.Lock()
        self.lease = Lease(settings.lease_s, self._renew)
        # A renewal fails within a quarter lease, leaving time to retry while it holds.
        self._link = Link(partial(settings.connect, "polyloop-owner", settings.lease_s / 4))

    def registered(self, run_id: str, token: EventLoopToken) -> tuple[str, int]:
        """The owner id and lease generation; registers the owner (lock, row, lease) once."""
        with self._lock:
            owner_id, generation, registered = self.lease.current()
            if registered:
                return owner_id, generation
            sent_at = self.lease.clock()
            key, hi, lo = owner_lock(self._settings.schema, owner_id)
            self._state.check_open(None)
            try:
                conn = self._link.connected()
                # A lapsed identity's lock goes: its lease has ended anyway.
                conn.execute("SELECT pg_advisory_unlock_all()")
                conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
                conn.execute(self._queries.forget_owners)
                conn.execute(self._queries.register_owner, self._lease_params(owner_id, hi, lo))
            except psycopg.Error as exc:
                self._link.drop()
                what = f"could not register this worker as an owner of runs: {type(exc).__name__}"
                raise StoreError(f"{what}: {exc}", run_id=run_id) from exc
            self.lease.registered(owner_id, sent_at, token)
            return owner_id, generation

    def release(self, run_id: str, epoch: int) -> None:
        """Give up a claim on the owner's connection; a failure is logged, not raised."""
        with self._lock:
            try:
                self._state.check_open(None)
                self._link.connected().execute(
                    self._queries.release, {"run_key": run_key(run_id), "epoch": epoch}
                )
            except (psycopg.Error, StoreError):
                # The row keeps this owner until the store closes or its lease ends.
                logger.warning("run %r: could not give its claim up", run_id, exc_info=True)
                self._link.drop()

    def close(self) -> None:
        """Free every run this owner still holds, drop its row, close its connection."""
        with self._lock:
            owner_id, _, registered = self.lease.current()
            # A connection whose session ended fails once; then a new one is tried.
            for _ in range(2 if registered else 0):
                try:
                    self._link.connected().execute(self._queries.drop_owner, (owner_id, owner_id))
                    break
                except (psycopg.Error, StoreError):
                    self._link.drop()
            self._link.closed = True
            self._link.drop()

    def _renew(self, owner_id: str) -> bool:
        """Extend the lease while more than its lock margin is left (the keeper's thread);
        after a lost connection, take the owner's lock again on a new one."""
        with self._lock:
            conn = self._link.connection
            lost = conn is None or conn.broken or conn.closed
            try:
                if self._state.closed:
                    return False
                conn = self._link.connected()
                if lost:
                    key, _, _ = owner_lock(self._settings.schema, owner_id)
                    conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
                done = conn.execute(self._queries.renew_owner, self._lease_params(owner_id))
            except psycopg.Error:
                self._link.drop()
                raise
            return done.rowcount == 1

    def _lease_params(self, owner_id: str, hi: int = 0, lo: int = 0) -> dict[str, object]:
        return {
            "owner": owner_id,
            "description": self.lease.description,
            "hi": hi,
            "lo": lo,
            "lease_s": self.lease.lease_s,
            # Half the effect margin; the other half covers clock rates (record 0034).
            "margin_s": effect_margin(self.lease.lease_s) / 2,
        }
