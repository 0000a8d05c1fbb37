"""What the web console shows of values from a log that could deceive or break a page:
bidirectional and control characters, lone surrogates, and run ids that are not plain
path segments. Each value is shown as the terminal shows it, every page still opens, and
an answer given from the page answers exactly what the page showed."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from html import unescape
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urljoin, urlsplit

import anyio.lowlevel
import httpx
import pytest

from kit import surrogate as surrogate_kit
from kit.agent import ANSWER_SCHEMA, Ledger, answer, definition, make_tools, request, tool_call
from kit.console import BASE_URL, CONSOLE_KINDS, browser, console, post_form, store_factory
from kit.review import reviews
from kit.surrogate import HALF, SHOWN
from polyloop import Replay, ToolRegistry, ToolSpec, approve, run, start_or_resume
from polyloop._escaping import escape_block, escape_field
from polyloop.cli._console import run_path
from polyloop.cli._people import pending_line
from polyloop.ports import ManagedStore
from polyloop.session import run_status
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.types import Proposal, Settlement, StepRecord, Verdict

pytestmark = pytest.mark.anyio

# What no page may hold raw: C0 controls but newline and tab, DEL, C1 controls, the
# bidirectional formatting characters, line and paragraph separators, lone surrogates.
RAW = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
    "\u2028\u2029\ud800-\udfff]"
)
# A command that reads differently once reordered, with a line of its own and half an emoji.
TRICKY = f"rm -rf /\u202e txt.exe\u2066 \u2069\x1b[2J \x7f\x85 a\u2028b\u061c\u200f {HALF} end"
TRICKY_RUN = f"ops\u202etxt.exe\x1b[31m\nok {HALF}"
DESCRIPTION = f"Send a message\u202e to anyone.\x07 {HALF}"
# Run ids a browser would read as something else in a path: dot segments, a path, an
# escape, a query, a fragment, spaces and half an emoji.
ODD_IDS = (".", "..", "a/b", "%2F", "?x", "#y", "a b", "...", f"x{HALF}", "a/../b")


@pytest.fixture(params=CONSOLE_KINDS)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ManagedStore]:
    return store_factory(request, tmp_path)


@pytest.fixture
async def store(reopen: Callable[[], ManagedStore]) -> AsyncIterator[ManagedStore]:
    async with reopen() as opened:
        yield opened


def tricky_tools(ledger: Ledger, sent: list[Any]) -> ToolRegistry:
    """``send``, which needs approval and gives back what it sent (as its observation);
    ``wire``, never replayed; with ``double`` and ``submit``."""

    async def send(arguments: dict[str, Any], *, result_id: str) -> str:
        ledger.calls.append(("send", result_id))
        sent.append(arguments)
        await anyio.lowlevel.checkpoint()
        return str(arguments["answer"])

    tools = make_tools(ledger)
    kept = [known for name in tools.names if (known := tools.get(name)) is not None]
    extra = [
        ToolSpec(
            name="send",
            description=DESCRIPTION,
            parameters=ANSWER_SCHEMA,
            handler=send,
            needs_approval=True,
        ),
        ToolSpec(name="wire", description=DESCRIPTION, parameters=ANSWER_SCHEMA, handler=send),
    ]
    return ToolRegistry([*kept, *extra], max_observation_chars=10_000)


def raw_call(name: str, text: str) -> str:
    """A reply calling ``name`` whose JSON holds ``text`` as it is, not as escapes."""
    return json.dumps({"tool": name, "arguments": {"answer": text}}, ensure_ascii=False)


def send_script() -> list[str]:
    return [raw_call("send", TRICKY), answer("done")]


async def propose(store: ManagedStore, run_id: str) -> None:
    """A run that waits for approval of ``send`` with :data:`TRICKY`."""
    tools = tricky_tools(Ledger(), [])
    await run(definition(store, script=send_script()), request(run_id, tools))


async def wire_in_doubt(store: ManagedStore, run_id: str) -> None:
    """A run whose ``wire`` with :data:`TRICKY` was announced when its process died."""
    script = [tool_call("double", n=1), raw_call("wire", TRICKY), answer("done")]
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=8), script=script),
            request(run_id, tricky_tools(Ledger(), []), model_replay=Replay.ALLOWED),
        )
    await start_or_resume(
        definition(store, script=script),
        request(run_id, tricky_tools(Ledger(), []), model_replay=Replay.ALLOWED),
    )


def assert_nothing_raw(text: str) -> None:
    found = RAW.search(text)
    assert found is None, f"{found.group()!r} shown raw at {found.start()}"


def one(pattern: str, html: str) -> str:
    """The one match of ``pattern``'s group in ``html``, as a browser reads it."""
    found = re.findall(pattern, html, flags=re.DOTALL)
    assert len(found) == 1, found
    return unescape(found[0])


