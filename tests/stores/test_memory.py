"""The memory store against the shared store contract."""

from __future__ import annotations

import pytest

from polyloop.ports import Store
from polyloop.stores import MemoryStore
from polyloop.testing.store_contract import StoreContract


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store_factory(self) -> object:
        # One store object holds the data; the memory store cannot be reopened.
        store = MemoryStore()

        def same_store() -> Store:
            return store

        return same_store


def test_memory_store_says_it_is_not_recoverable() -> None:
    assert "NOT recoverable" in (MemoryStore.__doc__ or "")
    assert MemoryStore().parameters() == {"kind": "memory", "format": "polyloop/1"}
