"""Forks for the tests of the stores and the command line: a recorded run and two forks."""

from __future__ import annotations

from typing import Any

from agent_kit import Ledger, definition, make_tools, request, tool_call
from polyloop import fork, run

SCRIPT = [
    tool_call("double", n=1),
    tool_call("double", n=2),
    tool_call("double", n=3),
    tool_call("submit", answer="6"),
]


async def write_forks(store: Any, ledger: Ledger | None = None) -> None:
    """``src``, a run of four steps; ``f``, its fork at step 2; ``f0``, at step 0."""
    ledger = ledger if ledger is not None else Ledger()
    await run(definition(store, script=SCRIPT), request("src", make_tools(ledger)))
    for run_id, at_step in (("f", 2), ("f0", 0)):
        await fork(
            definition(store, script=SCRIPT),
            request(run_id, make_tools(ledger)),
            source_run_id="src",
            at_step=at_step,
        )
