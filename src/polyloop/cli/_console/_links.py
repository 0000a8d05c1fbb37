"""Links from a run's page to other tools: a tracing UI by the run's trace id, and the
Temporal Web UI by its workflow id (the run id), from templates given to
``polyloop serve``. Checked when the console starts, so a typo is one clear error, not
a broken link on every page."""

from __future__ import annotations

from dataclasses import dataclass
from string import Formatter
from urllib.parse import quote, urlsplit

from polyloop.cli._common import CliError
from polyloop.types import run_trace_id

PLACEHOLDERS = ("trace_id", "run_id")


@dataclass(frozen=True, slots=True)
class LinkTemplate:
    """An address with ``{trace_id}`` and ``{run_id}`` where a run's own go."""

    template: str

    @classmethod
    def parse(cls, text: str, flag: str) -> LinkTemplate:
        """The template ``text`` given to ``flag``, or a :class:`CliError` that names what
        is wrong: a placeholder other than ``{trace_id}`` and ``{run_id}`` (or one with a
        format or conversion), an unpaired brace, or an address that is not http(s)
        (a ``javascript:`` link would run in the console's page)."""
        try:
            parts = list(Formatter().parse(text))
        except ValueError as exc:
            raise CliError(f"{flag} {text!r}: {exc} (write a brace as {{{{ or }}}})") from None
        for _, name, spec, conversion in parts:
            if name is None:
                continue
            if name not in PLACEHOLDERS or spec or conversion:
                shown = "{" + name + (f"!{conversion}" if conversion else "")
                shown += f":{spec}}}" if spec else "}"
                raise CliError(
                    f"{flag} {text!r}: unknown placeholder {shown}; "
                    "a template may hold {trace_id} and {run_id} only"
                )
        if urlsplit(text).scheme.lower() not in ("http", "https"):
            raise CliError(f"{flag} {text!r}: not an http:// or https:// address")
        return cls(text)

    def link(self, run_id: str) -> str:
        """The address for ``run_id``: its id percent-encoded as one path segment (any
        character it holds), its trace id as 32 hex digits."""
        segment = quote(run_id.encode("utf-8", "surrogatepass"), safe="")
        return self.template.format(trace_id=run_trace_id(run_id), run_id=segment)


def parsed(text: str | None, flag: str) -> LinkTemplate | None:
    """The template given to ``flag``, if one was."""
    return None if text is None else LinkTemplate.parse(text, flag)
