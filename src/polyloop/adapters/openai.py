"""Any OpenAI-compatible Chat Completions server behind the model-client seam.

OpenAI itself, vLLM, Ollama, llama.cpp server and every other server that speaks the
Chat Completions protocol: :class:`OpenAIModelClient` wraps an ``openai.AsyncOpenAI``
client that you build (base URL, key, timeouts, HTTP client and retry setting are yours)
and turns each model call of a run into one ``chat.completions.create`` request:

* messages: each message becomes ``{"role", "content"}``, its text blocks joined with no
  separator;
* binding: the request's binding, every key, goes as the request ``metadata`` (omitted
  when the binding is empty, or always with ``send_binding=False``). The binding is
  checked against OpenAI's metadata limits (at most 16 pairs, keys of at most 64
  characters, values of at most 512) before the request is sent, on every server, so a
  run that works against one server is not refused by another: a binding over the
  limits fails the call with ``ValueError`` (the binding belongs to the request, so
  ``call`` is the first place that sees it; nothing has been sent). OpenAI's own API
  accepts ``metadata`` only together with ``store``: against it, put ``"store": True`` in
  ``sampling`` (OpenAI then keeps the completions in your account) or build the adapter
  with ``send_binding=False``;
* sampling: the ``sampling`` mapping is passed as keyword arguments, as given; a key
  whose result the adapter would throw away (``n``, native tool calling, audio output,
  log probabilities) is refused when the adapter is built, see ``RESERVED_SAMPLING_KEYS``;
* reply, from the first choice:

  - ``call_id``: the response ``id`` (``None`` if empty or missing). It is the server's
    id, not PolyLoop's: some servers repeat it (Ollama draws ids from 999 values, so they
    repeat within a few dozen calls), so it is a unique key only where the server keeps
    it unique;
  - ``content``: ``message.content`` (``""`` if the server sent none);
  - ``reasoning``: ``message.reasoning`` (vLLM, Ollama) or, failing that,
    ``message.reasoning_content`` (older vLLM, llama.cpp server); neither is in OpenAI's
    schema, and the SDK keeps them as extra fields;
  - ``finish``: ``finish_reason`` as a :class:`~polyloop.types.FinishReason` (``stop``,
    ``length``, ``content_filter``, ``tool_calls`` and the legacy ``function_call`` as
    ``TOOL_CALLS``; any other value ``OTHER``; none ``None``);
  - ``refusal``: ``message.refusal`` when not empty. A reply with a refusal is a refusal:
    its ``finish`` reads ``REFUSAL`` where the server said ``stop`` or nothing (a reason
    that says more, such as ``length``, is kept);
  - ``usage``: ``prompt_tokens``, ``completion_tokens`` and
    ``completion_tokens_details.reasoning_tokens`` as input, output and reasoning tokens;
    a count the server did not send, or sent as something other than a whole number
    ``>= 0``, is ``None``, and so is the whole usage when the server reported none;
  - ``model``: the response ``model``, the name the server says answered (``None`` if
    empty).

Built with ``stream=True``, the adapter asks for each reply as a stream of chunks, with
the usage in the last one, hands each piece of content to a run's delta sink as it
arrives, and adds the chunks up into the body the server would have sent whole: the
reply is the one the same request read whole maps to, and only it is recorded. A
stream that ends with no chunk saying how the reply finished was cut off in transit: a
``ValueError``, never half a reply.

The adapter retries nothing and translates nothing: an exception of the SDK (a status
error, a connection error, a body that is not JSON) ends the run with ``MODEL_FAILURE``
under its own class name, and cancellation closes the request's connection and goes on.
A completion without choices, or whose first choice has no message, is a ``ValueError``
that says so. Native tool-call arguments that the run's log cannot hold (``NaN``,
``1e400``, nesting deeper than the record format allows) are passed on as text, like
arguments that do not parse, for the interpreter to refuse.
The SDK retries on its own unless told otherwise: whether it does is the ``max_retries``
you give ``AsyncOpenAI`` (``max_retries=0`` for exactly one request per model call).

Needs ``openai`` 1.63 or later: earlier releases lack ``metadata`` and ``store`` or do not
run under Trio. Importing this module imports ``openai``; nothing else in the library does.
"""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import anyio

