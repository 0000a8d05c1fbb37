"""``pending``, ``approve``, ``reject``, ``settle`` and ``cancel``: what waits for a
person, and the person's answer.

The answers go through :func:`polyloop.approve`, :func:`polyloop.reject`,
:func:`polyloop.settle` and :func:`polyloop.cancel`, which check everything against the
run's log under its claim before writing: a refused answer writes nothing and says why
in one line.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from rich.console import Console

from polyloop import serialization
from polyloop._escaping import escape_field, payload_text
from polyloop.cli._common import (
    CliError,
    command_words,
    edited_arguments,
    shell_word,
)
from polyloop.cli._stores import StoreSpec, open_store
from polyloop.cli._view import state_line
from polyloop.session import approve, cancel, reject, run_status, settle
from polyloop.types import (
    CorruptLog,
    Intent,
    IntentKind,
    JSONValue,
    Proposal,
    Ready,
    RunState,
    RunStatus,
    SchemaMajorMismatch,
    StopReason,
)

WAITING = (RunState.AWAITING_APPROVAL, RunState.IN_DOUBT)


@dataclass(frozen=True, slots=True)
class Answer:
    """One person's answer, as the command line gave it."""

    by: str
    approve: bool | None = None  # approve (True) or reject (False); None: a settlement
    arguments: JSONValue = None
    reason: str | None = None
    ran: bool | None = None
    observation: str | None = None
    result_id: str | None = None


async def pending(spec: StoreSpec, out: Console, *, as_json: bool) -> int:
    """Print every run that waits for a person: to approve an action, or to settle one."""
    async with open_store(spec) as store:
        waiting: list[RunStatus] = []
        for run in await store.list_runs(unfinished_only=True):
            try:
                status = await run_status(store, run.run_id)
            except (CorruptLog, SchemaMajorMismatch):
                continue  # 'polyloop verify' is the command that reports those
            # A run with a cancel request waits for no person: its next writer ends it.
            if status.state in WAITING and status.ready is not Ready.CANCEL_REQUESTED:
                waiting.append(status)
    for status in waiting:
        if as_json:
            sys.stdout.write(json.dumps(pending_json(status), ensure_ascii=False) + "\n")
            sys.stdout.flush()
        else:
            text = "\n".join((pending_line(status), *answer_commands(spec, status)))
            out.print(text, markup=False, soft_wrap=True, highlight=False)
    if not waiting and not as_json:
        out.print(f"nothing waits for a person in {spec.shown}", markup=False)
    return 0


def pending_json(status: RunStatus) -> dict[str, JSONValue]:
    proposal = status.proposal
    intent = status.open_intent
    answered = _answered(status)
    return {
        "run_id": status.run_id,
        "state": status.state.value,
        # "probe": no answer is needed, a worker (or resume) settles it through the probe.
        "ready": status.ready.value if status.ready is not None else None,
        # The id to answer with (--result-id): the proposal's, or the intent's in doubt.
        "result_id": answered.result_id if answered is not None else None,
        "proposal": serialization.encode(proposal) if proposal is not None else None,
        "open_intent": (
            serialization.encode(intent)
            if intent is not None and status.state is RunState.IN_DOUBT
            else None
        ),
    }


def pending_line(status: RunStatus) -> str:
    """One line (or two) saying what the run waits for."""
    if status.proposal is not None:
        proposal = status.proposal
        return (
            f"{escape_field(status.run_id)}  awaiting approval  "
            f"{escape_field(proposal.result_id)}  {escape_field(payload_text(proposal.payload))}"
            f"\n    {escape_field(proposal.description)}"
        )
    intent = status.open_intent
    what = payload_text(intent.payload) if intent is not None else "?"
    if intent is not None and intent.kind is IntentKind.MODEL_CALL:
        what = "a model call (its replay is never allowed)"
    where = intent.result_id if intent is not None else "?"
    # Listed as the runs that wait for a person are, but marked: a person need not answer.
    state = "in doubt" if status.ready is None else state_line(status)
    return f"{escape_field(status.run_id)}  {state}  {escape_field(where)}  {escape_field(what)}"


def _answered(status: RunStatus) -> Proposal | Intent | None:
    if status.proposal is not None:
        return status.proposal
    return status.open_intent if status.state is RunState.IN_DOUBT else None


