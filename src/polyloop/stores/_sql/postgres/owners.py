"""Owners and claims of a PostgreSQL store object.

:class:`Owner` is the store object as an owner of runs: a row in the ``owners`` table
with a lease that :class:`~polyloop.stores._lease.Lease` keeps, and a session-level
advisory lock held on a connection of its own (never a writer's, never the pool's) while
the owner lives. :class:`Claims` takes and gives up the claims of runs for that owner: a
claim is the run's row naming the owner, with its claim epoch moved on, taken on the
run's writer connection and given up on the owner's; pruning deletes a run under such a
claim. ``docs/stores.md`` describes the tables;
research records 0017 (claims) and 0018 (owners, leases, timeouts) say why.
"""

from __future__ import annotations

import logging
import threading
from contextlib import suppress
from datetime import datetime

import psycopg
from anyio.lowlevel import EventLoopToken

from polyloop.stores._common import WriterState
from polyloop.stores._lease import Lease
from polyloop.stores._refusals import claimed_already, not_claimed, store_closed
from polyloop.stores._sql.postgres.batch import Claim, Writer, fail_run
from polyloop.stores._sql.postgres.connect import Connection, Settings, scalar
from polyloop.stores._sql.postgres.read import Reader
from polyloop.stores._sql.postgres.sql import (
    Queries,
    lock_halves,
    owner_lock_key,
    run_id_column,
    run_key,
)
from polyloop.stores._sql.postgres.writers import Writers
from polyloop.types import RunLocked, StoreError

__all__ = ("Claims", "Owner")

logger = logging.getLogger("polyloop")
_OWNER_NAME = "polyloop-owner"


