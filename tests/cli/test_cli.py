"""The ``polyloop`` command: the demo agent, crash and resume in real processes, a real
OpenAI-compatible server, and the one-line errors.

Tests that call ``main()`` are synchronous: ``main`` starts its own event loop. The
backend is chosen with ``--backend``, so the command itself is exercised under asyncio
and Trio.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import polyloop as polyloop_package
from kit.chat import ChatServer, Reply
from kit.show import without_times
from kit.surrogate import HALF, SHOWN, StrictOutput
from polyloop import ActionStatus, ModelReply, StepRecord
from polyloop._escaping import escape_block, escape_field
from polyloop.cli import main
from polyloop.cli._agent import (
    Ledger,
    TextToolInterpreter,
    build_tools,
    evaluate,
    find_object,
    load_data,
    script,
    units,
)
from polyloop.cli._demo import DemoOptions, resume_command
from polyloop.cli._stores import parse_store
from polyloop.ports import Action, FinalAnswer, InvalidDecision
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.types import IntentKind, Result

ROOT = Path(__file__).resolve().parents[2]

BACKENDS = ["asyncio", "trio"]
# The demo's seven steps: list, three reads, a refused calculator call, the sum, submit.
STEPS = 7
TOTAL = 660
# RunStarted, four writes per step, RunEnded.
WRITES = 1 + 4 * STEPS + 1


def demo(*args: str, backend: str = "asyncio") -> list[str]:
    return ["--backend", backend, "demo", "--pace", "0", *args]


def user_env(*path: Path) -> dict[str, str]:
    """The environment of a user who has not activated the virtual environment: no
    ``polyloop`` on PATH (but for the directories ``path``), PolyLoop importable."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    kept = [d for d in dirs if not (Path(d) / "polyloop").exists()]
    source = str(Path(polyloop_package.__file__).resolve().parent.parent)
    imports = [source, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        "PATH": os.pathsep.join([*map(str, path), *kept]),
        "PYTHONPATH": os.pathsep.join(imports),
    }


# What ``python -m polyloop`` prints as its own name when no ``polyloop`` is on PATH.
MODULE_COMMAND = shlex.join([sys.executable, "-m", "polyloop"])


def polyloop(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a process of its own, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "polyloop", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=user_env(),
    )


