"""The contract every :class:`~polyloop.ports.EventSink` keeps, as reusable pytest classes.

Subclass :class:`EventSinkContract` in a test module and provide an ``event_sink``
fixture: the sink under test. Every test then runs against your sink, under each
``anyio_backend`` your test session parametrizes::

    class TestMySink(EventSinkContract):
        @pytest.fixture
        def event_sink(self):
            return MySink(queue_size=100)

        @pytest.fixture
        def slow_event_sink(self):
            return MySink(queue_size=0)  # every emit waits for a reader that never comes

``slow_event_sink`` is optional: a sink of the same kind whose ``emit`` waits until it
is cancelled, so the suite can cancel an emit in flight. Without it (the default is
``None``) that test is skipped; an emit in an already cancelled scope is still checked.
A sink that hands events on at once, awaiting nothing, has nothing to cancel.

A sink that is also a :class:`~polyloop.ports.DeltaSink` is checked to take pieces of
a model's text (and to let a cancellation out of ``emit_delta``); for any other sink
those tests are skipped.

The tests need pytest and anyio's pytest plugin (installed with anyio).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from polyloop.ports import DeltaSink, Event, EventKind, EventSink, TextDelta
from polyloop.testing._contract_checks import (
    assert_cancelled_before_start,
    assert_cancelled_in_flight,
    assert_plain_parameters,
)
from polyloop.testing.store_contract import sample_run
from polyloop.types import Amended

__all__ = ("EventSinkContract", "sample_deltas", "sample_events")

CONCURRENT_EMITS = 50


def sample_events(run_id: str) -> list[Event]:
    """One event of each kind, about the record the library sends with it."""
    writes = sample_run(run_id, steps=1)
    started = writes[0][1][0]
    step = next(args[0] for method, args in writes if method == "write_step")
    ended = writes[-1][1][0]
    amended = Amended(
        run_id=run_id,
        step=1,
        by="ops@example.com",
        reason="a clearer system prompt",
        changes={"run_context.sha256": {"recorded": "a" * 64, "amended": "b" * 64}},
        at=ended.at,
    )
    events = [
        Event(kind=EventKind.RUN_STARTED, run_id=run_id, step=None, record=started),
        Event(kind=EventKind.RUN_RESUMED, run_id=run_id, step=None, record=started),
        Event(kind=EventKind.STEP_FINISHED, run_id=run_id, step=step.step, record=step),
        Event(kind=EventKind.RUN_ENDED, run_id=run_id, step=None, record=ended),
        Event(kind=EventKind.RUN_AMENDED, run_id=run_id, step=1, record=amended),
    ]
    assert {event.kind for event in events} == set(EventKind)
    return events


def sample_deltas(run_id: str) -> list[TextDelta]:
    """The pieces of text of one streamed model call, as the library numbers them."""
    pieces = ('{"answer": ', '"four', '"}')
    return [
        TextDelta(run_id=run_id, step=0, result_id=f"{run_id}:0:model", index=index, text=text)
        for index, text in enumerate(pieces)
    ]


@pytest.mark.anyio
class EventSinkContract:
    """Tests every event sink passes. Provide an ``event_sink`` fixture."""

    @pytest.fixture
    def slow_event_sink(self) -> EventSink | None:
        return None

    async def test_satisfies_the_seam(self, event_sink: EventSink) -> None:
        assert isinstance(event_sink, EventSink)

    async def test_parameters_are_plain_json_and_stable(self, event_sink: EventSink) -> None:
        params = assert_plain_parameters(event_sink.parameters())
        for event in sample_events("r1"):
            await event_sink.emit(event)
        assert dict(event_sink.parameters()) == params

    async def test_every_kind_of_event_is_taken(self, event_sink: EventSink) -> None:
        emit: Callable[[Event], Awaitable[object]] = event_sink.emit
        for event in sample_events("r1"):
            assert await emit(event) is None

    async def test_concurrent_emits(self, event_sink: EventSink) -> None:
        returned: list[object] = []
        deliver: Callable[[Event], Awaitable[object]] = event_sink.emit

        async def emit(event: Event) -> None:
            returned.append(await deliver(event))

        async with anyio.create_task_group() as group:
            for index in range(CONCURRENT_EMITS):
                for event in sample_events(f"run-{index}"):
                    group.start_soon(emit, event)
        assert returned == [None] * (CONCURRENT_EMITS * len(EventKind))

    async def test_an_emit_in_a_cancelled_scope_lets_the_cancellation_out(
        self, event_sink: EventSink
    ) -> None:
        event = sample_events("r1")[2]
        await assert_cancelled_before_start(lambda: event_sink.emit(event))

    async def test_cancelling_an_emit_in_flight_propagates(
        self, slow_event_sink: EventSink | None
    ) -> None:
        if slow_event_sink is None:
            pytest.skip("no slow_event_sink: an emit in flight cannot be cancelled")
        event = sample_events("r1")[2]
        await assert_cancelled_in_flight(lambda: slow_event_sink.emit(event))

    async def test_a_delta_sink_takes_pieces_of_text(self, event_sink: EventSink) -> None:
        if not isinstance(event_sink, DeltaSink):
            pytest.skip("not a DeltaSink: it takes no pieces of text")
        params = dict(event_sink.parameters())
        deliver: Callable[[TextDelta], Awaitable[object]] = event_sink.emit_delta
        for delta in sample_deltas("r1"):
            assert await deliver(delta) is None
        assert dict(event_sink.parameters()) == params

    async def test_an_emit_delta_in_a_cancelled_scope_lets_the_cancellation_out(
        self, event_sink: EventSink
    ) -> None:
        if not isinstance(event_sink, DeltaSink):
            pytest.skip("not a DeltaSink: it takes no pieces of text")
        delta = sample_deltas("r1")[0]
        await assert_cancelled_before_start(lambda: event_sink.emit_delta(delta))
