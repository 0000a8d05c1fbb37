"""One page of a store's runs, most recently updated first: the request every store
reads, the cursors a page hands out, and the page derived from ``list_runs`` for a store
that cannot page itself (docs/stores.md#a-page-of-runs)."""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from polyloop.ports import ManagedStore, PagedStore, RunPage, StoredRun
from polyloop.types import InvalidRequest

# A place in the order: the store's own time of a run's last record (``None`` if it
# cannot tell) and the run id.
Position = tuple[float | datetime | None, str]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = datetime.resolution


@dataclass(frozen=True, slots=True, kw_only=True)
class PageRequest:
    """What a page is asked for, checked: the positions read from their cursors, the
    times made aware (a naive time is UTC)."""

    limit: int
    after: Position | None = None
    before: Position | None = None
    finished: bool | None = None
    since: datetime | None = None
    until: datetime | None = None

    @property
    def backward(self) -> bool:
        return self.before is not None

    @property
    def position(self) -> Position | None:
        return self.before if self.before is not None else self.after


def page_request(
    *,
    limit: int,
    after: str | None = None,
    before: str | None = None,
    finished: bool | None = None,
    updated_since: datetime | None = None,
    updated_before: datetime | None = None,
) -> PageRequest:
    """The request the arguments of :meth:`~polyloop.ports.PagedStore.page_runs` make,
    or ``InvalidRequest`` saying what is wrong with them."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidRequest(f"a page holds at least one run; limit is {limit!r}")
    if after is not None and before is not None:
        raise InvalidRequest("a page is either after a cursor or before one, not both")
    return PageRequest(
        limit=limit,
        after=None if after is None else position(after),
        before=None if before is None else position(before),
        finished=finished,
        since=_aware(updated_since),
        until=_aware(updated_before),
    )


def _aware(at: datetime | None) -> datetime | None:
    if at is not None and not isinstance(at, datetime):
        raise InvalidRequest(f"a page's time window takes datetimes, not {type(at).__name__}")
    return None if at is None else at.replace(tzinfo=at.tzinfo or UTC).astimezone(UTC)


def cursor(at: float | datetime | None, run_id: str) -> str:
    """The cursor of a run's place: JSON text, so a store's exact time goes through."""
    return json.dumps([at.isoformat() if isinstance(at, datetime) else at, run_id])


def position(text: str) -> Position:
    """The place a cursor names, or ``InvalidRequest``."""
    try:
        at, run_id = json.loads(text)
        if isinstance(at, str):
            at = datetime.fromisoformat(at)
            if at.tzinfo is None:
                raise ValueError("a naive time")
        elif at is not None and (isinstance(at, bool) or not isinstance(at, int | float)):
            raise ValueError("no time")
        if not isinstance(run_id, str):
            raise ValueError("no run id")
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"unreadable page cursor {text!r:.80}: {exc}") from None
    return at, run_id


def page_of(runs: Iterable[StoredRun], request: PageRequest) -> RunPage:
    """The page ``request`` asks for among ``runs``, worked out in Python: every run is
    looked at, so the cost follows their number."""
    kept = sorted((run for run in runs if _passes(run, request)), key=_key)
    keys = [_key(run) for run in kept]
    if request.before is not None:
        end = bisect_left(keys, _place(request.before))
        start = max(0, end - request.limit)
    else:
        start = 0 if request.after is None else bisect_right(keys, _place(request.after))
        end = start + request.limit
    chunk = kept[start:end]
    return RunPage(
        runs=tuple(chunk),
        newer=run_cursor(chunk[0]) if chunk and start > 0 else None,
        older=run_cursor(chunk[-1]) if chunk and end < len(kept) else None,
    )


def run_cursor(run: StoredRun) -> str:
    return cursor(run.updated_at, run.run_id)


def _passes(run: StoredRun, request: PageRequest) -> bool:
    if request.finished is not None and run.finished is not request.finished:
        return False
    if request.since is None and request.until is None:
        return True
    if run.updated_at is None:  # a run of unknown time is outside every window
        return False
    return (request.since is None or run.updated_at >= request.since) and (
        request.until is None or run.updated_at < request.until
    )


def _key(run: StoredRun) -> tuple[bool, int, str]:
    return _place((run.updated_at, run.run_id))


def _place(where: Position) -> tuple[bool, int, str]:
    """Most recent first, runs of unknown time last, ties by run id."""
    at, run_id = where
    if at is None:
        return True, 0, run_id
    if not isinstance(at, datetime):
        raise InvalidRequest("the page cursor is not one of this store's")
    return False, -((at - _EPOCH) // _MICROSECOND), run_id


class Paged:
    """``page_runs`` over one ``_page``, the request checked first; by default the page
    is worked out from ``list_runs``, as for a store that cannot page itself."""

    __slots__ = ()

    async def page_runs(
        self,
        *,
        limit: int,
        after: str | None = None,
        before: str | None = None,
        finished: bool | None = None,
        updated_since: datetime | None = None,
        updated_before: datetime | None = None,
    ) -> RunPage:
        """One page of the runs, most recently updated first (a ``PagedStore``).

        Cancellation: reading changes nothing on disk.
        """
        request = page_request(
            limit=limit,
            after=after,
            before=before,
            finished=finished,
            updated_since=updated_since,
            updated_before=updated_before,
        )
        return await self._page(request)

    async def _page(self, request: PageRequest) -> RunPage:
        list_runs = self.list_runs  # type: ignore[attr-defined]  # a ManagedStore's
        return page_of(await list_runs(unfinished_only=request.finished is False), request)


class _Listed(Paged):
    """The pages of a store that cannot page itself."""

    __slots__ = ("list_runs",)

    def __init__(self, store: ManagedStore) -> None:
        self.list_runs = store.list_runs


def pages(store: ManagedStore) -> PagedStore:
    """Where to ask for a page of ``store``'s runs: the store if it is a
    :class:`~polyloop.ports.PagedStore`, else its pages worked out from ``list_runs``;
    one way to ask whichever the store is."""
    return store if isinstance(store, PagedStore) else _Listed(store)
