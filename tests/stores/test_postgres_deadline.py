"""The client-side deadline of a PostgreSQL exchange (``stores/_sql/postgres/connection.py``).

Plain connections of the watched class, on a direct path and through the loopback proxy
of ``tests/kit/net_proxy.py``; the store's own use of them is tested end to end in
``test_postgres_silent_network.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from kit.net_proxy import Mode, Proxy
from polyloop.stores._sql.postgres.connection import Silent, Watched, deadline_s

SLACK_S = 3.0  # a loaded machine's scheduling (CI has run 1.55 s late), never a wait relied on


@pytest.fixture
def proxy(postgres_shared: str) -> Iterator[Proxy]:
    with Proxy.before(postgres_shared) as through:
        yield through


def _connect(conninfo: str, seconds: float) -> Watched:
    conn = Watched.connect(conninfo, autocommit=True)
    conn.deadline_s = seconds
    return conn


@pytest.mark.parametrize(
    ("statement_timeout_s", "expected"), [(0.5, 1.5), (2.0, 3.0), (30.0, 45.0)]
)
def test_the_deadline_is_the_statement_timeout_and_half_again_at_least_a_second_more(
    statement_timeout_s: float, expected: float
) -> None:
    assert deadline_s(statement_timeout_s) == expected


def test_a_statement_the_server_answers_in_time_stands_and_the_connection_lives(
    postgres_shared: str,
) -> None:
    with _connect(postgres_shared, 1.0) as conn:
        assert conn.execute("SELECT 7 FROM pg_sleep(0.3)").fetchone() == (7,)
        time.sleep(1.2)  # past the answered statement's deadline: nothing fires late
        assert conn.execute("SELECT 8").fetchone() == (8,)
        assert not conn.broken


def test_a_slow_server_past_the_deadline_costs_the_connection(postgres_shared: str) -> None:
    with _connect(postgres_shared, 0.5) as conn:
        began = time.monotonic()
        with pytest.raises(Silent, match=r"did not answer within 0\.5 s"):
            conn.execute("SELECT pg_sleep(30)")
        assert time.monotonic() - began < 0.5 + SLACK_S
        assert conn.broken


@pytest.mark.parametrize("mode", [Mode.BLACKHOLE, Mode.DROP_REPLIES, Mode.HOLD])
def test_a_silent_path_costs_the_connection_at_the_deadline(
    proxy: Proxy, postgres_shared: str, mode: Mode
) -> None:
    with _connect(proxy.conninfo(postgres_shared), 0.5) as conn:
        conn.execute("SELECT 1")
        proxy.set(mode)
        began = time.monotonic()
        with pytest.raises(Silent):
            conn.execute("SELECT 1")
        assert time.monotonic() - began < 0.5 + SLACK_S
        assert conn.broken


def test_a_commit_is_watched_like_a_statement(proxy: Proxy, postgres_shared: str) -> None:
    with _connect(proxy.conninfo(postgres_shared), 0.5) as conn:
        conn.autocommit = False
        conn.execute("SELECT 1")
        proxy.set(Mode.BLACKHOLE)
        began = time.monotonic()
        with pytest.raises(Silent):
            conn.commit()
        assert time.monotonic() - began < 0.5 + SLACK_S


def test_each_connection_keeps_its_own_deadline(postgres_shared: str) -> None:
    """A short deadline fires while a long one, set earlier, goes on waiting; the long
    one's statement then ends on its own."""
    outcomes: dict[str, object] = {}

    def slow(name: str, seconds: float, sleep: float) -> None:
        with _connect(postgres_shared, seconds) as conn:
            try:
                outcomes[name] = conn.execute("SELECT pg_sleep(%s)", (sleep,)).fetchone()
            except psycopg.Error as exc:
                outcomes[name] = type(exc)

    threads = [
        threading.Thread(target=slow, args=("patient", 5.0, 1.0)),
        threading.Thread(target=slow, args=("hasty", 0.3, 30.0)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert outcomes == {"patient": ("",), "hasty": Silent}
