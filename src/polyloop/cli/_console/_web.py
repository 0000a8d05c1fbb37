"""The console's pages, fragments, event streams and answers, as a Starlette application.

A run's facts are the HTML sections ``polyloop show --html`` writes; the list's rows are
the states ``polyloop runs`` prints. Answers go through :func:`polyloop.approve`,
:func:`polyloop.reject`, :func:`polyloop.settle` and :func:`polyloop.cancel`, which take
the run's claim: two people answering at once get exactly one verdict, and the other a
clear refusal.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Hashable
from contextlib import aclosing
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote, unquote, urlencode

import anyio
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from polyloop._escaping import escape_block, escape_field
from polyloop.cli import _html
from polyloop.cli._common import editable_json, edited_arguments
from polyloop.cli._console import _guard
from polyloop.cli._console._data import list_page, read_run, table_page
from polyloop.cli._console._guard import Access, Refused, checked_form, context, form_text
from polyloop.cli._console._links import LinkTemplate
from polyloop.cli._console._listing import (
    PER_PAGE,
    SCAN_LIMIT,
    Place,
    Query,
    RowCache,
    RunRow,
    StateFilter,
)
from polyloop.cli._console._run_page import WIDTH, edits, timeline
from polyloop.cli._facts import Doubt, in_doubt, utc_text
from polyloop.cli._view import RunView, span_text
from polyloop.ports import ManagedStore
from polyloop.session import approve, cancel, follow, reject, run_status, settle
from polyloop.types import (
    CancelRequest,
    CancelRequested,
    FollowedRecord,
    InvalidRequest,
    JSONValue,
    NotAwaitingApproval,
    NotInDoubt,
    PolyLoopError,
    Proposal,
    RunEnded,
    RunLocked,
    RunNotFound,
    RunState,
    StopReason,
    run_trace_id,
)

# What a finished answer says after the redirect; fixed words, never text from the URL.
DONE = {
    "approved": "Approved. The action runs next.",
    "rejected": "Rejected. The model is told why next.",
    "settled": "Settled. The run goes on from what you said.",
}
# Who goes on with the run, by whether it names an agent (RunStatus.agent).
GOES_ON = {
    True: "A worker hosting its agent goes on with it (within about a second, while one runs).",
    False: "It goes on when the program that started it resumes it.",
}
# What a cancel did, after the redirect: the run does not go on.
STOPPED = {
    "cancelled": "Cancelled. The run ended for good; nothing it had not started ran.",
    "cancel_requested": (
        "Cancel requested. The worker driving the run ends it before its next effect; "
        "an action already running finishes first."
    ),
    "already_finished": "The run had already finished. Nothing was written.",
}
_REFUSED_STATUS: dict[type[Exception], int] = {
    RunLocked: 409,
    NotAwaitingApproval: 409,
    NotInDoubt: 409,
    CancelRequested: 409,
    RunNotFound: 404,
    InvalidRequest: 400,
}


@dataclass(frozen=True, slots=True)
class Settings:
    """How the console runs: the store's name as shown, who may use it, how often the
    live pages look at the store, and how many runs a page of the list holds."""

    store_name: str
    access: Access = field(default_factory=Access)
    poll_s: float = 1.0
    per_page: int = PER_PAGE
    scan_limit: int = SCAN_LIMIT
    # What "today" and "yesterday" in the list's time links are measured from.
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    # Where a run's page links to: its trace in a tracing UI, its Temporal workflow.
    trace_link: LinkTemplate | None = None
    temporal_link: LinkTemplate | None = None


def run_path(run_id: str) -> str:
    """The run page's path, the run id as one path segment, which reads back to the id
    whatever it holds (``/``, ``%``, ``?``, ``#``, spaces, lone surrogates).

    The id's UTF-8 is percent-encoded twice: a server decodes a path once before routing
    it, and a ``/`` decoded there would split the segment. An id of dots only has its dots
    encoded too: a browser resolves a segment ``.`` or ``..`` (or ``%2e``) before asking,
    so a link to it would lead to another page.
    """
    segment = encoded(run_id, safe="")
    if not run_id.strip("."):
        segment = segment.replace(".", "%2E")
    return "/runs/" + quote(segment, safe="")


def encoded(text: str, *, safe: str) -> str:
    """``text`` percent-encoded as UTF-8, lone surrogates included (see :func:`decoded`)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe=safe)


