"""Tools the model may call, kept in one immutable registry.

A run's action executor, the tool list the model is shown, the argument checks, the
replay policy and the completion markers must never disagree with one another; they
disagree the moment each is configured in its own place. So everything about a tool is
declared once, in a :class:`ToolSpec`, and every one of those views is derived from the
single :class:`ToolRegistry` built from the specs.

Schemas are plain JSON Schema dicts (draft 2020-12). They are checked when the registry
is built, so a broken schema fails before any run starts, and arguments are validated
before a handler is called, so a handler only ever sees arguments its schema accepts.
References are followed only inside a tool's own schema: validating a model's arguments
must not reach out to the network, whose answer could change between a run and its
resumption, or stall the run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import anyio
import referencing
import referencing.exceptions
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, ValidationError, best_match

from polyloop._shared import exception_text, plain_copy
from polyloop.ports import Action, ActionExecutor, ActionOutcome
from polyloop.types import (
    ActionStatus,
    InvalidRequest,
    JSONValue,
    Reconciled,
    Replay,
    UnloggableValue,
)

__all__ = ("EnvironmentFault", "ToolRegistry", "ToolSpec")

# Refusal reasons are fed back to the model; a multi-megabyte argument must not turn
# into a multi-megabyte reason, so every part that echoes caller data is clipped.
_MESSAGE_CHARS = 500
_PATH_CHARS = 200
_NAME_CHARS = 100

_PAYLOAD_KEYS = frozenset({"name", "arguments"})


class ToolHandler(Protocol):
    """What performs a tool call: ``async (arguments, *, result_id) -> str``.

    ``result_id`` is stable across a replay after a crash, so a handler can use it as an
    idempotency key. The returned text is the observation the model will see. A handler
    that raises :class:`EnvironmentFault` reports that the environment behind the tool
    broke; any other ``Exception`` is the tool's own failure, shown to the model.
    """

    def __call__(self, arguments: dict[str, JSONValue], /, *, result_id: str) -> Awaitable[str]: ...


class ToolProbe(Protocol):
    """What a tool answers about one of its calls in doubt:
    ``async (arguments, *, result_id) -> Reconciled | None``.

    Asked only about a call whose replay is ``NEVER``, announced under ``result_id`` and
    whose outcome a crash lost. Return ``Reconciled(ran=True, observation=...)`` if the
    effect with that key happened, ``Reconciled(ran=False, observation=...)`` only if it
    has not happened **and never will** (the system behind the tool voided the key, or
    the probe stored a tombstone under it that makes a late attempt fail), and ``None``
    if it can promise neither. Raising counts as ``None``.
    """

    def __call__(
        self, arguments: dict[str, JSONValue], /, *, result_id: str
    ) -> Awaitable[Reconciled | None]: ...


class EnvironmentFault(Exception):
    """Raised by a tool handler when the environment behind the tool failed, not the tool.

    A lost connection or a closed session says nothing about the tool's own answer, so
    the registry's executor reports ``ActionStatus.ENV_FAULT`` with ``str(exc)`` as the
    detail, and the run ends ``ENV_FAILURE``. Any other ``Exception`` from a handler is the
    tool's own failure: an observation the model sees.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """One tool: its name, what the model is told about it, and how it runs.

    ``parameters`` is a JSON Schema (draft 2020-12) for the arguments object.
    ``replay`` says whether a call whose outcome was lost in a crash may run again;
    ``completes`` marks a tool whose call submits the task. ``annotations``, a plain-JSON
    dict, is where the tool came from and why it is configured as it is (an MCP server's
    hints, say): the run's snapshot records it, so a change between a crash and the
    resume is caught, but the model is not shown it. ``needs_approval`` makes a run stop
    ``AWAITING_APPROVAL`` when the model calls the tool, before anything runs: the call
    runs only once a person approves it (:func:`polyloop.approve`).

    ``reconcile`` is the tool's probe (:class:`ToolProbe`): when a call whose replay is
    ``NEVER`` is in doubt after a crash, the run asks it what became of the call's result
    id before it would end ``IN_DOUBT``, and goes on by its answer. The probe is not
    part of the run's identity (the model is not shown it), so one may be added to a
    tool before resuming runs that are already in doubt.

    ``reconcile_timeout_s`` bounds the probe's wait: a probe that has not answered
    within it is cancelled and counts as failed, so the run stays in doubt (its detail
    says the probe timed out, and after how long) and recovery goes on with other runs.
    Like the probe, it is not part of the run's identity.
    """

    name: str
    description: str
    parameters: Mapping[str, JSONValue]
    handler: ToolHandler
    replay: Replay = Replay.NEVER
    completes: bool = False
    annotations: Mapping[str, JSONValue] | None = None
    needs_approval: bool = False
    reconcile: ToolProbe | None = None
    reconcile_timeout_s: float = 30.0

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        replay: Replay = Replay.NEVER,
        completes: bool = False,
        annotations: Mapping[str, JSONValue] | None = None,
        needs_approval: bool = False,
        reconcile: ToolProbe | None = None,
        reconcile_timeout_s: float = 30.0,
    ) -> ToolSpec:
        """The tool a typed function describes (needs the ``tools`` extra).

        The name is the function's, the description its docstring's text, and the
        parameters a JSON Schema built by Pydantic from the type hints, each argument
        described by its entry in the docstring (Google, NumPy or reST style). Arguments
        are validated against that schema like any tool's, then given to the function
        as the typed values it declares. A keyword-only ``result_id: str`` parameter
        receives the call's result id and is not shown to the model. A plain function
        runs on a worker thread; a return value other than ``str`` becomes its JSON.
        A parameter that cannot be described (no hint, ``*args``, positional-only)
        raises ``InvalidRequest`` naming it. The other fields are as for ``ToolSpec``.
        """
        from polyloop._typed_tools import typed_tool

        typed = typed_tool(
            function, name=name, description=description, is_async=_is_async_callable(function)
        )
        return cls(
            name=typed.name,
            description=typed.description,
            parameters=typed.parameters,
            handler=typed.handler,
            replay=replay,
            completes=completes,
            annotations=annotations,
            needs_approval=needs_approval,
            reconcile=reconcile,
            reconcile_timeout_s=reconcile_timeout_s,
        )


def _clip(text: str, limit: int) -> str:
    # Keep both ends: jsonschema puts the offending value first and the complaint
    # ("... is too long") last, and the complaint is the part the model needs.
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]} …({len(text) - limit} characters omitted)… {text[-tail:]}"


def _refuse_retrieval(uri: str) -> NoReturn:
    raise referencing.exceptions.NoSuchResource(uri)


# A registry that can retrieve nothing: jsonschema's own default would fetch remote
# ``$ref`` targets over the network. referencing builds its __init__ with attrs behind a
# decorator mypy cannot see through, hence the call through an Any-typed name.
_make_registry: Any = referencing.Registry
_LOCAL_ONLY: referencing.Registry[Any] = _make_registry(retrieve=_refuse_retrieval)


def _check_fields(spec: object) -> ToolSpec:
    if not isinstance(spec, ToolSpec):
        raise InvalidRequest(f"a tool registry takes ToolSpec values, got {type(spec).__name__}")
    if not isinstance(spec.name, str) or not spec.name:
        raise InvalidRequest(f"a tool name must be a non-empty string, got {spec.name!r}")
    if not isinstance(spec.description, str):
        raise InvalidRequest(f"tool {spec.name!r}: description must be a string")
    if not _is_async_callable(spec.handler):
        raise InvalidRequest(
            f"tool {spec.name!r}: handler must be an async function "
            f"(async def handler(arguments, *, result_id) -> str), got {spec.handler!r:.80}"
        )
    if not isinstance(spec.replay, Replay):
        raise InvalidRequest(f"tool {spec.name!r}: replay must be a Replay, got {spec.replay!r}")
    if not isinstance(spec.completes, bool):
        raise InvalidRequest(f"tool {spec.name!r}: completes must be a bool")
    if not isinstance(spec.needs_approval, bool):
        raise InvalidRequest(f"tool {spec.name!r}: needs_approval must be a bool")
    if spec.reconcile is not None and not _is_async_callable(spec.reconcile):
        raise InvalidRequest(
            f"tool {spec.name!r}: reconcile must be None or an async function "
            f"(async def probe(arguments, *, result_id) -> Reconciled | None), "
            f"got {spec.reconcile!r:.80}"
        )
    timeout = spec.reconcile_timeout_s
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise InvalidRequest(
            f"tool {spec.name!r}: reconcile_timeout_s must be a positive, finite number "
            f"of seconds, got {timeout!r:.40}"
        )
    return spec


def _is_async_callable(handler: object) -> bool:
    # A plain function would fail only at the first call, as an observation the model
    # sees; refusing it here fails at start-up instead. Partials of async functions and
    # objects with an async __call__ are async callables too.
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 -- the method itself is tested
    return callable(handler) and inspect.iscoroutinefunction(call)


def _checked_schema(name: str, parameters: object) -> dict[str, JSONValue]:
    """A private deep copy of a valid schema, so later edits by the caller change nothing."""
    schema = _copied_dict(name, "parameters", parameters, "a JSON Schema dict")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(
            f"tool {name!r}: parameters is not a valid JSON Schema (draft 2020-12) at "
            f"{_clip(exc.json_path, _PATH_CHARS)}: {_clip(exc.message, _MESSAGE_CHARS)}"
        ) from exc
    if "type" in schema and schema["type"] != "object":
        raise InvalidRequest(
            f"tool {name!r}: the schema's top-level type must be 'object' (arguments are "
            f"a JSON object), got {schema['type']!r}"
        )
    return schema


def _checked_annotations(name: str, annotations: object) -> dict[str, JSONValue] | None:
    """A private deep copy of the annotations, or ``None`` when the tool has none."""
    if annotations is None:
        return None
    return _copied_dict(name, "annotations", annotations, "a dict or None")


def _copied_dict(name: str, field: str, value: object, expected: str) -> dict[str, JSONValue]:
    """A private deep copy of the tool's ``field``, which must be a dict of JSON values."""
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"tool {name!r}: {field} must be {expected}, got {type(value).__name__}"
        )
    try:
        copied: dict[str, JSONValue] = plain_copy(value, root=field, strict=True)
    except UnloggableValue as exc:
        raise InvalidRequest(f"tool {name!r}: {exc.reason}") from None
    return copied


