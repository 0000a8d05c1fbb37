"""The layout of a database store's tables, kept in its ``meta`` table, so that a release
runs only the migration steps a database has not had (docs/stores.md#sqlitestore)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from polyloop._shared import FORMAT
from polyloop.types import CorruptLog, SchemaMajorMismatch, StoreError

# A step SQL alone cannot say: called with the connection, the database's name, the run.
Action = Callable[[Any, str, str | None], None]

_GET_META = "SELECT key, value FROM {meta} WHERE key IN ('format', 'layout')"
# A database keeps the format it was first written in; its layout moves on.
_SET_FORMAT = (
    f"INSERT INTO {{meta}} (key, value) VALUES ('format', '{FORMAT}') ON CONFLICT DO NOTHING"
)
_SET_LAYOUT = (
    "INSERT INTO {{meta}} (key, value) VALUES ('layout', '{}')"
    " ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


@dataclass(frozen=True, slots=True)
class Layout:
    """A dialect's tables: ``steps`` (each layout and the statements, naming tables as
    ``{meta}``, ``{runs}``..., or actions that reach it), ``compose`` (a text to its
    statement), ``exists`` (does the table named by its parameter exist), ``locked`` (a
    transaction under the schema lock), ``holder`` (what messages call the whole)."""

    steps: Mapping[int, tuple[str | Action, ...]]
    compose: Callable[[str], Any]
    exists: Any
    locked: Callable[[Any], AbstractContextManager[None]]
    holder: str

    @property
    def current(self) -> int:
        return max(self.steps)


def require_store(conn: Any, layout: Layout, *, name: str, run_id: str | None) -> None:
    """A ``StoreError`` naming ``name`` unless it has a meta table; writes nothing."""
    if not conn.execute(layout.exists, ("meta",)).fetchone()[0]:
        raise StoreError(
            f"no PolyLoop store in {layout.holder} {name!r}: the {layout.holder} holds no "
            f"PolyLoop tables",
            run_id=run_id,
        )


def prepare(conn: Any, layout: Layout, *, name: str, where: str, run_id: str | None) -> None:
    """Bring the database to the current layout, then check its meta table (``name`` names
    it in messages, ``where`` its meta table in locations)."""
    meta = _meta(conn, layout)
    if _reached(conn, layout, meta, where, run_id) < layout.current:
        with layout.locked(conn):
            meta = _meta(conn, layout)  # another process may have upgraded it meanwhile
            reached = _reached(conn, layout, meta, where, run_id)
            if reached < layout.current:
                if "format" in meta:  # a database of another format is left as it is
                    _check(meta, layout, where, run_id)
                steps = sorted(layout.steps.items())
                for action in [a for number, step in steps if number > reached for a in step]:
                    if callable(action):
                        action(conn, name, run_id)
                    else:
                        conn.execute(layout.compose(action))
                conn.execute(layout.compose(_SET_FORMAT))
                conn.execute(layout.compose(_SET_LAYOUT.format(layout.current)))
                meta = _meta(conn, layout)
    _check(meta, layout, where, run_id)


def _meta(conn: Any, layout: Layout) -> dict[str, str]:
    """The ``format`` and ``layout`` keys (none if there is no meta table yet)."""
    if not conn.execute(layout.exists, ("meta",)).fetchone()[0]:
        return {}
    return dict(conn.execute(layout.compose(_GET_META)).fetchall())


def _reached(
    conn: Any, layout: Layout, meta: dict[str, str], where: str, run_id: str | None
) -> int:
    """The layout the database is at. One written before the key is at 2 if it has a
    table of runs, else at 0 (every step up to 2 is safe to run again)."""
    text = meta.get("layout")
    if text is None:
        return 2 if conn.execute(layout.exists, ("runs",)).fetchone()[0] else 0
    try:
        return int(text)
    except ValueError:
        reason = f"unreadable layout {text!r:.40}"
        raise CorruptLog(reason, run_id=run_id, location=f"{where} layout") from None


def _check(meta: dict[str, str], layout: Layout, where: str, run_id: str | None) -> None:
    """Refuse an unreadable record format, one of another major, or a newer layout."""
    form, holder = meta.get("format"), layout.holder
    if not isinstance(form, str) or not form.startswith("polyloop/"):
        reason = f"no readable record format in the {holder} ({form!r:.80})"
        raise CorruptLog(reason, run_id=run_id, location=f"{where} format")
    if form.partition(".")[0] != FORMAT.partition(".")[0]:
        reason = f"the {holder} holds records in format {form!r}; this library reads {FORMAT!r}"
        raise SchemaMajorMismatch(reason, run_id=run_id, location=f"{where} format")
    recorded = int(meta.get("layout", 0))
    if recorded > layout.current:
        raise SchemaMajorMismatch(
            f"the {layout.holder}'s tables have layout {recorded}, newer than this "
            f"release's {layout.current}: open it with a newer PolyLoop release",
            run_id=run_id,
            location=f"{where} layout",
        )
