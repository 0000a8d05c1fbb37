"""The store and the run that the child-process agents share.

``kill_agent.py`` and ``open_files_agent.py`` each open the store their parent names on
the command line and drive one JSON-action run of a scripted model; only the script, the
tools, the step budget and the instructions differ, so the rest is built once, here.
"""

from __future__ import annotations

from agent_kit import definition, request
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


def open_store(spec: str) -> Store:
    """The store ``spec`` names: ``jsonl:DIR``, ``sqlite:FILE`` or a PostgreSQL conninfo."""
    from polyloop.stores import JsonlStore, PostgresStore, SqliteStore

    if spec.startswith("jsonl:"):
        return JsonlStore(spec.removeprefix("jsonl:"))
    if spec.startswith("sqlite:"):
        return SqliteStore(spec.removeprefix("sqlite:"))
    return PostgresStore(spec)


def build(
    store: Store,
    run_id: str,
    model: ModelClient,
    registry: ToolRegistry,
    *,
    max_steps: int,
    instructions: str,
) -> tuple[Definition, Request]:
    """A run of ``model`` with ``registry``'s tools, to be run or resumed as given."""
    return definition(store, model=model), request(
        run_id,
        registry,
        budget=Budget(max_steps=max_steps, max_valid_steps=max_steps, max_context_chars=100_000),
        run_context=(Message.text(Role.SYSTEM, instructions),),
        goal_context=(Message.text(Role.USER, "Go."),),
        binding={},
        model_replay=Replay.ALLOWED,
        cancel_grace_s=1.0,
    )
