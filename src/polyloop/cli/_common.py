"""Small pieces every command shares: the user-error type, the consoles and the streams."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import TextIO

from rich.console import Console, RenderableType
from rich.measure import Measurement

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


# A model reply can hold half an emoji as a JSON escape ("\ud83d"): the log keeps the lone
# surrogate it decodes to, and no UTF-8 stream can take it as it is.
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its escape, ``\\ud83d``.

    Inside a JSON string the escape is JSON's own, so JSON output stays JSON and reads
    back to the same string.
    """
    return _LONE_SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


# What a string from a log must not print raw where the command lays out lines: control
# characters (C0, DEL, C1) could end or rewrite a line or send terminal commands;
# bidirectional formatting characters could reorder a line on screen; line and paragraph
# separators end a line for some readers. Any of them in a run id could forge an `ok` line.
_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}\u2028\u2029\ud800-\udfff]")
_UNSAFE_IN_BLOCK = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}\u2028\u2029\ud800-\udfff]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_field(text: str) -> str:
    """``text`` fit to print on one line among others (a run id, a stop reason, a name).

    Control characters (newline, tab and carriage return included), bidirectional
    formatting characters, line separators and lone surrogates are written as escapes
    (``\\n``, ``\\x1b``, ``\\u202e``), so the text cannot end the line it is on, start
    another, or reorder the line around it.
    """
    return _UNSAFE.sub(_escape, text)


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


def escape_block(text: str) -> str:
    """``text`` fit to print as a block of lines (an observation, a reply).

    As :func:`escape_field`, but newlines and tabs are kept: the view indents every line
    of the block, so a line of it cannot pass for a line of the view's own.
    """
    return _UNSAFE_IN_BLOCK.sub(_escape, text)


def editable_json(value: object, *, indent: int | None = None) -> str:
    """``value`` as JSON a person reads and may edit, safe to show as :func:`escape_block`
    text is: each character :func:`escape_field` escapes is written as JSON's own
    ``\\u`` escape, so the text, read back unchanged, is ``value`` exactly (lone
    surrogates included)."""
    text = json.dumps(value, ensure_ascii=False, indent=indent)
    # Outside its strings, JSON text holds only ASCII punctuation, digits, letters and the
    # indent's newlines; what is left to escape sits inside a string, where \\u is JSON.
    return _UNSAFE_IN_BLOCK.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


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
