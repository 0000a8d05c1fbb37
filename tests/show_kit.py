"""Runs for the tests of ``polyloop show``: each fact it tells, in a store of its own.

The runs are written by the kernel (a crash by ``FaultyStore``, then ``resume``), except
the old log, which is put together from the first release's record fixtures: it has
none of the later facts, and show must say so rather than fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from agent_kit import (
    Ledger,
    close_store,
    crash_and_resume,
    definition,
    five_step_script,
    make_tools,
    request,
    tool_call,
)
from polyloop import ModelReply, Replay, Usage, run
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._common import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

FIXTURES = Path(__file__).parent / "fixtures" / "records" / "v1"
OLD_RUN = "exp-7/task-12#3"
# A time in UTC as the terminal and the page show it.
UTC_TIME = re.compile(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z")


def reply(content: str, usage: Usage | None) -> ModelReply:
    return ModelReply(content=content, call_id=None, reasoning=None, usage=usage)


async def _write_runs(directory: Path) -> None:
    """Finished, partly metered, cancelled, resumed and in-doubt runs, one store each."""
    async with SqliteStore(directory / "done.db") as store:
        script = [
            reply(tool_call("double", n=1), Usage(input_tokens=100, output_tokens=20)),
            reply(tool_call("submit", answer="2"), Usage(input_tokens=130, output_tokens=10)),
        ]
        await run(definition(store, script=script), request("done", make_tools(Ledger())))
    async with SqliteStore(directory / "partial.db") as store:
        script = [
            reply(tool_call("double", n=1), Usage(input_tokens=100, output_tokens=20)),
            reply(tool_call("submit", answer="2"), None),
        ]
        await run(definition(store, script=script), request("partial", make_tools(Ledger())))
    async with SqliteStore(directory / "stopped.db") as store:
        slow = make_tools(Ledger(), delay=30, replay=Replay.ALLOWED)
        with anyio.move_on_after(0.3):
            await run(definition(store, script=five_step_script()), request("stopped", slow))
    # Crash once step 1's model intent is written; the resumed process writes steps 1-4.
    _, _, resumed = await crash_and_resume(
        lambda: SqliteStore(directory / "resumed.db"), 7, Replay.ALLOWED, five_step_script()
    )
    await close_store(resumed)
    # Crash once step 0's action intent is written; its replay is never: in doubt.
    _, _, doubt = await crash_and_resume(
        lambda: SqliteStore(directory / "doubt.db"), 4, Replay.NEVER, five_step_script()
    )
    await close_store(doubt)


async def _write_held(directory: Path) -> None:
    """An action intent left open by a crash, its replay never; a model call likewise, resumed."""
    async with JsonlStore(directory / "held") as store:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=4), script=five_step_script()),
                request("held", make_tools(Ledger())),
            )
    _, _, resumed = await crash_and_resume(
        lambda: SqliteStore(directory / "model.db"), 2, Replay.NEVER, five_step_script()
    )
    await close_store(resumed)


def _write_old_log(directory: Path) -> None:
    """A run cut short after step 0, in records as the first release wrote them."""
    names = ["run_started", "intent_model_call", "result_model_call", "step_action"]
    lines = [(FIXTURES / f"{name}.json").read_text(encoding="utf-8") for name in names]
    directory.mkdir()
    (directory / f"{safe_name(OLD_RUN)}.jsonl").write_text("".join(lines), encoding="utf-8")


def write_stores(directory: Path) -> dict[str, str]:
    """Write every run; the STORE argument of each, by name (see :data:`RUN_IDS`)."""
    anyio.run(_write_runs, directory)
    anyio.run(_write_held, directory)
    _write_old_log(directory / "old")
    shown = {name: f"sqlite:{directory / name}.db" for name in ("done", "partial", "stopped")}
    shown |= {name: f"sqlite:{directory / name}.db" for name in ("resumed", "doubt")}
    shown["old"] = f"jsonl:{directory / 'old'}"
    shown["held"] = f"jsonl:{directory / 'held'}"
    shown["model"] = f"sqlite:{directory / 'model.db'}"
    return shown


RUN_IDS = {"resumed": "r", "doubt": "r", "model": "r", "old": OLD_RUN}


def show(stores: dict[str, str], name: str, *options: str, backend: str = "asyncio") -> list[str]:
    return ["--backend", backend, "show", stores[name], RUN_IDS.get(name, name), *options]
