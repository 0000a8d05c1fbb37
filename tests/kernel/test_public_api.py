"""The public surface: what is exported, from where, and what public signatures mention."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import typing
from typing import Any

import pytest

import polyloop
import polyloop.mcp
import polyloop.otel
import polyloop.temporal
import polyloop.testing
from polyloop import interpreters, ports, serialization, session, tools, types

# SPEC §12.1: where every public name lives.
NAMES_BY_MODULE = {
    types: {
        "JSONValue",
        "Role",
        "TextBlock",
        "ContentBlock",
        "Message",
        "Budget",
        "Replay",
        "ActionStatus",
        "DecisionKind",
        "StopReason",
        "ToolStyle",
        "Injection",
        "StepRecord",
        "RunStarted",
        "Intent",
        "IntentKind",
        "Result",
        "RunEnded",
        "RunLog",
        "RunResult",
        "Record",
        "PolyLoopError",
        "RunAlreadyExists",
        "RunNotFound",
        "RunIdentityMismatch",
        "CorruptLog",
        "SchemaMajorMismatch",
        "RunLocked",
        "LeaseLost",
        "InvalidRequest",
        "StoreError",
        "UnloggableValue",
        "RunState",
        "RunStatus",
        "RecoveredRun",
        # issue 15: what the model said about its reply
        "FinishReason",
        "Usage",
        # issue 16: native tool calls as content blocks
        "ToolCallBlock",
        "ToolResultBlock",
        # issue 19: a person in the loop
        "Proposal",
        "Reconciled",
        "Verdict",
        "Settlement",
        "Review",
        "NotInDoubt",
        "NotAwaitingApproval",
        # issue 29, item 6: a run's trace id without OpenTelemetry installed
        "run_trace_id",
        # issue 44, part 4: why a run nobody drives goes on (RunStatus.ready)
        "Ready",
        # issue 44, part 3: a cancel that stops
        "CancelRequest",
        "CancelRequested",
        # issue 46, item 1: following a run as it is written
        "FollowedRecord",
        # issue 48: a run going on under a changed definition, recorded
        "Amendment",
        "Amended",
        "AmendmentRefused",
    },
    ports: {
        "ModelClient",
        "ModelCall",
        "ModelReply",
        "Interpreter",
        "Decision",
        "Action",
        "FinalAnswer",
        "InvalidDecision",
        "ActionExecutor",
        "ActionOutcome",
        "Store",
        "EventSink",
        "Event",
        "EventKind",
        "NullSink",
        "ReconcilingExecutor",
        "ManagedStore",
        "StoredRun",
        "reject_incomplete",
        # issue 18, item 7: spans current while a call runs
        "TracingSink",
        # issue 44, part 2: a store that says when a run may go on
        "ChangeFeed",
        # issue 46, item 3: the model's text as it arrives
        "StreamingModelClient",
        "DeltaSink",
        "TextDelta",
        # issue 46, item 1: a store that reads after a position and says when it grew
        "FollowableStore",
        # issue 47: a store that lists one page of its runs
        "PagedStore",
        "RunPage",
    },
    # issue 20: a handler reports a broken environment
    tools: {"ToolSpec", "ToolRegistry", "EnvironmentFault"},
    session: {
        # SPEC item 22: hosting runs
        "Agent",
        "Definition",
        "Request",
        "ObservationTexts",
        "run",
        "resume",
        "start_or_resume",
        "run_status",
        "recover",
        # issue 19: a person in the loop
        "approve",
        "reject",
        "settle",
        # issue 32: forks of recorded runs
        "fork",
        # issue 44: a host of agents
        "serve_agents",
        # issue 44, part 3: a cancel that stops
        "cancel",
        # issue 46, item 1: following a run as it is written
        "follow",
    },
}
# Modules imported by name, never re-exported at the top level.
# issue 30: runs driven by Temporal; imported explicitly, never re-exported at the top.
# "Agent" is the core's (SPEC item 22), re-exported where Temporal users first met it.
TEMPORAL_SHARED = {"Agent"}
TEMPORAL_NAMES = {
    "Agent",
    "AgentRun",
    "ApproveInput",
    "PolyLoopPlugin",
    "RejectInput",
    "RunInput",
    "SettleInput",
    "start_agent_run",
    "status_json",
}
# issue 18: spans for OpenTelemetry; imported explicitly, never re-exported at the top.
OTEL_NAMES = {"OpenTelemetrySink"}
NAMED_MODULES = {
    # issue 16, part 5: ready-made interpreters, one per action language
    interpreters: {"CodeBlockInterpreter", "JsonToolCallInterpreter", "NativeToolCallInterpreter"},
    # issue 43, item 4: a facade over private modules, as the interpreters are
    polyloop.otel: OTEL_NAMES,
}
# issue 20: tools from MCP servers; imported explicitly, never re-exported at the top.
MCP_NAMES = {"RESULT_ID_META_KEY", "MCPToolError", "ToolOverride", "mcp_tools"}
# Test doubles; imported explicitly, never re-exported at the top.
TESTING_NAMES = {
    "FaultyStore",
    "JsonActionInterpreter",
    "RecordingSink",
    "ScriptExhausted",
    "ScriptedEnvironment",
    "ScriptedModelClient",
    "SimulatedCrash",
    "without_timing",
    # issue 32, item 3: re-driving a recorded run offline
    "RecordedExecutor",
    "RecordedModelClient",
    "RecordedModelFailure",
    "ReplayDiverged",
}
ERRORS = {
    "PolyLoopError": Exception,
    "InvalidRequest": ValueError,
    "RunAlreadyExists": FileExistsError,
    "RunNotFound": LookupError,
    "RunIdentityMismatch": ValueError,
    "AmendmentRefused": ValueError,
    "CorruptLog": ValueError,
    "SchemaMajorMismatch": ValueError,
    "UnloggableValue": ValueError,
    "RunLocked": BlockingIOError,
    "LeaseLost": BlockingIOError,
    "StoreError": OSError,
}


@pytest.mark.parametrize(
    "module",
    [
        polyloop,
        types,
        ports,
        tools,
        session,
        serialization,
        interpreters,
        polyloop.mcp,
        polyloop.otel,
        polyloop.temporal,
        polyloop.testing,
    ],
    ids=lambda m: m.__name__,
)
def test_all_is_a_sorted_tuple_of_unique_existing_names(module: Any) -> None:
    exported = module.__all__
    assert isinstance(exported, tuple)
    assert list(exported) == sorted(exported)
    assert len(set(exported)) == len(exported)
    for name in exported:
        assert hasattr(module, name), name


@pytest.mark.parametrize("module", list(NAMES_BY_MODULE), ids=lambda m: m.__name__)
def test_each_module_exports_exactly_its_spec_names(module: Any) -> None:
    assert set(module.__all__) == NAMES_BY_MODULE[module]


@pytest.mark.parametrize("module", list(NAMED_MODULES), ids=lambda m: m.__name__)
def test_each_named_module_exports_exactly_its_names_and_stays_off_the_top_level(
    module: Any,
) -> None:
    assert set(module.__all__) == NAMED_MODULES[module]
    for name in module.__all__:
        assert name not in polyloop.__all__, name
        # Defined in a private module, but reprs, pickles and docs name the public one.
        assert getattr(module, name).__module__ == module.__name__, name
        assert not _is_private(getattr(module, name)), name


def test_top_level_reexports_the_same_objects_once() -> None:
    expected = set().union(*NAMES_BY_MODULE.values())
    assert set(polyloop.__all__) == expected
    for module, names in NAMES_BY_MODULE.items():
        for name in names:
            assert getattr(polyloop, name) is getattr(module, name), name
    # Exported once: no object reachable under two public names (aliases excepted).
    objects = [getattr(polyloop, name) for name in polyloop.__all__ if name not in {"ContentBlock"}]
    assert len({id(obj) for obj in objects}) == len(objects)


def test_the_mcp_module_exports_its_names_and_the_top_level_none_of_them() -> None:
    assert set(polyloop.mcp.__all__) == MCP_NAMES
    assert MCP_NAMES.isdisjoint(polyloop.__all__)


def test_the_otel_module_exports_its_names_and_the_top_level_none_of_them() -> None:
    assert set(polyloop.otel.__all__) == OTEL_NAMES
    assert OTEL_NAMES.isdisjoint(polyloop.__all__)


def test_the_temporal_module_exports_its_names_and_the_top_level_none_of_them() -> None:
    # Its values keep their private modules as homes: Temporal's data converter resolves
    # their annotations in the module that defines them.
    assert set(polyloop.temporal.__all__) == TEMPORAL_NAMES
    assert (TEMPORAL_NAMES - TEMPORAL_SHARED).isdisjoint(polyloop.__all__)
    for name in TEMPORAL_SHARED:
        assert getattr(polyloop.temporal, name) is getattr(polyloop, name), name


def test_the_testing_module_exports_its_names_and_the_top_level_none_of_them() -> None:
    assert set(polyloop.testing.__all__) == TESTING_NAMES
    assert TESTING_NAMES.isdisjoint(polyloop.__all__)


def test_codec_stays_in_serialization() -> None:
    for name in serialization.__all__:
        assert not hasattr(polyloop, name) or name not in polyloop.__all__


def _public_callables() -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    public = [(name, getattr(polyloop, name)) for name in polyloop.__all__]
    public += [(name, getattr(polyloop.mcp, name)) for name in polyloop.mcp.__all__]
    public += [(name, getattr(polyloop.otel, name)) for name in polyloop.otel.__all__]
    public += [(name, getattr(polyloop.temporal, name)) for name in polyloop.temporal.__all__]
    for name, obj in public:
        if inspect.isclass(obj):
            found.append((name, obj))
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and callable(member):
                    found.append((f"{name}.{attr}", member))
                if isinstance(member, (classmethod, property)):
                    inner = member.__func__ if isinstance(member, classmethod) else member.fget
                    found.append((f"{name}.{attr}", inner))
        elif callable(obj) and not isinstance(
            obj, typing.TypeAliasType if hasattr(typing, "TypeAliasType") else ()
        ):
            found.append((name, obj))
    return found


def _named_types(annotation: Any) -> list[Any]:
    """Every class mentioned in an annotation, recursively."""
    found = []
    origin = typing.get_origin(annotation)
    if origin is not None:
        found.append(origin)
    for arg in typing.get_args(annotation):
        found += _named_types(arg)
    if inspect.isclass(annotation):
        found.append(annotation)
    return found


def _is_private(cls: Any) -> bool:
    module = getattr(cls, "__module__", "") or ""
    if cls.__name__.startswith("_"):
        return True
    return any(part.startswith("_") for part in module.split("."))


def test_no_private_type_appears_in_a_public_signature() -> None:
    offenders = []
    exported = {id(getattr(polyloop.temporal, name)) for name in polyloop.temporal.__all__}
    for name, obj in _public_callables():
        if inspect.isclass(obj):
            if obj.__init__ is object.__init__:
                continue
            target = obj.__init__
        else:
            target = obj
        scope = {
            **vars(polyloop),
            **vars(polyloop.mcp),
            **vars(polyloop.otel),
            **vars(polyloop.temporal),
        }
        hints = typing.get_type_hints(target, localns=scope)
        if dataclasses.is_dataclass(obj):
            hints.update(typing.get_type_hints(obj, localns=scope))
        for where, annotation in hints.items():
            for cls in _named_types(annotation):
                if id(cls) in exported:  # a public name, whatever module defines it
                    continue
                if _is_private(cls) and cls.__module__.startswith("polyloop"):
                    offenders.append(f"{name} {where}: {cls.__module__}.{cls.__name__}")
    assert offenders == []


def test_errors_live_in_types_and_subclass_their_builtins() -> None:
    for name, builtin in ERRORS.items():
        cls = getattr(types, name)
        assert cls.__module__ == "polyloop.types"
        assert issubclass(cls, types.PolyLoopError)
        assert issubclass(cls, builtin)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_name_the_run_and_record_and_survive_pickling(name: str) -> None:
    cls = getattr(types, name)
    error = cls("it broke", run_id="run-7", location="runs/x.jsonl:3")
    assert "run-7" in str(error) and "runs/x.jsonl:3" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert (copy.run_id, copy.location, str(copy)) == (error.run_id, error.location, str(error))


def test_identity_mismatch_message_names_every_key() -> None:
    error = types.RunIdentityMismatch(run_id="r", differences=[("a.b", 1, 2), ("c", None, "x")])
    assert "a.b" in str(error) and "c" in str(error)
    assert pickle.loads(pickle.dumps(error)).differences == error.differences


def test_identity_mismatch_says_what_differs_and_what_to_do() -> None:
    differences = [("budget.max_steps", 20, 30), ("goal_context.sha256", "ab12", "cd34")]
    text = str(types.RunIdentityMismatch(run_id="r", differences=differences))
    assert "budget.max_steps (20 then, 30 now)" in text
    assert "goal_context.sha256 (the goal context is not the same)" in text
    assert "start a new run under a new run id" in text


def test_value_types_are_frozen_slotted_keyword_only() -> None:
    modules = (types, ports, session, interpreters, polyloop.mcp, polyloop.otel, polyloop.temporal)
    for module in modules:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
                params = obj.__dataclass_params__  # type: ignore[attr-defined]
                assert params.frozen, name
                assert hasattr(obj, "__slots__"), name
                assert all(f.kw_only for f in dataclasses.fields(obj)), name


# A class may state one cancellation rule for all its coroutines instead.
CLASS_RULE = "Cancellation, for every method:"


def _public_coroutines() -> list[tuple[str, Any, str]]:
    """(name, coroutine, the docstring that must state what a cancellation leaves)."""
    from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore

    found = [
        (name, function, function.__doc__ or "")
        for name, function in ((name, getattr(polyloop, name)) for name in polyloop.__all__)
        if inspect.iscoroutinefunction(function)
    ]
    found += [("mcp_tools", polyloop.mcp.mcp_tools, polyloop.mcp.mcp_tools.__doc__ or "")]
    start = polyloop.temporal.start_agent_run
    found += [("start_agent_run", start, start.__doc__ or "")]
    classes = [getattr(polyloop, n) for n in polyloop.__all__]
    classes += [
        MemoryStore,
        JsonlStore,
        SqliteStore,
        PostgresStore,
        polyloop.otel.OpenTelemetrySink,
        polyloop.temporal.AgentRun,
    ]
    for cls in classes:
        if not inspect.isclass(cls):
            continue
        rule = cls.__doc__ if CLASS_RULE in (cls.__doc__ or "") else None
        # Inherited coroutines too: the database stores take theirs from one engine.
        for attr, member in inspect.getmembers(cls, inspect.iscoroutinefunction):
            if not attr.startswith("_"):
                found.append((f"{cls.__name__}.{attr}", member, rule or member.__doc__ or ""))
    return found


@pytest.mark.parametrize(
    ("name", "coroutine", "doc"), _public_coroutines(), ids=[n for n, _, _ in _public_coroutines()]
)
def test_every_public_coroutine_documents_cancellation(name: str, coroutine: Any, doc: str) -> None:
    assert "Cancellation" in doc, name


def test_a_lost_lease_is_a_kind_of_run_locked() -> None:
    """Code that already treats ``RunLocked`` as "someone else has the run" keeps working."""
    assert issubclass(types.LeaseLost, types.RunLocked)


def test_the_event_kinds_are_only_ever_added_to() -> None:
    """A sink matches on the kinds' values; issue 48 added ``run_amended`` at the end."""
    assert [kind.value for kind in ports.EventKind] == [
        "run_started",
        "run_resumed",
        "step_finished",
        "run_ended",
        "run_amended",
    ]
    assert polyloop.EventKind.RUN_AMENDED is ports.EventKind.RUN_AMENDED
