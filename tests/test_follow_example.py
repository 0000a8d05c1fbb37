"""examples/follow_app.py: a web application follows a run over server-sent events, and a
client that reconnects with the last id it saw, across a restart of the server, gets
every record once."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "follow_app.py"

pytestmark = pytest.mark.slow  # a server process, started twice, and a run paced in seconds


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def serving(db: Path, port: int) -> Iterator[str]:
    """The example's server and its run, until the block ends (then stopped as by Ctrl-C)."""
    command = [sys.executable, str(EXAMPLE), "--db", str(db), "--port", str(port), "--pace", "1.0"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as server:
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            assert line.startswith("serving "), line
            yield line.split()[1].rsplit("/runs/", 1)[0]
        finally:
            server.send_signal(signal.SIGINT)
            _, err = server.communicate(timeout=30)
    assert server.returncode == 0, err


def events(
    base: str, last_seen: int, *, until: int | None = None
) -> list[tuple[str, int | None, dict[str, Any]]]:
    """One connection's events, as (event, id, data), sending ``last_seen`` as
    Last-Event-ID; closed after the event of id ``until`` if it is given."""
    got: list[tuple[str, int | None, dict[str, Any]]] = []
    headers = {"Last-Event-ID": str(last_seen)}
    for _ in range(100):  # the server may still be binding its port
        try:
            with httpx.stream(
                "GET", f"{base}/runs/demo/events", headers=headers, timeout=30
            ) as reply:
                assert reply.status_code == 200
                assert reply.headers["content-type"].startswith("text/event-stream")
                kind, position, data = "message", None, None
                for line in reply.iter_lines():
                    if line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("id: "):
                        position = int(line.removeprefix("id: "))
                    elif line.startswith("data: "):
                        data = json.loads(line.removeprefix("data: "))
                    elif line == "" and data is not None:
                        got.append((kind, position, data))
                        if until is not None and position == until:
                            return got
                        kind, position, data = "message", None, None
                return got
        except httpx.ConnectError:
            time.sleep(0.1)
    raise AssertionError("the server never answered")


def test_a_client_reconnecting_with_its_last_id_gets_every_record_once_across_a_restart(
    tmp_path: Path,
) -> None:
    db, port = tmp_path / "runs.db", _free_port()
    seen: list[tuple[str, int | None, dict[str, Any]]] = []
    with serving(db, port) as base:
        seen += events(base, 0, until=6)  # then the page is closed, and the server stops
    with serving(db, port) as base:  # started again: the run is resumed where it stopped
        while not any(kind == "end" for kind, _, _ in seen):
            last = max(position for _, position, _ in seen if position is not None)
            seen += events(base, last)  # as EventSource reconnects after each stream ends
        page = httpx.get(f"{base}/runs/%3Cb%3E", timeout=30)
        refused = httpx.get(f"{base}/runs/demo/events", headers={"Last-Event-ID": "x"}, timeout=30)
    records = [(position, data) for kind, position, data in seen if kind == "message"]
    positions = [position for position, _ in records]
    assert positions == list(range(1, len(positions) + 1))  # no gap, none twice
    kinds = [data["kind"] for _, data in records]
    assert kinds[0] == "run_started" and kinds[-1] == "run_ended"
    # The first server's run was cancelled when it stopped; the second resumed it.
    ends = [data["stop_reason"] for _, data in records if data["kind"] == "run_ended"]
    assert ends[0] == "cancelled" and ends[-1] == "submitted"
    observations = [data["observation"] for _, data in records if data["kind"] == "step"]
    assert observations[-1] == "accepted: lift-off"
    assert "<title>&lt;b&gt;</title>" in page.text and "<b>" not in page.text
    assert refused.status_code == 400
