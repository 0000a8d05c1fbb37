"""The web console (``polyloop serve``) through its HTTP interface, on SQLite and
PostgreSQL stores filled with real runs: the list, a run's page, the answers a person
gives, the live updates, and every safety rule."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from html import unescape
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import httpx
import pytest

from kit.agent import Ledger, definition, request
from kit.console import (
    CONSOLE_KINDS,
    EVIL,
    EVIL_RUN,
    FINISHED,
    browser,
    console,
    crash_in_doubt,
    fill,
    fill_deploys,
    post_form,
    resume,
    store_factory,
)
from kit.review import (
    approval_script,
    deploy_twice_script,
    pay_twice_script,
    payment_script,
    review_tools,
    reviews,
)
from polyloop import (
    Amendment,
    Replay,
    approve,
    reject,
    run,
    run_status,
    run_trace_id,
    settle,
    start_or_resume,
)
from polyloop.cli import _html, main
from polyloop.cli._console import LinkTemplate, exposure_problem, run_path
from polyloop.cli._console._guard import Access
from polyloop.cli._facts import step_time_text
from polyloop.cli._stores import parse_store
from polyloop.cli._view import read_view, span_text
from polyloop.ports import ManagedStore
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.types import Proposal, RunState, Settlement, StepRecord, Verdict

pytestmark = pytest.mark.anyio


@pytest.fixture(params=CONSOLE_KINDS)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ManagedStore]:
    return store_factory(request, tmp_path)


@pytest.fixture(scope="module")
def filled_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of :func:`fill` in a SQLite store, written once for the module (a fill
    crashes a run and resumes it); each test on SQLite gets a copy of its own."""
    place = tmp_path_factory.mktemp("filled")

    async def write() -> None:
        async with SqliteStore(place / "runs.db") as store:
            await fill(store)

    anyio.run(write)
    return place


@pytest.fixture
async def store(
    reopen: Callable[[], ManagedStore],
    filled_sqlite: Path,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> AsyncIterator[ManagedStore]:
    if request.node.callspec.params["reopen"] == "sqlite":
        shutil.copytree(filled_sqlite, tmp_path, dirs_exist_ok=True)
        async with reopen() as opened:
            yield opened
        return
    async with reopen() as opened:
        await fill(opened)
        yield opened


async def _answers(store: ManagedStore, run_id: str) -> list[Any]:
    """The verdicts and settlements of the run: what people answered."""
    return [r for r in reviews(await store.read_log(run_id)) if not isinstance(r, Proposal)]


def _rows(html: str) -> list[str]:
    """The run ids of the list's rows, in order."""
    found = re.findall(r'<td class="id"><a href="[^"]*">(.*?)</a></td>', html)
    return [unescape(run_id) for run_id in found]


# -- the list ------------------------------------------------------------------------------


async def test_the_list_shows_every_run_with_its_state(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/")
    assert page.status_code == 200
    assert sorted(_rows(page.text)) == sorted(["paused", "doubt", EVIL_RUN, *FINISHED])
    # Most recent record first: the in-doubt run was written last.
    assert _rows(page.text)[0] == "doubt"
    assert '<span class="state">awaiting approval</span>' in page.text
    assert '<span class="state">in doubt</span>' in page.text
    assert '<span class="state">finished</span> (final_answer)' in page.text


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("awaiting approval", ["paused"]),
        ("in doubt", ["doubt"]),
        ("unfinished", ["doubt", "paused"]),
        ("finished", sorted([EVIL_RUN, *FINISHED])),
        ("running", []),
        ("resumable", []),
    ],
)
async def test_the_list_filters_by_state(
    store: ManagedStore, state: str, expected: list[str]
) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/", params={"state": state})
    assert sorted(_rows(page.text)) == expected


async def test_the_list_is_paginated_most_recent_first(store: ManagedStore) -> None:
    """The older and newer links walk the list by cursor, down and back up."""
    async with browser(console(store, per_page=2)) as client:
        pages = [await client.get("/")]
        while links := re.findall(r'rel="next" href="([^"]*)"', pages[-1].text):
            pages.append(await client.get(unescape(links[0])))
        back = [pages[-1]]
        while links := re.findall(r'rel="prev" href="([^"]*)"', back[-1].text):
            back.append(await client.get(unescape(links[0])))
        wrong = await client.get("/", params={"after": "no cursor"})
        numbered = await client.get("/", params={"page": 3})  # an address of before
    shown = [_rows(page.text) for page in pages]
    assert [len(rows) for rows in shown] == [2, 2, 2]
    everything = shown[0] + shown[1] + shown[2]
    assert sorted(everything) == sorted(["paused", "doubt", EVIL_RUN, *FINISHED])
    listed = {run.run_id: run.updated_at for run in await store.list_runs()}
    times = [listed[run_id] for run_id in everything]
    assert times == sorted(times, reverse=True)
    assert 'rel="next"' in pages[0].text and 'rel="prev"' not in pages[0].text
    assert [_rows(page.text) for page in back] == shown[::-1]
    assert _rows(wrong.text) == shown[0] == _rows(numbered.text)  # no cursor: the first page


# -- one run -------------------------------------------------------------------------------


