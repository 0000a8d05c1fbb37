"""Amendments: when a run may go on under a changed snapshot, and the record that says so.

:func:`checked` looks at an :class:`~polyloop.types.Amendment` before any I/O,
:func:`amended` at the log's plan and the snapshot built now, once the run is claimed;
both are pure. :func:`record` writes the amendment and tells the event sink. What may
never change, and why, is research record 0074.
"""

from __future__ import annotations

from collections.abc import Mapping

from polyloop import _recovery
from polyloop.ports import EventKind, Store
from polyloop.session._checks import action_name_of
from polyloop.session._relay import Relay
from polyloop.session._steps import now
from polyloop.types import (
    Amended,
    Amendment,
    AmendmentRefused,
    IntentKind,
    InvalidRequest,
    JSONValue,
    RunIdentityMismatch,
)

# Keys that say how recorded steps read back to the model: no amendment may accept them,
# and a fork may not differ in them from the snapshot its inherited steps ran under.
READS_BACK: Mapping[str, str] = {
    "observation_template": (
        "every recorded step's observation is shown to the model through it, so changing "
        "it rewrites how the recorded steps read"
    ),
    "tool_style": (
        "recorded steps of one style read as another (a native tool call and its answer, "
        "or text), so changing it rewrites how the recorded steps read"
    ),
}

# Keys no amendment may accept, and why.
NEVER: Mapping[str, str] = {
    "run_id": "a run's id is what the run is; under another id it is another run",
    "model_replay": (
        "it decides whether a model call a crash left open is made again, and the run's "
        "recorded intents were written under it"
    ),
    **READS_BACK,
    "agent.name": "a run's agent and input are what its request is built from",
    "agent.input": "a run's agent and input are what its request is built from",
}
NEVER_PREFIXES: Mapping[str, str] = {
    "store.": "the store's kind and record format say how the log itself reads",
}


def never_reason(key: str) -> str | None:
    """Why no amendment may accept ``key``, or ``None`` if one may."""
    if key in NEVER:
        return NEVER[key]
    for prefix, why in NEVER_PREFIXES.items():
        if key.startswith(prefix):
            return why
    return None


def checked(amend: Amendment, run_id: str | None) -> frozenset[str]:
    """The keys ``amend`` accepts, once it is known to be one that may be given.

    Raises ``InvalidRequest`` for a malformed amendment and ``AmendmentRefused`` for
    one that accepts a key that may never change; nothing is read or written first.
    """
    if not isinstance(amend, Amendment):
        raise InvalidRequest(
            f"amend must be an Amendment, not {type(amend).__name__}", run_id=run_id
        )
    if not isinstance(amend.by, str) or not amend.by.strip():
        raise InvalidRequest("an amendment must name who made it (by)", run_id=run_id)
    if not isinstance(amend.reason, str):
        raise InvalidRequest("an amendment's reason must be a string", run_id=run_id)
    accept = amend.accept
    if not isinstance(accept, frozenset | tuple) or not all(isinstance(k, str) for k in accept):
        raise InvalidRequest(
            "an amendment accepts a frozenset or tuple of snapshot keys", run_id=run_id
        )
    for key in sorted(accept):
        if (why := never_reason(key)) is not None:
            raise AmendmentRefused(run_id=run_id, key=key, why=why)
    return frozenset(accept)


def amended(
    plan: _recovery.Plan,
    current: Mapping[str, JSONValue],
    differences: tuple[tuple[str, JSONValue, JSONValue], ...],
    amend: Amendment | None,
    run_id: str,
) -> Amended | None:
    """The record of the amendment that lets the run of ``plan`` go on under ``current``
    (``None`` when nothing differs), or the error that refuses it."""
    if not differences:
        return None
    accepted = frozenset() if amend is None else checked(amend, run_id)
    refused = tuple(d for d in differences if d[0] not in accepted)
    if refused:
        raise RunIdentityMismatch(run_id=run_id, differences=refused)
    assert amend is not None  # every difference was accepted by it
    _check_tools_in_use(plan, current, differences, run_id)
    keys = [key for key, _, _ in differences]
    return Amended(
        run_id=run_id,
        step=len(plan.steps),
        by=amend.by,
        reason=amend.reason,
        changes=_recovery.changes_between(plan.snapshot, current, keys),
        at=now(),
    )


def held_snapshots(
    started: Mapping[str, JSONValue], amendments: list[Amended]
) -> list[Mapping[str, JSONValue]]:
    """``started`` (a start record's snapshot), then the snapshot each of ``amendments``
    (in log order) left: every snapshot the run held."""
    held = [started]
    for amendment in amendments:
        held.append(_recovery.amended_snapshot(held[-1], amendment.changes))
    return held


async def record(store: Store, relay: Relay, amended: Amended) -> None:
    """Write ``amended`` (a durable barrier), then hand the event sink a ``RUN_AMENDED``
    event about it: once the sink hears of it, the log holds it.

    Cancellation: the record landed whole or not at all (if not, a resume with the
    same amendment writes it); cancelled once it landed, the sink may not hear of it.
    """
    await store.write_review(amended)
    await relay.emit(EventKind.RUN_AMENDED, amended.step, amended)


def _check_tools_in_use(
    plan: _recovery.Plan,
    current: Mapping[str, JSONValue],
    differences: tuple[tuple[str, JSONValue, JSONValue], ...],
    run_id: str,
) -> None:
    """Refuse a change to the tool of an open action intent or of a proposal that waits:
    its call was announced (or asked about) under the tool as it was. Only its
    description may change, the words a person or the model reads."""
    if not any(key == "tools" for key, _, _ in differences):
        return
    for tool, held_by in _tools_in_use(plan):
        before, after = _spec(plan.snapshot, tool), _spec(current, tool)
        if after is None:
            why = f"it removes tool {tool!r} while {held_by}"
        elif _without_description(before) != _without_description(after):
            why = f"it changes tool {tool!r} (more than its description) while {held_by}"
        else:
            continue
        raise AmendmentRefused(run_id=run_id, key="tools", why=why, differences=differences)


def _tools_in_use(plan: _recovery.Plan) -> list[tuple[str, str]]:
    """Each tool an open intent or a proposal of the interrupted step names, and how."""
    used = []
    intent = plan.open_intent
    if intent is not None and intent.kind is IntentKind.ACTION:
        state = "in doubt" if plan.state is _recovery.RecoveryState.IN_DOUBT else "open"
        if (name := action_name_of(intent.payload)) is not None:
            used.append((name, f"its intent {intent.result_id!r} is {state}"))
    proposal = plan.proposal
    if proposal is not None and (name := action_name_of(proposal.payload)) is not None:
        if plan.verdict is None:
            used.append((name, f"its proposal {proposal.result_id!r} awaits approval"))
        else:
            used.append((name, f"its proposal {proposal.result_id!r} was answered, not run"))
    return used


def _spec(snapshot: Mapping[str, JSONValue], name: str) -> dict[str, JSONValue] | None:
    tools = snapshot.get("tools")
    specs = tools.get("specs") if isinstance(tools, dict) else None
    for spec in specs if isinstance(specs, list) else []:
        if isinstance(spec, dict) and spec.get("name") == name:
            return spec
    return None


def _without_description(spec: dict[str, JSONValue] | None) -> dict[str, JSONValue] | None:
    if spec is None:
        return None
    return {key: value for key, value in spec.items() if key != "description"}
