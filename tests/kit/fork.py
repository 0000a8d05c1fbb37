"""Forks for the tests of the stores and the command line: a recorded run and two forks."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kit.agent import Ledger, definition, make_tools, request, timeless, tool_call
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


def without_run_id(steps: Any) -> list[Any]:
    """Steps without timing, and without the run id where the scripted model and the
    test tool put it (the reply's call id, the observation), so two runs compare."""

    def plain(step: Any) -> Any:
        return dataclasses.replace(
            step,
            run_id="",
            call_id=re.sub(r"^\w+/", "R/", step.call_id or ""),
            observation=re.sub(r"\(\w+:(\d+):action\)", r"(R:\1:action)", step.observation or ""),
        )

    return [plain(step) for step in timeless(steps)]
