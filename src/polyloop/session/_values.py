"""The values ``run`` and ``resume`` take: the definition, the request, the texts.

They live here, not in the package module, so that the modules of the loop can import
them; :mod:`polyloop.session` is their public home and says so in their ``__module__``.
Their annotations are therefore evaluated here, at class creation (no ``from __future__
import annotations``): ``typing.get_type_hints`` would look names up in the home module.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from polyloop.ports import ActionExecutor, EventSink, Interpreter, ModelClient, Store
from polyloop.tools import ToolRegistry
from polyloop.types import Budget, Injection, JSONValue, Message, Replay, ToolStyle

__all__ = ("Definition", "ObservationTexts", "Request")


@dataclass(frozen=True, slots=True, kw_only=True)
class ObservationTexts:
    """The texts the library feeds back when an action was refused or the environment failed.

    ``not_executed`` must contain ``{reason}`` and ``env_fault`` must contain ``{detail}``.
    The model sees them, so they are part of every run's snapshot.
    """

    not_executed: str
    env_fault: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Definition:
    """What stays the same across runs; safe to share between concurrent runs."""

    model: ModelClient
    interpreter: Interpreter
    store: Store
    events: EventSink
    texts: ObservationTexts

    def parameters(self) -> dict[str, JSONValue]:
        """The reproducibility parameters of the four seams and the texts, namespaced."""
        merged: dict[str, JSONValue] = {}
        seams: tuple[tuple[str, Any], ...] = (
            ("model", self.model),
            ("interpreter", self.interpreter),
            ("store", self.store),
            ("events", self.events),
        )
        for prefix, seam in seams:
            for key, value in seam.parameters().items():
                merged[f"{prefix}.{key}"] = value
        merged["texts.not_executed"] = self.texts.not_executed
        merged["texts.env_fault"] = self.texts.env_fault
        return merged


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """Everything one run needs. No field has a default; building one does no work.

    ``tools`` is what the model is shown, what the snapshot records and which calls
    submit the task; ``executor`` performs the actions. An executor derived from a
    registry (``registry.executor()``) must come from ``tools`` or a registry equal to
    it, or ``run`` and ``resume`` raise :class:`~polyloop.types.InvalidRequest` before
    any I/O: otherwise the model would be shown tools other than those that run. Any
    other executor is taken as it is, and keeping ``tools`` true to what it accepts is
    its author's part: the model sees ``tools``, and a call of a ``completes`` tool
    there that the executor reports ``EXECUTED`` (not synthesized) submits the task.
    """

    run_id: str
    budget: Budget
    executor: ActionExecutor
    tools: ToolRegistry
    run_context: tuple[Message, ...]
    goal_context: tuple[Message, ...]
    injection: Injection
    binding: Mapping[str, str]
    model_replay: Replay
    observation_template: str
    tool_style: ToolStyle
    cancel_grace_s: float
