"""Test doubles for PolyLoop's seams, for this project's tests and for downstream ones.

* :class:`ScriptedModelClient`: a model that answers from a script, by call index.
* :class:`JsonActionInterpreter`: a minimal JSON interpreter for tests (applications
  name one from :mod:`polyloop.interpreters`).
* :class:`ScriptedEnvironment`: an action executor that answers from a script, by step.
* :class:`RecordedModelClient` and :class:`RecordedExecutor`: a model and an executor
  that answer from a recorded run's log, to re-drive it offline; each raises or reports
  a :class:`ReplayDiverged` naming the step where the re-driven run asks for something
  the recorded one did not (:class:`RecordedModelFailure` is a recorded model failure
  raised again).
* :class:`FaultyStore`: wraps a store and simulates a crash after the k-th write.
* :class:`RecordingSink`: an event sink that keeps every event.
* :func:`without_timing`: a record without its times and durations, to compare runs.

The contract every implementation of a seam keeps is a pytest suite to subclass, in a
submodule of its own, imported by name because it needs pytest:
:mod:`~polyloop.testing.store_contract`, :mod:`~polyloop.testing.model_client_contract`,
:mod:`~polyloop.testing.interpreter_contract` (which also needs Hypothesis),
:mod:`~polyloop.testing.executor_contract` and :mod:`~polyloop.testing.event_sink_contract`.
"""

from polyloop.testing._doubles import (
    JsonActionInterpreter,
    RecordingSink,
    ScriptedEnvironment,
    ScriptedModelClient,
    ScriptExhausted,
)
from polyloop.testing._faults import FaultyStore, SimulatedCrash
from polyloop.testing._recorded import (
    RecordedExecutor,
    RecordedModelClient,
    RecordedModelFailure,
    ReplayDiverged,
)
from polyloop.testing._timing import without_timing

__all__ = (
    "FaultyStore",
    "JsonActionInterpreter",
    "RecordedExecutor",
    "RecordedModelClient",
    "RecordedModelFailure",
    "RecordingSink",
    "ReplayDiverged",
    "ScriptExhausted",
    "ScriptedEnvironment",
    "ScriptedModelClient",
    "SimulatedCrash",
    "without_timing",
)
