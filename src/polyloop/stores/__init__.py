"""Stores that ship with PolyLoop. Import them explicitly; there is no default store.

* :class:`MemoryStore` keeps runs in this process only: choosing it says "no recovery".
"""

from polyloop.stores._memory import MemoryStore

__all__ = ("MemoryStore",)