class Owner:
    """This store object as an owner of runs: its registration, its lease, its lock.

    Every method blocks: call it from a worker thread (the lease keeper's own, for the
    renewal), where it runs to its end once started. The owner's connection is used only
    with ``_lock`` held.
    """

    __slots__ = ("_conn", "_lock", "_queries", "_settings", "_state", "lease")

    def __init__(self, settings: Settings, queries: Queries, state: WriterState) -> None:
        self._settings = settings
        self._queries = queries
        self._state = state
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self.lease = Lease(settings.lease_s, self._renew)

    def registered(self, run_id: str, token: EventLoopToken) -> tuple[str, int]:
        """The owner id and lease generation, registering the owner if need be.

        Registering takes the owner's lock on the owner's connection (it lives as long as
        the session), writes its row with a lease, and starts keeping the lease from the
        event loop that ``token`` names.
        """
        with self._lock:
            owner_id, generation, registered = self.lease.current()
            if registered:
                return owner_id, generation
            sent_at = self.lease.clock()
            key = owner_lock_key(self._settings.schema, owner_id)
            hi, lo = lock_halves(key)
            try:
                conn = self._connection()
                # A lapsed identity's lock goes: its lease has ended anyway.
                conn.execute("SELECT pg_advisory_unlock_all()")
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
                conn.execute(self._queries.forget_owners)
                conn.execute(
                    self._queries.register_owner,
                    (owner_id, self.lease.description, hi, lo, self.lease.lease_s),
                )
            except psycopg.Error as exc:
                self._close_connection()
                raise StoreError(
                    f"could not register this worker as an owner of runs: "
                    f"{type(exc).__name__}: {exc}",
                    run_id=run_id,
                ) from exc
            self.lease.registered(owner_id, sent_at, token)
            return owner_id, generation

    def release(self, run_id: str, epoch: int) -> None:
        """Give up the claim of ``run_id`` taken at ``epoch``, through the owner's
        connection, which outlives any writer's; a failure is logged, not raised."""
        with self._lock:
            try:
                self._connection().execute(
                    self._queries.release, {"run_key": run_key(run_id), "epoch": epoch}
                )
            except (psycopg.Error, StoreError):
                # The row keeps this owner until the store closes or its lease ends.
                logger.warning("run %r: could not give its claim up", run_id, exc_info=True)
                self._close_connection()

    def close(self) -> None:
        """Free every run this owner still holds, drop its row, close its connection."""
        with self._lock:
            owner_id, _, registered = self.lease.current()
            conn = self._conn
            if registered and conn is not None and not (conn.broken or conn.closed):
                # Every run this owner still holds is free before this returns.
                with suppress(psycopg.Error):
                    conn.execute(self._queries.drop_owner, (owner_id, owner_id))
            self._close_connection()

    def _renew(self, owner_id: str) -> bool:
        """Extend the owner's lease if it has not ended (the lease keeper's thread)."""
        with self._lock:
            conn = self._conn
            if conn is None or conn.broken or conn.closed:
                return False
            try:
                done = conn.execute(self._queries.renew_owner, (self.lease.lease_s, owner_id))
            except psycopg.Error:
                self._close_connection()
                raise
            return done.rowcount == 1

    def _connection(self) -> Connection:
        """The connection that holds the owner's lock, opened again after a loss."""
        if self._state.closed:
            raise store_closed()
        conn = self._conn
        if conn is None or conn.broken or conn.closed:
            self._close_connection()
            conn = self._conn = self._settings.connect(_OWNER_NAME)
        return conn

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class Claims:
    """Takes and gives up the claims of one store object's owner.

    Every method blocks: call it from a worker thread, where it runs to its end once
    started; the store gives a claim back up if its caller was cancelled as the claim
    was taken. A run's claim lives in its slot, changed only with the slot's writer's
    lock held.
    """

    __slots__ = ("_owner", "_queries", "_reader", "_state", "_writers")

    def __init__(
        self,
        owner: Owner,
        writers: Writers,
        reader: Reader,
        queries: Queries,
        state: WriterState,
    ) -> None:
        self._owner = owner
        self._writers = writers
        self._reader = reader
        self._queries = queries
        self._state = state

    def held(self, run_id: str) -> bool:
        """Whether this store object holds ``run_id``'s claim."""
        slot = self._writers.slot(run_id)
        return slot is not None and slot.claim is not None

    def claim_of(self, run_id: str) -> Claim:
        """The run's claim, if the store may write and this object holds it."""
        with self._state.mutex:
            self._state.check_writable(run_id)
        slot = self._writers.slot(run_id)
        claim = slot.claim if slot is not None else None
        if claim is None:
            raise not_claimed(run_id)
        return claim

    def claim(self, run_id: str, token: EventLoopToken) -> None:
        """Make the owner the run's owner and move its claim epoch on, or ``RunLocked``."""
        with self._writers.used(run_id) as slot:
            if slot.claim is not None:
                raise claimed_already(run_id)
            self._reader.ready(run_id)
            owner_id, generation = self._owner.registered(run_id, token)
            with slot.writer.lock:
                slot.claim = self._claim(slot.writer, run_id, owner_id, generation)

    def release(self, run_id: str) -> None:
        """Give the claim up, writing no record (the row of a run never started goes)."""
        slot = self._writers.slot(run_id)
        if slot is None or slot.claim is None:
            return
        with slot.writer.lock:
            claim, slot.claim = slot.claim, None
        if claim is not None:
            self._owner.release(run_id, claim.epoch)
        with self._state.mutex:
            self._writers.forget(slot)

    def delete(self, run_id: str, cutoff: datetime) -> bool:
        """Delete a run this store object holds the claim of, if it still may go."""
        slot = self._writers.slot(run_id)
        claim = slot.claim if slot is not None else None
        if slot is None or claim is None:
            return False
        with slot.writer.lock:
            try:
                conn = slot.writer.connected(run_id)
                gone = scalar(
                    conn,
                    self._queries.prune_run,
                    {"run_key": run_key(run_id), "epoch": claim.epoch, "before": cutoff},
                )
            except psycopg.Error as exc:
                raise fail_run(self._state, slot.writer, run_id, exc) from exc
            if gone:
                slot.claim = None
        if gone:
            with self._state.mutex:
                # forget() keeps a slot that a claim made since the delete now holds.
                self._writers.forget(slot)
        return bool(gone)

    def _claim(self, writer: Writer, run_id: str, owner_id: str, generation: int) -> Claim:
        """Make ``owner_id`` the run's owner, if no live owner holds it (``writer.lock`` held).

        Raises ``RunLocked`` naming the holder, ``StoreError`` if the query fails.
        """
        key = run_key(run_id)
        try:
            conn = writer.connected(run_id)
            row = conn.execute(
                self._queries.claim,
                {"run_key": key, "run_id": run_id_column(run_id), "owner": owner_id},
            ).fetchone()
            holder = None if row else conn.execute(self._queries.holder, (key,)).fetchone()
        except psycopg.Error as exc:
            raise fail_run(self._state, writer, run_id, exc) from exc
        if row is None:
            who = (
                f"{holder[0]}, whose lease runs until {holder[1]:%Y-%m-%d %H:%M:%S %Z}"
                if holder
                else "another writer"
            )
            raise RunLocked(f"the run is held by {who}", run_id=run_id)
        epoch, next_seq, finished = row
        return Claim(
            run_id=run_id,
            writer=writer,
            epoch=int(epoch),
            generation=generation,
            next_seq=int(next_seq),
            finished=bool(finished),
        )
