"""A run start prepares its request once, under asyncio and Trio: the tool registry is
described once per call of ``run`` or ``resume``, and that one description is what the
snapshot records, what the tool list shows the model and what a native call carries."""

from __future__ import annotations

from typing import Any

import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from polyloop import (
    InvalidRequest,
    ModelCall,
    ModelReply,
    Replay,
    StopReason,
    ToolRegistry,
    ToolStyle,
    resume,
    run,
)
from polyloop.stores import MemoryStore
from polyloop.testing import FaultyStore, ScriptedModelClient, SimulatedCrash
from polyloop.types import JSONValue

pytestmark = pytest.mark.anyio

SCRIPT = [tool_call("double", n=1), answer("2")]


class ToolSeeingModel(ScriptedModelClient):
    """A scripted model that keeps the messages and the native tools of every call."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__(script)
        self.seen: list[ModelCall] = []

    async def call(self, call: ModelCall) -> ModelReply:
        self.seen.append(call)
        return await super().call(call)


@pytest.fixture
def described(monkeypatch: pytest.MonkeyPatch) -> list[ToolRegistry]:
    """Every registry ``ToolRegistry.describe`` is called on, in order."""
    calls: list[ToolRegistry] = []
    describe = ToolRegistry.describe

    def counting(self: ToolRegistry) -> JSONValue:
        calls.append(self)
        return describe(self)

    monkeypatch.setattr(ToolRegistry, "describe", counting)
    return calls


@pytest.mark.parametrize("style", list(ToolStyle))
async def test_a_run_describes_its_tools_once(
    described: list[ToolRegistry], style: ToolStyle
) -> None:
    tools = make_tools(Ledger())
    model = ToolSeeingModel(SCRIPT)
    result = await run(
        definition(MemoryStore(), model=model), request("r", tools, tool_style=style)
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert described == [tools]
    # The one description still reaches the model, as the style says it should.
    first, second = model.seen
    if style is ToolStyle.NATIVE:
        assert [tool["name"] for tool in first.tools] == ["double", "submit"]
        assert set(first.tools[0]) == {"name", "description", "parameters"}
    else:
        assert first.tools == ()
        assert any("Double a number." in m.content[0].text for m in first.messages)  # type: ignore[union-attr]
    assert second.tools == first.tools


async def test_a_resumed_run_describes_its_tools_once(described: list[ToolRegistry]) -> None:
    tools = make_tools(Ledger(), replay=Replay.ALLOWED)
    the_request = request("r", tools, model_replay=Replay.ALLOWED, tool_style=ToolStyle.NATIVE)
    store = MemoryStore()
    with pytest.raises(SimulatedCrash):
        # Crash after the start record and the first model-call intent.
        await run(definition(FaultyStore(store, fail_after_writes=2), script=SCRIPT), the_request)
    described.clear()
    model = ToolSeeingModel(SCRIPT)
    resumed = await resume(definition(store, model=model), the_request)
    assert resumed.stop_reason is StopReason.FINAL_ANSWER and resumed.step_count == 2
    assert described == [tools]
    assert all(len(call.tools) == 2 for call in model.seen)


class EarlierPortStore:
    """A store written for 0.1.0's port: it has none of the methods added since."""

    def __init__(self) -> None:
        self.inner = MemoryStore()
        for name in ("parameters", "start_run", "write_intent", "write_result", "write_step"):
            setattr(self, name, getattr(self.inner, name))
        self.read_log = self.inner.read_log
        self.end_run = self.inner.end_run


async def test_a_store_of_an_earlier_port_is_refused_before_anything_runs() -> None:
    store = EarlierPortStore()
    ledger = Ledger()
    model = ScriptedModelClient(SCRIPT)
    with pytest.raises(InvalidRequest) as refused:
        await run(definition(store, model=model), request("old", make_tools(ledger)))  # type: ignore[arg-type]
    assert refused.value.run_id == "old"
    assert (
        "the store EarlierPortStore lacks check_claim, claim_run, read_cancel, release_run, "
        "request_cancel, write_review of the store port"
    ) in str(refused.value)
    assert model.calls == []
    assert ledger.calls == []
    assert await store.inner.list_runs() == ()  # nothing was written