def links(html: str) -> dict[str, str]:
    """The list's rows: the run id as shown, and its link."""
    found = re.findall(r'<td class="id"><a href="([^"]*)">(.*?)</a></td>', html)
    return {unescape(shown): unescape(href) for href, shown in found}


def text_area(html: str) -> str:
    """What the arguments' text area holds once a browser parsed it (the newline right
    after the tag is not part of it)."""
    return one(r'<textarea id="arguments"[^>]*>(.*?)</textarea>', html).removeprefix("\n")


def hidden_result_id(html: str, form: str) -> str:
    form_html = one(rf'(<form[^>]*id="{form}".*?</form>)', html)
    return one(r'name="result_id" value="([^"]*)"', form_html)


def form_action(html: str, form: str) -> str:
    return one(rf'<form[^>]*id="{form}"[^>]*action="([^"]*)"', html)


def browser_join(page_url: str, href: str) -> str:
    """Where a browser goes from ``page_url`` following ``href``: an RFC 3986 join, and
    no segment a WHATWG browser would also read as ``.`` or ``..`` (``%2e`` included)."""
    joined = urljoin(page_url, href)
    for segment in urlsplit(joined).path.split("/"):
        assert segment.lower().replace("%2e", ".") not in (".", ".."), joined
    return joined


async def follow(client: httpx.AsyncClient, page_url: str, href: str) -> httpx.Response:
    """Open ``href`` as a browser on ``page_url`` would, and check it is the page the
    test client reaches with ``href`` as it is."""
    joined = browser_join(page_url, href)
    assert joined == urljoin(BASE_URL, href), (page_url, href, joined)
    return await client.get(joined)


# -- bidirectional and control characters --------------------------------------------------


async def test_every_value_from_a_log_is_shown_as_the_terminal_shows_it(
    store: ManagedStore,
) -> None:
    await propose(store, TRICKY_RUN)
    status = await run_status(store, TRICKY_RUN)
    proposal = status.proposal
    assert proposal is not None
    async with browser(console(store)) as client:
        listed = await client.get("/")
        assert listed.status_code == 200
        assert_nothing_raw(listed.text)
        [(shown, href)] = links(listed.text).items()
        assert shown == escape_field(TRICKY_RUN)
        page = await follow(client, f"{BASE_URL}/", href)
        partial = await client.get(href + "/partial")
    assert page.status_code == 200 and partial.status_code == 200
    assert_nothing_raw(page.text)
    assert_nothing_raw(partial.text)
    shown_id = escape_field(TRICKY_RUN)
    assert one(r"<title>(.*?)</title>", page.text) == f"run {shown_id} · polyloop console"
    assert one(r"<h1>(.*?)</h1>", page.text) == f"run {shown_id}"
    box = one(r'(<section id="waiting">.*?</section>)', page.text)
    assert one(r"<pre>(.*?)</pre>", box) == escape_field(proposal.action_text)
    assert one(r"<dt>tool</dt><dd>(.*?)</dd>", box) == escape_field(DESCRIPTION)
    assert one(r"<dt>result id</dt><dd>(.*?)</dd>", box) == escape_field(proposal.result_id)
    # What `polyloop pending` says of the same proposal is on the page as it says it.
    for said in (shown_id, escape_field(proposal.result_id), escape_field(DESCRIPTION)):
        assert said in pending_line(status) and said in unescape(page.text)


