"""``polyloop cancel``: what it prints, that a refusal is one line, exit status 1 and
nothing written, and (real processes) that a cancel from another process stops a run a
``polyloop worker`` drives: the running payment finishes, nothing after it runs, and no
worker drives the run again."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from kit import worker_process
from kit.console import fill
from kit.hosting import eventually
from kit.worker_app import Entry
from kit.worker_process import STORES, WorkerApp
from polyloop import CancelRequest, RunEnded, RunState, StepRecord, StopReason, run_status
from polyloop.cli import main
from polyloop.stores import SqliteStore

WHY = "wrong customer"


async def _fill(path: Path) -> None:
    """``paused`` waits for approval of a deploy, ``doubt`` is in doubt about a payment,
    ``done-1`` finished (the console's runs)."""
    async with SqliteStore(path) as store:
        await fill(store)


async def _log(path: Path, run_id: str) -> tuple[Any, ...]:
    async with SqliteStore(path) as store:
        return (await store.read_log(run_id)).records


@pytest.fixture(scope="module")
def filled_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runs of :func:`_fill` in a SQLite store, written once for the module; each test
    gets a copy of its own (:func:`sqlite`)."""
    place = tmp_path_factory.mktemp("filled")
    anyio.run(_fill, place / "runs.db")
    return place


@pytest.fixture
def sqlite(filled_once: Path, tmp_path: Path) -> str:
    shutil.copytree(filled_once, tmp_path, dirs_exist_ok=True)
    return f"sqlite:{tmp_path / 'runs.db'}"


def _records(spec: str, run_id: str) -> tuple[Any, ...]:
    return anyio.run(_log, Path(spec.removeprefix("sqlite:")), run_id)


@pytest.mark.parametrize(
    ("run_id", "result_id"), [("paused", "paused:1:action"), ("doubt", "doubt:1:action")]
)
def test_cancel_ends_a_waiting_run_for_good_and_says_so(
    sqlite: str, run_id: str, result_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _records(sqlite, run_id)
    argv = ["cancel", sqlite, run_id, "--by", "dana", "--reason", WHY, "--result-id", result_id]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == (
        f"run {run_id} ended for good: cancelled_by_request ({WHY})"
    )
    records = _records(sqlite, run_id)
    assert records[: len(before)] == before
    [end] = records[len(before) :]
    assert isinstance(end, RunEnded) and end.is_final
    assert (end.stop_reason, end.cancelled_by, end.detail) == (
        StopReason.CANCELLED_BY_REQUEST,
        "dana",
        WHY,
    )
    assert main(["show", sqlite, run_id]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "cancelled by dana" in shown and "cancelled_by_request" in shown
    # Nothing waits any more, and an answer is refused.
    assert main(["pending", sqlite]) == 0
    assert f"{run_id}  " not in capsys.readouterr().out
    assert main(["approve", sqlite, run_id, "--by", "ann"]) == 1
    assert "'dana' asked for the run to be cancelled" in capsys.readouterr().err


def test_a_finished_run_is_left_as_it_is(sqlite: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _records(sqlite, "done-1")
    assert main(["cancel", sqlite, "done-1", "--by", "dana", "--reason", WHY]) == 0
    said = capsys.readouterr().out.strip()
    assert said == "run done-1 had already finished (final_answer); nothing was written"
    assert _records(sqlite, "done-1") == before


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["paused", "--by", "a"], "--reason"),
        (["paused", "--reason", "x"], "--by"),
        (["paused", "--by", " ", "--reason", "x"], "by must be a non-empty"),
        (["paused", "--by", "a", "--reason", " "], "reason must be a non-empty"),
        (["nobody", "--by", "a", "--reason", "x"], "no record of this run"),
        (
            ["paused", "--by", "a", "--reason", "x", "--result-id", "paused:0:action"],
            "the open proposal is 'paused:1:action', not 'paused:0:action'",
        ),
        (
            ["doubt", "--by", "a", "--reason", "x", "--result-id", "doubt:0:action"],
            "the open intent is 'doubt:1:action', not 'doubt:0:action'",
        ),
    ],
)
def test_a_refused_cancel_is_one_line_and_writes_nothing(
    sqlite: str, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {run_id: _records(sqlite, run_id) for run_id in ("paused", "doubt")}
    assert main(["cancel", sqlite, *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert "Traceback" not in err
    assert {run_id: _records(sqlite, run_id) for run_id in ("paused", "doubt")} == before


async def _ask(path: Path, run_id: str) -> None:
    async with SqliteStore(path) as store:
        await store.request_cancel(CancelRequest(run_id=run_id, by="dana", reason=WHY))


def test_a_run_whose_cancel_its_writer_has_not_seen_says_so(
    sqlite: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Kept while a writer held the run, which stopped to wait before another intent.
    anyio.run(_ask, Path(sqlite.removeprefix("sqlite:")), "paused")
    assert main(["runs", sqlite]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if "paused" in line]
    assert "awaiting approval (cancel requested, resume it to go on)" in line
    assert main(["pending", sqlite]) == 0
    listed = capsys.readouterr().out
    assert "doubt  in doubt" in listed and "paused" not in listed  # no person is asked
    assert main(["show", sqlite, "paused"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "a cancel was requested; resume ends it, before any effect" in shown


# -- real processes ---------------------------------------------------------------------


@pytest.fixture(params=STORES)
def apps(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., WorkerApp]]:
    with worker_process.apps(request, tmp_path) as make:
        yield make


async def _finished(store: Any, run_id: str) -> bool:
    return (await run_status(store, run_id)).state is RunState.FINISHED


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_cancel_from_another_process_stops_a_run_a_worker_drives(
    apps: Callable[..., WorkerApp], anyio_backend: str
) -> None:
    app = apps(gated=True, WORKER_PAYMENTS="2")
    async with app.store() as store:
        await app.agent(store).start("r1", {})
        worker = app.worker(backend=anyio_backend)
        await eventually(
            lambda: len(app.entries("entered")) == 1, timeout_s=30, what="the first payment"
        )
        cancelled = await app.polyloop(
            "cancel", app.settings.store, "r1", "--by", "dana", "--reason", WHY
        )
        assert cancelled.returncode == 0, cancelled.stderr
        assert b"cancel requested for run r1" in cancelled.stdout
        acknowledged = len(app.entries())
        app.gate.touch()  # the payment running when the cancel came now finishes
        await eventually(lambda: _finished(store, "r1"), timeout_s=30, what="r1 ending")
        records = (await store.read_log("r1")).records
        # Room for a second drive, which must not come: ten polls of this worker.
        await anyio.sleep(1.0)
        second = app.worker(backend=anyio_backend)
        await eventually(second.serving, timeout_s=30, what="a second worker serving")
        await anyio.sleep(1.0)
        await second.stop()
        await worker.stop()
    end = records[-1]
    assert isinstance(end, RunEnded) and end.is_final
    assert (end.stop_reason, end.cancelled_by, end.detail) == (
        StopReason.CANCELLED_BY_REQUEST,
        "dana",
        WHY,
    )
    [step] = [record for record in records if isinstance(record, StepRecord)]
    assert step.step == 0 and step.observation == "paid 1"
    # After the cancel returned, the ledger holds only the end of the payment it found
    # running: no later payment started.
    assert app.entries()[acknowledged:] == [
        Entry(what="paid", result_id="r1:0:action", pid=worker.pid)
    ]
    assert app.paid() == ["r1:0:action"]
    assert [facts["why"] for facts in worker.of("r1", "driving")] == ["new"]
    [stopped] = worker.of("r1", "stopped")
    assert stopped["stop_reason"] == "cancelled_by_request"
    assert second.of("r1") == []  # a worker never picks the run up again
