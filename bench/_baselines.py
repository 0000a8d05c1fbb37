"""The one-commit-per-write baselines of benchmark 3: the stores without group commit.

Each write commits alone, in a worker-thread hop of its own (SQLite with
``synchronous=FULL`` for every commit), which is how a store without shared commits
behaves. They live here, not in the library: the library has one write path per store.
Each builds its own backend, a subclass of the store's private dialect that replaces
only the step that submits a write, and puts the store port over it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import anyio.to_thread

from polyloop.stores._engine import EngineStore
from polyloop.stores._sql.postgres.connection import Settings
from polyloop.stores._sql.postgres.store import Postgres
from polyloop.stores._sql.sqlite.store import Sqlite
from polyloop.stores._writes import Write, not_claimed


class _SqliteAlone(Sqlite):
    __slots__ = ()

    async def submit(self, write: Write) -> None:
        # As a barrier: the store's own commit then runs under ``synchronous=FULL``.
        barrier = dataclasses.replace(write, barrier=True)
        (error,) = await anyio.to_thread.run_sync(self.commit, [barrier])
        if error is not None:
            raise error


class SqliteOneCommitPerWrite(EngineStore):
    """``SqliteStore`` committing every write in a transaction of its own."""

    __slots__ = ()

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(_SqliteAlone(Path(os.fspath(path))))


class _PostgresAlone(Postgres):
    async def submit(self, write: Write) -> None:
        route = self._route(write.run_id)
        if route is None:
            raise not_claimed(write.run_id)
        (error,) = await anyio.to_thread.run_sync(self._committer.commit, route[0], [write])
        if error is not None:
            raise error


class PostgresOneCommitPerWrite(EngineStore):
    """``PostgresStore`` committing every write in a statement of its own, with its
    default options but for the schema and the number of writer connections."""

    __slots__ = ()

    def __init__(
        self, conninfo: str, *, schema: str = "polyloop", max_writer_connections: int = 8
    ) -> None:
        settings = Settings(
            conninfo=conninfo,
            schema=schema,
            pool_size=4,
            max_writers=max_writer_connections,
            timeout=30.0,
            lease_s=15.0,
            statement_timeout_s=30.0,
        )
        super().__init__(_PostgresAlone(settings))
