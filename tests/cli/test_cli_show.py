"""``polyloop show`` tells the truth about time, tokens, resumes and an effect in doubt:
the terminal view and ``--json``, on the runs of ``kit.show``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import polyloop
from kit.show import UTC_TIME, show, write_stores
from polyloop import run_trace_id
from polyloop.cli import main
from polyloop.stores import JsonlStore

BACKENDS = ["asyncio", "trio"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return write_stores(tmp_path_factory.mktemp("show"))


def text_of(capsys: pytest.CaptureFixture[str]) -> str:
    """Standard output with every run of whitespace as one space (terminal wrapping too)."""
    return " ".join(capsys.readouterr().out.split())


def document(stores: dict[str, str], name: str, capsys: pytest.CaptureFixture[str]) -> Any:
    assert main(show(stores, name, "--json")) == 0
    return json.loads(capsys.readouterr().out)


# -- the terminal ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_of_a_finished_run_has_times_and_tokens(
    stores: dict[str, str], backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "done", backend=backend)) == 0
    out = text_of(capsys)
    assert out.startswith("run done finished")
    assert "state finished (submitted)" in out
    assert len(UTC_TIME.findall(out)) == 4  # started, ended, and each step's record
    assert re.search(r"wall time \d+\.\d{3} s", out)
    assert re.search(r"time \d+\.\d{3} s \(model \d+\.\d{3} s, tool \d+\.\d{3} s\)", out)
    assert "tokens 100 in, 20 out, 120 total" in out
    assert out.count("tokens 230 in, 30 out, 260 total") == 2  # the summary and the end
    assert "resumed" not in out and "IN DOUBT" not in out
    assert f"trace id {run_trace_id('done')}" in out


def test_text_says_a_total_is_unknown_rather_than_understate_it(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "partial")) == 0
    out = text_of(capsys)
    assert "tokens ? in, ? out, ? total; unknown, as the reply of step 1 reported no counts" in out
    assert "120 total" in out  # step 0's own count is still shown


def test_text_marks_the_steps_a_resumed_process_wrote(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "resumed")) == 0
    out = text_of(capsys)
    assert "resumed after step 0 (at least 2 attempts)" in out
    assert "step 0 · action · executed ─" in out
    for step in (1, 2, 3, 4):
        assert re.search(rf"step {step} · \w+ · [\w ]+ · resumed", out), step
    assert out.count("written by a process that resumed the run") == 4


def test_text_puts_the_effect_in_doubt_first(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "doubt")) == 0
    out = text_of(capsys)
    assert out.startswith("run r in doubt")
    banner = out[: out.index("started")]
    assert "IN DOUBT step 0's action double was announced and has no result" in banner
    assert 'tool double arguments {"n": 1}' in banner
    assert "result id r:0:action" in banner
    assert UTC_TIME.search(banner)  # when the intent was written
    assert "finished" not in out


def test_text_of_a_model_call_in_doubt(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "model")) == 0
    out = text_of(capsys)
    assert "IN DOUBT step 0's model call was announced and has no result" in out
    assert "kind model_call result id r:0:model" in out


def test_an_open_intent_under_a_live_writer_is_running_not_in_doubt(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    holder = JsonlStore(stores["held"].removeprefix("jsonl:"))
    anyio.run(holder.claim_run, "held")  # a worker is driving it now
    try:
        assert main(show(stores, "held")) == 0
        out = text_of(capsys)
        assert out.startswith("run held running")
        assert "state running: a live worker" in out
        assert "IN DOUBT" not in out
    finally:
        anyio.run(holder.aclose)
    assert main(show(stores, "held")) == 0  # nobody holds it: the action is in doubt
    out = text_of(capsys)
    assert out.startswith("run held in doubt (4 records) IN DOUBT step 0's action double was")


def test_text_of_a_cancelled_run_says_resume_goes_on(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "stopped")) == 0
    out = text_of(capsys)
    assert out.startswith("run stopped resumable")
    assert "state resumable: cancelled; resume goes on" in out


def test_text_of_an_old_log_without_times(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "old")) == 0
    out = text_of(capsys)
    assert "state resumable: not finished; resume goes on" in out
    assert "started — last record — wall time —" in out
    assert "time 1.500 s" in out  # the first release already wrote a step's duration
    assert not UTC_TIME.search(out)
    assert "written" not in out and "resumed" not in out
    # The id is derived from the run id alone, so even a log older than tracing has one.
    assert f"trace id {run_trace_id('exp-7/task-12#3')}" in out


# With every opentelemetry module made unimportable, as in an install without the extra.
_WITHOUT_OTEL = """
import sys
sys.modules["opentelemetry"] = None
try:
    import polyloop.otel
except ImportError:
    pass
else:
    raise SystemExit("opentelemetry is still importable")
from polyloop.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_run_trace_id_needs_no_opentelemetry(stores: dict[str, str]) -> None:
    source = str(Path(polyloop.__file__).resolve().parent.parent)
    shown = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OTEL, *show(stores, "done", "--json")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": source, "PATH": ""},
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["trace_id"] == run_trace_id("done")


# -- JSON --------------------------------------------------------------------------------------

OLD_KEYS = {
    "run_id",
    "state",
    "stop_reason",
    "step_count",
    "valid_step_count",
    "detail",
    "last_record_at",
    "final_answer",
    "records",
    "interrupted",
    "snapshot",
    "open_intent",
    "usage",
    "steps",
}


