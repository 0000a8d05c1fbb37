"""Reading the JSON-lines store's run files: where the complete lines end, what they hold.

A record exists only once the ``\\n`` that ends its line is in the file; nothing else
ends a line (``\\r``, U+2028 and U+0085 are part of it). What follows the last ``\\n``
is a torn tail, a write whose caller was never told it succeeded: readers ignore it, even
when it is a whole JSON object, and the next claim cuts it off. A terminated line that
does not decode to a record of the run is a ``CorruptLog`` naming the file and the line
(from 1); a record of another format major is a ``SchemaMajorMismatch``. Research records
0009 (durability) and 0012 (the file-operation layer) say why.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from polyloop.serialization import dumps, loads
from polyloop.stores._common import open_failed, safe_name
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

SUFFIX = ".jsonl"
# O_NONBLOCK only matters if something other than a regular file was planted at the
# path (a FIFO would otherwise block the open); regular files ignore it.
COMMON_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CHUNK = 64 * 1024
_SPACE = " \t\r"  # what JSON skips between tokens on one line
_DECODER = json.JSONDecoder()


def complete_end(files: FileOps, fd: int) -> tuple[int, int]:
    """``(end of the last complete line, file size)``."""
    size = files.fstat(fd).st_size
    return _line_start(files, fd, size), size


def _line_start(files: FileOps, fd: int, end: int) -> int:
    """Just after the last ``\\n`` before ``end`` (0 if none), scanning back in chunks."""
    position = end
    while position > 0:
        start = max(0, position - _CHUNK)
        chunk = files.pread(fd, position - start, start)
        if len(chunk) != position - start:
            raise OSError(errno.EIO, "the run file shrank while it was being read")
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        position = start
    return 0


def last_end(files: FileOps, fd: int, end: int, location: str) -> RunEnded | None:
    """The end record on the last complete line (ending at ``end``), if that is one; a
    line that does not decode says ``None`` (whoever reads the whole log is told why)."""
    start = _line_start(files, fd, end - 1)
    line = files.pread(fd, end - 1 - start, start)
    if not line.lstrip(_SPACE.encode()).startswith(b"{"):
        return None  # a result-and-step pair, or not a record at all
    try:
        (record,) = decode_line(line, location)
    except (CorruptLog, SchemaMajorMismatch):
        return None
    return record if isinstance(record, RunEnded) else None


@contextmanager
def run_file(files: FileOps, path: Path, run_id: str | None) -> Iterator[int | None]:
    """A descriptor to read the run file at ``path`` (``None`` if there is none), closed
    after; a failed read is a ``StoreError`` naming the run (or else the file)."""
    try:
        fd = files.open(path, os.O_RDONLY | COMMON_FLAGS)
    except FileNotFoundError:
        yield None
        return
    except OSError as exc:
        raise cannot_open(exc, run_id) from exc
    try:
        require_regular(files, fd, run_id)
        yield fd
    except OSError as exc:
        if isinstance(exc, PolyLoopError):
            raise
        raise StoreError(
            f"could not read the run file: {exc}", run_id=run_id, location=path.name
        ) from exc
    finally:
        files.close(fd)


def read_file(files: FileOps, path: Path, run_id: str) -> bytes:
    """The whole file, or ``b""`` if there is none."""
    with run_file(files, path, run_id) as fd:
        return b"" if fd is None else _read_until(files, fd, None)


def _read_until(files: FileOps, fd: int, stop: bytes | None) -> bytes:
    """Read from the descriptor's position to the end, or until a chunk holds ``stop``."""
    chunks: list[bytes] = []
    while chunk := files.read(fd, 1024 * 1024):
        chunks.append(chunk)
        if stop is not None and stop in chunk:
            break
    return b"".join(chunks)


def first_run_id(files: FileOps, path: Path) -> str | None:
    """The run id of ``path``'s first complete line; ``None`` if it has none."""
    with run_file(files, path, None) as fd:
        if fd is None:
            return None  # removed while the directory was being listed
        head = _read_until(files, fd, b"\n")
    if b"\n" not in head:
        return None
    location = f"{path.name}:1"
    run_id = decode_line(head[: head.index(b"\n")], location)[0].run_id
    if f"{safe_name(run_id)}{SUFFIX}" != path.name:
        raise CorruptLog(
            "the file holds a run whose id does not match the file name",
            run_id=run_id,
            location=location,
        )
    return run_id


def cannot_open(exc: OSError, run_id: str | None) -> StoreError:
    """Why the run file would not open; a symbolic link is refused by name."""
    if exc.errno in (errno.ELOOP, errno.EMLINK):  # what O_NOFOLLOW reports for a link
        return StoreError("the run file is a symbolic link; refusing to follow it", run_id=run_id)
    return open_failed(exc, run_id, "the run file")


def require_regular(files: FileOps, fd: int, run_id: str | None) -> None:
    if not stat.S_ISREG(files.fstat(fd).st_mode):
        raise StoreError("the run file is not a regular file", run_id=run_id)


def line(bodies: Iterable[str]) -> bytes:
    """The line that holds records written as ``bodies``: one record alone, or an
    action's result and its step as a pair."""
    parts = list(bodies)
    text = parts[0] if len(parts) == 1 else f"[{','.join(parts)}]"
    return f"{text}\n".encode()


def log_lines(records: tuple[Record, ...]) -> bytes:
    """A whole log as its run file holds it: an action result shares its step's line."""
    lines: list[bytes] = []
    pending: Result | None = None
    for record in records:
        if isinstance(record, Result) and record.kind is IntentKind.ACTION:
            pending = record
        elif isinstance(record, StepRecord) and pending is not None:
            lines.append(line((dumps(pending), dumps(record))))
            pending = None
        else:
            lines.append(line((dumps(record),)))
    return b"".join(lines)


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
    stripped = text.lstrip(_SPACE)
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
    if text[position:].strip(_SPACE):
        raise CorruptLog("text after a record pair", location=location)
    result, step = parts
    if not isinstance(result, Result) or not isinstance(step, StepRecord):
        raise CorruptLog("a record pair must hold a result and then a step", location=location)
    return result, step


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in _SPACE:
        position += 1
    return position
