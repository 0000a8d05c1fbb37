"""The approvals example's worker on any store the command line names, PostgreSQL too.

    python tests/kit/approvals_worker_agent.py STORE EFFECTS BACKEND RUN_ID [--auto-approve]
        [--crash-after-paying]

It drives the run ``RUN_ID`` once, as ``examples/approvals.py`` does (the same model,
tools and request, taken from the example itself), but on ``STORE`` (``sqlite:PATH``,
``postgresql://...``) instead of the example's SQLite file, appending every side effect
to ``EFFECTS``, and prints what the example prints.
"""

from __future__ import annotations

import argparse
import importlib.util
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import ModuleType

import anyio

from polyloop import ManagedStore, RunResult, start_or_resume
from polyloop.cli._stores import open_store, parse_store
from polyloop.stores import PostgresStore

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "approvals.py"
LEASE_S = 2.0


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("approvals_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def drive(approvals: ModuleType, args: argparse.Namespace) -> RunResult:
    tools = approvals.make_tools(
        Path(args.effects),
        auto_approve=args.auto_approve,
        crash_after_paying=args.crash_after_paying,
    )
    async with _opened(args.store) as store:
        definition, request = approvals.build(store, args.run_id, tools)
        return await start_or_resume(definition, request)


def _opened(store: str) -> AbstractAsyncContextManager[ManagedStore]:
    """The store, with a short lease on PostgreSQL: a worker that dies there holds its
    runs until its lease lapses, and the tests take its runs over after it."""
    if store.startswith("postgresql"):
        return PostgresStore(store, lease_s=LEASE_S)
    return open_store(parse_store(store), create=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("effects")
    parser.add_argument("backend", choices=("asyncio", "trio"))
    parser.add_argument("run_id")
    parser.add_argument("--auto-approve", action="store_true")
    parser.add_argument("--crash-after-paying", action="store_true")
    args = parser.parse_args()
    approvals = example()
    approvals.show(anyio.run(drive, approvals, args, backend=args.backend))


if __name__ == "__main__":
    main()