async def test_the_arguments_text_area_approves_exactly_what_was_proposed(
    store: ManagedStore,
) -> None:
    await propose(store, TRICKY_RUN)
    proposal = (await run_status(store, TRICKY_RUN)).proposal
    assert proposal is not None and isinstance(proposal.payload, dict)
    async with browser(console(store)) as client:
        page = await client.get(run_path(TRICKY_RUN))
        area = text_area(page.text)
        assert_nothing_raw(area)
        # JSON escapes in place of what may not be shown: the same value once read.
        assert json.loads(area) == proposal.payload["arguments"] == {"answer": TRICKY}
        fields = {
            "by": "alice",
            "arguments": area.replace("\n", "\r\n"),  # as a browser sends a text area
            "result_id": hidden_result_id(page.text, "approve"),
        }
        action = form_action(page.text, "approve")
        sent = await post_form(client, browser_join(str(page.url), action), fields)
        assert sent.status_code == 303, sent.text
        done = await follow(client, str(page.url), sent.headers["location"])
    assert "Approved." in done.text
    [_, verdict] = reviews(await store.read_log(TRICKY_RUN))
    assert isinstance(verdict, Verdict) and verdict.approved
    assert verdict.payload == proposal.payload
    ran: list[Any] = []
    await start_or_resume(
        definition(store, script=send_script()),
        request(TRICKY_RUN, tricky_tools(Ledger(), ran)),
    )
    assert ran == [{"answer": TRICKY}]
    steps = [r for r in (await store.read_log(TRICKY_RUN)).records if isinstance(r, StepRecord)]
    assert steps[0].edited_by is None and steps[0].observation == TRICKY
    async with browser(console(store)) as client:
        finished = await client.get(run_path(TRICKY_RUN))
    assert_nothing_raw(finished.text)
    # The observation and the model's reply, as `polyloop show` writes them.
    assert escape_block(TRICKY) in unescape(finished.text)
    assert escape_block(raw_call("send", TRICKY)) in unescape(finished.text)


async def test_a_settlement_from_the_page_answers_the_action_shown(store: ManagedStore) -> None:
    await wire_in_doubt(store, TRICKY_RUN)
    async with browser(console(store)) as client:
        page = await client.get(run_path(TRICKY_RUN))
        assert page.status_code == 200
        assert_nothing_raw(page.text)
        box = one(r'(<section id="waiting">.*?</section>)', page.text)
        assert escape_field(json.dumps({"answer": TRICKY}, ensure_ascii=False)) in unescape(box)
        fields = {
            "by": "carol\u202e",
            "outcome": "ran",
            "observation": "sent, checked",
            "result_id": hidden_result_id(page.text, "settle"),
        }
        sent = await post_form(client, form_action(page.text, "settle"), fields)
        assert sent.status_code == 303, sent.text
        done = await client.get(sent.headers["location"])
    assert "Settled." in done.text
    assert_nothing_raw(done.text)
    [settlement] = reviews(await store.read_log(TRICKY_RUN))
    assert isinstance(settlement, Settlement)
    assert settlement.result_id == f"{TRICKY_RUN}:1:action" and settlement.ran


# -- lone surrogates ---------------------------------------------------------------------


