"""Which writer connection each run of a PostgreSQL store object goes through.

:class:`Writers` keeps the store object's writer connections (at most
``max_writer_connections``, never lent to the reader pool) and the :class:`Slot` of
every run that is claimed or being written, which ties the run to one of them. Each
writer gathers the writes of its runs into shared commits that
:class:`~polyloop.stores._sql.postgres.batch.Committer` sends. ``docs/stores.md`` describes
the connections for users; research record 0019 (one write path) says why writes share
commits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from polyloop.stores._batching import GroupCommit
from polyloop.stores._common import WriterState
from polyloop.stores._sql.postgres.batch import Committer, Slot, Writer
from polyloop.stores._sql.postgres.connect import Settings

__all__ = ("Writers",)

_WRITER_NAME = "polyloop-writer"


class Writers:
    """The writer connections of one store object and the slots of its runs.

    Thread-safe: the slot table and the list of writers change only with
    ``state.mutex`` held. Nothing here blocks or awaits, so there is nothing to cancel;
    the connections open on a writer's first write, in the committer's worker thread.
    """

    __slots__ = ("_settings", "_slots", "_state", "_writers", "committer")

    def __init__(self, settings: Settings, state: WriterState, committer: Committer) -> None:
        self._settings = settings
        self._state = state
        self.committer = committer
        self._writers: list[Writer] = []
        self._slots: dict[str, Slot] = {}

    def slot(self, run_id: str) -> Slot | None:
        """``run_id``'s slot, if the run is claimed or being written."""
        return self._slots.get(run_id)

    @contextmanager
    def used(self, run_id: str) -> Iterator[Slot]:
        """``run_id``'s slot, kept while in use; forgotten when nobody uses or claims it."""
        with self._state.mutex:
            self._state.check_writable(run_id)
            slot = self._slots.get(run_id)
            if slot is None:
                slot = self._slots[run_id] = Slot(run_id, self._pick())
                slot.writer.runs.add(run_id)
            slot.users += 1
        try:
            yield slot
        finally:
            with self._state.mutex:
                slot.users -= 1
                self.forget(slot)

    def forget(self, slot: Slot) -> None:
        """Drop ``slot`` unless someone uses it or it holds a claim (``state.mutex`` held)."""
        if slot.users == 0 and slot.claim is None:
            self.remove(slot)

    def remove(self, slot: Slot) -> None:
        """Drop ``slot`` if it is still its run's (``state.mutex`` held)."""
        if self._slots.get(slot.run_id) is slot:
            del self._slots[slot.run_id]
            slot.writer.runs.discard(slot.run_id)

    def close(self) -> list[Writer]:
        """Mark the store closed and drop every claim; the writers, for the caller to
        close (each under its lock, which a commit in flight may hold)."""
        with self._state.mutex:
            self._state.closed = True
            writers, self._writers = self._writers, []
            for slot in self._slots.values():
                slot.claim = None
        return writers

    def _pick(self) -> Writer:
        """An idle writer, a new one, or the least busy (``state.mutex`` held)."""
        writer = min(self._writers, key=lambda w: len(w.runs), default=None)
        if writer is None or (writer.runs and len(self._writers) < self._settings.max_writers):
            writer = Writer(connect=partial(self._settings.connect, _WRITER_NAME))
            writer.group = GroupCommit(partial(self.committer.commit, writer))
            self._writers.append(writer)
        return writer
