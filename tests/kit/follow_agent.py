"""A child process that follows one run in another process's store, for the crash tests:

    python tests/kit/follow_agent.py STORE RUN_ID OUT_FILE BACKEND

It waits for the run to exist, then follows it from the start until the first end record,
reconnecting every few records with the last position it saw, as a client whose connection
drops would. Each record it is given is appended to OUT_FILE as ``position<TAB>record``
(the record in the log's canonical JSON), flushed at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run by path: the folder above kit/ leads the path, not kit/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from contextlib import aclosing

import anyio

from kit import child_agent
from polyloop import RunEnded, RunNotFound, follow, serialization

RECONNECT_EVERY = 3


async def main(spec: str, run_id: str, out_file: str) -> None:
    store = child_agent.open_store(spec)
    position, ended = 0, False
    try:
        async with await anyio.open_file(out_file, "a", encoding="utf-8") as out:
            with anyio.fail_after(120):
                while not ended:
                    try:
                        async with aclosing(follow(store, run_id, after=position)) as followed:
                            async for item in followed:
                                position = item.position
                                text = serialization.dumps(item.record)
                                await out.write(f"{position}\t{text}\n")
                                await out.flush()
                                ended = isinstance(item.record, RunEnded)
                                if position % RECONNECT_EVERY == 0:
                                    break  # as if the connection dropped: call again
                    except RunNotFound:
                        await anyio.sleep(0.02)  # not started yet
    finally:
        await store.aclose()  # type: ignore[attr-defined]


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:4], backend=sys.argv[4])
