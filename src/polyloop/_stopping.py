"""The stop decision and the budget counters, as plain functions over plain data.

The order of the checks is part of the public contract: when two reasons hold at once,
the earlier one wins. Before a model call the budget is checked (steps, then valid
steps, then context size, then tokens); after a step, what the step itself says (model failure,
environment fault, environment done, a completing tool, a final answer). Because the
step's own reason is checked first, a last allowed step that also submits ends the run
as ``SUBMITTED``, not as ``STEP_LIMIT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyloop.types import ActionStatus, Budget, DecisionKind, StepRecord, StopReason, Usage


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """How much of the budget a run has used."""

    steps: int = 0
    valid_steps: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFacts:
    """What the stop decision needs to know about one finished step."""

    decision: DecisionKind
    model_failed: bool
    action_status: ActionStatus | None
    synthesized: bool
    done: bool
    completes: bool


def facts_of(step: StepRecord, completes: bool) -> StepFacts:
    """What ``step`` tells the stop decision; ``completes`` if its tool submits the task."""
    return StepFacts(
        decision=step.decision,
        model_failed=step.error is not None,
        action_status=step.action_status,
        synthesized=step.observation_synthesized,
        done=step.done,
        completes=completes,
    )


def before_model_call(budget: Budget, used: Counters, context_chars: int) -> StopReason | None:
    """The reason to stop before the next model call, or ``None`` to make it."""
    if used.steps >= budget.max_steps:
        return StopReason.STEP_LIMIT
    if used.valid_steps >= budget.max_valid_steps:
        return StopReason.VALID_STEP_LIMIT
    if context_chars > budget.max_context_chars:
        return StopReason.CONTEXT_LIMIT
    if budget.max_tokens is not None and used.tokens >= budget.max_tokens:
        return StopReason.TOKEN_LIMIT
    return None


def after_step(facts: StepFacts) -> StopReason | None:
    """The reason to stop because of what the step just finished says, or ``None``."""
    if facts.model_failed:
        return StopReason.MODEL_FAILURE
    if facts.action_status is ActionStatus.ENV_FAULT:
        return StopReason.ENV_FAILURE
    if facts.done:
        return StopReason.ENV_DONE
    if facts.completes and facts.action_status is ActionStatus.EXECUTED and not facts.synthesized:
        return StopReason.SUBMITTED
    if facts.decision is DecisionKind.FINAL:
        return StopReason.FINAL_ANSWER
    return None


def counts_as_valid(action_status: ActionStatus | None) -> bool:
    """Whether a step uses up a valid step: only an action that ran.

    A tool whose handler raised still ran, so a model cannot loop on a broken tool for
    free; a refused action or an unusable reply does not count.
    """
    return action_status is ActionStatus.EXECUTED


def settle(used: Counters, action_status: ActionStatus | None, tokens: int = 0) -> Counters:
    """The counters after one more step with the given action status and token count."""
    return Counters(
        steps=used.steps + 1,
        valid_steps=used.valid_steps + (1 if counts_as_valid(action_status) else 0),
        tokens=used.tokens + tokens,
    )


def limit_detail(budget: Budget, reason: StopReason, used: Counters, context_chars: int) -> str:
    """What the end record says when the budget check before a model call stops the run."""
    if reason is StopReason.CONTEXT_LIMIT:
        return (
            f"the context holds {context_chars} characters, more than "
            f"max_context_chars={budget.max_context_chars}"
        )
    if reason is StopReason.STEP_LIMIT:
        return f"max_steps={budget.max_steps} reached"
    if reason is StopReason.TOKEN_LIMIT:
        return f"{used.tokens} tokens used, max_tokens={budget.max_tokens} reached"
    return f"max_valid_steps={budget.max_valid_steps} reached"


def unmetered(budget: Budget, usage: Usage | None) -> str | None:
    """Why a reply that reports ``usage`` cannot be counted against the token budget.

    A budget that a reply could slip past unseen would not be a budget, so a reply
    that does not say what it cost ends the run rather than going uncounted.
    """
    limit = budget.max_tokens
    if limit is None or (usage is not None and usage.total_tokens is not None):
        return None
    return (
        f"the model reply does not report its input and output tokens, and the run "
        f"has a token budget (max_tokens={limit}) that cannot be kept without them"
    )
