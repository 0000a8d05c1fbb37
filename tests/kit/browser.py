"""The distribution's Chromium for the tests that render pages in a real browser.

It is never downloaded: CI installs the distribution's package, and Playwright launches
it by path.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from playwright.sync_api import Browser, sync_playwright


def chromium() -> str:
    """The browser; missing, the test fails under CI (which installs it) and skips elsewhere."""
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed; CI installs it before the tests")
        pytest.skip("chromium is not installed")
    return found


@contextmanager
def launched() -> Iterator[Browser]:
    """The browser, headless, driven by Playwright; closed at the end of the block."""
    executable = chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        try:
            yield browser
        finally:
            browser.close()
