"""The one-commit-per-write baselines of benchmark 3: the stores without group commit.

Each write commits alone, in a worker-thread hop of its own (SQLite with
``synchronous=FULL`` for every commit), which is how a store without shared commits
behaves. They live here, not in the library: the library has one write path per store.
They reach into the stores' private write step on purpose, and only to replace it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from polyloop.stores import PostgresStore, SqliteStore
from polyloop.stores._postgres_batch import Item
from polyloop.stores._postgres_sql import record_row
from polyloop.stores._sqlite_commit import Committer
from polyloop.stores._sqlite_sql import SYNCHRONOUS_FULL, Write


class _FullSyncCommitter(Committer):
    """The store's own commit, with every transaction under ``synchronous=FULL``."""

    __slots__ = ()

    def level(self, writes: Sequence[Write], admitted: Sequence[int]) -> int:
        return SYNCHRONOUS_FULL


class SqliteOneCommitPerWrite(SqliteStore):
    """``SqliteStore`` committing every write in a transaction of its own."""

    def __init__(self, path: str | os.PathLike[str], *, lease_s: float = 15.0) -> None:
        super().__init__(path, lease_s=lease_s)
        self._committer = _FullSyncCommitter(self._database, self._owners)

    async def _write(self, write: Write) -> None:
        (error,) = await anyio.to_thread.run_sync(self._committer.commit, [write])
        if error is not None:
            raise error


class PostgresOneCommitPerWrite(PostgresStore):
    """``PostgresStore`` committing every write in a statement of its own."""

    async def _write(self, run_id: str, records: Sequence[Any], mode: Any, **options: Any) -> None:
        rows = [record_row(record) for record in records]
        with self._writers.used(run_id) as slot:
            item = Item(
                slot,
                rows,
                mode,
                options.get("barrier", False),
                options.get("final", False),
                options.get("reason"),
            )
            commit = self._writers.committer.commit
            (error,) = await anyio.to_thread.run_sync(commit, slot.writer, [item])
        if error is not None:
            raise error