from polyloop._shared import needs_extra, plain_copy
from polyloop._strict_json import refuse_constant

with needs_extra("polyloop.adapters.openai", "openai"):
    import openai
    from openai.types.chat import (
        ChatCompletion,
        ChatCompletionChunk,
        ChatCompletionMessage,
        ChatCompletionMessageParam,
    )
from polyloop.ports import ModelCall, ModelReply
from polyloop.types import (
    FinishReason,
    JSONValue,
    Message,
    TextBlock,
    ToolCallBlock,
    ToolResultBlock,
    UnloggableValue,
    Usage,
)

__all__ = (
    "METADATA_LIMITS",
    "RESERVED_SAMPLING_KEYS",
    "OpenAIModelClient",
)

_WHY_REFUSED: Mapping[str, str] = {
    "model": "the adapter sets the model",
    "messages": "the adapter sets the messages",
    "metadata": "the adapter sends the binding as metadata",
    "stream": "build the adapter with stream=True to stream",
    "stream_options": "the adapter asks for usage itself when it streams",
    "extra_headers": "set headers on the client (default_headers)",
    "extra_query": "set query parameters on the client (default_query)",
    "timeout": "set the timeout on the client",
    "n": "only the first choice is read; leave n out (one choice is the default)",
    "tools": "the adapter sends the tools itself with ToolStyle.NATIVE",
    "tool_choice": "the loop decides what a reply without a tool call means",
    "parallel_tool_calls": "the adapter asks for one tool call per step with ToolStyle.NATIVE",
    "functions": "the legacy function calls are not read; use ToolStyle.NATIVE",
    "function_call": "the legacy function calls are not read; use ToolStyle.NATIVE",
    "modalities": "only text is read; audio output would be dropped",
    "audio": "only text is read; audio output would be dropped",
    "logprobs": "log probabilities are not recorded, so they would be dropped",
    "top_logprobs": "log probabilities are not recorded, so they would be dropped",
}

RESERVED_SAMPLING_KEYS = frozenset(_WHY_REFUSED)
"""Keyword arguments of ``create`` that ``sampling`` may not hold, each refused with its
reason. The adapter sets some itself (``model``, ``messages``, ``metadata``). Everything
in ``sampling`` is recorded in every run's snapshot and checked by ``resume``: headers
(which may carry credentials), query parameters and timeouts are set on the client
instead (``default_headers``, ``default_query``, ``timeout``). The others ask for results
the adapter would throw away: more than one choice, native tool calls, audio output, log
probabilities. ``response_format`` is accepted: it shapes the text that is read."""

METADATA_LIMITS: Mapping[str, int] = MappingProxyType(
    {"pairs": 16, "key_chars": 64, "value_chars": 512}
)
"""OpenAI's limits on request ``metadata``, which every binding sent is checked against."""

_FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "content_filter": FinishReason.CONTENT_FILTER,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,  # the legacy name of tool_calls
}

# Where reasoning servers put the thinking text, newest name first.
_REASONING_FIELDS = ("reasoning", "reasoning_content")

# How long closing a cancelled stream's connection may hold the cancellation up.
_CLOSE_GRACE_S = 5.0


