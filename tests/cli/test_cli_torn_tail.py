"""``show``, ``runs`` and ``verify`` on a JSONL run file with a huge torn tail: the file is
read in chunks, so neither the tail nor the whole file is ever held, and what each command
prints is what it printed for a short tail.

Memory is measured in this process with ``tracemalloc``, which sees every Python
allocation, the worker threads' included.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from kit.agent import Ledger, definition, make_tools, request, tool_call
from kit.show import without_times
from polyloop import run
from polyloop.cli import main
from polyloop.stores import JsonlStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, SimulatedCrash

BACKENDS = ["asyncio", "trio"]
# Garbage enough that holding it once (let alone the copies a split makes) is plain.
GARBAGE = 20 * 1024 * 1024
PEAK_BOUND = GARBAGE // 8
# The start of a record whose write never finished: no newline, never valid JSON.
TORN_START = b'{"schema":"polyloop/1","kind":"res'
T = TypeVar("T")


def peak_of(call: Callable[[], T]) -> tuple[T, int]:
    """What ``call`` returns, and the most memory Python held at once while it ran."""
    tracemalloc.start()
    try:
        result = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def tear(path: Path, size: int) -> None:
    """Append ``size`` bytes of a write that never finished."""
    with path.open("ab") as file:
        file.write(TORN_START + b"\xff" * (size - len(TORN_START)))


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A JSONL store holding one run that crashed after its step 0's model result."""
    directory = tmp_path / "runs"
    script = [tool_call("double", n=1), tool_call("submit", answer="2")]

    async def crashed() -> None:
        async with JsonlStore(directory) as inner:
            with pytest.raises(SimulatedCrash):
                await run(
                    definition(FaultyStore(inner, fail_after_writes=3), script=script),
                    request("crashed", make_tools(Ledger())),
                )

    anyio.run(crashed)
    return f"jsonl:{directory}"


def timeless(printed: tuple[int, str, str]) -> tuple[int, str, str]:
    """A command's status and output, with the age and duration of ``runs`` taken out."""
    status, out, err = printed
    lines = [
        without_times(line) if line.split()[:1] == ["crashed"] else line
        for line in out.splitlines()
    ]
    return status, "\n".join(lines), err


def run_file(store: str) -> Path:
    return Path(store.removeprefix("jsonl:")) / f"{safe_name('crashed')}.jsonl"


def command(capsys: pytest.CaptureFixture[str], *args: str) -> Callable[[], tuple[int, str, str]]:
    def call() -> tuple[int, str, str]:
        status = main(list(args))
        out, err = capsys.readouterr()
        return status, out, err

    return call


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["show", "runs"])
def test_show_and_runs_hold_no_torn_tail_and_print_what_they_did_without_it(
    store: str, backend: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--backend", backend, name, store, *(("crashed",) if name == "show" else ()))
    before = command(capsys, *args)()
    assert before[0] == 0 and "crashed" in before[1]
    tear(run_file(store), GARBAGE)

    after, peak = peak_of(command(capsys, *args))
    # A torn tail is invisible to readers (the run's age aside, which goes on growing).
    assert (timeless(after) if name == "runs" else after) == (
        timeless(before) if name == "runs" else before
    )
    assert peak < PEAK_BOUND, f"{name} held {peak} bytes for a {GARBAGE}-byte torn tail"


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_holds_no_torn_tail_and_reports_its_length_and_line(
    store: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run_file(store)
    lines = path.read_bytes().count(b"\n")
    tear(path, GARBAGE)

    (status, out, _), peak = peak_of(command(capsys, "--backend", backend, "verify", store))
    assert status == 0  # a warning alone
    assert f"warning  crashed  {path}:{lines + 1}: torn tail: {GARBAGE} bytes after" in out
    assert "1 run checked: 0 clean, 1 with warnings, 0 with errors" in out
    assert peak < PEAK_BOUND, f"verify held {peak} bytes for a {GARBAGE}-byte torn tail"


def test_verify_reports_a_file_that_is_all_torn_tail_at_its_first_line(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run_file(store)
    path.write_bytes(b"")
    tear(path, 1000)
    assert main(["verify", store]) == 0
    out = capsys.readouterr().out
    assert f"{path}:1: torn tail: 1000 bytes after the last complete line" in out
    assert "holds no record" not in out  # the torn tail is the finding


def test_verify_names_bad_lines_before_a_torn_tail_by_their_number(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run_file(store)
    lines = path.read_bytes().count(b"\n")
    with path.open("ab") as file:
        file.write(b"not a record\n")
    tear(path, 100)
    assert main(["verify", store]) == 1
    out = capsys.readouterr().out
    assert f"error    crashed  {path}:{lines + 1}: not a JSON record" in out
    assert f"warning  crashed  {path}:{lines + 2}: torn tail: 100 bytes" in out
