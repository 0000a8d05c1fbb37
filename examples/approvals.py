"""A person in the loop: an action that waits for approval, and one settled after a crash.

What it shows
    * ``ToolSpec(..., needs_approval=True)``: when the model calls ``deploy``, the run
      records the proposed call and stops ``AWAITING_APPROVAL`` before anything runs; a
      person approves or rejects it (``polyloop approve|reject``), from any process and
      however much later, and running this script again goes on from there;
    * settling a run in doubt: ``pay`` may never run twice, so when the process dies
      after paying but before the payment's result was written, the run ends
      ``IN_DOUBT``; a person who knows what happened says so (``polyloop settle``) and
      the run goes on as if the payment had ended that way;
    * no polling anywhere: each call of this script drives the run as far as it can go
      and stops; the person's answer is written to the store, not sent to a process.

How to run it::

    python examples/approvals.py --db runs.db                  # stops: awaiting approval
    polyloop pending sqlite:runs.db                            # deploy(prod) waits
    polyloop approve sqlite:runs.db release-1 --by alice       # or: reject --reason ...
    python examples/approvals.py --db runs.db                  # deploys, pays, submits

    python examples/approvals.py --db runs.db --run-id release-2 --auto-approve --crash-after-paying
    python examples/approvals.py --db runs.db --run-id release-2 --auto-approve  # in doubt
    polyloop settle sqlite:runs.db release-2 --by alice --ran --observation "paid 5"
    python examples/approvals.py --db runs.db --run-id release-2 --auto-approve  # finishes

Every side effect is appended to ``<db>.effects.txt`` (one line per tool call that ran),
so you can check that nothing ran twice and nothing rejected ran at all.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import anyio

from polyloop import (
    Budget,
    Definition,
    Injection,
    JSONValue,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunResult,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    start_or_resume,
)
from polyloop.interpreters import JsonToolCallInterpreter
from polyloop.stores import SqliteStore
from polyloop.testing import ScriptedModelClient

CRASH_STATUS = 3


def _call(tool: str, **arguments: JSONValue) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


SCRIPT = [
    _call("deploy", env="prod"),
    _call("pay", amount=5),
    _call("submit", answer="deployed and paid"),
]


def make_tools(effects: Path, *, auto_approve: bool, crash_after_paying: bool) -> ToolRegistry:
    def effect(line: str) -> None:
        with effects.open("a", encoding="utf-8") as out:
            out.write(line + "\n")

    async def deploy(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        effect(f"deploy {arguments['env']} {result_id}")
        return f"deployed to {arguments['env']}"

    async def pay(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        effect(f"pay {arguments['amount']} {result_id}")
        if crash_after_paying:
            print("the process dies after paying, before the result is written", flush=True)
            os._exit(CRASH_STATUS)
        return f"paid {arguments['amount']}"

    async def submit(arguments: dict[str, JSONValue], *, result_id: str) -> str:
        effect(f"submit {result_id}")
        return f"accepted {arguments['answer']}"

    def schema(name: str, kind: JSONValue) -> dict[str, JSONValue]:
        return {
            "type": "object",
            "properties": {name: kind},
            "required": [name],
            "additionalProperties": False,
        }

    return ToolRegistry(
        [
            ToolSpec(
                name="deploy",
                description="Deploy the release to an environment (staging or prod).",
                parameters=schema("env", {"enum": ["staging", "prod"]}),
                handler=deploy,
                needs_approval=not auto_approve,  # a person says yes first
            ),
            ToolSpec(
                name="pay",
                description="Pay the release fee.",
                parameters=schema("amount", {"type": "integer"}),
                handler=pay,  # replay never: a payment must not happen twice
            ),
            ToolSpec(
                name="submit",
                description="Report that the release is done. Ends the task.",
                parameters=schema("answer", {"type": "string"}),
                handler=submit,
                replay=Replay.ALLOWED,
                completes=True,
            ),
        ],
        max_observation_chars=1_000,
    )


def build(store: SqliteStore, run_id: str, tools: ToolRegistry) -> tuple[Definition, Request]:
    definition = Definition(
        model=ScriptedModelClient(SCRIPT, name="approvals-example"),
        interpreter=JsonToolCallInterpreter(),
        store=store,
        events=NullSink(),
        texts=ObservationTexts(not_executed="Not executed: {reason}", env_fault="Fault: {detail}"),
    )
    request = Request(
        run_id=run_id,
        budget=Budget(max_steps=8, max_valid_steps=6, max_context_chars=20_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, "You release software. Use the tools."),),
        goal_context=(Message.text(Role.USER, "Deploy the release to prod and pay the fee."),),
        injection=Injection(entries={}),
        binding={},
        model_replay=Replay.ALLOWED,
        observation_template="Result: {observation}",
        tool_style=ToolStyle.JSON,
        cancel_grace_s=2.0,
    )
    return definition, request


async def drive(args: argparse.Namespace) -> RunResult:
    tools = make_tools(
        Path(f"{args.db}.effects.txt"),
        auto_approve=args.auto_approve,
        crash_after_paying=args.crash_after_paying,
    )
    async with SqliteStore(args.db) as store:
        definition, request = build(store, args.run_id, tools)
        return await start_or_resume(definition, request)


def show(result: RunResult) -> None:
    for step in result.steps:
        settled = f" (settled by {step.settled_by})" if step.settled_by else ""
        print(f"  step {step.step}: {step.action_text} -> {step.observation}{settled}")
    print(f"stop reason: {result.stop_reason.value} after {result.step_count} steps")
    if result.detail:
        print(f"detail: {result.detail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="polyloop-approvals.db", help="the SQLite database")
    parser.add_argument("--run-id", default="release-1")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--auto-approve", action="store_true", help="deploy needs no approval")
    parser.add_argument(
        "--crash-after-paying", action="store_true", help="die right after the payment"
    )
    args = parser.parse_args()
    show(anyio.run(drive, args, backend=args.backend))


if __name__ == "__main__":
    main()
