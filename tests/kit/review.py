"""Builders for the tests of a person in the loop: a tool that needs approval, a tool
whose replay is never allowed, the scripts that call them, and the stories of answers
written for a proposal or an intent that is no longer open."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio.lowlevel
import pytest

from kit.agent import (
    ANSWER_SCHEMA,
    NUMBER_SCHEMA,
    Ledger,
    answer,
    close_store,
    definition,
    request,
    tool_call,
)
from polyloop import (
    NotAwaitingApproval,
    NotInDoubt,
    Proposal,
    Replay,
    RunLog,
    RunResult,
    RunState,
    Settlement,
    StepRecord,
    StopReason,
    Store,
    ToolRegistry,
    ToolSpec,
    Verdict,
    approve,
    reject,
    run_status,
    settle,
    start_or_resume,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, SimulatedCrash

ENV_SCHEMA = {
    "type": "object",
    "properties": {"env": {"type": "string", "enum": ["staging", "prod"]}},
    "required": ["env"],
    "additionalProperties": False,
}


def review_tools(
    ledger: Ledger,
    *,
    needs_approval: bool = True,
    descriptions: dict[str, str] | None = None,
    without: tuple[str, ...] = (),
) -> ToolRegistry:
    """``double`` (replay allowed), ``deploy`` (needs approval unless told otherwise),
    ``pay`` (replay never allowed) and ``submit`` (completes); ``descriptions`` replaces
    the description of the tools it names, and the tools named in ``without`` are left
    out (a deploy that changed or removed them)."""

    def handler(name: str, render: Any) -> Any:
        async def run(arguments: dict[str, Any], *, result_id: str) -> str:
            ledger.calls.append((name, result_id))
            await anyio.lowlevel.checkpoint()
            return str(render(arguments))

        return run

    specs = [
        ToolSpec(
            name="double",
            description="Double a number.",
            parameters=NUMBER_SCHEMA,
            handler=handler("double", lambda a: a["n"] * 2),
            replay=Replay.ALLOWED,
        ),
        ToolSpec(
            name="deploy",
            description="Deploy the build to an environment.",
            parameters=ENV_SCHEMA,
            handler=handler("deploy", lambda a: f"deployed to {a['env']}"),
            needs_approval=needs_approval,
        ),
        ToolSpec(
            name="pay",
            description="Pay an amount.",
            parameters=NUMBER_SCHEMA,
            handler=handler("pay", lambda a: f"paid {a['n']}"),
        ),
        ToolSpec(
            name="submit",
            description="Submit the answer.",
            parameters=ANSWER_SCHEMA,
            handler=handler("submit", lambda a: f"accepted {a['answer']}"),
            replay=Replay.ALLOWED,
            completes=True,
        ),
    ]
    changed = descriptions or {}
    return ToolRegistry(
        [
            dataclasses.replace(spec, description=changed.get(spec.name, spec.description))
            for spec in specs
            if spec.name not in without
        ],
        max_observation_chars=10_000,
    )


def observed(payload: Any) -> str:
    """What the tool of ``payload`` returns when it runs: what a person who checked would
    report for a call in doubt."""
    name, arguments = payload["name"], payload["arguments"]
    return {
        "double": lambda: str(arguments.get("n", 0) * 2),
        "deploy": lambda: f"deployed to {arguments.get('env')}",
        "pay": lambda: f"paid {arguments.get('n')}",
        "submit": lambda: f"accepted {arguments.get('answer')}",
    }[name]()


def approval_script() -> list[str]:
    """Double, deploy to prod (needs approval), then answer."""
    return [tool_call("double", n=1), tool_call("deploy", env="prod"), answer("done")]


def payment_script() -> list[str]:
    """Double, pay (never replayed), then answer."""
    return [tool_call("double", n=1), tool_call("pay", n=5), answer("done")]


def reviews(log: RunLog) -> list[Proposal | Verdict | Settlement]:
    return [r for r in log.records if isinstance(r, Proposal | Verdict | Settlement)]


def plain_steps(steps: Sequence[StepRecord]) -> list[StepRecord]:
    """Step records without timing or who settled them: what two runs share."""
    cleared = {
        f.name: None
        for f in dataclasses.fields(StepRecord)
        if f.metadata.get("timing") or f.name in ("duration_s", "settled_by")
    }
    return [dataclasses.replace(step, **cleared) for step in steps]


def deploy_twice_script() -> list[str]:
    """Double, deploy to prod (needs approval), the same deploy again, then answer."""
    deploy = tool_call("deploy", env="prod")
    return [tool_call("double", n=1), deploy, deploy, answer("done")]


def pay_twice_script() -> list[str]:
    """Double, pay 5 (never replayed), pay 5 again, then answer."""
    return [tool_call("double", n=1), tool_call("pay", n=5), tool_call("pay", n=5), answer("done")]


# -- an answer names the proposal it answers (issue 42) -----------------------------------


async def _opened(open_store: Callable[[], Store], operation: Callable[[Store], Any]) -> Any:
    """``operation`` through a store object of its own, as a separate process would.

    A memory store is the one thing every "process" of a memory test shares, so it is
    left open.
    """
    store = open_store()
    try:
        return await operation(store)
    finally:
        if not isinstance(store, MemoryStore):
            await close_store(store)


async def _drive(open_store: Callable[[], Store], ledger: Ledger, script: list[str]) -> RunResult:
    tools = review_tools(ledger)
    return await _opened(  # type: ignore[no-any-return]
        open_store,
        lambda store: start_or_resume(definition(store, script=script), request("r", tools)),
    )


async def approval_story(open_store: Callable[[], Store]) -> None:
    """Alice opens proposal 0; Bob rejects it; the model proposes the same call again
    (proposal 1). Alice's answer, written for proposal 0, is refused and writes nothing."""
    ledger, script = Ledger(), deploy_twice_script()
    assert (await _drive(open_store, ledger, script)).stop_reason is StopReason.AWAITING_APPROVAL
    shown = await _opened(open_store, lambda store: run_status(store, "r"))
    seen = shown.proposal.result_id  # what Alice's screen holds
    await _opened(open_store, lambda store: reject(store, "r", by="bob", reason="not now"))
    assert (await _drive(open_store, ledger, script)).stop_reason is StopReason.AWAITING_APPROVAL
    status = await _opened(open_store, lambda store: run_status(store, "r"))
    assert status.proposal.payload == shown.proposal.payload  # the same call, word for word
    assert (seen, status.proposal.result_id) == ("r:1:action", "r:2:action")
    before = await _opened(open_store, lambda store: store.read_log("r"))
    stale = r"the open proposal is 'r:2:action', not 'r:1:action'"
    answers: list[Callable[[Store], Awaitable[object]]] = [
        lambda store: approve(store, "r", by="alice", result_id=seen),
        lambda store: approve(store, "r", by="alice", arguments={"env": "prod"}, result_id=seen),
        lambda store: reject(store, "r", by="alice", reason="x", result_id=seen),
    ]
    for stale_answer in answers:
        with pytest.raises(NotAwaitingApproval, match=stale):
            await _opened(open_store, stale_answer)
    with pytest.raises(NotInDoubt, match="no effect in doubt"):
        await _opened(
            open_store,
            lambda store: settle(store, "r", by="alice", ran=True, observation="x", result_id=seen),
        )
    assert await _opened(open_store, lambda store: store.read_log("r")) == before
    status = await _opened(open_store, lambda store: run_status(store, "r"))
    assert status.state is RunState.AWAITING_APPROVAL
    assert status.proposal.result_id == "r:2:action"
    assert [name for name, _ in ledger.calls] == ["double"]  # no deploy ran
    await _opened(open_store, lambda store: approve(store, "r", by="alice", result_id="r:2:action"))
    assert (await _drive(open_store, ledger, script)).stop_reason is StopReason.FINAL_ANSWER
    assert [name for name, _ in ledger.calls] == ["double", "deploy"]


