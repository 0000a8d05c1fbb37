"""The one CPU and memory sampler every benchmark uses.

CPU: user + system seconds of a process, its threads included. Memory: the resident
set of this process as the kernel counts it (C allocations included), or the peak of
Python's own allocations during one piece of work (``tracemalloc``: only what Python
allocates, and tracing slows Python down, so a peak is measured in a pass of its own).
"""

from __future__ import annotations

import os
import resource
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._common import settle


def cpu_seconds(pid: int | None = None) -> float:
    """User + system seconds of this process (or of process ``pid``, from ``/proc``)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
