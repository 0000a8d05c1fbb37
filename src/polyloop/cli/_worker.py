"""``polyloop worker MODULE:ATTR``: host the agents a module names until a signal stops it.

ATTR is an ``Agent``, a sequence or a mapping of them, or a function returning an async
context manager that yields them (the module opens its stores and clients in it, as a
Starlette lifespan does). The first SIGTERM or SIGINT drains (nothing new is claimed,
each run stops at its next step boundary); a second one cancels what still runs, whose
end records the kernel writes within each run's grace.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.to_thread

from polyloop._escaping import escape_field
from polyloop.cli._common import PROGRAM, CliError
from polyloop.session import Agent, serve_agents

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SHAPES = (
    "an Agent, a sequence or mapping of agents, or a function returning an async "
    "context manager that yields them"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    target: str
    concurrency: int
    poll_s: float
    drain_grace_s: float
    as_json: bool


async def worker(options: WorkerOptions) -> int:
    """Serve the target's agents until signalled; 0 once they are drained."""
    found = await anyio.to_thread.run_sync(load_target, options.target)
    with _printing(as_json=options.as_json):
        async with agents_of(found, options.target) as agents:
            stop = anyio.Event()
            async with anyio.create_task_group() as group:
                group.start_soon(_watch_signals, stop, group.cancel_scope)
                await serve_agents(
                    agents,
                    concurrency=options.concurrency,
                    poll_s=options.poll_s,
                    stop=stop.wait,
                    drain_grace_s=options.drain_grace_s,
                )
                group.cancel_scope.cancel()
    return 0


def load_target(target: str) -> Any:
    """The object ``MODULE:ATTR`` names, the module imported with the current directory
    on the path (as ``python -m`` would)."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise CliError(f"expected MODULE:ATTR (such as app:agents), not {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise CliError(f"cannot import {module_name!r}: no module named {exc.name!r}") from None
        raise CliError(f"importing {module_name!r} failed: {_text(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the module's own failure, shown in one line
        raise CliError(f"importing {module_name!r} failed: {_text(exc)}") from None
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise CliError(f"{target!r}: {module_name!r} has no attribute {attribute!r}") from None
    return found


@asynccontextmanager
async def agents_of(found: Any, target: str) -> AsyncIterator[list[Agent]]:
    """The agents ``found`` holds or, for a function, yields from its context manager."""
    if callable(found) and not isinstance(found, Agent):
        try:
            opened = found()
        except Exception as exc:  # noqa: BLE001 - the application's failure, in one line
            raise CliError(f"{target!r} raised {_text(exc)}") from None
        if not hasattr(opened, "__aenter__") or not hasattr(opened, "__aexit__"):
            raise CliError(f"{target!r} returned {type(opened).__name__}: expected {_SHAPES}")
        async with opened as yielded:
            yield _agents(yielded, target)
    else:
        yield _agents(found, target)


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _agents(found: Any, target: str) -> list[Agent]:
    if isinstance(found, Agent):
        return [found]
    if isinstance(found, Mapping):
        found = list(found.values())
    if isinstance(found, Sequence) and not isinstance(found, str):
        agents = list(found)
        if agents and all(isinstance(agent, Agent) for agent in agents):
            return agents
    raise CliError(f"{target!r} is {type(found).__name__}: expected {_SHAPES}")


async def _watch_signals(stop: anyio.Event, hard: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(*SIGNALS) as received:
        async for _ in received:
            if stop.is_set():
                _note("stopping at once: the runs still driven end cancelled, resumable")
                hard.cancel()
                return
            _note("draining: each run stops at its next step boundary (signal again to stop now)")
            stop.set()


def _note(text: str) -> None:
    print(f"{PROGRAM} worker: {text}", file=sys.stderr, flush=True)


class _Lines(logging.Handler):
    """One line per host record on standard output: words, or JSON with ``--json``."""

    def __init__(self, *, as_json: bool) -> None:
        super().__init__(level=logging.INFO)
        self.as_json = as_json

    def emit(self, record: logging.LogRecord) -> None:
        facts = getattr(record, "polyloop_worker", None)
        at = datetime.fromtimestamp(record.created, UTC)
        if self.as_json:
            line = json.dumps(
                {"at": at.isoformat(), **(facts or {"message": record.getMessage()})},
                ensure_ascii=False,
                default=str,
            )
        else:
            line = f"{at:%H:%M:%S} {escape_field(' '.join(record.getMessage().split()))}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@contextmanager
def _printing(*, as_json: bool) -> Iterator[None]:
    handler = _Lines(as_json=as_json)
    logger = logging.getLogger("polyloop.worker")
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved
