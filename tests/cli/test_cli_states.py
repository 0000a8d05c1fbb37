"""The command line tells apart why a run nobody drives goes on, and who takes it: ``runs``
(text and ``--json``), ``pending``, ``show`` and what an answer says next.

One SQLite store holds a run in each state, left the way it happens: started through an
agent, answered, killed inside a tool with a probe or without one, killed between
steps, and a run started without an agent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import definition, request
from kit.hosting import SCRIPT, Till, payer, tools
from polyloop import approve, run
from polyloop.cli import main
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash

# Writes before the kill: inside pay (its intent is the fourth), or after its step.
INSIDE_PAY, BETWEEN_STEPS = 4, 5

# Each run's state as `polyloop runs` prints it: the SPEC's word first, then the detail.
STATES = {
    "new": "resumable (not yet driven, waiting for a worker)",
    "approved": "resumable (approved, waiting for a worker)",
    "asking": "awaiting approval",
    "probe": "in doubt (its tool's probe will settle it, waiting for a worker)",
    "doubt": "in doubt (waiting for a person)",
    "crashed": "resumable (interrupted, waiting for a worker)",
    "plain": "resumable (interrupted, resume it to go on)",
    "done": "finished",
}


async def _killed(store: Any, run_id: str, after: int, **options: Any) -> None:
    with pytest.raises(SimulatedCrash):
        await payer(FaultyStore(store, fail_after_writes=after), Till(), **options).run(run_id, {})


async def _fill(path: Path) -> None:
    async with SqliteStore(path) as store:
        till = Till()
        await payer(store, till).start("new", {})
        asking = payer(store, till, needs_approval=True)
        await asking.run("approved", {})
        await approve(store, "approved", by="ann")
        await asking.run("asking", {})
        await _killed(store, "probe", INSIDE_PAY, probe=True)
        await _killed(store, "doubt", INSIDE_PAY)
        await _killed(store, "crashed", BETWEEN_STEPS)
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=BETWEEN_STEPS), script=SCRIPT),
                request("plain", tools(till)),
            )
        await payer(store, till).run("done", {})


@pytest.fixture
def states(tmp_path: Path) -> str:
    anyio.run(_fill, tmp_path / "runs.db")
    return f"sqlite:{tmp_path / 'runs.db'}"


def _rows(out: str) -> dict[str, str]:
    """Each run's line of the table, its cells joined by single spaces."""
    return {
        line.split()[0]: " ".join(line.split())
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in STATES
    }


def test_runs_prints_each_state_with_why_it_goes_on_and_who_takes_it(
    states: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", states]) == 0
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == set(STATES)
    for run_id, state in STATES.items():
        assert rows[run_id].startswith(f"{run_id} {state} "), rows[run_id]


def test_runs_json_keeps_the_word_and_adds_why_and_the_agent(
    states: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["runs", states, "--json"]) == 0
    lines = {d["run_id"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    # Scripts that read the word keep working: it is still one of the SPEC's words.
    assert {run_id: line["state"] for run_id, line in lines.items()} == {
        run_id: state.split(" (")[0] for run_id, state in STATES.items()
    }
    assert {run_id: line["ready"] for run_id, line in lines.items()} == {
        "new": "new",
        "approved": "approved",
        "asking": None,
        "probe": "probe",
        "doubt": None,
        "crashed": "interrupted",
        "plain": "interrupted",
        "done": None,
    }
    assert {run_id for run_id, line in lines.items() if line["agent"] == "payer"} == (
        set(STATES) - {"plain"}
    )
    assert lines["plain"]["agent"] is None


def test_pending_marks_the_doubt_a_probe_will_settle(
    states: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pending", states]) == 0
    out = capsys.readouterr().out
    assert 'doubt  in doubt  doubt:0:action  pay({"n": 2})' in out
    assert (
        "probe  in doubt (its tool's probe will settle it, waiting for a worker)  "
        'probe:0:action  pay({"n": 2})'
    ) in out
    assert 'asking  awaiting approval  asking:0:action  pay({"n": 2})' in out
    for ready in ("new", "approved", "crashed", "plain", "done"):
        assert f"\n{ready}  " not in f"\n{out}"  # nothing of theirs waits for a person
    assert main(["pending", states, "--json"]) == 0
    lines = {d["run_id"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {run_id: line["ready"] for run_id, line in lines.items()} == {
        "asking": None,
        "probe": "probe",
        "doubt": None,
    }


def test_show_says_who_goes_on(states: str, capsys: pytest.CaptureFixture[str]) -> None:
    worker = "a worker hosting agent 'payer' goes on (or resume)"
    shown = {
        "approved": f"resumable: approved; {worker}",
        "new": f"resumable: not yet driven; {worker}",
        "crashed": f"resumable: not finished; {worker}",
        "plain": "resumable: not finished; resume goes on",
        "probe": (
            "in doubt: an effect may or may not have happened, and its tool's probe will "
            f"settle it; {worker}"
        ),
        "asking": (
            "awaiting approval: nothing ran; polyloop approve or reject, then a worker "
            "hosting agent 'payer'"
        ),
    }
    for run_id, state in shown.items():
        assert main(["show", states, run_id]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"state {state}" in out, out
    assert main(["show", states, "probe"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "is never replayed: its tool's probe will settle it when the run is driven" in out
    assert main(["show", states, "probe", "--json"]) == 0
    shown_json = json.loads(capsys.readouterr().out)
    assert (shown_json["ready"], shown_json["agent"]) == ("probe", "payer")
    assert shown_json["in_doubt"]["probe_will_settle"] is True


def test_an_answer_says_a_worker_goes_on_with_a_run_of_an_agent(
    states: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["approve", states, "asking", "--by", "ann"]) == 0
    assert capsys.readouterr().out == (
        "approved asking:0:action (by ann); a worker hosting agent 'payer' goes on with run "
        "'asking' (or resume it)\n"
    )
    assert main(["settle", states, "doubt", "--by", "cy", "--ran", "--observation", "ok"]) == 0
    assert capsys.readouterr().out.endswith(
        "; a worker hosting agent 'payer' goes on with run 'doubt' (or resume it)\n"
    )
    assert main(["runs", states]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["asking"].startswith("asking resumable (approved, waiting for a worker) ")
    assert rows["doubt"].startswith("doubt resumable (settled, waiting for a worker) ")
