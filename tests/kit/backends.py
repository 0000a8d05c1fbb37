"""Which event-loop backends a case runs under in the quick run.

``tests/conftest.py`` runs every async case under asyncio and Trio. A file whose cases do
the same under either backend takes its backends from :data:`TRIO_SLOW` (its Trio cases
run with ``--run-slow``); its cases where the event loop matters (a whole run, a request
cancelled in flight, concurrent runs) take :data:`BOTH_BACKENDS` and stay quick under
both (research-wiki/0044 and 0065).
"""

from __future__ import annotations

import pytest

TRIO_SLOW = ("asyncio", pytest.param("trio", marks=pytest.mark.slow))
BOTH_BACKENDS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