async def test_the_run_page_shows_the_proposal_first_and_what_show_shows(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/runs/paused")
    assert page.status_code == 200
    text = page.text
    assert text.index("Waits for approval") < text.index('id="summary"')
    assert "Deploy the build to an environment." in text
    # The run's facts are the very sections polyloop show --html writes.
    view = await read_view(store, parse_store("sqlite:unused"), "paused")
    assert _html.sections(view) in text
    assert 'id="approve"' in text and 'id="reject"' in text and 'id="settle"' not in text


async def test_the_run_page_shows_an_amendment_with_its_author_and_reason(
    store: ManagedStore,
) -> None:
    amend = Amendment(by="ops <release 2.4>", reason="a clearer deploy text", accept=("tools",))
    deployed = review_tools(Ledger(), descriptions={"deploy": "Deploy; prod needs a ticket."})
    await start_or_resume(
        definition(store, script=approval_script()), request("paused", deployed), amend=amend
    )
    async with browser(console(store)) as client:
        page = await client.get("/runs/paused")
    assert page.status_code == 200
    text = unescape(page.text)
    assert "by ops <release 2.4> at " in text
    assert ": a clearer deploy text (changed tools)" in text
    assert "<release 2.4>" not in page.text  # escaped, as everything a log holds
    assert 'id="approve"' in page.text  # the run still waits for its approval


async def test_a_run_in_doubt_offers_to_settle_it(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/runs/doubt")
    text = page.text
    assert 'id="settle"' in text and 'id="approve"' not in text
    assert '<section id="in-doubt">' in text
    assert text.index('id="settle"') < text.index('id="summary"')
    assert 'name="result_id" value="doubt:1:action"' in text


async def test_an_unknown_run_is_404(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/runs/nobody")
    assert page.status_code == 404
    assert "no record of the run" in page.text


async def test_a_run_id_with_a_slash_has_a_page_of_its_own(
    reopen: Callable[[], ManagedStore],
) -> None:
    async with reopen() as store:
        await crash_in_doubt(store, "team/a#1")
        async with browser(console(store)) as client:
            listed = await client.get("/")
            assert run_path("team/a#1") in listed.text
            page = await client.get(run_path("team/a#1"))
    assert page.status_code == 200
    assert "run team/a#1" in page.text


# -- answers -------------------------------------------------------------------------------


async def test_approve_then_the_next_resume_runs_the_tool_once(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        sent = await post_form(
            client, "/runs/paused/approve", {"by": "alice", "result_id": "paused:1:action"}
        )
        assert sent.status_code == 303
        assert sent.headers["location"] == "/runs/paused?done=approved"
        page = await client.get(sent.headers["location"])
    assert "Approved." in page.text
    assert "by alice at" in page.text  # who answered, and when
    [verdict] = await _answers(store, "paused")
    assert isinstance(verdict, Verdict) and verdict.approved and verdict.by == "alice"
    ledger = await resume(store, "paused", approval_script())
    assert ledger.count("paused:1:action") == 1


async def test_approve_with_edited_arguments_runs_them(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        refused = await post_form(
            client, "/runs/paused/approve", {"by": "alice", "arguments": '{"env": "moon"}'}
        )
        assert refused.status_code == 400
        assert "Nothing was written" in refused.text
        assert "moon" in refused.text  # what was typed is kept in the form
        assert await _answers(store, "paused") == []
        sent = await post_form(
            client, "/runs/paused/approve", {"by": "alice", "arguments": '{"env": "staging"}'}
        )
    assert sent.status_code == 303
    await resume(store, "paused", approval_script())
    steps = [r for r in (await store.read_log("paused")).records if isinstance(r, StepRecord)]
    assert steps[1].observation == "deployed to staging"
    assert steps[1].edited_by == "alice"


@pytest.mark.parametrize(
    ("arguments", "says"),
    [("{x", "not JSON"), ("[1]", "JSON object")],
)
async def test_edited_arguments_that_are_not_an_object_are_refused(
    store: ManagedStore, arguments: str, says: str
) -> None:
    async with browser(console(store)) as client:
        refused = await post_form(
            client, "/runs/paused/approve", {"by": "alice", "arguments": arguments}
        )
    assert refused.status_code == 400
    assert says in refused.text
    assert await _answers(store, "paused") == []


async def test_reject_needs_a_reason_and_the_tool_never_runs(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        missing = await post_form(client, "/runs/paused/reject", {"by": "bob", "reason": " "})
        assert missing.status_code == 400
        assert await _answers(store, "paused") == []
        sent = await post_form(
            client, "/runs/paused/reject", {"by": "bob", "reason": "not on a Friday"}
        )
        assert sent.status_code == 303
        page = await client.get(sent.headers["location"])
    assert "by bob at" in page.text and "not on a Friday" in page.text
    ledger = await resume(store, "paused", approval_script())
    assert ledger.count("paused:1:action") == 0


async def test_settle_then_the_next_resume_never_runs_the_action_again(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        vague = await post_form(client, "/runs/doubt/settle", {"by": "carol", "outcome": "ran"})
        assert vague.status_code == 400
        sent = await post_form(
            client,
            "/runs/doubt/settle",
            {
                "by": "carol",
                "outcome": "ran",
                "observation": "paid 5 (checked in the bank)",
                "result_id": "doubt:1:action",
            },
        )
        assert sent.status_code == 303
        page = await client.get(sent.headers["location"])
    assert "Settled." in page.text and "by carol (it ran)" in page.text
    [settlement] = await _answers(store, "doubt")
    assert isinstance(settlement, Settlement) and settlement.ran and settlement.by == "carol"
    ledger = await resume(store, "doubt", payment_script(), Replay.ALLOWED)
    assert ledger.count("doubt:1:action") == 0
    steps = [r for r in (await store.read_log("doubt")).records if isinstance(r, StepRecord)]
    assert steps[1].observation == "paid 5 (checked in the bank)"


async def test_settle_as_not_run(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        fields = {"by": "carol", "outcome": "did_not_run", "observation": "no such payment"}
        sent = await post_form(client, "/runs/doubt/settle", fields)
    assert sent.status_code == 303
    [settlement] = await _answers(store, "doubt")
    assert isinstance(settlement, Settlement)
    assert not settlement.ran and settlement.observation == "no such payment"


async def test_two_people_answering_at_once_get_exactly_one_verdict(
    store: ManagedStore,
) -> None:
    statuses: list[int] = []
    pages: list[str] = []
    async with browser(console(store)) as alice, browser(console(store)) as bob:

        async def answer(client: httpx.AsyncClient, path: str, fields: dict[str, str]) -> None:
            sent = await post_form(client, path, fields)
            statuses.append(sent.status_code)
            pages.append(sent.text)

        await alice.get("/")
        await bob.get("/")
        async with anyio.create_task_group() as group:
            group.start_soon(answer, alice, "/runs/paused/approve", {"by": "alice"})
            group.start_soon(answer, bob, "/runs/paused/reject", {"by": "bob", "reason": "no"})
    assert sorted(statuses) == [303, 409]
    assert any("Nothing was written" in page for page in pages)
    assert len(await _answers(store, "paused")) == 1


async def test_an_answer_to_a_proposal_the_run_left_behind_is_refused(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        stale = await post_form(
            client,
            "/runs/paused/approve",
            {"by": "alice", "result_id": "paused:0:action"},
        )
    assert stale.status_code == 409
    assert "another action" in stale.text
    assert await _answers(store, "paused") == []


async def test_an_answer_to_a_run_already_answered_says_so(store: ManagedStore) -> None:
    await approve(store, "paused", by="someone")
    async with browser(console(store)) as client:
        late = await post_form(client, "/runs/paused/reject", {"by": "bob", "reason": "no"})
        again = await post_form(
            client, "/runs/doubt/settle", {"by": "b", "outcome": "ran", "observation": "x"}
        )
        twice = await post_form(
            client, "/runs/doubt/settle", {"by": "b", "outcome": "ran", "observation": "x"}
        )
    assert late.status_code == 409 and "already answered" in late.text
    assert "by someone at" in late.text  # the page shows who did
    assert again.status_code == 303
    assert twice.status_code == 409 and "already answered" in twice.text


async def _moved_on(store: ManagedStore) -> None:
    """Bob rejects ``twice``'s deploy; its worker resumes, and the model proposes the very
    same deploy again: a page still open on the first proposal now shows a stale one."""
    await reject(store, "twice", by="bob", reason="not now")
    await resume(store, "twice", deploy_twice_script())
    assert (await run_status(store, "twice")).proposal.result_id == "twice:2:action"


@pytest.mark.parametrize(
    ("answer", "fields"),
    [
        ("approve", {}),
        ("approve", {"arguments": '{"env": "prod"}'}),
        ("approve", {"arguments": '{"env": "staging"}'}),
        ("reject", {"reason": "no"}),
    ],
)
async def test_an_answer_from_a_page_the_run_moved_on_from_is_refused(
    store: ManagedStore, answer: str, fields: dict[str, str]
) -> None:
    await run(
        definition(store, script=deploy_twice_script()), request("twice", review_tools(Ledger()))
    )
    async with browser(console(store)) as client:
        page = await client.get("/runs/twice")  # Alice opens proposal 0
        assert 'name="result_id" value="twice:1:action"' in page.text
        await _moved_on(store)
        before = await store.read_log("twice")
        late = await post_form(
            client,
            f"/runs/twice/{answer}",
            {"by": "alice", "result_id": "twice:1:action", **fields},
        )
    assert late.status_code == 409
    text = unescape(late.text)
    assert "Nothing was written" in text and "moved on" in text
    # The refusal is approve's or reject's own, from the check under the run's claim.
    assert "the open proposal is 'twice:2:action', not 'twice:1:action'" in text
    assert 'name="result_id" value="twice:2:action"' in late.text  # the new proposal
    assert await store.read_log("twice") == before
    status = await run_status(store, "twice")
    assert status.state is RunState.AWAITING_APPROVAL
    assert status.proposal.result_id == "twice:2:action"


async def _crash_paying(store: ManagedStore, writes: int) -> None:
    """Drive ``pays`` (two payments, never replayed) until ``writes`` more writes landed,
    then die; the next worker's resume ends in doubt."""
    tools = review_tools(Ledger())
    with pytest.raises(SimulatedCrash):
        await start_or_resume(
            definition(FaultyStore(store, fail_after_writes=writes), script=pay_twice_script()),
            request("pays", tools),
        )
    await store.release_run("pays")
    await resume(store, "pays", pay_twice_script())


async def test_a_settlement_from_a_page_the_run_moved_on_from_is_refused(
    store: ManagedStore,
) -> None:
    await _crash_paying(store, 8)  # the first payment's intent landed
    async with browser(console(store)) as client:
        page = await client.get("/runs/pays")
        assert 'name="result_id" value="pays:1:action"' in page.text
        await settle(store, "pays", by="bob", ran=True, observation="paid 5")
        await _crash_paying(store, 4)  # the second payment's intent landed
        before = await store.read_log("pays")
        fields = {"by": "alice", "outcome": "did_not_run", "observation": "x"}
        late = await post_form(
            client, "/runs/pays/settle", {**fields, "result_id": "pays:1:action"}
        )
    assert late.status_code == 409
    text = unescape(late.text)
    assert "moved on" in text and "another effect in doubt (pays:2:action)" in text
    assert "the effect in doubt is 'pays:2:action', not 'pays:1:action'" in text
    assert await store.read_log("pays") == before


@pytest.mark.parametrize(
    ("arguments", "key"),
    [
        ('{\n  "env": "staging",\n  "env": "prod"\n}', "env"),
        ('{"env": "staging", "extra": {"a": 1, "a": 2}}', "a"),
    ],
)
async def test_edited_arguments_naming_a_key_twice_are_refused(
    store: ManagedStore, arguments: str, key: str
) -> None:
    before = await store.read_log("paused")
    async with browser(console(store)) as client:
        fields = {"by": "alice", "arguments": arguments, "result_id": "paused:1:action"}
        refused = await post_form(client, "/runs/paused/approve", fields)
    assert refused.status_code == 400
    text = unescape(refused.text)
    assert f"the arguments name the key '{key}' twice in one object" in text
    assert "Nothing was written" in text
    assert await store.read_log("paused") == before


async def _model_call_in_doubt(store: ManagedStore) -> None:
    """``model``: its model call of step 1 (replay never) was announced when its
    process died; resumed, it ends in doubt."""
    tools = review_tools(Ledger())
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=6), script=payment_script()),
            request("model", tools),
        )
    await store.release_run("model")
    await start_or_resume(definition(store, script=payment_script()), request("model", tools))


@pytest.mark.parametrize(
    ("outcome", "ends"), [("did_not_run", "final_answer"), ("ran", "model_failure")]
)
async def test_a_model_call_in_doubt_is_settled_from_its_page(
    store: ManagedStore, outcome: str, ends: str
) -> None:
    await _model_call_in_doubt(store)
    async with browser(console(store)) as client:
        page = await client.get("/runs/model")
        assert "Settle the model call in doubt" in page.text
        assert "the run calls the model again" in page.text and "model_failure" in page.text
        assert 'name="result_id" value="model:1:model"' in page.text
        stale = {
            "by": "carol",
            "outcome": outcome,
            "observation": "x",
            "result_id": "model:0:model",
        }
        refused = await post_form(client, "/runs/model/settle", stale)
        assert refused.status_code == 409
        fields = {**stale, "result_id": "model:1:model", "observation": "checked the bill"}
        sent = await post_form(client, "/runs/model/settle", fields)
        assert sent.status_code == 303
        twice = await post_form(client, "/runs/model/settle", fields)
        assert twice.status_code == 409
    [settlement] = await _answers(store, "model")
    assert isinstance(settlement, Settlement) and settlement.ran is (outcome == "ran")
    await resume(store, "model", payment_script())
    assert (await run_status(store, "model")).stop_reason.value == ends


# -- safety --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "headers"),
    [
        ({"by": "mallory"}, {}),  # no CSRF field
        ({"by": "mallory", "csrf": "x" * 43}, {}),  # a wrong one
        ({"by": "mallory", "csrf": "{cookie}"}, {"Sec-Fetch-Site": "cross-site"}),
        ({"by": "mallory", "csrf": "{cookie}"}, {"Origin": "http://evil.test"}),
    ],
)
async def test_a_post_not_from_the_consoles_page_is_refused_and_writes_nothing(
    store: ManagedStore, fields: dict[str, str], headers: dict[str, str]
) -> None:
    async with browser(console(store)) as client:
        await client.get("/")
        cookie = client.cookies["polyloop_csrf"]
        data = {k: v.replace("{cookie}", cookie) for k, v in fields.items()}
        sent = await client.post("/runs/paused/approve", data=data, headers=headers)
        settle = await client.post(
            "/runs/doubt/settle",
            data={**data, "outcome": "ran", "observation": "x"},
            headers=headers,
        )
    assert sent.status_code == 403 and settle.status_code == 403
    assert await _answers(store, "paused") == []
    assert await _answers(store, "doubt") == []


async def test_a_post_without_the_csrf_cookie_is_refused(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        sent = await client.post("/runs/paused/approve", data={"by": "mallory", "csrf": "y" * 43})
    assert sent.status_code == 403
    assert await _answers(store, "paused") == []


async def test_read_only_shows_no_forms_and_refuses_posts(store: ManagedStore) -> None:
    async with browser(console(store, read_only=True)) as client:
        paused = await client.get("/runs/paused")
        doubt = await client.get("/runs/doubt")
        sent = await post_form(client, "/runs/paused/approve", {"by": "alice"})
        settled = await post_form(
            client, "/runs/doubt/settle", {"by": "a", "outcome": "ran", "observation": "x"}
        )
    assert "<form" not in paused.text and "<form" not in doubt.text
    assert "Waits for approval" in paused.text  # what waits is still shown
    assert sent.status_code == 405 and settled.status_code == 405
    assert await _answers(store, "paused") == [] and await _answers(store, "doubt") == []


TOKEN = "s3cret-token-for-the-console-0123456789"


async def test_with_a_token_every_request_must_carry_it(store: ManagedStore) -> None:
    app = console(store, token=TOKEN)
    async with browser(app) as client:
        page = await client.get("/runs/paused")
        assert page.status_code == 303
        assert page.headers["location"] == "/login?next=%2Fruns%2Fpaused"
        events = await client.get("/events")
        assert events.status_code == 303
        wrong = await client.get("/", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 303
        posted = await post_form(client, "/runs/paused/approve", {"by": "mallory"})
        assert posted.status_code == 401
        right = await client.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert right.status_code == 200 and "paused" in right.text
    assert await _answers(store, "paused") == []


async def test_the_login_form_sets_a_strict_session_cookie(store: ManagedStore) -> None:
    async with browser(console(store, token=TOKEN)) as client:
        form = await client.get("/login", params={"next": "/runs/paused"})
        assert form.status_code == 200 and 'name="token"' in form.text
        bad = await post_form(client, "/login", {"token": "guess", "next": "/runs/paused"})
        assert bad.status_code == 401
        assert "polyloop_session" not in client.cookies
        good = await post_form(client, "/login", {"token": TOKEN, "next": "/runs/paused"})
        assert good.status_code == 303 and good.headers["location"] == "/runs/paused"
        cookie = good.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert TOKEN not in cookie  # the cookie holds a value derived from the token
        page = await client.get("/runs/paused")
        assert page.status_code == 200
        away = await post_form(client, "/login", {"token": TOKEN, "next": "//evil.test/"})
        assert away.headers["location"] == "/"


async def test_behind_a_proxy_its_header_names_who_answers(store: ManagedStore) -> None:
    app = console(store, user_header="X-Forwarded-User")
    async with browser(app) as anonymous:
        refused = await anonymous.get("/")
        assert refused.status_code == 403
    async with browser(app, **{"X-Forwarded-User": "dana"}) as client:
        page = await client.get("/runs/paused")
        assert 'name="by"' not in page.text
        assert "Answering as <strong>dana</strong>" in page.text
        sent = await post_form(client, "/runs/paused/approve", {"by": "someone else"})
    assert sent.status_code == 303
    [verdict] = await _answers(store, "paused")
    assert verdict.by == "dana"


async def test_without_a_proxy_an_answer_needs_a_name(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        sent = await post_form(client, "/runs/paused/approve", {"by": "  "})
    assert sent.status_code == 400
    assert await _answers(store, "paused") == []


async def test_markup_from_the_log_is_shown_as_text(store: ManagedStore) -> None:
    evil_by = '<img src=x onerror="alert(1)">'
    async with browser(console(store)) as client:
        sent = await post_form(
            client,
            "/runs/doubt/settle",
            {"by": evil_by, "outcome": "ran", "observation": EVIL},
        )
        assert sent.status_code == 303
        await resume(store, "doubt", payment_script(), Replay.ALLOWED)
        pages = [
            await client.get("/"),
            await client.get(run_path(EVIL_RUN)),
            await client.get("/runs/doubt"),
        ]
    for page in pages:
        assert page.status_code == 200
        assert "<script>alert" not in page.text
        assert "<b>bold</b>" not in page.text
        assert "<img src=x" not in page.text
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in pages[0].text  # the run id
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in pages[1].text  # the answer
    assert "&lt;b&gt;bold&lt;/b&gt;" in pages[2].text  # the observation
    assert "&lt;img src=x" in pages[2].text  # who settled it


async def test_every_response_carries_a_strict_policy_and_a_fresh_nonce(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        first = await client.get("/runs/paused")
        second = await client.get("/runs/paused")
    nonces = []
    for page in (first, second):
        policy = page.headers["content-security-policy"]
        nonce = re.search(r"'nonce-([^']+)'", policy)
        assert nonce is not None
        nonces.append(nonce.group(1))
        assert f'<script nonce="{nonce.group(1)}">' in page.text
        assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
        assert "unsafe-inline" not in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["referrer-policy"] == "no-referrer"
    assert nonces[0] != nonces[1]
    cookie = first.headers["set-cookie"]
    assert "polyloop_csrf=" in cookie and "SameSite=Strict" in cookie and "HttpOnly" in cookie


# -- live updates --------------------------------------------------------------------------


async def _first_change(
    app: Any,
    path: str,
    query: str,
    change: Callable[[], Any],
    *,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    until: str = "event: changed",
) -> str:
    """Open the event stream at ``path`` as a browser does, make ``change``, and return
    what the stream sent until it sent ``until`` (by default: the page changed)."""
    to_app, from_test = anyio.create_memory_object_stream[dict[str, Any]](10)
    received: list[str] = []
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"console.test"), (b"accept", b"text/event-stream"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("console.test", 80),
    }
    changed = anyio.Event()

    async def receive() -> dict[str, Any]:
        return await from_test.receive()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            received.append(message.get("body", b"").decode())
            if until in "".join(received):
                changed.set()

    await to_app.send({"type": "http.request", "body": b"", "more_body": False})
    with anyio.fail_after(10), to_app, from_test:
        async with anyio.create_task_group() as group:
            group.start_soon(app, scope, receive, send)
            await anyio.sleep(0.1)
            await change()
            await changed.wait()
            await to_app.send({"type": "http.disconnect"})
    return "".join(received)


async def test_a_run_page_hears_when_its_run_changes(store: ManagedStore) -> None:
    app = console(store, poll_s=0.02)
    async with browser(app) as client:
        page = await client.get("/runs/paused")
    shown = re.search(r'data-after="([0-9]+)"', page.text)
    assert shown is not None
    after = int(shown.group(1))
    assert after == len((await store.read_log("paused")).records)

    async def answer() -> None:
        await approve(store, "paused", by="erin")

    # The stream follows the run from the last record the page shows: the verdict is the
    # one record after it, sent with its position as the event's id.
    sent = await _first_change(app, "/runs/paused/events", f"after={after}", answer)
    assert sent.startswith("retry: ")
    assert sent.count("event: changed") == 1
    assert f"id: {after + 1}\nevent: changed" in sent
    async with browser(app) as client:
        fresh = await client.get("/runs/paused/partial")
    assert fresh.text.startswith('<div id="live"')
    assert "by erin at" in fresh.text


async def test_a_reconnecting_page_gets_the_records_after_its_last_event_id(
    store: ManagedStore,
) -> None:
    app = console(store, poll_s=0.02)
    length = len((await store.read_log("paused")).records)

    async def nothing() -> None:
        pass

    # A browser that reconnects sends the last id it saw; that wins over the page's own.
    sent = await _first_change(
        app,
        "/runs/paused/events",
        "after=0",
        nothing,
        headers=((b"last-event-id", str(length - 2).encode()),),
        until=f"id: {length}\n",
    )
    ids = re.findall(r"^id: ([0-9]+)$", sent, re.MULTILINE)
    assert ids == [str(length - 1), str(length)]


async def test_the_stream_of_a_finished_run_tells_the_page_to_stop_asking(
    store: ManagedStore,
) -> None:
    app = console(store, poll_s=0.02)
    finished = next(run.run_id for run in await store.list_runs() if run.finished)
    length = len((await store.read_log(finished)).records)

    async def nothing() -> None:
        pass

    sent = await _first_change(
        app, f"/runs/{finished}/events", f"after={length}", nothing, until="event: ended"
    )
    assert "event: changed" not in sent


async def test_a_position_that_is_not_one_is_refused(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        refused = await client.get("/runs/paused/events", params={"after": "-1"})
    assert refused.status_code == 400


async def test_the_list_hears_when_a_run_starts(
    store: ManagedStore, reopen: Callable[[], ManagedStore]
) -> None:
    app = console(store, poll_s=0.02)
    async with browser(app) as client:
        page = await client.get("/")
    version = re.search(r'data-version="([0-9a-f]+)"', page.text)
    assert version is not None

    async def start() -> None:
        await crash_in_doubt(store, "newcomer")

    sent = await _first_change(app, "/events", f"state=all&v={version.group(1)}", start)
    assert "event: changed" in sent
    async with browser(app) as client:
        fresh = await client.get("/partials/runs")
    assert "newcomer" in _rows(fresh.text)


# -- starting it ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "access", "refused"),
    [
        ("127.0.0.1", Access(), False),
        ("localhost", Access(), False),
        ("::1", Access(), False),
        ("127.0.0.2", Access(), False),
        ("0.0.0.0", Access(), True),
        ("::", Access(), True),
        ("192.168.1.5", Access(), True),
        ("console.example.com", Access(), True),
        ("0.0.0.0", Access(token="t" * 20), False),
        ("0.0.0.0", Access(user_header="X-Forwarded-User"), False),
        ("0.0.0.0", Access(read_only=True), True),
    ],
)
def test_only_a_loopback_address_needs_no_token(host: str, access: Access, refused: bool) -> None:
    assert (exposure_problem(host, access) is not None) is refused


def test_serve_refuses_a_public_address_without_a_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POLYLOOP_CONSOLE_TOKEN", raising=False)
    store = f"sqlite:{tmp_path / 'absent.db'}"
    assert main(["serve", store, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "--token-file" in err and "POLYLOOP_CONSOLE_TOKEN" in err and "--user-header" in err


def test_serve_refuses_a_short_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POLYLOOP_CONSOLE_TOKEN", "short")
    assert main(["serve", f"sqlite:{tmp_path / 'x.db'}", "--host", "0.0.0.0"]) == 1
    assert "at least 16" in capsys.readouterr().err
    monkeypatch.delenv("POLYLOOP_CONSOLE_TOKEN")
    (tmp_path / "token").write_text("", encoding="utf-8")
    assert main(["serve", "sqlite:x.db", "--token-file", str(tmp_path / "token")]) == 1
    assert "at least 16" in capsys.readouterr().err


def test_serve_never_creates_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", f"sqlite:{tmp_path / 'absent.db'}", "--port", "0"]) == 1
    assert "no SQLite store" in capsys.readouterr().err
    assert not (tmp_path / "absent.db").exists()


async def _filled(path: Path) -> None:
    async with SqliteStore(path) as opened:
        await fill(opened)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_serve_prints_the_address_serves_and_stops_on_ctrl_c(tmp_path: Path, backend: str) -> None:
    anyio.run(_filled, tmp_path / "runs.db")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyloop",
            "--backend",
            backend,
            "serve",
            f"sqlite:{tmp_path / 'runs.db'}",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        said = [server.stdout.readline() for _ in range(2)]
        assert said[0].startswith("console for sqlite:")
        url = said[1].removeprefix("open ").strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200 and "paused" in page.text
        run_page = httpx.get(url + "runs/paused", timeout=10)
        assert "Waits for approval" in run_page.text
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=20)
    assert server.returncode == 130, err
    assert err.strip() == "polyloop: interrupted"


# -- searching and filtering the list (issue 47) ---------------------------------------------


async def test_the_runs_that_called_deploy_and_ended_in_doubt_are_one_link(
    reopen: Callable[[], ManagedStore],
) -> None:
    async with reopen() as store:
        await crash_in_doubt(store, "deploy-doubt-earlier", tool="deploy")
        await anyio.sleep(0.01)
        since = (await run_status(store, "deploy-doubt-earlier")).last_record_at
        assert since is not None
        await anyio.sleep(0.01)
        expected = await fill_deploys(store)
        after = since.isoformat()
        async with browser(console(store)) as client:
            page = await client.get(
                "/", params={"tool": "deploy", "stop_reason": "in_doubt", "started_after": after}
            )
            everything = await client.get("/", params={"tool": "deploy", "stop_reason": "in_doubt"})
    assert sorted(_rows(page.text)) == sorted(expected)
    assert sorted(_rows(everything.text)) == sorted([*expected, "deploy-doubt-earlier"])
    # The form keeps what was asked, so the next filter narrows this one.
    assert 'name="tool" value="deploy"' in page.text
    assert '<option value="in_doubt" selected>' in page.text


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"tool": "pay"}, ["doubt"]),
        ({"tool": "deploy"}, ["paused"]),  # proposed: the model called it
        ({"tool": "double"}, ["doubt", "paused"]),
        ({"stop_reason": "final_answer"}, sorted([EVIL_RUN, *FINISHED])),
        ({"stop_reason": "awaiting_approval"}, ["paused"]),
        ({"model": "SCRIPT"}, sorted(["doubt", "paused", EVIL_RUN, *FINISHED])),
        ({"model": "gpt"}, []),
        ({"q": "done-"}, list(FINISHED)),  # a part of the run id
        ({"q": "DONE-2 OK"}, ["done-2"]),  # a part of the final answer, any case
        ({"q": "paid 5"}, []),  # the payment is in doubt: it has no observation
        ({"q": "2", "tool": "double"}, ["doubt", "paused"]),  # the last observation
        ({"state": "in doubt", "tool": "deploy"}, []),
        ({"started_before": "2000-01-01"}, []),
        ({"started_after": "2000-01-01T00:00Z"}, sorted(["doubt", "paused", EVIL_RUN, *FINISHED])),
    ],
)
async def test_the_list_searches_and_filters(
    store: ManagedStore, params: dict[str, str], expected: list[str]
) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/", params=params)
    assert sorted(_rows(page.text)) == expected


async def test_a_time_that_is_no_time_is_refused_in_words_and_not_applied(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/", params={"started_after": "last tuesday", "tool": "pay"})
    assert sorted(_rows(page.text)) == ["doubt"]
    assert "Not a time, so not applied: <code>last tuesday</code>" in page.text


async def test_the_filters_stay_on_every_link_of_the_list(store: ManagedStore) -> None:
    filters = {"tool": "double", "q": "d", "started_after": "2000-01-01T00:00:00Z"}
    async with browser(console(store, per_page=1)) as client:
        page = await client.get("/", params=filters)
        live = re.search(r'data-partial="([^"]*)" data-events="([^"]*)"', page.text)
        assert live is not None
        partial, events = (unescape(found) for found in live.groups())
        older = unescape(re.findall(r'rel="next" href="([^"]*)"', page.text)[0])
        second = await client.get(older)
        fragment = await client.get(partial)
    for link in (partial, events, older):
        assert "tool=double" in link and "q=d" in link and "started_after=2000-01-01" in link
    assert _rows(page.text) + _rows(second.text) == ["doubt", "paused"]
    assert _rows(fragment.text) == _rows(page.text)
    states = re.findall(r'<nav class="filters" id="states">(.*?)</nav>', page.text, re.S)[0]
    assert "/?q=d&amp;state=in%20doubt&amp;tool=double&amp;started_after=" in states


async def test_the_list_shows_duration_and_start_of_each_run(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        page = await client.get("/", params={"q": "done-1"})
    status = await run_status(store, "done-1")
    assert status.started_at is not None and status.ended_at is not None
    seconds = (status.ended_at - status.started_at).total_seconds()
    assert f'<td class="duration">{span_text(seconds)}</td>' in page.text
    assert "<th>duration</th>" in page.text and "Cost is not shown" in page.text


async def test_yesterdays_deploys_in_doubt_are_two_clicks_from_the_list(
    reopen: Callable[[], ManagedStore],
) -> None:
    """The issue's measure: from the list, "yesterday", then a row's "in doubt about
    deploy", and the list holds exactly the runs that called deploy yesterday and ended
    in doubt (the console's clock is a day after the runs were made)."""
    async with reopen() as store:
        expected = await fill_deploys(store)
        started = (await run_status(store, expected[0])).started_at
        assert started is not None
        later = started + timedelta(days=1)
        async with browser(console(store, clock=lambda: later)) as client:
            listed = await client.get("/")
            times = one_match(r'<nav class="filters" id="times">(.*?)</nav>', listed.text)
            yesterday = await client.get(_href(times, "yesterday"))
            doubt = one_match(
                r'<a class="facet doubt" href="([^"]*)">in doubt about deploy<',
                yesterday.text,
                first=True,
            )
            narrowed = await client.get(unescape(doubt))
            # Today, for the same clock, holds none of them.
            today = await client.get(_href(times, "today"))
    assert len(_rows(yesterday.text)) == 6
    assert sorted(_rows(narrowed.text)) == sorted(expected)
    assert _rows(today.text) == []
    # The list that results is a link a person can share: every filter is in it.
    assert "stop_reason=in_doubt" in doubt and "tool=deploy" in doubt
    assert "started_after=" in doubt and "started_before=" in doubt


def one_match(pattern: str, html: str, *, first: bool = False) -> str:
    found = re.findall(pattern, html, re.S)
    assert found and (first or len(found) == 1), found
    return str(found[0])


def _href(links: str, words: str) -> str:
    return unescape(one_match(rf'<a href="([^"]*)"[^>]*>{re.escape(words)}</a>', links))


# -- a run's page: timeline, edits, trace (issue 47) -----------------------------------------


async def test_a_run_page_shows_its_trace_id_and_links_only_when_templates_are_set(
    store: ManagedStore,
) -> None:
    trace = LinkTemplate.parse("https://tempo.example/trace/{trace_id}", "--trace-url")
    temporal = LinkTemplate.parse(
        "https://temporal.example/namespaces/default/workflows/{run_id}", "--temporal-url"
    )
    async with browser(console(store, trace_link=trace, temporal_link=temporal)) as client:
        linked = await client.get(run_path(EVIL_RUN))
    async with browser(console(store)) as client:
        plain = await client.get(run_path(EVIL_RUN))
    trace_id = run_trace_id(EVIL_RUN)
    for page in (linked, plain):
        assert f"trace id <code>{trace_id}</code>" in page.text
    assert f'href="https://tempo.example/trace/{trace_id}"' in linked.text
    workflow = quote(EVIL_RUN, safe="")
    assert f'href="https://temporal.example/namespaces/default/workflows/{workflow}"' in linked.text
    assert 'id="trace-link"' not in plain.text and 'id="temporal-link"' not in plain.text


async def test_a_run_page_draws_each_step_on_a_timeline(store: ManagedStore) -> None:
    view = await read_view(store, parse_store("sqlite:x.db"), "paused")  # double, then a proposal
    async with browser(console(store)) as client:
        page = await client.get(run_path("paused"))
    section = re.search(r'<section id="timeline">.*?</section>', page.text, re.S)
    assert section is not None
    rows = re.findall(r'<tr class="step-time">(.*?)</tr>', section.group(), re.S)
    assert len(rows) == len(view.steps) == 1
    [step] = view.steps
    assert step.model_duration_s is not None and step.action_duration_s is not None
    assert '<rect class="model"' in rows[0] and '<rect class="tool"' in rows[0]
    assert step_time_text(step) in unescape(rows[0])


async def test_after_an_edited_approval_the_page_shows_both_arguments(
    store: ManagedStore,
) -> None:
    await approve(store, "paused", by="dana", arguments={"env": "staging"}, result_id=None)
    async with browser(console(store)) as client:
        waiting = await client.get(run_path("paused"))
    await resume(store, "paused", approval_script())
    async with browser(console(store)) as client:
        ran = await client.get(run_path("paused"))
    for page in (waiting, ran):
        section = re.search(r'<section id="edits">.*?</section>', page.text, re.S)
        assert section is not None
        proposed, approved = re.findall(
            r'<figure class="(?:proposed|approved)">.*?<pre>(.*?)</pre>', section.group(), re.S
        )
        assert json.loads(unescape(proposed)) == {"env": "prod"}
        assert json.loads(unescape(approved)) == {"env": "staging"}
        assert "approved by <strong>dana</strong>" in section.group()
        assert "(changed: <code>env</code>)" in section.group()
    async with browser(console(store)) as client:
        untouched = await client.get(run_path("done-1"))
    assert 'id="edits"' not in untouched.text


async def test_a_search_past_its_limit_says_which_runs_it_read(store: ManagedStore) -> None:
    async with browser(console(store, scan_limit=4)) as client:
        page = await client.get("/", params={"q": "done"})
        plain = await client.get("/", params={"state": "finished"})
    # The four most recent: doubt, paused, the run with markup, done-3.
    assert _rows(page.text) == ["done-3"]
    assert "Searched the 4 most recent runs only" in page.text
    assert "Searched the" not in plain.text  # a state filter reads as before
