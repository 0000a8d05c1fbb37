"""``python -m polyloop``: the same as the ``polyloop`` command."""

import sys

from polyloop.cli import main

if __name__ == "__main__":
    sys.exit(main())
