"""``polyloop show`` and ``polyloop verify`` on forks (issue 32): show says which run and
which step a fork came from and marks its inherited steps, in text, JSON and HTML;
verify checks what a fork claims to have taken over, against its source when it is
still in the store, and notes a source that is gone without calling it an error."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit.agent import Ledger, answer, definition, make_tools, request, tool_call
from kit.fork import SCRIPT, write_forks
from kit.store import sampled
from polyloop import Replay, StepRecord, fork, resume, run
from polyloop.cli import main
from polyloop.session._forking import inherited_digest
from polyloop.stores import JsonlStore, SqliteStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

BACKENDS = ["asyncio", "trio"]


def _opener(kind: str, tmp_path: Path) -> tuple[str, Callable[[], Any]]:
    if kind == "jsonl":
        return f"jsonl:{tmp_path / 'runs'}", lambda: JsonlStore(tmp_path / "runs")
    return f"sqlite:{tmp_path / 'runs.db'}", lambda: SqliteStore(tmp_path / "runs.db")


def _written(kind: str, tmp_path: Path) -> str:
    spec, opener = _opener(kind, tmp_path)

    async def write() -> None:
        async with opener() as store:
            await write_forks(store)

    anyio.run(write)
    return spec


@pytest.fixture(scope="module")
def forked(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A JSONL store with ``src``, ``f`` and ``f0``, read only by the tests that take it."""
    return _written("jsonl", tmp_path_factory.mktemp("forks"))


