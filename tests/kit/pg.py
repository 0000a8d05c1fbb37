"""A PostgreSQL server for the tests, and a fresh, empty database for each test.

Which server (decided once per test session by the ``postgres_server`` fixture):

1. The server named by the environment variable ``POLYLOOP_TEST_POSTGRES`` (a libpq
   URL or connection string; default ``postgresql://postgres@127.0.0.1:5432/test``), if
   it answers. Its role must be allowed to create and drop databases.
2. Otherwise a throw-away server started by pytest-postgresql's ``postgresql_proc``
   fixture factory (a temporary data directory and a free port, stopped at the end of the
   session). PostgreSQL's ``initdb`` refuses to run as root, so when the tests run as
   root this fallback is not tried.
3. Otherwise nothing can run. When the environment variable ``CI`` is ``"true"`` every
   test that needs the server FAILS, so that a CI job can never pass by skipping them;
   anywhere else they are skipped with a reason that says so loudly.

Isolation, two ways:

* ``postgres_conninfo`` (built on :func:`fresh_database`) is a ``postgresql://`` URL of a
  database created for one test with a unique name and dropped afterwards
  (``WITH (FORCE)``, which also ends connections a failed test left open). Nothing is
  shared, locks included, and a store needs nothing but that URL to find its data, even
  in a child process or through the command line. Dropping a database makes the server
  checkpoint, which costs a fraction of a second.
* ``postgres_shared`` is one database for the whole session, and ``postgres_schemas``
  (built on :func:`fresh_schemas`) hands out uniquely named PostgreSQL schemas in it and
  drops them (``CASCADE``) afterwards: cheap, for the many tests that only need rows of
  their own and pass the schema to the store. ``postgres_place`` is one such schema and
  the URL, the same for every fixture of one test that asks for it.

Two ways to use it. As a pytest plugin: ``pytest_plugins = ("kit.pg",)`` in the root
``conftest.py`` provides the fixtures above to every test (register it there, which loads
before any test module imports ``kit.pg``; a module imported before its registration as a
plugin makes pytest warn). Or as plain functions: a test module imports ``kit.pg``, assigns
``pg_fallback_proc = pg.fallback_server()`` and builds its own fixtures from
:func:`server_conninfo`, :func:`fresh_database` and :func:`fresh_schemas`. A database left
behind by a killed test session is named ``polyloop_test_<pid>_<random>`` and can be
dropped by hand.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from pytest_postgresql import factories

ENV_VAR = "POLYLOOP_TEST_POSTGRES"
DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
CONNECT_TIMEOUT_S = 5


def fallback_server() -> Any:
    """pytest-postgresql's process fixture for the throw-away server.

    Assign it to the module-level name ``pg_fallback_proc`` of a test module (pytest
    registers fixtures by that name); :func:`server_conninfo` asks for it only when no
    configured server answers, so normally no server is started.
    """
    return factories.postgresql_proc(port=None)


# The plugin's own fallback fixture; it runs only if ``postgres_server`` asks for it.
pg_fallback_proc = fallback_server()


@pytest.fixture(scope="session")
def postgres_server(request: pytest.FixtureRequest) -> str:
    """A URL of a server where databases can be created (see the module documentation)."""
    return server_conninfo(request, "pg_fallback_proc")


@pytest.fixture
def postgres_conninfo(postgres_server: str) -> Iterator[str]:
    """A ``postgresql://`` URL of an empty database of this test's own."""
    with fresh_database(postgres_server) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_shared(postgres_server: str) -> Iterator[str]:
    """A URL of a database shared by the whole session; use :func:`fresh_schemas` in it."""
    with fresh_database(postgres_server) as url:
        yield url


@pytest.fixture
def postgres_schemas(postgres_shared: str) -> Iterator[Callable[[], str]]:
    """Names new schemas in ``postgres_shared``; every one named is dropped afterwards."""
    with fresh_schemas(postgres_shared) as new:
        yield new


@pytest.fixture
def postgres_place(postgres_shared: str, postgres_schemas: Callable[[], str]) -> tuple[str, str]:
    """The URL and schema of a store of this test's own, at the cost of a schema: the place
    of a store every other PostgreSQL store object of the test opens again."""
    return postgres_shared, postgres_schemas()


def server_conninfo(request: pytest.FixtureRequest, fallback_fixture: str) -> str:
    """Apply the three rules above; ``fallback_fixture`` names the fallback process fixture."""
    configured = os.environ.get(ENV_VAR) or DEFAULT_URL
    problem = probe(configured)
    if problem is None:
        return as_url(configured)
    fallback, fallback_problem = _start_fallback(request, fallback_fixture)
    if fallback is not None:
        return fallback
    unavailable(
        f"no PostgreSQL server: {ENV_VAR} ({_safe(configured)}) did not answer ({problem}); "
        f"the throw-away server could not start ({fallback_problem})"
    )
    raise AssertionError("unreachable")  # pragma: no cover - unavailable() never returns