def decoded(text: str) -> str:
    """What :func:`encoded` encoded; bytes that are not UTF-8 (in an address typed by
    hand) as U+FFFD, which names no run and no result, rather than an error."""
    try:
        return unquote(text, errors="surrogatepass")
    except UnicodeDecodeError:
        return unquote(text, errors="replace")


def version(value: Hashable) -> str:
    """A short fingerprint of what the store said (run-table entries), to tell the live
    pages it changed. Python's own hash of the frozen entries: a page and its event
    stream are served by one process, and hashing 100,000 entries this way costs a
    fraction of writing them out as text."""
    return format(hash(value) & 0xFFFF_FFFF_FFFF_FFFF, "016x")


def _templates() -> Environment:
    environment = Environment(
        loader=PackageLoader("polyloop.cli._console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_shown,
    )
    environment.filters["run_path"] = run_path
    environment.filters["field"] = escape_field
    environment.filters["form_value"] = lambda text: encoded(text, safe=":")
    environment.filters["utc"] = utc_text
    environment.globals["css"] = Markup(_html.CSS)
    return environment


def _shown(value: object) -> object:
    """Every value a template prints, as the terminal prints it: whatever is not already
    markup (the run's sections, escaped where they are made) is text that may come from
    a log, so its control and bidirectional characters and lone surrogates are written
    as escapes (a template shows a one-line value through the ``field`` filter, which
    escapes line breaks too)."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return escape_block(value)
    return value


def create_app(store: ManagedStore, settings: Settings) -> Starlette:
    """The console for ``store`` (open, and kept open by the caller while it serves)."""
    console = _Console(store, settings, _templates())
    routes = [
        Route("/", console.runs_page),
        Route("/partials/runs", console.runs_partial),
        Route("/events", console.runs_events),
        Route("/login", console.login_page, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/runs/{key}", console.run_page),
        Route("/runs/{key}/partial", console.run_partial),
        Route("/runs/{key}/events", console.run_events),
        Route("/runs/{key}/approve", console.approve, methods=["POST"]),
        Route("/runs/{key}/reject", console.reject, methods=["POST"]),
        Route("/runs/{key}/settle", console.settle, methods=["POST"]),
        Route("/runs/{key}/cancel", console.cancel, methods=["POST"]),
        Route("/favicon.ico", _no_icon),
    ]
    return Starlette(routes=routes, middleware=[Middleware(_guard.Guard, access=settings.access)])


async def _no_icon(request: Request) -> Response:
    """Browsers ask for an icon on every page; an empty answer keeps a 404 out of their
    consoles and logs."""
    return Response(status_code=204)


def _run_id(request: Request) -> str:
    return decoded(request.path_params["key"])


def answered_id(form: FormData) -> str | None:
    """The result id a form answers, if it names one. The page writes it with
    :func:`encoded`, since a field cannot carry every character a log can hold; an
    ordinary id reads as itself."""
    return decoded(form_text(form, "result_id")) or None


def _sse(changes: AsyncIterator[None]) -> StreamingResponse:
    async def stream() -> AsyncIterator[str]:
        yield "retry: 3000\n\n"
        async for _ in changes:
            yield "event: changed\ndata: {}\n\n"

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"}
    )


def _position(request: Request) -> int | None:
    """Where a run's event stream starts: ``Last-Event-ID`` when the browser reconnects,
    else the ``after`` the page was rendered with; ``None`` if it is not a position."""
    text = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    return int(text) if text.isascii() and text.isdigit() else None


def _record_events(followed: AsyncGenerator[FollowedRecord, None]) -> StreamingResponse:
    async def stream() -> AsyncIterator[str]:
        yield "retry: 3000\n\n"
        last: FollowedRecord | None = None
        try:
            async with aclosing(followed) as records:
                async for last in records:
                    yield f"id: {last.position}\nevent: changed\ndata: {{}}\n\n"
        except RunNotFound:
            last = None  # pruned: nothing more will come
        # A stop a resume may continue ends a stream too: the browser reconnects and waits
        # for more. After a final end (or none to be had), it is told to stop asking.
        if last is None or (isinstance(last.record, RunEnded) and last.record.is_final):
            yield "event: ended\ndata: {}\n\n"

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"X-Accel-Buffering": "no"}
    )


class _Console:
    """The handlers, sharing the store, the settings and the cache of list rows."""

    def __init__(self, store: ManagedStore, settings: Settings, templates: Environment) -> None:
        self.store = store
        self.settings = settings
        self.templates = templates
        self.rows = RowCache()

    def render(
        self, request: Request, name: str, values: dict[str, Any], status: int = 200
    ) -> HTMLResponse:
        found = context(request)
        page = self.templates.get_template(name).render(
            nonce=found.nonce,
            csrf=found.csrf,
            user=found.user,
            store_name=self.settings.store_name,
            read_only=self.settings.access.read_only,
            token_needed=self.settings.access.token is not None,
            **values,
        )
        return HTMLResponse(page, status_code=status)

    # -- the list --------------------------------------------------------------------------

    async def _listing(self, request: Request) -> dict[str, Any]:
        query, place = Query.parse(request.query_params), Place.parse(request.query_params)
        page, rows, seen = await list_page(
            self.store, self.rows, query, place, self.settings.per_page, self.settings.scan_limit
        )
        params = query.params()
        return {
            "page": page,
            "rows": rows,
            "wanted": query.state,
            "query": query,
            "filters": [
                (choice, _link(query.with_changes(state=choice))) for choice in StateFilter
            ],
            "stop_reasons": [reason.value for reason in StopReason],
            "times": _time_links(query, self.settings.clock()),
            "facets": {row.run_id: _facets(query, row) for row in rows},
            "durations": {row.run_id: _duration_text(row) for row in rows},
            "live_query": _query_string({**params, **place.params()}),
            "previous": _query_string({**params, "before": page.newer or ""}),
            "next": _query_string({**params, "after": page.older or ""}),
            "version": version(seen),
        }

    async def runs_page(self, request: Request) -> Response:
        return self.render(request, "runs.html", await self._listing(request))

    async def runs_partial(self, request: Request) -> Response:
        return self.render(request, "runs_live.html", await self._listing(request))

    async def runs_events(self, request: Request) -> Response:
        query, place = Query.parse(request.query_params), Place.parse(request.query_params)
        settings = self.settings

        async def seen() -> Hashable:
            found = await table_page(
                self.store, query, place, settings.per_page, settings.scan_limit
            )
            return found.runs

        return _sse(self._changes(request, seen))

    # -- one run ---------------------------------------------------------------------------

    async def _run(self, request: Request) -> tuple[str, RunView | None]:
        run_id = _run_id(request)
        return run_id, await read_run(self.store, run_id)

    async def run_page(
        self,
        request: Request,
        *,
        error: str | None = None,
        status: int = 200,
        form: FormData | None = None,
    ) -> Response:
        run_id, view = await self._run(request)
        if view is None:
            return self.render(request, "missing.html", {"run_id": run_id}, status=404)
        done = DONE.get(request.query_params.get("done", "")) if error is None else None
        if done is not None:
            done = f"{done} {GOES_ON[view.status.agent is not None]}"
        elif error is None:
            done = STOPPED.get(request.query_params.get("done", ""))
        values = {
            **await self._run_values(run_id, view),
            "error": error,
            "done": done,
            "entered": _entered(form),
        }
        return self.render(request, "run.html", values, status=status)

    async def run_partial(self, request: Request) -> Response:
        run_id, view = await self._run(request)
        if view is None:
            return PlainTextResponse("no such run\n", status_code=404)
        return self.render(request, "run_live.html", await self._run_values(run_id, view))

    async def _run_values(self, run_id: str, view: RunView) -> dict[str, Any]:
        proposal = view.status.proposal
        doubt = in_doubt(view)
        stored = await self.store.describe_run(run_id)
        asked = await self._cancel_asked(view, stored is not None and stored.cancel_requested)
        trace_link, temporal_link = self.settings.trace_link, self.settings.temporal_link
        return {
            "run_id": run_id,
            "view": view,
            "trace_id": run_trace_id(run_id),
            "trace_href": trace_link.link(run_id) if trace_link is not None else None,
            "temporal_href": temporal_link.link(run_id) if temporal_link is not None else None,
            "timeline": timeline(view),
            "timeline_width": WIDTH,
            "edits": edits(view),
            "sections": Markup(_html.sections(view)),
            "proposal": proposal,
            "proposed_arguments": _arguments_text(proposal),
            "doubt": doubt,
            "doubt_is_model_call": doubt is not None and doubt.intent.kind.value == "model_call",
            "doubt_arguments": json.dumps(doubt.arguments, ensure_ascii=False) if doubt else "",
            "cancellable": view.status.state is not RunState.FINISHED and asked is None,
            "cancel_asked": asked,
            # The cancel names what the page shows the run waiting on, as the answers do.
            "cancel_result_id": _waiting_id(view, doubt),
            "live_state": _live_state(view, doubt) + (" cancel" if asked is not None else ""),
            "position": view.records,
        }

    async def _cancel_asked(self, view: RunView, requested: bool) -> CancelRequest | None:
        """The cancel request of a run that has not ended yet: its writer ends it soon."""
        if not requested or view.status.state is RunState.FINISHED:
            return None
        return await self.store.read_cancel(view.status.run_id)

    async def run_events(self, request: Request) -> Response:
        """The run's records after the position the page shows, one event each, with the
        position as the event's id: a browser that reconnects (a reload, a dropped
        connection, a restarted server) sends the last one back as ``Last-Event-ID``."""
        after = _position(request)
        if after is None:
            return PlainTextResponse("the position is a whole number\n", status_code=400)
        return _record_events(follow(self.store, _run_id(request), after=after))

    async def _changes(
        self, request: Request, look: Callable[[], Awaitable[Hashable]]
    ) -> AsyncIterator[None]:
        """Once when what ``look`` sees differs from the page's version, then once per
        change it sees, checking every ``poll_s`` seconds until the browser goes away."""
        seen = request.query_params.get("v")
        while True:
            now = version(await look())
            if now != seen:
                if seen is not None:
                    yield None
                seen = now
            await anyio.sleep(self.settings.poll_s)

    # -- answers ---------------------------------------------------------------------------

    async def approve(self, request: Request) -> Response:
        async def answer(run_id: str, form: FormData, by: str) -> str:
            arguments = await self._edited_arguments(run_id, form)
            result_id = answered_id(form)
            await approve(self.store, run_id, by=by, arguments=arguments, result_id=result_id)
            return "approved"

        return await self._answer(request, answer)

    async def reject(self, request: Request) -> Response:
        async def answer(run_id: str, form: FormData, by: str) -> str:
            reason = form_text(form, "reason").strip()
            if not reason:
                raise Refused(400, "a rejection needs a reason: the model is told it")
            await reject(self.store, run_id, by=by, reason=reason, result_id=answered_id(form))
            return "rejected"

        return await self._answer(request, answer)

    async def settle(self, request: Request) -> Response:
        async def answer(run_id: str, form: FormData, by: str) -> str:
            outcome = form_text(form, "outcome")
            if outcome not in ("ran", "did_not_run"):
                raise Refused(400, "say whether it ran or did not run")
            observation = form_text(form, "observation")
            if not observation.strip():
                what = "what it gave" if outcome == "ran" else "why it did not run"
                raise Refused(400, f"a settlement needs {what}")
            await settle(
                self.store,
                run_id,
                by=by,
                ran=outcome == "ran",
                observation=observation,
                result_id=answered_id(form),
            )
            return "settled"

        return await self._answer(request, answer)

    async def cancel(self, request: Request) -> Response:
        async def answer(run_id: str, form: FormData, by: str) -> str:
            reason = form_text(form, "cancel_reason").strip()
            if not reason:
                raise Refused(400, "a cancel needs a reason: it is recorded with the run's end")
            status = await cancel(
                self.store, run_id, by=by, reason=reason, result_id=answered_id(form)
            )
            if status.state is not RunState.FINISHED:
                return "cancel_requested"
            if status.stop_reason is StopReason.CANCELLED_BY_REQUEST:
                return "cancelled"
            return "already_finished"

        return await self._answer(request, answer)

    async def _answer(
        self, request: Request, answer: Callable[[str, FormData, str], Awaitable[str]]
    ) -> Response:
        if self.settings.access.read_only:
            return PlainTextResponse(
                "this console is read-only\n", status_code=405, headers={"Allow": "GET"}
            )
        run_id = _run_id(request)
        try:
            form = await checked_form(request)
        except Refused as refused:  # not from our page: say so, and nothing more
            return PlainTextResponse(refused.message + "\n", status_code=refused.status)
        try:
            done = await answer(run_id, form, self._by(request, form))
        except Refused as refused:
            return await self.run_page(
                request, error=refused.message, status=refused.status, form=form
            )
        except PolyLoopError as exc:
            status = _REFUSED_STATUS.get(type(exc))
            if status is None:
                raise
            error = await self._moved_on(run_id, form, exc) or _refusal_text(exc)
            return await self.run_page(request, error=error, status=status, form=form)
        return RedirectResponse(f"{run_path(run_id)}?done={done}", status_code=303)

    def _by(self, request: Request, form: FormData) -> str:
        user = context(request).user
        if user is not None:
            return user  # the authenticating proxy named the person
        by = form_text(form, "by").strip()
        if not by:
            raise Refused(400, "say who answers: the name is recorded with the answer")
        return by

    async def _moved_on(self, run_id: str, form: FormData, exc: PolyLoopError) -> str | None:
        """Why an answer was refused, when the run moved on from what the page showed: it
        now waits on another proposal or intent. Only words: the refusal itself came from
        the check under the run's claim."""
        answered = answered_id(form)
        if answered is None or not isinstance(exc, NotAwaitingApproval | NotInDoubt):
            return None
        status = await run_status(self.store, run_id)
        waiting = status.proposal or (
            status.open_intent if status.state is RunState.IN_DOUBT else None
        )
        if waiting is None or waiting.result_id == answered:
            return None
        what = "another action" if status.proposal is not None else "another effect in doubt"
        return (
            f"Nothing was written: the page you answered showed {answered}, and the run has "
            f"moved on: it now waits on {what} ({waiting.result_id}). Read it below, then "
            f"answer again. ({exc})"
        )

    async def _edited_arguments(self, run_id: str, form: FormData) -> JSONValue:
        """The arguments the person edited, or ``None`` to run the proposal as it is.

        Read as strictly as a model's tool call: a key named twice is refused, since
        only one of its values could run. Whether the proposal is still open is checked
        by ``approve``, under the run's claim.
        """
        text = form_text(form, "arguments").strip()
        if not text:
            return None
        try:
            edited = edited_arguments(text)
        except ValueError as exc:
            raise Refused(400, f"Nothing was written: {exc}.") from None
        proposal = (await run_status(self.store, run_id)).proposal
        if proposal is None or proposal.result_id != answered_id(form):
            return edited  # approve refuses it, or checks it against the tool's schema
        payload = proposal.payload
        proposed = payload.get("arguments") if isinstance(payload, dict) else None
        return None if edited == proposed else edited

    # -- logging in ------------------------------------------------------------------------

    async def login_page(self, request: Request, error: str | None = None) -> Response:
        target = _guard.local_target(request.query_params.get("next"))
        status = 401 if error else 200
        return self.render(request, "login.html", {"next": target, "error": error}, status)

    async def login(self, request: Request) -> Response:
        token = self.settings.access.token
        if token is None:
            return RedirectResponse("/", status_code=303)
        try:
            form = await checked_form(request)
        except Refused as refused:
            return PlainTextResponse(refused.message + "\n", status_code=refused.status)
        if not _guard.same_secret(form_text(form, "token").strip(), token):
            return await self.login_page(request, error="That is not the console's token.")
        response = RedirectResponse(_guard.local_target(form_text(form, "next")), status_code=303)
        cookie = _guard.cookie_header(
            _guard.SESSION_COOKIE,
            _guard.session_value(token),
            secure=request.url.scheme == "https",
        )
        response.headers.append("set-cookie", cookie)
        return response


