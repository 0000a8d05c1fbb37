"""A small PolyLoop agent on any OpenAI-compatible model server.

The model gets three tools (``add``, ``multiply`` and ``submit``) and a task; it answers
with one JSON object per turn, which the ready-made
:class:`~polyloop.interpreters.JsonToolCallInterpreter` turns into a tool call or a final
answer (the object may sit in a ```json block with prose around it, as models often
write it). The run ends when the model submits (``SUBMITTED``), answers directly
(``FINAL_ANSWER``) or runs out of steps.

Usage (any server that speaks Chat Completions)::

    python examples/openai_agent.py --base-url https://api.openai.com/v1 --model gpt-4o-mini
    python examples/openai_agent.py --base-url http://localhost:11434/v1 --model qwen2.5:7b
    python examples/openai_agent.py --base-url http://localhost:8000/v1 --model my-vllm-model

The API key comes from ``--api-key`` or ``OPENAI_API_KEY``; local servers usually accept
any value. ``--binding KEY=VALUE`` (repeatable) adds coordinates to the run; they are
recorded in its snapshot and sent as request ``metadata``, which OpenAI's own API accepts
only with ``--store`` (it then keeps the completions in your account). ``--stream``
prints the model's text as it arrives; the run records each reply whole, as without it.

Needs ``pip install "polyloop[openai]"`` (and ``polyloop[trio]`` for ``--backend trio``).

The store is a :class:`~polyloop.stores.MemoryStore`: this run cannot be resumed after
the process ends. Swap in ``SqliteStore("runs.db")`` or ``JsonlStore("runs/")`` and call
:func:`polyloop.resume` with the same request to get crash recovery.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import openai

from polyloop import (
    Budget,
    Definition,
    Event,
    EventKind,
    Injection,
    JSONValue,
    Message,
    NullSink,
    ObservationTexts,
    Replay,
    Request,
    Role,
    RunResult,
    StopReason,
    TextDelta,
    ToolRegistry,
    ToolSpec,
    ToolStyle,
    run,
)
from polyloop.adapters.openai import OpenAIModelClient
from polyloop.interpreters import JsonToolCallInterpreter, NativeToolCallInterpreter
from polyloop.stores import MemoryStore

DEFAULT_TASK = "Compute (17 + 25) * 3 with the tools, then submit the result."

SYSTEM_PROMPT = """You solve tasks with tools. Every reply holds exactly one JSON object,
on its own or in one ```json block:
  {"tool": "<tool name>", "arguments": {...}}   to call a tool, or
  {"answer": "<text>"}                          to answer without a tool.
The tools and their JSON Schemas follow. Use submit to hand in your final result."""

NUMBERS: dict[str, JSONValue] = {
    "type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SUBMISSION: dict[str, JSONValue] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def build_tools() -> ToolRegistry:
    """Two pure arithmetic tools (safe to repeat) and ``submit``, which ends the run."""

    async def add(arguments: dict[str, Any], *, result_id: str) -> str:
        return _number(arguments["a"] + arguments["b"])

    async def multiply(arguments: dict[str, Any], *, result_id: str) -> str:
        return _number(arguments["a"] * arguments["b"])

    async def submit(arguments: dict[str, Any], *, result_id: str) -> str:
        return f"Submitted: {arguments['answer']}"

    return ToolRegistry(
        [
            ToolSpec(
                name="add",
                description="Add two numbers.",
                parameters=NUMBERS,
                handler=add,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="multiply",
                description="Multiply two numbers.",
                parameters=NUMBERS,
                handler=multiply,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="submit",
                description="Submit the final result.",
                parameters=SUBMISSION,
                handler=submit,
                completes=True,
            ),
        ],
        max_observation_chars=2_000,
    )


class ShowText(NullSink):
    """Prints the model's text as it arrives; every other event is dropped."""

    async def emit_delta(self, delta: TextDelta) -> None:
        if delta.index == 0:
            print(f"[step {delta.step}] ", end="")
        print(delta.text, end="", flush=True)

    async def emit(self, event: Event) -> None:
        if event.kind is EventKind.STEP_FINISHED:
            print(flush=True)  # the step's reply is whole: end its line


async def solve(
    client: openai.AsyncOpenAI,
    *,
    model: str,
    task: str,
    temperature: float = 0.0,
    max_steps: int = 10,
    run_id: str = "example-run",
    binding: Mapping[str, str] | None = None,
    store: bool = False,
    native: bool = False,
    stream: bool = False,
) -> RunResult:
    """Run the agent once on ``task`` and return how the run ended.

    With ``native``, the tools go to the server in its own tool-calling form and the
    model's tool calls are read as such; otherwise they are described in the prompt and
    the model answers with a JSON object. With ``stream``, the model's text is printed
    as it arrives.
    """
    sampling: dict[str, JSONValue] = {"temperature": temperature}
    if store:
        sampling["store"] = True
    definition = Definition(
        model=OpenAIModelClient(client, model=model, sampling=sampling, stream=stream),
        interpreter=NativeToolCallInterpreter() if native else JsonToolCallInterpreter(),
        store=MemoryStore(),
        events=ShowText() if stream else NullSink(),
        texts=ObservationTexts(
            not_executed="Not executed: {reason}", env_fault="Tool failure: {detail}"
        ),
    )
    tools = build_tools()
    request = Request(
        run_id=run_id,
        budget=Budget(max_steps=max_steps, max_valid_steps=max_steps, max_context_chars=50_000),
        executor=tools.executor(),
        tools=tools,
        run_context=(Message.text(Role.SYSTEM, SYSTEM_PROMPT),),
        goal_context=(Message.text(Role.USER, task),),
        injection=Injection(entries={}),
        binding=dict(binding or {}),
        model_replay=Replay.ALLOWED,
        observation_template="Tool result: {observation}",
        tool_style=ToolStyle.NATIVE if native else ToolStyle.JSON,
        cancel_grace_s=5.0,
    )
    return await run(definition, request)


def report(result: RunResult) -> str:
    """The trajectory, one line per step, and how the run ended."""
    lines = []
    for step in result.steps:
        if step.error is not None:
            lines.append(f"step {step.step}: model failure: {step.error}")
        elif step.action_text is not None:
            lines.append(f"step {step.step}: {step.action_text} -> {step.observation}")
        elif step.final_answer is not None:
            lines.append(f"step {step.step}: answer {step.final_answer!r}")
        else:
            lines.append(f"step {step.step}: unusable reply, told: {step.observation}")
    lines.append(
        f"stopped: {result.stop_reason.value} after {result.step_count} steps"
        + (f" ({result.detail})" if result.detail else "")
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run a small PolyLoop agent on an OpenAI-compatible model server."
    )
    parser.add_argument(
        "--base-url",
        required=True,
        help="the server's OpenAI-compatible base URL, e.g. http://localhost:11434/v1",
    )
    parser.add_argument("--model", required=True, help="the model name the server knows")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", "not-needed"),
        help="API key (default: $OPENAI_API_KEY)",
    )
    parser.add_argument("--task", default=DEFAULT_TASK)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument(
        "--max-retries", type=int, default=2, help="the SDK's own retries; PolyLoop adds none"
    )
    parser.add_argument(
        "--binding",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a coordinate of the run, sent as request metadata (repeatable)",
    )
    parser.add_argument(
        "--store",
        action="store_true",
        help="send store=true (OpenAI accepts metadata only with it)",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="use the server's own tool calling instead of JSON in the reply text",
    )
    parser.add_argument(
        "--stream", action="store_true", help="print the model's text as it arrives"
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args(argv)
    pairs = [item.partition("=") for item in args.binding]
    if any(not key or not sep for key, sep, _ in pairs):
        parser.error("--binding takes KEY=VALUE")
    args.binding = {key: value for key, _, value in pairs}
    return args


async def amain(args: argparse.Namespace) -> int:
    async with openai.AsyncOpenAI(
        base_url=args.base_url, api_key=args.api_key, max_retries=args.max_retries
    ) as client:
        result = await solve(
            client,
            model=args.model,
            task=args.task,
            temperature=args.temperature,
            max_steps=args.max_steps,
            binding=args.binding,
            store=args.store,
            native=args.native,
            stream=args.stream,
        )
    print(report(result))
    return 0 if result.stop_reason in (StopReason.SUBMITTED, StopReason.FINAL_ANSWER) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return anyio.run(amain, args, backend=args.backend)


if __name__ == "__main__":
    sys.exit(main())