def _checked_limit(max_observation_chars: object) -> int:
    if (
        not isinstance(max_observation_chars, int)
        or isinstance(max_observation_chars, bool)
        or max_observation_chars < 1
    ):
        raise InvalidRequest(
            f"max_observation_chars must be an int >= 1, got {max_observation_chars!r}"
        )
    return max_observation_chars


def _schema_refusal(name: str, validator: Draft202012Validator, arguments: object) -> str | None:
    try:
        if validator.is_valid(arguments):  # the common case: stop at the first success
            return None
        error: ValidationError | None = best_match(validator.iter_errors(arguments))
    except referencing.exceptions.Unresolvable as exc:
        return (
            f"arguments for tool {name!r} cannot be checked: its schema refers to "
            f"{_clip(str(exc.ref), _PATH_CHARS)!r}, which is not inside the tool's own schema"
        )
    except RecursionError:
        # A schema such as {"$ref": "#"} recurses without end; refusing the call is
        # the only answer that does not take the run down with it.
        return f"arguments for tool {name!r} cannot be checked: validation recursed too deeply"
    if error is None:
        return None
    return (
        f"arguments for tool {name!r} do not match its schema at "
        f"{_clip(error.json_path, _PATH_CHARS)}: {_clip(error.message, _MESSAGE_CHARS)}"
    )


