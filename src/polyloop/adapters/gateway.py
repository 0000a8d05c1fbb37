"""PolyGateway behind the :class:`~polyloop.ports.ModelClient` seam.

PolyGateway already does everything around a model call that is governance: retries,
back-off, source fail-over, circuit breaking, rate limits, caching, telemetry. This
adapter therefore only translates, in both directions, and adds no behaviour of its own:

* messages: the text blocks of each message are joined with no separator into the
  gateway's ``{"role", "content"}`` dicts (a separator would put characters in front of
  the model that nobody wrote);
* binding: of the request's binding, only ``session_id`` and ``parent_card_id`` have a
  slot in ``chat`` and are passed; the other keys are already in the run's snapshot, and
  keys the gateway does not know are not an error;
* failures: whatever ``chat`` raises, cancellation included, reaches the library as it
  is, so a run that ends with ``MODEL_FAILURE`` names the gateway's own exception class;
  there is no retry here, which would stack a second budget on the gateway's own;
* reply: ``call_id``, ``content`` and ``reasoning`` are kept (an empty ``call_id``
  becomes ``None``), and so is what the response says about the reply: its finish
  reason, its token counts and the model string the provider reported (an empty one
  becomes ``None``). The gateway reports no refusal, so ``refusal`` stays ``None``. The
  other fields of the response (latency, cost, cache hits...) stay in the gateway's
  ledger, joined by ``call_id``.

Importing this module imports ``polygateway``; nothing else in PolyLoop does.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from polyloop.ports import ModelCall, ModelReply
from polyloop.types import FinishReason, JSONValue, Message, TextBlock, Usage

__all__ = ("GATEWAY_ERRORS", "REPLY_FIELDS", "GatewayModelClient")

# ========================================================================================
# MAPPING ONTO THE ``polygateway`` PACKAGE
#
# Every name, attribute and keyword this adapter assumes about PolyGateway is in this
# section and nowhere else: aligning the adapter with a release of the gateway is a change
# here only. The class below touches the gateway through the helpers of this section.
#
# The gateway is a private package: the type checker usually cannot see it, hence the
# ignore on the import (``unused-ignore`` keeps the check quiet where it is installed).
# The Protocols below spell out, for the type checker, exactly the part of the gateway
# this adapter relies on.
# ========================================================================================

from polygateway import (  # type: ignore[import-not-found, unused-ignore]
    AllSourcesExhausted,
    CircuitOpenError,
    GatewayClient,
    GatewaySettings,
    GovernanceBackendError,
    LLMResponse,
    build_model_fingerprint,
)

GATEWAY_ERRORS: tuple[type[Exception], ...] = (
    AllSourcesExhausted,
    CircuitOpenError,
    GovernanceBackendError,
)
"""The gateway failures this adapter knows of. None is caught: each one ends the run with
``MODEL_FAILURE`` and a detail that starts with its own class name."""

_CHAT_SLOTS = ("session_id", "parent_card_id")
"""Binding keys that ``chat`` has keyword slots for, passed under the same names."""

REPLY_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "call_id": "call_id",
        "content": "content",
        "reasoning": "reasoning",
        "finish": "finish_reason",
        "usage.input_tokens": "prompt_tokens",
        "usage.output_tokens": "completion_tokens",
        "usage.reasoning_tokens": "reasoning_tokens",
        "model": "model_reported",
    }
)
"""Which attribute of ``LLMResponse`` each :class:`~polyloop.ports.ModelReply` field is
read from. The gateway reports no refusal; ``ModelReply.refusal`` stays ``None``."""

_FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "content_filter": FinishReason.CONTENT_FILTER,
    "tool_calls": FinishReason.TOOL_CALLS,
}
"""The gateway passes the provider's finish reason on in OpenAI's words; others are OTHER."""


class _Settings(Protocol):
    """What the adapter reads from ``GatewaySettings``."""

    @property
    def sources(self) -> Any: ...  # opaque here: only handed to the fingerprint function

    @property
    def scope(self) -> Any: ...  # recorded as its string form


class _Response(Protocol):
    """What the adapter reads from ``LLMResponse``: the attributes of ``REPLY_FIELDS``."""

    @property
    def call_id(self) -> str: ...

    @property
    def content(self) -> str: ...

    @property
    def reasoning(self) -> str | None: ...

    @property
    def finish_reason(self) -> str: ...

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def reasoning_tokens(self) -> int: ...

    @property
    def model_reported(self) -> str: ...


class _Client(Protocol):
    """What the adapter calls on ``GatewayClient``."""

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        session_id: str | None = ...,
        parent_card_id: str | None = ...,
    ) -> _Response: ...


def _check_pair(client: object, settings: object) -> None:
    if not isinstance(client, GatewayClient):
        raise TypeError(f"client must be a polygateway.GatewayClient, not {type(client).__name__}")
    if not isinstance(settings, GatewaySettings):
        raise TypeError(
            f"settings must be a polygateway.GatewaySettings, not {type(settings).__name__}"
        )


def _identity(settings: _Settings) -> dict[str, JSONValue]:
    fingerprint: str = build_model_fingerprint(settings.sources)
    return {"fingerprint": fingerprint, "scope": str(settings.scope)}


def _gateway_message(message: Message) -> dict[str, Any]:
    texts = [block.text for block in message.content if isinstance(block, TextBlock)]
    if len(texts) != len(message.content):
        raise ValueError("the gateway adapter sends text blocks only; this message has others")
    return {
        "role": message.role.value,  # "system" | "user" | "assistant", as the gateway spells them
        "content": "".join(texts),
    }


async def _chat(
    client: _Client, messages: list[dict[str, Any]], binding: Mapping[str, str]
) -> _Response:
    slots = {key: binding[key] for key in _CHAT_SLOTS if key in binding}
    return await client.chat(messages, **slots)


def _reply(response: _Response) -> ModelReply:
    if not isinstance(response, LLMResponse):
        raise TypeError(
            f"the gateway returned {type(response).__name__}, not polygateway.LLMResponse"
        )
    return ModelReply(
        call_id=_field(response, "call_id") or None,
        content=_field(response, "content"),
        reasoning=_field(response, "reasoning"),
        finish=_finish(_field(response, "finish")),
        usage=_usage(response),
        model=_field(response, "model") or None,
    )


def _field(response: object, reply_field: str) -> Any:
    """The response attribute that ``reply_field`` is read from.

    A response without ``call_id`` or ``content`` is an error; one without any of the
    other attributes (a gateway release that does not report it) leaves it ``None``.
    """
    name = REPLY_FIELDS[reply_field]
    if reply_field in ("call_id", "content"):
        return getattr(response, name)
    return getattr(response, name, None)


def _finish(reported: object) -> FinishReason | None:
    if not isinstance(reported, str) or not reported:
        return None
    return _FINISH_REASONS.get(reported, FinishReason.OTHER)


def _usage(response: object) -> Usage | None:
    counts = {
        name: _count(_field(response, f"usage.{name}"))
        for name in ("input_tokens", "output_tokens", "reasoning_tokens")
    }
    usage = Usage(**counts)
    return None if usage == Usage() else usage


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


# ========================================================================================
# END OF THE MAPPING SECTION
# ========================================================================================


class GatewayModelClient:
    """A :class:`~polyloop.ports.ModelClient` that calls the model through PolyGateway.

    ``client`` is a ``GatewayClient`` your project has already built, with whatever
    limiter, breaker, cache and telemetry it shares between its uses; this adapter never
    builds one. ``settings`` is the ``GatewaySettings`` that client was built from; it is
    read once, here, to compute the model identity that goes into every run's snapshot
    (the gateway's own ``build_model_fingerprint`` of the sources, plus the scope), because
    the client does not disclose its sources or its scope.

    .. warning::
       **The client and the settings must belong together.** Nothing can check it: the
       client does not say which settings built it. Given a client and some other
       settings, the fingerprint describes a model the runs are not using, and the
       identity check of :func:`~polyloop.session.resume` (which is what refuses to
       continue a run on a different model configuration) checks the wrong thing.

    One instance may serve any number of concurrent runs: it keeps no per-call state.
    """

    __slots__ = ("_client", "_parameters")

    def __init__(self, *, client: GatewayClient, settings: GatewaySettings) -> None:
        _check_pair(client, settings)
        self._client: _Client = client
        self._parameters = _identity(settings)

    def parameters(self) -> Mapping[str, JSONValue]:
        """``{"fingerprint": <the gateway's model fingerprint>, "scope": <the scope>}``."""
        return dict(self._parameters)

    async def call(self, call: ModelCall) -> ModelReply:
        """Make one call through ``chat``; its exceptions and cancellation pass through.

        The native tool style is refused (``ValueError``): how the gateway carries tool
        calls is not known yet, so it is not guessed at.
        """
        if call.tools:
            raise ValueError(
                "the gateway adapter does not support the native tool style yet (the "
                "gateway's tool protocol is not known): use ToolStyle.JSON or MARKDOWN"
            )
        messages = [_gateway_message(message) for message in call.messages]
        return _reply(await _chat(self._client, messages, call.binding))

    def __repr__(self) -> str:
        return f"GatewayModelClient(scope={self._parameters['scope']!r})"
