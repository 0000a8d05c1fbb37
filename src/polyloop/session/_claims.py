"""The per-process claim on a run id, held for the length of one ``run`` or ``resume``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from polyloop.ports import Store
from polyloop.types import RunLocked

# Keyed by id(store): a second writer through another store object, or another process,
# is for the store's own writer lock to refuse.
_ACTIVE: dict[int, set[str]] = {}


@contextmanager
def _driving(store: Store, run_id: str) -> Iterator[None]:
    """Refuse a second concurrent run/resume of one run id through one store object."""
    active = _ACTIVE.setdefault(id(store), set())
    if run_id in active:
        raise RunLocked(
            "another run or resume call is already driving this run through this store",
            run_id=run_id,
        )
    active.add(run_id)
    try:
        yield
    finally:
        active.discard(run_id)
        if not active:
            _ACTIVE.pop(id(store), None)
