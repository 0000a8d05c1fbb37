"""Probes: asking a reconciling executor what became of an action in doubt.

:func:`probe_for` asks the executor's ``reconciles`` once per resume, before the loop
is built: whether a run waiting for a person has anything to do depends on it. The
loop then checks its claim and awaits :func:`ask`, which turns the probe's answer into
the settlement to write, or into what the in-doubt end should say. :func:`can_settle`
asks it once more as an action that is never replayed is announced, for its intent to
record: ``run_status``, which has no executor, reads the answer there.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from polyloop import _recovery
from polyloop._shared import RECONCILE_PREFIX, exception_text
from polyloop.ports import Action, ActionExecutor, ReconcilingExecutor
from polyloop.session._checks import action_name
from polyloop.session._steps import action_of, now
from polyloop.types import Intent, IntentKind, Reconciled, Replay, Settlement

logger = logging.getLogger("polyloop")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """The question a run in doubt puts to its executor: what became of ``action``.

    ``refused`` is what ``reconciles`` raised, if it did: the probe then counts as
    failed without being asked.
    """

    executor: ReconcilingExecutor
    intent: Intent
    action: Action
    refused: Exception | None = None

    @property
    def tool(self) -> str:
        """The tool the action calls, or, for a call of no tool, its executor's type."""
        return action_name(self.intent) or type(self.executor).__name__

    @property
    def name(self) -> str:
        """How messages name the probe."""
        return f"the probe of tool {self.tool!r}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Unsettled:
    """What the in-doubt end adds when the probe could not settle the action."""

    note: str
    failed: bool


def probe_for(executor: ActionExecutor, plan: _recovery.Plan) -> Probe | None:
    """The probe to ask about ``plan``'s action in doubt, if there is one to ask.

    Only an action can be settled, and only an executor that says it can answer for it
    is asked. One whose ``reconciles`` raises is a probe that failed: the loop counts it
    and the end says what it raised.
    """
    intent = plan.open_intent
    if (
        plan.state is not _recovery.RecoveryState.IN_DOUBT
        or intent is None
        or intent.kind is not IntentKind.ACTION
        or not isinstance(executor, ReconcilingExecutor)
    ):
        return None
    action = action_of(intent)
    try:
        if not executor.reconciles(action):
            return None
    except Exception as exc:  # noqa: BLE001 - the executor's fault, counted as "cannot tell"
        return Probe(executor=executor, intent=intent, action=action, refused=exc)
    return Probe(executor=executor, intent=intent, action=action)


def can_settle(executor: ActionExecutor, action: Action, replay: Replay) -> bool | None:
    """What the intent of ``action`` records as ``reconciles``: for an action that is
    never replayed, whether the executor says its probe could settle it, should it be
    left in doubt (one whose ``reconciles`` raises could not); ``None`` for any other."""
    if replay is not Replay.NEVER:
        return None
    if not isinstance(executor, ReconcilingExecutor):
        return False
    try:
        return bool(executor.reconciles(action))
    except Exception:  # noqa: BLE001 - asked again, and reported, if the action is left in doubt
        return False


async def ask(probe: Probe) -> Settlement | Unsettled:
    """The settlement the probe's answer makes, or why there is none.

    Cancellation: propagates from the probe; nothing is written for it, so the run
    stays in doubt and a later resume asks again.
    """
    if probe.refused is not None:
        return _failed(probe, probe.refused)
    intent = probe.intent
    began = time.perf_counter()
    try:
        answer = await probe.executor.reconcile(probe.action, result_id=intent.result_id)
        if answer is not None and not _well_formed(answer):
            raise TypeError(f"it returned {answer!r:.80}, not Reconciled or None")
    except Exception as exc:  # noqa: BLE001 - a failing probe cannot tell, by contract
        return _failed(probe, exc)
    if answer is None:
        return Unsettled(note=f"{probe.name} could not tell", failed=False)
    return Settlement(
        run_id=intent.run_id,
        result_id=intent.result_id,
        ran=answer.ran,
        observation=answer.observation,
        by=f"{RECONCILE_PREFIX}{probe.tool}",
        at=now(),
        duration_s=time.perf_counter() - began,
    )


def _failed(probe: Probe, exc: Exception) -> Unsettled:
    logger.warning("run %r: %s failed", probe.intent.run_id, probe.name, exc_info=exc)
    return Unsettled(note=f"{probe.name} failed: {exception_text(exc)}", failed=True)


def _well_formed(answer: object) -> bool:
    return (
        isinstance(answer, Reconciled)
        and isinstance(answer.ran, bool)
        and isinstance(answer.observation, str)
    )


def noted(detail: str | None, note: str | None) -> str | None:
    """An in-doubt detail with what the probe said, if it was asked."""
    if note is None:
        return detail
    return note if detail is None else f"{detail}; {note}"
