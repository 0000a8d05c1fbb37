"""Comparing runs whatever their clocks said."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

from polyloop.types import Record, RunStarted

__all__ = ("without_timing",)

_R = TypeVar("_R", bound=Record)


def without_timing(record: _R) -> _R:
    """``record`` with its timing fields set to ``None``: ``at``, the durations, and
    the step record's ``resumed`` (which attempt of the run wrote it).

    Those are the only fields allowed to differ between a run and the same run resumed
    after a crash, so two trajectories are the same run when their records are equal
    once passed through this. A fork's start record has its inherited steps cleared too.
    """
    value: Any = record  # replace() cannot be typed over a union of record classes
    timing: dict[str, Any] = {
        field.name: None
        for field in dataclasses.fields(record)
        if field.metadata.get("timing") and getattr(record, field.name) is not None
    }
    if isinstance(record, RunStarted) and record.inherited:
        timing["inherited"] = tuple(without_timing(step) for step in record.inherited)
    return cast(_R, dataclasses.replace(value, **timing)) if timing else record