class ToolRegistry:
    """An immutable set of tools, and every view of them the kernel needs.

    Raises :class:`~polyloop.types.InvalidRequest` for duplicate or empty names, an
    invalid schema, a schema whose top-level type is not ``object``, or a
    ``max_observation_chars`` below 1. Observations longer than
    ``max_observation_chars`` are cut by the derived executor.
    """

    __slots__ = ("_max_observation_chars", "_specs", "_validators")

    _specs: dict[str, ToolSpec]
    _validators: dict[str, Draft202012Validator]
    _max_observation_chars: int

    def __init__(self, specs: Iterable[ToolSpec], *, max_observation_chars: int) -> None:
        limit = _checked_limit(max_observation_chars)
        checked: dict[str, ToolSpec] = {}
        validators: dict[str, Draft202012Validator] = {}
        for raw in specs:
            spec = _check_fields(raw)
            if spec.name in checked:
                raise InvalidRequest(f"tool {spec.name!r} is registered twice")
            schema = _checked_schema(spec.name, spec.parameters)
            annotations = _checked_annotations(spec.name, spec.annotations)
            checked[spec.name] = dataclasses.replace(
                spec, parameters=schema, annotations=annotations
            )
            validators[spec.name] = Draft202012Validator(schema, registry=_LOCAL_ONLY)
        object.__setattr__(self, "_specs", checked)
        object.__setattr__(self, "_validators", validators)
        object.__setattr__(self, "_max_observation_chars", limit)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"ToolRegistry is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"ToolRegistry is immutable; cannot delete {name!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """The tool names, in registration order."""
        return tuple(self._specs)

    @property
    def max_observation_chars(self) -> int:
        """The longest observation the derived executor returns uncut."""
        return self._max_observation_chars

    def subset(self, names: Iterable[str]) -> ToolRegistry:
        """A registry of the named tools only, in registration order, with the same limit."""
        if isinstance(names, str):
            raise InvalidRequest(f"subset takes an iterable of names, not the string {names!r}")
        wanted = set(names)
        unknown = sorted(repr(name) for name in wanted if name not in self._specs)
        if unknown:
            raise InvalidRequest(
                f"subset names unknown tools {', '.join(unknown)}; known tools: {self._known()}"
            )
        kept = [spec for name, spec in self._specs.items() if name in wanted]
        return ToolRegistry(kept, max_observation_chars=self._max_observation_chars)

    def get(self, name: str) -> ToolSpec | None:
        """The spec registered under ``name`` (a copy: the registry cannot be edited)."""
        spec = self._lookup(name)
        if spec is None:
            return None
        return dataclasses.replace(
            spec,
            parameters=plain_copy(spec.parameters),
            annotations=None if spec.annotations is None else plain_copy(spec.annotations),
        )

    def describe(self) -> JSONValue:
        """What the model is shown and the snapshot records: one plain-JSON dict per tool.

        ``annotations`` is present only for a tool that has them, and ``needs_approval``
        only for a tool that needs it, so the description of every other tool, and the
        identity of runs started before the fields existed, is unchanged.
        """
        described: list[JSONValue] = []
        for spec in self._specs.values():
            tool: dict[str, JSONValue] = {
                "name": spec.name,
                "description": spec.description,
                "parameters": plain_copy(spec.parameters),
                "replay": spec.replay.value,
                "completes": spec.completes,
            }
            if spec.annotations is not None:
                tool["annotations"] = plain_copy(spec.annotations)
            if spec.needs_approval:
                tool["needs_approval"] = True
            described.append(tool)
        return described

    def validate(self, name: str, arguments: object) -> str | None:
        """``None`` if the call may run, else the reason it is refused."""
        call = self._accepted(name, arguments)
        return call if isinstance(call, str) else None

    def _accepted(
        self, name: object, arguments: object
    ) -> tuple[ToolSpec, dict[str, JSONValue]] | str:
        """The spec and a private copy of the arguments of a call that may run, or why not."""
        if not isinstance(name, str) or (validator := self._validators.get(name)) is None:
            return self._unknown(name)
        if not isinstance(arguments, dict) or not all(isinstance(key, str) for key in arguments):
            return (
                f"arguments for tool {name!r} must be a JSON object with string keys, "
                f"got {type(arguments).__name__}"
            )
        # Checked here as well as by the library, so that a handler behind this registry
        # never sees a value (NaN, a tuple) that a strict JSON log could not carry back.
        try:
            copied: dict[str, JSONValue] = plain_copy(arguments, root="arguments", strict=True)
        except UnloggableValue as exc:
            return (
                f"arguments for tool {name!r} are not plain JSON: "
                f"{_clip(exc.reason, _MESSAGE_CHARS)}"
            )
        refusal = _schema_refusal(name, validator, copied)
        return (self._specs[name], copied) if refusal is None else refusal

    def needs_approval(self, name: str) -> bool:
        """Whether a call of ``name`` waits for a person's approval before it runs."""
        spec = self._lookup(name)
        return spec is not None and spec.needs_approval

    def marks_completion(self, name: str) -> bool:
        """Whether calling ``name`` submits the task."""
        spec = self._lookup(name)
        return spec is not None and spec.completes

    def executor(self) -> ActionExecutor:
        """An action executor that dispatches ``{"name", "arguments"}`` payloads here."""
        return RegistryExecutor(self)

    def __copy__(self) -> ToolRegistry:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> ToolRegistry:
        # An immutable value, like a tuple: a copy may be the value itself, and handlers
        # (closures over clients, sockets) are not meant to be duplicated.
        return self

    def _lookup(self, name: object) -> ToolSpec | None:
        return self._specs.get(name) if isinstance(name, str) else None

    def _known(self) -> str:
        return ", ".join(repr(name) for name in self._specs) or "none"

    def _unknown(self, name: object) -> str:
        if not isinstance(name, str):
            return f"a tool name must be a string, got {type(name).__name__}"
        return f"unknown tool {_clip(name, _NAME_CHARS)!r}; known tools: {self._known()}"

    def __len__(self) -> int:
        return len(self._specs)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._specs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolRegistry):
            return NotImplemented
        mine = (self._max_observation_chars, list(self._specs.items()))
        theirs = (other._max_observation_chars, list(other._specs.items()))
        return mine == theirs

    def __repr__(self) -> str:
        return (
            f"ToolRegistry(names={self.names!r}, "
            f"max_observation_chars={self._max_observation_chars!r})"
        )


