"""The ``polyloop`` command.

``polyloop demo`` runs a complete agent on a durable store (and can crash and resume
it); ``polyloop runs``, ``show`` and ``verify`` list, display and check the runs any
PolyLoop program stored. See ``polyloop --help``.

The command needs the ``cli`` extra (``pip install -e '.[cli]'`` in the checkout, which
brings ``rich``); without it, it says so in one line and exits with status 1. Nothing in the
library imports this package.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ("main",)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        import rich  # noqa: F401 - only checking that the extra is installed
    except ImportError:
        # The console's extra holds rich too: one install must be enough for serve.
        extra = "web" if "serve" in words else "cli"
        print(
            "polyloop: error: the command needs the 'rich' package: in the PolyLoop checkout,"
            f" run pip install -e '.[{extra}]'",
            file=sys.stderr,
        )
        return 1
    from polyloop.cli._app import run_command

    return run_command(words)
