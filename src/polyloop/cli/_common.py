"""Small pieces every command shares: the user-error type and the consoles."""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console, RenderableType
from rich.measure import Measurement

PROGRAM = "polyloop"


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 1, no traceback."""


def console(stream: TextIO | None = None) -> Console:
    """A console on ``stream`` (standard output by default), with no auto-highlighting."""
    return Console(file=stream if stream is not None else sys.stdout, highlight=False)


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
