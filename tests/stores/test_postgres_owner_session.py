"""A PostgreSQL owner whose session ends while its process lives keeps its runs for as
long as it may still start an effect on them (research record 0034).

The owner's advisory lock goes with its session: a server restart, a terminated backend,
a pooler or load balancer that drops the connection. The owner learns of it only at its
next statement, and until then its own clock says its lease holds. So another worker may
take a run over from an owner without its lock only once less than the lock margin (a
sixth of the lease) is left, when the owner itself has stopped starting effects (it needs
a third). Meanwhile the owner opens its connection again, takes its lock again and goes
on with the same claims.
"""

from __future__ import annotations

import time

import anyio
import psycopg
import pytest

from kit import pg
from polyloop import LeaseLost, RunLocked
from polyloop.stores import PostgresStore
from polyloop.testing.store_contract import sample_run

# Slow: real leases lapsing in real time.
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

LEASE_S = 3.0


def _end_owner_sessions(conninfo: str) -> int:
    """End every owner session of the test's database, as a server restart would."""
    with pg.admin(conninfo) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'polyloop-owner'"
        ).fetchall()
    return len(rows)


def _lease_until(conninfo: str) -> float:
    """The owners' lease end, as seconds from now on the server's clock."""
    with psycopg.connect(conninfo) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(lease_until) - now()) FROM polyloop.owners"
        ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


async def _started(store: PostgresStore, run_id: str) -> None:
    await store.claim_run(run_id)
    method, arguments = sample_run(run_id)[0]
    await getattr(store, method)(*arguments)


async def test_an_owner_whose_session_ended_keeps_its_runs_and_goes_on(
    postgres_conninfo: str,
) -> None:
    async with (
        PostgresStore(postgres_conninfo, lease_s=LEASE_S) as a,
        PostgresStore(postgres_conninfo, lease_s=LEASE_S) as b,
    ):
        await _started(a, "r")
        assert await anyio.to_thread.run_sync(_end_owner_sessions, postgres_conninfo) == 1
        # Its lock is gone, but A may still start an effect: nobody else may take the run.
        with pytest.raises(RunLocked):
            await b.claim_run("r")
        await a.check_claim("r")
        # A's keeper opens a new session, takes the lock again and renews the lease.
        with anyio.fail_after(LEASE_S * 2):
            while True:
                if await anyio.to_thread.run_sync(_lease_until, postgres_conninfo) > LEASE_S * 0.9:
                    break
                await anyio.sleep(0.05)
        with pytest.raises(RunLocked):
            await b.claim_run("r")
        await a.check_claim("r")
        _, (intent,) = sample_run("r", steps=1)[1]
        await a.write_intent(intent)  # the same claim, the same epoch
        assert [type(r).__name__ for r in (await b.read_log("r")).records] == [
            "RunStarted",
            "Intent",
        ]


async def test_an_owner_without_its_lock_is_taken_over_only_once_it_can_start_nothing(
    postgres_conninfo: str,
) -> None:
    """A's keeper is stopped (a stuck loop, a stopped process would do the same) and its
    session ends: B gets the run before A's lease ends, and only once A may no longer
    start an effect on it."""
    async with (
        PostgresStore(postgres_conninfo, lease_s=LEASE_S) as a,
        PostgresStore(postgres_conninfo, lease_s=LEASE_S) as b,
    ):
        await _started(a, "r")
        a._backend._owner.lease.stop()  # type: ignore[attr-defined]  # no more renewals
        await anyio.to_thread.run_sync(_end_owner_sessions, postgres_conninfo)
        left = await anyio.to_thread.run_sync(_lease_until, postgres_conninfo)
        began = time.monotonic()
        with anyio.fail_after(LEASE_S * 2):
            while True:
                try:
                    await b.claim_run("r")
                    break
                except RunLocked:
                    await anyio.sleep(0.02)
        waited = time.monotonic() - began
        # Taken over before the lease's end, with at most a sixth of it left.
        assert left - LEASE_S / 6 - 0.5 <= waited < left
        # A, from now on, starts nothing and writes nothing.
        with anyio.fail_after(LEASE_S), pytest.raises(LeaseLost):
            await a.check_claim("r")
