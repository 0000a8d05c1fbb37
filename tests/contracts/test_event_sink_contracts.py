"""The event sinks PolyLoop ships keep the event-sink contract, the command line's too.

Each of them hands an event on at once and awaits nothing, so none has an emit in flight
to cancel: the suite's in-flight test is skipped for them, by the contract's default.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kit.deltas import DeltaRecordingSink
from polyloop import EventSink, NullSink
from polyloop.cli._demo import ProgressSink
from polyloop.testing import RecordingSink
from polyloop.testing.event_sink_contract import EventSinkContract


class TestNullSink(EventSinkContract):
    @pytest.fixture
    def event_sink(self) -> EventSink:
        return NullSink()


class TestRecordingSink(EventSinkContract):
    @pytest.fixture
    def event_sink(self) -> EventSink:
        return RecordingSink()


class TestProgressSink(EventSinkContract):
    @pytest.fixture
    def event_sink(self) -> EventSink:
        return ProgressSink(Console(file=io.StringIO(), width=100), note="contract")


class TestDeltaRecordingSink(EventSinkContract):
    """The tests' own delta sink, so that the suite's checks of a delta sink run."""

    @pytest.fixture
    def event_sink(self) -> EventSink:
        return DeltaRecordingSink()
