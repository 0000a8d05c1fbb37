"""The JSON-lines format of the run files: a record exists once its line's ``\\n`` is in
the file; what follows the last one is a torn tail, ignored and cut off by the next claim
(docs/recovery.md#damaged-logs)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from polyloop import types
from polyloop.serialization import dumps, loads
from polyloop.stores._jsonl.fileops import FileOps
from polyloop.stores._open_files import open_failed
from polyloop.stores._paths import safe_name
from polyloop.stores._writes import kept_cancel
from polyloop.types import CorruptLog, Record, Result, RunEnded, SchemaMajorMismatch, StepRecord

SUFFIX = ".jsonl"
CANCEL_SUFFIX = ".cancel"  # beside a run file: the run's cancel request
# O_NONBLOCK: a FIFO planted at the path would otherwise block the open.
COMMON_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CHUNK = 64 * 1024
_SPACE = " \t\r"  # what JSON skips between tokens on one line
_DECODER = json.JSONDecoder()
_SHRANK = "the run file shrank while it was being read"


def extent(files: FileOps, fd: int) -> tuple[int, int]:
    """Where the last complete line ends, and the file's size: a torn tail lies between."""
    size = files.fstat(fd).st_size
    return _line_start(files, fd, size), size


def tail(files: FileOps, fd: int, location: str) -> tuple[int, int, RunEnded | None]:
    """Where the last complete line ends, the file's size, and that line's end record if any."""
    end, size = extent(files, fd)
    if end == 0:
        return 0, size, None
    start = _line_start(files, fd, end - 1)
    line = files.pread(fd, end - 1 - start, start)
    record: Record | None = None
    if line.lstrip(_SPACE.encode()).startswith(b"{"):  # not a result-and-step pair
        # A line that does not decode is no end: a reader of the whole log is told why.
        with contextlib.suppress(CorruptLog, SchemaMajorMismatch):
            (record,) = decode_line(line, location)
    return end, size, record if isinstance(record, RunEnded) else None


def _line_start(files: FileOps, fd: int, end: int) -> int:
    """Just after the last ``\\n`` before ``end`` (0 if none), scanning back in chunks."""
    position = end
    while position > 0:
        start = max(0, position - _CHUNK)
        chunk = files.pread(fd, position - start, start)
        if len(chunk) != position - start:
            raise OSError(errno.EIO, _SHRANK)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0


@contextlib.contextmanager
def run_file(
    files: FileOps, path: Path, run_id: str | None, flags: int = os.O_RDONLY
) -> Iterator[int | None]:
    """A descriptor to read the run file (``None`` if there is none); a failed read is a
    ``StoreError`` naming the run, or else the file."""
    try:
        fd = files.open(path, flags | COMMON_FLAGS)
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        raise cannot_open(exc, run_id, path) from exc
    try:
        require_regular(files, fd, run_id, path)
        yield fd
    except OSError as exc:
        if isinstance(exc, types.PolyLoopError):
            raise
        reason = f"could not read the run file: {exc.strerror or exc}"
        raise types.StoreError(reason, run_id=run_id, location=str(path)) from exc
    finally:
        files.close(fd)


def lines(files: FileOps, fd: int, end: int) -> Iterator[bytes]:
    """The complete lines up to ``end``, without their ``\\n``, read in chunks from the
    descriptor's position (the start); only the line being read is held."""
    parts: list[bytes] = []  # the line so far: joined once, not grown chunk by chunk
    position = 0
    while position < end:
        chunk = files.read(fd, min(_CHUNK, end - position))
        if not chunk:
            raise OSError(errno.EIO, _SHRANK)
        position += len(chunk)
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            parts.append(chunk[start:newline])
            yield b"".join(parts)
            parts.clear()
            start = newline + 1
        if start < len(chunk):
            parts.append(chunk[start:])


def first_run_id(files: FileOps, fd: int, path: Path, end: int) -> str:
    """The run of the file's first line, which must be the one the file is named for."""
    location = f"{path}:1"
    head = next(lines(files, fd, end))
    run_id = decode_line(head, location)[0].run_id
    if f"{safe_name(run_id)}{SUFFIX}" != path.name:
        reason = "the file holds a run whose id does not match the file name"
        raise CorruptLog(reason, run_id=run_id, location=location)
    return run_id


def cannot_open(exc: OSError, run_id: str | None, path: Path) -> types.StoreError:
    """Why the run file at ``path`` would not open; a symbolic link is refused by name."""
    if exc.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW reports for a link
        reason = f"the run file {path} is a symbolic link; refusing to follow it"
        return types.StoreError(reason, run_id=run_id)
    return open_failed(exc, run_id, f"the run file {path}")