async def test_a_run_id_holding_a_lone_surrogate_keeps_the_list_and_its_page(
    reopen: Callable[[], ManagedStore],
) -> None:
    await surrogate_kit.fill(reopen())
    async with reopen() as store, browser(console(store)) as client:
        listed = await client.get("/")
        assert listed.status_code == 200
        shown = links(listed.text)
        assert set(shown) == {"half", "ask", surrogate_kit.RUN_ID.replace(HALF, SHOWN)}
        page = await follow(client, f"{BASE_URL}/", shown[f"id {SHOWN}"])
        answered = await client.get("/runs/half")
        # What the live pages fetch again when the store changes.
        live_list = await client.get("/partials/runs")
        live_run = await client.get(shown[f"id {SHOWN}"] + "/partial")
    assert live_list.status_code == 200 and set(links(live_list.text)) == set(shown)
    assert live_run.status_code == 200 and f"id {SHOWN}" in live_run.text
    assert page.status_code == 200
    assert one(r"<h1>(.*?)</h1>", page.text) == f"run id {SHOWN}"
    assert answered.status_code == 200 and f"done {SHOWN}" in answered.text


async def test_a_proposal_holding_a_lone_surrogate_is_approved_from_the_page(
    reopen: Callable[[], ManagedStore],
) -> None:
    await surrogate_kit.fill(reopen())
    async with reopen() as store, browser(console(store)) as client:
        proposal = (await run_status(store, "ask")).proposal
        assert proposal is not None
        page = await client.get("/runs/ask")
        assert page.status_code == 200
        assert f"hi {SHOWN}" in text_area(page.text)
        fields = {
            "by": "alice",
            "arguments": text_area(page.text),
            "result_id": hidden_result_id(page.text, "approve"),
        }
        sent = await post_form(client, form_action(page.text, "approve"), fields)
        assert sent.status_code == 303, sent.text
        [_, verdict] = reviews(await store.read_log("ask"))
    assert isinstance(verdict, Verdict) and verdict.payload == proposal.payload


# -- run ids that are not plain path segments --------------------------------------------


@pytest.mark.parametrize("run_id", ODD_IDS)
async def test_every_run_id_has_a_page_its_link_reaches_and_answers_from(
    store: ManagedStore, run_id: str
) -> None:
    await propose(store, run_id)
    async with browser(console(store)) as client:
        listed = await client.get("/")
        href = links(listed.text)[escape_field(run_id)]
        assert href == run_path(run_id)
        page = await follow(client, f"{BASE_URL}/?state=all", href)
        assert page.status_code == 200
        assert one(r"<h1>(.*?)</h1>", page.text) == f"run {escape_field(run_id)}"
        for part in ("partial", "events"):
            assert one(rf'data-{part}="([^"]*)"', page.text) == f"{href}/{part}"
        fields = {"by": "alice", "result_id": hidden_result_id(page.text, "approve")}
        action = form_action(page.text, "approve")
        sent = await post_form(client, browser_join(str(page.url), action), fields)
        assert sent.status_code == 303, sent.text
        assert sent.headers["location"] == f"{href}?done=approved"
        done = await follow(client, str(page.url), sent.headers["location"])
    assert "Approved." in done.text
    [proposal, verdict] = reviews(await store.read_log(run_id))
    assert isinstance(proposal, Proposal) and isinstance(verdict, Verdict) and verdict.approved


async def test_the_login_sends_a_person_back_to_the_run_they_asked_for(
    store: ManagedStore,
) -> None:
    token = "s3cret-token-for-the-console-0123456789"
    for run_id in ("..", "a/b"):
        await propose(store, run_id)
    for run_id in ("..", "a/b"):
        async with browser(console(store, token=token)) as client:
            asked = await client.get(run_path(run_id))
            assert asked.status_code == 303
            [target] = parse_qs(urlsplit(asked.headers["location"]).query)["next"]
            assert target == run_path(run_id)
            login = await client.get(asked.headers["location"])
            next_field = one(r'name="next" value="([^"]*)"', login.text)
            logged = await post_form(client, "/login", {"token": token, "next": next_field})
            assert logged.headers["location"] == run_path(run_id)
            page = await follow(client, f"{BASE_URL}/login", logged.headers["location"])
            assert one(r"<h1>(.*?)</h1>", page.text) == f"run {escape_field(run_id)}"


