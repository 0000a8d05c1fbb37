"""The one sampler every benchmark uses: CPU time, memory, descriptors and event-loop lateness.

CPU: user + system seconds of a process, its threads included. Memory: the resident
set of this process as the kernel counts it (C allocations included), or the peak of
Python's own allocations during one piece of work (``tracemalloc``: only what Python
allocates, and tracing slows Python down, so a peak is measured in a pass of its own).
Lateness: how much longer than asked a ticker's sleeps take while other work shares the
event loop, which is what a program sharing that loop feels.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc

from bench._common import ROOT, settle

T = TypeVar("T")


def cpu_seconds(pid: int | None = None) -> float:
    """User + system seconds of this process (or of process ``pid``, from ``/proc``)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_named(word: str) -> set[int]:
    """The process ids of this process's children whose name holds ``word``."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, _, rest = stat.read_text().partition(") ")
        except OSError:  # the process ended while the directory was read
            continue
        if int(rest.split()[1]) == os.getpid() and word in name:
            found.add(int(stat.parent.name))
    return found


def resident_kib(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak so far (``VmHWM``), in KiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def open_descriptors() -> int:
    """How many files this process holds open (the listing's own one left out)."""
    return len(os.listdir("/proc/self/fd")) - 1


async def python_peak_bytes(work: Callable[[], Awaitable[Any]]) -> float:
    """Bytes of Python memory allocated at the peak of ``work``, above where it started."""
    settle()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        await work()
        return float(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()


def source_name(path: str) -> str:
    """A profiled source file as a table names it: by package, or by its place in the
    project, never by where it lies on this machine."""
    if path == "~":
        return "built-in functions (C)"
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if path.startswith(str(ROOT) + "/"):
        return path[len(str(ROOT)) + 1 :].removeprefix("src/")
    if "/lib/python3" in path:
        return path.rsplit("/lib/python3", 1)[1].lstrip("0123456789.").lstrip("/")
    return Path(path).name


class Ticker:
    """Sleeps ``period_s`` again and again and notes how late each wake-up was, calling
    ``on_tick`` after each (another sample taken at the same pace)."""

    def __init__(self, period_s: float, on_tick: Callable[[], None] | None = None) -> None:
        self.period_s = period_s
        self.on_tick = on_tick
        self.lateness_s: list[float] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        while True:
            asked = time.perf_counter()
            await anyio.sleep(self.period_s)
            self.lateness_s.append(max(0.0, time.perf_counter() - asked - self.period_s))
            if self.on_tick is not None:
                self.on_tick()


async def beside_ticker(
    work: Callable[[], Awaitable[T]], period_s: float, on_tick: Callable[[], None] | None = None
) -> tuple[T, Ticker]:
    """``work()``, with a :class:`Ticker` ticking on the same event loop until it returns."""
    ticker = Ticker(period_s, on_tick)
    async with anyio.create_task_group() as group:
        await group.start(ticker.run)
        result = await work()
        group.cancel_scope.cancel()
    return result, ticker


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted samples (interpolated, ``0.0`` for none)."""
    if len(ordered) < 2:
        return ordered[0] if ordered else 0.0
    return statistics.quantiles(ordered, n=100, method="inclusive")[round(q * 100) - 1]


def lateness_ms(samples_ms: list[float], prefix: str = "") -> dict[str, Any]:
    """The median, 99th percentile and largest of lateness samples, in milliseconds."""
    ordered = sorted(samples_ms)
    return {
        f"{prefix}p50_ms": quantile(ordered, 0.50),
        f"{prefix}p99_ms": quantile(ordered, 0.99),
        f"{prefix}max_ms": ordered[-1] if ordered else 0.0,
    }