def _parse_payload(payload: JSONValue) -> tuple[str, object] | str:
    """``(name, arguments)`` from an action payload, or why the payload is malformed."""
    if not isinstance(payload, dict):
        return (
            "the action payload must be a JSON object with the keys 'name' and 'arguments', "
            f"got {type(payload).__name__}"
        )
    if payload.keys() != _PAYLOAD_KEYS:
        missing = sorted(_PAYLOAD_KEYS - payload.keys())
        extra = sorted(repr(key) for key in payload.keys() - _PAYLOAD_KEYS)
        detail = "; ".join(
            part
            for part in (
                f"missing {', '.join(map(repr, missing))}" if missing else "",
                _clip(f"unexpected {', '.join(extra)}", _MESSAGE_CHARS) if extra else "",
            )
            if part
        )
        return f"the action payload must have exactly the keys 'name' and 'arguments': {detail}"
    name = payload["name"]
    if not isinstance(name, str):
        return f"the action payload's 'name' must be a string, got {type(name).__name__}"
    return name, payload["arguments"]


async def _run_handler(
    spec: ToolSpec, arguments: dict[str, JSONValue], result_id: str
) -> tuple[ActionStatus, str, bool]:
    """The call's status, the handler's observation and whether the library made it up.

    ``arguments`` must be the handler's own copy: the payload belongs to the recorded
    action, and a handler that edits its arguments must not rewrite the trajectory.
    """
    try:
        result: object = await spec.handler(arguments, result_id=result_id)
    except EnvironmentFault as exc:
        return ActionStatus.ENV_FAULT, _fault_detail(exc), True
    except Exception as exc:  # noqa: BLE001 -- a failing tool is an observation, not a crash
        return ActionStatus.EXECUTED, exception_text(exc), True
    if not isinstance(result, str):
        return (
            ActionStatus.EXECUTED,
            f"TypeError: tool {spec.name!r} returned {type(result).__name__}, expected str",
            True,
        )
    return ActionStatus.EXECUTED, result, False


