"""How text from a log is shown to a person, the same on every surface.

A log holds whatever a model or a file name put there. Shown raw, a control character
could end or rewrite the line a person reads, or send terminal commands; a
bidirectional formatting character could make a command read differently from what
will run; a line separator ends a line for some readers; a lone surrogate (half an
emoji, which JSON can carry) cannot be encoded at all. The command line, the web
console and Temporal's status all escape through these functions, so a proposal reads
the same wherever it is answered.
"""

from __future__ import annotations

import json
import re

from polyloop._shared import call_text
from polyloop.types import JSONValue

__all__ = (
    "escape_block",
    "escape_field",
    "escape_in_json_text",
    "escape_surrogates",
    "payload_text",
)

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
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


def escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate written as its escape, ``\\ud83d``.

    Inside a JSON string the escape is JSON's own, so JSON output stays JSON and reads
    back to the same string.
    """
    return _LONE_SURROGATE.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


def escape_field(text: str) -> str:
    """``text`` fit to show on one line among others (a run id, a stop reason, a call).

    Control characters (newline, tab and carriage return included), bidirectional
    formatting characters, line separators and lone surrogates are written as escapes
    (``\\n``, ``\\x1b``, ``\\u202e``), so the text cannot end the line it is on, start
    another, or reorder the line around it.
    """
    return _UNSAFE.sub(_escape, text)


def escape_block(text: str) -> str:
    """``text`` fit to show as a block of lines (an observation, a reply).

    As :func:`escape_field`, but newlines and tabs are kept: the views indent every line
    of the block, so a line of it cannot pass for a line of the view's own.
    """
    return _UNSAFE_IN_BLOCK.sub(_escape, text)


def escape_in_json_text(text: str) -> str:
    """JSON ``text`` with each character :func:`escape_block` would escape written as
    JSON's own ``\\u`` escape, so it reads back to the same value (lone surrogates
    included). Outside its strings, JSON text holds only ASCII punctuation, digits,
    letters and an indent's newlines: what is left to escape sits inside a string."""
    return _UNSAFE_IN_BLOCK.sub(lambda found: f"\\u{ord(found.group()):04x}", text)


def payload_text(payload: JSONValue) -> str:
    """A proposed or announced action's payload as one line, before escaping: a tool
    call as its action text reads (``name({arguments})``), anything else as JSON."""
    if isinstance(payload, dict) and isinstance(payload.get("name"), str):
        return call_text(str(payload["name"]), payload.get("arguments"))
    return json.dumps(payload, ensure_ascii=False, sort_keys=True)
