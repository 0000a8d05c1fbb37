"""Where a re-driven run's messages first differ from its recorded run's, in one line.

The log keeps a digest of the messages of each model call, not the messages. The
history part of them is written out in the log all the same (each step's reply and
observation, and the template in the snapshot), so the recorded history can be built
again and compared message by message with what the re-driven run sends; the messages
before the history (run context, injected text, tool list, goal) are known only by
their digest. Pure functions over plain values: the recorded model client calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from polyloop._assembly import canonical, message_json, step_messages
from polyloop.types import Message, StepRecord

# How much of each side of the first difference a reason quotes: enough to recognise
# the text, short enough for a stop reason's detail.
QUOTE_CHARS = 60


@dataclass(frozen=True, slots=True, kw_only=True)
class Said:
    """One message of a recorded history: the step that added it, and which part it was."""

    step: int
    part: str  # "reply" or "observation"
    message: Message


def recorded_history(steps: Sequence[StepRecord], template: str, before: int) -> list[Said]:
    """The history messages the recorded run sent at step ``before``, as the loop built them."""
    said: list[Said] = []
    for step in steps:
        if step.step >= before:
            break
        messages = step_messages(step.history_text, step.observation, template, step.tool_call)
        said += [
            Said(step=step.step, part=part, message=message)
            for part, message in zip(("reply", "observation"), messages, strict=False)
        ]
    return said


def first_difference(history: Sequence[Said], sent: Sequence[Message]) -> str:
    """Which message of ``sent`` is the first to differ from the recorded ``history``.

    The recorded history is the tail of what the recorded run sent; it is matched
    against the tail of ``sent``, so the messages before it may be of any number.
    """
    before = len(sent) - len(history)
    if before < 0:
        return (
            f"{len(sent)} messages were sent where the recorded run's history alone "
            f"held {len(history)}"
        )
    for offset, said in enumerate(history):
        if sent[before + offset] != said.message:
            return _quoted(before + offset, said, sent[before + offset])
    same = f"the {len(history)} of the history are the same" if history else "no history yet"
    return (
        f"the {before} messages before the history (run context, injected text, tool "
        f"list, goal) differ from the recorded run's, whose log keeps only their digest; {same}"
    )


def _quoted(index: int, said: Said, message: Message) -> str:
    recorded = _text(said.message)
    now = _text(message)
    at = next(
        (i for i, (a, b) in enumerate(zip(recorded, now, strict=False)) if a != b),
        min(len(recorded), len(now)),
    )
    return (
        f"message {index} (the {said.part} of step {said.step}) differs at character {at}: "
        f"recorded {_around(recorded, at)}, sent {_around(now, at)}"
    )


def _text(message: Message) -> str:
    return canonical(message_json(message)).decode("utf-8", "surrogatepass")


def _around(text: str, at: int) -> str:
    start = max(0, at - QUOTE_CHARS // 2)
    end = start + QUOTE_CHARS
    head = "…" if start > 0 else ""
    tail = "…" if end < len(text) else ""
    return f"{head}{text[start:end]}{tail}"
