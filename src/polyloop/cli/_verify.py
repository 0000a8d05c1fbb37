"""``polyloop verify``: check stored logs and name every problem with its location.

Two levels of finding:

* **warning**: a torn tail (bytes after a JSONL file's last newline). It is the normal
  trace of a crash in the middle of a write: readers ignore it and the run's next writer
  removes it. Warnings alone leave the exit status at 0.
* **error**: a complete line or row that is not a record of this run, a record of
  another major of the format, or records that cannot follow each other (the check
  ``resume`` itself makes before trusting a log).

JSONL files are read raw, line by line, so that every bad line is named (up to a limit
per file). The database stores are read through the store, which stops at a run's first
bad row; the order check runs on every log that reads back.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio.to_thread

from polyloop.cli._common import CliError
from polyloop.cli._stores import StoreSpec
from polyloop.ports import ManagedStore
from polyloop.session import run_status
from polyloop.stores._common import safe_name
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._jsonl.reader import COMMON_FLAGS, SUFFIX, decode_line, extent, lines
from polyloop.types import CorruptLog, PolyLoopError, Record, SchemaMajorMismatch

Level = Literal["warning", "error"]

# Bad lines named one by one in a file; the rest are counted.
MAX_LINE_ERRORS = 20
_RECORD_INDEX = re.compile(r"record (\d+)")


@dataclass(frozen=True, slots=True)
class Finding:
    level: Level
    location: str
    message: str


@dataclass(slots=True)
class RunCheck:
    """The findings for one run (or one file whose run could not be read)."""

    name: str
    records: int = 0
    findings: list[Finding] = field(default_factory=list)
    run_id: str | None = None  # once a record named it
    file: str | None = None  # a JSONL file's path, as the user can open it
    line_of: list[int] = field(default_factory=list)  # each record's line in that file

    def add(self, level: Level, location: str, message: str) -> None:
        self.findings.append(Finding(level, location, message))

    @property
    def errors(self) -> int:
        return sum(1 for finding in self.findings if finding.level == "error")


async def verify(store: ManagedStore, spec: StoreSpec, run_id: str | None) -> list[RunCheck]:
    """Check every run of the store, or only ``run_id``."""
    if spec.kind == "jsonl":
        checks = await anyio.to_thread.run_sync(
            verify_directory, Path(spec.location), run_id, spec.shown
        )
    else:
        run_ids = (
            (run_id,) if run_id is not None else [run.run_id for run in await store.list_runs()]
        )
        checks = [await _read_stored_run(store, each) for each in run_ids]
        if run_id is not None and checks[0].records == 0 and not checks[0].findings:
            raise CliError(f"unknown run id {run_id!r} in {spec.shown}")
    for check in checks:
        if check.run_id is not None and check.records and not check.errors:
            await _check_order(store, check)
    return checks


async def _read_stored_run(store: ManagedStore, run_id: str) -> RunCheck:
    check = RunCheck(name=run_id, run_id=run_id)
    try:
        log = await store.read_log(run_id)
    except (CorruptLog, SchemaMajorMismatch) as exc:
        check.add("error", exc.location or "?", _reason(exc))
        return check
    check.records = len(log.records)
    return check


def verify_directory(directory: Path, run_id: str | None, shown: str) -> list[RunCheck]:
    """Check the JSONL files of ``directory`` (only ``run_id``'s file if given)."""
    if run_id is not None:
        path = directory / f"{safe_name(run_id)}{SUFFIX}"
        if not path.exists():
            raise CliError(f"unknown run id {run_id!r} in {shown}")
        return [check_file(path)]
    return [check_file(path) for path in sorted(directory.glob(f"*{SUFFIX}"))]


def check_file(path: Path) -> RunCheck:
    """Every problem of one JSONL run file, with its ``file:line``: the file by its path
    (under the directory as the user named it), so that the user can open it."""
    where = str(path)
    check = RunCheck(name=path.name)
    if path.is_symlink() or not path.is_file():
        check.add("error", where, "not a regular file (stores never follow links)")
        return check
    files = OsFileOps()
    try:
        fd = files.open(path, os.O_RDONLY | COMMON_FLAGS)
    except OSError as exc:
        check.add("error", where, f"cannot be read: {exc.strerror or exc}")
        return check
    try:
        # Line by line, up to the last complete one: a torn tail is measured, never held.
        end, size = extent(files, fd)
        records, line_of, complete = _decode_lines(check, where, lines(files, fd, end))
    except OSError as exc:
        check.add("error", where, f"cannot be read: {exc.strerror or exc}")
        return check
    finally:
        files.close(fd)
    if size > end:
        check.add(
            "warning",
            f"{where}:{complete + 1}",
            f"torn tail: {size - end} bytes after the last complete line (a write "
            f"that never finished; readers ignore it, the next writer removes it)",
        )
    if records:
        run_id = records[0].run_id
        check.name = check.run_id = run_id
        check.file, check.line_of = where, line_of
        _check_owner(check, path, run_id, records, line_of)
    elif not check.findings:
        check.add("warning", where, "the file holds no record")
    check.records = len(records)
    return check


def _decode_lines(
    check: RunCheck, name: str, pieces: Iterable[bytes]
) -> tuple[list[Record], list[int], int]:
    """Decode every complete line; note each bad one. Also return each record's line, and
    how many lines there were."""
    records: list[Record] = []
    line_of: list[int] = []
    bad = number = 0
    for number, piece in enumerate(pieces, start=1):
        location = f"{name}:{number}"
        try:
            decoded = decode_line(piece, location)
        except (CorruptLog, SchemaMajorMismatch) as exc:
            bad += 1
            if bad <= MAX_LINE_ERRORS:
                check.add("error", location, _reason(exc))
            continue
        records.extend(decoded)
        line_of.extend([number] * len(decoded))
    if bad > MAX_LINE_ERRORS:
        check.add("error", name, f"{bad - MAX_LINE_ERRORS} more lines do not decode")
    return records, line_of, number


def _check_owner(
    check: RunCheck, path: Path, run_id: str, records: list[Record], line_of: list[int]
) -> None:
    if f"{safe_name(run_id)}{SUFFIX}" != path.name:
        check.add(
            "error",
            f"{path}:{line_of[0]}",
            f"the file name does not belong to run {run_id!r}, so the store cannot find this log",
        )
    for record, number in zip(records, line_of, strict=True):
        if record.run_id != run_id:
            check.add(
                "error",
                f"{path}:{number}",
                f"a record of run {record.run_id!r} in the log of run {run_id!r}",
            )
            return


async def _check_order(store: ManagedStore, check: RunCheck) -> None:
    """The check ``resume`` makes before trusting a log: can its records follow each other?"""
    assert check.run_id is not None
    try:
        await run_status(store, check.run_id)
    except CorruptLog as exc:
        location = exc.location or "?"
        match = _RECORD_INDEX.fullmatch(location)
        if check.file is not None and match is not None:
            location = f"{check.file}:{check.line_of[int(match.group(1))]} ({location})"
        check.add("error", location, f"records out of order: {exc.reason}")


def _reason(exc: PolyLoopError) -> str:
    if isinstance(exc, SchemaMajorMismatch):
        return f"another major of the record format: {exc.reason}"
    return exc.reason
