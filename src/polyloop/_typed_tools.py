"""A tool's schema, description and handler derived from a typed Python function.

The JSON Schema comes from the type hints through Pydantic, each argument's description
from the docstring through docstring-parser: they are what Python users already write
tools with, and both stay behind the ``tools`` extra, so the kernel itself needs only
anyio and jsonschema. What they produce is an ordinary schema, recorded in the run's
snapshot like a hand-written one (docs/tools.md, research record 0068).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from polyloop._shared import needs_extra
from polyloop.types import InvalidRequest, JSONValue

__all__ = ("TypedTool", "typed_tool")

# A keyword-only parameter of this name receives the call's result id (an idempotency
# key that is stable across a replay) instead of being an argument the model fills in.
RESULT_ID = "result_id"


@dataclass(frozen=True, slots=True, kw_only=True)
class TypedTool:
    """What a typed function gives a ``ToolSpec``."""

    name: str
    description: str
    parameters: dict[str, JSONValue]
    handler: Callable[..., Awaitable[str]]


def typed_tool(
    function: Callable[..., Any], *, name: str | None, description: str | None, is_async: bool
) -> TypedTool:
    """The tool ``function`` describes; ``InvalidRequest`` names what cannot be described."""
    with needs_extra("ToolSpec.from_function", "tools"):
        import docstring_parser
        import pydantic
    tool_name = name if name is not None else getattr(function, "__name__", "")
    docstring = docstring_parser.parse(inspect.getdoc(function) or "")
    notes = {param.arg_name: param.description for param in docstring.params}
    fields, takes_result_id = _fields(tool_name, function, notes)
    config = pydantic.ConfigDict(extra="forbid")  # an argument the schema lacks is refused
    model = pydantic.create_model(f"{tool_name}_arguments", __config__=config, **fields)
    parameters = model.model_json_schema(schema_generator=_untitled_generator())
    told = "\n\n".join(
        part for part in (docstring.short_description, docstring.long_description) if part
    )
    handler = functools.partial(
        _call,
        function,
        model=model,
        names=tuple(fields),
        takes_result_id=takes_result_id,
        is_async=is_async,
    )
    return TypedTool(
        name=tool_name,
        description=told if description is None else description,
        parameters=parameters,
        handler=handler,
    )


def _fields(
    tool_name: str, function: Callable[..., Any], notes: dict[str, str | None]
) -> tuple[dict[str, Any], bool]:
    import pydantic

    try:
        hints = typing.get_type_hints(function, include_extras=True)
        parameters = inspect.signature(function).parameters.values()
    except (NameError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"tool {tool_name!r}: cannot read its signature: {exc}") from exc
    fields: dict[str, Any] = {}
    takes_result_id = False
    for parameter in parameters:
        if parameter.name == RESULT_ID and parameter.kind is parameter.KEYWORD_ONLY:
            takes_result_id = True
            continue
        refusal = _refusal(parameter, hints)
        if refusal is not None:
            raise InvalidRequest(f"tool {tool_name!r}: argument {parameter.name!r} {refusal}")
        default = ... if parameter.default is parameter.empty else parameter.default
        field = pydantic.Field(default, description=notes.get(parameter.name))
        fields[parameter.name] = (hints[parameter.name], field)
    return fields, takes_result_id


def _refusal(parameter: inspect.Parameter, hints: dict[str, Any]) -> str | None:
    if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
        return "is variadic: a tool's arguments are named, each with a type"
    if parameter.kind is parameter.POSITIONAL_ONLY:
        return "is positional-only: the model passes arguments by name"
    if parameter.name.startswith("_"):
        return "starts with an underscore, which a schema property cannot"
    if parameter.name not in hints:
        return "has no type hint: the schema is built from the hints"
    return None


async def _call(
    function: Callable[..., Any],
    arguments: dict[str, JSONValue],
    /,
    *,
    result_id: str,
    model: Any,
    names: tuple[str, ...],
    takes_result_id: bool,
    is_async: bool,
) -> str:
    import pydantic_core

    # The registry has already checked the arguments against the schema; validating them
    # again here turns them into the typed values the function declared.
    values = model.model_validate(arguments)
    keywords = {field: getattr(values, field) for field in names}
    if takes_result_id:
        keywords[RESULT_ID] = result_id
    if is_async:
        returned = await function(**keywords)
    else:
        # A plain function may block; it runs on a worker thread, never on the loop.
        returned = await anyio.to_thread.run_sync(functools.partial(function, **keywords))
    if isinstance(returned, str):
        return returned
    return pydantic_core.to_json(returned).decode()


@functools.cache
def _untitled_generator() -> type[Any]:
    from pydantic.json_schema import GenerateJsonSchema

    class Untitled(GenerateJsonSchema):
        """Pydantic's schema without the titles it derives from names the model already sees."""

        def field_title_should_be_set(self, schema: Any) -> bool:
            return False

        def generate(self, schema: Any, mode: Any = "validation") -> Any:
            generated = super().generate(schema, mode)
            generated.pop("title", None)
            return generated

    return Untitled
