"""A PostgreSQL store whose commits a test can watch: the probe sees each statement of a
batch just before it is sent, from the batch's thread.

The store is built over its own backend (the library's dialect with a committer that
calls the probe), so production code carries no hook for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from polyloop.stores import PostgresStore
from polyloop.stores._sql.planning import Plan, RunPlan
from polyloop.stores._sql.postgres.batch import Committer
from polyloop.stores._sql.postgres.sql import Connection

# The connection, (run id, kind) of each row, the SQL sent.
Probe = Callable[[Connection, tuple[tuple[str, str], ...], tuple[str, ...]], None]


@dataclass(eq=False, slots=True)
class _ProbedCommitter(Committer):
    probe: Probe | None = None

    def _send(self, conn: Connection, runs: Sequence[RunPlan], barrier: bool, batch: Plan) -> None:
        if self.probe is not None:
            query = self.queries.write if barrier else self.queries.lazy_write
            rows = tuple((run.run_id, kind) for run in runs for _, kind, _ in run.rows())
            self.probe(conn, rows, (query.as_string(conn),))
        super(_ProbedCommitter, self)._send(conn, runs, barrier, batch)


def probed(conninfo: str, probe: Probe, **options: Any) -> PostgresStore:
    """A ``PostgresStore`` with ``options`` whose batches ``probe`` sees before each
    statement; built before any claim, so every writer commits through the probe."""
    store = PostgresStore(conninfo, **options)
    backend: Any = store._backend
    plain: Committer = backend._committer
    backend._committer = _ProbedCommitter(plain.state, plain.queries, plain.lease, probe)
    return store
