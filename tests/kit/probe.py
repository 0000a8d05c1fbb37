"""An outside payment ledger keyed by result id, with the ``pay`` tool's probe over it:
the shared fixture of the probe tests (issue 31).

``pay`` (replay never allowed) stores each payment under its result id and refuses a
second one; its probe ``finds`` returns the payment under the key (it ran) or writes a
tombstone for the key (it did not, and a late attempt with that key fails), and never
answers about a key in ``hangs_on``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import anyio.lowlevel

from kit.agent import ANSWER_SCHEMA, NUMBER_SCHEMA
from polyloop import Reconciled, Replay, ToolRegistry, ToolSpec
from polyloop.tools import ToolProbe

NOT_PAID = "no payment under {key}; the key is void"


class KeyVoided(Exception):
    """A payment arrived for a key the probe has tombstoned: the late attempt fails."""


@dataclasses.dataclass
class Payments:
    """The outside ledger: payments and tombstones by result id, each key used once.

    ``entered`` holds the key of every call of the handler; ``attempt`` numbers the
    process now driving the run; ``probed`` holds the attempt and key of every question
    the probe was asked. ``reachable=False`` stands for a request lost before it reached
    the processor: the handler returns, but nothing is paid.
    """

    payments: dict[str, int] = dataclasses.field(default_factory=dict)
    entered: list[str] = dataclasses.field(default_factory=list)
    tombstones: set[str] = dataclasses.field(default_factory=set)
    probed: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    attempt: int = 0
    before_paying: Callable[[], None] | None = None
    reachable: bool = True
    hangs_on: set[str] = dataclasses.field(default_factory=set)
    cancelled: list[str] = dataclasses.field(default_factory=list)

    def paid(self) -> list[str]:
        """The keys paid under, in the order they were paid."""
        return list(self.payments)

    async def pay(self, arguments: dict[str, Any], *, result_id: str) -> str:
        self.entered.append(result_id)
        await anyio.lowlevel.checkpoint()
        hook, self.before_paying = self.before_paying, None
        if hook is not None:
            hook()
        if result_id in self.tombstones:
            raise KeyVoided(f"payment key {result_id} was voided")
        assert result_id not in self.payments, f"a second payment under {result_id}"
        if self.reachable:
            self.payments[result_id] = arguments["n"]
        return f"paid {arguments['n']}"

    async def finds(self, arguments: dict[str, Any], *, result_id: str) -> Reconciled | None:
        """The probe: the payment under the key, or a tombstone that voids the key."""
        self.probed.append((self.attempt, result_id))
        await anyio.lowlevel.checkpoint()
        if result_id in self.hangs_on:
            await self._never_answered(result_id)
        if result_id in self.payments:
            return Reconciled(ran=True, observation=f"paid {self.payments[result_id]}")
        self.tombstones.add(result_id)
        return Reconciled(ran=False, observation=NOT_PAID.format(key=result_id))

    async def _never_answered(self, result_id: str) -> None:
        """The ledger's answer about ``result_id`` never comes; note the cancellation."""
        try:
            await anyio.Event().wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(result_id)
            raise

    async def cannot_tell(self, arguments: dict[str, Any], *, result_id: str) -> None:
        self.probed.append((self.attempt, result_id))
        await anyio.lowlevel.checkpoint()

    async def fails(self, arguments: dict[str, Any], *, result_id: str) -> Reconciled:
        self.probed.append((self.attempt, result_id))
        await anyio.lowlevel.checkpoint()
        raise ConnectionError("the ledger did not answer")


def tools(
    payments: Payments,
    probe: str | ToolProbe | None = "finds",
    replay: Replay = Replay.NEVER,
    *,
    probe_timeout_s: float = 30.0,
) -> ToolRegistry:
    """``double`` (replay allowed), ``pay`` (replay never unless told otherwise) with the
    probe named (a method of ``payments``) or given, bounded by ``probe_timeout_s``, and
    ``submit``."""
    reconcile = getattr(payments, probe) if isinstance(probe, str) else probe

    async def double(arguments: dict[str, Any], *, result_id: str) -> str:
        await anyio.lowlevel.checkpoint()
        return str(arguments["n"] * 2)

    return ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=NUMBER_SCHEMA,
                handler=double,
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="pay",
                description="Pay an amount.",
                parameters=NUMBER_SCHEMA,
                handler=payments.pay,
                replay=replay,
                reconcile=reconcile,
                reconcile_timeout_s=probe_timeout_s,
            ),
            ToolSpec(
                name="submit",
                description="Submit the answer.",
                parameters=ANSWER_SCHEMA,
                handler=double,
                replay=Replay.ALLOWED,
                completes=True,
            ),
        ],
        max_observation_chars=10_000,
    )
