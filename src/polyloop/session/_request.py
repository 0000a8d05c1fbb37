"""Request checks and the snapshot: what ``run`` and ``resume`` verify before any I/O.

Also the messages a request opens the transcript with and the tools its model calls
carry, since they are built from the same fields the snapshot records: :func:`prepare`
hands all three to the loop as one value.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyloop import _assembly, serialization
from polyloop.ports import Store
from polyloop.session._values import Definition, Request
from polyloop.tools import RegistryExecutor, ToolRegistry
from polyloop.types import (
    Budget,
    Injection,
    InvalidRequest,
    JSONValue,
    Message,
    Replay,
    RunStarted,
    ToolStyle,
    UnloggableValue,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A checked request: its snapshot, the messages before the history (``prefix``) and
    the tools a native-style model call carries (``tools``; none in another style)."""

    snapshot: dict[str, JSONValue]
    prefix: tuple[Message, ...]
    tools: tuple[Mapping[str, JSONValue], ...]


def prepare(definition: Definition, request: Request) -> Prepared:
    """Check the request and build what a run of it needs; raise ``InvalidRequest`` on
    any problem. The tool registry is described once, for all three."""
    run_id = request.run_id if isinstance(request.run_id, str) else None
    problems = _problems(definition, request)
    if problems:
        raise InvalidRequest("; ".join(problems), run_id=run_id)
    described = request.tools.describe()
    tools = _tool_list(described)
    return Prepared(
        snapshot=_snapshot(definition, request, described, run_id),
        prefix=_context_prefix(request, tools),
        tools=_native_tools(request, tools),
    )


def _snapshot(
    definition: Definition, request: Request, described: JSONValue, run_id: str | None
) -> dict[str, JSONValue]:
    snapshot = {**definition.parameters(), **_request_parameters(request, described)}
    try:
        encoded = serialization.encode(RunStarted(run_id=request.run_id, snapshot=snapshot))
    except UnloggableValue as exc:
        raise InvalidRequest(
            f"the snapshot cannot be recorded: {exc.reason}", run_id=run_id
        ) from exc
    plain = encoded["snapshot"]
    assert isinstance(plain, dict)
    return plain


def _problems(definition: Definition, request: Request) -> list[str]:
    problems: list[str] = []
    if not isinstance(request.run_id, str) or not request.run_id:
        problems.append("run_id must be a non-empty string")
    problems += _budget_problems(request.budget)
    problems += _template_problems(
        "observation_template", request.observation_template, "observation"
    )
    problems += _template_problems("texts.not_executed", definition.texts.not_executed, "reason")
    problems += _template_problems("texts.env_fault", definition.texts.env_fault, "detail")
    problems += _shape_problems(request)
    problems += _store_problems(definition.store)
    return problems


# Every method of the store port. A store written for an earlier port lacks some of them
# and would otherwise fail part-way into a run, after its first intent is written.
_STORE_METHODS = tuple(sorted(name for name in vars(Store) if not name.startswith("_")))


def _store_problems(store: object) -> list[str]:
    missing = [name for name in _STORE_METHODS if not callable(getattr(store, name, None))]
    if not missing:
        return []
    return [
        f"the store {type(store).__name__} lacks {', '.join(missing)} of the store port "
        "(docs/stores.md, 'Your own store', says what each must do)"
    ]


def _budget_problems(budget: Budget) -> list[str]:
    if not isinstance(budget, Budget):
        return [f"budget must be a Budget, not {type(budget).__name__}"]
    problems = [
        f"budget.{name} must be an integer of at least 1, not {value!r}"
        for name in ("max_steps", "max_valid_steps", "max_context_chars")
        if not _positive_int(value := getattr(budget, name))
    ]
    if budget.max_tokens is not None and not _positive_int(budget.max_tokens):
        problems.append(
            f"budget.max_tokens must be None or an integer of at least 1, not {budget.max_tokens!r}"
        )
    return problems


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _template_problems(name: str, template: object, placeholder: str) -> list[str]:
    if not isinstance(template, str) or f"{{{placeholder}}}" not in template:
        return [f"{name} must be a string containing {{{placeholder}}}"]
    try:
        template.format(**{placeholder: ""})
    except (KeyError, IndexError, ValueError) as exc:
        return [f"{name} cannot be filled with only {{{placeholder}}}: {exc!r}"]
    return []