def probe(conninfo: str) -> str | None:
    """``None`` if a server answers at ``conninfo``, else why not."""
    try:
        with psycopg.connect(conninfo, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        first_line = next(iter(str(exc).strip().splitlines()), "")
        return f"{type(exc).__name__}: {first_line}"
    return None


def unavailable(reason: str) -> None:
    """Fail (under ``CI=true``) or skip, loudly."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"POSTGRESQL TESTS CANNOT RUN (CI=true): {reason}", pytrace=False)
    pytest.skip(
        f"POSTGRESQL TESTS SKIPPED: {reason}. Set {ENV_VAR} to a reachable server "
        f"(with CI=true this is a failure, not a skip)"
    )


def _start_fallback(request: pytest.FixtureRequest, fixture: str) -> tuple[str | None, str]:
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return None, "not tried: running as root, and initdb refuses to run as root"
    try:
        executor = request.getfixturevalue(fixture)
    except Exception as exc:  # noqa: BLE001 - any failure means "no fallback server"
        return None, f"{type(exc).__name__}: {exc}"
    url = _url(
        {
            "host": executor.host,
            "port": str(executor.port),
            "user": executor.user,
            "password": executor.password or "",
            "dbname": executor.maintenance_dbname,
        }
    )
    problem = probe(url)
    return (url, "") if problem is None else (None, problem)


@contextmanager
def fresh_database(server: str) -> Iterator[str]:
    """An empty, uniquely named database nobody used before: yield its URL; drop it."""
    name = _spares.take(server)
    try:
        yield as_url(server, dbname=name)
    finally:
        _drop(server, name)


def _create(server: str) -> str:
    name = f"polyloop_test_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with admin(server) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return name


def _drop(server: str, name: str) -> None:
    with admin(server) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


class _Spares:
    """Databases created one ahead, on a thread of their own.

    Creating a database copies a template: a tenth of a second on an idle machine, more on
    a busy one, that a test would otherwise wait for at its start. Each database still
    serves one test only. The spares left at the end of the session are dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[str, list[str]] = {}
        self._servers: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def take(self, server: str) -> str:
        with self._lock:
            ready = self._ready.get(server, [])
            name = ready.pop() if ready else None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._work, name="spare databases", daemon=True
                )
                self._thread.start()
        self._servers.put(server)  # the next test's
        return _create(server) if name is None else name

    def _work(self) -> None:
        while (server := self._servers.get()) is not None:
            try:
                name = _create(server)
            except Exception:  # noqa: BLE001 - the next take creates its own and meets it there
                continue
            with self._lock:
                self._ready.setdefault(server, []).append(name)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._servers.put(None)
        thread.join()
        with self._lock:
            spares, self._ready = self._ready, {}
        for server, names in spares.items():
            for name in names:
                _drop(server, name)


_spares = _Spares()


def pytest_unconfigure(config: pytest.Config) -> None:
    _spares.close()


@contextmanager
def fresh_schemas(conninfo: str) -> Iterator[Callable[[], str]]:
    """Yield a function that names a new, unused schema; drop every one named at the end.

    The store creates the schema itself at first use; the name is all a test needs.
    """
    named: list[str] = []

    def new() -> str:
        named.append(f"test_{uuid.uuid4().hex[:16]}")
        return named[-1]

    try:
        yield new
    finally:
        with admin(conninfo) as conn:
            for name in named:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name))
                )


@contextmanager
def admin(conninfo: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for test bookkeeping (never one a store uses)."""
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn:
        yield conn


def as_url(conninfo: str, **changes: str) -> str:
    """``conninfo`` (a URL or ``key=value`` string) as a ``postgresql://`` URL, changed.

    Tools that recognise a PostgreSQL store by its ``postgresql://`` prefix (the command
    line, the crash-test child) can then take it as it is.
    """
    return _url({**conninfo_to_dict(conninfo), **changes})


def _url(params: dict[str, Any]) -> str:
    params = {key: str(value) for key, value in params.items() if value not in (None, "")}
    user, password = params.pop("user", ""), params.pop("password", "")
    host, port = params.pop("host", ""), params.pop("port", "")
    dbname = params.pop("dbname", "")
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    netloc = (f"{auth}@" if auth else "") + _host(host) + (f":{port}" if port else "")
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{netloc}/{quote(dbname, safe='')}{query}"


def _host(host: str) -> str:
    if ":" in host and not host.startswith("/"):
        return f"[{host}]"  # an IPv6 address
    return quote(host, safe="")  # a socket directory is percent-encoded


def _safe(conninfo: str) -> str:
    """``conninfo`` without its password, for messages."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return "an unparsable connection string"
    params.pop("password", None)
    return _url(params)