@pytest.fixture(params=sampled(["jsonl", "sqlite"]))
def writable(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same runs in a store of the test's own, which it may change."""
    return _written(request.param, tmp_path)


def text_of(capsys: pytest.CaptureFixture[str]) -> str:
    return " ".join(capsys.readouterr().out.split())


def source_steps(spec: str) -> tuple[StepRecord, ...]:
    async def read() -> tuple[StepRecord, ...]:
        async with JsonlStore(spec.removeprefix("jsonl:")) as store:
            log = await store.read_log("src")
        return tuple(record for record in log.records if isinstance(record, StepRecord))

    return anyio.run(read)


# -- show --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_show_says_the_run_is_a_fork_and_marks_its_inherited_steps(
    forked: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", backend, "show", forked, "f"]) == 0
    out = text_of(capsys)
    digest = inherited_digest(source_steps(forked)[:2])
    assert (
        "forked from run 'src' at step 2 (steps 0 to 1 inherited: copies of its steps, "
        f"not run again here; inherited sha256 {digest})"
    ) in out
    assert "step 0 · action · executed · inherited ─" in out
    assert "step 1 · action · executed · inherited ─" in out
    assert "step 2 · action · executed ─" in out and "step 3 · action · executed ─" in out
    assert out.count("inherited from run 'src', where it ran; not run again in this run") == 2
    # The inherited observations are the source's, the fork's own steps its own.
    assert "2 (src:0:action)" in out and "6 (f:2:action)" in out
    assert "steps 4 (4 valid)" in out
    # Forked under the source's own snapshot: nothing changed.
    assert "snapshot the snapshot run 'src' held at step 2" in out


def test_show_of_a_fork_at_step_0_and_of_a_plain_run(
    forked: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", forked, "f0"]) == 0
    out = text_of(capsys)
    assert "forked from run 'src' at step 0 (nothing inherited; inherited sha256 " in out
    assert "· inherited" not in out
    assert main(["show", forked, "src"]) == 0
    out = text_of(capsys)
    assert "forked from" not in out and "inherited" not in out and "snapshot" not in out


def test_show_json_names_the_source_and_marks_the_inherited_timeline(
    forked: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", forked, "f", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["forked_from"] == "src"
    assert document["forked_at_step"] == 2
    assert document["inherited_sha256"] == inherited_digest(source_steps(forked)[:2])
    assert [entry["inherited"] for entry in document["timeline"]] == [True, True, False, False]
    assert [entry["step"] for entry in document["timeline"]] == [0, 1, 2, 3]
    assert [step["step"] for step in document["steps"]] == [0, 1, 2, 3]
    assert {step["run_id"] for step in document["steps"]} == {"f"}
    assert document["step_count"] == 4 and document["resumed_after_steps"] == []
    assert main(["show", forked, "src", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (plain["forked_from"], plain["forked_at_step"], plain["inherited_sha256"]) == (
        None,
        None,
        None,
    )
    assert not any(entry["inherited"] for entry in plain["timeline"])


def test_show_html_marks_the_inherited_steps(forked: str, tmp_path: Path) -> None:
    page = tmp_path / "f.html"
    assert main(["show", forked, "f", "--html", str(page)]) == 0
    html = page.read_text(encoding="utf-8")
    assert "<dt>forked from</dt><dd>run &#x27;src&#x27; at step 2 (steps 0 to 1" in html
    assert html.count('<section class="step inherited"') == 2
    assert '<section class="step inherited" id="step-1">' in html
    assert '<section class="step" id="step-2">' in html
    assert html.count('<span class="tag">inherited</span>') == 2


def test_a_fork_of_a_resumed_run_was_not_resumed_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "runs"

    async def write() -> None:
        async with JsonlStore(directory) as store:
            ledger = Ledger()
            tools = make_tools(ledger, replay=Replay.ALLOWED)
            with pytest.raises(SimulatedCrash):  # after step 0, within step 1
                await run(
                    definition(FaultyStore(store, fail_after_writes=7), script=SCRIPT),
                    request("src", tools, model_replay=Replay.ALLOWED),
                )
            await store.release_run("src")
            await resume(
                definition(store, script=SCRIPT),
                request("src", tools, model_replay=Replay.ALLOWED),
            )
            await fork(
                definition(store, script=SCRIPT),
                request("f", tools),
                source_run_id="src",
                at_step=3,
            )

    anyio.run(write)
    spec = f"jsonl:{directory}"
    assert main(["show", spec, "src", "--json"]) == 0
    source = json.loads(capsys.readouterr().out)
    assert source["resumed_after_steps"] == [0]
    assert main(["show", spec, "f", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["resumed_after_steps"] == []
    assert [entry["resumed"] for entry in document["timeline"]] == [
        entry["resumed"] for entry in source["timeline"][:3]
    ] + [False]
    assert main(["show", spec, "f"]) == 0
    assert "resumed after" not in text_of(capsys)


# -- verify ------------------------------------------------------------------------------------


def _jsonl_path(spec: str, run_id: str) -> Path:
    return Path(spec.removeprefix("jsonl:")) / f"{safe_name(run_id)}.jsonl"


def _drop_source(spec: str) -> None:
    """Take ``src`` out of the store: its file removed, or the run pruned."""
    if spec.startswith("jsonl:"):
        _jsonl_path(spec, "src").unlink()
        return

    async def prune() -> None:
        async with SqliteStore(spec.removeprefix("sqlite:")) as store:
            stored = await store.describe_run("src")
            assert stored is not None and stored.updated_at is not None
            # The source ended before its forks started: a cutoff just after it takes it alone.
            cutoff = stored.updated_at + timedelta(microseconds=1)
            pruned = await store.prune(finished_before=cutoff)
            assert pruned == ("src",)

    anyio.run(prune)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_accepts_forks_checked_against_their_source(
    writable: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--backend", backend, "verify", writable]) == 0
    out = capsys.readouterr().out
    for run_id in ("src", "f", "f0"):
        assert f"ok       {run_id} (" in out
    assert "note" not in out
    assert out.rstrip().endswith("3 runs checked: 3 clean, 0 with warnings, 0 with errors")


def test_verify_notes_a_source_that_is_gone(
    writable: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _drop_source(writable)
    assert main(["verify", writable, "f"]) == 0
    out = capsys.readouterr().out
    assert (
        "note     f: forked from run 'src' at step 2; that run is not in this store (the "
        "fork stands alone), so only the copies were checked against the digest"
    ) in out
    assert "ok       f (" in out
    assert "1 run checked: 1 clean, 0 with warnings, 0 with errors" in out


def test_verify_names_both_runs_when_the_source_is_not_what_the_fork_took_over(
    writable: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _drop_source(writable)
    # Another run under the source's id: the fork's digest is not of its first steps.
    other = [tool_call("double", n=5), tool_call("double", n=6), answer("12")]
    spec, opener = _opener(writable.partition(":")[0], Path(writable.partition(":")[2]).parent)
    assert spec == writable

    async def rewrite() -> None:
        async with opener() as store:
            await run(definition(store, script=other), request("src", make_tools(Ledger())))

    anyio.run(rewrite)
    assert main(["verify", writable]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "forked from run 'src' at step 2, but the inherited_sha256 of run 'f' is not the "
        "digest of run 'src''s first 2 steps"
    ) in out
    assert "error f " in out and "ok src (" in out
    # A fork at step 0 took over nothing: its empty digest holds whatever the source is.
    assert "ok f0 (" in out
    assert "3 runs checked: 2 clean, 0 with warnings, 1 with errors" in out


def _edit_start(spec: str, run_id: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    path = _jsonl_path(spec, run_id)
    first, *rest = path.read_text(encoding="utf-8").splitlines(keepends=True)
    record = json.loads(first)
    edit(record)
    path.write_text(json.dumps(record) + "\n" + "".join(rest), encoding="utf-8")
    return path


def test_verify_finds_inherited_copies_that_do_not_match_their_digest(
    forked: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "runs"
    shutil.copytree(forked.removeprefix("jsonl:"), copy)
    spec = f"jsonl:{copy}"

    def tamper(record: dict[str, Any]) -> None:
        record["inherited"][1]["observation"] = "400 (src:1:action)"

    path = _edit_start(spec, "f", tamper)
    assert main(["verify", spec, "f"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"error f {path}:1 (record 0): the inherited steps of this fork of run 'src' do not "
        "hash to the inherited_sha256 its start record holds"
    ) in out


def test_verify_finds_a_fork_whose_step_is_not_its_count_of_inherited_steps(
    forked: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "runs"
    shutil.copytree(forked.removeprefix("jsonl:"), copy)
    spec = f"jsonl:{copy}"

    def miscount(record: dict[str, Any]) -> None:
        record["forked_at_step"] = 3

    path = _edit_start(spec, "f", miscount)
    assert main(["verify", spec, "f"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"error f {path}:1 (record 0): a fork of run 'src' at step 3 whose start record "
        "holds 2 inherited steps"
    ) in out
