"""The five seams a downstream project fills in, and the values that cross them.

Every seam is a :class:`typing.Protocol`: an object satisfies it by shape, without
inheriting from anything here. Definition-level seams (model client, interpreter, store,
event sink) report ``parameters()``, the reproducibility facts that go into a run's
snapshot; the action executor belongs to one request and reports none.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Protocol, Self, TypeAlias, runtime_checkable

from polyloop.types import (
    ActionStatus,
    CancelRequest,
    FinishReason,
    Intent,
    IntentKind,
    JSONValue,
    Message,
    Reconciled,
    Record,
    Replay,
    Result,
    Review,
    RunEnded,
    RunLog,
    RunStarted,
    Settlement,
    StepRecord,
    ToolCallBlock,
    Usage,
)

__all__ = (
    "Action",
    "ActionExecutor",
    "ActionOutcome",
    "ChangeFeed",
    "Decision",
    "DeltaSink",
    "Event",
    "EventKind",
    "EventSink",
    "FinalAnswer",
    "FollowableStore",
    "Interpreter",
    "InvalidDecision",
    "ManagedStore",
    "ModelCall",
    "ModelClient",
    "ModelReply",
    "NullSink",
    "PagedStore",
    "ReconcilingExecutor",
    "RunPage",
    "Store",
    "StoredRun",
    "StreamingModelClient",
    "TextDelta",
    "TracingSink",
    "reject_incomplete",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCall:
    """One call to the model: the assembled messages and where the call belongs.

    ``call_index`` counts model calls within the run from 0; ``result_id`` is the id the
    library allocated for this call's result before making it; ``binding`` is the
    request's binding, passed through untouched. ``tools`` is empty unless the request's
    tool style is ``NATIVE``: then it holds each tool's ``name``, ``description`` and
    ``parameters`` (a JSON Schema), for the client to send in its API's own form.
    """

    messages: tuple[Message, ...]
    call_index: int
    run_id: str
    result_id: str
    binding: Mapping[str, str]
    tools: tuple[Mapping[str, JSONValue], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelReply:
    """What the model answered. ``call_id`` is the caller's ledger key; never ``""``.

    The optional fields say what the server reported about the reply, ``None`` where it
    reported nothing: ``finish``, how the reply ended; ``usage``, the tokens the call
    used; ``model``, the model the server says answered; ``refusal``, the model's refusal
    text. A client that knows none of them leaves them out. ``tool_calls`` holds the
    native tool calls of the reply, in the order the model made them.
    """

    call_id: str | None
    content: str
    reasoning: str | None
    finish: FinishReason | None = None
    usage: Usage | None = None
    model: str | None = None
    refusal: str | None = None
    tool_calls: tuple[ToolCallBlock, ...] = ()

    @property
    def complete(self) -> bool:
        """Whether the reply ended normally: not cut off, filtered or refused."""
        return self.refusal is None and self.finish not in _INCOMPLETE


_INCOMPLETE = frozenset({FinishReason.LENGTH, FinishReason.CONTENT_FILTER, FinishReason.REFUSAL})


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """Run this action. ``payload`` goes to the executor; the texts go to the trajectory.

    ``tool_call`` is the native tool call the action answers, if it came from one: the
    history then holds the call as structured content and the observation as its result.
    """

    payload: JSONValue
    action_text: str
    history_text: str
    tool_call: ToolCallBlock | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FinalAnswer:
    """The model answered; the run ends with ``FINAL_ANSWER``."""

    answer: str
    history_text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class InvalidDecision:
    """The reply could not be used; ``feedback`` is fed back to the model verbatim."""

    feedback: str
    history_text: str


Decision: TypeAlias = Action | FinalAnswer | InvalidDecision
"""The three branches an interpreter can choose."""


def reject_incomplete(reply: ModelReply) -> InvalidDecision | None:
    """The invalid decision for a reply that did not end normally, or ``None``.

    A reply cut off at the length limit may hold a half-written action, one the content
    filter cut may miss its end, and a refusal holds no action: none may be acted on.
    Every interpreter PolyLoop ships calls this first; an interpreter of your own should
    too, or decide for itself on :attr:`ModelReply.finish`. The feedback tells the model
    what happened in plain words, and the reply stays in the history as it was sent.
    """
    if reply.complete:
        return None
    if reply.refusal is not None or reply.finish is FinishReason.REFUSAL:
        said = f": {reply.refusal}" if reply.refusal else "."
        feedback = f"Your reply was a refusal{said} Nothing was run."
    elif reply.finish is FinishReason.LENGTH:
        feedback = (
            "Your reply was cut off at the length limit before it ended, so it was not "
            "acted on. Answer again, more briefly."
        )
    else:
        feedback = (
            "Your reply was withheld in part by the server's content filter, so it was "
            "not acted on. Answer again."
        )
    return InvalidDecision(feedback=feedback, history_text=reply.content or reply.refusal or "")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionOutcome:
    """How an action went.

    ``observation`` is what the model will see; for ``NOT_EXECUTED`` it is the refusal
    reason and for ``ENV_FAULT`` the fault detail, which the library wraps in its
    templates. ``done`` is the environment's own done signal (``False`` where the
    environment has none).
    """

    status: ActionStatus
    observation: str
    synthesized: bool
    done: bool
    truncated_chars: int = 0


@runtime_checkable
class ModelClient(Protocol):
    """Calls a model. Failure is an exception; the library never retries.

    ``polyloop.testing.model_client_contract`` checks a downstream implementation.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        """The reproducibility parameters of this client (model identity, sampling)."""
        ...

    async def call(self, call: ModelCall) -> ModelReply:
        """Make one model call.

        Cancellation: the library cancels this call when the run is cancelled; it must
        let the cancellation propagate. The model-call intent is already durable, so a
        later ``resume`` replays the call only if the request's model replay allows it.
        """
        ...


