"""A delta sink and a store that note, in one timeline, when each piece of a model's
text arrived and when each step record was written."""

from __future__ import annotations

from typing import Any

from polyloop import Event, StepRecord, TextDelta
from polyloop.stores import MemoryStore
from polyloop.testing import RecordingSink

Timeline = list[tuple[str, Any]]


class DeltaRecordingSink(RecordingSink):
    """A recording sink that also keeps every piece of text, in one timeline.

    Its parameters are a :class:`RecordingSink`'s, so a run through either has one
    snapshot."""

    def __init__(self, timeline: Timeline | None = None) -> None:
        super().__init__()
        self.deltas: list[TextDelta] = []
        self.timeline = timeline if timeline is not None else []

    async def emit(self, event: Event) -> None:
        self.timeline.append(("event", event.kind))
        await super().emit(event)

    async def emit_delta(self, delta: TextDelta) -> None:
        self.deltas.append(delta)
        self.timeline.append(("delta", delta.step))

    def text_of(self, step: int) -> str:
        """The pieces of ``step``'s call joined, checking they came numbered in order."""
        mine = [delta for delta in self.deltas if delta.step == step]
        assert [delta.index for delta in mine] == list(range(len(mine)))
        return "".join(delta.text for delta in mine)


class TimelineStore(MemoryStore):
    """A memory store that notes in the timeline when each step record is written."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline

    async def write_step(self, step: StepRecord, action_result: Any) -> None:
        self.timeline.append(("write_step", step.step))
        await super().write_step(step, action_result)
