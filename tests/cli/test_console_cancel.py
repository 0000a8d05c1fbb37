"""The console's Cancel button: offered on every run that has not finished, naming what
the page shows the run waiting on, with the same safety rules as the other answers
(the form's CSRF token, read-only consoles, a refusal that writes nothing, values from
the log and from people escaped)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from kit.console import browser, console, fill, post_form, resume, store_factory
from kit.review import approval_script
from kit.store import sampled
from polyloop import CancelRequest, RunEnded, RunState, StopReason, run_status
from polyloop.cli._console import run_path
from polyloop.ports import ManagedStore
from polyloop.stores import MemoryStore

pytestmark = pytest.mark.anyio

WHY = "wrong customer"
# A reason that reads differently once its bidirectional override is applied.
TRICKY = "stop\u202e gnirts \x1b[2J now"


@pytest.fixture(params=sampled(("memory", "sqlite", "postgresql")))
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ManagedStore]:
    if request.param == "memory":
        memory = MemoryStore()
        return lambda: memory
    return store_factory(request, tmp_path)


@pytest.fixture
async def store(reopen: Callable[[], ManagedStore]) -> AsyncIterator[ManagedStore]:
    async with reopen() as opened:
        await fill(opened)
        yield opened


def _cancel_form(html: str) -> str | None:
    found = re.findall(r'(<form[^>]*id="cancel".*?</form>)', html, flags=re.DOTALL)
    assert len(found) <= 1
    return found[0] if found else None


def _result_id(form: str) -> str | None:
    found = re.findall(r'name="result_id" value="([^"]*)"', form)
    return unescape(found[0]) if found else None


async def _end(store: ManagedStore, run_id: str) -> Any:
    return (await store.read_log(run_id)).records[-1]


async def test_every_unfinished_run_offers_a_cancel_naming_what_it_waits_on(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        paused = _cancel_form((await client.get("/runs/paused")).text)
        doubt = _cancel_form((await client.get("/runs/doubt")).text)
        finished = _cancel_form((await client.get("/runs/done-1")).text)
    assert paused is not None and doubt is not None and finished is None
    assert _result_id(paused) == "paused:1:action"
    assert _result_id(doubt) == "doubt:1:action"
    assert 'name="cancel_reason"' in paused and 'action="/runs/paused/cancel"' in paused


async def test_a_cancel_from_the_page_ends_a_waiting_run_for_good(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        fields = {"by": "alice", "cancel_reason": WHY, "result_id": "paused:1:action"}
        sent = await post_form(client, "/runs/paused/cancel", fields)
        assert sent.status_code == 303
        assert sent.headers["location"] == "/runs/paused?done=cancelled"
        page = await client.get(sent.headers["location"])
    assert "Cancelled. The run ended for good" in page.text
    assert _cancel_form(page.text) is None and 'id="approve"' not in page.text
    assert "cancelled by" in page.text and "alice" in page.text
    end = await _end(store, "paused")
    assert isinstance(end, RunEnded)
    assert (end.stop_reason, end.cancelled_by, end.detail) == (
        StopReason.CANCELLED_BY_REQUEST,
        "alice",
        WHY,
    )
    ledger = await resume(store, "paused", approval_script())
    assert ledger.calls == []  # final: the next resume runs nothing


@pytest.mark.parametrize(
    ("fields", "status", "says"),
    [
        ({"by": "alice", "cancel_reason": " "}, 400, "a cancel needs a reason"),
        ({"cancel_reason": WHY}, 400, "say who answers"),
        (
            {"by": "alice", "cancel_reason": WHY, "result_id": "paused:0:action"},
            409,
            "Nothing was written",
        ),
    ],
)
async def test_a_refused_cancel_writes_nothing_and_keeps_what_was_typed(
    store: ManagedStore, fields: dict[str, str], status: int, says: str
) -> None:
    before = await store.read_log("paused")
    async with browser(console(store)) as client:
        refused = await post_form(client, "/runs/paused/cancel", fields)
    assert refused.status_code == status
    assert says in refused.text
    if fields.get("cancel_reason", "").strip():
        assert f'value="{WHY}"' in refused.text
    assert await store.read_log("paused") == before
    assert await store.read_cancel("paused") is None


async def test_a_cancel_without_the_forms_token_or_on_a_read_only_console_is_refused(
    store: ManagedStore,
) -> None:
    fields = {"by": "alice", "cancel_reason": WHY}
    async with browser(console(store)) as client:
        forged = await post_form(client, "/runs/paused/cancel", fields, csrf=False)
    async with browser(console(store, read_only=True)) as client:
        page = await client.get("/runs/paused")
        read_only = await post_form(client, "/runs/paused/cancel", fields)
    assert forged.status_code == 403
    assert _cancel_form(page.text) is None
    assert read_only.status_code == 405
    assert await store.read_cancel("paused") is None
    assert (await run_status(store, "paused")).state is RunState.AWAITING_APPROVAL


async def test_a_run_with_a_request_shows_it_escaped_and_refuses_answers(
    store: ManagedStore,
) -> None:
    # Kept while its writer held the run: the writer ends it before its next effect.
    await store.request_cancel(CancelRequest(run_id="paused", by="bob\u202e", reason=TRICKY))
    async with browser(console(store)) as client:
        page = await client.get(run_path("paused"))
        approved = await post_form(client, "/runs/paused/approve", {"by": "alice"})
    assert "\u202e" not in page.text and "\x1b" not in page.text
    notice = re.findall(r'<p class="notice" id="cancel-requested">(.*?)</p>', page.text)
    assert len(notice) == 1
    assert "\\u202e" in unescape(notice[0]) and "\\x1b" in unescape(notice[0])
    assert _cancel_form(page.text) is None
    assert approved.status_code == 409
    assert "asked for the run to be cancelled" in unescape(approved.text)
