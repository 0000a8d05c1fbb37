"""Store objects of every shipped kind over one place, for cases that run on each store."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from polyloop import Store
from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore
from polyloop.stores._engine import EngineStore
from polyloop.stores._jsonl.fileops import FileOps
from polyloop.stores._jsonl.store import Jsonl

STORE_KINDS = ("memory", "jsonl", "sqlite", "postgresql")
DURABLE_KINDS = ("jsonl", "sqlite", "postgresql")
SLOW = pytest.mark.slow
# The stores on which a case about the kernel, the command line or the console runs in the
# quick run; its cases on the others are slow (research-wiki/0065). Each store's own tests
# (its contract suite, crash sweeps and faults) stay quick.
QUICK_KINDS = ("memory", "sqlite")
# The backends of a test file about one durable store: its Trio cases are slow, as are the
# Trio cases on a durable store elsewhere (tests/conftest.py, research-wiki/0044).
DURABLE_STORE_BACKENDS = ("asyncio", pytest.param("trio", marks=SLOW))


def sampled(kinds: Iterable[str]) -> list[Any]:
    """``kinds`` as parameters, each not in :data:`QUICK_KINDS` marked slow."""
    return [kind if kind in QUICK_KINDS else pytest.param(kind, marks=SLOW) for kind in kinds]


def jsonl_store_on(directory: Path, files: FileOps) -> EngineStore:
    """A JSON-lines store whose every file operation goes through ``files`` (a model of a
    disk, or one that fails on cue): the library's own backend under the store engine, as
    ``JsonlStore`` builds it over the operating system's file operations."""
    return EngineStore(Jsonl(directory.absolute(), files))


def durable_opener(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Store]:
    """What opens store objects over one durable store, of the kind the fixture's param names.

    Each call opens another object on the same data, as a new process would; the PostgreSQL
    server is asked for only when that kind runs, for a schema of the test's own.
    """
    if request.param == "jsonl":
        return lambda: JsonlStore(tmp_path / "runs")
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "runs.db")
    conninfo, schema = request.getfixturevalue("postgres_place")
    return lambda: PostgresStore(conninfo, schema=schema)


class Stores:
    """Store objects of one kind over one place (a directory, a file, a database).

    ``open`` gives a new store object on the same data (the memory store has only one
    object: its data lives in it); ``reopen`` closes a durable store object first, as the
    end of its process would.
    """

    def __init__(self, kind: str, tmp_path: Path, place: tuple[str, str] | None = None) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.place = place  # PostgreSQL's: the URL and the schema
        self.opened: list[Any] = []
        self._memory = MemoryStore()

    @classmethod
    def of(cls, kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
        """Store objects of ``kind``; PostgreSQL's in a schema of the test's own."""
        place = request.getfixturevalue("postgres_place") if kind == "postgresql" else None
        return cls(kind, tmp_path, place)

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
            assert self.place is not None
            conninfo, schema = self.place
            store = PostgresStore(conninfo, schema=schema)
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


def stores_fixture(kinds: Iterable[Any]) -> Any:
    """A ``stores`` fixture with a parameter per kind (or :func:`sampled` parameter): each
    test gets its own :class:`Stores`, every store it opened closed after it."""

    @pytest.fixture(params=list(kinds))
    async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
        kit = Stores.of(request.param, request, tmp_path)
        try:
            yield kit
        finally:
            await kit.close_all()

    return stores
