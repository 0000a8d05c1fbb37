"""The calls a run's log holds, walked as the live sink would have seen them.

A resumed attempt rebuilds from them the spans of the steps earlier attempts logged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from polyloop.types import Intent, IntentKind, Record, Result, Settlement, StepRecord

LoggedStep = tuple[StepRecord, Intent | None, Settlement | None]
"""A step record, with its action's intent and the settlement that closed it, if any."""


def logged_calls(records: Iterable[Record]) -> Iterator[LoggedStep | Intent]:
    """The calls a log holds, in order, as the live sink would have seen them: each step
    record with its action's intent and the settlement that closed it, then an action
    intent with no result after it (in doubt) if the log ends with one that no
    settlement closed. Walks the log once and keeps nothing of it."""
    action: Intent | None = None  # the action intent of the step being walked
    open_intent: Intent | None = None
    settlement: Settlement | None = None
    for record in records:
        if isinstance(record, Intent):
            open_intent = record
            if record.kind is IntentKind.ACTION:
                action = record
        elif isinstance(record, Result):
            open_intent = None
        elif isinstance(record, Settlement):
            settlement = record
        elif isinstance(record, StepRecord):
            intent = action if action is not None and action.step == record.step else None
            settled = settlement if record.settled_by is not None else None
            yield record, intent, settled
            action = open_intent = settlement = None
    # A settled action is no longer in doubt: the attempt that resumes records its step.
    if open_intent is not None and open_intent.kind is IntentKind.ACTION and settlement is None:
        yield open_intent
