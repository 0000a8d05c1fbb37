"""``polyloop verify``: check stored logs and name every problem with its location.

Two levels of finding:

* **warning**: a torn tail (bytes after a JSONL file's last newline). It is the normal
  trace of a crash in the middle of a write: readers ignore it and the run's next writer
  removes it. Warnings alone leave the exit status at 0.
* **error**: a complete line or row that is not a record of this run, a record of
  another major of the format, or records that cannot follow each other (the check
  ``resume`` itself makes before trusting a log).

A fork (:func:`polyloop.fork`) is checked for what it claims to have taken over: as many
inherited steps as its step, copies whose digest is the one it recorded, and, when its
source is still in the same store, a digest equal to that of the source's first steps.
A source no longer in the store is not an error: the fork stands alone; a note says so.

JSONL files are read raw, line by line, so that every bad line is named (up to a limit
per file). The database stores are read through the store, which stops at a run's first
bad row; the order check runs on every log that reads back.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import anyio.to_thread

from polyloop.cli._common import CliError
from polyloop.cli._stores import StoreSpec
from polyloop.ports import ManagedStore
from polyloop.session import run_status
from polyloop.session._forking import changed_keys, inherited_digest, snapshot_held
from polyloop.stores._jsonl.fileops import OsFileOps
from polyloop.stores._jsonl.reader import COMMON_FLAGS, SUFFIX, decode_line, extent, lines
from polyloop.stores._paths import safe_name
from polyloop.types import (
    CorruptLog,
    JSONValue,
    PolyLoopError,
    Record,
    RunStarted,
    SchemaMajorMismatch,
    StepRecord,
)

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
    notes: list[str] = field(default_factory=list)  # facts worth a line, not problems

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
            await _check_fork(store, check)
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


async def _check_fork(store: ManagedStore, check: RunCheck) -> None:
    """A fork's start record against what it claims: its step, its digest, its source."""
    assert check.run_id is not None
    started = (await store.read_log(check.run_id)).records[0]
    if not isinstance(started, RunStarted) or started.forked_from is None:
        return
    source, at_step = started.forked_from, started.forked_at_step
    where = _start_location(check)
    inherited = started.inherited_steps
    if at_step != len(inherited):
        check.add(
            "error",
            where,
            f"a fork of run {source!r} at step {at_step} whose start record holds "
            f"{len(inherited)} inherited steps",
        )
        return
    # The copies differ from the source's steps only by their run id: put it back and
    # they must hash to the recorded digest, whether or not the source is still here.
    as_read = tuple(dataclasses.replace(step, run_id=source) for step in inherited)
    if inherited_digest(as_read) != started.inherited_sha256:
        check.add(
            "error",
            where,
            f"the inherited steps of this fork of run {source!r} do not hash to the "
            f"inherited_sha256 its start record holds",
        )
        return
    await _check_source(store, check, started, where)


async def _check_source(
    store: ManagedStore, check: RunCheck, started: RunStarted, where: str
) -> None:
    """The digest a fork recorded against its source's first steps, if the source is here."""
    source, at_step = started.forked_from, started.forked_at_step or 0
    assert source is not None
    try:
        read = await _completed_steps(store, source, at_step)
    except (CorruptLog, SchemaMajorMismatch):
        check.notes.append(
            f"forked from run {source!r}, whose log cannot be read: the digest of the "
            f"inherited steps was checked against the copies only"
        )
        return
    if read is None:
        check.notes.append(
            f"forked from run {source!r} at step {at_step}; that run is not in this store "
            f"(the fork stands alone), so only the copies were checked against the digest"
        )
        return
    steps, held = read
    if len(steps) < at_step or inherited_digest(steps[:at_step]) != started.inherited_sha256:
        check.add(
            "error",
            where,
            f"forked from run {source!r} at step {at_step}, but the inherited_sha256 of run "
            f"{check.run_id!r} is not the digest of run {source!r}'s first {at_step} steps",
        )
    elif started.inherited_snapshot is not None and changed_keys(held, started.inherited_snapshot):
        check.add(
            "error",
            where,
            f"forked from run {source!r} at step {at_step}, but the inherited_snapshot of "
            f"run {check.run_id!r} is not the snapshot run {source!r} held at that step",
        )


async def _completed_steps(
    store: ManagedStore, run_id: str, at_step: int
) -> tuple[tuple[StepRecord, ...], Mapping[str, JSONValue]] | None:
    """The completed steps of ``run_id`` as a fork reads them (its own inherited steps,
    then its step records) and the snapshot it held at ``at_step``; ``None`` if it has
    no log."""
    log = await store.read_log(run_id)
    if not log.records:
        return None
    await run_status(store, run_id)  # a log whose records cannot follow each other raises
    first = log.records[0]
    inherited = first.inherited_steps if isinstance(first, RunStarted) else ()
    own = (record for record in log.records if isinstance(record, StepRecord))
    return (*inherited, *own), snapshot_held(log, at_step)


def _start_location(check: RunCheck) -> str:
    """Where the start record is: its JSONL line, or its index in the log."""
    if check.file is not None and check.line_of:
        return f"{check.file}:{check.line_of[0]} (record 0)"
    return "record 0"


def _reason(exc: PolyLoopError) -> str:
    if isinstance(exc, SchemaMajorMismatch):
        return f"another major of the record format: {exc.reason}"
    return exc.reason
