"""The SQLite store's schema and statements, its rows, and how its connections are set up.

The schema itself, and what each row means, is described in
:mod:`polyloop.stores._sql.sqlite.store`; its migration steps are SQLite's
:class:`~polyloop.stores._sql.schema.Layout`. This module turns rows back into records
(:func:`decode_rows`) and binds run ids (:func:`run_key`, :func:`run_id_of`). On the
connection side it holds :func:`connect`, the one place a connection is made,
:func:`configure`, the ``synchronous`` levels with :class:`Db`, which remembers the
level its connection was last set to, :class:`Database`, the file with the worker
threads' connection opened and checked at first use, and the transactions the store's
paths share (:func:`immediate`, :func:`rollback_quietly`). The shared commit's own
statements (``COMMIT``, ``ROLLBACK``, savepoints) stay with
:mod:`polyloop.stores._sql.sqlite.commit`, which issues them.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from polyloop.stores._common import (
    WriterState,
    create_directories,
    decode_row,
    fsync_directory,
    open_files_error,
)
from polyloop.stores._refusals import store_closed
from polyloop.stores._sql.schema import Layout, Steps, prepare
from polyloop.types import (
    PolyLoopError,
    Record,
    StoreError,
)

__all__ = (
    "ADVANCE_RUN",
    "DESCRIBE_RUN",
    "DROP_UNSTARTED",
    "EXPLAIN_REFUSAL",
    "FREE_RUN",
    "INSERT",
    "LIST_RUNS",
    "LIST_UNFINISHED",
    "NEW_RUN",
    "PRUNABLE",
    "PRUNE_ROWS",
    "PRUNE_RUN",
    "SELECT_CLAIM",
    "SELECT_RUN",
    "TAKE_RUN",
    "SYNCHRONOUS_FULL",
    "SYNCHRONOUS_NORMAL",
    "Database",
    "Db",
    "configure",
    "connect",
    "decode_rows",
    "immediate",
    "rollback_quietly",
    "run_id_of",
    "run_key",
)

# One row to insert: (kind, body).
_Row = tuple[str, str]
# How the run id is bound: text, or the bytes of an id that is not valid UTF-8 text.
_Key = str | bytes

# How long a statement waits for another connection's lock before it fails.
_BUSY_TIMEOUT_S = 30.0

SYNCHRONOUS_NORMAL = 1
SYNCHRONOUS_FULL = 2
_SET_SYNCHRONOUS = {
    SYNCHRONOUS_NORMAL: "PRAGMA synchronous=NORMAL",
    SYNCHRONOUS_FULL: "PRAGMA synchronous=FULL",
}


# The tables, as migration steps (see :mod:`polyloop.stores._sql.schema`).
_STEPS: Steps = {
    1: (
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS records (run_id TEXT NOT NULL, seq INTEGER NOT NULL,"
        " kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq))",
    ),
    2: (
        "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, next_seq INTEGER NOT NULL,"
        " finished INTEGER NOT NULL, updated_at REAL NOT NULL, owner TEXT,"
        " epoch INTEGER NOT NULL DEFAULT 0, stop_reason TEXT)",
        "CREATE INDEX IF NOT EXISTS runs_unfinished ON runs (run_id) WHERE finished = 0",
        # One row per run of the records, finished if its last record is a final end.
        "INSERT OR IGNORE INTO runs (run_id, next_seq, finished, updated_at, stop_reason)"
        " SELECT r.run_id, max(r.seq) + 1, coalesce((SELECT l.kind = 'run_ended'"
        "   AND json_valid(l.body) AND json_extract(l.body, '$.stop_reason')"
        "   NOT IN ('cancelled', 'in_doubt', 'awaiting_approval')"
        "   FROM records AS l WHERE l.run_id = r.run_id ORDER BY l.seq DESC LIMIT 1), 0),"
        "  (julianday('now') - 2440587.5) * 86400.0,"
        "  (SELECT json_extract(l.body, '$.stop_reason') FROM records AS l"
        "   WHERE l.run_id = r.run_id AND l.kind = 'run_ended' AND json_valid(l.body)"
        "   AND l.seq = (SELECT max(seq) FROM records WHERE run_id = r.run_id))"
        " FROM records AS r GROUP BY r.run_id ORDER BY min(r.rowid)",
    ),
    3: (
        lambda conn, name, run_id: _add_columns(conn),
        "DROP INDEX IF EXISTS runs_owned",  # served the owners' leases, gone with them
        "CREATE INDEX IF NOT EXISTS runs_finished ON runs (updated_at) WHERE finished = 1",
    ),
    # Releases before settlements marked a run that ended in doubt finished; a
    # settlement reopens such a run.
    4: (
        "UPDATE runs SET finished = 0 WHERE finished = 1 AND (SELECT l.kind = 'run_ended'"
        " AND json_valid(l.body) AND json_extract(l.body, '$.stop_reason') = 'in_doubt'"
        " FROM records AS l WHERE l.run_id = runs.run_id ORDER BY l.seq DESC LIMIT 1)",
    ),
    # Releases before 0032 kept owners with leases in a table of that name. A view stands
    # in its place: such a release can open the database but cannot register as an
    # owner, so it never claims a run behind the locks of a current one.
    5: (
        lambda conn, name, run_id: _retire_owners(conn, name, run_id),
        "CREATE VIEW IF NOT EXISTS owners AS SELECT NULL AS owner_id, NULL AS description,"
        " NULL AS lease_until, NULL AS started_at WHERE 0",
    ),
}
# Columns the runs table gained after it was first made, with what an older row holds.
_RUNS_COLUMNS = (
    ("owner", "TEXT"),
    ("epoch", "INTEGER NOT NULL DEFAULT 0"),
    ("stop_reason", "TEXT"),
)
INSERT = "INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)"
SELECT_RUN = "SELECT seq, kind, body FROM records WHERE run_id = ? ORDER BY seq"
# Claims: the run's row names its writer; every claim moves the epoch on, and a new id
# gets a row with next_seq 0 until the run starts.
SELECT_CLAIM = "SELECT epoch, next_seq, finished FROM runs WHERE run_id = ?"
TAKE_RUN = "UPDATE runs SET owner = ?, epoch = epoch + 1 WHERE run_id = ?"
NEW_RUN = (
    "INSERT INTO runs (run_id, next_seq, finished, updated_at, owner, epoch)"
    " VALUES (?, 0, 0, ?, ?, 1)"
)
DROP_UNSTARTED = "DELETE FROM runs WHERE run_id = ? AND epoch = ? AND next_seq = 0"
FREE_RUN = "UPDATE runs SET owner = NULL WHERE run_id = ? AND epoch = ? AND next_seq > 0"
# The fence: a run's row moves on only under the writer's claim epoch, from the seq it
# expects, and never once the run has finished; a write that moves no row is refused
# and rolled back. An end record gives the owner up in the same statement.
ADVANCE_RUN = (
    "UPDATE runs SET next_seq = ?, finished = ?, stop_reason = ?, updated_at = ?,"
    " owner = CASE WHEN ? THEN NULL ELSE owner END"
    " WHERE run_id = ? AND epoch = ? AND next_seq = ? AND finished = 0"
)
EXPLAIN_REFUSAL = "SELECT epoch, finished FROM runs WHERE run_id = ?"
_LISTED = (
    "SELECT r.run_id, r.finished, r.updated_at, r.owner FROM runs AS r {index} WHERE r.next_seq > 0"
)
LIST_RUNS = _LISTED.format(index="") + " ORDER BY r.rowid"
# Named, because without statistics SQLite would rather scan the whole table in rowid
# order than sort the few rows the index holds; the index is what keeps finished runs
# out of the cost.
LIST_UNFINISHED = (
    _LISTED.format(index="INDEXED BY runs_unfinished") + " AND r.finished = 0 ORDER BY r.rowid"
)
DESCRIBE_RUN = _LISTED.format(index="") + " AND r.run_id = ?"
PRUNABLE = (
    "SELECT run_id FROM runs INDEXED BY runs_finished WHERE finished = 1 AND updated_at < ?"
    " AND owner IS NULL AND stop_reason IS NOT 'in_doubt' ORDER BY updated_at"
)
PRUNE_ROWS = "DELETE FROM records WHERE run_id = ?"
PRUNE_RUN = (
    "DELETE FROM runs WHERE run_id = ? AND epoch = ? AND finished = 1 AND updated_at < ?"
    " AND stop_reason IS NOT 'in_doubt'"
)


# -- records and rows -----------------------------------------------------------------------


def run_key(run_id: str) -> _Key:
    """The value bound for ``run_id``: the text itself when SQLite can hold it."""
    if run_id.isascii():
        return run_id
    try:
        run_id.encode("utf-8")
    except UnicodeEncodeError:
        return run_id.encode("utf-8", "surrogatepass")
    return run_id


def run_id_of(key: object) -> str:
    if isinstance(key, bytes):
        return key.decode("utf-8", "surrogatepass")
    return str(key)


def decode_rows(name: str, run_id: str, rows: Sequence[tuple[Any, ...]]) -> tuple[Record, ...]:
    """The records of ``rows`` (seq, kind, body) of ``run_id`` in the database ``name``."""
    return tuple(_decode_row(name, run_id, seq, kind, body) for seq, kind, body in rows)


def _decode_row(name: str, run_id: str, seq: int, kind: object, body: object) -> Record:
    return decode_row(body, run_id=run_id, kind=kind, location=f"{name}: run row seq {seq}")


# -- connections and transactions -----------------------------------------------------------


@dataclass(eq=False, slots=True)
class Db:
    """One connection, and the ``synchronous`` level it was last set to."""

    conn: sqlite3.Connection
    level: int | None = SYNCHRONOUS_FULL  # None: unknown, a pragma failed

    def synchronous(self, level: int) -> None:
        """Set ``synchronous`` for the next transaction, unless it is set already.

        Only between transactions: SQLite refuses the pragma inside one.
        """
        if self.level != level:
            self.level = None  # unknown until the pragma returns
            self.conn.execute(_SET_SYNCHRONOUS[level])
            self.level = level


def connect(path: Path, *, timeout: float) -> sqlite3.Connection:
    """A new connection in autocommit mode, usable from any worker thread: the store
    issues its own ``BEGIN`` and hands the connection between threads under its mutex."""
    return sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)


class _Directories:
    """Directory operations on the real file system, for :func:`create_directories`."""

    __slots__ = ()

    def mkdir(self, path: Path) -> None:
        path.mkdir()

    def is_dir(self, path: Path) -> bool:
        return path.is_dir()

    def fsync_directory(self, directory: Path) -> None:
        fsync_directory(directory)


_DIRECTORIES = _Directories()


class Database:
    """The database file, and the one connection the store's worker threads share.

    The connection is opened and checked at first use. Every method runs in a worker
    thread with the store mutex (``state.mutex``) held, which is what makes one
    connection enough; none of them is ever cancelled halfway (a worker thread runs to
    its end).
    """

    __slots__ = ("_worker", "path", "state")

    def __init__(self, path: Path, state: WriterState) -> None:
        self.path = path
        self.state = state
        self._worker: Db | None = None

    @property
    def opened(self) -> Db | None:
        """The connection if it is open; never opens it."""
        return self._worker

    def connection(self, run_id: str | None) -> Db:
        """The connection, opening and checking the database on first use."""
        if self.state.closed:
            raise store_closed(run_id)
        if self._worker is None:
            self._worker = self._open(run_id)
        return self._worker

    @contextmanager
    def reading(self, run_id: str | None) -> Iterator[None]:
        """Refuse a closed store; report a failed statement as a ``StoreError``."""
        if self.state.closed:
            raise store_closed(run_id)
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {type(exc).__name__}: {exc}", run_id=run_id) from exc

    def close(self) -> None:
        db, self._worker = self._worker, None
        if db is not None:
            try:
                db.conn.close()
            except sqlite3.Error as exc:
                raise StoreError(f"closing {self.path.name} failed: {exc}") from exc

    def _open(self, run_id: str | None) -> Db:
        """Open and check the database (WAL, ``synchronous=FULL``, the schema, the format)."""
        path = self.path
        conn: sqlite3.Connection | None = None
        try:
            create_directories(_DIRECTORIES, path.absolute().parent, run_id=run_id)
            created = not path.exists()
            conn = connect(path, timeout=_BUSY_TIMEOUT_S)
            configure(conn, path.name, run_id)
            prepare(conn, _LAYOUT, name=path.name, where=f"{path.name}: meta", run_id=run_id)
            if created:
                fsync_directory(path.parent)
        except BaseException as exc:
            if conn is not None:
                with suppress(sqlite3.Error):  # the original error says more
                    conn.close()
            if isinstance(exc, (sqlite3.Error, OSError)) and not isinstance(exc, PolyLoopError):
                raise open_files_error(exc, run_id) or StoreError(
                    f"cannot open {path.name}: {exc}", run_id=run_id
                ) from exc
            raise
        return Db(conn)


def configure(conn: sqlite3.Connection, name: str, run_id: str | None) -> None:
    """Switch to WAL with ``synchronous=FULL`` and make sure the database took both."""
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(
            f"{name}: SQLite refused WAL journal mode (it reports {mode!r}); the store needs "
            f"a database file on a local file system, not an in-memory database",
            run_id=run_id,
        )
    conn.execute("PRAGMA synchronous=FULL")
    level = conn.execute("PRAGMA synchronous").fetchone()[0]
    if level != SYNCHRONOUS_FULL:
        raise StoreError(
            f"{name}: SQLite refused synchronous=FULL (it reports {level!r})", run_id=run_id
        )


def _add_columns(conn: sqlite3.Connection) -> None:
    """Add the columns an older runs table lacks (SQLite has no ADD COLUMN IF NOT EXISTS)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    for column, declaration in _RUNS_COLUMNS:
        if column not in columns:
            conn.execute(f"ALTER TABLE runs ADD COLUMN {column} {declaration}")


