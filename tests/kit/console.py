"""Stores filled with real runs for the web console's tests, and a client that speaks
to the console as a browser does (cookies, the CSRF field of its forms)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from kit.agent import Ledger, answer, definition, request, tool_call
from kit.review import approval_script, review_tools
from kit.store import sampled
from polyloop import Replay, run, start_or_resume
from polyloop.cli._console import Access, Settings, create_app
from polyloop.ports import ManagedStore
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash
from polyloop.types import RunEnded, RunStarted, StopReason

BASE_URL = "http://console.test"
EVIL = '<script>alert("x")</script><b>bold</b>'
EVIL_RUN = f"run-{EVIL}"
FINISHED = ("done-1", "done-2", "done-3")
# The stores the console's tests run on: what it shows and takes goes through the store's
# interface alone, which each store's contract suite checks (research-wiki/0065).
CONSOLE_KINDS = sampled(("sqlite", "postgresql"))
DOUBT_ARGUMENTS: dict[str, dict[str, Any]] = {"pay": {"n": 5}, "deploy": {"env": "prod"}}


def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ManagedStore]:
    """A way to open the same store again: SQLite in ``tmp_path``, or a fresh schema of
    the shared PostgreSQL database (``request.param``)."""
    if request.param == "sqlite":
        return lambda: SqliteStore(tmp_path / "runs.db")
    from polyloop.stores import PostgresStore

    url = request.getfixturevalue("postgres_shared")
    schema = request.getfixturevalue("postgres_schemas")()
    return lambda: PostgresStore(url, schema=schema)


async def fill(store: ManagedStore) -> None:
    """``paused`` awaits approval of a deploy; ``doubt`` is in doubt about a payment;
    the ``done-*`` runs and one whose id and final answer hold markup finished."""
    tools = review_tools(Ledger())
    for run_id in FINISHED:
        await run(definition(store, script=[answer(f"{run_id} ok")]), request(run_id, tools))
    await run(definition(store, script=[answer(EVIL)]), request(EVIL_RUN, tools))
    await run(definition(store, script=approval_script()), request("paused", tools))
    await crash_in_doubt(store, "doubt")


async def fill_deploys(store: ManagedStore) -> tuple[str, ...]:
    """Runs around deploys: three in doubt about a deploy (one whose process died and
    that no resume has ended yet), one in doubt about a payment, one whose deploy ran,
    one whose deploy waits for approval. The ids of the three."""
    for run_id in ("deploy-doubt-1", "deploy-doubt-2"):
        await crash_in_doubt(store, run_id, tool="deploy")
    await crash_in_doubt(store, "deploy-doubt-3", tool="deploy", resumed=False)
    await crash_in_doubt(store, "pay-doubt")
    tools = review_tools(Ledger(), needs_approval=False)
    await run(definition(store, script=approval_script()), request("deploy-done", tools))
    waiting = review_tools(Ledger())
    await run(definition(store, script=approval_script()), request("deploy-waits", waiting))
    return ("deploy-doubt-1", "deploy-doubt-2", "deploy-doubt-3")


async def fill_many(store: ManagedStore, run_ids: list[str], *, at_once: int = 500) -> None:
    """A run per id, each of a start record and a final end record, written through the
    store's own calls ``at_once`` runs at a time, so group commit shares the syncs."""
    waiting = iter(run_ids)

    async def writer() -> None:
        for run_id in waiting:  # shared: each run is written by one writer
            await store.claim_run(run_id)
            await store.start_run(RunStarted(run_id=run_id, snapshot={"model.name": "m"}))
            ended = RunEnded(
                run_id=run_id,
                stop_reason=StopReason.FINAL_ANSWER,
                final_answer="done",
                steps=0,
                valid_steps=0,
                detail=None,
            )
            await store.end_run(ended)

    async with anyio.create_task_group() as group:
        for _ in range(min(at_once, len(run_ids))):
            group.start_soon(writer)


async def crash_in_doubt(
    store: ManagedStore, run_id: str, tool: str = "pay", *, resumed: bool = True
) -> None:
    """A run whose payment (or deploy, ``tool``: neither is ever replayed, and the
    deploy runs without approval here) was announced when its process died: in doubt,
    with an end record that says so once resumed (``resumed``), without one before."""
    tools = review_tools(Ledger(), needs_approval=tool != "deploy")
    script = [tool_call("double", n=1), tool_call(tool, **DOUBT_ARGUMENTS[tool]), answer("done")]
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=8), script=script),
            request(run_id, tools, model_replay=Replay.ALLOWED),
        )
    if not resumed:
        return
    await start_or_resume(
        definition(store, script=script),
        request(run_id, tools, model_replay=Replay.ALLOWED),
    )


async def resume(
    store: ManagedStore, run_id: str, script: list[str], model_replay: Replay = Replay.NEVER
) -> Ledger:
    """The worker's next resume of ``run_id``; the ledger of what its tools ran."""
    ledger = Ledger()
    await start_or_resume(
        definition(store, script=script),
        request(run_id, review_tools(ledger), model_replay=model_replay),
    )
    return ledger


def console(store: ManagedStore, **options: Any) -> Any:
    access = Access(
        token=options.pop("token", None),
        user_header=options.pop("user_header", None),
        read_only=options.pop("read_only", False),
    )
    return create_app(store, Settings("test store", access, **options))


@asynccontextmanager
async def browser(app: Any, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, headers=headers) as client:
        yield client


async def post_form(
    client: httpx.AsyncClient, path: str, fields: dict[str, str], *, csrf: bool = True
) -> httpx.Response:
    """POST ``fields`` as the console's own form would: after loading the page (which
    sets the CSRF cookie), with the cookie's token echoed."""
    if "polyloop_csrf" not in client.cookies:
        await client.get("/")
    data = dict(fields)
    if csrf:
        data["csrf"] = client.cookies["polyloop_csrf"]
    return await client.post(path, data=data, headers={"Sec-Fetch-Site": "same-origin"})
