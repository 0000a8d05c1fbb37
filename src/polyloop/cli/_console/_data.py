"""What the console reads from the store: the rows of a page of the list, and one run.

Everything goes through the public API (``page_runs`` or ``list_runs``, ``read_log``,
:func:`polyloop.run_status`) and the command line's own view of a run, so a page says
what ``polyloop runs`` and ``polyloop show`` say.
"""

from __future__ import annotations

import anyio

from polyloop._paging import page_of, page_request, pages
from polyloop.cli._console._listing import (
    PER_PAGE,
    SCAN_LIMIT,
    Page,
    Place,
    Query,
    RowCache,
    RunRow,
    ordered,
    passes,
)
from polyloop.cli._facts import in_doubt, run_tokens_text
from polyloop.cli._view import CORRUPT, STATE_WORDS, RunView, state_detail
from polyloop.ports import ManagedStore, RunPage, StoredRun
from polyloop.session import run_status
from polyloop.types import (
    CorruptLog,
    Intent,
    IntentKind,
    InvalidRequest,
    Proposal,
    RunNotFound,
    SchemaMajorMismatch,
)

# Runs whose logs a page reads at once.
READ_AT_ONCE = 8


async def read_run(store: ManagedStore, run_id: str) -> RunView | None:
    """The run ``run_id`` read whole, or ``None`` if the store has no record of it."""
    log = await store.read_log(run_id)
    if not log.records:
        return None
    try:
        status = await run_status(store, run_id)
    except RunNotFound:  # pruned between the two reads
        return None
    return RunView(status=status, log=log)


async def read_row(store: ManagedStore, run: StoredRun) -> RunRow | None:
    """The list's line for ``run``; ``None`` if it went away since it was listed."""
    try:
        view = await read_run(store, run.run_id)
    except (CorruptLog, SchemaMajorMismatch) as exc:
        return RunRow(
            run.run_id, CORRUPT, None, None, None, run.updated_at, run.owner, detail=str(exc)
        )
    if view is None:
        return None
    status = view.status
    return RunRow(
        run_id=run.run_id,
        state=STATE_WORDS[status.state],
        stop_reason=view.stop_reason,
        steps=status.steps,
        tokens=run_tokens_text(view),
        last_record_at=status.last_record_at or run.updated_at,
        owner=status.owner or run.owner,
        detail=status.detail,
        state_detail=state_detail(status),
        started_at=status.started_at,
        ended_at=status.ended_at,
        tools=tools_called(view),
        models=models_of(view),
        last_texts=last_texts(view),
        doubt_tool=doubt.tool if (doubt := in_doubt(view)) is not None else None,
    )


def tools_called(view: RunView) -> tuple[str, ...]:
    """The tools the run called, or was asked to call (a proposal, an action in doubt),
    in the order first seen: its steps' native tool calls, and its actions' intents and
    proposals, which name the tool whatever the interpreter."""
    names: dict[str, None] = {}
    for step in view.steps:
        if step.tool_call is not None:
            names[step.tool_call.name] = None
    for record in view.log.records:
        if isinstance(record, Intent) and record.kind is not IntentKind.ACTION:
            continue
        if isinstance(record, Intent | Proposal):
            payload = record.payload
            name = payload.get("name") if isinstance(payload, dict) else None
            if isinstance(name, str):
                names[name] = None
    return tuple(names)


def models_of(view: RunView) -> tuple[str, ...]:
    """The snapshot's model parameters that are text (``model.name``, ...), digests left
    out, and the model each reply names."""
    found: dict[str, None] = {}
    for key, value in view.snapshot.items():
        if key.startswith("model.") and isinstance(value, str) and "sha256" not in key:
            found[value] = None
    for step in view.steps:
        if step.model is not None:
            found[step.model] = None
    return tuple(found)


def last_texts(view: RunView) -> tuple[str, ...]:
    """What a search of the list reads besides the run id: the last step's reply and
    observation, and the final answer."""
    texts = []
    if view.steps:
        last = view.steps[-1]
        texts.append(last.model_output)
        if last.observation is not None:
            texts.append(last.observation)
    if (answer := view.final_answer) is not None:
        texts.append(answer)
    return tuple(texts)


