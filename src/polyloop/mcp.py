"""Tools from Model Context Protocol servers, as ordinary :class:`~polyloop.tools.ToolSpec` values.

:func:`mcp_tools` lists the tools of an initialized ``mcp.ClientSession`` (any transport
the SDK offers: stdio, streamable HTTP) and turns each into a spec whose handler calls
the tool through that session. The session is yours: open it around your runs and
close it after; PolyLoop starts no server and closes nothing.

Durability rules, the same as for any tool:

* **Replay.** An MCP tool's annotations say whether calling it again is harmless, but
  the MCP specification tells clients to treat them as untrusted unless the server is.
  So every MCP tool gets ``Replay.NEVER``, unless you pass ``trusted=True``: then a tool
  annotated ``readOnlyHint`` or ``idempotentHint`` gets ``Replay.ALLOWED``. A
  :class:`ToolOverride` per tool sets replay or completes by your own decision.
* **Identity.** The server's annotations, the trust setting and the overrides are
  recorded in each spec's ``annotations``, which the run's snapshot covers with the
  schema and the replay decision: a server that changed a tool between a crash and the
  resume makes :func:`~polyloop.session.resume` raise ``RunIdentityMismatch``.
* **Idempotency key.** Each call carries the result id PolyLoop allocated for it in the
  request's ``_meta``, under :data:`RESULT_ID_META_KEY`; it is the same when a call is
  made again after a crash, so a server can recognise a repeated call.

What a call gives back:

* the text content of the result is the observation; every other content block
  (image, audio, embedded resource, resource link) is described in a line of its own
  (type, MIME type, size), so nothing is dropped unseen; a result with no content but
  structured content shows that as JSON;
* a result the server marks ``isError`` is the tool's own failure: the handler raises
  :class:`MCPToolError`, which the model sees as ``"MCPToolError: <text>"`` (executed,
  synthesized, and never a submission);
* anything ``ClientSession.call_tool`` raises (a closed session, a lost transport, a
  timeout, an error response) means the environment broke: the handler raises
  :class:`~polyloop.tools.EnvironmentFault` and the run ends ``ENV_FAILURE``.

Importing this module imports ``mcp`` (the ``polyloop[mcp]`` extra); nothing else in
the library does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from polyloop._shared import exception_text, needs_extra, plain_copy

with needs_extra("polyloop.mcp", "mcp"):
    import mcp
    from mcp import types as mcp_types
from polyloop.tools import EnvironmentFault, ToolHandler, ToolRegistry, ToolSpec
from polyloop.types import InvalidRequest, JSONValue, Replay, UnloggableValue

__all__ = ("MCPToolError", "RESULT_ID_META_KEY", "ToolOverride", "mcp_tools")

RESULT_ID_META_KEY = "polyloop/result_id"
"""The key of the request ``_meta`` entry that carries PolyLoop's result id for the call."""

# The hints that say a repeated call changes nothing more than the first one did.
_REPEATABLE_HINTS = ("readOnlyHint", "idempotentHint")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolOverride:
    """Your own decision for one MCP tool, in place of what its annotations imply.

    ``None`` leaves a setting as :func:`mcp_tools` would choose it: ``replay`` from the
    annotations and the trust rule, ``completes`` ``False``.
    """

    replay: Replay | None = None
    completes: bool | None = None


class MCPToolError(Exception):
    """A result the MCP server marked ``isError``: the tool's own failure, shown to the model.

    Raised by the handlers :func:`mcp_tools` builds, and caught by the registry's
    executor like any tool's exception.
    """


async def mcp_tools(
    session: mcp.ClientSession,
    *,
    prefix: str | None = None,
    trusted: bool = False,
    overrides: Mapping[str, ToolOverride] | None = None,
) -> list[ToolSpec]:
    """One :class:`~polyloop.tools.ToolSpec` per tool the server lists, in its order.

    ``session`` must be initialized and stay open while runs use the tools. ``prefix`` is
    put in front of every tool name as given (``"files_"`` makes ``read`` into
    ``files_read``), so two servers with tools of the same name can share a registry.
    ``trusted`` lets the server's annotations decide replay (see the module docs).
    ``overrides`` maps a tool's name on the server (without the prefix) to a
    :class:`ToolOverride`.

    Raises :class:`~polyloop.types.InvalidRequest` for an ill-typed argument, an override
    naming a tool the server does not list, a name listed twice, a listing whose pages
    never end (a cursor handed back twice), or a tool whose schema
    or description a :class:`~polyloop.tools.ToolRegistry` would refuse (the message
    names the tool). Errors of the session itself (``mcp.MCPError`` and the like)
    propagate as raised.

    Cancellation: listing writes nothing; a cancelled call propagates the cancellation
    and returns no tools. The handlers let cancellation through as well: the SDK then
    tells the server the request was cancelled.
    """
    _check_arguments(prefix, trusted, overrides)
    chosen = dict(overrides or {})
    listed = await _list_all(session)
    names = [tool.name for tool in listed]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InvalidRequest(f"the MCP server lists the tool {twice[0]!r} more than once")
    unknown = sorted(name for name in chosen if name not in names)
    if unknown:
        raise InvalidRequest(
            f"overrides name tools the MCP server does not list: {', '.join(map(repr, unknown))}; "
            f"it lists: {', '.join(map(repr, names)) or 'none'}"
        )
    return [_spec(session, tool, prefix or "", trusted, chosen.get(tool.name)) for tool in listed]


