"""Scripted seams: deterministic stand-ins for a model, an interpreter and an environment."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence

import anyio
import anyio.lowlevel

from polyloop._json_decisions import Finding, LenientReading
from polyloop.ports import Action, ActionOutcome, Decision, Event, ModelCall, ModelReply
from polyloop.types import JSONValue, Replay

ScriptItem = str | ModelReply | Exception
OutcomeItem = ActionOutcome | Exception


class ScriptExhausted(Exception):
    """The scripted model was called more often than its script has replies."""


class ScriptedModelClient:
    """A model client that answers call ``i`` of every run with ``script[i]``.

    A string becomes a reply whose ``call_id`` is ``"<run_id>/<i>"``; an exception is
    raised instead of answering. ``script`` may also be a function of the call. Every
    call is kept in :attr:`calls`. One instance can serve many concurrent runs.

    It answers by call number alone and never reads the messages: a settlement, an
    approval with edited arguments or a rejection does not change its next answer.
    """

    def __init__(
        self,
        script: Sequence[ScriptItem] | Callable[[ModelCall], ScriptItem],
        *,
        delay: float = 0.0,
        name: str = "scripted",
    ) -> None:
        self._script = script
        self._delay = delay
        self._name = name
        self.calls: list[ModelCall] = []

    def parameters(self) -> Mapping[str, JSONValue]:
        params: dict[str, JSONValue] = {"kind": "scripted", "name": self._name}
        if not callable(self._script):
            text = json.dumps([_describe_item(item) for item in self._script])
            params["script_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return params

    async def call(self, call: ModelCall) -> ModelReply:
        self.calls.append(call)
        if self._delay:
            await anyio.sleep(self._delay)
        else:
            await anyio.lowlevel.checkpoint()
        item = self._item(call)
        if isinstance(item, Exception):
            raise item
        if isinstance(item, ModelReply):
            return item
        return ModelReply(call_id=f"{call.run_id}/{call.call_index}", content=item, reasoning=None)

    def _item(self, call: ModelCall) -> ScriptItem:
        if callable(self._script):
            return self._script(call)
        if call.call_index >= len(self._script):
            return ScriptExhausted(f"no scripted reply for call {call.call_index}")
        return self._script[call.call_index]


def _describe_item(item: ScriptItem) -> JSONValue:
    if isinstance(item, ModelReply):
        described: list[JSONValue] = [item.call_id, item.content, item.reasoning]
        facts = {
            "finish": str(item.finish) if item.finish is not None else None,
            "usage": repr(item.usage) if item.usage is not None else None,
            "model": item.model,
            "refusal": item.refusal,
        }
        # Only what a reply reports beyond its text, so older scripts hash as before.
        if any(value is not None for value in facts.values()):
            described.append({k: v for k, v in facts.items() if v is not None})
        return described
    if isinstance(item, Exception):
        return f"{type(item).__name__}: {item}"
    return item


class JsonActionInterpreter:
    """A test double: the reply is one JSON object, and nothing else.

    ``{"tool": NAME, "arguments": {...}}`` is an action with the payload
    ``{"name": NAME, "arguments": {...}}``; ``{"answer": TEXT}`` is a final answer;
    anything else is an invalid decision with one fixed feedback. It is kept as it is
    because tests pin its behaviour and its parameters; applications should name an
    interpreter from :mod:`polyloop.interpreters` instead, such as
    :class:`~polyloop.interpreters.JsonToolCallInterpreter`, which also reads a fenced
    block and tells the model precisely what was wrong.
    """

    FEEDBACK = (
        'Reply with one JSON object: {"tool": <name>, "arguments": {...}} to use a tool, '
        'or {"answer": <text>} to answer.'
    )

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "json-action", "version": 1}

    def interpret(self, reply: ModelReply) -> Decision:
        return _LOOSE_JSON.interpret(reply)


_LOOSE_JSON = LenientReading(finding=Finding.WHOLE_REPLY, feedback=JsonActionInterpreter.FEEDBACK)


class ScriptedEnvironment:
    """An action executor that answers the action of step ``k`` with ``outcomes[k]``.

    The step comes from the result id the library allocates (``"<run_id>:<k>:action"``),
    so a replay after a crash gets the same outcome. Every execution's result id is kept
    in :attr:`executions`, which is how tests prove an action never ran twice.
    """

    def __init__(
        self,
        outcomes: Sequence[OutcomeItem] | Callable[[Action, int], OutcomeItem],
        *,
        replay: Replay = Replay.NEVER,
        delay: float = 0.0,
    ) -> None:
        self._outcomes = outcomes
        self._replay = replay
        self._delay = delay
        self.executions: list[str] = []

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Answer from the script.

        Cancellation: propagates from the delay; the execution is already counted.
        """
        self.executions.append(result_id)
        if self._delay:
            await anyio.sleep(self._delay)
        else:
            await anyio.lowlevel.checkpoint()
        step = int(result_id.rsplit(":", 2)[-2])
        if callable(self._outcomes):
            item = self._outcomes(action, step)
        else:
            item = self._outcomes[step]
        if isinstance(item, Exception):
            raise item
        return item

    def replay(self, action: Action) -> Replay:
        return self._replay


class RecordingSink:
    """An event sink that keeps every event in :attr:`events`."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def parameters(self) -> Mapping[str, JSONValue]:
        return {"kind": "recording"}

    async def emit(self, event: Event) -> None:
        self.events.append(event)
