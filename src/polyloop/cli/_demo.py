"""``polyloop demo``: run the demo agent on a durable store, crash it on purpose, resume it.

Progress comes from an event sink: each finished step is printed as its record lands.
``--crash-after-writes N`` wraps the store so that the process ends with ``os._exit``
right after the N-th write returns: no cleanup, no end record, exactly what a killed
process leaves behind. ``--resume RUN_ID`` then continues the run and shows which steps
came back from the log and which tools ran in this process.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import ParamSpec

import anyio
import anyio.to_thread
from rich.console import Console
from rich.text import Text

from polyloop.cli._agent import (
    TEXTS,
    Ledger,
    TextToolInterpreter,
    build_request,
    build_tools,
    load_data,
    script,
)
from polyloop.cli._common import CliError, command_words, install_hint, print_line
from polyloop.cli._render import step_line
from polyloop.cli._stores import StoreSpec, open_store, wrong_kind
from polyloop.ports import Event, EventKind, ManagedStore, ModelClient, Store
from polyloop.session import Definition, resume, run, run_status
from polyloop.testing import FaultyStore
from polyloop.tools import ToolRegistry
from polyloop.types import (
    JSONValue,
    RunLocked,
    RunNotFound,
    RunResult,
    RunState,
    RunStatus,
    StepRecord,
    StopReason,
    StoreError,
)

DEFAULT_STORE = "sqlite:polyloop-demo/demo.db"
CRASH_EXIT_STATUS = 3
UNFINISHED_EXIT_STATUS = 2
_Args = ParamSpec("_Args")
COMPLETED = frozenset({StopReason.SUBMITTED, StopReason.FINAL_ANSWER, StopReason.ENV_DONE})


@dataclass(frozen=True, slots=True)
class DemoOptions:
    run_id: str
    store: StoreSpec
    store_given: bool
    resume: str | None
    crash_after_writes: int | None
    model: str
    base_url: str | None
    model_name: str | None
    api_key: str | None
    pace: float


class ProgressSink:
    """An event sink that prints each finished step."""

    def __init__(self, out: Console, *, note: str | None = None) -> None:
        self._out = out
        self._note = note

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "cli-progress"}

    async def emit(self, event: Event) -> None:
        if event.kind is EventKind.STEP_FINISHED and isinstance(event.record, StepRecord):
            print_line(self._out, step_line(event.record, note=self._note))
            self._out.file.flush()  # progress must show even through a pipe


class CrashingStore(FaultyStore):
    """The testing store's crash made real: the process ends right after write ``limit``.

    The exit comes before the write that :class:`FaultyStore` would refuse, so no
    cleanup runs and no end record is written, exactly as when a process is killed.
    """

    def __init__(self, inner: Store, limit: int, before_exit: Callable[[int], None]) -> None:
        super().__init__(inner, fail_after_writes=limit)
        self._before_exit = before_exit

    async def _write(
        self, write: Callable[_Args, Awaitable[None]], *args: _Args.args, **kwargs: _Args.kwargs
    ) -> None:
        await super()._write(write, *args, **kwargs)
        if self.crashed:
            self._before_exit(self.writes)
            os._exit(CRASH_EXIT_STATUS)


async def demo(options: DemoOptions, out: Console) -> int:
    """Run (or resume) the demo agent; the exit status."""
    data = load_data()
    ledger = Ledger()
    problem = await anyio.to_thread.run_sync(wrong_kind, options.store)
    if problem is not None:
        raise CliError(f"cannot open the store {options.store.shown}: {problem}")
    # Only a new run makes its store; resuming one needs the store it ran in.
    creating = options.resume is None
    async with open_store(options.store, create=creating) as store, _model(options, data) as model:
        await _try_the_store(store, options)
        before = await _announce(store, options, out)
        result, crashing = await _drive(store, model, build_tools(data, ledger), options, out)
    if crashing is not None:
        _say(out, f"no crash: the run made only {crashing.writes} store writes", "yellow")
    _summary(result, out)
    if options.resume:
        _proof(result, before, ledger, out)
    inspect = shlex.join([*command_words(), "show", options.store.text, options.run_id])
    _say(out, f"inspect it: {inspect}", "dim")
    return 0 if result.stop_reason in COMPLETED else UNFINISHED_EXIT_STATUS


async def _try_the_store(store: ManagedStore, options: DemoOptions) -> None:
    """Claim the run and give it back, so that a store that cannot be made or written (a
    path under a regular file, a directory without write permission) is named as such,
    before the run starts and the failure would read as the run's own."""
    if options.store.kind == "postgresql":
        return  # already reached: opening the store connected once
    if options.resume is not None and not await anyio.Path(options.store.location).exists():
        return  # no store, so no such run: _announce says so, and nothing is created
    try:
        await store.claim_run(options.run_id)
    except RunLocked:
        return  # another process drives the run: _announce says so
    except StoreError as exc:
        raise CliError(f"cannot open the store {options.store.shown}: {exc.reason}") from None
    await store.release_run(options.run_id)


async def _await_lease(store: ManagedStore, status: RunStatus, out: Console) -> RunStatus:
    """A crashed PostgreSQL worker's lease holds its run until most of it has run out
    (research record 0034): wait for that, never past the lease's end, rather than refuse."""
    until = status.lease_expires_at
    assert until is not None
    _say(out, f"the run is held under a lease until {until:%H:%M:%S %Z}; waiting", "dim")
    with anyio.move_on_after((until - datetime.now(UTC)).total_seconds() + 1.0):
        while status.state is RunState.RUNNING:
            await anyio.sleep(0.25)
            status = await run_status(store, status.run_id)
    return status