class OpenAIModelClient:
    """A :class:`~polyloop.ports.ModelClient` for an OpenAI-compatible server.

    ``client`` is an ``openai.AsyncOpenAI`` you built and own (close it when you are done
    with it). ``model`` is the model name the server knows. ``sampling`` holds the other
    keyword arguments of ``chat.completions.create`` that shape the answer
    (``temperature``, ``top_p``, ``max_tokens``, ``seed``...); a parameter the SDK does not
    name but your server understands goes under ``"extra_body"``, e.g.
    ``{"extra_body": {"top_k": 20}}``. A key that ``create`` does not accept, or that is
    in :data:`RESERVED_SAMPLING_KEYS`, is refused here, with ``ValueError``, instead of
    failing or losing something on every run later.

    ``send_binding`` (default ``True``) sends each request's binding as ``metadata``; with
    ``False`` no ``metadata`` is ever sent, for servers that refuse it (OpenAI without
    ``store``) or when the server should not see the binding.

    ``stream`` (default ``False``) asks for every reply as a stream of chunks, with the
    usage in its last one (``stream_options={"include_usage": True}``), and assembles the
    chunks into the reply the same request would have had whole. The adapter is a
    :class:`~polyloop.ports.StreamingModelClient`: with a
    :class:`~polyloop.ports.DeltaSink` on the definition, the run hands the sink each
    piece of the reply's text as it arrives. Without ``stream``, the reply is read whole
    and a delta sink gets its text as one piece, once the reply is in.

    ``parameters()`` reports the base URL, the model and the sampling parameters: what
    the run's snapshot records and what :func:`~polyloop.session.resume` checks. The API
    key, timeouts, retry setting, ``send_binding`` and ``stream`` are not part of it.

    One instance may serve any number of concurrent runs: it keeps no per-call state.
    """

    __slots__ = ("_client", "_model", "_sampling", "_send_binding", "_stream")

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        *,
        model: str,
        sampling: Mapping[str, JSONValue],
        send_binding: bool = True,
        stream: bool = False,
    ) -> None:
        if not isinstance(client, openai.AsyncOpenAI):
            raise TypeError(f"client must be an openai.AsyncOpenAI, not {type(client).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty string")
        if not isinstance(send_binding, bool):
            raise TypeError("send_binding must be True or False")
        if not isinstance(stream, bool):
            raise TypeError("stream must be True or False")
        _check_sampling(client, sampling)
        self._client = client
        self._model = model
        self._sampling: dict[str, Any] = copy.deepcopy(dict(sampling))
        self._send_binding = send_binding
        self._stream = stream

    def parameters(self) -> Mapping[str, JSONValue]:
        """``{"base_url": ..., "model": ..., "sampling": {...}}``."""
        return {
            "base_url": str(self._client.base_url),
            "model": self._model,
            "sampling": copy.deepcopy(self._sampling),
        }

    async def call(self, call: ModelCall) -> ModelReply:
        """Make one Chat Completions request; exceptions and cancellation pass through.

        Cancellation: the request's connection is closed and the cancellation goes on.
        """
        return await self._request(call, None)

    async def stream(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]]
    ) -> ModelReply:
        """Make the request as :meth:`call` does, handing ``on_text`` the reply's text:
        each piece as it arrives when the adapter streams, else all of it at the end.

        Cancellation: the request's connection is closed and the cancellation goes on.
        """
        return await self._request(call, on_text)

    async def _request(
        self, call: ModelCall, on_text: Callable[[str], Awaitable[None]] | None
    ) -> ModelReply:
        options: dict[str, Any] = copy.deepcopy(self._sampling)
        if self._send_binding and call.binding:
            _check_metadata(call.binding)  # before sending: a refused request may still cost
            options["metadata"] = dict(call.binding)
        if call.tools:
            options["tools"] = [_native_tool(tool) for tool in call.tools]
            # One action per step: servers that honour it make one call at most.
            options["parallel_tool_calls"] = False
        messages = [chat for message in call.messages for chat in _chat_messages(message)]
        if self._stream:
            chunks = await self._client.chat.completions.create(
                model=self._model,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                **options,
            )
            return _reply(await _assembled(chunks, on_text), call.result_id)
        response = await self._client.chat.completions.create(
            model=self._model, messages=messages, **options
        )
        reply = _reply(response, call.result_id)
        if on_text is not None and reply.content:
            await on_text(reply.content)
        return reply

    def __repr__(self) -> str:
        return f"OpenAIModelClient(base_url={str(self._client.base_url)!r}, model={self._model!r})"


