"""STORE arguments, and listing the runs of a JSON-lines directory (``JsonlStore.list_runs``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kit.agent import Ledger, answer, definition, make_tools, request
from polyloop import StoreError, run
from polyloop.cli import main
from polyloop.cli._common import CliError
from polyloop.cli._stores import StoreSpec, parse_store, require_existing
from polyloop.stores import JsonlStore
from polyloop.stores._paths import safe_name

# -- STORE arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("jsonl:runs", StoreSpec("jsonl", "runs", "jsonl:runs")),
        ("jsonl:/a/b:c", StoreSpec("jsonl", "/a/b:c", "jsonl:/a/b:c")),
        ("sqlite:demo.db", StoreSpec("sqlite", "demo.db", "sqlite:demo.db")),
        (
            "postgresql://u@h/db",
            StoreSpec("postgresql", "postgresql://u@h/db", "postgresql://u@h/db"),
        ),
        ("postgres://h/db", StoreSpec("postgresql", "postgres://h/db", "postgres://h/db")),
    ],
)
def test_store_arguments_parse(text: str, spec: StoreSpec) -> None:
    assert parse_store(text) == spec


@pytest.mark.parametrize("text", ["runs", "JSONL:runs", "file:x", "mysql://h/db", "", ":x"])
def test_unknown_schemes_are_refused(text: str) -> None:
    with pytest.raises(CliError, match="unknown store scheme"):
        parse_store(text)


def test_passwords_are_masked_in_messages() -> None:
    assert parse_store("postgresql://me:s3cret@db:5432/x").shown == "postgresql://me:***@db:5432/x"
    with pytest.raises(CliError) as raised:
        parse_store("mysql://me:s3cret@db/x")
    assert "s3cret" not in str(raised.value)


def test_reading_commands_never_create_a_store(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    for text, message in [
        (
            f"jsonl:{tmp_path / 'nothing'}",
            f"no JSONL store at {tmp_path / 'nothing'}: the directory does not exist",
        ),
        (
            f"jsonl:{tmp_path / 'file'}",
            f"{tmp_path / 'file'} is a file, not a directory of JSONL run logs",
        ),
        (
            f"jsonl:{tmp_path / 'fifo'}",
            f"{tmp_path / 'fifo'} is a special file (not a regular file), not a directory "
            "of JSONL run logs",
        ),
        (
            f"sqlite:{tmp_path / 'nothing.db'}",
            f"no SQLite store at {tmp_path / 'nothing.db'}: the file does not exist",
        ),
        (f"sqlite:{tmp_path}", f"{tmp_path} is a directory, not a SQLite database file"),
    ]:
        with pytest.raises(CliError) as refused:
            require_existing(parse_store(text))
        # The path itself and what it is, never "the directory is not a directory".
        assert str(refused.value) == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file"]
    require_existing(parse_store(f"jsonl:{tmp_path}"))
    require_existing(parse_store(f"sqlite:{tmp_path / 'file'}"))


# Every command but the demo works on a store that exists.
EXISTING_ONLY = [
    ["runs"],
    ["show", "r1"],
    ["verify"],
    ["pending"],
    ["prune", "--finished-before", "2999-01-01"],
    ["approve", "r1", "--by", "ann"],
    ["reject", "r1", "--by", "ann", "--reason", "no"],
    ["settle", "r1", "--by", "ann", "--did-not-run", "--reason", "no"],
]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root``, with a file's contents."""
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else None
        for path in root.rglob("*")
    }


