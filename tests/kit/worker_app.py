"""The application a ``polyloop worker`` process hosts in the tests: ``kit.worker_app:lifespan``.

Its one agent, ``payer``, pays through the ``pay`` tool ``$WORKER_PAYMENTS`` times (one
step each; once unless told) and answers, on the store ``$WORKER_STORE`` (``sqlite:FILE``
or a PostgreSQL URL, whose claims hold for ``$WORKER_LEASE_S`` seconds, 3 unless told).
``kit.worker_app:others`` hosts an agent of another name, ``other``, on the same store.

The outside world is the ledger ``$WORKER_LEDGER``: a file that every process appends to
and syncs line by line, ``<what> <result id> <pid>``. A call of ``pay`` notes ``entered``
when it starts and ``paid`` once it paid. Options, all from the environment:

* ``$WORKER_GATE``: a call waits until that file exists, before it pays, or with
  ``$WORKER_HOLD=after`` once it paid and before it returns (a process killed there
  paid, and its step was never recorded);
* ``$WORKER_APPROVAL=1``: a call needs a person's approval first;
* ``$WORKER_PROBE=1``: the tool has a probe that reads the ledger (noting ``probed``):
  a payment under the key means it ran; otherwise it notes ``void``, the key can never
  pay, and it did not run.

The test process builds the same agent from the same settings (:func:`agent`) to start
runs, so both build one request.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from kit import child_agent
from kit.agent import NUMBER_SCHEMA, answer, definition, request, tool_call
from polyloop import Agent, JSONValue, Reconciled, Request, Store, ToolRegistry, ToolSpec

VOID = "no payment under {key}; the key is void"


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One line of the ledger: what happened to which call, in which process."""

    what: str
    result_id: str
    pid: int

    @property
    def run_id(self) -> str:
        return self.result_id.rsplit(":", 2)[0]

    @property
    def step(self) -> int:
        return int(self.result_id.rsplit(":", 2)[1])


def read_ledger(path: str | Path) -> list[Entry]:
    """The ledger's lines, in the order they were written; none if nothing was."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    entries = []
    for line in text.splitlines():
        what, result_id, pid = line.split(" ")
        entries.append(Entry(what=what, result_id=result_id, pid=int(pid)))
    return entries


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What the environment says the application is (see the module documentation)."""

    store: str
    ledger: str
    gate: str | None = None
    hold_after_paying: bool = False
    approval: bool = False
    probe: bool = False
    payments: int = 1
    lease_s: float = 3.0

    @classmethod
    def of(cls, env: Mapping[str, str]) -> Settings:
        return cls(
            store=env["WORKER_STORE"],
            ledger=env["WORKER_LEDGER"],
            gate=env.get("WORKER_GATE") or None,
            hold_after_paying=env.get("WORKER_HOLD") == "after",
            approval=env.get("WORKER_APPROVAL") == "1",
            probe=env.get("WORKER_PROBE") == "1",
            payments=int(env.get("WORKER_PAYMENTS", "1")),
            lease_s=float(env.get("WORKER_LEASE_S", "3")),
        )


class _Till:
    """The ``pay`` tool and its probe over the ledger of ``settings``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def pay(self, arguments: dict[str, Any], *, result_id: str) -> str:
        await self._note("entered", result_id)
        if not self.settings.hold_after_paying:
            await self._gate()
        if await self._find("void", result_id):
            raise RuntimeError(f"payment key {result_id} was voided")
        await self._note("paid", result_id)
        if self.settings.hold_after_paying:
            await self._gate()
        return f"paid {arguments['n']}"

    async def probe(self, arguments: dict[str, Any], *, result_id: str) -> Reconciled:
        await self._note("probed", result_id)
        if await self._find("paid", result_id):
            return Reconciled(ran=True, observation=f"paid {arguments['n']}")
        await self._note("void", result_id)
        return Reconciled(ran=False, observation=VOID.format(key=result_id))

    async def _gate(self) -> None:
        gate = self.settings.gate
        # The gate is a file another process creates: there is no event to wait on.
        while gate and not await anyio.Path(gate).exists():  # noqa: ASYNC110
            await anyio.sleep(0.02)

    async def _note(self, what: str, result_id: str) -> None:
        line = f"{what} {result_id} {os.getpid()}"
        await anyio.to_thread.run_sync(child_agent.append_synced, self.settings.ledger, line)

    async def _find(self, what: str, result_id: str) -> bool:
        entries = await anyio.to_thread.run_sync(read_ledger, self.settings.ledger)
        return any(entry.what == what and entry.result_id == result_id for entry in entries)


def script(payments: int) -> list[str]:
    """The model's replies: ``payments`` payments of 1, 2, ... coins, then an answer."""
    return [tool_call("pay", n=index + 1) for index in range(payments)] + [answer("paid")]


def agent(store: Store, settings: Settings, *, name: str = "payer") -> Agent:
    till = _Till(settings)
    spec = ToolSpec(
        name="pay",
        description="Pay n coins.",
        parameters=NUMBER_SCHEMA,
        handler=till.pay,
        needs_approval=settings.approval,
        reconcile=till.probe if settings.probe else None,
    )
    registry = ToolRegistry([spec], max_observation_chars=1_000)

    def request_for(run_id: str, input: JSONValue) -> Request:
        return request(run_id, registry)

    return Agent(
        name=name,
        definition=definition(store, script=script(settings.payments)),
        request_for=request_for,
    )


def open_store(settings: Settings) -> Any:
    """A new store object over the application's store."""
    return child_agent.open_store(settings.store, lease_s=settings.lease_s)


@asynccontextmanager
async def lifespan() -> AsyncIterator[list[Agent]]:
    settings = Settings.of(os.environ)
    async with open_store(settings) as store:
        yield [agent(store, settings)]


@asynccontextmanager
async def others() -> AsyncIterator[list[Agent]]:
    """An application that hosts only ``other``: it must leave ``payer``'s runs alone."""
    settings = Settings.of(os.environ)
    async with open_store(settings) as store:
        yield [agent(store, settings, name="other")]
