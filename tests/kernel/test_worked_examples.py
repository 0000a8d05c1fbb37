"""The worked examples run as programs and keep the promises their documentation makes.

Each example is started as a subprocess, as a reader would start it, and its printed
outcome is checked. The PostgreSQL example runs against a fresh database from the
server that ``kit/pg.py`` finds; under ``CI=true`` it fails, never skips, when there is none.
The code-as-action executor is also exercised directly, for the cases the example's
script does not reach (a missing interpreter, a payload without code, a killed child).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kit import pg
from polyloop import Action, ActionStatus, Replay

# Slow: the worked examples run as programs of their own.
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# pytest-postgresql's throw-away server, started only if no configured server answers.
pg_fallback_proc = pg.fallback_server()


def _run(
    script: str,
    *args: str,
    cwd: Path | None = None,
    status: int = 0,
    env: dict[str, str] | None = None,
) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env=env,
    )
    assert done.returncode == status, (
        f"{script} {' '.join(args)} exited {done.returncode}\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done.stdout


# -- 1. sqlite_script.py ------------------------------------------------------------------

SQLITE_STEPS = [
    '  step 0: multiply({"a": 7, "b": 24}) -> 168',
    '  step 1: multiply({"a": 168, "b": 60}) -> 10080',
    '  step 2: multiply({"a": 10080, "b": 3}) -> 30240',
    '  step 3: submit({"answer": 30240}) -> accepted 30240',
]


def test_sqlite_script_runs_then_returns_the_recorded_run(tmp_path: Path) -> None:
    # By default the database goes to the temporary directory, never the working one.
    checkout, temporary = tmp_path / "checkout", tmp_path / "tmp"
    checkout.mkdir()
    temporary.mkdir()
    env = {**os.environ, "TMPDIR": str(temporary)}
    first = _run("sqlite_script.py", cwd=checkout, env=env)
    assert first.splitlines() == [
        f"run 'minutes-in-three-weeks' in {temporary / 'polyloop-example.db'}",
        *SQLITE_STEPS,
        "stop reason: submitted after 4 steps (new run)",
        "submissions of this run on file: 1",
    ]
    assert (temporary / "polyloop-example.db").is_file()
    assert list(checkout.iterdir()) == []

    again = _run("sqlite_script.py", cwd=checkout, env=env)
    assert "the store already holds this run (steps on record: 4); resuming" in again
    assert "stop reason: submitted after 4 steps (continued from the log)" in again
    # The finished run was handed back from the log: nothing was submitted again.
    assert "submissions of this run on file: 1" in again


def test_sqlite_script_dies_mid_run_and_the_next_start_finishes_it(tmp_path: Path) -> None:
    db = str(tmp_path / "runs.db")
    crashed = _run(
        "sqlite_script.py", "--db", db, "--run-id", "r2", "--crash-after-writes", "6", status=3
    )
    assert "the process dies after store write 6" in crashed
    assert "stop reason" not in crashed

    resumed = _run("sqlite_script.py", "--db", db, "--run-id", "r2")
    assert "the store already holds this run (steps on record: 1); resuming" in resumed
    assert all(line in resumed.splitlines() for line in SQLITE_STEPS)
    assert "stop reason: submitted after 4 steps (continued from the log)" in resumed
    assert "submissions of this run on file: 1" in resumed


def test_sqlite_script_never_submits_twice_after_a_crash_inside_submit(
    tmp_path: Path,
) -> None:
    # Write 16 is the submit action's intent: the process dies before its result lands.
    db = str(tmp_path / "runs.db")
    _run("sqlite_script.py", "--db", db, "--run-id", "r3", "--crash-after-writes", "16", status=3)
    submissions = Path(f"{db}.submissions.txt")
    assert submissions.read_text().splitlines() == ["r3:3:action 30240"]

    resumed = _run("sqlite_script.py", "--db", db, "--run-id", "r3")
    assert "the store already holds this run (steps on record: 3); resuming" in resumed
    assert "stop reason: in_doubt after 3 steps (continued from the log)" in resumed
    assert "submissions of this run on file: 1" in resumed
    assert submissions.read_text().splitlines() == ["r3:3:action 30240"]


# -- 2. trio_experiment.py ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_trio_experiment_runs_candidates_concurrently_and_picks_the_best(
    tmp_path: Path, backend: str
) -> None:
    out = _run("trio_experiment.py", "--dir", str(tmp_path / "logs"), "--backend", backend)
    lines = out.splitlines()
    header = re.fullmatch(
        rf"4 candidate runs under {backend}, one shared model client: 13 calls, "
        r"up to (\d+) in flight at once",
        lines[0],
    )
    assert header is not None, lines[0]
    assert int(header.group(1)) >= 2, "the candidate runs did not overlap"
    rows = [line.split() for line in lines[2:6]]
    assert rows == [
        ["baseline", "submitted", "5", "169", "yes"],
        ["batch", "submitted", "3", "169", "yes"],
        ["double-check", "submitted", "4", "169", "yes"],
        ["guess", "submitted", "1", "361", "no"],
    ]
    assert lines[6] == "best: batch (correct in 3 steps)"
    # One JSON-lines log per candidate.
    assert len(list((tmp_path / "logs").glob("*.jsonl"))) == 4


def test_trio_experiment_defaults_to_trio_and_a_temporary_directory(tmp_path: Path) -> None:
    out = _run("trio_experiment.py", cwd=tmp_path)
    assert out.startswith("4 candidate runs under trio,")
    assert "best: batch (correct in 3 steps)" in out
    assert list(tmp_path.iterdir()) == []


# -- 3. asyncio_postgres_app.py -----------------------------------------------------------


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> str:
    return pg.server_conninfo(request, "pg_fallback_proc")


@pytest.fixture
def pg_database(pg_server: str) -> Iterator[str]:
    with pg.fresh_database(pg_server) as conninfo:
        yield conninfo


def _check_postgres_app(out: str) -> str:
    lines = out.splitlines()
    batch = re.fullmatch(
        r"batch (capitals-[0-9a-f]{8}): asyncio workers, PostgreSQL store", lines[0]
    )
    assert batch is not None, lines[0]
    assert lines[1:] == [
        "  France: submitted 'Paris' in 2 steps, lookups 1, resumed False",
        "  Japan: submitted 'Tokyo' in 2 steps, lookups 1, resumed False",
        "  Kenya: submitted 'Nairobi' in 2 steps, lookups 1, resumed False",
        "  Peru: the worker died after store write 5",
        "  Peru: resumable, 1 step on record, nobody drives it",
        "  Peru: taken over by another store object: submitted 'Lima' in 2 steps, "
        "lookups 1, resumed True",
    ]
    return batch.group(1)


def test_asyncio_postgres_app_runs_repeatedly_against_one_database(pg_database: str) -> None:
    first = _check_postgres_app(_run("asyncio_postgres_app.py", "--conninfo", pg_database))
    # The second time the connection string comes from the environment; new run ids
    # mean nothing collides with the first batch.
    env = {**os.environ, "POLYLOOP_TEST_POSTGRES": pg_database}
    second = _check_postgres_app(_run("asyncio_postgres_app.py", env=env))
    assert first != second
    with pg.admin(pg_database) as conn:
        runs = conn.execute("SELECT count(DISTINCT run_key) FROM polyloop.records").fetchone()
    assert runs == (8,)


# -- 4. code_as_action.py -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_code_as_action_ends_when_the_environment_says_done(backend: str) -> None:
    out = _run("code_as_action.py", "--time-limit", "1", "--backend", backend)
    assert out.splitlines() == [
        "  step 0 [executed] done=False: Let me look at the data first.",
        "      -> region,units | north,120 | north,80 | south,45 | south,55 | south,100",
        "  step 1 [executed, synthesized] done=False: "
        "I'll wait for the nightly export to land before summing.",
        "      -> TimeoutError: the code ran for more than 1 s and was stopped",
        "  step 2 [executed] done=False: No export then. Summing the amounts.",
        "      -> ... KeyError: 'amount'",
        "  step 3 [invalid] done=False: The total is 400, so I am done.",
        "      -> Your reply holds no code block. Reply with exactly one ```python block "
        "holding the code to run, at the end of your reply (text before the block is fine). "
        "No reply ends the task: the environment says when it is done.",
        "  step 4 [executed] done=True: The column is 'units'. Writing the answer file.",
        "      -> wrote 400",
        "stop reason: env_done after 5 steps (4 valid)",
        "answer.txt holds: 400",
    ]


@pytest.fixture(scope="module")
def code_as_action() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "code_as_action_example", EXAMPLES / "code_as_action.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code(source: str) -> Action:
    return Action(payload={"code": source}, action_text=source, history_text=source)


@pytest.mark.anyio
async def test_code_as_action_kills_a_snippet_at_its_time_limit(
    code_as_action: ModuleType, tmp_path: Path
) -> None:
    executor = code_as_action.SubprocessPythonExecutor(tmp_path, time_limit=0.5)
    snippet = (
        "import os, time\nopen('pid', 'w').write(str(os.getpid()))\n"
        "while True:\n    time.sleep(0.05)\n"
    )
    outcome = await executor.execute(_code(snippet), result_id="r:0:action")
    assert outcome.status is ActionStatus.EXECUTED
    assert outcome.synthesized is True
    assert outcome.observation.startswith("TimeoutError: ")
    assert outcome.done is False
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child is gone (and reaped), not left running


@pytest.mark.anyio
async def test_code_as_action_reports_output_exit_status_and_done(
    code_as_action: ModuleType, tmp_path: Path
) -> None:
    executor = code_as_action.SubprocessPythonExecutor(tmp_path, time_limit=10)
    failing = await executor.execute(
        _code("print('hi')\nraise SystemExit(4)\n"), result_id="r:0:action"
    )
    assert failing.status is ActionStatus.EXECUTED
    assert failing.synthesized is False
    assert failing.observation == "[exit status 4]\nhi\n"
    assert failing.done is False
    solved = await executor.execute(
        _code("open('answer.txt', 'w').write('400')\n"), result_id="r:1:action"
    )
    assert (solved.status, solved.observation, solved.done) == (
        ActionStatus.EXECUTED,
        "(no output)\n",
        True,
    )
    assert executor.replay(_code("")) is Replay.NEVER


@pytest.mark.anyio
async def test_code_as_action_cannot_start_python_is_an_environment_fault(
    code_as_action: ModuleType, tmp_path: Path
) -> None:
    executor = code_as_action.SubprocessPythonExecutor(
        tmp_path, time_limit=10, python=str(tmp_path / "no-such-python")
    )
    outcome = await executor.execute(_code("print(1)\n"), result_id="r:0:action")
    assert outcome.status is ActionStatus.ENV_FAULT
    assert outcome.observation.startswith("could not start Python: ")


@pytest.mark.anyio
async def test_code_as_action_payload_without_code_is_not_executed(
    code_as_action: ModuleType, tmp_path: Path
) -> None:
    executor = code_as_action.SubprocessPythonExecutor(tmp_path, time_limit=10)
    action = Action(payload={"name": "x"}, action_text="x", history_text="x")
    outcome = await executor.execute(action, result_id="r:0:action")
    assert (outcome.status, outcome.observation) == (
        ActionStatus.NOT_EXECUTED,
        "the action holds no code",
    )
