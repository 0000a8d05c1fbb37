"""Agents: a definition paired with the way to build a run's request from its input.

A run started through an agent names the agent and holds its JSON input in its start
record, so any process hosting an agent of that name can build the same request and
drive the run: the worker, an application's own task group, or Temporal
(docs/running-agents.md). Annotations are evaluated at class creation (no ``from __future__
import annotations``), as in ``_values``: the class's public home is :mod:`polyloop.session`.
"""

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from polyloop import serialization
from polyloop.ports import ManagedStore
from polyloop.session import _amending
from polyloop.session._driving import Mode, Origin, drive, register
from polyloop.session._values import Definition, Request
from polyloop.types import (
    Amendment,
    InvalidRequest,
    JSONValue,
    RunResult,
    RunStarted,
    UnloggableValue,
)

__all__ = ("Agent", "RequestFor", "resume_as")

RequestFor = Callable[[str, JSONValue], Request | Awaitable[Request]]
"""``request_for(run_id, input)``: a function or a coroutine function."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Agent:
    """An agent any host can drive: a name, what its runs share, and how to build a request.

    ``request_for(run_id, input)`` (a function or a coroutine function) gets a run id and
    the JSON value the run was started with, and must build the same request in every
    process and on every attempt, or the run is refused with
    :class:`~polyloop.types.RunIdentityMismatch`. ``status_store`` is the store read to
    list and describe runs (default: the definition's store, which every store PolyLoop
    ships can serve).

    ``amend`` is the amendment every host of the agent resumes its runs with
    (:func:`polyloop.resume`'s ``amend``): the snapshot keys a deploy of this agent may
    change under a run in flight, who stands behind that and why. A run that differs
    from its snapshot only in those keys goes on, and its log says what changed; any
    other difference is refused as without it. ``AmendmentRefused`` at construction for
    one that accepts what may never change.
    """

    name: str
    definition: Definition
    request_for: RequestFor
    status_store: ManagedStore | None = None
    amend: Amendment | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest(f"an agent's name must be a non-empty string, not {self.name!r}")
        if not callable(self.request_for):
            raise InvalidRequest(f"agent {self.name!r}: request_for must be callable")
        if self.amend is not None:
            _amending.checked(self.amend, None)

    async def request(self, run_id: str, input: JSONValue) -> Request:
        """The request ``request_for`` builds for ``run_id`` from ``input``.

        Raises :class:`~polyloop.types.InvalidRequest` naming the run if ``input`` is not
        a value the log can hold, or if the request is for another run.

        Cancellation: nothing is read or written; a coroutine ``request_for`` is cancelled.
        """
        origin = self._origin(run_id, input)
        built = self.request_for(run_id, origin.input)
        request = await built if inspect.isawaitable(built) else built
        if not isinstance(request, Request) or request.run_id != run_id:
            found = request.run_id if isinstance(request, Request) else type(request).__name__
            raise InvalidRequest(
                f"request_for of agent {self.name!r} returned a request for {found!r}",
                run_id=run_id,
            )
        return request

    async def start(self, run_id: str, input: JSONValue) -> None:
        """Make the run ``run_id`` exist durably, recording this agent and ``input``; do
        not drive it. A host of this agent (``polyloop worker``) drives it from there.

        Starting a run that was already started with this agent, the same input and the
        same snapshot changes nothing, so a retried call is safe; one started otherwise
        raises :class:`~polyloop.types.RunIdentityMismatch` listing the differences. A
        snapshot that differs only as the agent's ``amend`` accepts (a deploy since the
        first call) is safe too, and still nothing is written: the host that resumes the
        run records the amendment before it goes on. A difference the amendment may not
        accept raises :class:`~polyloop.types.AmendmentRefused`, as the host's resume
        would. Raises what :func:`polyloop.run` raises before it drives
        (``InvalidRequest``, ``RunLocked`` while another writer holds an unstarted run,
        ``StoreError``).

        Cancellation: the start record landed whole or not at all; the claim is given up
        under a shielded, time-bounded scope either way.
        """
        request = await self.request(run_id, input)
        await register(self.definition, request, self._origin(run_id, input), self.amend)

    async def run(self, run_id: str, input: JSONValue) -> RunResult:
        """Start the run ``run_id`` here (or resume it, if it exists) and drive it until
        it stops: :func:`polyloop.start_or_resume` for a run of this agent.

        A run that exists must have been started with this agent and ``input``
        (:class:`~polyloop.types.RunIdentityMismatch` otherwise, nothing written).

        Cancellation: as for :func:`polyloop.run`.
        """
        request = await self.request(run_id, input)
        origin = self._origin(run_id, input)
        return await drive(self.definition, request, Mode.EITHER, origin=origin, amend=self.amend)

    def _origin(self, run_id: str, input: JSONValue) -> Origin:
        if not isinstance(run_id, str) or not run_id:
            raise InvalidRequest(f"agent {self.name!r}: run_id must be a non-empty string")
        try:
            encoded = serialization.encode(
                RunStarted(run_id=run_id, snapshot={}, agent=self.name, input=input)
            )
        except UnloggableValue as exc:
            raise InvalidRequest(
                f"the input for agent {self.name!r} cannot be recorded: {exc.reason}",
                run_id=run_id,
            ) from exc
        return Origin(agent=self.name, input=encoded.get("input"))


async def resume_as(agent: Agent, request: Request, input: JSONValue) -> RunResult:
    """Resume the run ``agent`` started with ``input``, its request built by
    :meth:`Agent.request`: how a host drives a run another process started (under the
    agent's amendment, if it has one)."""
    origin = agent._origin(request.run_id, input)
    return await drive(agent.definition, request, Mode.RESUME, origin=origin, amend=agent.amend)