async def rows_for(
    store: ManagedStore, cache: RowCache, runs: list[StoredRun] | tuple[StoredRun, ...]
) -> dict[str, RunRow]:
    """The rows of ``runs``, from the cache where the run table says nothing changed."""
    cached = {run.run_id: row for run in runs if (row := cache.get(run)) is not None}
    unread = [run for run in runs if run.run_id not in cached]
    read = await _read_rows(store, unread)
    for run in unread:
        if run.run_id in read:
            cache.put(run, read[run.run_id])
    found = cached | read
    return {run.run_id: found[run.run_id] for run in runs if run.run_id in found}


async def _read_rows(store: ManagedStore, runs: list[StoredRun]) -> dict[str, RunRow]:
    """The rows of ``runs`` read from the store, ``READ_AT_ONCE`` runs at a time: a
    database answers several readers at once, so their round trips overlap."""
    found: dict[str, RunRow] = {}
    waiting = iter(runs)

    async def reader() -> None:
        for run in waiting:  # shared: each run is read by one reader
            row = await read_row(store, run)
            if row is not None:
                found[run.run_id] = row

    async with anyio.create_task_group() as group:
        for _ in range(min(READ_AT_ONCE, len(runs))):
            group.start_soon(reader)
    return found


async def table_page(
    store: ManagedStore,
    query: Query,
    place: Place,
    per_page: int = PER_PAGE,
    scan_limit: int = SCAN_LIMIT,
) -> RunPage:
    """What the run table says for page ``place`` of ``query``: the page itself when the
    run table can tell which runs pass; else the runs that may pass, most recent first
    (every unfinished run for a finer state; the ``scan_limit`` most recent runs the run
    table cannot rule out for a search, the page's ``older`` saying more were left).
    What the live page watches for changes.

    A run whose last record is older than ``started_after`` started before it, so the
    store rules it out unread.

    Cancellation: reading changes nothing on disk.
    """
    source, finished = pages(store), query.finished
    if not query.needs_rows:
        try:
            after, before = place.after, place.before
            return await source.page_runs(
                limit=per_page, finished=finished, after=after, before=before
            )
        except InvalidRequest:  # a cursor of no page of this store: the first page
            return await source.page_runs(limit=per_page, finished=finished)
    if query.reads_content:
        since = query.started_after
        return await source.page_runs(limit=scan_limit, finished=finished, updated_since=since)
    return RunPage(runs=tuple(ordered(await store.list_runs(unfinished_only=True))))


async def list_page(
    store: ManagedStore,
    cache: RowCache,
    query: Query,
    place: Place,
    per_page: int = PER_PAGE,
    scan_limit: int = SCAN_LIMIT,
) -> tuple[Page, list[RunRow], tuple[StoredRun, ...]]:
    """Page ``place`` of the runs that pass ``query``, their rows, and the run table's
    entries it was chosen from (what the live page watches for changes).

    Only the runs on the page are read when the run table can tell which pass, and the
    store sorts and cuts the page. For a finer state, every unfinished run is read too
    (through the cache) to tell which pass. A search or a filter on what a log holds
    reads the ``scan_limit`` most recent runs the run table cannot rule out, at most,
    and the page says so.

    Cancellation: reading changes nothing on disk.
    """
    table = await table_page(store, query, place, per_page, scan_limit)
    if not query.needs_rows:
        rows = await rows_for(store, cache, table.runs)
        page = Page(table.runs, newer=table.newer, older=table.older)
    else:
        rows = await rows_for(store, cache, table.runs)
        passing = [
            run for run in table.runs if run.run_id in rows and passes(rows[run.run_id], query)
        ]
        found = _placed(passing, place, per_page)
        searched_only = scan_limit if query.reads_content and table.older is not None else None
        page = Page(found.runs, found.newer, found.older, len(passing), searched_only)
    return page, [rows[run.run_id] for run in page.runs if run.run_id in rows], table.runs


def _placed(runs: list[StoredRun], place: Place, per_page: int) -> RunPage:
    """Page ``place`` of ``runs``; the first page for a cursor of none of them."""
    try:
        return page_of(runs, page_request(limit=per_page, after=place.after, before=place.before))
    except InvalidRequest:
        return page_of(runs, page_request(limit=per_page))
