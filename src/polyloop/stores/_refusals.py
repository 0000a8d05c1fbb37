"""Why a store refuses a call, written once for every store
(docs/stores.md#claims-one-writer-per-run)."""

from __future__ import annotations

from polyloop.types import PolyLoopError, RunAlreadyExists, RunLocked, StoreError


def store_closed(run_id: str | None = None) -> StoreError:
    return StoreError("the store is closed", run_id=run_id)


def not_claimed(run_id: str) -> RunLocked:
    return RunLocked("this store object does not hold the run's claim", run_id=run_id)


def claimed_already(run_id: str) -> RunLocked:
    return RunLocked("this store object already holds the run's claim", run_id=run_id)


def check_order(run_id: str, *, start: bool, started: bool, finished: bool) -> None:
    """The rule every store keeps: a run starts once, nothing before its start or final end."""
    if start and started:
        raise RunAlreadyExists("the run already has records", run_id=run_id)
    if not start and not started:
        raise StoreError("the run was never started in this store", run_id=run_id)
    if not start and finished:
        raise StoreError("the run has ended; nothing may follow its end record", run_id=run_id)


def fence_refusal(
    run_id: str, *, epoch: int, row: tuple[int, bool, int] | None, start: bool
) -> PolyLoopError:
    """Why a database's fence moved no row for a write under claim ``epoch``, given the
    run's row now (its epoch, whether it finished, its next seq; ``None`` when gone)."""
    if row is None or row[0] != epoch:
        reason = "another writer claimed the run since this store object did"
        return RunLocked(reason, run_id=run_id)
    try:
        check_order(run_id, start=start, started=True, finished=bool(row[1]))
    except PolyLoopError as refusal:
        return refusal
    return StoreError("the run's rows moved on without this writer", run_id=run_id)
