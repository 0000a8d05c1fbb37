"""Markdown code fences in a model's reply, found the way a Markdown reader finds them.

A fence opens on a line of three or more backticks (indented by at most three spaces)
followed by an optional info string without backticks; its first word is the block's
language tag. The block closes on a line of at least as many backticks and nothing
else. A line such as ```` ```json {"a": 1}``` ```` is inline code, not a fence, since
its info string would hold backticks. Tilde fences are not recognised: models write
backticks, and one spelling keeps the rules short.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPENING = re.compile(r"^ {0,3}(?P<ticks>`{3,})(?P<info>[^`]*)$")
_CLOSING = re.compile(r"^ {0,3}(?P<ticks>`{3,})[ \t]*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class FencedBlock:
    """One fenced block: its tag, its text, and where it sits (lines count from 1).

    ``body`` is the lines between the fences, each ending in a newline. ``closing_line``
    is ``None`` for a block whose closing fence never came.
    """

    tag: str
    body: str
    opening_line: int
    closing_line: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FenceScan:
    """Every fenced block of a text, and the text after the last closed one.

    ``unclosed`` is a block still open at the end of the text (it is not in
    ``blocks``). ``after`` is everything after the last closing fence, or the whole
    text when there is no closed block.
    """

    blocks: tuple[FencedBlock, ...]
    unclosed: FencedBlock | None
    after: str


def scan_fences(text: str) -> FenceScan:
    """Find the fenced blocks of ``text``."""
    lines = text.split("\n")
    blocks: list[FencedBlock] = []
    after_start = 0
    index = 0
    while index < len(lines):
        opening = _OPENING.match(lines[index].rstrip("\r"))
        if opening is None:
            index += 1
            continue
        ticks = len(opening.group("ticks"))
        info = opening.group("info").split()
        tag = info[0] if info else ""
        body: list[str] = []
        closing_index: int | None = None
        for inner in range(index + 1, len(lines)):
            closing = _CLOSING.match(lines[inner].rstrip("\r"))
            if closing is not None and len(closing.group("ticks")) >= ticks:
                closing_index = inner
                break
            body.append(lines[inner])
        block = FencedBlock(
            tag=tag,
            body="".join(f"{line}\n" for line in body),
            opening_line=index + 1,
            closing_line=None if closing_index is None else closing_index + 1,
        )
        if closing_index is None:
            return FenceScan(blocks=tuple(blocks), unclosed=block, after=_join(lines, after_start))
        blocks.append(block)
        after_start = closing_index + 1
        index = closing_index + 1
    return FenceScan(blocks=tuple(blocks), unclosed=None, after=_join(lines, after_start))


def _join(lines: list[str], start: int) -> str:
    return "\n".join(lines[start:])


def clip(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters: feedback must not echo a whole reply back."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…"