@runtime_checkable
class StreamingModelClient(ModelClient, Protocol):
    """A model client that can report the reply's text while the call runs. Optional.

    When the run's event sink is a :class:`DeltaSink`, the library calls :meth:`stream`
    instead of ``call``; otherwise it calls ``call``, as for any client. Either way the
    reply returned is the one that is recorded: the pieces of text are only shown, never
    written to the log.
    """

    async def stream(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
    ) -> ModelReply:
        """Make the call as ``call`` would, awaiting ``on_text`` with each new piece of
        the reply's visible text (``content``) as it arrives, in order; then return the
        whole reply, whose ``content`` is those pieces joined.

        ``on_text`` never raises (a sink's failure is counted by the library), so a
        client need not guard it; it may take a while, as the sink does.

        Cancellation: as for ``call``; ``on_text`` lets a cancellation through too.
        """
        ...


@runtime_checkable
class Interpreter(Protocol):
    """Turns a model reply into a decision. Pure and synchronous.

    ``polyloop.testing.interpreter_contract`` checks a downstream implementation.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        """The reproducibility parameters of this interpreter."""
        ...

    def interpret(self, reply: ModelReply) -> Decision:
        """Choose one of the three branches for ``reply``."""
        ...


@runtime_checkable
class ActionExecutor(Protocol):
    """Performs actions for one run. Discrimination is by status, never by exception.

    ``polyloop.testing.executor_contract`` checks a downstream implementation.
    """

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Perform ``action``; ``result_id`` is stable across a replay after a crash.

        Cancellation: must propagate. The action intent is already durable; ``resume``
        performs the action again (same ``result_id``) only if ``replay`` allowed it.
        """
        ...

    def replay(self, action: Action) -> Replay:
        """Whether ``action`` may be performed again if its outcome was lost."""
        ...


