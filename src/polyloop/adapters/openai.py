"""Any OpenAI-compatible Chat Completions server behind the model-client seam.

OpenAI itself, vLLM, Ollama, llama.cpp server and every other server that speaks the
Chat Completions protocol: :class:`OpenAIModelClient` wraps an ``openai.AsyncOpenAI``
client that you build (base URL, key, timeouts, HTTP client and retry setting are yours)
and turns each model call of a run into one ``chat.completions.create`` request:

* messages: each message becomes ``{"role", "content"}``, its text blocks joined with no
  separator;
* binding: the request's binding, every key, goes as the request ``metadata`` (omitted
  when the binding is empty). OpenAI's own API accepts ``metadata`` only together with
  ``store``: against it, run with an empty binding or put ``"store": True`` in
  ``sampling``;
* sampling: the ``sampling`` mapping is passed as keyword arguments, as given;
* reply: the response ``id`` becomes ``call_id`` (``None`` if empty or missing), the first
  choice's ``message.content`` becomes ``content`` (``""`` if the server sent none), and
  the ``reasoning_content`` field that reasoning servers add to the message, when present,
  becomes ``reasoning``.

The adapter retries nothing and translates nothing: an exception of the SDK (a status
error, a connection error, a body that is not JSON) ends the run with ``MODEL_FAILURE``
under its own class name, and cancellation closes the request's connection and goes on.
The SDK retries on its own unless told otherwise: whether it does is the ``max_retries``
you give ``AsyncOpenAI`` (``max_retries=0`` for exactly one request per model call).

Importing this module imports ``openai``; nothing else in the library does.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from polyloop.ports import ModelCall, ModelReply
from polyloop.types import JSONValue, Message

__all__ = ("RESERVED_SAMPLING_KEYS", "OpenAIModelClient")

RESERVED_SAMPLING_KEYS = frozenset(
    {
        "model",
        "messages",
        "metadata",  # set by the adapter
        "stream",
        "stream_options",  # would turn the reply into a stream
        "extra_headers",
        "extra_query",
        "timeout",  # transport: belongs on the client
    }
)
"""Keyword arguments of ``create`` that ``sampling`` may not hold. Everything in
``sampling`` is recorded in every run's snapshot and checked by ``resume``: headers (which
may carry credentials), query parameters and timeouts are set on the client instead
(``default_headers``, ``default_query``, ``timeout``)."""


class OpenAIModelClient:
    """A :class:`~polyloop.ports.ModelClient` for an OpenAI-compatible server.

    ``client`` is an ``openai.AsyncOpenAI`` you built and own (close it when you are done
    with it). ``model`` is the model name the server knows. ``sampling`` holds the other
    keyword arguments of ``chat.completions.create`` that shape the answer
    (``temperature``, ``top_p``, ``max_tokens``, ``seed``...); a parameter the SDK does not
    name but your server understands goes under ``"extra_body"``, e.g.
    ``{"extra_body": {"top_k": 20}}``. A key that ``create`` does not accept is refused
    here, with ``ValueError``, instead of failing every run later.

    ``parameters()`` reports the base URL, the model and the sampling parameters: what
    the run's snapshot records and what :func:`~polyloop.session.resume` checks. The API
    key, timeouts and retry setting are not part of it.

    One instance may serve any number of concurrent runs: it keeps no per-call state.
    """

    __slots__ = ("_client", "_model", "_sampling")

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        *,
        model: str,
        sampling: Mapping[str, JSONValue],
    ) -> None:
        if not isinstance(client, openai.AsyncOpenAI):
            raise TypeError(f"client must be an openai.AsyncOpenAI, not {type(client).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string")
        _check_sampling(client, sampling)
        self._client = client
        self._model = model
        self._sampling: dict[str, Any] = copy.deepcopy(dict(sampling))

    def parameters(self) -> Mapping[str, JSONValue]:
        """``{"base_url": ..., "model": ..., "sampling": {...}}``."""
        return {
            "base_url": str(self._client.base_url),
            "model": self._model,
            "sampling": copy.deepcopy(self._sampling),
        }

    async def call(self, call: ModelCall) -> ModelReply:
        """Make one Chat Completions request; exceptions and cancellation pass through."""
        options: dict[str, Any] = copy.deepcopy(self._sampling)
        if call.binding:
            options["metadata"] = dict(call.binding)
        response = await self._client.chat.completions.create(
            model=self._model,
            messages=[_chat_message(message) for message in call.messages],
            **options,
        )
        return _reply(response)

    def __repr__(self) -> str:
        return f"OpenAIModelClient(base_url={str(self._client.base_url)!r}, model={self._model!r})"


def _check_sampling(client: openai.AsyncOpenAI, sampling: Mapping[str, JSONValue]) -> None:
    if not isinstance(sampling, Mapping):
        raise TypeError("sampling must be a mapping of keyword arguments")
    keys = list(sampling)
    if bad := [key for key in keys if not isinstance(key, str)]:
        raise TypeError(f"sampling keys must be strings: {bad!r}")
    if reserved := sorted(RESERVED_SAMPLING_KEYS.intersection(keys)):
        raise ValueError(
            f"sampling may not set {reserved}: model, messages and metadata are the "
            "adapter's, replies are not streamed, and transport settings belong on the client"
        )
    accepted = inspect.signature(client.chat.completions.create).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in accepted):
        return
    names = {parameter.name for parameter in accepted}
    if unknown := sorted(key for key in keys if key not in names):
        raise ValueError(
            f"chat.completions.create takes no parameter {unknown}; "
            'pass server-specific parameters under "extra_body"'
        )


def _chat_message(message: Message) -> ChatCompletionMessageParam:
    content = "".join(block.text for block in message.content)
    # The SDK types each role's dict separately; this one dict fits the role it names.
    return cast("ChatCompletionMessageParam", {"role": message.role.value, "content": content})


def _reply(response: object) -> ModelReply:
    if not isinstance(response, ChatCompletion):
        raise TypeError(
            f"the server's answer is not a chat completion but {type(response).__name__}"
        )
    # Servers are lenient about ids: missing, null and "" all mean "no join key".
    call_id = getattr(response, "id", None)
    if not response.choices:
        raise ValueError(f"the chat completion {call_id!r} has no choices")
    message = response.choices[0].message
    # Not in the SDK's schema; reasoning servers add it, and the SDK keeps extra fields.
    reasoning = (message.model_extra or {}).get("reasoning_content")
    return ModelReply(
        call_id=call_id if isinstance(call_id, str) and call_id else None,
        content=message.content if isinstance(message.content, str) else "",
        reasoning=reasoning if isinstance(reasoning, str) else None,
    )
