"""Tools from MCP servers under PolyLoop's durability rules, against a real SDK server.

The server (``tests/kit/mcp_server.py``) is started by the tests, over stdio as a child
process of the client and over streamable HTTP on an ephemeral port of 127.0.0.1, and
records every call it receives with the result id found in the request's ``_meta``.
Pure mounting rules (the annotation table, names, schemas, result rendering) are
checked against a stand-in session that answers from a list.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp import types as mcp_types
from mcp.client.streamable_http import streamable_http_client

from kit.agent import answer, definition, request, tool_call
from polyloop import (
    Action,
    ActionStatus,
    Intent,
    IntentKind,
    InvalidRequest,
    Replay,
    RunEnded,
    RunIdentityMismatch,
    StopReason,
    ToolRegistry,
    resume,
    run,
)
from polyloop.mcp import RESULT_ID_META_KEY, MCPToolError, ToolOverride, mcp_tools
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash

pytestmark = [
    pytest.mark.anyio,
    # Under Trio, the SDK's streamable HTTP client leaves the response streams of httpx2
    # to the garbage collector; Trio closes them itself and warns. Nothing else is muted.
    pytest.mark.filterwarnings(r"ignore:Async generator 'http(x|core)2\.:ResourceWarning"),
]

KIT = Path(__file__).resolve().parents[1] / "kit" / "mcp_server.py"
SERVER_TOOLS = ["lookup", "put", "send", "plain", "slow", "fail", "media"]
LIMIT = 10_000


# -- the server ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """Where a test server records its calls, and how to reach it."""

    record: Path
    url: str | None  # None: over stdio, a new child process per session
    variant: str | None = None

    def calls(self, result_id: str | None = None, event: str = "call") -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        # Only whole lines: the server may be halfway through appending the last one.
        lines = [json.loads(line) for line in self.record.read_text().split("\n")[:-1]]
        return [
            line
            for line in lines
            if line["event"] == event and (result_id is None or line["result_id"] == result_id)
        ]

    async def wait_for(self, result_id: str, event: str) -> None:
        with anyio.fail_after(10):
            # Another process writes the record: there is no event to wait on.
            while not self.calls(result_id, event):  # noqa: ASYNC110
                await anyio.sleep(0.02)


def _start_http(record: Path, variant: str | None) -> tuple[subprocess.Popen[str], str]:
    args = [sys.executable, str(KIT), "--transport", "http", "--record", str(record)]
    if variant is not None:
        args += ["--changed", variant]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline()


class HttpServers:
    """One HTTP server per variant, started when a test first asks for it (the changed
    variants only the slow tests ask for) and shared by the module's tests after."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: dict[str | None, subprocess.Popen[str]] = {}
        self.servers: dict[str | None, Server] = {}

    def __getitem__(self, variant: str | None) -> Server:
        if variant not in self.servers:
            record = self.folder / f"{variant or 'base'}.jsonl"
            process, line = _start_http(record, variant)
            self.processes[variant] = process
            assert line.startswith("port "), line
            url = f"http://127.0.0.1:{int(line.split()[1])}/mcp"
            self.servers[variant] = Server(record=record, url=url, variant=variant)
        return self.servers[variant]

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
            process.wait(timeout=10)
            assert process.stdout is not None
            process.stdout.close()


