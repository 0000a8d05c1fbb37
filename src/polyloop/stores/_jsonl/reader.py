"""Reading the JSON-lines store's run files: where the complete lines end, what they hold.

The rule every reader here applies: a record exists only once the ``\\n`` that ends its
line is in the file. Nothing else ends a line; ``\\r``, U+2028, U+0085 and the other
characters some tools break lines on are part of the line. Whatever follows the last
``\\n`` is a *torn tail*, what remains of a write that never finished and whose caller
was never told it had succeeded: readers ignore it, even when it happens to be a whole
JSON object, and the next writer of the run cuts it off (see
:mod:`polyloop.stores._jsonl.claims`). A terminated line is never passed over. If it does not
decode to a record of the run (``{}``, invalid UTF-8, a duplicate key, a record of
another run, a malformed result-and-step pair), it raises
:class:`~polyloop.types.CorruptLog` naming the file and the line, counted from 1; a
record written in another major of the format raises
:class:`~polyloop.types.SchemaMajorMismatch`.

:func:`parse_lines` applies the rule to a file's bytes, :func:`decode_line` to one line.
:func:`read_file` reads a whole run file and :func:`first_run_id` only as far as its
first line. :func:`complete_end` finds where the complete lines end, which is where a
writer taking a run over truncates. The open flags and the link and file-type checks
live here as well, since the writer opens run files under the same rules.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from polyloop.serialization import dumps, loads
from polyloop.stores._common import open_files_error, safe_name
from polyloop.stores._jsonl.fileops import FileOps
from polyloop.types import (
    CorruptLog,
    IntentKind,
    PolyLoopError,
    Record,
    Result,
    RunEnded,
    SchemaMajorMismatch,
    StepRecord,
    StoreError,
)

__all__ = (
    "COMMON_FLAGS",
    "READ_FLAGS",
    "open_run_file",
    "SUFFIX",
    "complete_end",
    "decode_line",
    "last_end",
    "log_lines",
    "pair_line",
    "record_line",
    "first_run_id",
    "parse_lines",
    "read_file",
    "refuse_link",
    "require_regular",
)

SUFFIX = ".jsonl"
_NOT_FOLLOWED = {errno.ELOOP, errno.EMLINK}  # what O_NOFOLLOW reports for a link
# O_NONBLOCK only matters if something other than a regular file was planted at the
# path (a FIFO would otherwise block the open); regular files ignore it.
COMMON_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
READ_FLAGS = os.O_RDONLY | COMMON_FLAGS
_TAIL_CHUNK = 64 * 1024
_READ_CHUNK = 1024 * 1024
_JSON_SPACE = " \t\r"
_DECODER = json.JSONDecoder()


# -- reading files ------------------------------------------------------------------------


def complete_end(files: FileOps, fd: int) -> tuple[int, int]:
    """``(end of the last complete line, file size)``, scanning back from the end."""
    size = files.fstat(fd).st_size
    position = size
    while position > 0:
        start = max(0, position - _TAIL_CHUNK)
        chunk = files.pread(fd, position - start, start)
        if len(chunk) != position - start:
            raise OSError(errno.EIO, "the run file shrank while it was being read")
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1, size
        position = start
    return 0, size


def last_end(files: FileOps, fd: int, end: int, location: str) -> RunEnded | None:
    """The end record on the last complete line (ending at ``end``), if that is one.

    A line that does not decode says ``None``: whoever reads the whole log is told why.
    """
    start = end - 1
    while start > 0:
        begin = max(0, start - _TAIL_CHUNK)
        newline = files.pread(fd, start - begin, begin).rfind(b"\n")
        if newline >= 0:
            start = begin + newline + 1
            break
        start = begin
    line = files.pread(fd, end - 1 - start, start)
    if not line.lstrip(_JSON_SPACE.encode()).startswith(b"{"):
        return None  # a result-and-step pair, or not a record at all
    try:
        (record,) = decode_line(line, location)
    except (CorruptLog, SchemaMajorMismatch):
        return None
    return record if isinstance(record, RunEnded) else None


def open_run_file(files: FileOps, path: Path, run_id: str) -> int | None:
    """A descriptor to read the run file at ``path``, or ``None`` if there is none;
    refuses links, and names the open-file limit when it is met."""
    try:
        return files.open(path, READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        refuse_link(exc, run_id)
        raise open_files_error(exc, run_id) or StoreError(
            f"could not open the run file: {exc}", run_id=run_id
        ) from exc


def read_file(files: FileOps, path: Path, run_id: str) -> bytes:
    """The whole file, or ``b""`` if there is none; refuses links and special files."""
    fd = open_run_file(files, path, run_id)
    if fd is None:
        return b""
    try:
        require_regular(files, fd, run_id)
        return _read_until(files, fd, None)
    except OSError as exc:
        if isinstance(exc, PolyLoopError):
            raise
        raise StoreError(f"could not read the run file: {exc}", run_id=run_id) from exc
    finally:
        files.close(fd)


def _read_until(files: FileOps, fd: int, stop: bytes | None) -> bytes:
    """Read from the descriptor's position to the end, or until a chunk holds ``stop``."""
    chunks: list[bytes] = []
    while True:
        chunk = files.read(fd, _READ_CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
        if stop is not None and stop in chunk:
            break
    return b"".join(chunks)


def first_run_id(files: FileOps, path: Path) -> str | None:
    """The run id of ``path``'s first complete line; ``None`` if it has none."""
    try:
        fd = files.open(path, READ_FLAGS)
    except FileNotFoundError:
        return None  # removed while the directory was being listed
    except OSError as exc:
        raise StoreError(
            f"could not open {path.name} (links are not followed): {exc}", location=path.name
        ) from exc
    try:
        if not stat.S_ISREG(files.fstat(fd).st_mode):
            raise StoreError("not a regular file", location=path.name)
        head = _read_until(files, fd, b"\n")
    except OSError as exc:
        if isinstance(exc, PolyLoopError):
            raise
        raise StoreError(f"could not read the file: {exc}", location=path.name) from exc
    finally:
        files.close(fd)
    newline = head.find(b"\n")
    line = head if newline < 0 else head[: newline + 1]
    if not line.endswith(b"\n"):
        return None
    location = f"{path.name}:1"
    records = decode_line(line[:-1], location)
    run_id = records[0].run_id
    if f"{safe_name(run_id)}{SUFFIX}" != path.name:
        raise CorruptLog(
            "the file holds a run whose id does not match the file name",
            run_id=run_id,
            location=location,
        )
    return run_id


def refuse_link(exc: OSError, run_id: str) -> None:
    if exc.errno in _NOT_FOLLOWED:
        raise StoreError(
            "the run file is a symbolic link; refusing to follow it", run_id=run_id
        ) from exc


def require_regular(files: FileOps, fd: int, run_id: str) -> None:
    if not stat.S_ISREG(files.fstat(fd).st_mode):
        raise StoreError("the run file is not a regular file", run_id=run_id)


# -- lines --------------------------------------------------------------------------------


def record_line(record: Record) -> bytes:
    """The line that holds ``record`` alone."""
    return (dumps(record) + "\n").encode("utf-8")


def pair_line(result: Result, step: StepRecord) -> bytes:
    """The one line that holds an action's result and its step record."""
    return f"[{dumps(result)},{dumps(step)}]\n".encode()


def log_lines(records: tuple[Record, ...]) -> bytes:
    """A whole log as its run file holds it: an action result shares its step's line."""
    lines: list[bytes] = []
    pending: Result | None = None
    for record in records:
        if isinstance(record, Result) and record.kind is IntentKind.ACTION:
            pending = record
        elif isinstance(record, StepRecord) and pending is not None:
            lines.append(pair_line(pending, record))
            pending = None
        else:
            lines.append(record_line(record))
    return b"".join(lines)


# -- parsing ------------------------------------------------------------------------------


def parse_lines(data: bytes, file_name: str, run_id: str) -> list[Record]:
    """The records of a run file's bytes; the unterminated last piece is ignored.

    Lines are split on ``\\n`` only: other characters that some readers treat as line
    breaks (``\\r``, U+2028, U+0085) are part of the line.
    """
    pieces = data.split(b"\n")
    records: list[Record] = []
    for number, piece in enumerate(pieces[:-1], start=1):
        location = f"{file_name}:{number}"
        try:
            decoded = decode_line(piece, location)
        except (CorruptLog, SchemaMajorMismatch) as exc:
            if exc.run_id is None:  # the codec cannot know which run the file is for
                raise type(exc)(exc.reason, run_id=run_id, location=location) from exc
            raise
        for record in decoded:
            if record.run_id != run_id:
                raise CorruptLog(
                    f"the line holds a record of run {record.run_id!r}",
                    run_id=run_id,
                    location=location,
                )
            records.append(record)
    return records


def decode_line(piece: bytes, location: str) -> list[Record]:
    """The records of one line (its ``\\n`` already removed): one, or a result and a step."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptLog(f"the line is not UTF-8: {exc}", location=location) from exc
    stripped = text.lstrip(_JSON_SPACE)
    if stripped.startswith("["):
        return list(_decode_pair(stripped, location))
    return [loads(text, location=location)]


def _decode_pair(text: str, location: str) -> tuple[Result, StepRecord]:
    """Read ``[result, step]``; each element is checked by the codec's own ``loads``."""
    parts: list[Record] = []
    position = 1
    for closer in (",", "]"):
        position = _skip_space(text, position)
        try:
            _, end = _DECODER.raw_decode(text, position)
        except (ValueError, RecursionError) as exc:
            raise CorruptLog(f"not a JSON record pair: {exc}", location=location) from exc
        parts.append(loads(text[position:end], location=location))
        position = _skip_space(text, end)
        if text[position : position + 1] != closer:
            raise CorruptLog(
                f"a record pair expects {closer!r} at column {position + 1}", location=location
            )
        position += 1
    if text[position:].strip(_JSON_SPACE):
        raise CorruptLog("text after a record pair", location=location)
    result, step = parts
    if not isinstance(result, Result) or not isinstance(step, StepRecord):
        raise CorruptLog("a record pair must hold a result and then a step", location=location)
    return result, step


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in _JSON_SPACE:
        position += 1
    return position