def pasted(line: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """A command the demo printed, run as the user would paste it into their shell."""
    return subprocess.run(
        shlex.split(line), capture_output=True, text=True, timeout=120, cwd=cwd, env=user_env()
    )


def printed(prefix: str, out: str) -> str:
    """The command on the line of ``out`` that starts with ``prefix``."""
    (line,) = [line for line in out.splitlines() if line.startswith(prefix)]
    return line.removeprefix(prefix)


def run_id_in(out: str) -> str:
    match = re.search(r"demo run (demo-[0-9a-f]{8})", out)
    assert match is not None, out
    return match.group(1)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("polyloop: error: "), err
    assert "Traceback" not in err
    return lines[0]


async def action_results(store: Any, run_id: str) -> list[str]:
    log = await store.read_log(run_id)
    return [
        r.result_id for r in log.records if isinstance(r, Result) and r.kind is IntentKind.ACTION
    ]


def read_log(store_spec: str, run_id: str) -> Any:
    import anyio

    async def read() -> Any:
        kind, _, where = store_spec.partition(":")
        store = JsonlStore(where) if kind == "jsonl" else SqliteStore(where)
        async with store:
            return await store.read_log(run_id), await action_results(store, run_id)

    return anyio.run(read)


# -- the demo ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_demo_runs_on_the_default_sqlite_store(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    backend: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    began = datetime.now(UTC)
    assert main(demo(backend=backend)) == 0
    ended = datetime.now(UTC)
    out = capsys.readouterr().out
    run_id = run_id_in(out)
    assert "on sqlite:polyloop-demo/demo.db (scripted model)" in out
    assert (tmp_path / "polyloop-demo" / "demo.db").is_file()
    for step in range(STEPS):
        assert f"step  {step}  " in out
    assert "list_files({})" in out
    assert 'read_file({"name": "north.csv"})' in out
    assert "not executed  calculator" in out  # the schema refused the wordy expression
    assert "does not match '^[0-9+" in out
    assert f"→ {TOTAL}" in out
    assert f"stopped: submitted after {STEPS} steps ({STEPS - 1} valid)" in out
    assert f"Submitted total {TOTAL} (correct)." in out
    assert f"polyloop show sqlite:polyloop-demo/demo.db {run_id}" in out

    assert main(["runs", "sqlite:polyloop-demo/demo.db", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    listed = json.loads(line)
    # When the store took the run's last record: during the demo, in UTC.
    last_record_at = datetime.fromisoformat(listed.pop("last_record_at"))
    assert last_record_at.utcoffset() == timedelta(0)
    assert began - timedelta(seconds=1) <= last_record_at <= ended + timedelta(seconds=1)
    # Its start and end records' times, and the time between them.
    started_at = datetime.fromisoformat(listed.pop("started_at"))
    ended_at = datetime.fromisoformat(listed.pop("ended_at"))
    assert began - timedelta(seconds=1) <= started_at <= ended_at <= last_record_at
    assert listed.pop("duration_s") == (ended_at - started_at).total_seconds()
    assert listed == {
        "run_id": run_id,
        "state": "finished",
        "stop_reason": "submitted",
        "step_count": STEPS,
        "valid_step_count": STEPS - 1,
        "detail": None,
        "ready": None,
        "agent": None,
    }


def test_every_demo_run_gets_a_new_run_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"jsonl:{tmp_path / 'runs'}"
    assert main(demo("--store", store)) == 0
    assert main(demo("--store", store)) == 0
    out = capsys.readouterr().out
    first, second = re.findall(r"demo run (demo-[0-9a-f]{8})", out)
    assert first != second
    assert len(list((tmp_path / "runs").glob("*.jsonl"))) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_demo_runs_on_a_jsonl_store_and_logs_every_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    store = f"jsonl:{tmp_path / 'runs'}"
    assert main(demo("--store", store, backend=backend)) == 0
    out = capsys.readouterr().out
    run_id = run_id_in(out)
    assert f"on {store} (scripted model)" in out
    assert f"polyloop show {store} {run_id}" in out
    log, actions = read_log(store, run_id)
    # A step record and its action result share one line; every other record has its own.
    (path,) = (tmp_path / "runs").glob("*.jsonl")
    assert len(path.read_text().splitlines()) == WRITES
    assert len(log.records) == WRITES + STEPS
    assert actions == [f"{run_id}:{k}:action" for k in range(STEPS)]
    steps = [r for r in log.records if isinstance(r, StepRecord)]
    assert [s.action_status for s in steps].count(ActionStatus.NOT_EXECUTED) == 1

    assert main(["verify", store]) == 0
    assert f"ok       {run_id} ({WRITES + STEPS} records)" in capsys.readouterr().out


def test_the_demo_says_when_the_crash_point_lies_beyond_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"jsonl:{tmp_path / 'runs'}"
    assert main(demo("--store", store, "--crash-after-writes", str(WRITES + 5))) == 0
    out = capsys.readouterr().out
    assert f"no crash: the run made only {WRITES} store writes" in out
    assert "stopped: submitted" in out


# -- crash and resume, in real processes -----------------------------------------------------


@pytest.fixture(params=["sqlite", "jsonl"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return (
        f"sqlite:{tmp_path / 'demo.db'}"
        if request.param == "sqlite"
        else f"jsonl:{tmp_path / 'runs'}"
    )


def crash(store_spec: str, writes: int) -> tuple[str, str]:
    """Run the demo until the process dies after write ``writes``; its run id and the
    resume command it printed."""
    done = polyloop(
        "demo", "--pace", "0", "--store", store_spec, "--crash-after-writes", str(writes)
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr == ""
    run_id = run_id_in(done.stdout)
    assert f"simulated crash: the process ends right after store write {writes}" in done.stdout
    command = printed("resume it with: ", done.stdout)
    assert command == f"{MODULE_COMMAND} demo --resume {run_id} --store {store_spec}"
    assert "stopped:" not in done.stdout
    return run_id, command


def executions(out: str) -> list[int]:
    match = re.search(r"tool executions in this process: (\d+)(?: \(steps ([\d, ]+)\))?", out)
    assert match is not None, out
    steps = [int(s) for s in match.group(2).split(", ")] if match.group(2) else []
    assert len(steps) == int(match.group(1))
    return steps


@pytest.mark.slow
@pytest.mark.parametrize(
    ("writes", "recorded", "executed"),
    [
        (14, 3, [3, 5, 6]),  # after step 3's model-call intent: the call is made again
        (16, 3, [3, 5, 6]),  # after step 3's action intent: read_file may run again
        (23, 5, [5, 6]),  # after step 5's model result: the reply is interpreted again
        (29, 7, []),  # after the last step record: only the end record was missing
    ],
)
def test_a_crashed_demo_resumes_without_repeating_a_step(
    store_spec: str, writes: int, recorded: int, executed: list[int]
) -> None:
    run_id, command = crash(store_spec, writes)
    log, actions = read_log(store_spec, run_id)
    assert len([r for r in log.records if isinstance(r, StepRecord)]) == recorded

    done = pasted(f"{command} --pace 0")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"resuming {run_id} on {store_spec} (scripted model): {recorded} steps on record" in out
    assert out.count("(read from the log)") == recorded
    assert out.count("(ran now)") == STEPS - recorded
    assert f"{recorded} steps read back from the log (not run again)" in out
    assert executions(out) == executed
    assert "no step was repeated" in out
    assert f"stopped: submitted after {STEPS} steps" in out

    # In the log, each action result was written exactly once.
    _, actions = read_log(store_spec, run_id)
    assert actions == [f"{run_id}:{k}:action" for k in range(STEPS)]


def installed_script(tmp_path: Path) -> Path:
    """A ``.venv/bin/polyloop`` as pip writes it: a script that calls ``main``."""
    script = tmp_path / ".venv" / "bin" / "polyloop"
    script.parent.mkdir(parents=True)
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom polyloop.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return script


def crashed_demo(program: str, cwd: Path, env: dict[str, str]) -> Any:
    """``program demo`` made to crash after its 16th write; what it printed."""
    done = subprocess.run(
        [program, "demo", "--pace", "0", "--crash-after-writes", "16"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == 3, done.stderr
    return done


def test_the_demo_prints_commands_that_run_as_pasted_without_an_activated_venv(
    tmp_path: Path,
) -> None:
    # The README's set-up runs .venv/bin/polyloop, and polyloop is not on PATH.
    installed_script(tmp_path)
    done = crashed_demo(".venv/bin/polyloop", tmp_path, user_env())
    run_id = run_id_in(done.stdout)
    command = printed("resume it with: ", done.stdout)
    assert command == f".venv/bin/polyloop demo --resume {run_id}"
    resumed = pasted(f"{command} --pace 0", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "no step was repeated" in resumed.stdout
    inspect = printed("inspect it: ", resumed.stdout)
    assert inspect == f".venv/bin/polyloop show sqlite:polyloop-demo/demo.db {run_id}"
    shown = pasted(inspect, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"run {run_id}  finished" in shown.stdout


def test_the_demo_prints_the_plain_name_when_it_is_on_path(tmp_path: Path) -> None:
    # An activated environment: polyloop on PATH is the script that ran.
    script = installed_script(tmp_path)
    done = crashed_demo("polyloop", tmp_path, user_env(script.parent))
    command = printed("resume it with: ", done.stdout)
    assert command == f"polyloop demo --resume {run_id_in(done.stdout)}"


def test_a_crash_after_the_submit_intent_leaves_the_run_in_doubt(store_spec: str) -> None:
    # submit may never run twice: after its intent, nobody knows whether it ran.
    run_id, _ = crash(store_spec, 28)
    before = polyloop("runs", store_spec)
    (line,) = [line for line in before.stdout.splitlines() if run_id in line]
    assert "in doubt" in line

    done = polyloop("demo", "--resume", run_id, "--store", store_spec, "--pace", "0")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "stopped: in_doubt after 6 steps" in done.stdout
    assert f"action intent '{run_id}:6:action' has no result" in done.stdout
    assert executions(done.stdout) == []

    # Its end record is final, yet the run stays in doubt: nobody knows whether submit ran.
    runs = polyloop("runs", store_spec)
    (line,) = [line for line in runs.stdout.splitlines() if run_id in line]
    waiting = ["in", "doubt", "(waiting", "for", "a", "person)"]
    assert without_times(line).split() == [run_id, *waiting, "in_doubt", "6", "5"]


@pytest.mark.parametrize(("backend", "stop_reason"), [("asyncio", "cancelled"), ("trio", "-")])
def test_an_interrupted_demo_says_how_to_resume_it(
    tmp_path: Path, backend: str, stop_reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"jsonl:{tmp_path / 'runs'}"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polyloop",
            "--backend",
            backend,
            "demo",
            "--pace",
            "0.5",
            "--store",
            store,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=user_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert child.stdout is not None
    seen = [child.stdout.readline() for _ in range(3)]  # the header and step 0
    assert "step  0" in seen[1], seen
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    run_id = run_id_in(seen[0])
    assert (
        err == f"polyloop: interrupted\nresume it with: {MODULE_COMMAND} demo --resume {run_id} "
        f"--store {store}\n"
    )
    assert "stopped:" not in out

    assert main(["runs", store]) == 0
    line = capsys.readouterr().out.splitlines()[-1].split()
    interrupted = ["resumable", "(interrupted,", "resume", "it", "to", "go", "on)"]
    assert line[:9] == [run_id, *interrupted, stop_reason]
    assert main(demo("--store", store, "--resume", run_id, backend=backend)) == 0
    out = capsys.readouterr().out
    assert "no step was repeated" in out
    assert f"stopped: submitted after {STEPS} steps" in out


def test_resuming_a_finished_demo_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"jsonl:{tmp_path / 'runs'}"
    assert main(demo("--store", store)) == 0
    run_id = run_id_in(capsys.readouterr().out)
    assert main(demo("--store", store, "--resume", run_id)) == 0
    out = capsys.readouterr().out
    assert "the run had already finished: nothing ran" in out
    assert executions(out) == []
    assert "no step was repeated" in out


def test_resuming_with_another_model_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"jsonl:{tmp_path / 'runs'}"
    assert main(demo("--store", store, "--crash-after-writes", "99")) == 0
    run_id = run_id_in(capsys.readouterr().out)
    (path,) = (tmp_path / "runs").glob("*.jsonl")
    before = path.read_bytes()
    args = [
        "--store",
        store,
        "--resume",
        run_id,
        "--model",
        "openai",
        "--base-url",
        "http://127.0.0.1:9/v1",
        "--model-name",
        "m",
    ]
    assert main(demo(*args)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"run '{run_id}': the run was started with other parameters" in line
    assert "model.base_url" in line and "model.model" in line
    assert path.read_bytes() == before


def test_resuming_an_unknown_demo_run_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(demo("--store", f"jsonl:{tmp_path}", "--resume", "demo-nothere")) == 1
    captured = capsys.readouterr()
    assert (
        one_error_line(captured.err)
        == f"polyloop: error: unknown run id 'demo-nothere' in jsonl:{tmp_path}"
    )


@pytest.mark.parametrize(
    ("store", "problem"),
    [
        (
            "jsonl:{tmp}/file/runs",
            "cannot create the directory {tmp}/file/runs: {tmp}/file is a file",
        ),
        ("jsonl:{tmp}/file", "{tmp}/file is a file, not a directory of JSONL run logs"),
        ("sqlite:{tmp}/file/runs.db", "{tmp}/file is a file, not a directory"),
        ("sqlite:{tmp}", "{tmp} is a directory, not a SQLite database file"),
    ],
)
def test_a_demo_store_that_cannot_be_opened_is_blamed_not_the_run(
    tmp_path: Path, store: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("in the way")
    store = store.format(tmp=tmp_path)
    assert main(demo("--store", store)) == 1
    captured = capsys.readouterr()
    line = one_error_line(captured.err)
    # The store by its path and that it could not be opened; no run is blamed, none began.
    assert line.startswith(f"polyloop: error: cannot open the store {store}: ")
    assert problem.format(tmp=tmp_path) in line
    assert "run '" not in line and "demo run" not in captured.out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_a_demo_store_in_a_directory_without_write_permission_is_blamed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert main(demo("--store", f"jsonl:{locked}/runs")) == 1
    finally:
        locked.chmod(0o755)
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"polyloop: error: cannot open the store jsonl:{locked}/runs: ")
    assert str(locked / "runs") in line and "run '" not in line


# -- a real OpenAI-compatible server ----------------------------------------------------------


@pytest.fixture
def chat_server() -> Iterator[ChatServer]:
    server = ChatServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


def model_turns(data: dict[str, str]) -> list[str]:
    """What a chatty model might say: prose, fenced blocks, bare objects, one slip."""
    expression = " + ".join(str(n) for text in data.values() for n in units(text))
    return [
        'I will look at the files first. {"tool": "list_files", "arguments": {}}',
        "Hmm, let me think about this.",  # no decision at all: fed back as a correction
        *(
            f'```json\n{{"tool": "read_file", "arguments": {{"name": "{name}"}}}}\n```'
            for name in data
        ),
        f'Sum: ```json\n{{"tool": "calculator", "arguments": {{"expression": "{expression}"}}}}'
        "\n```",
        f'Done. {{"tool": "submit", "arguments": {{"total": {TOTAL}}}}}',
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_demo_runs_on_an_openai_compatible_server(
    chat_server: ChatServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    turns = model_turns(load_data())

    def respond(body: dict[str, Any]) -> Reply:
        answered = sum(1 for m in body["messages"] if m["role"] == "assistant")
        return Reply(content=turns[answered], id=f"chatcmpl-{answered}")

    chat_server.responder = respond
    store = f"jsonl:{tmp_path / 'runs'}"
    args = [
        "--store",
        store,
        "--model",
        "openai",
        "--base-url",
        chat_server.base_url,
        "--model-name",
        "local-model",
        "--api-key",
        "k",
    ]
    assert main(demo(*args, backend=backend)) == 0
    out = capsys.readouterr().out
    assert "(model local-model)" in out
    assert "invalid reply" in out
    assert f"stopped: submitted after {len(turns)} steps" in out
    assert f"Submitted total {TOTAL} (correct)." in out

    assert len(chat_server.requests) == len(turns)
    first = chat_server.requests[0]
    assert first["model"] == "local-model"
    assert first["temperature"] == 0
    system = "\n".join(m["content"] for m in first["messages"] if m["role"] == "system")
    assert '{"tool": "<tool name>", "arguments": {...}}' in system
    for tool in ("list_files", "read_file", "calculator", "submit"):
        assert f'"name":"{tool}"' in system.replace(" ", "")
    # The correction the interpreter fed back reached the model.
    third = chat_server.requests[2]["messages"]
    assert "held no usable decision" in third[-1]["content"]


def test_a_model_server_that_fails_ends_the_demo_with_a_model_failure(
    chat_server: ChatServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The server answers every request with an error: the run stops, the command does not.
    args = [
        "--store",
        f"jsonl:{tmp_path}",
        "--model",
        "openai",
        "--base-url",
        chat_server.base_url,
        "--model-name",
        "m",
    ]
    assert main(demo(*args)) == 2
    out = capsys.readouterr().out
    assert "stopped: model_failure after 1 steps" in out
    assert "InternalServerError" in out or "APIStatusError" in out


def test_the_resume_command_names_the_same_store_and_model() -> None:
    options = DemoOptions(
        run_id="demo-1",
        store=parse_store("jsonl:my runs"),
        store_given=True,
        resume=None,
        crash_after_writes=5,
        model="openai",
        base_url="http://h:1/v1",
        model_name="m x",
        api_key="secret",
        pace=0.0,
    )
    command = resume_command(options, "demo-1")
    assert command == (
        "polyloop demo --resume demo-1 --store 'jsonl:my runs' --model openai "
        "--base-url http://h:1/v1 --model-name 'm x'"
    )
    assert "secret" not in command


# -- the interpreter and the tools ------------------------------------------------------------


def decide(text: str) -> Any:
    return TextToolInterpreter().interpret(ModelReply(call_id=None, content=text, reasoning=None))


def test_the_interpreter_reads_fenced_blocks_bare_objects_and_answers() -> None:
    action = decide(
        'Plan: {not json}. ```json\n{"tool": "read_file", "arguments": {"name": "a.csv"}}\n```'
    )
    assert isinstance(action, Action)
    assert action.payload == {"name": "read_file", "arguments": {"name": "a.csv"}}
    assert action.action_text == 'read_file({"name": "a.csv"})'
    bare = decide('first {"x": 1} is not a call')
    assert isinstance(bare, InvalidDecision)
    assert "held no usable decision" in bare.feedback
    answer = decide('The answer: {"answer": "660"}')
    assert isinstance(answer, FinalAnswer)
    assert answer.answer == "660"
    assert isinstance(decide("no braces at all"), InvalidDecision)
    assert find_object('```\n[1, 2]\n``` then {"tool": "t"}') == {"tool": "t"}


def test_the_calculator_evaluates_arithmetic_and_nothing_else() -> None:
    assert evaluate("1 + 2 * (3 - 1) / 4") == 2.0
    assert evaluate("-5 + +2") == -3
    for bad in ("__import__('os')", "2 ** 8", "x + 1", "1 +", "True + 1"):
        with pytest.raises(ValueError, match=r"unsupported|not an arithmetic"):
            evaluate(bad)


def test_the_scripted_model_follows_the_bundled_data() -> None:
    data = load_data()
    assert list(data) == ["east.csv", "north.csv", "south.csv"]
    replies = script(data)
    assert len(replies) == STEPS
    assert sum(sum(units(text)) for text in data.values()) == TOTAL
    decisions = [decide(reply) for reply in replies]
    assert all(isinstance(d, Action) for d in decisions)
    names = [d.payload["name"] for d in decisions]
    assert names == [
        "list_files",
        "read_file",
        "read_file",
        "read_file",
        "calculator",
        "calculator",
        "submit",
    ]
    tools = build_tools(data, Ledger())
    assert tools.validate("calculator", decisions[4].payload["arguments"]) is not None
    assert tools.validate("calculator", decisions[5].payload["arguments"]) is None
    assert tools.marks_completion("submit")


# -- the command line itself -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["runs", "ftp:x"], "unknown store scheme in 'ftp:x'"),
        (["runs", "mysql://u:pw@h/db"], "unknown store scheme in 'mysql://u:***@h/db'"),
        (["runs", "sqlite:"], "names no file"),
        (["demo", "--crash-after-writes", "0"], "at least 1"),
        (["demo", "--pace", "fast"], "expected seconds"),
        (["demo", "--model", "openai"], "--model openai needs --base-url and --model-name"),
        (["demo", "--model-name", "m"], "--model-name: only with --model openai"),
        (["show", "jsonl:x", "r", "--json", "--html", "f"], "not allowed with argument"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_usage_errors_are_one_line_and_status_1(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert message in one_error_line(captured.err)
    assert captured.out == ""


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "runs", "show", "verify"):
        assert command in out
    assert main(["demo", "--help"]) == 0
    assert "--crash-after-writes" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["runs", "gopher:x"], "polyloop: error: argument STORE: unknown store scheme"),
        (
            ["runs", "sqlite:missing.db"],
            "polyloop: error: no SQLite store at missing.db: the file does not exist",
        ),
        (
            ["verify", "jsonl:missing"],
            "polyloop: error: no JSONL store at missing: the directory does not exist",
        ),
        (["show", "jsonl:.", "nobody"], "polyloop: error: unknown run id 'nobody' in jsonl:."),
    ],
)
def test_errors_from_a_real_process_are_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = polyloop(*args, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert one_error_line(done.stderr).startswith(message)
    assert not (tmp_path / "missing.db").exists()
    assert not (tmp_path / "missing").exists()


def test_without_rich_the_command_says_which_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['rich'] = None; from polyloop.cli import main; "
        "sys.exit(main(['runs', 'jsonl:.']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "pip install -e '.[cli]'" in one_error_line(done.stderr)


def test_without_rich_serve_names_the_one_extra_it_needs() -> None:
    # The web extra holds rich as well, so serve asks for it alone, not cli and then web.
    code = (
        "import sys; sys.modules['rich'] = None; from polyloop.cli import main; "
        "sys.exit(main(['serve', 'jsonl:.']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "pip install -e '.[web]'" in one_error_line(done.stderr)
    web = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "web"
    ]
    assert any(requirement.startswith("rich") for requirement in web)


def test_without_trio_the_trio_backend_says_which_extra_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['trio'] = None; from polyloop.cli import main; "
        f"sys.exit(main(['--backend', 'trio', 'runs', 'jsonl:{tmp_path}']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "pip install -e '.[trio]'" in one_error_line(done.stderr)


def test_the_console_script_is_installed() -> None:
    script_path = Path(sys.executable).parent / "polyloop"
    assert script_path.exists()
    done = subprocess.run([str(script_path), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "usage: polyloop" in done.stdout


def test_the_demo_shows_a_lone_surrogate_from_the_model_escaped(
    chat_server: ChatServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server sends half an emoji as a JSON escape; the reply decodes to a lone surrogate.
    chat_server.responder = lambda body: Reply(content=f'{{"answer": "done {HALF}"}}')
    args = ["--store", f"jsonl:{tmp_path}", "--model", "openai"]
    args += ["--base-url", chat_server.base_url, "--model-name", "m", "--api-key", "k"]
    output = StrictOutput(monkeypatch)
    assert main(demo(*args)) == 0
    out, err = output.read()
    assert f"→ done {SHOWN}" in out and f"answer: done {SHOWN}" in out
    assert "stopped: final_answer after 1 steps" in out
    assert err == ""


def test_a_block_keeps_its_lines_and_tabs_and_escapes_the_rest() -> None:
    text = "one\n\ttwo\r\x1b[31m\u202eok\u2028"
    assert escape_block(text) == "one\n\ttwo\\r\\x1b[31m\\u202eok\\u2028"
    assert escape_field(text) == "one\\n\\ttwo\\r\\x1b[31m\\u202eok\\u2028"


@pytest.mark.parametrize(
    ("raised", "status"),
    [
        (BaseExceptionGroup("served", [KeyboardInterrupt()]), 130),
        (BaseExceptionGroup("served", [BaseExceptionGroup("c", [KeyboardInterrupt()])]), 130),
        (BaseExceptionGroup("served", [KeyboardInterrupt(), SystemExit(3)]), None),
    ],
)
def test_ctrl_c_inside_a_task_group_is_an_interruption(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    raised: BaseException,
    status: int | None,
) -> None:
    """A server's task group wraps the KeyboardInterrupt that landed in one of its
    connections; the command still ends as interrupted, and nothing else is hidden."""
    import polyloop.cli._app as app

    def interrupted(*args: Any, **kwargs: Any) -> int:
        raise raised

    monkeypatch.setattr(app.anyio, "run", interrupted)
    if status is None:
        with pytest.raises(BaseExceptionGroup):
            main(["runs", f"sqlite:{tmp_path / 'runs.db'}"])
        return
    assert main(["runs", f"sqlite:{tmp_path / 'runs.db'}"]) == status
    assert capsys.readouterr().err == "polyloop: interrupted\n"
