"""The web console tells apart why a run nobody drives goes on, as ``polyloop runs`` does:
on the list, on a run's page, and after an answer; on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from kit.console import CONSOLE_KINDS, browser, console, post_form, store_factory
from kit.hosting import Till, eventually, payer, serving
from polyloop import Ready, RunState, approve, run_status
from polyloop.cli._console import run_path
from polyloop.ports import ManagedStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = pytest.mark.anyio

# Writes before the kill: the payment's intent is the fourth; the payment then runs.
INSIDE_PAY = 4


@pytest.fixture(params=CONSOLE_KINDS)
def reopen(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ManagedStore]:
    return store_factory(request, tmp_path)


async def _killed_inside_pay(store: Any, run_id: str, **options: Any) -> None:
    crashing = payer(FaultyStore(store, fail_after_writes=INSIDE_PAY), Till(), **options)
    with pytest.raises(SimulatedCrash):
        await crashing.run(run_id, {})


@pytest.fixture
async def store(reopen: Callable[[], ManagedStore]) -> AsyncIterator[ManagedStore]:
    """``approved`` waits for a worker after its approval, ``asking`` for a person's,
    ``probe`` for the probe a worker will ask, ``doubt`` for a person to settle it."""
    async with reopen() as opened:
        asking = payer(opened, Till(), needs_approval=True)
        for run_id in ("approved", "asking"):
            await asking.run(run_id, {})
        await approve(opened, "approved", by="ann")
        await _killed_inside_pay(opened, "probe", probe=True)
        await _killed_inside_pay(opened, "doubt")
        yield opened


def _detail(text: str) -> str:
    return f'<small class="detail">{text}</small>'


async def test_the_list_says_why_each_run_goes_on_or_who_it_waits_for(
    store: ManagedStore,
) -> None:
    async with browser(console(store)) as client:
        page = unescape((await client.get("/")).text)
    assert _detail("approved, waiting for a worker") in page
    assert _detail("its tool's probe will settle it, waiting for a worker") in page
    assert _detail("waiting for a person") in page
    assert page.count('<small class="detail">') == 3  # awaiting approval says it all
    # The filters still go by the state's word.
    async with browser(console(store)) as client:
        doubts = (await client.get("/", params={"state": "in doubt"})).text
    assert run_path("probe") in doubts and run_path("doubt") in doubts
    assert run_path("approved") not in doubts


async def test_a_run_page_says_the_probe_will_settle_the_doubt(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        probe = unescape((await client.get(run_path("probe"))).text)
        doubt = unescape((await client.get(run_path("doubt"))).text)
    said = "Its tool's probe will settle this when the run is driven next"
    assert said in probe and said not in doubt
    assert "(its tool's probe will settle it, waiting for a worker)" in probe
    assert "a worker hosting agent 'payer' goes on (or resume)" in probe
    assert "(waiting for a person)" in doubt
    assert 'id="settle"' in probe and 'id="settle"' in doubt  # a person may still answer


async def test_after_an_answer_the_page_says_a_worker_goes_on(store: ManagedStore) -> None:
    async with browser(console(store)) as client:
        sent = await post_form(
            client, "/runs/asking/approve", {"by": "alice", "result_id": "asking:0:action"}
        )
        assert sent.status_code == 303
        page = unescape((await client.get(sent.headers["location"])).text)
    assert "Approved. The action runs next. A worker hosting its agent goes on with it" in page
    assert "(approved, waiting for a worker)" in page
    assert (await run_status(store, "asking")).ready is Ready.APPROVED


async def test_an_approval_in_the_console_is_driven_on_by_a_worker(
    reopen: Callable[[], ManagedStore],
) -> None:
    """``polyloop serve`` and a worker side by side, each with a store object of its own,
    as two processes have: the person approves in the browser, the worker goes on."""
    till = Till()
    async with reopen() as served, reopen() as hosted:
        agent = payer(hosted, till, needs_approval=True)
        await agent.start("r1", {})
        async with serving(agent, poll_s=0.05), browser(console(served)) as client:
            await eventually(lambda: _waits(served), what="r1 waiting for approval")
            sent = await post_form(
                client, "/runs/r1/approve", {"by": "alice", "result_id": "r1:0:action"}
            )
            assert sent.status_code == 303
            took = await eventually(lambda: _finished(served), what="r1 going on")
            page = unescape((await client.get(run_path("r1"))).text)
    assert took < 10.0  # about a poll interval; generous for a loaded machine
    assert till.paid == ["r1:0:action"]
    assert "finished (final_answer)" in page


async def _waits(store: ManagedStore) -> bool:
    return (await run_status(store, "r1")).state is RunState.AWAITING_APPROVAL


async def _finished(store: ManagedStore) -> bool:
    return (await run_status(store, "r1")).state is RunState.FINISHED
