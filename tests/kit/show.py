"""Runs for the tests of ``polyloop show``: each fact it tells, in a store of its own.

The runs are written by the kernel (a crash by ``FaultyStore``, then ``resume``), except
the old log, which is put together from the first release's record fixtures: it has
none of the later facts, and show must say so rather than fail.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from kit.agent import (
    Ledger,
    close_store,
    crash_and_resume,
    definition,
    five_step_script,
    make_tools,
    request,
    tool_call,
)
from kit.probe import Payments, tools
from kit.review import payment_script
from polyloop import (
    ModelReply,
    Replay,
    Usage,
    run,
    start_or_resume,
)
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "records" / "v1"
OLD_RUN = "exp-7/task-12#3"
# A time in UTC as the terminal and the page show it.
UTC_TIME = re.compile(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z")
# A span in the age and duration columns of ``polyloop runs``, or "-" where there is none.
SPAN = re.compile(r"-|\d\.\ds|\d+s|\d+m\d\ds|\d+h\d\dm|\d+d\d\dh")


def without_times(line: str) -> str:
    """A line of ``polyloop runs`` without its last two columns (age and duration), which
    depend on when it was printed; both are checked to be spans first."""
    rest, age, duration = line.rsplit(maxsplit=2)
    assert SPAN.fullmatch(age) and SPAN.fullmatch(duration), line
    return rest


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


# Write 8 is the action intent of step 1, the payment: a crash right after leaves it open.
_PAY_INTENT = 8


async def _crash_at_payment(store: Any, run_id: str, payments: Payments) -> None:
    with pytest.raises(SimulatedCrash):
        await run(
            definition(FaultyStore(store, fail_after_writes=_PAY_INTENT), script=payment_script()),
            request(run_id, tools(payments), model_replay=Replay.ALLOWED),
        )


async def _resume_payment(store: Any, run_id: str, payments: Payments) -> None:
    await start_or_resume(
        definition(store, script=payment_script()),
        request(run_id, tools(payments), model_replay=Replay.ALLOWED),
    )


async def _write_probed(directory: Path) -> None:
    """Runs whose payment in doubt the tool's probe settled: it ran (``paid``), it did
    not (``unpaid``), and one that crashed once the probe's settlement landed, before its
    step did (``pending``)."""
    async with SqliteStore(directory / "probed.db") as store:
        for run_id, reachable in (("paid", True), ("unpaid", False)):
            payments = Payments(reachable=reachable)
            await _crash_at_payment(store, run_id, payments)
            await _resume_payment(store, run_id, payments)
        payments = Payments()
        await _crash_at_payment(store, "pending", payments)
        # The resume's first write is the settlement: it lands, and the process dies.
        with pytest.raises(SimulatedCrash):
            await _resume_payment(FaultyStore(store, fail_after_writes=1), "pending", payments)
        assert payments.paid() == ["pending:1:action"]


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
    anyio.run(_write_probed, directory)
    _write_old_log(directory / "old")
    shown = {name: f"sqlite:{directory / name}.db" for name in ("done", "partial", "stopped")}
    shown |= {name: f"sqlite:{directory / name}.db" for name in ("resumed", "doubt")}
    shown["old"] = f"jsonl:{directory / 'old'}"
    shown["held"] = f"jsonl:{directory / 'held'}"
    shown["model"] = f"sqlite:{directory / 'model.db'}"
    shown |= dict.fromkeys(("paid", "unpaid", "pending"), f"sqlite:{directory / 'probed.db'}")
    return shown


RUN_IDS = {"resumed": "r", "doubt": "r", "model": "r", "old": OLD_RUN}


def show(stores: dict[str, str], name: str, *options: str, backend: str = "asyncio") -> list[str]:
    return ["--backend", backend, "show", stores[name], RUN_IDS.get(name, name), *options]