# What each answer does, shown before the command that gives it.
_ACTION_ANSWERS = (
    ("it ran", ["--ran", "--observation", "TEXT"]),
    ("it did not run", ["--did-not-run", "--reason", "TEXT"]),
)
_MODEL_CALL_ANSWERS = (
    ("not run (the run calls the model again)", ["--did-not-run", "--reason", "TEXT"]),
    ("ran, reply lost (the run ends model_failure)", ["--ran", "--observation", "TEXT"]),
)


def answer_commands(spec: StoreSpec, status: RunStatus) -> list[str]:
    """The commands that answer the waiting run, each on its own indented line: NAME and
    TEXT are for the person to fill in; every other word is exact (and shell-quoted)."""
    answered = _answered(status)
    if answered is None:
        return []
    store = [spec.shown, *(["--schema", spec.schema] if spec.schema is not None else [])]
    target = [*store, status.run_id, "--by", "NAME"]
    checked = ["--result-id", answered.result_id]
    if isinstance(answered, Proposal):
        answers = [
            ("approve", ["approve", *target, *checked]),
            ("reject", ["reject", *target, "--reason", "TEXT", *checked]),
        ]
    else:
        kinds = _MODEL_CALL_ANSWERS if answered.kind is IntentKind.MODEL_CALL else _ACTION_ANSWERS
        answers = [(said, ["settle", *target, *how, *checked]) for said, how in kinds]
    lines = []
    for said, words in answers:
        command = " ".join(shell_word(word) for word in [*command_words(), *words])
        lines.append(f"    {said}: {command}")
    return lines


async def answer(spec: StoreSpec, run_id: str, given: Answer, out: Console) -> int:
    """Write one person's answer for ``run_id`` and say in one line what was written,
    and who goes on with the run."""
    async with open_store(spec) as store:
        if given.approve is True:
            verdict = await approve(
                store, run_id, by=given.by, arguments=given.arguments, result_id=given.result_id
            )
            said = f"approved {verdict.result_id}"
        elif given.approve is False:
            assert given.reason is not None
            verdict = await reject(
                store, run_id, by=given.by, reason=given.reason, result_id=given.result_id
            )
            said = f"rejected {verdict.result_id}"
        else:
            assert given.ran is not None and given.observation is not None
            settlement = await settle(
                store,
                run_id,
                by=given.by,
                ran=given.ran,
                observation=given.observation,
                result_id=given.result_id,
            )
            how = "ran" if settlement.ran else "did not run"
            said = f"settled {settlement.result_id}: {how}"
        agent = (await run_status(store, run_id)).agent
    then = f"resume run {run_id!r} to go on"
    if agent is not None:
        then = f"a worker hosting agent {agent!r} goes on with run {run_id!r} (or resume it)"
    out.print(
        f"{escape_field(said)} (by {escape_field(given.by)}); {escape_field(then)}",
        markup=False,
        soft_wrap=True,
        highlight=False,
    )
    return 0


async def cancel_run(spec: StoreSpec, run_id: str, given: Answer, out: Console) -> int:
    """Ask ``run_id`` to stop for good and say in one line what became of it."""
    assert given.reason is not None
    async with open_store(spec) as store:
        status = await cancel(
            store, run_id, by=given.by, reason=given.reason, result_id=given.result_id
        )
    out.print(cancel_outcome(status), markup=False, soft_wrap=True, highlight=False)
    return 0


def cancel_outcome(status: RunStatus) -> str:
    """What a cancel did: the run ended, its writer will end it, or it had finished."""
    run = escape_field(status.run_id)
    if status.state is not RunState.FINISHED:
        owner = f" ({escape_field(status.owner)})" if status.owner else ""
        return (
            f"cancel requested for run {run}: the writer driving it{owner} ends it before "
            "its next effect; 'polyloop show' tells when it has"
        )
    if status.stop_reason is not StopReason.CANCELLED_BY_REQUEST:
        reason = status.stop_reason.value if status.stop_reason is not None else "-"
        return f"run {run} had already finished ({reason}); nothing was written"
    return f"run {run} ended for good: cancelled_by_request ({escape_field(status.detail or '')})"


def parse_arguments(text: str | None) -> JSONValue:
    """The ``--arguments`` JSON object, or ``CliError`` saying what is wrong with it (a
    key named twice in one object included)."""
    if text is None:
        return None
    try:
        return edited_arguments(text)
    except ValueError as exc:
        raise CliError(f"--arguments: {exc}") from None
