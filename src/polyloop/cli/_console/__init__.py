"""``polyloop serve``: a web console over a store, for the people who operate its runs.

It lists every run with its state, shows one run as ``polyloop show`` does, and lets a
person approve, reject or settle what waits for one, through the same public calls as
the command line. It needs the ``web`` extra (Starlette, Jinja2, python-multipart and
Hypercorn).
"""

from __future__ import annotations

from polyloop.cli._console._guard import Access, exposure_problem
from polyloop.cli._console._links import LinkTemplate
from polyloop.cli._console._links import parsed as parsed_link
from polyloop.cli._console._web import Settings, create_app, run_path

__all__ = (
    "Access",
    "LinkTemplate",
    "Settings",
    "create_app",
    "exposure_problem",
    "parsed_link",
    "run_path",
)
