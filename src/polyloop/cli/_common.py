"""Small pieces every command shares: the user-error type, the consoles and the streams."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import TextIO

from rich.console import Console, RenderableType
from rich.measure import Measurement

from polyloop._escaping import escape_field, escape_in_json_text, escape_surrogates
from polyloop._strict_json import (
    STRICT_JSON,
    FloatOverflow,
    IntegerTooLong,
    NotJsonNumber,
    RepeatedKey,
)
from polyloop.types import JSONValue

PROGRAM = "polyloop"
_MODULE_ENTRY = Path(__file__).resolve().parent.parent / "__main__.py"


def install_hint(extra: str) -> str:
    """How to add an extra: PolyLoop is installed from its checkout, not from an index."""
    return f"in the PolyLoop checkout, run pip install -e '.[{extra}]'"


def command_words() -> list[str]:
    """The words that start this command again, as the user can paste them.

    After an install into a virtual environment that is not activated, ``polyloop`` is
    not on PATH, so a printed ``polyloop ...`` would not run: then the hint names the
    script (``.venv/bin/polyloop``) or interpreter (``python -m polyloop``) that ran.
    """
    started = sys.argv[0] if sys.argv else ""
    if Path(started).name == PROGRAM:
        words, script = [started], started
    elif started and Path(started).resolve() == _MODULE_ENTRY:
        words, script = [sys.executable, "-m", PROGRAM], str(Path(sys.executable).parent / PROGRAM)
    else:
        return [PROGRAM]  # called in process, by a program of its own: the plain name
    on_path = shutil.which(PROGRAM)
    return [PROGRAM] if on_path is not None and _same_file(on_path, script) else words


def _same_file(one: str, other: str) -> bool:
    try:
        return os.path.samefile(one, other)
    except OSError:
        return False


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 1, no traceback."""


def console(stream: TextIO | None = None) -> Console:
    """A console on ``stream`` (standard output by default), with no auto-highlighting.

    Written to a file or a pipe, each line loses the trailing spaces rich pads table
    cells with, so that piped output compares and greps cleanly.
    """
    target = stream if stream is not None else sys.stdout
    if not target.isatty():
        target = TrailingSpaceStripper(target)
    return Console(file=target, highlight=False)


def shell_word(text: str) -> str:
    """``text`` as one word a POSIX shell reads back exactly, fit to print on one line.

    Plain text is quoted the usual way (``shlex.quote``). Text that :func:`escape_field`
    would escape (a control, bidirectional or separator character, a lone surrogate) is
    written in ANSI-C quotes instead (``$'a\\nb'``, understood by bash, zsh and ksh), with
    the same escapes: the terminal shows them, and the shell turns them back into the
    characters.
    """
    if escape_field(text) == text:
        return shlex.quote(text)
    return "$'" + escape_field(text.replace("\\", "\\\\").replace("'", "\\'")) + "'"


def edited_arguments(text: str) -> JSONValue:
    """The arguments a person edited, read as strictly as a model's tool call: one JSON
    object, and no key named twice in any object of it (JSON readers keep the last of
    two, so a line added above the key it means to replace would silently change
    nothing). ``ValueError`` saying what is wrong, for the person to read."""
    try:
        value: JSONValue = STRICT_JSON.decode(text)
    except RepeatedKey as exc:
        key = escape_field(exc.keys[0])
        raise ValueError(
            f"the arguments name the key '{key}' twice in one object: give each key once, "
            f"so that it is clear which value you mean"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"the arguments are not JSON: {exc}") from None
    except (NotJsonNumber, FloatOverflow, IntegerTooLong, RecursionError) as exc:
        raise ValueError(
            f"the arguments hold {_unloggable(exc)}, which the log cannot carry"
        ) from None
    if not isinstance(value, dict):
        raise ValueError("the arguments must be a JSON object")
    return value


def _unloggable(exc: Exception) -> str:
    if isinstance(exc, NotJsonNumber):
        return exc.word
    if isinstance(exc, FloatOverflow):
        return f"the number {exc.text:.40}"
    if isinstance(exc, IntegerTooLong):
        return f"a whole number of {exc.digits} digits"
    return "JSON nested too deeply"


def editable_json(value: object, *, indent: int | None = None) -> str:
    """``value`` as JSON a person reads and may edit, safe to show as :func:`escape_block`
    text is: each character :func:`escape_field` escapes is written as JSON's own
    ``\\u`` escape, so the text, read back unchanged, is ``value`` exactly (lone
    surrogates included)."""
    return escape_in_json_text(json.dumps(value, ensure_ascii=False, indent=indent))


@contextmanager
def escaped_output() -> Iterator[None]:
    """While open, all that goes to standard output and error has its surrogates escaped.

    Every command writes through these two streams, so no command can fail on text it
    read from a log, and none needs to escape it itself.
    """
    with (
        redirect_stdout(SurrogateEscaper(sys.stdout)),
        redirect_stderr(SurrogateEscaper(sys.stderr)),
    ):
        yield


class SurrogateEscaper(io.TextIOBase):
    """A text stream that writes to ``target`` with lone surrogates escaped."""

    def __init__(self, target: TextIO) -> None:
        super().__init__()
        self._target = target

    def write(self, text: str) -> int:
        self._target.write(escape_surrogates(text))
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()

    # Rich picks its characters (box lines or ASCII) by the stream's encoding. The base
    # class has a read-only property here, which its stubs declare as an attribute.
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._target.encoding


class TrailingSpaceStripper(io.TextIOBase):
    """A text stream that writes each complete line to ``target`` without trailing spaces."""

    def __init__(self, target: TextIO) -> None:
        super().__init__()
        self._target = target
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        if lines:
            self._target.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        # Rich ends what it prints with a newline; a line still open is written as it
        # is rather than held back, so nothing printed is ever lost.
        if self._partial:
            self._target.write(self._partial)
            self._partial = ""
        self._target.flush()

    def isatty(self) -> bool:
        return False


def print_unwrapped(out: Console, renderable: RenderableType) -> None:
    """Print ``renderable`` at its natural width, so none of its rows wraps.

    A console that is not a terminal renders at 80 columns; a table wider than that
    would wrap its rows, and a listing must keep one line per run.
    """
    natural = Measurement.get(out, out.options.update_width(100_000), renderable).maximum
    width = out.width
    out.width = max(width, natural)
    try:
        out.print(renderable)
    finally:
        out.width = width


def print_line(out: Console, text: RenderableType) -> None:
    """Print ``text`` without wrapping its lines.

    On a terminal a line too long is cut with an ellipsis; elsewhere (a file, a pipe)
    it is written whole.
    """
    if out.is_terminal:
        out.print(text, no_wrap=True, overflow="ellipsis")
    else:
        out.print(text, soft_wrap=True)
