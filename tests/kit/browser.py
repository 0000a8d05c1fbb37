"""The distribution's Chromium for the tests that render pages in a real browser.

It is never downloaded: CI installs the distribution's package, and Playwright launches
it by path.
"""

from __future__ import annotations

import os
import shutil

import pytest


def chromium() -> str:
    """The browser; missing, the test fails under CI (which installs it) and skips elsewhere."""
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed; CI installs it before the tests")
        pytest.skip("chromium is not installed")
    return found
