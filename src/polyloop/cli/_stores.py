"""STORE arguments: ``jsonl:DIR``, ``sqlite:FILE``, ``postgresql://...``, and opening them."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio.to_thread

from polyloop.cli._common import CliError, install_hint
from polyloop.ports import ManagedStore
from polyloop.types import StoreError

Kind = Literal["jsonl", "sqlite", "postgresql"]

# Seconds to wait for a PostgreSQL server before giving up (the store's own default
# suits long-running workers, not a command someone is waiting on).
POSTGRES_TIMEOUT_S = 10.0
_POSTGRES_PREFIXES = ("postgresql://", "postgres://")
_PASSWORD = re.compile(r"(://[^:/@]*):[^@/]*@")
SYNTAX = "jsonl:DIR, sqlite:FILE or postgresql://..."


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A parsed STORE argument. ``text`` is what the user wrote; ``schema`` is the
    PostgreSQL schema (``None``: the store's default)."""

    kind: Kind
    location: str
    text: str
    schema: str | None = None

    @property
    def shown(self) -> str:
        """The argument as it may appear in messages: any password is masked."""
        return _masked(self.text)


def parse_store(text: str) -> StoreSpec:
    """Parse a STORE argument; ``CliError`` for an unknown scheme or a missing path."""
    if text.startswith(_POSTGRES_PREFIXES):
        return StoreSpec("postgresql", text, text)
    scheme, colon, rest = text.partition(":")
    if not colon or scheme not in ("jsonl", "sqlite"):
        raise CliError(f"unknown store scheme in {_masked(text)!r}: write {SYNTAX}")
    if not rest:
        what = "directory" if scheme == "jsonl" else "file"
        raise CliError(f"{text!r} names no {what}: write {scheme}:{what.upper()}")
    kind: Kind = "jsonl" if scheme == "jsonl" else "sqlite"
    return StoreSpec(kind, rest, text)


def _masked(text: str) -> str:
    return _PASSWORD.sub(r"\1:***@", text)


def with_schema(spec: StoreSpec, schema: str | None) -> StoreSpec:
    """``spec`` with the PostgreSQL schema given by ``--schema``; refused for other stores."""
    if schema is None:
        return spec
    if spec.kind != "postgresql":
        raise CliError(f"--schema names a PostgreSQL schema; {spec.shown} is a {spec.kind} store")
    if not schema or len(schema.encode()) > 63 or "\x00" in schema:
        raise CliError(f"--schema {schema!r}: a schema name has 1 to 63 bytes and no NUL")
    return StoreSpec(spec.kind, spec.location, spec.text, schema)


def require_existing(spec: StoreSpec) -> None:
    """Refuse a JSONL directory or SQLite file that is not there (never create one).
    Blocking (it looks at the file system): call it in a worker thread."""
    path = Path(spec.location)
    if spec.kind == "jsonl" and not path.exists():
        raise CliError(f"no JSONL store at {spec.location}: the directory does not exist")
    if spec.kind == "sqlite" and not path.exists():
        raise CliError(f"no SQLite store at {spec.location}: the file does not exist")
    problem = wrong_kind(spec)
    if problem is not None:
        raise CliError(problem)


def wrong_kind(spec: StoreSpec) -> str | None:
    """What is wrong with what is at a JSONL or SQLite store's path, if it is there and is
    not what the store needs (a file for a JSONL directory, a directory for a database)."""
    path = Path(spec.location)
    if spec.kind == "jsonl" and path.exists() and not path.is_dir():
        return f"{spec.location} is {_what(path)}, not a directory of JSONL run logs"
    if spec.kind == "sqlite" and path.exists() and not path.is_file():
        return f"{spec.location} is {_what(path)}, not a SQLite database file"
    return None


def _what(path: Path) -> str:
    """What is at ``path``, in the words a message needs."""
    if path.is_dir():
        return "a directory"
    return "a file" if path.is_file() else "a special file (not a regular file)"


@asynccontextmanager
async def open_store(spec: StoreSpec, *, create: bool = False) -> AsyncIterator[ManagedStore]:
    """The store ``spec`` names, open for the length of the ``async with`` block.

    Only with ``create`` may a database store that is not there be made (the demo's);
    every other command works on an existing one, so a mistyped name is an error, not a
    new, empty store. A JSONL directory is checked by :func:`require_existing`.
    """
    store = _build(spec, create=create)
    try:
        if spec.kind == "postgresql":
            await anyio.to_thread.run_sync(_probe_postgres, spec)
        try:
            # Opened now, so that a missing store is named as such, not as a run's error.
            await store.__aenter__()
        except StoreError as exc:
            if create:  # the demo's own store: the store is to blame, not the run
                raise CliError(f"cannot open the store {spec.shown}: {exc}") from None
            if spec.kind != "postgresql":
                raise  # its message names the file already
            raise CliError(f"{spec.shown}: {exc}") from None
        yield store
    finally:
        await store.aclose()


def _build(spec: StoreSpec, *, create: bool) -> ManagedStore:
    if spec.kind == "jsonl":
        from polyloop.stores import JsonlStore

        return JsonlStore(spec.location)
    if spec.kind == "sqlite":
        from polyloop.stores import SqliteStore

        return SqliteStore(spec.location, create=create)
    try:
        from polyloop.stores import PostgresStore
    except ImportError:
        raise CliError(f"a postgresql:// store needs psycopg: {install_hint('postgres')}") from None
    if spec.schema is None:
        return PostgresStore(spec.location, timeout=POSTGRES_TIMEOUT_S, create=create)
    return PostgresStore(
        spec.location, schema=spec.schema, timeout=POSTGRES_TIMEOUT_S, create=create
    )


def _probe_postgres(spec: StoreSpec) -> None:
    """Connect once, so that an unreachable server is one clear error, not a long wait."""
    import psycopg

    try:
        with psycopg.connect(spec.location, connect_timeout=int(POSTGRES_TIMEOUT_S)):
            pass
    except psycopg.Error as exc:
        raise CliError(f"cannot connect to {spec.shown}: {exc}") from None