def _link(query: Query) -> str:
    """The list's address for ``query``, from its first page."""
    params = query.params()
    return "/?" + _query_string(params) if params else "/"


def _query_string(params: dict[str, str]) -> str:
    """``params`` as a query string; a value from a log (a tool's name) may hold a lone
    surrogate, which is percent-encoded as :func:`encoded` does, never an error."""
    return urlencode(params, quote_via=lambda text, safe, *_: encoded(text, safe=safe))


def _time_links(query: Query, now: datetime) -> list[tuple[str, str, bool]]:
    """The list's time choices, each as (words, address, chosen), keeping every other
    filter: the last hour and day, and today and yesterday in UTC (the list's times)."""
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    spans: list[tuple[str, datetime | None, datetime | None]] = [
        ("any time", None, None),
        ("last hour", now - timedelta(hours=1), None),
        ("last 24 hours", now - timedelta(days=1), None),
        ("today", today, None),
        ("yesterday", today - timedelta(days=1), today),
    ]
    links = []
    for words, after, before in spans:
        chosen = query.with_changes(started_after=after, started_before=before, unreadable=())
        same = (query.started_after, query.started_before) == (after, before)
        links.append((words, _link(chosen), same))
    return links


def _facets(query: Query, row: RunRow) -> dict[str, Any]:
    """The row's links that narrow the list to runs like it, keeping the other filters:
    one per tool it called, and, for a run that ended in doubt about an action, one to
    the runs that ended in doubt about the same tool (a run in doubt has ended so, or
    counts as such: see :func:`ended_with`)."""
    tools = [(tool, _link(query.with_changes(tool=tool))) for tool in row.tools]
    doubt = None
    if row.doubt_tool is not None:  # the run is in doubt about an action of that tool
        narrowed = query.with_changes(stop_reason=StopReason.IN_DOUBT, tool=row.doubt_tool)
        doubt = (row.doubt_tool, _link(narrowed))
    return {"tools": tools, "doubt": doubt}


