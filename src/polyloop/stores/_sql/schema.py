"""The layout of a database store's tables, and how an older one is brought up to date.

Both SQL dialects keep a ``meta`` table whose ``format`` key names the record format and
whose ``layout`` key numbers the shape of the tables. A dialect describes its tables as
migration steps (a :class:`Layout`): each step names the layout it reaches and the
statements that reach it. :func:`prepare` runs, under the dialect's lock, the steps a
database has not had yet, then checks the record format and refuses a layout newer than
this release knows. A database from before the ``layout`` key is taken to be at layout
2 if it has a table of runs, else at 0 (every step up to 2 is safe to run again).
Research records 0033 (one engine) and 0025 (reopening runs in doubt) say why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from polyloop._shared import FORMAT
from polyloop.stores._common import check_format
from polyloop.types import CorruptLog, SchemaMajorMismatch

__all__ = ("Layout", "Steps", "prepare")

# A step where SQL alone cannot say it: called with the connection, the database's
# name for messages, and the run being served.
Action = Callable[[Any, str, str | None], None]
# Each layout number, and the statements (or actions) that reach it from the one before.
Steps = Mapping[int, tuple[str | Action, ...]]

_BEFORE_KEY_WITH_RUNS = 2

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
    """What a dialect says of its tables: the steps (SQL text naming its tables as
    ``{meta}``, ``{runs}``...), ``compose``, which makes a text its statement,
    ``exists``, a query of whether the table named by its one parameter exists, and
    ``locked``, a transaction holding the dialect's schema lock."""

    steps: Steps
    compose: Callable[[str], Any]
    exists: Any
    locked: Callable[[Any], AbstractContextManager[None]]
    holder: str  # how messages name the whole: "database", "schema"

    @property
    def current(self) -> int:
        return max(self.steps)


def prepare(conn: Any, layout: Layout, *, name: str, where: str, run_id: str | None) -> None:
    """Bring the database on ``conn`` to the current layout, then check its meta table.

    ``name`` names the database in messages, ``where`` its meta table in locations.
    """
    meta = _meta(conn, layout)
    if _recorded(conn, layout, meta, where, run_id) < layout.current:
        with layout.locked(conn):
            meta = _meta(conn, layout)  # another process may have upgraded it meanwhile
            reached = _recorded(conn, layout, meta, where, run_id)
            if reached < layout.current:
                if "format" in meta:  # a database of another format is left as it is
                    _check(meta, layout, where, run_id)
                _upgrade(conn, layout, reached, name, run_id)
                meta = _meta(conn, layout)
    _check(meta, layout, where, run_id)


def _upgrade(conn: Any, layout: Layout, reached: int, name: str, run_id: str | None) -> None:
    for number, actions in sorted(layout.steps.items()):
        if number > reached:
            for action in actions:
                if callable(action):
                    action(conn, name, run_id)
                else:
                    conn.execute(layout.compose(action))
    conn.execute(layout.compose(_SET_FORMAT))
    conn.execute(layout.compose(_SET_LAYOUT.format(layout.current)))


def _meta(conn: Any, layout: Layout) -> dict[str, str]:
    """The ``format`` and ``layout`` keys (none if there is no meta table yet)."""
    if not conn.execute(layout.exists, ("meta",)).fetchone()[0]:
        return {}
    return dict(conn.execute(layout.compose(_GET_META)).fetchall())


def _recorded(
    conn: Any, layout: Layout, meta: dict[str, str], where: str, run_id: str | None
) -> int:
    """The layout the database is at; inferred for one written before the key."""
    text = meta.get("layout")
    if text is None:
        has_runs = conn.execute(layout.exists, ("runs",)).fetchone()[0]
        return _BEFORE_KEY_WITH_RUNS if has_runs else 0
    try:
        return int(text)
    except ValueError:
        reason = f"unreadable layout {text!r:.40}"
        raise CorruptLog(reason, run_id=run_id, location=f"{where} layout") from None


def _check(meta: dict[str, str], layout: Layout, where: str, run_id: str | None) -> None:
    check_format(
        meta.get("format"), holder=layout.holder, run_id=run_id, location=f"{where} format"
    )
    recorded = int(meta.get("layout", 0))
    if recorded > layout.current:
        raise SchemaMajorMismatch(
            f"the {layout.holder}'s tables have layout {recorded}, newer than this "
            f"release's {layout.current}: open it with a newer PolyLoop release",
            run_id=run_id,
            location=f"{where} layout",
        )