def test_json_of_a_finished_run_adds_the_facts(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "done", capsys)
    assert set(shown) >= OLD_KEYS
    assert shown["usage"] == {"input_tokens": 230, "output_tokens": 30, "reasoning_tokens": None}
    assert shown["total_tokens"] == 260
    assert shown["tokens_unreported_steps"] == []
    assert shown["in_doubt"] is None and shown["resumed_after_steps"] == []
    assert shown["started_at"].endswith("Z") and shown["wall_time_s"] > 0
    (first, second) = shown["timeline"]
    assert first["step"] == 0 and first["total_tokens"] == 120 and first["resumed"] is False
    assert first["duration_s"] >= first["model_duration_s"] >= 0
    assert first["at"] < second["at"]
    assert shown["trace_id"] == run_trace_id("done")


def test_json_of_a_partly_metered_run_has_no_total(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "partial", capsys)
    assert shown["total_tokens"] is None
    assert shown["tokens_unreported_steps"] == [1]


def test_json_of_a_resumed_run(stores: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    shown = document(stores, "resumed", capsys)
    assert shown["resumed_after_steps"] == [0]
    assert [step["resumed"] for step in shown["timeline"]] == [False, True, True, True, True]


def test_json_of_an_in_doubt_run_names_the_effect(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "doubt", capsys)
    assert shown["state"] == "in doubt"
    doubt = shown["in_doubt"]
    assert {k: doubt[k] for k in ("step", "kind", "tool", "arguments", "result_id", "replay")} == {
        "step": 0,
        "kind": "action",
        "tool": "double",
        "arguments": {"n": 1},
        "result_id": "r:0:action",
        "replay": "never",
    }
    assert doubt["announced_at"].endswith("Z")
    assert shown["state_text"].startswith("IN DOUBT")


def test_json_of_an_old_log_has_nulls(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "old", capsys)
    assert set(shown) >= OLD_KEYS
    assert shown["started_at"] is None and shown["wall_time_s"] is None
    assert shown["total_tokens"] is None and shown["in_doubt"] is None
    assert shown["timeline"] == [
        {
            "step": 0,
            "inherited": False,
            "at": None,
            "duration_s": 1.5,
            "model_duration_s": None,
            "action_duration_s": None,
            "resumed": False,
            "total_tokens": None,
            "settled_by": None,
            "settled_by_probe": False,
            "probe_duration_s": None,
            "snapshot_index": 0,
        }
    ]
    assert shown["reconciled_steps"] == [] and shown["pending_settlement"] is None
    assert shown["forked_from"] is None and shown["forked_at_step"] is None
    # Never amended: one snapshot, the start record's, the one the run goes on under.
    assert shown["snapshots"] == [shown["snapshot"]] and shown["inherited_snapshot"] is None
    assert shown["effective_snapshot"] == shown["snapshot"]


# -- a step the tool's own probe settled ---------------------------------------------------------

PROBE_TOOK = r"; the probe took \d+\.\d{3} (ms|s)"


def step_block(out: str, step: int) -> str:
    return out[out.index(f"step {step} ·") : out.index(f"step {step + 1} ·")]


@pytest.mark.parametrize(("name", "said"), [("paid", "it ran"), ("unpaid", "it did not run")])
def test_text_says_the_probe_settled_the_step_and_how_long_it_took(
    stores: dict[str, str], name: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, name)) == 0
    block = step_block(text_of(capsys), 1)
    assert re.search(rf"settled by the probe of tool 'pay' \({said}\) at \S+{PROBE_TOOK}", block), (
        block
    )
    assert "time unknown" in block  # the step's calls ran in the crashed attempt


def test_text_of_a_run_whose_probe_settlement_has_no_step_yet(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(show(stores, "pending")) == 0
    out = text_of(capsys)
    assert out.startswith("run pending resumable")
    assert "IN DOUBT" not in out
    settled = "settled by the probe of tool 'pay' (it ran)"
    assert f"state resumable: the open action was {settled}; resume goes on" in out
    end = out[out.index("end ─") :]
    assert re.search(rf"{re.escape(settled)} at \S+{PROBE_TOOK}", end), end
    assert f"has no result (replay never); {settled}: resume records it" in end


@pytest.mark.parametrize(("name", "ran"), [("paid", True), ("unpaid", False)])
def test_json_names_the_probe_that_settled_a_step(
    stores: dict[str, str], name: str, ran: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, name, capsys)
    assert shown["reconciled_steps"] == [1] and shown["pending_settlement"] is None
    first, settled, last = shown["timeline"]
    for step in (first, last):
        assert step["settled_by"] is None and step["settled_by_probe"] is False
        assert step["probe_duration_s"] is None
    assert settled["settled_by"] == "reconcile:pay" and settled["settled_by_probe"] is True
    assert settled["probe_duration_s"] > 0 and settled["duration_s"] is None
    (settlement,) = shown["reviews"]
    assert settlement["ran"] is ran and settlement["duration_s"] == settled["probe_duration_s"]


def test_json_of_a_pending_probe_settlement(
    stores: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shown = document(stores, "pending", capsys)
    assert shown["state"] == "resumable" and shown["in_doubt"] is None
    assert shown["reconciled_steps"] == [1]
    pending = shown["pending_settlement"]
    assert pending.pop("probe_duration_s") > 0
    assert pending == {
        "result_id": "pending:1:action",
        "ran": True,
        "settled_by": "reconcile:pay",
        "settled_by_probe": True,
    }
    assert [step["settled_by"] for step in shown["timeline"]] == [None]
