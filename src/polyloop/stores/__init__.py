"""Stores that ship with PolyLoop. Import them explicitly; there is no default store.

* :class:`MemoryStore`: this process only; choosing it says "no recovery".
* :class:`JsonlStore`: one append-only JSON-lines file per run in a directory.
* :class:`SqliteStore`: one SQLite database file (WAL, ``synchronous=FULL``).
* :class:`PostgresStore`: a PostgreSQL database shared by workers on many hosts (the
  ``postgres`` extra). The durable stores are imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from polyloop.stores._memory import MemoryStore

if TYPE_CHECKING:
    from polyloop.stores._jsonl.store import JsonlStore
    from polyloop.stores._sql.postgres.store import PostgresStore
    from polyloop.stores._sql.sqlite.store import SqliteStore

__all__ = ("JsonlStore", "MemoryStore", "PostgresStore", "SqliteStore")

_LAZY = {
    "JsonlStore": "polyloop.stores._jsonl.store",
    "SqliteStore": "polyloop.stores._sql.sqlite.store",
    "PostgresStore": "polyloop.stores._sql.postgres.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polyloop.stores' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value
