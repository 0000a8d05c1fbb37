"""How much time and how many examples the fuzz tests may spend.

One knob, the environment variable ``POLYLOOP_FUZZ_SECONDS``: the wall-clock seconds that
the time-bounded byte fuzzers of ``tests/kernel/test_serialization_fuzz.py`` (the record codec) and
``tests/stores/test_fuzz_stores.py`` (the JSON-lines reader) share between them. Unset, it is
:data:`CI_SECONDS` when ``CI=true`` (the bounded fuzzing run of every CI job) and
:data:`LOCAL_SECONDS` otherwise, so that a local test run stays quick. Example counts of
the example-bounded tests (the stateful store machines) scale with the same number,
relative to the CI default, and never drop below a floor that still exercises every rule.

A long fuzzing session is ``POLYLOOP_FUZZ_SECONDS=3600 pytest --run-slow
tests/kernel/test_serialization_fuzz.py tests/stores/test_fuzz_stores.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

ENV_VAR = "POLYLOOP_FUZZ_SECONDS"
CI_SECONDS = 15.0
LOCAL_SECONDS = 3.0


def total_seconds() -> float:
    """The fuzzing budget in seconds (see the module documentation)."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a number of seconds, not {raw!r}") from None
        if not value >= 0:  # also refuses NaN
            raise ValueError(f"{ENV_VAR} must be at least 0, not {raw!r}")
        return value
    return CI_SECONDS if os.environ.get("CI") == "true" else LOCAL_SECONDS


def seconds(share: float) -> float:
    """This test's part of the budget: ``share`` (a fraction) of :func:`total_seconds`."""
    return total_seconds() * share


def examples(at_ci_default: int, *, floor: int) -> int:
    """An example count: ``at_ci_default`` under the CI budget, scaled with the budget."""
    scaled = round(at_ci_default * total_seconds() / CI_SECONDS)
    return max(floor, scaled)


def fuzz_for(budget_s: float, batch: Callable[[], None]) -> int:
    """Call ``batch`` (a hypothesis test) again and again until ``budget_s`` has passed.

    Every call draws new random examples, so the number of examples grows with the
    budget while each call stays an ordinary, shrinking, reproducible hypothesis run.
    ``batch`` runs at least once. Returns how many times it ran.
    """
    deadline = time.monotonic() + budget_s
    runs = 0
    while True:
        batch()
        runs += 1
        if time.monotonic() >= deadline:
            return runs
