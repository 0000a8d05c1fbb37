"""The one way the stores for one host reach the file system, so that a test can put a
model of a disk in its place (docs/stores.md#durability-at-a-glance)."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from polyloop.stores import _paths
from polyloop.types import RunLocked, StoreError

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux


class FileOps(_paths.DirectoryOps, Protocol):
    """What the stores for one host ask of a file system; errors are ``OSError``, and
    ``lock_range`` raises ``RunLocked`` when another open description holds the byte;
    ``wait_range`` waits for it."""

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int: ...
    def close(self, fd: int) -> None: ...
    def lock_range(self, fd: int, offset: int, run_id: str) -> None: ...
    def wait_range(self, fd: int, offset: int) -> None: ...
    def unlock_range(self, fd: int, offset: int) -> None: ...
    def range_held(self, fd: int, offset: int) -> bool: ...
    def write(self, fd: int, data: bytes | memoryview) -> int: ...
    def read(self, fd: int, size: int) -> bytes: ...
    def pread(self, fd: int, size: int, offset: int) -> bytes: ...
    def fstat(self, fd: int) -> os.stat_result: ...
    def fsync(self, fd: int) -> None: ...
    def ftruncate(self, fd: int, length: int) -> None: ...
    def unlink(self, path: Path) -> None: ...
    def replace(self, source: Path, target: Path) -> None: ...
    def listdir(self, directory: Path) -> list[str]: ...


def write_all(files: FileOps, fd: int, data: bytes) -> None:
    """Write all of ``data``: a write may take only part of it."""
    view = memoryview(data)
    while view:
        if (written := files.write(fd, view)) <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        view = view[written:]


def _os(name: str) -> Callable[..., Any]:
    """A method that calls ``os.<name>``, looked up at each call: a test may patch ``os``."""
    return lambda self, *args: getattr(os, name)(*args)


class OsFileOps:
    """The operating system's file operations, each ``os`` function looked up when called.
    A byte lock belongs to the open file description (``F_OFD_SETLK``)."""

    __slots__ = ()

    open = _os("open")
    write = _os("write")
    read = _os("read")
    pread = _os("pread")
    fstat = _os("fstat")
    fsync = _os("fsync")
    ftruncate = _os("ftruncate")
    close = _os("close")
    unlink = _os("unlink")
    replace = _os("replace")
    mkdir = _os("mkdir")
    listdir = _os("listdir")

    def fsync_directory(self, directory: Path) -> None:
        _paths.fsync_directory(directory)

    def is_dir(self, path: Path) -> bool:
        return os.path.isdir(path)

    def lock_range(self, fd: int, offset: int, run_id: str) -> None:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, offset))
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLocked("another writer holds this run", run_id=run_id) from None
            raise StoreError(f"could not lock the run: {exc}", run_id=run_id) from exc

    def wait_range(self, fd: int, offset: int) -> None:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK, offset))

    def unlock_range(self, fd: int, offset: int) -> None:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, offset))

    def range_held(self, fd: int, offset: int) -> bool:
        answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_RDLCK, offset))
        return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)


def _flock(kind: int, offset: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0)
