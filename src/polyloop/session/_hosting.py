"""Hosting agents: drive every run of the hosted agents that can go on, until told to stop.

:class:`Host` is what ``polyloop.serve_agents`` and ``polyloop worker`` run. It lists
each store's unfinished runs, and reads a run's log only when the listing says the run
changed since it was last read (its last write, its claim, its lease), so runs that
finished cost nothing and runs that wait unchanged cost a row of the listing.
:func:`~polyloop.session._picking.choose` says what to do with a run; runs that go on
are driven by at most ``concurrency`` tasks, each through the kernel's own claim, so a
run is never driven twice (here by the set of runs in hand, elsewhere by the claim).

What wakes the host is one awaitable (``wait_for_change``, from :func:`watching`): a
sleep of ``poll_s``, or, when every hosted store is a :class:`~polyloop.ports.ChangeFeed`,
the first of their notifications or :data:`FEED_FALLBACK_S`; the listing stays the truth.

A graceful stop claims nothing new, lets each run being driven reach its next step
boundary (:mod:`~polyloop.session._draining`), and cancels what is still running after
``drain_grace_s``; the kernel then writes each run's ``CANCELLED`` end within its grace.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, TypeAlias

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from polyloop import _recovery
from polyloop._shared import exception_text
from polyloop.ports import ChangeFeed, ManagedStore, StoredRun
from polyloop.session import _draining
from polyloop.session._agents import Agent, resume_as
from polyloop.session._picking import Choice, choose
from polyloop.session._probes import probe_for
from polyloop.types import (
    CorruptLog,
    InvalidRequest,
    JSONValue,
    LeaseLost,
    RunIdentityMismatch,
    RunLocked,
    RunResult,
    SchemaMajorMismatch,
    StopReason,
    StoreError,
)

logger = logging.getLogger("polyloop.worker")

Agents: TypeAlias = Agent | Iterable[Agent] | Mapping[str, Agent]
Fingerprint: TypeAlias = tuple[datetime | None, bool, datetime | None]
_Key: TypeAlias = tuple[int, str]

# A run last written this recently is read again at the next change: a file's time may
# not tell apart two writes in one tick of the clock.
SETTLE_S = 1.0
# Stores that notify are still listed this often: a lease that runs out writes nothing,
# so a dead worker's runs wait this much longer than its lease (15 s by default).
FEED_FALLBACK_S = 5.0
# A log that breaks these rules stays broken until it changes: trying again is no use.
IN_DOUBT = _recovery.RecoveryState.IN_DOUBT
_REFUSALS = (RunIdentityMismatch, InvalidRequest, CorruptLog, SchemaMajorMismatch)
_WAITING = {
    StopReason.AWAITING_APPROVAL: Choice.AWAITS_APPROVAL,
    StopReason.IN_DOUBT: Choice.AWAITS_SETTLEMENT,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Hosted:
    """One store to list, and the hosted agents whose runs it holds, by name."""

    store: ManagedStore
    agents: Mapping[str, Agent]


def hosted_stores(agents: Agents) -> tuple[Hosted, ...]:
    """The stores to list for ``agents``, each once; refuses what cannot be hosted."""
    given = list(agents.values()) if isinstance(agents, Mapping) else agents
    listed = [given] if isinstance(given, Agent) else list(given)
    if not listed or not all(isinstance(agent, Agent) for agent in listed):
        raise InvalidRequest("serve_agents needs one or more polyloop.Agent objects")
    by_store: dict[int, Hosted] = {}
    names: set[str] = set()
    for agent in listed:
        if agent.name in names:
            raise InvalidRequest(f"two hosted agents are named {agent.name!r}")
        names.add(agent.name)
        store = agent.status_store or agent.definition.store
        if not isinstance(store, ManagedStore):
            raise InvalidRequest(
                f"agent {agent.name!r}: its store cannot list runs; give it a status_store"
            )
        hosted = by_store.setdefault(id(store), Hosted(store=store, agents={}))
        assert isinstance(hosted.agents, dict)
        hosted.agents[agent.name] = agent
    return tuple(by_store.values())


@asynccontextmanager
async def watching(
    hosted: tuple[Hosted, ...], *, poll_s: float
) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """What the host waits on between listings: the first notification of the hosted
    stores, or :data:`FEED_FALLBACK_S` (``poll_s`` if longer), when every one of them is a
    :class:`~polyloop.ports.ChangeFeed`; otherwise a sleep of ``poll_s``."""
    stores = [each.store for each in hosted]
    feeds = [store for store in stores if isinstance(store, ChangeFeed)]
    if len(feeds) < len(stores):
        yield partial(anyio.sleep, poll_s)
        return
    async with AsyncExitStack() as stack:
        waits = [await stack.enter_async_context(feed.changes()) for feed in feeds]
        yield partial(_first_change, waits, max(poll_s, FEED_FALLBACK_S))


async def _first_change(waits: Sequence[Callable[[], Awaitable[None]]], most_s: float) -> None:
    with anyio.move_on_after(most_s):
        if len(waits) == 1:
            await waits[0]()
            return
        async with anyio.create_task_group() as group:

            async def wake(wait: Callable[[], Awaitable[None]]) -> None:
                await wait()
                group.cancel_scope.cancel()

            for wait in waits:
                group.start_soon(wake, wait)


def fingerprint(stored: StoredRun) -> Fingerprint:
    """What the listing says of a run that tells whether it changed."""
    return (stored.updated_at, stored.claimed, stored.lease_expires_at)


@dataclass(slots=True, kw_only=True)
class _Seen:
    """What the host last made of a run: the listing it read the log at (``None``: read
    it at the next change), how many records the log had, and what it last said."""

    fingerprint: Fingerprint | None
    records: int
    said: Choice | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    key: _Key
    agent: Agent
    input: JSONValue
    why: Choice
    owner: str | None

    @property
    def run_id(self) -> str:
        return self.key[1]


def _utc_now() -> datetime:
    return datetime.now(UTC)


class Host:
    """The runs of ``hosted``'s agents that can go on, driven until :meth:`serve` stops."""

    def __init__(
        self,
        hosted: tuple[Hosted, ...],
        *,
        concurrency: int,
        wait_for_change: Callable[[], Awaitable[object]],
        drain_grace_s: float,
        now: Callable[[], datetime] = _utc_now,
    ) -> None:
        self.hosted = hosted
        self.concurrency = concurrency
        self.wait_for_change = wait_for_change
        self.drain_grace_s = drain_grace_s
        self.now = now
        self.drain = _draining.Drain()
        self.seen: dict[_Key, _Seen] = {}
        self.busy: set[_Key] = set()
        self._warned: dict[object, str] = {}
        self._working = 0
        self._idle = anyio.Event()

    async def serve(self, stop: Callable[[], Awaitable[object]]) -> None:
        """Drive runs until ``stop()`` returns, then drain; cancelled, cancel them all."""
        send, receive = anyio.create_memory_object_stream[_Job](math.inf)
        names = ", ".join(repr(name) for hosted in self.hosted for name in hosted.agents)
        text = f"hosting {names}, driving at most {self.concurrency} runs at once"
        self._say(logging.INFO, "serving", None, text)
        async with anyio.create_task_group() as workers:
            for _ in range(self.concurrency):
                self._working += 1
                workers.start_soon(self._work, receive.clone())
            receive.close()
            async with anyio.create_task_group() as polling:
                polling.start_soon(self._poll, send)
                await stop()
                # Set before the poller stops, so no queued run is taken meanwhile.
                self.drain.requested = True
                polling.cancel_scope.cancel()
            self._say(logging.INFO, "draining", None, f"stopping: {len(self.busy)} runs in hand")
            with anyio.move_on_after(self.drain_grace_s):
                await self._idle.wait()
            workers.cancel_scope.cancel()

    # -- noticing ----------------------------------------------------------------------

    async def _poll(self, send: MemoryObjectSendStream[_Job]) -> None:
        with send:
            while True:
                for index, hosted in enumerate(self.hosted):
                    await self._look_at_store(index, hosted, send)
                await self.wait_for_change()

    async def _look_at_store(
        self, index: int, hosted: Hosted, send: MemoryObjectSendStream[_Job]
    ) -> None:
        try:
            listed = await hosted.store.list_runs(unfinished_only=True)
        except Exception as exc:  # noqa: BLE001 - a store that fails is reported and asked again
            self._warn(("store", index), None, f"could not list runs: {exception_text(exc)}")
            return
        self._warned.pop(("store", index), None)
        here = {stored.run_id for stored in listed}
        for key in [key for key in self.seen if key[0] == index and key[1] not in here]:
            del self.seen[key]  # finished or pruned: never read again
            self._warned.pop(key, None)
        for stored in listed:
            key = (index, stored.run_id)
            seen = self.seen.get(key)
            if key in self.busy or stored.claimed:
                continue
            if seen is not None and seen.fingerprint == fingerprint(stored):
                continue
            await self._look_at_run(key, hosted, stored, send)

    async def _look_at_run(
        self, key: _Key, hosted: Hosted, stored: StoredRun, send: MemoryObjectSendStream[_Job]
    ) -> None:
        run_id, seen = key[1], self.seen.get(key)
        try:
            log = await hosted.store.read_log(run_id)
            plan = _recovery.read_plan(log)
        except _REFUSALS as exc:
            self._refuse(key, stored, -1, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a store that fails is reported and asked again
            self._warn(key, run_id, f"could not read its log: {exception_text(exc)}")
            return
        records, settled = len(log.records), self._settled(stored)
        # A cancel request is kept beside the log, not in it: news of its own, once.
        said = seen.said if seen is not None else None
        cancel_news = stored.cancel_requested and said is not Choice.CANCEL_REQUESTED
        if seen is not None and seen.records == records and not cancel_news:
            seen.fingerprint = settled  # nothing new in the log: nothing new to decide
            return
        started = plan.started
        agent = hosted.agents.get(started.agent or "") if started is not None else None
        has_probe = False
        if started is not None and agent is not None and plan.state is IN_DOUBT:
            try:
                request = await agent.request(run_id, started.input)
            except Exception as exc:  # noqa: BLE001 - request_for's failure is reported once
                self._refuse(key, stored, records, exc)
                return
            has_probe = probe_for(request.executor, plan) is not None
        choice = choose(stored, plan, hosted=hosted.agents.keys(), has_probe=has_probe)
        if choice.drives and agent is not None and started is not None:
            # Read again once driven: whatever the drive wrote decides what comes next.
            self.seen[key] = _Seen(fingerprint=None, records=records, said=choice)
            self.busy.add(key)
            job = _Job(key=key, agent=agent, input=started.input, why=choice, owner=stored.owner)
            send.send_nowait(job)
            return
        self.seen[key] = _Seen(fingerprint=settled, records=records, said=choice)
        if choice.waits_for_person and said is not choice:
            name = started.agent if started is not None else None
            self._say(logging.INFO, "waiting", run_id, choice.text, agent=name)

    def _settled(self, stored: StoredRun) -> Fingerprint | None:
        """``stored``'s fingerprint, or ``None`` if it was written too recently to trust."""
        at = stored.updated_at
        if at is None or (self.now() - at).total_seconds() < SETTLE_S:
            return None
        return fingerprint(stored)

    # -- driving -----------------------------------------------------------------------

    async def _work(self, receive: MemoryObjectReceiveStream[_Job]) -> None:
        try:
            with receive:
                async for job in receive:
                    if self.drain.requested:
                        self.busy.discard(job.key)  # claimed nothing: left for any host
                        continue
                    try:
                        await self._drive(job)
                    finally:
                        self.busy.discard(job.key)
        finally:
            self._working -= 1
            if self._working == 0:
                self._idle.set()

    async def _drive(self, job: _Job) -> None:
        run_id = job.run_id
        driven = False

        def claimed(_: str) -> None:
            nonlocal driven
            driven = True
            owner = f" (left by {job.owner})" if job.owner and job.why is Choice.INTERRUPTED else ""
            text = f"driving it: {job.why.text}{owner}"
            self._say(logging.INFO, "driving", run_id, text, agent=job.agent.name, why=job.why)

        try:
            request = await job.agent.request(run_id, job.input)
            with _draining.watching(self.drain, claimed):
                result = await resume_as(job.agent, request, job.input)
        except RunLocked:
            self.seen.pop(job.key, None)  # another writer won the race: look again later
        except (StoreError, LeaseLost) as exc:
            self.seen.pop(job.key, None)  # the store's trouble, not the run's: try again
            self._warn(job.key, run_id, f"could not drive it: {exception_text(exc)}")
        except Exception as exc:  # noqa: BLE001 - left alone until its log changes
            self._refuse(job.key, None, None, exc)
        else:
            if driven:
                self._stopped(job, result)
            # Otherwise another host drove it meanwhile: the log, read again, says the rest.

    def _stopped(self, job: _Job, result: RunResult) -> None:
        reason = result.stop_reason
        detail = f": {result.detail}" if result.detail else ""
        text = f"stopped {reason.value} after {result.step_count} steps{detail}"
        self._say(
            logging.INFO,
            "stopped",
            job.run_id,
            text,
            agent=job.agent.name,
            stop_reason=reason.value,
            steps=result.step_count,
        )
        seen = self.seen.get(job.key)
        if seen is not None:
            seen.said = _WAITING.get(reason)
        self._warned.pop(job.key, None)

    # -- saying ------------------------------------------------------------------------

    def _refuse(
        self, key: _Key, stored: StoredRun | None, records: int | None, exc: Exception
    ) -> None:
        """Report ``exc`` once and leave the run alone until its log changes."""
        if records is not None:
            fingerprint_ = self._settled(stored) if stored is not None else None
            self.seen[key] = _Seen(fingerprint=fingerprint_, records=records)
        text = f"left alone until its log changes: {exception_text(exc)}"
        self._warn(key, key[1], text, event="refused")

    def _warn(self, key: object, run_id: str | None, text: str, *, event: str = "failed") -> None:
        """Say ``text`` at warning level, unless it was the last thing said of ``key``."""
        if self._warned.get(key) == text:
            return
        self._warned[key] = text
        self._say(logging.WARNING, event, run_id, text)

    def _say(self, level: int, event: str, run_id: str | None, text: str, **fields: Any) -> None:
        where = f"run {run_id!r}: " if run_id is not None else ""
        facts = {"event": event, "run_id": run_id, "message": text, **fields}
        logger.log(level, "%s%s", where, text, extra={"polyloop_worker": facts})
