"""The file operations of the JSON-lines store, behind one narrow, replaceable object.

Everything the store does to the file system goes through an object with the methods of
:class:`FileOps`, so the power-loss tests can answer them from a model of a disk that
loses power, fails a write or fills up (research record 0012). :class:`OsFileOps` is the
real thing: each method calls the ``os`` function of the same name when it is called, so
a test that patches ``os`` still sees it. The store takes another one only through a
private keyword argument.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from polyloop.stores._byte_locks import lock_range, range_held, unlock_range
from polyloop.stores._common import fsync_directory

__all__ = ("FileOps", "OsFileOps")


class FileOps(Protocol):
    """What the JSON-lines store asks of a file system; errors are ``OSError``, and a
    descriptor means something only to the object that handed it out. The byte locks
    are those of :mod:`polyloop.stores._byte_locks`; closing a descriptor lets go of
    every lock its description holds."""

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int: ...

    def write(self, fd: int, data: bytes | memoryview) -> int: ...

    def read(self, fd: int, size: int) -> bytes: ...

    def pread(self, fd: int, size: int, offset: int) -> bytes: ...

    def fstat(self, fd: int) -> os.stat_result: ...

    def fsync(self, fd: int) -> None: ...

    def fsync_directory(self, directory: Path) -> None: ...

    def ftruncate(self, fd: int, length: int) -> None: ...

    def close(self, fd: int) -> None: ...

    def lock_range(self, fd: int, offset: int, run_id: str) -> None: ...

    def unlock_range(self, fd: int, offset: int) -> None: ...

    def range_held(self, fd: int, offset: int) -> bool: ...

    def unlink(self, path: Path) -> None: ...

    def mkdir(self, path: Path) -> None: ...

    def is_dir(self, path: Path) -> bool: ...

    def listdir(self, directory: Path) -> list[str]: ...


class OsFileOps:
    """The operating system's own file operations, unchanged."""

    __slots__ = ()

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    def read(self, fd: int, size: int) -> bytes:
        return os.read(fd, size)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_directory(self, directory: Path) -> None:
        fsync_directory(directory)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def close(self, fd: int) -> None:
        os.close(fd)

    def lock_range(self, fd: int, offset: int, run_id: str) -> None:
        lock_range(fd, offset, run_id)

    def unlock_range(self, fd: int, offset: int) -> None:
        unlock_range(fd, offset)

    def range_held(self, fd: int, offset: int) -> bool:
        return range_held(fd, offset)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def is_dir(self, path: Path) -> bool:
        return os.path.isdir(path)

    def listdir(self, directory: Path) -> list[str]:
        return os.listdir(directory)