def _check_sampling(client: openai.AsyncOpenAI, sampling: Mapping[str, JSONValue]) -> None:
    if not isinstance(sampling, Mapping):
        raise TypeError("sampling must be a mapping of keyword arguments")
    keys = list(sampling)
    if bad := [key for key in keys if not isinstance(key, str)]:
        raise TypeError(f"sampling keys must be strings: {bad!r}")
    if refused := sorted(RESERVED_SAMPLING_KEYS.intersection(keys)):
        reasons = "; ".join(f"{key!r}: {_WHY_REFUSED[key]}" for key in refused)
        raise ValueError(f"sampling may not set {reasons}")
    accepted = inspect.signature(client.chat.completions.create).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in accepted):
        return
    names = {parameter.name for parameter in accepted}
    if unknown := sorted(key for key in keys if key not in names):
        raise ValueError(
            f"chat.completions.create takes no parameter {unknown}; "
            'pass server-specific parameters under "extra_body"'
        )


def _check_metadata(binding: Mapping[str, str]) -> None:
    problem = _metadata_problem(binding)
    if problem is not None:
        raise ValueError(
            f"the binding cannot go as request metadata: {problem} (OpenAI allows at most "
            f"{METADATA_LIMITS['pairs']} pairs, keys of at most {METADATA_LIMITS['key_chars']} "
            f"characters and values of at most {METADATA_LIMITS['value_chars']}, and metadata "
            "only with store=True); shorten the binding or build the adapter with "
            "send_binding=False"
        )


def _metadata_problem(binding: Mapping[str, str]) -> str | None:
    if len(binding) > METADATA_LIMITS["pairs"]:
        return f"it has {len(binding)} pairs"
    for key, value in binding.items():
        if len(key) > METADATA_LIMITS["key_chars"]:
            return f"the key {key[:20]!r}... has {len(key)} characters"
        if len(value) > METADATA_LIMITS["value_chars"]:
            return f"the value of {key!r} has {len(value)} characters"
    return None


def _native_tool(tool: Mapping[str, JSONValue]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["parameters"],
        },
    }


def _chat_messages(message: Message) -> list[ChatCompletionMessageParam]:
    """The Chat Completions messages for one message: one, or one per tool result."""
    results = [block for block in message.content if isinstance(block, ToolResultBlock)]
    if results:
        if len(results) != len(message.content):
            raise ValueError("a message holding a tool result may hold nothing else")
        return [
            cast(
                "ChatCompletionMessageParam",
                {"role": "tool", "tool_call_id": block.call_id, "content": _utf8(block.text)},
            )
            for block in results
        ]
    text = _utf8("".join(block.text for block in message.content if isinstance(block, TextBlock)))
    calls = [block for block in message.content if isinstance(block, ToolCallBlock)]
    chat: dict[str, Any] = {"role": message.role.value, "content": text}
    if calls:
        chat["content"] = text or None  # what the API itself sends with a bare tool call
        chat["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_text(call.arguments)},
            }
            for call in calls
        ]
    # The SDK types each role's dict separately; this one dict fits the role it names.
    return [cast("ChatCompletionMessageParam", chat)]