@runtime_checkable
class ReconcilingExecutor(ActionExecutor, Protocol):
    """An executor that can also ask what became of an action in doubt.

    When a run would end ``IN_DOUBT`` (an action whose replay is ``NEVER`` was
    announced and its outcome lost), the library first asks :meth:`reconciles` and, if
    it says yes, awaits :meth:`reconcile` under the run's claim, after the same claim
    check as any effect. A :class:`~polyloop.types.Reconciled` answer is written as the
    action's settlement and the run goes on; ``None`` leaves the run in doubt. The
    executor a :class:`~polyloop.tools.ToolRegistry` derives is one: it asks the tool's
    ``reconcile`` probe, cancelled after the tool's ``reconcile_timeout_s``. The library
    sets no limit of its own on :meth:`reconcile`: a custom executor bounds its wait, so
    that one run's question cannot keep a recovery from going on.
    """

    def reconciles(self, action: Action) -> bool:
        """Whether :meth:`reconcile` can say anything about ``action``. Cheap and pure."""
        ...

    async def reconcile(self, action: Action, *, result_id: str) -> Reconciled | None:
        """What became of ``action`` under ``result_id``, or ``None`` if it cannot tell.

        ``ran=False`` must be a promise that the effect has not happened and never will
        (see :class:`~polyloop.types.Reconciled`).

        Cancellation: must propagate. Nothing has been written for the answer yet, so
        the run stays in doubt, and a later ``resume`` asks again.
        """
        ...


@runtime_checkable
class Store(Protocol):
    """Persists the records of runs. Every method names its run explicitly.

    A run has one writer. A store object becomes a run's writer with :meth:`claim_run`,
    and every write for that run is refused with :class:`~polyloop.types.RunLocked`
    unless this store object holds the claim; a second claimant (another store object,
    in this process or another, or this one again) gets ``RunLocked``. :meth:`end_run`
    and :meth:`release_run` give the claim up, and so does closing the store or the
    death of its process. A write for a run whose log ends with a final end record (any
    stop reason but ``CANCELLED``, ``IN_DOUBT`` and ``AWAITING_APPROVAL``) is refused
    with :class:`~polyloop.types.StoreError`.
    Refused writes write nothing.

    ``write_intent`` is a durable barrier: when it returns, the intent survives a crash
    of the process (and, for stores that promise it, of the machine). ``write_step``
    lands the step and its action result together or not at all.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        """What changes the meaning of the log (kind, record format), never a path."""
        ...

    async def claim_run(self, run_id: str) -> None:
        """Become the run's only writer; ``RunLocked`` if anyone holds it, this object too.

        The run need not exist yet: ``run`` claims an id before it starts the run.
        Records read after this returns include every record any earlier writer wrote.

        Cancellation: if the call raises, this store object holds no claim on the run.
        (The built-in stores wait up to 10 s for a claim taken just before the failure
        to be given back; past that it is given back in the background, with a warning.)
        """
        ...

    async def release_run(self, run_id: str) -> None:
        """Give up this store object's claim on the run, writing nothing.

        Does nothing if this object holds no claim on the run.

        Cancellation: the claim is given up or still held; calling again finishes it.
        """
        ...

    async def check_claim(self, run_id: str) -> None:
        """Return only if an effect of the run may start now under this object's claim.

        The kernel calls it after an intent is durable and right before the effect that
        intent announces (a model call, an action). It raises ``RunLocked`` when this
        object holds no claim on the run, ``StoreError`` when the store is closed or an
        earlier write of the run failed, and ``LeaseLost`` when the claim's lease has
        ended or has less than its safety margin left. A store whose claims have a lease
        answers from its own clock (no round trip) and may first wait, never past the
        lease's end, for a renewal already under way; a store without leases answers at
        once.

        Cancellation: nothing changes; the effect has not started.
        """
        ...

    async def start_run(self, record: RunStarted) -> None:
        """Write the first record of a run; ``RunAlreadyExists`` if it has records.

        Cancellation: either the record landed whole or not at all.
        """
        ...

    async def write_intent(self, intent: Intent) -> None:
        """Write an intent and make it durable before returning.

        Cancellation: either the intent landed whole or not at all; a cancelled caller
        cannot tell which, and recovery does not need to.
        """
        ...

    async def write_result(self, result: Result) -> None:
        """Write the result of a model call.

        Cancellation: either the result landed whole or not at all.
        """
        ...

    async def write_step(self, step: StepRecord, action_result: Result | None) -> None:
        """Write a step record and its action's result atomically.

        ``read_log`` returns the action result immediately before the step record.

        Cancellation: both records landed or neither did.
        """
        ...

    async def write_review(self, record: Review) -> None:
        """Write a proposal awaiting approval, a verdict on one, or a settlement, and make
        it durable before returning (a barrier, like :meth:`write_intent`).

        These are the records that stop a run for a person and hold the person's answer;
        they are refused, like every write, unless this store object holds the claim.

        Cancellation: either the record landed whole or not at all.
        """
        ...

    async def request_cancel(self, request: CancelRequest) -> None:
        """Keep ``request`` beside the run's log, durably, without the run's claim.

        From the moment it returns, :meth:`write_intent` and :meth:`write_review` of a
        :class:`~polyloop.types.Proposal` for the run raise
        :class:`~polyloop.types.CancelRequested` and write nothing, in this process and
        every other, so no new effect starts; step records, results and end records are
        still written, so an effect already running is recorded. The check and the
        intent's write are one atomic step: a request and an intent racing each other
        are ordered, never both let through. A run keeps its first request; another one
        changes nothing. :class:`~polyloop.types.RunNotFound` if the run has no record.

        Cancellation: the request was kept whole or not at all.
        """
        ...

    async def read_cancel(self, run_id: str) -> CancelRequest | None:
        """The run's cancel request, or ``None``. Needs no claim.

        Cancellation: reading changes nothing on disk.
        """
        ...

    async def read_log(self, run_id: str) -> RunLog:
        """Read every record of ``run_id`` in write order (empty if there is none).

        Readers never need the claim and never disturb its holder.

        Cancellation: reading changes nothing on disk.
        """
        ...

    async def end_run(self, record: RunEnded) -> None:
        """Write the end record of a run and give up the run's claim.

        Cancellation: either the record landed whole or not at all.
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredRun:
    """One run as a store knows it without reading its log.

    ``finished`` says the log ends with a final end record (any stop reason but
    ``CANCELLED``, ``IN_DOUBT`` and ``AWAITING_APPROVAL``: a run in doubt or waiting
    for approval is unfinished, since a person's answer lets it go on). ``claimed``
    says a live writer holds the run's claim right now: a worker drives it (or is about
    to). ``updated_at`` is when the store took the run's
    last record, in UTC, or ``None`` if the store cannot tell.

    Stores that give claims a lease also say whose claim the run is under, or was last
    under while not given up: ``owner`` describes that worker (host and process), and
    ``lease_expires_at`` is when its lease ends or ended. A run whose owner's lease has
    ended, or whose owner's process died, is not ``claimed``: anyone may take it over.

    ``cancel_requested`` says someone asked the run to stop (:meth:`Store.request_cancel`).
    """

    run_id: str
    finished: bool
    claimed: bool
    updated_at: datetime | None
    owner: str | None = None
    lease_expires_at: datetime | None = None
    cancel_requested: bool = False


