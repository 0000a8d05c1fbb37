"""Proposals and edits: an action put to a person, and what their verdict makes of it.

A tool that needs approval is not announced: its call is recorded as a
:class:`~polyloop.types.Proposal` and the run ends to wait. A verdict approves the
call as proposed, approves it with other arguments (an edit), or rejects it; the loop
then runs the call, runs the edited call, or records the rejection as not executed.
Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

from polyloop._shared import call_text
from polyloop.ports import Action
from polyloop.types import Intent, Proposal, Verdict


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Edit:
    """Who edited an approved call, and the call's text as the model proposed it."""

    by: str
    proposed: str


def proposal_of(intent: Intent, description: str, at: datetime) -> Proposal:
    """The proposal that puts to a person the action ``intent`` would announce."""
    return Proposal(
        run_id=intent.run_id,
        result_id=intent.result_id,
        step=intent.step,
        replay=intent.replay,
        payload=intent.payload,
        action_text=intent.action_text or "",
        history_text=intent.history_text or "",
        description=description,
        tool_call=intent.tool_call,
        at=at,
    )


def edited(verdict: Verdict, proposal: Proposal) -> tuple[Action, Edit]:
    """The call a person approved with other arguments, as it will run, and the edit.

    Its text and native tool call are rebuilt from the edited payload, so that the
    records say what ran and the model's history shows the call its result answers;
    the model's own words (``history_text``) are left as it wrote them.
    """
    payload = verdict.payload
    # approve() checked the edited payload is a tool call with an arguments object.
    assert isinstance(payload, dict) and isinstance(payload.get("name"), str)
    name, arguments = str(payload["name"]), payload.get("arguments")
    call = proposal.tool_call
    action = Action(
        payload=payload,
        action_text=call_text(name, arguments),
        history_text=proposal.history_text,
        tool_call=None if call is None else dataclasses.replace(call, arguments=arguments),
    )
    return action, Edit(by=verdict.by, proposed=proposal.action_text)
