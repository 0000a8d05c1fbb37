"""The approvals example's worker on any store the command line names, PostgreSQL too.

    python approvals_worker_agent.py STORE EFFECTS BACKEND RUN_ID [--auto-approve]
        [--crash-after-paying]

It drives the run ``RUN_ID`` once, as ``examples/approvals.py`` does (the same model,
tools and request, taken from the example itself), but on ``STORE`` (``sqlite:PATH``,
``postgresql://...``) instead of the example's SQLite file, appending every side effect
to ``EFFECTS``, and prints what the example prints.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import anyio

from polyloop import RunResult, start_or_resume
from polyloop.cli._stores import open_store, parse_store

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "approvals.py"


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
    async with open_store(parse_store(args.store), create=True) as store:
        definition, request = approvals.build(store, args.run_id, tools)
        return await start_or_resume(definition, request)


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