def _shape_problems(request: Request) -> list[str]:
    problems = []
    if not isinstance(request.tools, ToolRegistry):
        problems.append("tools must be a ToolRegistry")
    elif _other_registry(request.executor, request.tools):
        # The model is shown request.tools; an executor of another registry would run
        # tools it never saw and miss the completion markers it was told about.
        problems.append(
            "executor must run the tools the model is shown: it was derived from another "
            "ToolRegistry than tools (build it with tools.executor())"
        )
    for name in ("run_context", "goal_context"):
        value = getattr(request, name)
        if not isinstance(value, tuple) or not all(isinstance(m, Message) for m in value):
            problems.append(f"{name} must be a tuple of Message")
    injection = request.injection
    if not isinstance(injection, Injection):
        problems.append("injection must be an Injection")
    else:
        if unknown := _assembly.unknown_channels(injection):
            problems.append(f"injection channels {list(unknown)} are not read (only 'system')")
        if not all(isinstance(e, str) for v in injection.entries.values() for e in v):
            problems.append("injection entries must be strings")
    if not isinstance(request.binding, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in request.binding.items()
    ):
        problems.append("binding must map strings to strings")
    if not isinstance(request.model_replay, Replay):
        problems.append("model_replay must be a Replay")
    if not isinstance(request.tool_style, ToolStyle):
        problems.append("tool_style must be a ToolStyle")
    grace = request.cancel_grace_s
    if not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace < 0:
        problems.append("cancel_grace_s must be a finite number of seconds, at least 0")
    return problems


def _other_registry(executor: object, tools: ToolRegistry) -> bool:
    return isinstance(executor, RegistryExecutor) and executor.registry != tools


def _request_parameters(request: Request, described: JSONValue) -> dict[str, JSONValue]:
    budget = request.budget
    injection = {k: list(v) for k, v in sorted(request.injection.entries.items())}
    params: dict[str, JSONValue] = {
        "budget.max_steps": budget.max_steps,
        "budget.max_valid_steps": budget.max_valid_steps,
        "budget.max_context_chars": budget.max_context_chars,
        # Written only when set, so a run started before token budgets existed resumes.
        **({} if budget.max_tokens is None else {"budget.max_tokens": budget.max_tokens}),
        "tools": {
            "max_observation_chars": request.tools.max_observation_chars,
            "specs": described,
        },
        "run_context.sha256": _sha256([_assembly.message_json(m) for m in request.run_context]),
        "goal_context.sha256": _sha256([_assembly.message_json(m) for m in request.goal_context]),
        "injection.sha256": _sha256(injection),  # type: ignore[arg-type]
        "model_replay": request.model_replay.value,
        "observation_template": request.observation_template,
        "tool_style": request.tool_style.value,
    }
    for key, value in request.binding.items():
        params[f"binding.{key}"] = value
    return params


def _sha256(value: JSONValue) -> str:
    return hashlib.sha256(_assembly.canonical(value)).hexdigest()


def _context_prefix(request: Request, tools: list[dict[str, Any]]) -> tuple[Message, ...]:
    """The messages before the history: contexts, injection and tool list, in order."""
    return _assembly.prefix(
        run_context=request.run_context,
        injection_text=_assembly.render_injection(request.injection),
        tools_text=_assembly.render_tools(tools, request.tool_style),
        goal_context=request.goal_context,
    )


def _native_tools(
    request: Request, tools: list[dict[str, Any]]
) -> tuple[Mapping[str, JSONValue], ...]:
    """The tools a native-style model call carries: name, description and schema each."""
    if request.tool_style is not ToolStyle.NATIVE:
        return ()
    return tuple(
        {"name": tool["name"], "description": tool["description"], "parameters": tool["parameters"]}
        for tool in tools
    )


def _tool_list(described: JSONValue) -> list[dict[str, Any]]:
    assert isinstance(described, list)
    return [tool for tool in described if isinstance(tool, dict)]
