"""The one-commit-per-write baselines of benchmark 3: the stores without group commit.

Each write commits alone, in a worker-thread hop of its own (SQLite with
``synchronous=FULL`` for every commit), which is how a store without shared commits
behaves. They live here, not in the library: the library has one write path per store.
They reach into the stores' private dialects on purpose, and only to replace the step
that submits a write.
"""

from __future__ import annotations

import dataclasses

import anyio.to_thread

from polyloop.stores import PostgresStore, SqliteStore
from polyloop.stores._common import Write
from polyloop.stores._refusals import not_claimed
from polyloop.stores._sql.postgres.store import Postgres
from polyloop.stores._sql.sqlite.store import Sqlite


class _SqliteAlone(Sqlite):
    __slots__ = ()

    async def submit(self, write: Write) -> None:
        # As a barrier: the store's own commit then runs under ``synchronous=FULL``.
        barrier = dataclasses.replace(write, barrier=True)
        (error,) = await anyio.to_thread.run_sync(self.commit, [barrier])
        if error is not None:
            raise error


class SqliteOneCommitPerWrite(SqliteStore):
    """``SqliteStore`` committing every write in a transaction of its own."""

    _DIALECT = _SqliteAlone


class _PostgresAlone(Postgres):
    __slots__ = ()

    async def submit(self, write: Write) -> None:
        route = self._route(write.run_id)
        if route is None:
            raise not_claimed(write.run_id)
        (error,) = await anyio.to_thread.run_sync(self._committer.commit, route[0], [write])
        if error is not None:
            raise error


class PostgresOneCommitPerWrite(PostgresStore):
    """``PostgresStore`` committing every write in a statement of its own."""

    _DIALECT = _PostgresAlone
