"""Giving a claim back when the claim's caller fails as its thread finishes.

The claim ran in a worker thread and took the run; if the await then raises, the store
must give the claim back, and must not hold the caller's error or cancellation up for
longer than a bounded grace while it does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest

from polyloop.stores import _engine

pytestmark = pytest.mark.anyio


class _AfterTheThread(Exception):
    """What the await raises once the claim's thread has finished."""


def _fail_the_first_call_after_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    real = anyio.to_thread.run_sync
    calls = 0

    async def run_sync(function: Callable[..., Any], *args: Any, **options: Any) -> Any:
        nonlocal calls
        calls += 1
        result = await real(function, *args, **options)
        if calls == 1:
            raise _AfterTheThread
        return result

    monkeypatch.setattr(anyio.to_thread, "run_sync", run_sync)


async def test_a_claim_whose_await_fails_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    held: set[str] = set()
    _fail_the_first_call_after_it_ran(monkeypatch)
    with pytest.raises(_AfterTheThread):
        await _engine.claim_in_thread(lambda: held.add("r"), lambda: held.discard("r"), run_id="r")
    assert held == set()


async def test_a_claim_that_failed_before_taking_the_run_gives_nothing_back() -> None:
    released: list[str] = []

    def claim() -> None:
        raise OSError("no room")

    with pytest.raises(OSError, match="no room"):
        await _engine.claim_in_thread(claim, lambda: released.append("r"), run_id="r")
    assert released == []


async def test_a_slow_release_holds_the_caller_up_for_the_grace_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the grace the caller gets its error back; the release still finishes."""
    grace_s = 0.2
    monkeypatch.setattr(_engine, "RELEASE_GRACE_S", grace_s)
    _fail_the_first_call_after_it_ran(monkeypatch)
    may_finish = threading.Event()
    released = threading.Event()

    def release() -> None:
        may_finish.wait(30)
        released.set()

    began = anyio.current_time()
    try:
        with pytest.raises(_AfterTheThread):
            await _engine.claim_in_thread(lambda: None, release, run_id="r")
        waited = anyio.current_time() - began
        assert grace_s <= waited < 10 * grace_s
        assert not released.is_set()
        assert "run 'r': giving its claim back took over 0.2 s" in caplog.text
    finally:
        may_finish.set()
    await anyio.to_thread.run_sync(released.wait, 30)
    assert released.is_set()
