"""Test doubles for PolyLoop's seams, for this project's tests and for downstream ones.

* :class:`ScriptedModelClient`: a model that answers from a script, by call index.
* :class:`JsonActionInterpreter`: a minimal JSON interpreter for tests (applications
  name one from :mod:`polyloop.interpreters`).
* :class:`ScriptedEnvironment`: an action executor that answers from a script, by step.
* :class:`FaultyStore`: wraps a store and simulates a crash after the k-th write.
* :class:`RecordingSink`: an event sink that keeps every event.
"""

from polyloop.testing._doubles import (
    JsonActionInterpreter,
    RecordingSink,
    ScriptedEnvironment,
    ScriptedModelClient,
    ScriptExhausted,
)
from polyloop.testing._faults import FaultyStore, SimulatedCrash

__all__ = (
    "FaultyStore",
    "JsonActionInterpreter",
    "RecordingSink",
    "ScriptExhausted",
    "ScriptedEnvironment",
    "ScriptedModelClient",
    "SimulatedCrash",
)