def _check_arguments(prefix: object, trusted: object, overrides: object) -> None:
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise InvalidRequest(f"prefix must be a non-empty string or None, got {prefix!r}")
    if not isinstance(trusted, bool):
        raise InvalidRequest(f"trusted must be a bool, got {trusted!r}")
    if overrides is None:
        return
    if not isinstance(overrides, Mapping):
        raise InvalidRequest(
            f"overrides must be a mapping of tool names to ToolOverride, got "
            f"{type(overrides).__name__}"
        )
    for name, override in overrides.items():
        if not isinstance(name, str):
            raise InvalidRequest(f"an override key must be a tool name, got {name!r}")
        if not isinstance(override, ToolOverride):
            raise InvalidRequest(
                f"override for {name!r} must be a ToolOverride, got {type(override).__name__}"
            )
        if override.replay is not None and not isinstance(override.replay, Replay):
            raise InvalidRequest(f"override for {name!r}: replay must be a Replay or None")
        if override.completes is not None and not isinstance(override.completes, bool):
            raise InvalidRequest(f"override for {name!r}: completes must be a bool or None")


async def _list_all(session: mcp.ClientSession) -> list[mcp_types.Tool]:
    listed: list[mcp_types.Tool] = []
    cursor: str | None = None
    seen: set[str] = set()
    while True:
        params = None if cursor is None else mcp_types.PaginatedRequestParams(cursor=cursor)
        page = await session.list_tools(params=params)
        listed.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return listed
        # A server that hands back a cursor twice would keep this loop going for ever.
        if cursor in seen:
            raise InvalidRequest(f"the MCP server's tool listing repeats the cursor {cursor!r}")
        seen.add(cursor)


def _spec(
    session: mcp.ClientSession,
    tool: mcp_types.Tool,
    prefix: str,
    trusted: bool,
    override: ToolOverride | None,
) -> ToolSpec:
    hints = _hints(tool)
    repeatable = trusted and any((hints or {}).get(hint) is True for hint in _REPEATABLE_HINTS)
    replay = Replay.ALLOWED if repeatable else Replay.NEVER
    completes = False
    chosen: dict[str, JSONValue] = {}
    if override is not None and override.replay is not None:
        replay = override.replay
        chosen["replay"] = replay.value
    if override is not None and override.completes is not None:
        completes = override.completes
        chosen["completes"] = completes
    spec = ToolSpec(
        name=prefix + tool.name,
        description=tool.description or "",
        parameters=tool.input_schema,
        handler=_handler(session, tool.name),
        replay=replay,
        completes=completes,
        annotations={
            "source": "mcp",
            "mcp_name": tool.name,
            "mcp_annotations": hints,
            "trusted": trusted,
            "overrides": chosen,
        },
    )
    _accepted(spec, mcp_name=tool.name)
    return spec


def _hints(tool: mcp_types.Tool) -> dict[str, JSONValue] | None:
    """The tool's annotations as the server sent them (wire names), or ``None``."""
    if tool.annotations is None:
        return None
    dumped = tool.annotations.model_dump(by_alias=True, mode="json", exclude_none=True)
    try:
        hints: dict[str, JSONValue] = plain_copy(dumped, root="annotations", strict=True)
    except UnloggableValue as exc:
        raise InvalidRequest(f"MCP tool {tool.name!r}: {exc.reason}") from None
    return hints


def _accepted(spec: ToolSpec, *, mcp_name: str) -> None:
    """Refuse here, naming the MCP tool, what a registry would refuse later."""
    try:
        ToolRegistry([spec], max_observation_chars=1)
    except InvalidRequest as exc:
        raise InvalidRequest(f"MCP tool {mcp_name!r} cannot be mounted: {exc.reason}") from None


def _handler(session: mcp.ClientSession, name: str) -> ToolHandler:
    async def call(arguments: dict[str, JSONValue], /, *, result_id: str) -> str:
        try:
            result = await session.call_tool(name, dict(arguments), meta=_meta(result_id))
        except Exception as exc:
            # No answer at all (closed session, lost transport, timeout, error response)
            # says nothing about the tool: the environment failed.
            raise EnvironmentFault(
                f"MCP tool {name!r} could not be called: {exception_text(exc)}"
            ) from exc
        text = _observation(result)
        if result.is_error:
            raise MCPToolError(text)
        return text

    return call


def _meta(result_id: str) -> mcp_types.RequestParamsMeta:
    # An open map on the wire; the SDK's TypedDict names only its reserved keys.
    return cast(mcp_types.RequestParamsMeta, {RESULT_ID_META_KEY: result_id})


def _observation(result: mcp_types.CallToolResult) -> str:
    lines = [_block_text(block) for block in result.content]
    if not lines and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False, sort_keys=True)
    return "\n".join(lines)


def _block_text(block: Any) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        return f"[{block.type}: {block.mime_type}, {_base64_size(block.data)} bytes]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        kind = resource.mime_type or "unknown type"
        if isinstance(resource, mcp_types.TextResourceContents):
            # Text the server chose to return: shown after its description line.
            size = f"{len(resource.text)} characters"
            return f"[resource {resource.uri}: {kind}, {size}]\n{resource.text}"
        return f"[resource {resource.uri}: {kind}, {_base64_size(resource.blob)} bytes]"
    if isinstance(block, mcp_types.ResourceLink):
        kind = block.mime_type or "unknown type"
        size = "size unknown" if block.size is None else f"{block.size} bytes"
        return f"[resource link {block.uri}: {kind}, {size}]"
    return f"[{getattr(block, 'type', type(block).__name__)} content]"


def _base64_size(data: str) -> int:
    # The decoded size, without decoding: every 4 characters carry 3 bytes.
    body = "".join(data.split()).rstrip("=")
    return len(body) * 3 // 4