def _retire_owners(conn: sqlite3.Connection, name: str, run_id: str | None) -> None:
    """Drop the owners table of an earlier release, its runs freed; refuse while one of
    its owners still holds a lease (its process may be running)."""
    row = conn.execute("SELECT type FROM sqlite_master WHERE name = 'owners'").fetchone()
    if row is None or row[0] != "table":
        return
    live = conn.execute(
        "SELECT description, lease_until FROM owners WHERE lease_until > ? LIMIT 1",
        (time.time(),),
    ).fetchone()
    if live is not None:
        raise StoreError(
            f"{name}: a process of an earlier PolyLoop release ({live[0]}) holds runs "
            f"in this database under a lease; stop it before opening the database with "
            f"this release, which claims runs by locks instead",
            run_id=run_id,
        )
    conn.execute("UPDATE runs SET owner = NULL WHERE owner IN (SELECT owner_id FROM owners)")
    conn.execute("DROP TABLE owners")


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; roll back if anything inside fails."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise


def rollback_quietly(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with suppress(sqlite3.Error):  # the original error says more
            conn.execute("ROLLBACK")


# SQLite's tables, upgraded under ``BEGIN IMMEDIATE``, the database's write lock.
_LAYOUT = Layout(
    steps=_STEPS,
    compose=partial(str.format, meta="meta"),
    exists="SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
    locked=immediate,
    holder="database",
)