def _utf8(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (half an emoji a server sent as a
    JSON escape, now in the history) goes back as that escape, ``\\ud83d``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _arguments_text(arguments: JSONValue) -> str:
    # Sent back as received: unparsable text stays that text.
    if isinstance(arguments, str):
        return arguments
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    try:
        text.encode()
    except UnicodeEncodeError:
        # A lone surrogate the server sent escaped goes back escaped: UTF-8 cannot carry it.
        return json.dumps(arguments, ensure_ascii=True, separators=(",", ":"), sort_keys=True)
    return text


def _reply(response: object, result_id: str) -> ModelReply:
    if not isinstance(response, ChatCompletion):
        raise TypeError(
            f"the server's answer is not a chat completion but {type(response).__name__}"
        )
    # Servers are lenient about ids: missing, null and "" all mean "no join key".
    call_id = getattr(response, "id", None)
    # The SDK does not validate the body: any part of it may be missing or null.
    if not isinstance(response.choices, list) or not response.choices:
        raise ValueError(f"the chat completion {call_id!r} has no choices")
    choice = response.choices[0]
    message = getattr(choice, "message", None)
    if not isinstance(message, ChatCompletionMessage):
        raise ValueError(f"the chat completion {call_id!r} has no message in its first choice")
    refusal = _text(getattr(message, "refusal", None))
    return ModelReply(
        call_id=_text(call_id),
        content=message.content if isinstance(message.content, str) else "",
        reasoning=_reasoning(message),
        finish=_finish(getattr(choice, "finish_reason", None), refused=refusal is not None),
        usage=_usage(getattr(response, "usage", None)),
        model=_text(getattr(response, "model", None)),
        refusal=refusal,
        tool_calls=_tool_calls(getattr(message, "tool_calls", None), result_id),
    )


async def _assembled(
    chunks: object, on_text: Callable[[str], Awaitable[None]] | None
) -> ChatCompletion:
    """The completion a stream of chunks adds up to, in the shape the server would have
    sent whole, so that one mapping makes the reply of either. Each piece of content
    goes to ``on_text`` as it arrives."""
    if not isinstance(chunks, openai.AsyncStream):
        raise TypeError(f"the server's answer is not a stream but {type(chunks).__name__}")
    whole = _Whole()
    try:
        async for chunk in chunks:
            text = whole.add(chunk)
            if text and on_text is not None:
                await on_text(text)
    finally:
        # Cancelled or failed mid-stream: the connection is closed, not left to linger.
        with anyio.move_on_after(_CLOSE_GRACE_S, shield=True):
            await chunks.close()
    return whole.completion()


class _Whole:
    """Adds a stream's chunks up: the first choice's pieces, the ids, the usage."""

    __slots__ = (
        "call_id",
        "content",
        "finish",
        "model",
        "reasoning",
        "refusal",
        "seen",
        "tools",
        "usage",
    )

    def __init__(self) -> None:
        self.call_id: object = None
        self.model: object = None
        self.usage: object = None
        self.finish: object = None
        self.seen = False  # whether any chunk carried the first choice
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.reasoning: dict[str, list[str]] = {name: [] for name in _REASONING_FIELDS}
        self.tools: dict[int, dict[str, Any]] = {}

    def add(self, chunk: object) -> str:
        """Take one chunk in; the new piece of content it carries, or ``""``."""
        if not isinstance(chunk, ChatCompletionChunk):
            raise TypeError(f"a streamed chunk is not a chat completion chunk: {chunk!r:.80}")
        # The SDK does not validate chunks either: any part may be missing or null.
        self.call_id = self.call_id or getattr(chunk, "id", None)
        self.model = self.model or getattr(chunk, "model", None)
        if (usage := getattr(chunk, "usage", None)) is not None:
            self.usage = usage
        choices = getattr(chunk, "choices", None)
        first = (
            [c for c in choices if getattr(c, "index", 0) == 0] if isinstance(choices, list) else []
        )
        text = ""
        for choice in first:
            self.seen = True
            if (finish := getattr(choice, "finish_reason", None)) is not None:
                self.finish = finish
            delta = getattr(choice, "delta", None)
            piece = getattr(delta, "content", None)
            if isinstance(piece, str):
                self.content.append(piece)
                text += piece
            if isinstance(refusal := getattr(delta, "refusal", None), str):
                self.refusal.append(refusal)
            for name in _REASONING_FIELDS:
                if isinstance(thought := getattr(delta, name, None), str):
                    self.reasoning[name].append(thought)
            self._add_tool_calls(getattr(delta, "tool_calls", None))
        return text

    def _add_tool_calls(self, calls: object) -> None:
        if not isinstance(calls, list):
            return
        for position, call in enumerate(calls):
            index = getattr(call, "index", position)
            built = self.tools.setdefault(
                index if isinstance(index, int) else position,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            built["id"] = built["id"] or getattr(call, "id", None)
            function = getattr(call, "function", None)
            if isinstance(name := getattr(function, "name", None), str):
                built["function"]["name"] += name
            if isinstance(arguments := getattr(function, "arguments", None), str):
                built["function"]["arguments"] += arguments

    def completion(self) -> ChatCompletion:
        if self.seen and self.finish is None:
            # Every server says how a streamed reply ended in its last choice chunk; a
            # stream without that was cut off in transit, and its text may be half a reply.
            raise ValueError(
                f"the stream of chat completion {_text(self.call_id)!r} ended before the "
                "reply did: no chunk said how it finished"
            )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content else None,
            "refusal": "".join(self.refusal) or None,
        }
        for name, pieces in self.reasoning.items():
            if pieces:
                message[name] = "".join(pieces)
        if self.tools:
            message["tool_calls"] = [self.tools[index] for index in sorted(self.tools)]
        choice = {"index": 0, "message": message, "finish_reason": self.finish}
        # Built as the SDK builds a body it read whole: without validating it.
        return ChatCompletion.construct(
            id=self.call_id,
            object="chat.completion",
            model=self.model,
            choices=[choice] if self.seen else [],
            usage=self.usage,
        )


def _tool_calls(calls: object, result_id: str) -> tuple[ToolCallBlock, ...]:
    """The reply's native tool calls; arguments that are not a JSON object are passed on
    as their text, for the interpreter to refuse with a reason the model can act on."""
    if not isinstance(calls, list):
        return ()
    found = []
    for index, call in enumerate(calls):
        function = getattr(call, "function", None)
        name = getattr(function, "name", None)
        # A call without an id still needs one its result can name: stable per call.
        call_id = _text(getattr(call, "id", None)) or f"{result_id}:{index}"
        found.append(
            ToolCallBlock(
                call_id=call_id,
                name=name if isinstance(name, str) else "",
                arguments=_parsed_arguments(getattr(function, "arguments", None)),
            )
        )
    return tuple(found)


def _parsed_arguments(raw: object) -> JSONValue:
    if isinstance(raw, dict):  # some servers send an object rather than its text
        return raw if _loggable(raw) else _object_text(raw)
    if not isinstance(raw, str):
        return ""
    if not raw.strip():
        return {}  # a call with no arguments, as several servers send it
    try:
        parsed = json.loads(raw, parse_constant=refuse_constant)
    except (ValueError, RecursionError):
        return raw
    return parsed if isinstance(parsed, dict) and _loggable(parsed) else raw


def _loggable(arguments: dict[str, Any]) -> bool:
    # Parsed JSON the log cannot hold (1e400 read as infinity, nesting past the record
    # bound) goes on as text, for the interpreter to refuse: the reply is still recorded.
    try:
        plain_copy(arguments, strict=True)
    except UnloggableValue:
        return False
    return True


def _object_text(arguments: dict[str, Any]) -> str:
    # An object the server sent whole has no text of its own: this is the nearest.
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):  # not reached by a body the SDK could read
        return "<arguments sent as an object that cannot be written as JSON>"


