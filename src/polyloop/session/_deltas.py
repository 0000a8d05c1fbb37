"""The model's text as it arrives: how the loop calls the model of one run.

A run whose model client can stream (:class:`~polyloop.ports.StreamingModelClient`) and
whose event sink hears text (:class:`~polyloop.ports.DeltaSink`) calls the client's
``stream``, and each piece of text goes to the sink as a
:class:`~polyloop.ports.TextDelta` while the call runs. Every other run calls ``call``.
Either way the call returns one whole reply, and only that reply is recorded: pieces
are never written, so they are seen only in the process that runs the step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from polyloop.ports import ModelCall, ModelClient, ModelReply, StreamingModelClient, TextDelta
from polyloop.session._relay import Relay

ModelCaller = Callable[[ModelCall], Awaitable[ModelReply]]


def model_caller(model: ModelClient, relay: Relay) -> ModelCaller:
    """How this run calls its model; decided once per run."""
    if relay.takes_deltas and isinstance(model, StreamingModelClient):
        return _Streamed(model, relay).call
    return model.call


class _Streamed:
    """Calls a streaming client, numbering each call's pieces and relaying them."""

    __slots__ = ("_model", "_relay")

    def __init__(self, model: StreamingModelClient, relay: Relay) -> None:
        self._model = model
        self._relay = relay

    async def call(self, call: ModelCall) -> ModelReply:
        """Stream ``call``, relaying its pieces; return the whole reply.

        Cancellation: propagates from the client or the sink; nothing is written here.
        """
        count = 0
        returned = False

        async def on_text(text: str) -> None:
            nonlocal count
            if not isinstance(text, str):
                raise TypeError(
                    f"a streamed piece of text must be a str, not {type(text).__name__}"
                )
            # Empty pieces say nothing; pieces after the call returned come too late to
            # precede the step's record, and are dropped.
            if not text or returned:
                return
            delta = TextDelta(
                run_id=call.run_id,
                step=call.call_index,
                result_id=call.result_id,
                index=count,
                text=text,
            )
            count += 1
            await self._relay.emit_delta(delta)

        try:
            return await self._model.stream(call, on_text)
        finally:
            returned = True
