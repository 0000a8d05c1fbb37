"""A worker process for the lease tests: it drives one run and can be stopped mid-effect.

Run as a script::

    python tests/kit/lease.py CONNINFO SCHEMA RUN_ID WHERE LEASE_S LEDGER MARKER

The worker starts the run ``RUN_ID`` on a PostgreSQL store (the store whose claims have
leases) with the given lease. When the run enters its model call (``WHERE=model``) or its tool
(``WHERE=tool``), the worker creates the file ``MARKER`` and then waits in that effect
for a while, so that the test can stop the process there (``SIGSTOP``), let its lease
run out, take the run over, and let it go on (``SIGCONT``). The tool notes each of its
executions in ``LEDGER`` before it returns. The worker prints the run's stop reason, or
``refused`` and the error if the store refused one of its writes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import anyio

from kit import one_writer
from polyloop import (
    ModelCall,
    ModelReply,
    Replay,
    RunLocked,
    Store,
    StoreError,
    run,
)

# How long a held effect waits: longer than any lease the tests use.
HOLD_S = 3.0


class HeldModel(one_writer.Model):
    """The one-writer model, which waits in its first call once it has said so."""

    def __init__(self, note: one_writer.Note, marker: Path | None) -> None:
        super().__init__(note)
        self.marker = marker

    async def call(self, call: ModelCall) -> ModelReply:
        if self.marker is not None and not await anyio.Path(self.marker).exists():
            await anyio.Path(self.marker).touch()
            await anyio.sleep(HOLD_S)
        return await super().call(call)


def held_tools(note: one_writer.Note, marker: Path | None) -> Any:
    """The one-writer tool (replay never), which waits once it has said so."""

    class Hold(one_writer.Gate):
        async def hold(self) -> None:
            if marker is not None:
                await anyio.Path(marker).touch()
                await anyio.sleep(HOLD_S)

    return one_writer.tools(note, Replay.NEVER, Hold())


def open_store(location: str, schema: str, lease_s: float) -> Store:
    from polyloop.stores import PostgresStore

    return PostgresStore(location, schema=schema, lease_s=lease_s)


def definition(store: Store, note: one_writer.Note, model: one_writer.Model) -> Any:
    from polyloop import Definition, NullSink
    from polyloop.testing import JsonActionInterpreter

    return Definition(
        model=model,
        interpreter=JsonActionInterpreter(),
        store=store,
        events=NullSink(),
        texts=one_writer.TEXTS,
    )


async def _worker(argv: list[str]) -> str:
    location, schema, run_id, where, lease_s, ledger, marker = argv
    note = one_writer.file_note(ledger)
    store = open_store(location, schema, float(lease_s))
    model = HeldModel(note, Path(marker) if where == "model" else None)
    registry = held_tools(note, Path(marker) if where == "tool" else None)
    try:
        result = await run(
            definition(store, note, model), one_writer.request(run_id, registry, Replay.ALLOWED)
        )
    except (RunLocked, StoreError) as exc:
        return f"refused {type(exc).__name__}: {exc}"
    finally:
        await store.aclose()  # type: ignore[attr-defined]
    return result.stop_reason.value


if __name__ == "__main__":
    print(anyio.run(_worker, sys.argv[1:]), flush=True)