async def _announce(store: ManagedStore, options: DemoOptions, out: Console) -> RunStatus | None:
    """Say what is about to run; on resume, show the steps already on record."""
    run_id = options.run_id
    model = "scripted model" if options.model == "scripted" else f"model {options.model_name}"
    if options.resume is None:
        _say(out, f"demo run {run_id} on {options.store.shown} ({model})", "bold")
        return None
    try:
        status = await run_status(store, run_id)
    except RunNotFound:
        raise CliError(f"unknown run id {run_id!r} in {options.store.shown}") from None
    if status.state is RunState.RUNNING and status.lease_expires_at is not None:
        status = await _await_lease(store, status, out)
    if status.state is RunState.RUNNING:
        raise CliError(f"run {run_id!r} is being driven by another process right now")
    _say(
        out,
        f"resuming {run_id} on {options.store.shown} ({model}): {status.steps} steps on record",
        "bold",
    )
    for record in (await store.read_log(run_id)).records:
        if isinstance(record, StepRecord):
            print_line(out, step_line(record, note="read from the log"))
    return status


async def _drive(
    store: Store, model: ModelClient, tools: ToolRegistry, options: DemoOptions, out: Console
) -> tuple[RunResult, CrashingStore | None]:
    """Run or resume; also the crashing wrapper, if there was one (it did not fire)."""
    status: AbstractContextManager[object] = (
        out.status("working…", spinner="dots") if out.is_terminal else nullcontext()
    )
    with status as spinner:
        writer = _maybe_crashing(store, options, out, spinner)
        definition = Definition(
            model=model,
            interpreter=TextToolInterpreter(),
            store=writer,
            events=ProgressSink(out, note="ran now" if options.resume else None),
            texts=TEXTS,
        )
        drive = resume if options.resume else run
        result = await drive(definition, build_request(options.run_id, tools))
    return result, writer if isinstance(writer, CrashingStore) else None


def _maybe_crashing(store: Store, options: DemoOptions, out: Console, spinner: object) -> Store:
    if options.crash_after_writes is None:
        return store

    def before_exit(writes: int) -> None:
        stop = getattr(spinner, "stop", None)
        if callable(stop):
            stop()
        _say(out, f"simulated crash: the process ends right after store write {writes}", "bold red")
        _say(out, f"resume it with: {resume_command(options, options.run_id)}")
        sys.stdout.flush()
        sys.stderr.flush()

    return CrashingStore(store, options.crash_after_writes, before_exit)


def new_run_id() -> str:
    """A fresh id for a demo run."""
    return f"demo-{secrets.token_hex(4)}"


def resume_command(options: DemoOptions, run_id: str) -> str:
    """The exact command that resumes ``run_id`` with the same store and model."""
    words = [*command_words(), "demo", "--resume", run_id]
    if options.store_given:
        words += ["--store", options.store.text]
    if options.store.schema is not None:
        words += ["--schema", options.store.schema]
    if options.model != "scripted":
        words += [
            "--model",
            options.model,
            "--base-url",
            options.base_url or "",
            "--model-name",
            options.model_name or "",
        ]
    return shlex.join(words)


@asynccontextmanager
async def _model(options: DemoOptions, data: Mapping[str, str]) -> AsyncIterator[ModelClient]:
    if options.model == "scripted":
        from polyloop.testing import ScriptedModelClient

        yield ScriptedModelClient(script(data), delay=options.pace, name="polyloop-demo")
        return
    try:
        import openai

        from polyloop.adapters.openai import OpenAIModelClient
    except ImportError:
        raise CliError(
            f"--model openai needs the openai package: {install_hint('openai')}"
        ) from None
    api_key = options.api_key or os.environ.get("OPENAI_API_KEY") or "unused"
    async with openai.AsyncOpenAI(
        base_url=options.base_url, api_key=api_key, max_retries=0
    ) as client:
        yield OpenAIModelClient(client, model=options.model_name or "", sampling={"temperature": 0})


def _summary(result: RunResult, out: Console) -> None:
    style = "green" if result.stop_reason in COMPLETED else "yellow"
    line = Text()
    line.append("stopped: ", "bold")
    line.append(result.stop_reason.value, style=f"bold {style}")
    line.append(f" after {result.step_count} steps ({result.valid_step_count} valid)")
    print_line(out, line)
    submitted = [
        step
        for step in result.steps
        if step.action_text is not None and step.action_text.startswith("submit(")
    ]
    if result.stop_reason is StopReason.SUBMITTED and submitted:
        _say(out, f"  {submitted[-1].observation}")
    if result.final_answer is not None:
        _say(out, f"  answer: {result.final_answer}")
    if result.detail is not None:
        _say(out, f"  detail: {result.detail}")


def _proof(result: RunResult, before: RunStatus | None, ledger: Ledger, out: Console) -> None:
    """Show that the resume redid nothing that was on record."""
    recorded = before.steps if before is not None else 0
    if before is not None and before.state is RunState.FINISHED:
        _say(out, "the run had already finished: nothing ran, its result was read back")
    ran_now = [step.step for step in result.steps if step.step >= recorded]
    executed = ledger.steps()
    _say(
        out,
        f"resume: {recorded} steps read back from the log (not run again), "
        f"{len(ran_now)} steps ran now {_steps(ran_now)}",
    )
    _say(out, f"tool executions in this process: {len(executed)} {_steps(executed)}")
    repeated = sorted({step for step in executed if step < recorded})
    if repeated:
        _say(out, f"a recorded step ran again: {_steps(repeated)}", "bold red")
    else:
        _say(out, "no step was repeated", "green")


def _say(out: Console, text: str, style: str = "") -> None:
    print_line(out, Text(text, style=style))


def _steps(steps: list[int]) -> str:
    return "(steps " + ", ".join(str(step) for step in steps) + ")" if steps else ""
