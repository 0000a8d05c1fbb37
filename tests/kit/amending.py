"""The release the amendment tests deploy under a run in flight: another deploy
description and another system prompt, and the amendment that accepts both."""

from __future__ import annotations

from typing import Any

from kit.agent import Ledger, request
from kit.review import review_tools
from polyloop import Amendment, Message, Request, Role

DEPLOYED = {"deploy": "Deploy the build; prod needs a change ticket."}
FIXED_PROMPT = "You are a careful agent. Never deploy on Fridays."
DEPLOY_FIX = Amendment(
    by="ops@example.com",
    reason="release 2.4: clearer deploy description and system prompt",
    accept=("run_context.sha256", "tools"),
)


def deployed_request(ledger: Ledger, run_id: str = "r", **overrides: Any) -> Request:
    """The request as the new release builds it: another deploy description, another
    system prompt."""
    tools = review_tools(ledger, descriptions=DEPLOYED)
    system = (Message.text(Role.SYSTEM, FIXED_PROMPT),)
    return request(run_id, tools, run_context=system, **overrides)