@runtime_checkable
class ManagedStore(Store, Protocol):
    """A store that can list its runs, describe one, prune old ones, and be closed.

    Every store PolyLoop ships is one; :func:`polyloop.run_status`,
    :func:`polyloop.recover` and the command line need nothing more.
    ``polyloop.testing.store_contract`` checks a downstream implementation.
    """

    async def list_runs(self, *, unfinished_only: bool = False) -> tuple[StoredRun, ...]:
        """Every run the store holds, or only those without a final end record.

        Stores that keep a table of runs answer ``unfinished_only`` without reading the
        runs that finished, so the cost follows the number of unfinished runs.

        Cancellation: listing changes nothing on disk.
        """
        ...

    async def describe_run(self, run_id: str) -> StoredRun | None:
        """The run ``run_id`` as :meth:`list_runs` would list it; ``None`` if it has no record.

        Cancellation: describing changes nothing on disk.
        """
        ...

    async def prune(
        self, *, finished_before: datetime, archive: str | os.PathLike[str] | None = None
    ) -> tuple[str, ...]:
        """Delete the runs that finished before ``finished_before``; return their ids.

        Never touches a run that is unfinished, ended ``IN_DOUBT``, or claimed: each
        run is deleted under its own claim, so pruning is safe while workers run. With
        ``archive``, each run's log is first written durably to that directory in the
        JSON-lines store's format (``polyloop show jsonl:DIR RUN_ID`` reads it).

        Cancellation: each run is archived and deleted whole or not at all.
        """
        ...

    async def aclose(self) -> None:
        """Give up every claim and release every resource. Idempotent.

        Cancellation: closing completes, shielded, before the cancellation goes on.
        """
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class ChangeFeed(Protocol):
    """A store that says when a run may have become able to go on, so that a host need
    not list the store on a short timer. Optional: a host polls a store without one.

    :class:`~polyloop.stores.PostgresStore` is one; its writes that may let a run go on
    (a run's start, a verdict, a settlement, an end record that leaves the run open, a
    cancel request, a claim given up without a record) notify in their own transaction.
    """

    def changes(self) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Listen while the ``async with`` block runs; it yields ``wait``.

        The block begins once the store listens (or could not yet: it keeps trying).
        ``await wait()`` returns once such a write may have committed since the block
        began or ``wait`` last returned; several writes may wake it once, and it may
        wake for nothing (after a lost connection, say), so the store's listing stays
        the truth: list after each return, and also on a timer of your own, since a
        lease that runs out is not a write. A feed of a closed store never wakes.

        Cancellation: ``wait`` changes nothing when cancelled; leaving the block stops
        listening (shielded, waiting a moment at most for the store's own thread).
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPage:
    """One page of runs, most recently updated first (:meth:`PagedStore.page_runs`).

    ``newer`` is the cursor to pass as ``before`` for the page above this one, ``None``
    when nothing comes before it; ``older`` the cursor to pass as ``after`` for the page
    below, ``None`` when this is the last. A cursor is text to hand back as it is.
    """

    runs: tuple[StoredRun, ...]
    newer: str | None = None
    older: str | None = None


@runtime_checkable
class PagedStore(Protocol):
    """A store that lists one page of its runs, sorted and filtered by the store, so the
    cost follows the page, not the number of runs. Optional: a store without it is paged
    from :meth:`ManagedStore.list_runs` (docs/stores.md#a-page-of-runs). Every store
    PolyLoop ships is one.
    """

    async def page_runs(
        self,
        *,
        limit: int,
        after: str | None = None,
        before: str | None = None,
        finished: bool | None = None,
        updated_since: datetime | None = None,
        updated_before: datetime | None = None,
    ) -> RunPage:
        """At most ``limit`` runs as :meth:`ManagedStore.list_runs` lists them, most
        recent ``updated_at`` first, ties by run id, runs whose time the store cannot
        tell last: the first such runs, or those right after the cursor ``after`` (a
        page's ``older``), or right before the cursor ``before`` (a page's ``newer``).
        ``finished`` keeps only finished (``True``) or unfinished (``False``) runs;
        ``updated_since`` and ``updated_before`` keep runs whose ``updated_at`` is in
        that window (a naive time is UTC). A cursor stays valid while runs change: a
        page after it starts after the run it was taken from. ``InvalidRequest`` for a
        ``limit`` below 1, both cursors, or a cursor the store cannot read.

        Cancellation: reading changes nothing on disk.
        """
        ...


@runtime_checkable
class FollowableStore(Protocol):
    """A store that reads a run's records after a position and says when more may have
    been written: what :func:`polyloop.follow` uses to read only what is new. Optional: a
    store without it is followed by reading its whole log on a short timer and skipping
    what was already seen (docs/following.md#your-own-store). Every store PolyLoop ships
    is one.
    """

    async def read_after(self, run_id: str, after: int) -> tuple[Record, ...]:
        """The run's records at positions ``after + 1`` onward (position 1 is the start
        record), in write order: the tail of what :meth:`Store.read_log` would return,
        empty if the log is no longer than ``after``. ``RunNotFound`` if the run has no
        record. Needs no claim and never disturbs the writer.

        Cancellation: reading changes nothing on disk.
        """
        ...

    def appended(self, run_id: str) -> AbstractAsyncContextManager[Callable[[], Awaitable[None]]]:
        """Watch the run while the ``async with`` block runs; it yields ``wait``.

        ``await wait()`` returns once a record of the run may have been written since the
        block began or ``wait`` last returned (and once the run may have been deleted). It
        may wake for nothing, never sleeps through a write: read after it returns.

        Cancellation: ``wait`` changes nothing when cancelled; leaving the block stops
        watching.
        """
        ...


class EventKind(enum.StrEnum):
    """What an event reports."""

    RUN_STARTED = "run_started"
    RUN_RESUMED = "run_resumed"
    STEP_FINISHED = "step_finished"
    RUN_ENDED = "run_ended"
    RUN_AMENDED = "run_amended"


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A progress notification; ``record`` is the record the event is about.

    ``intent`` is, on a ``STEP_FINISHED`` event whose step ran an action, the action's
    intent: what was run (its payload) and under which result id.

    ``logged`` is, on a ``RUN_RESUMED`` event, every record the run's log held when the
    resumed attempt read it, in write order: what the earlier attempts did, for a sink
    that rebuilds what it may have lost. It is the tuple the store returned, not a copy,
    and it is left out of the event's repr. Empty on every other event.

    ``settlement`` is, on a ``STEP_FINISHED`` event whose action was in doubt, the
    settlement that closed it: who settled it (a person, or a tool's probe) and how.

    A ``RUN_AMENDED`` event comes once a resume has written an
    :class:`~polyloop.types.Amended` record (its ``record``; ``step`` is the first step
    run under it), before that resume's ``RUN_RESUMED`` event, and even when the run
    still waits for a person and nothing else is written.
    """

    kind: EventKind
    run_id: str
    step: int | None
    record: Record
    intent: Intent | None = None
    logged: tuple[Record, ...] = field(default=(), repr=False)
    settlement: Settlement | None = None


@runtime_checkable
class EventSink(Protocol):
    """Receives progress events. A failing sink is counted, logged and never re-entered.

    ``polyloop.testing.event_sink_contract`` checks a downstream implementation.
    """

    def parameters(self) -> Mapping[str, JSONValue]:
        """The reproducibility parameters of this sink (usually none)."""
        ...

    async def emit(self, event: Event) -> None:
        """Deliver one event.

        Cancellation: must propagate; events are not persisted, so nothing is on disk
        on the sink's account.
        """
        ...


@runtime_checkable
class TracingSink(EventSink, Protocol):
    """An event sink that also wraps each model call and each action while it runs.

    The kernel looks ``around_call`` up once per run; without it, a call runs unwrapped.
    """

    def around_call(
        self, *, run_id: str, step: int, kind: IntentKind
    ) -> AbstractContextManager[object]:
        """A context the kernel enters just before the call of ``kind`` at ``step``
        starts and leaves when it returns or raises.

        The call runs inside it, in the same context (``contextvars``), so what the
        sink makes current there is current in the model client or the tool. It sees
        the call's exception, cancellation included, which goes on whatever it returns.
        One it raises itself is counted and logged like a failing ``emit``, and the
        call runs or ends as it would have. The step's record still arrives by ``emit``.
        """
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta:
    """A piece of a model's reply text, as it arrived while the call ran.

    ``step`` and ``result_id`` name the model call (the result id is the one its
    ``Result`` record will carry); ``index`` counts the call's pieces from 0, so that a
    display can tell that it missed one. Joined in index order, the pieces of a call
    that returned are the ``content`` of its reply, which is what the log records.
    Pieces are never written anywhere: they live only in the process that runs the step.
    """

    run_id: str
    step: int
    result_id: str
    index: int
    text: str


@runtime_checkable
class DeltaSink(EventSink, Protocol):
    """An event sink that also hears a model's text as it arrives. Optional.

    The kernel looks ``emit_delta`` up once per run. With a model client that is a
    :class:`StreamingModelClient`, each piece of the reply's text reaches
    ``emit_delta`` before the step's record is written; with any other client, or any
    other sink, the model is called as usual and no piece is sent.
    """

    async def emit_delta(self, delta: TextDelta) -> None:
        """Deliver one piece of text. The model's stream waits while this runs.

        A failure is counted and logged like a failing ``emit``; the next piece is
        still delivered.

        Cancellation: must propagate; the run is then cancelled, as in any model call.
        """
        ...


class NullSink:
    """An event sink that discards every event: the explicit way to say "no events"."""

    __slots__ = ()

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "null"}

    async def emit(self, event: Event) -> None:
        """Discard ``event``.

        Cancellation: nothing happens, so nothing is left behind.
        """
        return

    def __repr__(self) -> str:
        return "NullSink()"
