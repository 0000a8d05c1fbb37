"""A store error that names the open-file limit a store hit, and what to do about it
(docs/stores.md#open-files-and-connections)."""

from __future__ import annotations

import errno
import os
import resource

from polyloop.types import StoreError


def open_files_error(exc: BaseException, run_id: str | None) -> StoreError | None:
    """A ``StoreError`` naming the open-file limit ``exc`` hit and what to do, or ``None``.
    SQLite says only "unable to open", so then the process tries to open a file itself."""
    number = getattr(exc, "errno", None)
    text = str(exc).lower()
    if number is None and not isinstance(exc, OSError):
        try:
            os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as probe:
            number = probe.errno
    if number == errno.ENFILE or "file table overflow" in text:
        what = (
            "too many open files on this machine (the system-wide limit, fs.file-max): "
            "raise it with `sysctl fs.file-max` or run fewer processes"
        )
    elif number == errno.EMFILE or "too many open files" in text:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        what = (
            f"too many open files (the process's open-file limit, RLIMIT_NOFILE = {soft}): "
            f"raise it with `ulimit -n` or run fewer concurrent runs per process"
        )
    else:
        return None
    error = StoreError(f"{what}; nothing was written, so the run can be resumed", run_id=run_id)
    error.__cause__ = exc
    return error


def open_failed(exc: OSError, run_id: str | None, what: str) -> StoreError:
    """A file (``what``, by its path) would not open: nothing was written."""
    error = open_files_error(exc, run_id) or StoreError(
        f"could not open {what}: {exc.strerror or exc}", run_id=run_id
    )
    error.__cause__ = exc
    return error
