"""Store objects of every shipped kind over one place, for cases that run on each store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore

STORE_KINDS = ("memory", "jsonl", "sqlite", "postgresql")


class Stores:
    """Store objects of one kind over one place (a directory, a file, a database).

    ``open`` gives a new store object on the same data (the memory store has only one
    object: its data lives in it); ``reopen`` closes a durable store object first, as the
    end of its process would.
    """

    def __init__(self, kind: str, tmp_path: Path, conninfo: str | None) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.conninfo = conninfo
        self.opened: list[Any] = []
        self._memory = MemoryStore()

    @property
    def jsonl_dir(self) -> Path:
        return self.tmp_path / "runs"

    @property
    def sqlite_path(self) -> Path:
        return self.tmp_path / "runs.db"

    def open(self) -> Any:
        store: Any
        if self.kind == "memory":
            return self._memory
        if self.kind == "jsonl":
            store = JsonlStore(self.jsonl_dir)
        elif self.kind == "sqlite":
            store = SqliteStore(self.sqlite_path)
        else:
            assert self.conninfo is not None
            store = PostgresStore(self.conninfo)
        self.opened.append(store)
        return store

    async def reopen(self, store: Any) -> Any:
        if self.kind == "memory":
            return store
        await store.aclose()
        return self.open()

    async def close_all(self) -> None:
        for store in self.opened:
            await store.aclose()
