"""The store and the run that the child-process agents share.

``kit/kill_agent.py``, ``kit/open_files_agent.py`` and ``kit/paused_worker_agent.py`` each open the
store their parent names on the command line and drive one JSON-action run of a scripted
model; only the script, the tools, the step budget, the instructions and the model's
replay policy differ, so the rest is built once, here, as is the synced side file in
which their effects are noted.
"""

from __future__ import annotations

import os

from kit.agent import definition, request
from polyloop import (
    Budget,
    Definition,
    Message,
    ModelClient,
    Replay,
    Request,
    Role,
    Store,
    ToolRegistry,
)


def open_store(spec: str, *, lease_s: float = 3.0) -> Store:
    """The store ``spec`` names: ``jsonl:DIR``, ``sqlite:FILE`` or a PostgreSQL conninfo
    (whose claims hold for ``lease_s`` seconds without a renewal)."""
    from polyloop.stores import JsonlStore, PostgresStore, SqliteStore

    if spec.startswith("jsonl:"):
        return JsonlStore(spec.removeprefix("jsonl:"))
    if spec.startswith("sqlite:"):
        return SqliteStore(spec.removeprefix("sqlite:"))
    # A short lease: a killed worker's runs are free once a sixth of it is left (research
    # record 0034), so the next process resumes them within a few seconds.
    return PostgresStore(spec, lease_s=lease_s)


def build(
    store: Store,
    run_id: str,
    model: ModelClient,
    registry: ToolRegistry,
    *,
    max_steps: int,
    instructions: str,
    model_replay: Replay = Replay.ALLOWED,
) -> tuple[Definition, Request]:
    """A run of ``model`` with ``registry``'s tools, to be run or resumed as given."""
    return definition(store, model=model), request(
        run_id,
        registry,
        budget=Budget(max_steps=max_steps, max_valid_steps=max_steps, max_context_chars=100_000),
        run_context=(Message.text(Role.SYSTEM, instructions),),
        goal_context=(Message.text(Role.USER, "Go."),),
        binding={},
        model_replay=model_replay,
        cancel_grace_s=1.0,
    )


def append_synced(path: str, line: str) -> None:
    """Append ``line`` to the side file ``path`` and sync it before returning.

    The side file lives outside the store: what a child noted there happened, whatever
    becomes of the child (killed, stopped) or of its store's records afterwards.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def stopped_or_ended(pid: int) -> str | None:
    """``"stopped"`` or ``"ended"`` once child ``pid`` is either, else ``None``; the child
    is left for its owner (anyio) to reap. Nothing wakes a parent when its child stops,
    so callers poll this."""
    try:
        change = os.waitid(os.P_PID, pid, os.WSTOPPED | os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: it ended
        return "ended"
    if change is None:
        return None
    return "stopped" if change.si_code == os.CLD_STOPPED else "ended"