def _fault_detail(exc: EnvironmentFault) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 -- a broken __str__ must not hide the fault itself
        return exception_text(exc)


class RegistryExecutor:
    """The action executor derived from a :class:`ToolRegistry`: what its ``executor()`` returns.

    Not part of the public API; :mod:`polyloop.session` uses :attr:`registry` to refuse a
    request whose executor runs the tools of another registry than the one the model sees.
    """

    __slots__ = ("_registry",)

    def __init__(self, registry: ToolRegistry) -> None:
        self._registry = registry

    @property
    def registry(self) -> ToolRegistry:
        """The registry whose tools this executor runs."""
        return self._registry

    async def execute(self, action: Action, *, result_id: str) -> ActionOutcome:
        """Validate the call, run its handler, and report the outcome.

        A malformed payload, an unknown tool or arguments the tool's schema refuses give
        ``NOT_EXECUTED`` with the reason, and the handler is not called. A handler that
        returns gives ``EXECUTED`` with its text; one that raises
        :class:`EnvironmentFault` gives ``ENV_FAULT`` with the exception's message; one
        that raises any other ``Exception`` gives ``EXECUTED`` with
        ``"ExceptionClass: message"``, marked synthesized. ``done`` is always ``False``: a
        registry has no environment done signal.

        Cancellation: cancellation raised while the handler runs propagates out of this
        coroutine untouched (only ``Exception`` is caught, never ``BaseException``). The
        executor records nothing itself; what was announced before the call is the
        caller's intent log, and what the handler did before being cancelled is up to it.
        """
        call = _parse_payload(action.payload)
        if isinstance(call, str):
            return self._outcome(ActionStatus.NOT_EXECUTED, call, synthesized=True)
        accepted = self._registry._accepted(*call)
        if isinstance(accepted, str):
            return self._outcome(ActionStatus.NOT_EXECUTED, accepted, synthesized=True)
        status, observation, synthesized = await _run_handler(*accepted, result_id)
        return self._outcome(status, observation, synthesized=synthesized)

    def replay(self, action: Action) -> Replay:
        """The named tool's replay policy; ``NEVER`` for anything this registry cannot run."""
        call = _parse_payload(action.payload)
        if isinstance(call, str):
            return Replay.NEVER
        spec = self._registry._lookup(call[0])
        return Replay.NEVER if spec is None else spec.replay

    def reconciles(self, action: Action) -> bool:
        """Whether the named tool has a probe."""
        call = _parse_payload(action.payload)
        spec = None if isinstance(call, str) else self._registry._lookup(call[0])
        return spec is not None and spec.reconcile is not None

    async def reconcile(self, action: Action, *, result_id: str) -> Reconciled | None:
        """The tool probe's answer about ``action``, its observation cut like a handler's.

        ``None`` for a tool without a probe. Whatever the probe raises propagates: the
        library counts it and treats it as "cannot tell". A probe still waiting after the
        tool's ``reconcile_timeout_s`` is cancelled, and ``TimeoutError`` raised instead
        (whatever it answers once cancelled is not taken).

        Cancellation: propagates untouched; the probe's own writes are its business.
        """
        call = _parse_payload(action.payload)
        spec = None if isinstance(call, str) else self._registry._lookup(call[0])
        if isinstance(call, str) or spec is None or spec.reconcile is None:
            return None
        arguments = call[1]
        copied = plain_copy(arguments) if isinstance(arguments, dict) else {}
        timeout = spec.reconcile_timeout_s
        with anyio.move_on_after(timeout) as deadline:
            answer: object = await spec.reconcile(copied, result_id=result_id)
        # Set only by this scope's own deadline: a cancellation from outside it has
        # already propagated. An answer given after the cancellation is not trusted.
        if deadline.cancel_called:
            raise TimeoutError(f"it did not answer within {timeout:g} s and was cancelled")
        if answer is None:
            return None
        if (
            not isinstance(answer, Reconciled)
            or not isinstance(answer.ran, bool)
            or not isinstance(answer.observation, str)
        ):
            raise TypeError(
                f"the probe of tool {spec.name!r} returned {answer!r:.80}, "
                f"not Reconciled(ran=bool, observation=str) or None"
            )
        limit = self._registry.max_observation_chars
        if len(answer.observation) <= limit:
            return answer
        return dataclasses.replace(answer, observation=answer.observation[:limit])

    def _outcome(self, status: ActionStatus, text: str, *, synthesized: bool) -> ActionOutcome:
        limit = self._registry.max_observation_chars
        cut = max(0, len(text) - limit)
        return ActionOutcome(
            status=status,
            observation=text[:limit],
            synthesized=synthesized,
            done=False,
            truncated_chars=cut,
        )

    def __repr__(self) -> str:
        return f"RegistryExecutor(names={self._registry.names!r})"


def described_call_refusal(described: JSONValue, name: str, arguments: object) -> str | None:
    """Why a call of ``name`` with ``arguments`` does not fit the tool as ``described``
    (the ``describe()`` list a run's snapshot holds), or ``None`` if it fits.

    Lets a call be checked against a run's tools long after the registry that described
    them is gone: a person editing the arguments of a proposed call, say.
    """
    specs = described if isinstance(described, list) else []
    for tool in specs:
        if isinstance(tool, dict) and tool.get("name") == name:
            schema = tool.get("parameters")
            if not isinstance(schema, dict):
                break
            if not isinstance(arguments, dict):
                return f"arguments for tool {name!r} must be a JSON object"
            try:
                copied = plain_copy(arguments, root="arguments", strict=True)
            except UnloggableValue as exc:
                return f"arguments for tool {name!r} are not plain JSON: {exc.reason}"
            validator = Draft202012Validator(schema, registry=_LOCAL_ONLY)
            return _schema_refusal(name, validator, copied)
    return f"the run's tools hold no tool {name!r} with a schema"
