"""Sweeps over every crash or fault point, sampled unless the slow tests run.

A sweep that crashes a run after each of its writes is the strongest test the stores have,
and the one that costs most: on PostgreSQL each point opens stores and runs the run twice.
The default run takes a sample, the first point, the last and every seventh between (a step
writes four records, so every seventh point falls on each kind of write in turn);
``--run-slow`` (the README's test command, CI) takes all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

SAMPLE_EVERY = 7


def every_point(points: Iterable[Any]) -> list[Any]:
    """``points`` as parameters, those outside the default sample marked slow.

    A point given as ``pytest.param`` keeps its id and marks; a tuple is the values of
    several argument names, as ``parametrize`` reads it.
    """
    listed = list(points)
    last = len(listed) - 1
    return [
        point if i % SAMPLE_EVERY == 0 or i == last else _slow(point)
        for i, point in enumerate(listed)
    ]


def _slow(point: Any) -> Any:
    if isinstance(point, type(pytest.param(None))):
        return pytest.param(*point.values, id=point.id, marks=(*point.marks, pytest.mark.slow))
    values = point if isinstance(point, tuple) else (point,)
    return pytest.param(*values, marks=pytest.mark.slow)
