"""SQLite's tables (:data:`LAYOUT`), its statements, and :func:`connect`
(docs/stores.md#sqlitestore)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

from polyloop._paging import PageRequest
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._open_files import open_files_error
from polyloop.stores._paths import create_directories
from polyloop.stores._sql.paging import Dialect, page_sql
from polyloop.stores._sql.schema import Action, Layout, prepare, require_store
from polyloop.types import PolyLoopError, StoreError

_FILES = OsFileOps()


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


def _add_columns(*added: str) -> Action:
    """A step adding each column (``name declaration``) an older runs table lacks
    (SQLite has no ADD COLUMN IF NOT EXISTS)."""

    def add(conn: sqlite3.Connection, name: str, run_id: str | None) -> None:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
        for column in added:
            if column.split()[0] not in columns:
                conn.execute(f"ALTER TABLE runs ADD COLUMN {column}")

    return add


def _retire_owners(conn: sqlite3.Connection, name: str, run_id: str | None) -> None:
    """Drop an earlier release's owners table, freeing its runs, unless a lease holds."""
    row = conn.execute("SELECT type FROM sqlite_master WHERE name = 'owners'").fetchone()
    if row is None or row[0] != "table":
        return
    live = conn.execute(
        "SELECT description FROM owners WHERE lease_until > ? LIMIT 1", (time.time(),)
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


# SQLite's tables, upgraded under ``BEGIN IMMEDIATE``, the database's write lock.
LAYOUT = Layout(
    steps={
        1: (
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS records (run_id TEXT NOT NULL, seq INTEGER NOT NULL,"
            " kind TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, seq))",
        ),
        2: (
            "CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY,"
            " next_seq INTEGER NOT NULL, finished INTEGER NOT NULL, updated_at REAL NOT NULL,"
            " owner TEXT, epoch INTEGER NOT NULL DEFAULT 0, stop_reason TEXT)",
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
            _add_columns("owner TEXT", "epoch INTEGER NOT NULL DEFAULT 0", "stop_reason TEXT"),
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
        # Releases before 0032 kept owners with leases in a table of that name. A view
        # stands in its place: such a release can open the database but cannot register
        # as an owner, so it never claims a run behind the locks of a current one.
        5: (
            _retire_owners,
            "CREATE VIEW IF NOT EXISTS owners AS SELECT NULL AS owner_id, NULL AS description,"
            " NULL AS lease_until, NULL AS started_at WHERE 0",
        ),
        # A run's cancel request, kept in its row: later intents and proposals yield to it.
        6: (_add_columns("cancel_by TEXT", "cancel_reason TEXT", "cancel_at TEXT"),),
        # A page of runs, most recent first, read in order from the index (record 0076).
        7: ("CREATE INDEX IF NOT EXISTS runs_recent ON runs (updated_at DESC, run_id)",),
    },
    compose=partial(str.format, meta="meta"),
    exists="SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
    locked=immediate,
    holder="database",
)

INSERT = "INSERT INTO records (run_id, seq, kind, body) VALUES (?, ?, ?, ?)"
SELECT_RUN = "SELECT seq, kind, body FROM records WHERE run_id = ? ORDER BY seq"
SELECT_AFTER = "SELECT seq, kind, body FROM records WHERE run_id = ? AND seq >= ? ORDER BY seq"
# How many records a started run has: what a follower checks for news (no row: none).
RUN_LENGTH = "SELECT next_seq FROM runs WHERE run_id = ? AND next_seq > 0"
# Followed runs checked at once: well under SQLite's smallest limit on parameters (999).
KEYS_A_STATEMENT = 500


def run_lengths(count: int) -> str:
    """The length of each of ``count`` runs that has a record, by its ``run_id`` column."""
    marks = ", ".join("?" * count)
    return f"SELECT run_id, next_seq FROM runs WHERE run_id IN ({marks}) AND next_seq > 0"


# A claim names its writer in the run's row and moves the epoch on.
SELECT_CLAIM = (
    "SELECT epoch, finished, next_seq, cancel_by, cancel_reason, cancel_at FROM runs"
    " WHERE run_id = ?"
)
TAKE_RUN = "UPDATE runs SET owner = ?, epoch = epoch + 1 WHERE run_id = ?"
NEW_RUN = (
    "INSERT INTO runs (run_id, next_seq, finished, updated_at, owner, epoch)"
    " VALUES (?, 0, 0, ?, ?, 1)"
)
DROP_UNSTARTED = "DELETE FROM runs WHERE run_id = ? AND epoch = ? AND next_seq = 0"
FREE_RUN = "UPDATE runs SET owner = NULL WHERE run_id = ? AND epoch = ? AND next_seq > 0"
# The fence: a run's row moves on only under the claim's epoch, from the expected seq,
# never once finished, and for an intent or a proposal only without a cancel request;
# an end record gives the owner up in the same statement.
ADVANCE_RUN = (
    "UPDATE runs SET next_seq = ?, finished = ?, stop_reason = ?, updated_at = ?,"
    " owner = CASE WHEN ? THEN NULL ELSE owner END"
    " WHERE run_id = ? AND epoch = ? AND next_seq = ? AND finished = 0"
    " AND (NOT ? OR cancel_at IS NULL)"
)
# A run's first request stays; the row of a run never started has no record to cancel.
ASK_CANCEL = (
    "UPDATE runs SET cancel_by = coalesce(cancel_by, ?),"
    " cancel_reason = coalesce(cancel_reason, ?),"
    " updated_at = CASE WHEN cancel_at IS NULL THEN ? ELSE updated_at END,"
    " cancel_at = coalesce(cancel_at, ?) WHERE run_id = ? AND next_seq > 0"
)
READ_CANCEL = (
    "SELECT cancel_by, cancel_reason, cancel_at FROM runs WHERE run_id = ?"
    " AND cancel_at IS NOT NULL"
)
_LISTED = (
    "SELECT r.run_id, r.finished, r.updated_at, r.owner, r.cancel_at IS NOT NULL"
    " FROM runs AS r {} WHERE r.next_seq > 0"
)
LIST_RUNS = _LISTED.format("") + " ORDER BY r.rowid"
DESCRIBE_RUN = _LISTED.format("") + " AND r.run_id = ?"
# Named: without statistics SQLite would scan the whole table rather than the index.
LIST_UNFINISHED = (
    _LISTED.format("INDEXED BY runs_unfinished") + " AND r.finished = 0 ORDER BY r.rowid"
)
PAGED = Dialect(
    mark=":{}".format,
    finished=("r.finished = 1", "r.finished = 0"),
    tie="r.run_id",
    stamp=float,
    # A run's time is listed to the microsecond, rounded: a bound moves half a one
    # down, so a run is in a window as its listed time says.
    time=lambda at: at.timestamp() - 5e-7,
    key=lambda run_id: run_key(run_id),  # defined below
)


def page_query(request: PageRequest) -> tuple[str, dict[str, object]]:
    """The statement of a page of runs: the few unfinished runs from their own index,
    any others in order from the index of recent ones."""
    index = "runs_unfinished" if request.finished is False else "runs_recent"
    text, params = page_sql(PAGED, request)
    return _LISTED.format(f"INDEXED BY {index}") + text, params


PRUNABLE = (
    "SELECT run_id FROM runs INDEXED BY runs_finished WHERE finished = 1 AND updated_at < ?"
    " AND owner IS NULL AND stop_reason IS NOT 'in_doubt' ORDER BY updated_at"
)
PRUNE_ROWS = "DELETE FROM records WHERE run_id = ?"
PRUNE_RUN = (
    "DELETE FROM runs WHERE run_id = ? AND epoch = ? AND finished = 1 AND updated_at < ?"
    " AND stop_reason IS NOT 'in_doubt'"
)


def connect(path: Path, run_id: str | None, *, create: bool = True) -> sqlite3.Connection:
    """Open, check and bring up to date the database (WAL, ``synchronous=FULL``), in
    autocommit mode, for any thread; not ``create``: make nothing, refuse a non-store."""
    conn: sqlite3.Connection | None = None
    try:
        if create:
            create_directories(_FILES, path.absolute().parent, run_id=run_id)
        elif not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            raise StoreError(f"no PolyLoop store at {path}: the file {problem}", run_id=run_id)
        created = create and not path.exists()
        # Not ``create``: read-write, never create, as the file may go since the check.
        target = path if create else path.absolute().as_uri() + "?mode=rw"
        # A statement waits up to 30 s for another connection's lock before it fails.
        conn = sqlite3.connect(
            target, timeout=30.0, isolation_level=None, check_same_thread=False, uri=not create
        )
        if not create:  # before WAL mode is set, which would write to the file
            require_store(conn, LAYOUT, name=path.name, run_id=run_id)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        conn.execute("PRAGMA synchronous=FULL")
        level = conn.execute("PRAGMA synchronous").fetchone()[0]
        if str(mode).lower() != "wal" or level != 2:  # 2 is FULL
            raise StoreError(
                f"{path}: SQLite refused WAL journal mode or synchronous=FULL (it reports "
                f"{mode!r} and {level!r}); the store needs a database file on a local file "
                f"system, not an in-memory database",
                run_id=run_id,
            )
        prepare(conn, LAYOUT, name=str(path), where=f"{path}: meta", run_id=run_id)
        if created:
            _FILES.fsync_directory(path.parent)
    except BaseException as exc:
        if conn is not None:
            with suppress(sqlite3.Error):  # the original error says more
                conn.close()
        if isinstance(exc, (sqlite3.Error, OSError)) and not isinstance(exc, PolyLoopError):
            raise open_files_error(exc, run_id) or StoreError(
                f"cannot open the database {path}: {exc}", run_id=run_id
            ) from exc
        raise
    return conn


def run_key(run_id: str) -> str | bytes:
    """The value bound for ``run_id``: its text, or bytes where it is not valid UTF-8."""
    try:
        run_id.encode("utf-8")
    except UnicodeEncodeError:
        return run_id.encode("utf-8", "surrogatepass")
    return run_id


def run_id_of(key: str | bytes) -> str:
    return key.decode("utf-8", "surrogatepass") if isinstance(key, bytes) else key
