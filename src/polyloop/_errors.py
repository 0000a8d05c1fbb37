"""Every exception PolyLoop raises on purpose, in one flat module.

The hierarchy::

    PolyLoopError (Exception)
    ├── InvalidRequest (ValueError)        a request, budget, tool or schema that cannot run
    ├── RunAlreadyExists (FileExistsError) `run` found records for the run id
    ├── RunNotFound (LookupError)          `resume` found no record for the run id
    ├── RunIdentityMismatch (ValueError)   the recorded snapshot differs from the current one
    │   └── AmendmentRefused               an amendment asks to change what may never change
    ├── CorruptLog (ValueError)            a record that cannot be read back as written
    ├── SchemaMajorMismatch (ValueError)   a record written by another major of the format
    ├── UnloggableValue (ValueError)       a value strict JSON cannot carry back exactly
    ├── RunLocked (BlockingIOError)        another writer holds the run
    │   └── LeaseLost                      this worker's lease ended: it starts and writes nothing
    ├── NotInDoubt (ValueError)            a settlement for a run with no effect in doubt
    ├── NotAwaitingApproval (ValueError)   a verdict for a run with no proposal waiting
    ├── CancelRequested                    someone asked the run to stop: no new effect starts
    └── StoreError (OSError)               the store could not write or read; the run stops

Each leaf also subclasses the builtin it resembles, so code that already catches
``ValueError`` or ``OSError`` keeps working. The run id and, where there is one, the
location of the offending record are keyword fields; the message is built from them so
that a log line alone says which run and which record went wrong.

The public home of these names is :mod:`polyloop.types`; this module only keeps them
together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = (
    "AmendmentRefused",
    "CancelRequested",
    "CorruptLog",
    "InvalidRequest",
    "LeaseLost",
    "NotAwaitingApproval",
    "NotInDoubt",
    "PolyLoopError",
    "RunAlreadyExists",
    "RunIdentityMismatch",
    "RunLocked",
    "RunNotFound",
    "SchemaMajorMismatch",
    "StoreError",
    "UnloggableValue",
)


def _rebuild(cls: type[PolyLoopError], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return cls(*args, **kwargs)


class PolyLoopError(Exception):
    """Root of every error PolyLoop raises on purpose.

    ``run_id`` names the run the error is about (``None`` when there is none yet, for
    example a tool registry built outside any run). ``location`` names the record: a
    file and line, a table row, or a record index.
    """

    run_id: str | None
    location: str | None
    reason: str

    def __init__(
        self, reason: str, *, run_id: str | None = None, location: str | None = None
    ) -> None:
        self.reason = reason
        self.run_id = run_id
        self.location = location
        super().__init__(self._message())

    def _message(self) -> str:
        where = []
        if self.run_id is not None:
            where.append(f"run {self.run_id!r}")
        if self.location is not None:
            where.append(f"at {self.location}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.reason}" if prefix else self.reason

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields do not survive the default exception pickling,
        # which replays ``self.args``; errors cross process boundaries in tests
        # and in worker pools, so rebuild them from their fields.
        return (_rebuild, (type(self), (self.reason,), self._fields()))

    def _fields(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "location": self.location}


class InvalidRequest(PolyLoopError, ValueError):
    """A request, budget, tool registry or schema that cannot be run; nothing was written."""


class RunAlreadyExists(PolyLoopError, FileExistsError):
    """``run`` was asked to start a run whose id already has records in the store."""


class RunNotFound(PolyLoopError, LookupError):
    """``resume`` was asked to continue a run that has no record in the store."""


class NotInDoubt(PolyLoopError, ValueError):
    """``settle`` was asked about a run that has no effect in doubt, or about another
    effect than the one in doubt (already settled, never announced, or not an action)."""


class NotAwaitingApproval(PolyLoopError, ValueError):
    """``approve`` or ``reject`` was asked about a run that waits for no approval (none
    was asked for, or a verdict was already given)."""


class CancelRequested(PolyLoopError):
    """A cancel was requested for the run (:func:`polyloop.cancel`): ``by`` asked, for
    ``why``. A store raises it instead of writing an intent or a proposal of that run,
    so no new effect starts; the run's owner then ends the run for good. ``approve``,
    ``reject`` and ``settle`` refuse an answer for such a run with it too."""

    by: str
    why: str

    def __init__(
        self,
        reason: str | None = None,
        *,
        run_id: str | None = None,
        location: str | None = None,
        by: str = "",
        why: str = "",
    ) -> None:
        self.by, self.why = by, why
        if reason is None:
            reason = f"{by!r} asked for the run to be cancelled: {why}"
        super().__init__(reason, run_id=run_id, location=location)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "by": self.by, "why": self.why}


def _difference(key: str, recorded: Any, current: Any) -> str:
    """One differing key in words: a hashed input changed, or its value then and now."""
    if key.endswith(".sha256"):
        return f"{key} (the {key.removesuffix('.sha256').replace('_', ' ')} is not the same)"
    return f"{key} ({_clipped(recorded)} then, {_clipped(current)} now)"


def _clipped(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


class RunIdentityMismatch(PolyLoopError, ValueError):
    """The snapshot recorded when the run started differs from the one built now.

    ``differences`` holds one ``(key, recorded, current)`` triple per differing key,
    sorted by key; a key missing on one side shows ``None`` there.
    """

    differences: tuple[tuple[str, Any, Any], ...]

    def __init__(
        self,
        reason: str | None = None,
        *,
        run_id: str | None = None,
        location: str | None = None,
        differences: Sequence[tuple[str, Any, Any]] = (),
    ) -> None:
        self.differences = tuple(differences)
        if reason is None:
            keys = ", ".join(_difference(*difference) for difference in self.differences)
            reason = (
                f"the run was started with other parameters; differing keys: {keys}. Resume "
                f"it with the inputs it was started with, or start a new run under a new run id"
            )
        super().__init__(reason, run_id=run_id, location=location)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "differences": self.differences}


class AmendmentRefused(RunIdentityMismatch):
    """An amendment (:class:`~polyloop.types.Amendment`) asks a run to go on under a
    change that may never be made to it: ``key`` names the snapshot key (or ``run_id``),
    ``why`` says why it may not change. Nothing was written.

    A :class:`RunIdentityMismatch`, so code that refuses a changed definition refuses
    this too; ``differences`` holds the differences the run was asked to go on under.
    """

    key: str
    why: str

    def __init__(
        self,
        reason: str | None = None,
        *,
        run_id: str | None = None,
        location: str | None = None,
        differences: Sequence[tuple[str, Any, Any]] = (),
        key: str = "",
        why: str = "",
    ) -> None:
        self.key, self.why = key, why
        if reason is None:
            reason = f"the amendment may not change {key!r}: {why}"
        super().__init__(reason, run_id=run_id, location=location, differences=differences)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "key": self.key, "why": self.why}


class CorruptLog(PolyLoopError, ValueError):
    """A complete record that does not decode, or records that cannot follow each other."""


class SchemaMajorMismatch(PolyLoopError, ValueError):
    """A record carries another major version of the record format than this library reads."""


class UnloggableValue(PolyLoopError, ValueError):
    """A value that strict JSON cannot carry back exactly (NaN, infinities, huge integers)."""


class RunLocked(PolyLoopError, BlockingIOError):
    """Another writer (another store object, here or in another process) holds the run."""


class LeaseLost(RunLocked):
    """This store object's lease on the run ended, or would have too little left when the
    next effect started: another worker may have taken the run over.

    Raised before anything starts: no model call or action is begun under a lease that
    may have ended, and nothing more is written for the run through this store object.
    """


class StoreError(PolyLoopError, OSError):
    """The store failed to write or read; the run stops and the cause is chained.

    After a store error, nothing more is written for that run through that store object
    until it is closed and opened again.
    """
