"""A stand-in for PolyGateway, for PolyLoop's tests only.

PolyGateway is the consumers' own LLM gateway and is not published, so it cannot be
installed here. This package mirrors the part of its surface that PolyLoop's gateway
adapter is written against, with the same names at the top level of the package:

* ``GatewayClient.chat(messages, *, session_id=None, parent_card_id=None)``, a coroutine
  returning an ``LLMResponse``; ``messages`` is a list of ``{"role", "content"}`` dicts;
* ``LLMResponse``, about twenty fields, among them ``call_id: str``, the visible
  ``content``, the ``reasoning`` text, the provider's ``finish_reason`` in OpenAI's words,
  the token counts ``prompt_tokens``, ``completion_tokens`` and ``reasoning_tokens``, and
  ``model_reported``, the model string the provider answered with;
* ``GatewaySettings`` with its ``sources`` and its ``scope``;
* ``build_model_fingerprint(sources) -> str``, which covers the models and the request
  shape (sampling parameters, reasoning switch) of every source, and nothing else;
* ``AllSourcesExhausted``, ``CircuitOpenError`` and ``GovernanceBackendError``.

Two things are stand-in only and say so: how a client is built (the real gateway builds
its client with a factory that takes the governance pieces: limiter, breaker, cache,
telemetry, retry policy; here a client takes its settings and a *responder* coroutine
that plays the upstream providers, so a test can script answers, failures and delays),
and the ``calls`` list a client keeps of what it was asked.

The real ``chat`` takes more keywords than the two above; the adapter never passes them,
so this one does not accept them: an adapter that started to pass one would fail here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

__all__ = (
    "AllSourcesExhausted",
    "ChatRequest",
    "CircuitOpenError",
    "GatewayClient",
    "GatewayError",
    "GatewaySettings",
    "GovernanceBackendError",
    "LLMResponse",
    "SourceSpec",
    "build_model_fingerprint",
)

_ROLES = frozenset({"system", "user", "assistant"})


class GatewayError(Exception):
    """Base class of the gateway's own failures."""


class AllSourcesExhausted(GatewayError):
    """Every source of the scope failed or was skipped, retries included."""


class CircuitOpenError(GatewayError):
    """The breaker of the scope is open; no request was sent upstream."""


class GovernanceBackendError(GatewayError):
    """A governance backend (limiter, cache, ledger) could not be reached."""


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """One upstream (provider, model) pair with the request shape the gateway sends it."""

    provider: str
    model: str
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int | None = None
    reasoning: bool = False
    # Routing only: these decide where a request goes, not what the model is.
    api_base: str = ""
    weight: int = 1


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What a gateway client is built from: its scope, its sources, its governance."""

    scope: str
    sources: tuple[SourceSpec, ...]
    rate_limit_rpm: int = 600
    circuit_failure_threshold: int = 5
    cache_ttl_s: float = 0.0
    max_retries: int = 2


def build_model_fingerprint(sources: Sequence[SourceSpec]) -> str:
    """A stable digest of which models this scope uses and how it asks them.

    Sampling parameters and the reasoning switch are part of it; routing details
    (endpoint, weight) are not. The order of the sources does not matter.
    """
    shapes = sorted(
        json.dumps(
            {
                "provider": source.provider,
                "model": source.model,
                "temperature": source.temperature,
                "top_p": source.top_p,
                "max_tokens": source.max_tokens,
                "reasoning": source.reasoning,
            },
            sort_keys=True,
        )
        for source in sources
    )
    digest = hashlib.sha256("\n".join(shapes).encode()).hexdigest()
    return f"mfp1:{digest}"


@dataclass(frozen=True, slots=True)
class LLMResponse:
    """One finished model call as the gateway reports it (about twenty fields)."""

    call_id: str
    content: str
    reasoning: str | None = None
    scope: str = ""
    session_id: str | None = None
    parent_card_id: str | None = None
    model_alias: str = ""
    model_reported: str = ""
    provider: str = ""
    source_index: int = 0
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    total_tokens: int = 0
    latency_ms: float = 0.0
    first_token_ms: float = 0.0
    cache_hit: bool = False
    cost_usd: float = 0.0
    retries: int = 0
    created_at: float = 0.0


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """Stand-in only: one ``chat`` call as the responder and the tests see it."""

    messages: list[dict[str, str]]
    session_id: str | None
    parent_card_id: str | None


Responder = Callable[[ChatRequest], Awaitable[LLMResponse]]


class GatewayClient:
    """A gateway client. Stand-in construction: settings plus a scripted responder."""

    def __init__(self, settings: GatewaySettings, *, responder: Responder) -> None:
        self._settings = settings
        self._responder = responder
        self.calls: list[ChatRequest] = []

    async def chat(
        self,
        messages: list[dict[str, str]],
        *,
        session_id: str | None = None,
        parent_card_id: str | None = None,
    ) -> LLMResponse:
        """Send one conversation through the gateway and return the finished response."""
        _check_messages(messages)
        for name, value in (("session_id", session_id), ("parent_card_id", parent_card_id)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None")
        request = ChatRequest(
            messages=[dict(message) for message in messages],
            session_id=session_id,
            parent_card_id=parent_card_id,
        )
        self.calls.append(request)
        return await self._responder(request)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list):
        raise TypeError("messages must be a list of dicts")
    for message in messages:
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise TypeError(f"each message must be a dict with role and content: {message!r}")
        if message["role"] not in _ROLES or not isinstance(message["content"], str):
            raise TypeError(f"malformed message: {message!r}")
