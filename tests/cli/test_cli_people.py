"""``polyloop pending``, ``approve``, ``reject`` and ``settle``: what they print, and that
bad input is one line on stderr, exit status 1, and nothing written."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import surrogate as surrogate_kit
from kit.agent import Ledger, definition, request
from kit.review import approval_script, payment_script, review_tools
from kit.surrogate import HALF, SHOWN, StrictOutput
from polyloop import Replay, run, start_or_resume
from polyloop.cli import main
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.testing import FaultyStore, SimulatedCrash

# A reviewer adds a line above the key they mean to replace: JSON readers would keep the
# last value, and the proposal would be approved unchanged.
EDITED_ABOVE = '{\n  "env": "staging",\n  "env": "prod"\n}'


async def _fill(store: Any) -> None:
    """``paused`` waits for approval of a deploy; ``doubt`` is in doubt about a payment."""
    async with store:
        tools = review_tools(Ledger())
        await run(definition(store, script=approval_script()), request("paused", tools))
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=8), script=payment_script()),
                request("doubt", tools, model_replay=Replay.ALLOWED),
            )
        await start_or_resume(
            definition(store, script=payment_script()),
            request("doubt", tools, model_replay=Replay.ALLOWED),
        )


async def _log(store: Any, run_id: str) -> tuple[Any, ...]:
    async with store:
        return (await store.read_log(run_id)).records


@pytest.fixture(scope="module")
def filled_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of :func:`_fill` in a SQLite store, written once for the module; each test
    gets a copy of its own (:func:`sqlite`)."""
    place = tmp_path_factory.mktemp("filled")
    anyio.run(_fill, SqliteStore(place / "runs.db"))
    return place


@pytest.fixture
def sqlite(filled_once: Path, tmp_path: Path) -> str:
    shutil.copytree(filled_once, tmp_path, dirs_exist_ok=True)
    return f"sqlite:{tmp_path / 'runs.db'}"


def _records(spec: str, run_id: str) -> tuple[Any, ...]:
    return anyio.run(_log, SqliteStore(spec.removeprefix("sqlite:")), run_id)