@pytest.fixture(scope="module")
def http_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServers]:
    servers = HttpServers(tmp_path_factory.mktemp("mcp-http"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(params=["stdio", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def servers(
    transport: str, request: pytest.FixtureRequest, tmp_path: Path
) -> HttpServers | dict[str | None, Server]:
    """The base server and its changed variants, over the test's transport."""
    if transport == "http":
        shared: HttpServers = request.getfixturevalue("http_servers")
        return shared
    record = tmp_path / "stdio.jsonl"
    return {v: Server(record=record, url=None, variant=v) for v in (None, "schema", "annotations")}


@pytest.fixture
def server(servers: HttpServers | dict[str | None, Server]) -> Server:
    return servers[None]


@asynccontextmanager
async def connect(server: Server) -> AsyncIterator[ClientSession]:
    """An initialized client session to ``server``; closed (and its child gone) on exit."""
    if server.url is not None:
        async with (
            streamable_http_client(server.url) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session
        return
    args = [str(KIT), "--transport", "stdio", "--record", str(server.record)]
    if server.variant is not None:
        args += ["--changed", server.variant]
    params = StdioServerParameters(command=sys.executable, args=args)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


def new_run_id(label: str) -> str:
    # The HTTP servers are shared by the module: unique ids keep their records apart.
    return f"{label}-{uuid.uuid4().hex[:8]}"


def action_id(run_id: str, step: int) -> str:
    return f"{run_id}:{step}:action"


# -- a whole run --------------------------------------------------------------------------


async def test_a_durable_run_through_an_mcp_server(server: Server, tmp_path: Path) -> None:
    run_id = new_run_id("whole")
    script = [
        tool_call("lookup", key="a"),
        tool_call("media"),
        tool_call("fail", reason="no disk"),
        tool_call("lookup", key=7),  # refused by the schema before any call
        answer("done"),
    ]
    async with connect(server) as session, SqliteStore(tmp_path / "runs.db") as store:
        tools = ToolRegistry(await mcp_tools(session), max_observation_chars=LIMIT)
        result = await run(definition(store, script=script), request(run_id, tools))
        log = await store.read_log(run_id)

    assert result.stop_reason is StopReason.FINAL_ANSWER
    looked, media, failed, refused, _ = result.steps
    assert (looked.action_status, looked.observation) == (ActionStatus.EXECUTED, "value of a")
    assert not looked.observation_synthesized
    assert media.observation == MEDIA_OBSERVATION
    assert failed.action_status is ActionStatus.EXECUTED
    assert failed.observation_synthesized
    assert failed.observation == "MCPToolError: Error executing tool fail: could not do it: no disk"
    assert refused.action_status is ActionStatus.NOT_EXECUTED
    assert "at $.key" in (refused.observation or "")
    # The server saw each executed call once, under the result id PolyLoop allocated.
    for step, tool in enumerate(["lookup", "media", "fail"]):
        assert [c["tool"] for c in server.calls(action_id(run_id, step))] == [tool]
    assert server.calls(action_id(run_id, 3)) == []
    assert isinstance(log.records[-1], RunEnded)


MEDIA_OBSERVATION = "\n".join(
    [
        "here is what I found",
        "[image: image/png, 4 bytes]",
        "[audio: audio/wav, 8 bytes]",
        "[resource file:///report.pdf: application/pdf, 4 bytes]",
        "[resource link file:///notes.txt: text/plain, size unknown]",
    ]
)


async def test_long_results_are_cut_and_counted_like_any_tool(http_servers: Any) -> None:
    server = http_servers[None]
    async with connect(server) as session:
        tools = ToolRegistry(await mcp_tools(session), max_observation_chars=20)
        action = Action(
            payload={"name": "media", "arguments": {}}, action_text="media", history_text=""
        )
        outcome = await tools.executor().execute(action, result_id=new_run_id("cut"))
    assert outcome.observation == MEDIA_OBSERVATION[:20]
    assert outcome.truncated_chars == len(MEDIA_OBSERVATION) - 20


async def test_a_closed_session_is_an_environment_fault(http_servers: Any, tmp_path: Path) -> None:
    async with connect(http_servers[None]) as session:
        tools = ToolRegistry(await mcp_tools(session), max_observation_chars=LIMIT)
    run_id = new_run_id("closed")
    async with SqliteStore(tmp_path / "runs.db") as store:
        result = await run(
            definition(store, script=[tool_call("lookup", key="a")]), request(run_id, tools)
        )
    assert result.stop_reason is StopReason.ENV_FAILURE
    step = result.steps[0]
    assert step.action_status is ActionStatus.ENV_FAULT
    assert step.observation is not None
    assert step.observation.startswith("Fault: MCP tool 'lookup' could not be called: ")


# -- mounting: names, schemas, replay -------------------------------------------------------


@pytest.mark.parametrize("trusted", [False, True])
async def test_a_real_servers_annotations_decide_replay_only_when_trusted(
    http_servers: Any, trusted: bool
) -> None:
    async with connect(http_servers[None]) as session:
        specs = await mcp_tools(session, prefix="srv_", trusted=trusted)
        listed = (await session.list_tools()).tools
    assert [spec.name for spec in specs] == [f"srv_{name}" for name in SERVER_TOOLS]
    repeatable = {"lookup", "put", "slow", "media"} if trusted else set()
    for spec, tool in zip(specs, listed, strict=True):
        expected = Replay.ALLOWED if tool.name in repeatable else Replay.NEVER
        assert spec.replay is expected, tool.name
        assert spec.parameters == tool.input_schema
        assert spec.description == tool.description
        assert spec.annotations is not None
        assert spec.annotations["mcp_name"] == tool.name
        assert spec.annotations["trusted"] is trusted
    described = ToolRegistry(specs, max_observation_chars=LIMIT).describe()
    assert isinstance(described, list) and isinstance(described[1], dict)
    assert described[1]["annotations"] == {
        "source": "mcp",
        "mcp_name": "put",
        "mcp_annotations": {"readOnlyHint": False, "idempotentHint": True},
        "trusted": trusted,
        "overrides": {},
    }


class StandInSession:
    """Answers ``list_tools`` from a list (in pages) and ``call_tool`` with ``answer``."""

    def __init__(
        self, tools: Sequence[mcp_types.Tool], *, page: int = 100, answer: Any = None
    ) -> None:
        self.tools = list(tools)
        self.page = page
        self.answer = answer
        self.calls: list[tuple[str, Any, Any]] = []

    async def list_tools(
        self, *, params: mcp_types.PaginatedRequestParams | None = None
    ) -> mcp_types.ListToolsResult:
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + self.page
        more = str(end) if end < len(self.tools) else None
        return mcp_types.ListToolsResult(tools=self.tools[start:end], next_cursor=more)

    async def call_tool(self, name: str, arguments: Any = None, *, meta: Any = None) -> Any:
        self.calls.append((name, arguments, meta))
        await anyio.lowlevel.checkpoint()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def listed(name: str, hints: dict[str, Any] | None = None, **fields: Any) -> mcp_types.Tool:
    schema = fields.pop("schema", {"type": "object", "properties": {}})
    annotations = None if hints is None else mcp_types.ToolAnnotations.model_validate(hints)
    return mcp_types.Tool(name=name, input_schema=schema, annotations=annotations, **fields)


# Every combination of hints that matters, and the replay each gets (untrusted, trusted).
ANNOTATION_TABLE = [
    (None, Replay.NEVER),
    ({}, Replay.NEVER),
    ({"title": "Read"}, Replay.NEVER),
    ({"readOnlyHint": True}, Replay.ALLOWED),
    ({"readOnlyHint": False}, Replay.NEVER),
    ({"idempotentHint": True}, Replay.ALLOWED),
    ({"readOnlyHint": False, "idempotentHint": True}, Replay.ALLOWED),
    ({"destructiveHint": True, "idempotentHint": True}, Replay.ALLOWED),
    ({"destructiveHint": False}, Replay.NEVER),
    ({"idempotentHint": False}, Replay.NEVER),
    ({"openWorldHint": False}, Replay.NEVER),
    ({"readOnlyHint": True, "destructiveHint": True}, Replay.ALLOWED),
]


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize(("hints", "when_trusted"), ANNOTATION_TABLE, ids=str)
async def test_annotation_table(hints: Any, when_trusted: Replay, trusted: bool) -> None:
    (spec,) = await mcp_tools(StandInSession([listed("t", hints)]), trusted=trusted)
    assert spec.replay is (when_trusted if trusted else Replay.NEVER)
    assert spec.completes is False
    assert spec.annotations == {
        "source": "mcp",
        "mcp_name": "t",
        "mcp_annotations": hints,
        "trusted": trusted,
        "overrides": {},
    }


async def test_overrides_are_the_callers_decision_and_are_recorded() -> None:
    session = StandInSession(
        [listed("send", {"destructiveHint": True}), listed("read", {"readOnlyHint": True})]
    )
    send, read = await mcp_tools(
        session,
        trusted=True,
        overrides={
            "send": ToolOverride(replay=Replay.ALLOWED, completes=True),
            "read": ToolOverride(replay=Replay.NEVER),
        },
    )
    assert (send.replay, send.completes) == (Replay.ALLOWED, True)
    assert (read.replay, read.completes) == (Replay.NEVER, False)
    assert send.annotations is not None and read.annotations is not None
    assert send.annotations["overrides"] == {"replay": "allowed", "completes": True}
    assert read.annotations["overrides"] == {"replay": "never"}


async def test_every_page_of_the_listing_is_mounted() -> None:
    names = [f"t{i}" for i in range(7)]
    specs = await mcp_tools(StandInSession([listed(n) for n in names], page=3))
    assert [spec.name for spec in specs] == names


async def test_a_listing_that_never_ends_is_refused() -> None:
    class Looping(StandInSession):
        async def list_tools(self, *, params: Any = None) -> mcp_types.ListToolsResult:
            return mcp_types.ListToolsResult(tools=[], next_cursor="again")

    with pytest.raises(InvalidRequest, match="repeats the cursor 'again'"):
        await mcp_tools(Looping([]))


@pytest.mark.parametrize(
    ("arguments", "complaint"),
    [
        ({"prefix": ""}, "prefix"),
        ({"trusted": "yes"}, "trusted"),
        ({"overrides": {"nope": ToolOverride()}}, "'nope'"),
        ({"overrides": {"t": {"replay": "allowed"}}}, "ToolOverride"),
        ({"overrides": {"t": ToolOverride(replay="allowed")}}, "Replay"),  # type: ignore[arg-type]
        ({"overrides": {"t": ToolOverride(completes=1)}}, "bool"),  # type: ignore[arg-type]
    ],
)
async def test_bad_arguments_are_refused(arguments: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidRequest, match=complaint):
        await mcp_tools(StandInSession([listed("t")]), **arguments)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array"},
        {"type": "object", "properties": {"a": {"type": 7}}},
        {"type": "object", "minProperties": float("nan")},
    ],
)
async def test_a_schema_the_registry_would_refuse_names_the_tool(schema: Any) -> None:
    session = StandInSession([listed("good"), listed("bad", schema=schema)])
    with pytest.raises(InvalidRequest, match="MCP tool 'bad' cannot be mounted"):
        await mcp_tools(session)


async def test_name_clashes_are_refused_and_a_prefix_resolves_them() -> None:
    with pytest.raises(InvalidRequest, match="lists the tool 'a' more than once"):
        await mcp_tools(StandInSession([listed("a"), listed("a")]))
    first = await mcp_tools(StandInSession([listed("read")]))
    second = await mcp_tools(StandInSession([listed("read")]))
    with pytest.raises(InvalidRequest, match="'read' is registered twice"):
        ToolRegistry([*first, *second], max_observation_chars=LIMIT)
    second = await mcp_tools(StandInSession([listed("read")]), prefix="other_")
    together = ToolRegistry([*first, *second], max_observation_chars=LIMIT)
    assert together.names == ("read", "other_read")


# -- what a call gives back -----------------------------------------------------------------


async def _outcome(answer: Any, name: str = "t") -> Any:
    session = StandInSession([listed(name)], answer=answer)
    tools = ToolRegistry(await mcp_tools(session, prefix="p_"), max_observation_chars=LIMIT)
    action = Action(payload={"name": f"p_{name}", "arguments": {}}, action_text="", history_text="")
    outcome = await tools.executor().execute(action, result_id="r:3:action")
    return outcome, session


async def test_the_result_id_goes_in_the_request_meta_under_the_servers_tool_name() -> None:
    answer = mcp_types.CallToolResult(content=[mcp_types.TextContent(text="ok")])
    outcome, session = await _outcome(answer)
    assert (outcome.status, outcome.observation, outcome.synthesized) == (
        ActionStatus.EXECUTED,
        "ok",
        False,
    )
    assert session.calls == [("t", {}, {RESULT_ID_META_KEY: "r:3:action"})]


@pytest.mark.parametrize(
    "failure",
    [
        MCPError(code=-32000, message="Connection closed"),
        MCPError(code=-32603, message="internal error"),
        RuntimeError("input required"),
        OSError("broken pipe"),
    ],
    ids=repr,
)
async def test_no_answer_is_an_environment_fault(failure: Exception) -> None:
    outcome, _ = await _outcome(failure)
    assert outcome.status is ActionStatus.ENV_FAULT
    assert outcome.synthesized
    assert outcome.observation.startswith("MCP tool 't' could not be called: ")
    assert str(failure) in outcome.observation


async def test_an_error_result_is_the_tools_own_failure() -> None:
    answer = mcp_types.CallToolResult(
        content=[mcp_types.TextContent(text="bad input")], is_error=True
    )
    outcome, _ = await _outcome(answer)
    assert (outcome.status, outcome.observation, outcome.synthesized) == (
        ActionStatus.EXECUTED,
        "MCPToolError: bad input",
        True,
    )
    assert issubclass(MCPToolError, Exception)


async def test_structured_content_alone_is_shown_as_json() -> None:
    answer = mcp_types.CallToolResult(content=[], structured_content={"b": 1, "a": [True]})
    outcome, _ = await _outcome(answer)
    assert outcome.observation == '{"a": [true], "b": 1}'


async def test_an_embedded_text_resource_is_described_then_shown() -> None:
    resource = mcp_types.TextResourceContents(uri="file:///a.txt", mime_type=None, text="hello")
    answer = mcp_types.CallToolResult(
        content=[mcp_types.EmbeddedResource(resource=resource), mcp_types.TextContent(text="end")]
    )
    outcome, _ = await _outcome(answer)
    assert outcome.observation == "[resource file:///a.txt: unknown type, 5 characters]\nhello\nend"


async def test_cancellation_goes_through_the_handler() -> None:
    class Hanging(StandInSession):
        async def call_tool(self, name: str, arguments: Any = None, *, meta: Any = None) -> Any:
            await anyio.sleep_forever()

    tools = ToolRegistry(await mcp_tools(Hanging([listed("t")])), max_observation_chars=LIMIT)
    action = Action(payload={"name": "t", "arguments": {}}, action_text="", history_text="")
    with anyio.move_on_after(0.05) as scope:
        await tools.executor().execute(action, result_id="r:0:action")
    assert scope.cancelled_caught


# -- crashes, changed servers, cancellation -------------------------------------------------

CRASH_SCRIPT = [tool_call("put", key="k", value="v"), answer("stored")]


async def _crash_and_resume(
    tools: ToolRegistry, folder: Path, k: int
) -> tuple[str, Any, list[Any]]:
    """Crash a run after write ``k`` and resume it on a store opened afresh."""
    run_id = new_run_id(f"crash{k}")
    database = folder / f"crash{k}.db"
    first = SqliteStore(database)
    try:
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(first, fail_after_writes=k), script=CRASH_SCRIPT),
                request(run_id, tools, model_replay=Replay.ALLOWED),
            )
        crashed = list((await first.read_log(run_id)).records)
    finally:
        await first.aclose()
    async with SqliteStore(database) as second:
        resumed = await resume(
            definition(second, script=CRASH_SCRIPT),
            request(run_id, tools, model_replay=Replay.ALLOWED),
        )
    return run_id, resumed, crashed


async def _writes_of_a_whole_run(tools: ToolRegistry, folder: Path) -> int:
    async with SqliteStore(folder / "count.db") as store:
        counter = FaultyStore(store, fail_after_writes=1_000)
        await run(definition(counter, script=CRASH_SCRIPT), request(new_run_id("count"), tools))
    return counter.writes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trusted", "replay"), [(True, Replay.ALLOWED), (False, Replay.NEVER)], ids=["allowed", "never"]
)
async def test_a_crash_at_every_write_point(
    server: Server, tmp_path: Path, trusted: bool, replay: Replay
) -> None:
    async with connect(server) as session:
        tools = ToolRegistry(await mcp_tools(session, trusted=trusted), max_observation_chars=LIMIT)
        total = await _writes_of_a_whole_run(tools, tmp_path)
        assert total == 9  # start, 2 model intents, 2 model results, action intent, 2 steps, end
        outcomes = [await _crash_and_resume(tools, tmp_path, k) for k in range(1, total)]
    open_action_seen = False
    for k, (run_id, resumed, crashed) in enumerate(outcomes, start=1):
        received = [call["result_id"] for call in server.calls() if call["tool"] == "put"]
        mine = [rid for rid in received if rid is not None and rid.startswith(f"{run_id}:")]
        last = crashed[-1]
        if isinstance(last, Intent) and last.kind is IntentKind.ACTION:
            # The call went out, its answer was lost with the crash.
            open_action_seen = True
            if replay is Replay.NEVER:
                assert resumed.stop_reason is StopReason.IN_DOUBT, k
                assert mine == [action_id(run_id, 0)], k
            else:
                assert resumed.stop_reason is StopReason.FINAL_ANSWER, k
                assert mine == [action_id(run_id, 0)] * 2, k
            continue
        assert resumed.stop_reason is StopReason.FINAL_ANSWER, k
        assert mine == [action_id(run_id, 0)], k
    assert open_action_seen