def require_regular(files: FileOps, fd: int, run_id: str | None, path: Path) -> None:
    if not stat.S_ISREG(files.fstat(fd).st_mode):
        reason = f"the run file {path} is not a regular file (a directory or a special file)"
        raise types.StoreError(reason, run_id=run_id)


def cancel_text(request: types.CancelRequest) -> bytes:
    """What a run's cancel marker file holds: the request as one JSON object."""
    at = request.at.isoformat() if request.at else None
    fields = {"run_id": request.run_id, "by": request.by, "reason": request.reason, "at": at}
    return json.dumps(fields).encode()


def cancel_of(data: bytes, run_id: str, location: str) -> types.CancelRequest:
    """The request a cancel marker file holds, or ``CorruptLog``."""
    try:
        fields = json.loads(data)
        if fields["run_id"] != run_id:
            raise ValueError(f"it names the run {fields['run_id']!r}")
        by, reason, at = fields["by"], fields["reason"], fields["at"]
        if not isinstance(by, str) or not isinstance(reason, str) or not isinstance(at, str):
            raise TypeError("by, reason and at must be strings")
        return kept_cancel(run_id, by, reason, at)
    except (ValueError, KeyError, TypeError) as exc:
        why = f"unreadable cancel request: {type(exc).__name__}: {exc}"
        raise CorruptLog(why, run_id=run_id, location=location) from exc


def line(*bodies: str) -> bytes:
    """The line that holds one record, or an action's result and its step as a pair."""
    text = bodies[0] if len(bodies) == 1 else f"[{','.join(bodies)}]"
    return f"{text}\n".encode()


def log_lines(records: tuple[Record, ...]) -> bytes:
    """A whole log as its run file holds it: an action result shares its step's line."""
    lines: list[bytes] = []
    pending: Result | None = None
    for record in records:
        if isinstance(record, Result) and record.kind is types.IntentKind.ACTION:
            pending = record
        elif isinstance(record, StepRecord) and pending is not None:
            lines.append(line(dumps(pending), dumps(record, after=pending)))
            pending = None
        else:
            lines.append(line(dumps(record)))
    return b"".join(lines)


def records_of(pieces: Iterable[bytes], file_name: str, run_id: str) -> list[Record]:
    """The records of a run file's complete lines, given in order without their ``\\n``;
    ``file_name`` is how locations name the file: its full path, so a reader can open it."""
    records: list[Record] = []
    for number, piece in enumerate(pieces, start=1):
        location = f"{file_name}:{number}"
        try:
            decoded = decode_line(piece, location)
        except (CorruptLog, SchemaMajorMismatch) as exc:
            if exc.run_id is None:  # the codec cannot know which run the file is for
                raise type(exc)(exc.reason, run_id=run_id, location=location) from exc
            raise
        for record in decoded:
            if record.run_id != run_id:
                reason = f"the line holds a record of run {record.run_id!r}"
                raise CorruptLog(reason, run_id=run_id, location=location)
            records.append(record)
    return records


def decode_line(piece: bytes, location: str) -> list[Record]:
    """The records of one line (its ``\\n`` already removed): one, or a result and a step."""
    try:
        text = piece.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptLog(f"the line is not UTF-8: {exc}", location=location) from exc
    stripped = text.lstrip(_SPACE)
    if stripped.startswith("["):
        return list(_decode_pair(stripped, location))
    return [loads(text, location=location)]


def _decode_pair(text: str, location: str) -> tuple[Result, StepRecord]:
    """Read ``[result, step]``; each element is checked by the codec's own ``loads``, the
    step after the result, whose observation it may name."""
    parts: list[Record] = []
    position = 1
    for closer in (",", "]"):
        position = _skip_space(text, position)
        try:
            _, end = _DECODER.raw_decode(text, position)
        except (ValueError, RecursionError) as exc:
            raise CorruptLog(f"not a JSON record pair: {exc}", location=location) from exc
        parts.append(
            loads(text[position:end], location=location, after=parts[0] if parts else None)
        )
        position = _skip_space(text, end)
        if text[position : position + 1] != closer:
            reason = f"a record pair expects {closer!r} at column {position + 1}"
            raise CorruptLog(reason, location=location)
        position += 1
    if text[position:].strip(_SPACE):
        raise CorruptLog("text after a record pair", location=location)
    result, step = parts
    if not isinstance(result, Result) or not isinstance(step, StepRecord):
        raise CorruptLog("a record pair must hold a result and then a step", location=location)
    return result, step


def _skip_space(text: str, position: int) -> int:
    return len(text) - len(text[position:].lstrip(_SPACE))