async def settlement_story(open_store: Callable[[], Store]) -> None:
    """Alice opens the payment in doubt; Bob settles it; the next payment is in doubt too.
    Alice's settlement, written for the first, is refused and writes nothing."""
    ledger, script = Ledger(), pay_twice_script()
    tools = review_tools(ledger)

    async def crash_at_pay(writes: int) -> None:
        async def crashing(store: Store) -> None:
            with pytest.raises(SimulatedCrash):
                await start_or_resume(
                    definition(FaultyStore(store, fail_after_writes=writes), script=script),
                    request("r", tools),
                )

        await _opened(open_store, crashing)

    await crash_at_pay(8)  # the first payment's intent lands, then the worker dies
    assert (await _drive(open_store, ledger, script)).stop_reason is StopReason.IN_DOUBT
    seen = (await _opened(open_store, lambda store: run_status(store, "r"))).open_intent.result_id
    await _opened(
        open_store,
        lambda store: settle(store, "r", by="bob", ran=True, observation="paid 5", result_id=seen),
    )
    await crash_at_pay(4)  # the settled step, then the second payment's model call and intent
    assert (await _drive(open_store, ledger, script)).stop_reason is StopReason.IN_DOUBT
    before = await _opened(open_store, lambda store: store.read_log("r"))
    with pytest.raises(NotInDoubt, match=r"'r:2:action', not 'r:1:action'.*no longer open"):
        await _opened(
            open_store,
            lambda store: settle(
                store, "r", by="alice", ran=False, observation="x", result_id=seen
            ),
        )
    assert await _opened(open_store, lambda store: store.read_log("r")) == before
    status = await _opened(open_store, lambda store: run_status(store, "r"))
    assert (status.state, status.open_intent.result_id) == (RunState.IN_DOUBT, "r:2:action")
