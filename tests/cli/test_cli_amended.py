"""``polyloop show`` and ``verify`` on a run that went on under an amended definition
(issue 48): the amendment at its step, with its author and reason, in text, JSON and
HTML; ``verify`` accepts it, and flags one that does not follow from the snapshot."""

from __future__ import annotations

import html
import json
from pathlib import Path

import anyio
import pytest

from kit.agent import Ledger, definition, request
from kit.review import approval_script, review_tools
from polyloop import Amendment, Message, Role, StopReason, approve, fork, resume, run
from polyloop.cli import main
from polyloop.stores import JsonlStore

AMEND = Amendment(by="ops@example.com", reason="release 2.4: the deploy text", accept=("tools",))
DESCRIPTION = {"deploy": "Deploy the build; prod needs a change ticket."}


async def _write(directory: Path) -> None:
    """Run ``r`` to its approval, amend its deploy description, approve and finish it;
    fork it at step 1 (after the amendment) onto the first release as ``f``."""
    async with JsonlStore(directory) as store:
        ledger = Ledger()
        await run(definition(store, script=approval_script()), request("r", review_tools(ledger)))
        new = request("r", review_tools(ledger, descriptions=DESCRIPTION))
        await resume(definition(store, script=approval_script()), new, amend=AMEND)
        await approve(store, "r", by="alice")
        done = await resume(definition(store, script=approval_script()), new)
        assert done.stop_reason is StopReason.FINAL_ANSWER
        await fork(
            definition(store, script=approval_script()),
            request("f", review_tools(ledger)),
            source_run_id="r",
            at_step=1,
        )


@pytest.fixture
def amended_store(tmp_path: Path) -> str:
    anyio.run(_write, tmp_path / "runs")
    return f"jsonl:{tmp_path / 'runs'}"


def test_show_names_the_amendment_at_its_step(
    amended_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", amended_store, "r"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # long lines are wrapped
    assert "amended by ops@example.com at " in out
    assert ": release 2.4: the deploy text (changed tools) approved by alice" in out
    # It stands with step 1, the step run under it, after the proposal it came after.
    assert out.index("step 1 ") < out.index("proposed") < out.index("amended by")
    assert out.index("amended by") < out.index("step 2 ")

    assert main(["show", amended_store, "r", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    (amended,) = [review for review in shown["reviews"] if review["kind"] == "amended"]
    assert (amended["by"], amended["reason"], amended["step"]) == (AMEND.by, AMEND.reason, 1)
    change = amended["changes"]["tools"]
    assert "change ticket" in json.dumps(change["amended"])
    assert "change ticket" not in json.dumps(change["recorded"])

    page = tmp_path / "r.html"
    assert main(["show", amended_store, "r", "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert html.escape("by ops@example.com at ") in text
    assert html.escape("release 2.4: the deploy text (changed tools)") in text


def test_show_says_which_snapshot_each_step_ran_under(
    amended_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", amended_store, "r", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    # The start record's snapshot, then the amended one: step 0 ran under the first,
    # steps 1 and 2 under the second, which is the one the run goes on under.
    first, amended = shown["snapshots"]
    assert first == shown["snapshot"] and amended == shown["effective_snapshot"]
    assert "change ticket" in json.dumps(amended["tools"])
    assert "change ticket" not in json.dumps(first["tools"])
    assert [row["snapshot_index"] for row in shown["timeline"]] == [0, 1, 1]
    assert shown["inherited_snapshot"] is None

    assert main(["show", amended_store, "r"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("snapshot the start record's, before any amendment") == 1
    assert out.count("snapshot as amended at step 1 by ops@example.com") == 2
    assert out.index("before any amendment") < out.index("step 1 ")

    page = tmp_path / "r.html"
    assert main(["show", amended_store, "r", "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.count(html.escape("as amended at step 1 by ops@example.com")) == 2
    assert "what it goes on under, as amended" in text
    assert html.escape("prod needs a change ticket") in text


def test_show_of_a_fork_after_the_amendment_names_what_it_differs_in(
    amended_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", amended_store, "f", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    # It inherited step 0 at step 1, where the source already held the amended snapshot.
    assert "change ticket" in json.dumps(shown["inherited_snapshot"]["tools"])
    assert "change ticket" not in json.dumps(shown["effective_snapshot"]["tools"])
    assert [row["snapshot_index"] for row in shown["timeline"]][:1] == [None]
    assert main(["show", amended_store, "f"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "snapshot differs from the snapshot run 'r' held at step 1 in tools" in out


def test_verify_checks_a_forks_inherited_snapshot_against_its_source(
    amended_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", amended_store, "f"]) == 0
    assert "ok       f (" in capsys.readouterr().out
    (path,) = Path(amended_store.removeprefix("jsonl:")).glob("f-*.jsonl")
    first, *rest = path.read_text(encoding="utf-8").splitlines(keepends=True)
    record = json.loads(first)
    record["inherited_snapshot"]["tools"] = "not what the source held"
    first = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
    path.write_text("".join([first, *rest]), encoding="utf-8")
    assert main(["verify", amended_store, "f"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "forked from run 'r' at step 1, but the inherited_snapshot of run 'f' is not the "
        "snapshot run 'r' held at that step"
    ) in out


def test_verify_accepts_an_amended_log(
    amended_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", amended_store, "r"]) == 0
    assert "ok       r (" in capsys.readouterr().out


def test_verify_flags_an_amendment_that_does_not_follow_from_the_snapshot(
    amended_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (path,) = Path(amended_store.removeprefix("jsonl:")).glob("r-*.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if '"kind":"amended"' in line)
    record = json.loads(lines[index])
    record["changes"]["tools"]["recorded"] = "not what the run held"
    lines[index] = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
    path.write_text("".join(lines), encoding="utf-8")
    assert main(["verify", amended_store, "r"]) == 1
    out = capsys.readouterr().out
    assert f"{path}:{index + 1} (record " in out and "records out of order: " in out
    assert "amendment of 'tools' does not start from the value the run held" in out


def test_an_old_log_without_amendments_shows_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def write() -> None:
        async with JsonlStore(tmp_path / "runs") as store:
            tools = review_tools(Ledger())
            start = (Message.text(Role.SYSTEM, "You are a careful agent."),)
            await run(
                definition(store, script=approval_script()),
                request("r", tools, run_context=start),
            )

    anyio.run(write)
    assert main(["show", f"jsonl:{tmp_path / 'runs'}", "r"]) == 0
    assert "amended" not in capsys.readouterr().out
