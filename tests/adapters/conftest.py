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


@pytest.fixture
def llmock(llmock_server: LLMockServer) -> LLMockServer:
    llmock_server.state.reset()
    return llmock_server
