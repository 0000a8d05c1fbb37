"""LLMock, a mock server this project did not write, for the adapters' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llmock.simulation import MockResponseSettings
from llmock.testing import LLMockServer


@pytest.fixture(scope="module")
def llmock_server() -> Iterator[LLMockServer]:
    # Scripted replies only: no tool is offered, so it never decides on a call of its own.
    with LLMockServer(responses=MockResponseSettings(tool_mode="off")) as started:
        yield started
        # A request a test left stalled, cancelled on the client's side long ago, would
        # hold the server's exit up for seconds: nothing waits for it, so do not wait.
        # (LLMock has no public switch for it; without this attribute, exit is just slower.)
        web = getattr(started, "_server", None)
        if web is not None:
            web.force_exit = True


@pytest.fixture
def llmock(llmock_server: LLMockServer) -> LLMockServer:
    llmock_server.state.reset()
    return llmock_server
