"""Where the stores for one host keep their files: names no run id can break out of, and
directories that survive a power loss (docs/stores.md#missing-directories)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Protocol

from polyloop.stores._open_files import open_files_error
from polyloop.types import StoreError


def safe_name(run_id: str) -> str:
    """A file name for ``run_id`` that cannot leave its directory or collide: a readable
    prefix (at most 40 safe characters, no leading dot) and the sha256 of the full id."""
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()
    prefix = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_id)[:40].lstrip(".")
    return f"{prefix}-{digest}" if prefix else digest


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectoryOps(Protocol):
    def mkdir(self, path: Path) -> None: ...
    def is_dir(self, path: Path) -> bool: ...
    def fsync_directory(self, directory: Path) -> None: ...


def create_directories(files: DirectoryOps, directory: Path, *, run_id: str | None) -> None:
    """Create ``directory`` and its missing parents, each synced into its parent (a lost
    directory takes its files along); a ``StoreError`` names a path that cannot be made."""
    missing: list[Path] = []
    current = directory
    while not files.is_dir(current) and current != current.parent:
        missing.append(current)
        current = current.parent
    try:
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by someone else meanwhile
                files.mkdir(path)
            if not files.is_dir(path):  # a file is in the way: name it, not the system's words
                reason = in_the_way(path) or f"{path} is not a directory"
                if path != directory:
                    reason = f"cannot create the directory {directory}: {reason}"
                raise StoreError(reason, run_id=run_id)
            files.fsync_directory(path.parent)
    except OSError as exc:
        if isinstance(exc, StoreError):
            raise
        reason = exc.strerror or type(exc).__name__
        raise open_files_error(exc, run_id) or StoreError(
            f"cannot create the directory {path}: {reason}", run_id=run_id
        ) from exc


def in_the_way(directory: Path) -> str | None:
    """Why ``directory`` cannot be made, if a path on the way to it is not a directory."""
    for path in (directory, *directory.parents):
        if path.is_dir():
            return None
        if path.exists():
            what = "a file" if path.is_file() else "something other than a directory"
            return f"{path} is {what}, not a directory"
    return None