async def test_a_path_that_is_not_utf_8_names_no_run(store: ManagedStore) -> None:
    await propose(store, "paused")
    async with browser(console(store)) as client:
        missing = await client.get("/runs/%25FF")
        answered = await post_form(client, "/runs/%25FF/approve", {"by": "alice"})
        stale = await post_form(
            client, run_path("paused") + "/approve", {"by": "alice", "result_id": "%FF"}
        )
    assert missing.status_code == 404 and "no record of the run" in missing.text
    assert answered.status_code == 404
    assert stale.status_code == 409
    assert [type(r) for r in reviews(await store.read_log("paused"))] == [Proposal]


def test_a_run_path_is_one_segment_that_reads_back_to_the_run_id() -> None:
    for run_id in (*ODD_IDS, TRICKY_RUN, "%252E", ".%2e"):
        path = run_path(run_id)
        [segment] = path.removeprefix("/runs/").split("/")
        assert segment.isascii() and segment.lower().replace("%2e", ".") not in (".", "..")
        # A server decodes the path once before routing; the console decodes the rest.
        assert unquote(unquote(segment), errors="surrogatepass") == run_id


async def test_what_a_search_asked_is_echoed_as_the_terminal_shows_it(
    store: ManagedStore,
) -> None:
    await wire_in_doubt(store, TRICKY_RUN)
    markup = '"><script>alert(5)</script>'
    asked = {
        # An address holds UTF-8: half an emoji cannot be asked for.
        "q": f"{TRICKY.replace(HALF, '')}{markup}",
        "tool": f"wire{markup}\u202e",
        "model": f"{markup}\x1b",
        "started_after": f"{markup}\u2066",
    }
    async with browser(console(store)) as client:
        page = await client.get("/", params=asked)
        found = await client.get("/", params={"q": "ops", "tool": "wire"})
    assert page.status_code == 200
    assert_nothing_raw(page.text)
    assert "<script>alert(5)" not in page.text
    for name in ("q", "tool", "model"):
        value = one(rf'name="{name}" value="([^"]*)"', page.text)
        assert unescape(value) == escape_field(asked[name].strip())
    refused = one(r"Not a time, so not applied: <code>(.*?)</code>", page.text)
    assert unescape(refused) == escape_field(asked["started_after"])
    # The run in doubt is found, its tool and the doubt shown as the terminal shows them.
    assert_nothing_raw(found.text)
    assert [escape_field(TRICKY_RUN)] == list(links(found.text))
    assert '<a class="facet doubt"' in found.text and "in doubt about wire</a>" in found.text


async def test_edited_arguments_beside_the_proposed_ones_are_shown_as_the_terminal_shows_them(
    store: ManagedStore,
) -> None:
    await propose(store, TRICKY_RUN)
    edited = {"answer": f"{TRICKY}<b>x</b>", f"note\u202e{HALF}": "<i>y</i>"}
    await approve(store, TRICKY_RUN, by="ann\u202e<b>", arguments=edited, result_id=None)
    async with browser(console(store)) as client:
        page = await client.get(run_path(TRICKY_RUN))
    assert page.status_code == 200
    assert_nothing_raw(page.text)
    found = re.search(r'<section id="edits">.*?</section>', page.text, re.DOTALL)
    assert found is not None
    box = found.group()
    assert "<b>" not in box and "<i>" not in box
    proposed, approved = re.findall(r"<pre>(.*?)</pre>", box, re.S)
    # The JSON shown reads back as the arguments themselves, every character escaped.
    assert json.loads(unescape(proposed)) == {"answer": TRICKY}
    assert json.loads(unescape(approved)) == edited
    changed = re.findall(r"<code>(.*?)</code>", box)
    assert [unescape(key) for key in changed] == ["answer", escape_field(f"note\u202e{HALF}")]
    shown_by = escape_field("ann\u202e")
    assert f"approved by <strong>{shown_by}&lt;b&gt;</strong>" in box