def test_pending_lists_approvals_and_doubts(
    sqlite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pending", sqlite]) == 0
    out = capsys.readouterr().out
    assert 'paused  awaiting approval  paused:1:action  deploy({"env": "prod"})' in out
    assert "Deploy the build to an environment." in out
    assert 'doubt  in doubt  doubt:1:action  pay({"n": 5})' in out
    assert main(["pending", sqlite, "--json"]) == 0
    lines = {d["run_id"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert lines["paused"]["state"] == "awaiting_approval"
    assert lines["paused"]["proposal"]["payload"]["name"] == "deploy"
    assert lines["doubt"]["open_intent"]["result_id"] == "doubt:1:action"
    assert main(["runs", sqlite]) == 0
    assert "awaiting approval" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["approve", "{store}", "paused", "--by", "a", "--arguments", "[1]"], "JSON object"),
        (["approve", "{store}", "paused", "--by", "a", "--arguments", "{x"], "not JSON"),
        (["approve", "{store}", "paused", "--by", "a", "--arguments", '{"env": 1}'], "schema"),
        (["approve", "{store}", "paused", "--by", " "], "by must be a non-empty"),
        (["approve", "{store}", "doubt", "--by", "a"], "waits for no approval"),
        (["approve", "{store}", "nobody", "--by", "a"], "no record of this run"),
        (["reject", "{store}", "paused", "--by", "a"], "--reason"),
        (["settle", "{store}", "paused", "--by", "a", "--ran", "--observation", "x"], "doubt"),
        (["settle", "{store}", "doubt", "--by", "a", "--ran"], "--observation"),
        (["settle", "{store}", "doubt", "--by", "a", "--did-not-run"], "--reason"),
        (["settle", "{store}", "doubt", "--by", "a", "--ran", "--did-not-run"], "not allowed"),
        (
            ["approve", "{store}", "paused", "--by", "a", "--result-id", "paused:0:action"],
            "the open proposal is 'paused:1:action', not 'paused:0:action'",
        ),
        (
            ["reject", "{store}", "paused", "--by", "a", "--reason", "x", "--result-id", "p:1"],
            "not 'p:1'",
        ),
        (
            ["approve", "{store}", "paused", "--by", "a", "--result-id", "doubt:1:action"],
            "not 'doubt:1:action'",
        ),
        (
            ["approve", "{store}", "paused", "--by", "a", "--arguments", EDITED_ABOVE],
            "--arguments: the arguments name the key 'env' twice in one object",
        ),
        (
            ["approve", "{store}", "paused", "--by", "a", "--arguments", '{"a": {"b": 1, "b": 1}}'],
            "the key 'b' twice",
        ),
        (
            [
                "settle",
                "{store}",
                "doubt",
                "--by",
                "a",
                "--did-not-run",
                "--reason",
                "x",
                "--result-id",
                "paused:1:action",
            ],
            "the effect in doubt is 'doubt:1:action', not 'paused:1:action'",
        ),
        (
            [
                "settle",
                "{store}",
                "doubt",
                "--by",
                "a",
                "--ran",
                "--observation",
                "x",
                "--intent",
                "doubt:0:action",
            ],
            "not 'doubt:0:action'",
        ),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    sqlite: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {run_id: _records(sqlite, run_id) for run_id in ("paused", "doubt")}
    assert main([part.replace("{store}", sqlite) for part in argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert {run_id: _records(sqlite, run_id) for run_id in ("paused", "doubt")} == before


def test_answers_are_written_once(sqlite: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["approve", sqlite, "paused", "--by", "alice", "--arguments", '{"env": "staging"}']
    assert main(argv) == 0
    assert "approved paused:1:action (by alice)" in capsys.readouterr().out
    assert main(["reject", sqlite, "paused", "--by", "bob", "--reason", "no"]) == 1
    assert "already approved by 'alice'" in capsys.readouterr().err
    argv = ["settle", sqlite, "doubt", "--by", "carol", "--did-not-run", "--reason", "declined"]
    assert main(argv) == 0
    assert "settled doubt:1:action: did not run (by carol)" in capsys.readouterr().out
    assert main(["pending", sqlite]) == 0
    assert "nothing waits for a person" in capsys.readouterr().out


def test_pending_on_a_jsonl_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(_fill, JsonlStore(tmp_path / "runs"))
    assert main(["pending", f"jsonl:{tmp_path / 'runs'}"]) == 0
    out = capsys.readouterr().out
    assert "paused  awaiting approval" in out and "doubt  in doubt" in out


async def _resume_paused(path: Path) -> None:
    async with SqliteStore(path) as store:
        tools = review_tools(Ledger())
        await start_or_resume(definition(store, script=approval_script()), request("paused", tools))


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ([], None),
        (["--arguments", '{"env": "prod"}'], None),
        (["--arguments", '{"env": "staging"}'], '{"env": "staging"}'),
    ],
)
def test_show_mentions_the_arguments_of_an_approval_only_when_a_person_edited_them(
    sqlite: str, given: list[str], said: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["approve", sqlite, "paused", "--by", "alice", *given]) == 0
    anyio.run(_resume_paused, Path(sqlite.removeprefix("sqlite:")))
    capsys.readouterr()
    assert main(["show", sqlite, "paused"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "approved by alice" in out
    assert ("with arguments" in out) is (said is not None)
    if said is not None:
        assert f"with arguments {said}" in out
        assert 'edited by alice before it ran; the model proposed deploy({"env": "prod"})' in out


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_pending_and_approve_escape_a_lone_surrogate(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proposal's argument holds a lone surrogate, and so does the name of who
    approves it (an argument of bytes that are not UTF-8 arrives as surrogates)."""
    store = SqliteStore(tmp_path / "runs.db") if kind == "sqlite" else JsonlStore(tmp_path)
    spec = f"sqlite:{tmp_path / 'runs.db'}" if kind == "sqlite" else f"jsonl:{tmp_path}"
    anyio.run(surrogate_kit.fill, store)
    output = StrictOutput(monkeypatch)
    assert main(["pending", spec]) == 0
    out, err = output.read()
    assert f'ask  awaiting approval  ask:0:action  send({{"answer": "hi {SHOWN}"}})' in out
    assert err == ""
    assert main(["pending", spec, "--json"]) == 0
    (line,) = output.read()[0].splitlines()
    assert json.loads(line)["proposal"]["payload"]["arguments"] == {"answer": f"hi {HALF}"}
    assert main(["approve", spec, "ask", "--by", "al\udcffce"]) == 0
    assert output.read() == (
        "approved ask:0:action (by al\\udcffce); resume run 'ask' to go on\n",
        "",
    )


async def _resume_doubt(path: Path) -> None:
    async with SqliteStore(path) as store:
        tools = review_tools(Ledger())
        await start_or_resume(
            definition(store, script=payment_script()),
            request("doubt", tools, model_replay=Replay.ALLOWED),
        )


@pytest.mark.parametrize(
    ("how", "said"),
    [
        (["--ran", "--observation", "paid"], "ran"),
        (["--did-not-run", "--reason", "declined"], "did not run"),
    ],
)
def test_show_and_html_say_how_a_settled_step_ended_and_that_its_time_is_unknown(
    sqlite: str, how: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["settle", sqlite, "doubt", "--by", "carol", *how]) == 0
    anyio.run(_resume_doubt, Path(sqlite.removeprefix("sqlite:")))
    capsys.readouterr()
    assert main(["show", sqlite, "doubt"]) == 0
    out = capsys.readouterr().out
    step = out[out.index("step 1 ·") : out.index("step 2 ·")]
    fields = {
        line.split(maxsplit=1)[0]: line.split(maxsplit=1)[1] for line in step.splitlines()[1:]
    }
    assert fields["time"] == "unknown"
    assert fields["settled"].startswith("by carol at ") and fields["settled"].endswith(f": {said}")
    page = tmp_path / "doubt.html"
    assert main(["show", sqlite, "doubt", "--html", str(page)]) == 0
    capsys.readouterr()
    html = page.read_text(encoding="utf-8")
    section = html[html.index('id="step-1"') : html.index('id="step-2"')]
    assert "<dt>time</dt><dd>unknown</dd>" in section
    assert f"<dt>settled</dt><dd>{fields['settled']}</dd>" in section
    assert main(["show", sqlite, "doubt", "--json"]) == 0
    timeline = json.loads(capsys.readouterr().out)["timeline"]
    assert timeline[1]["duration_s"] is None and timeline[0]["duration_s"] is not None
    # A person, not a probe: the fields a probe's settlement fills say so.
    assert (timeline[1]["settled_by"], timeline[1]["settled_by_probe"]) == ("carol", False)
    assert timeline[1]["probe_duration_s"] is None and timeline[0]["settled_by"] is None


def _commands(out: str) -> dict[str, str]:
    """The answer commands ``pending`` printed, by what each says it does."""
    found = {}
    for line in out.splitlines():
        said, colon, command = line.strip().partition(": ")
        if colon and line.startswith("    ") and "--by NAME" in command:
            found[said] = command
    return found


def _filled(command: str, **words: str) -> list[str]:
    """A printed command as a person pastes it, NAME and TEXT filled in; the program's
    own name left out, so that it runs in this process."""
    parts = shlex.split(command)
    assert parts[0] == "polyloop"
    return [words.get(part, part) for part in parts[1:]]


def test_pending_prints_the_commands_that_answer_each_run(
    sqlite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pending", sqlite]) == 0
    commands = _commands(capsys.readouterr().out)
    assert set(commands) == {"approve", "reject", "it ran", "it did not run"}
    assert commands["approve"].endswith(" paused --by NAME --result-id paused:1:action")
    assert "--reason TEXT --result-id paused:1:action" in commands["reject"]
    assert "--did-not-run --reason TEXT --result-id doubt:1:action" in commands["it did not run"]
    before = _records(sqlite, "paused")
    assert main(_filled(commands["reject"], NAME="bob", TEXT="not now")) == 0
    assert "rejected paused:1:action (by bob)" in capsys.readouterr().out
    assert len(_records(sqlite, "paused")) == len(before) + 1
    assert main(_filled(commands["it ran"], NAME="carol", TEXT="paid 5")) == 0
    assert "settled doubt:1:action: ran (by carol)" in capsys.readouterr().out
    # Printed before those answers, the commands now answer what is no longer open.
    assert main(_filled(commands["approve"], NAME="alice")) == 1
    assert "already rejected by 'bob'" in capsys.readouterr().err


def test_pending_json_names_the_result_id_to_answer_with(
    sqlite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pending", sqlite, "--json"]) == 0
    lines = {d["run_id"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (lines["paused"]["result_id"], lines["doubt"]["result_id"]) == (
        "paused:1:action",
        "doubt:1:action",
    )


ODD_IDS = ["it's mine", "two\nlines \u202egnp.exe", "$(touch pwned) `x` \\ *"]


async def _fill_odd(store: Any) -> None:
    async with store:
        for run_id in ODD_IDS:
            tools = review_tools(Ledger())
            await run(definition(store, script=approval_script()), request(run_id, tools))


def test_pending_commands_give_any_run_id_back_exactly_and_print_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_fill_odd, SqliteStore(tmp_path / "runs.db"))
    spec = f"sqlite:{tmp_path / 'runs.db'}"
    assert main(["pending", spec]) == 0
    out = capsys.readouterr().out
    assert "\u202e" not in out and out.count("\n") == 3 * 4  # 4 lines a run, none broken
    approvals = [line.split(": ", 1)[1] for line in out.splitlines() if "approve: " in line]
    for words in map(_words_of, approvals):
        assert words[:2] == ["approve", spec]
        assert words[3:] == ["--by", "NAME", "--result-id", f"{words[2]}:1:action"]
    assert sorted(_words_of(command)[2] for command in approvals) == sorted(ODD_IDS)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def _words_of(command: str) -> list[str]:
    """The words bash reads from ``command``, printed NUL-separated instead of run."""
    shell = "polyloop() { printf '%s\\0' \"$@\"; }; " + command
    done = subprocess.run(["bash", "-c", shell], capture_output=True, check=True)
    return done.stdout.decode().split("\0")[:-1]


async def _fill_model_doubt(store: Any) -> None:
    """``model`` is in doubt about its model call of step 1 (replay never)."""
    async with store:
        tools = review_tools(Ledger())
        with pytest.raises(SimulatedCrash):
            await run(
                definition(FaultyStore(store, fail_after_writes=6), script=payment_script()),
                request("model", tools),
            )
        await store.release_run("model")
        await start_or_resume(definition(store, script=payment_script()), request("model", tools))


async def _resume_model(path: Path) -> Any:
    async with SqliteStore(path) as store:
        tools = review_tools(Ledger())
        return await start_or_resume(
            definition(store, script=payment_script()), request("model", tools)
        )


@pytest.mark.parametrize(
    ("said", "ends", "state"),
    [
        ("not run (the run calls the model again)", "final_answer", "resume calls the model again"),
        ("ran, reply lost (the run ends model_failure)", "model_failure", "calls no model"),
    ],
)
def test_a_model_call_in_doubt_is_listed_settled_and_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], said: str, ends: str, state: str
) -> None:
    path = tmp_path / "runs.db"
    anyio.run(_fill_model_doubt, SqliteStore(path))
    spec = f"sqlite:{path}"
    assert main(["pending", spec]) == 0
    out = capsys.readouterr().out
    assert "model  in doubt  model:1:model  a model call (its replay is never allowed)" in out
    commands = _commands(out)
    assert set(commands) == {
        "not run (the run calls the model again)",
        "ran, reply lost (the run ends model_failure)",
    }
    assert main(["show", spec, "model"]) == 0
    assert "step 1's model call was announced and has no result" in capsys.readouterr().out
    assert main(_filled(commands[said], NAME="carol", TEXT="checked the bill")) == 0
    assert "settled model:1:model" in capsys.readouterr().out
    assert main(["show", spec, "model"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "the open model call was settled by carol" in shown and state in shown
    assert main(_filled(commands[said], NAME="dave", TEXT="again")) == 1
    assert "already settled by 'carol'" in capsys.readouterr().err
    result = anyio.run(_resume_model, path)
    assert result.stop_reason.value == ends
    assert main(["runs", spec]) == 0
    assert ends in capsys.readouterr().out