@pytest.mark.slow
@pytest.mark.parametrize("change", ["schema", "annotations"])
async def test_a_server_changed_between_crash_and_resume_is_refused(
    servers: HttpServers | dict[str | None, Server], tmp_path: Path, change: str
) -> None:
    run_id = new_run_id("changed")
    database = tmp_path / "runs.db"
    async with connect(servers[None]) as session:
        tools = ToolRegistry(await mcp_tools(session), max_observation_chars=LIMIT)
        first = SqliteStore(database)
        try:
            with pytest.raises(SimulatedCrash):
                # Write 4 is the action intent: the resume would have to decide on it.
                await run(
                    definition(FaultyStore(first, fail_after_writes=4), script=CRASH_SCRIPT),
                    request(run_id, tools),
                )
            before = (await first.read_log(run_id)).records
        finally:
            await first.aclose()
    async with connect(servers[change]) as session, SqliteStore(database) as second:
        changed = ToolRegistry(await mcp_tools(session), max_observation_chars=LIMIT)
        with pytest.raises(RunIdentityMismatch) as mismatch:
            await resume(definition(second, script=CRASH_SCRIPT), request(run_id, changed))
        after = (await second.read_log(run_id)).records
    assert after == before
    assert any(key.startswith("tools") for key, _, _ in mismatch.value.differences)


async def test_cancelling_a_run_cancels_the_mcp_request(server: Server, tmp_path: Path) -> None:
    run_id = new_run_id("cancel")
    script = [tool_call("slow", seconds=60), answer("never")]
    async with connect(server) as session, SqliteStore(tmp_path / "runs.db") as store:
        tools = ToolRegistry(await mcp_tools(session), max_observation_chars=LIMIT)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:

                async def cancel_once_called() -> None:
                    await server.wait_for(action_id(run_id, 0), "call")
                    scope.cancel()

                group.start_soon(cancel_once_called)
                await run(definition(store, script=script), request(run_id, tools))
        assert scope.cancelled_caught
        # The server hears of it while the session is still open.
        await server.wait_for(action_id(run_id, 0), "cancelled")
        log = await store.read_log(run_id)
    end = log.records[-1]
    assert isinstance(end, RunEnded)
    assert end.stop_reason is StopReason.CANCELLED