@pytest.mark.parametrize("command", EXISTING_ONLY, ids=" ".join)
def test_no_command_but_the_demo_creates_a_store(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty.db").write_bytes(b"")
    before = _tree(tmp_path)
    for store, message in [
        (
            f"jsonl:{tmp_path / 'typo'}",
            f"no JSONL store at {tmp_path / 'typo'}: the directory does not exist",
        ),
        (
            f"sqlite:{tmp_path / 'typo.db'}",
            f"no SQLite store at {tmp_path / 'typo.db'}: the file does not exist",
        ),
        (
            f"sqlite:{tmp_path / 'empty.db'}",
            "no PolyLoop store in database 'empty.db': the database holds no PolyLoop tables",
        ),
    ]:
        assert main([command[0], store, *command[1:]]) == 1
        assert capsys.readouterr() == ("", f"polyloop: error: {message}\n")
    assert _tree(tmp_path) == before


# -- JsonlStore.list_runs ----------------------------------------------------------------------


async def start(directory: Path, *run_ids: str) -> None:
    async with JsonlStore(directory) as store:
        for run_id in run_ids:
            await run(
                definition(store, script=[answer("ok")]), request(run_id, make_tools(Ledger()))
            )


@pytest.mark.anyio
async def test_list_runs_lists_every_run_sorted(tmp_path: Path) -> None:
    awkward = ["b", "a/../../x", "ü-run", "a" * 300, ".hidden"]
    await start(tmp_path, *awkward)
    (tmp_path / "notes.txt").write_text("not a run")
    async with JsonlStore(tmp_path) as store:
        listed = await store.list_runs()
        assert tuple(run.run_id for run in listed) == tuple(sorted(awkward))
        assert all(run.finished and not run.claimed for run in listed)
        assert await store.list_runs(unfinished_only=True) == ()


@pytest.mark.anyio
async def test_list_runs_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    async with JsonlStore(tmp_path / "none") as store:
        assert await store.list_runs() == ()
    assert not (tmp_path / "none").exists()


@pytest.mark.anyio
async def test_list_runs_leaves_out_a_file_without_a_complete_line(tmp_path: Path) -> None:
    await start(tmp_path, "kept")
    (tmp_path / f"{safe_name('torn')}.jsonl").write_bytes(b'{"schema":"polyloop/1"')
    (tmp_path / f"{safe_name('empty')}.jsonl").write_bytes(b"")
    async with JsonlStore(tmp_path) as store:
        assert tuple(run.run_id for run in await store.list_runs()) == ("kept",)


def left_out(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "polyloop" and record.levelno == logging.WARNING
    ]


@pytest.mark.anyio
async def test_list_runs_leaves_out_an_unreadable_first_line_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await start(tmp_path, "kept")
    name = f"{safe_name('bad')}.jsonl"
    (tmp_path / name).write_bytes(b"garbage\n")
    async with JsonlStore(tmp_path) as store:
        with caplog.at_level(logging.WARNING, logger="polyloop"):
            assert tuple(run.run_id for run in await store.list_runs()) == ("kept",)
    (warning,) = left_out(caplog)
    # The file by its full path, so that it can be opened from anywhere.
    assert warning.startswith(f"{tmp_path / name} is left out of the listing")
    assert f"{tmp_path / name}:1" in warning


@pytest.mark.anyio
async def test_list_runs_leaves_out_a_file_named_for_another_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await start(tmp_path, "kept", "other")
    original = tmp_path / f"{safe_name('kept')}.jsonl"
    original.rename(tmp_path / "renamed.jsonl")
    async with JsonlStore(tmp_path) as store:
        with caplog.at_level(logging.WARNING, logger="polyloop"):
            assert tuple(run.run_id for run in await store.list_runs()) == ("other",)
    (warning,) = left_out(caplog)
    assert warning.startswith(f"{tmp_path / 'renamed.jsonl'} is left out of the listing")
    assert "does not match the file name" in warning
    assert f"{tmp_path / 'renamed.jsonl'}:1" in warning


@pytest.mark.anyio
async def test_list_runs_leaves_out_links_and_refuses_closed_stores(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await start(tmp_path / "runs", "kept")
    os.symlink(tmp_path / "runs" / f"{safe_name('kept')}.jsonl", tmp_path / "runs" / "link.jsonl")
    store = JsonlStore(tmp_path / "runs")
    with caplog.at_level(logging.WARNING, logger="polyloop"):
        (listed,) = await store.list_runs()
    assert listed.run_id == "kept" and listed.finished and not listed.claimed
    (warning,) = left_out(caplog)
    link = tmp_path / "runs" / "link.jsonl"
    assert warning.startswith(f"{link} is left out of the listing")
    assert f"the run file {link} is a symbolic link" in warning
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await store.list_runs()