def _duration_text(row: RunRow) -> str:
    """The run's duration as ``polyloop runs`` shows it; ``—`` for a run with no end yet."""
    seconds = row.duration_s
    return "—" if seconds is None else span_text(seconds)


def _arguments_text(proposal: Proposal | None) -> str:
    """The proposed arguments for the text area: sent back unchanged, they read as the
    proposal's own, whatever characters they hold."""
    if proposal is None or not isinstance(proposal.payload, dict):
        return ""
    return editable_json(proposal.payload.get("arguments"), indent=2)


def _live_state(view: RunView, doubt: Doubt | None) -> str:
    """What the forms on a run page depend on: a change reloads the page."""
    return f"{view.status.state.value} {_waiting_id(view, doubt) or ''}".strip()


def _waiting_id(view: RunView, doubt: Doubt | None) -> str | None:
    """The result id of the proposal or the effect in doubt the run waits on, if any."""
    if doubt is not None and view.status.state is RunState.IN_DOUBT:
        return doubt.intent.result_id
    return view.status.proposal.result_id if view.status.proposal is not None else None


def _entered(form: FormData | None) -> dict[str, str]:
    """What the person typed, kept when a refused answer shows the page again."""
    if form is None:
        return {}
    names = ("by", "arguments", "reason", "observation", "cancel_reason")
    return {name: form_text(form, name) for name in names}


def _refusal_text(exc: PolyLoopError) -> str:
    if isinstance(exc, RunLocked):
        return (
            f"Nothing was written: someone else holds the run right now (a worker resuming "
            f"it, or another person answering). Look again in a moment. ({exc})"
        )
    if isinstance(exc, NotAwaitingApproval | NotInDoubt):
        return f"Nothing was written: the run was already answered, see below. ({exc})"
    return f"Nothing was written: {exc}"