def _text(value: object) -> str | None:
    """A non-empty string, or ``None``: servers send null, "" or nothing alike."""
    return value if isinstance(value, str) and value else None


def _reasoning(message: object) -> str | None:
    # Not in the SDK's schema; the SDK keeps extra fields as attributes.
    for name in _REASONING_FIELDS:
        if (text := _text(getattr(message, name, None))) is not None:
            return text
    return None


def _finish(reported: object, *, refused: bool) -> FinishReason | None:
    text = _text(reported)
    finish = None if text is None else _FINISH_REASONS.get(text, FinishReason.OTHER)
    # A refusal arrives with "stop": the reply ended, but as a refusal.
    if refused and finish in (None, FinishReason.STOP):
        return FinishReason.REFUSAL
    return finish


def _usage(usage: object) -> Usage | None:
    if usage is None:
        return None
    details = getattr(usage, "completion_tokens_details", None)
    counted = Usage(
        input_tokens=_count(getattr(usage, "prompt_tokens", None)),
        output_tokens=_count(getattr(usage, "completion_tokens", None)),
        reasoning_tokens=_count(getattr(details, "reasoning_tokens", None)),
    )
    return None if counted == Usage() else counted


def _count(value: object) -> int | None:
    # The SDK does not validate the body: a count may arrive as anything.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
