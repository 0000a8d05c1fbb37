"""Fuzzing the JSON-lines reader and every store.

Three kinds of test live here:

* **Byte fuzzers** (time-bounded). The JSON-lines reader, alone and inside a real
  ``JsonlStore``, is fed arbitrary run files: whatever it gets, it returns records or
  raises ``CorruptLog`` / ``SchemaMajorMismatch``, nothing else, and listing never
  refuses. The wall-clock budget is shared through ``kit.fuzz_budget``
  (``POLYLOOP_FUZZ_SECONDS``; 15 s with ``CI=true``, 3 s otherwise) with the codec
  fuzzers of ``tests/kernel/test_serialization_fuzz.py``.
* **Stateful store machines** (example-bounded). A hypothesis rule-based machine writes
  runs in the order the kernel writes them, crashes and reopens the store, lets a second
  store object try to write, and after every step checks that ``read_log`` returns every
  acknowledged write, in order, and nothing else. One machine per store and backend.
* **Line breakers.** Strings holding characters that some reader somewhere treats as a
  line break round-trip through every store and never split a record.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kit import fuzz_budget
from kit.fuzz import (
    AWKWARD,
    LINE_BREAKERS,
    REFUSALS,
    SEED_LINE_RECORDS,
    action_intent,
    action_result,
    any_line,
    fuzz_settings,
    model_intent,
    model_result,
    mutated_lines,
    read_file_bytes,
    rewrites_exactly,
    run_ended,
    seed_lines,
    step_record,
)
from polyloop.serialization import dumps
from polyloop.stores import JsonlStore, MemoryStore, PostgresStore, SqliteStore
from polyloop.stores._jsonl.reader import decode_line
from polyloop.stores._paths import safe_name
from polyloop.testing.store_contract import apply, expected_records
from polyloop.types import (
    JSONValue,
    Record,
    Replay,
    RunAlreadyExists,
    RunLocked,
    RunStarted,
    StopReason,
    StoreError,
)

STORE_KINDS = ("memory", "jsonl", "sqlite", "postgresql")
BACKENDS = ("asyncio", "trio")


# -- the JSON-lines reader on arbitrary run files (time-bounded) -------------------------------


@st.composite
def run_files(draw: st.DrawFn) -> bytes:
    """A run file's bytes: lines of every kind ``kit.fuzz`` makes, and a tail after the last."""
    lines = draw(st.lists(any_line | seed_lines, max_size=8))
    # A line of another run is corruption too.
    if draw(st.booleans()):
        other = dumps(run_ended("someone-else", StopReason.CANCELLED, 0)).encode()
        lines.insert(draw(st.integers(0, len(lines))), other)
    body = b"".join(line + b"\n" for line in lines)
    tail = draw(st.just(b"") | st.binary(max_size=60) | mutated_lines)
    return body + tail


def test_jsonl_reader_on_arbitrary_file_bytes() -> None:
    @fuzz_settings(200)
    @given(run_files())
    def any_file(data: bytes) -> None:
        records = read_file_bytes(data)
        if records is not None:
            for record in records:
                rewrites_exactly(record)

    @fuzz_settings(200)
    @given(st.lists(seed_lines, max_size=6), st.binary(max_size=200) | mutated_lines)
    def valid_lines_then_a_tail(lines: list[bytes], tail: bytes) -> None:
        # Complete canonical lines followed by anything without a newline: the tail is
        # torn and ignored, the lines read back exactly.
        tail = tail.replace(b"\n", b"")
        expected = [record for line in lines for record in SEED_LINE_RECORDS[line]]
        data = b"".join(line + b"\n" for line in lines) + tail
        assert read_file_bytes(data) == expected

    fuzz_budget.fuzz_for(fuzz_budget.seconds(0.20), any_file)
    fuzz_budget.fuzz_for(fuzz_budget.seconds(0.05), valid_lines_then_a_tail)


def listed_ids(data: bytes) -> tuple[str, ...]:
    """What listing a directory holding only run ``r``'s file with ``data`` must show.

    A run is listed once its first line is complete and is a record of it; a file whose
    first line does not read as one is left out (never an error).
    """
    if b"\n" not in data:
        return ()
    try:
        first = decode_line(data.split(b"\n", 1)[0], "run.jsonl:1")
    except REFUSALS:
        return ()
    return ("r",) if first[0].run_id == "r" else ()


@pytest.mark.parametrize("backend", BACKENDS)
def test_jsonl_store_reads_arbitrary_run_files(backend: str, tmp_path: Path) -> None:
    """``read_log`` and ``list_runs`` of a real store over a directory of arbitrary files."""
    directory = tmp_path / "runs"
    directory.mkdir()
    path = directory / f"{safe_name('r')}.jsonl"

    async def read(store: JsonlStore) -> tuple[list[Record] | None, tuple[str, ...]]:
        try:
            records: list[Record] | None = list((await store.read_log("r")).records)
        except REFUSALS:
            records = None
        # Listing never refuses: an unreadable file is left out of it.
        ids = tuple(run.run_id for run in await store.list_runs())
        return records, ids

    with anyio.from_thread.start_blocking_portal(backend) as portal:
        store = JsonlStore(directory)

        @fuzz_settings(100)
        @given(run_files())
        def any_file(data: bytes) -> None:
            path.write_bytes(data)
            records, ids = portal.call(read, store)
            assert records == read_file_bytes(data)
            assert ids == listed_ids(data)
            if records:
                assert ids == ("r",)  # a readable log is always listed

        try:
            fuzz_budget.fuzz_for(fuzz_budget.seconds(0.15), any_file)
        finally:
            portal.call(store.aclose)


# -- line-breaking characters through every store --------------------------------------------


@pytest.fixture
def store_kind_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[str], Callable[[], Any]]:
    def factory(kind: str) -> Callable[[], Any]:
        if kind == "memory":
            shared = MemoryStore()
            return lambda: shared
        if kind == "jsonl":
            return lambda: JsonlStore(tmp_path / "runs")
        if kind == "sqlite":
            return lambda: SqliteStore(tmp_path / "runs.db")
        conninfo, schema = request.getfixturevalue("postgres_place")
        return lambda: PostgresStore(conninfo, schema=schema)

    return factory


def breaker_run(run_id: str, text: str) -> list[tuple[str, tuple[Any, ...]]]:
    """Every kind of write, each carrying ``text`` wherever a string goes."""
    return [
        ("start_run", (RunStarted(run_id=run_id, snapshot={text: text, "k": [text]}),)),
        ("write_intent", (model_intent(run_id, 0, sha=text),)),
        ("write_result", (model_result(run_id, 0, text),)),
        ("write_intent", (action_intent(run_id, 0, {text: text}),)),
        (
            "write_step",
            (step_record(run_id, 0, text, with_action=True), action_result(run_id, 0, text)),
        ),
        ("write_intent", (model_intent(run_id, 1),)),
        ("write_result", (model_result(run_id, 1, text),)),
        ("write_step", (step_record(run_id, 1, text, with_action=False), None)),
        ("end_run", (run_ended(run_id, StopReason.FINAL_ANSWER, 2, detail=text),)),
    ]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_line_breaking_characters_round_trip_through_every_store(
    kind: str, store_kind_factory: Callable[[str], Callable[[], Any]], tmp_path: Path
) -> None:
    open_store = store_kind_factory(kind)
    texts = {f"one-{ord(c):04x}": f"before{c}after" for c in LINE_BREAKERS}
    texts["all"] = f"{LINE_BREAKERS}|{LINE_BREAKERS[::-1]}\r\n\n\r"
    texts["surrogate"] = f"{LINE_BREAKERS}\ud800"
    runs = {
        f"run{LINE_BREAKERS}{name}": breaker_run(f"run{LINE_BREAKERS}{name}", text)
        for name, text in texts.items()
    }
    store = open_store()
    try:
        for writes in runs.values():
            await apply(store, writes)
        for run_id, writes in runs.items():
            assert list((await store.read_log(run_id)).records) == expected_records(writes)
        ids = [run.run_id for run in await store.list_runs()]
        assert set(runs) <= set(ids)
    finally:
        if kind != "memory":
            await store.aclose()
    if kind == "memory":
        return
    reopened = open_store()
    try:
        for run_id, writes in runs.items():
            assert list((await reopened.read_log(run_id)).records) == expected_records(writes)
    finally:
        await reopened.aclose()
    if kind == "jsonl":
        for run_id, writes in runs.items():
            data = (tmp_path / "runs" / f"{safe_name(run_id)}.jsonl").read_bytes()
            # One line per write call (a step and its result share one line), for every
            # way of splitting lines.
            assert data.count(b"\n") == len(writes)
            assert data.endswith(b"\n")
            assert len(data.splitlines()) == len(writes)
            assert len(data.decode("utf-8").splitlines()) == len(writes)
            # Text mode with universal newlines (\r and \r\n also end a line).
            universal = (tmp_path / "runs" / f"{safe_name(run_id)}.jsonl").read_text("utf-8")
            assert universal.count("\n") == len(writes)


# -- stateful store machines -------------------------------------------------------------------

RUN_SUFFIXES = (
    "r",
    "../escape",
    "a/b",
    "nul\x00byte",
    "snow\u2603",
    "brk\u2028\r\n\x85",
    "x" * 300,
)
texts = st.text(alphabet=st.sampled_from(AWKWARD) | st.characters(), max_size=12)
small_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=6,
)
# Where a run is in the order the kernel writes (research-wiki 0005).
BOUNDARY, MODEL_INTENT, MODEL_RESULT, ACTION_INTENT, FINISHED = (
    "boundary",
    "model_intent",
    "model_result",
    "action_intent",
    "finished",
)
OPEN = (BOUNDARY, MODEL_INTENT, MODEL_RESULT, ACTION_INTENT)
# The writes allowed next in each phase, repeated to make progress likelier than an end.
NEXT_WRITES = {
    BOUNDARY: ["model_intent"] * 4 + ["end_final", "end_cancelled"],
    MODEL_INTENT: ["model_result"] * 4 + ["end_cancelled"],
    MODEL_RESULT: ["action_intent"] * 3 + ["step_without_action"] * 2 + ["end_cancelled"],
    ACTION_INTENT: ["step_with_action"] * 4 + ["end_cancelled"],
}
# The reasons nothing may follow (an in-doubt or awaiting-approval end waits for a
# person's answer, so it is not among them).
FINAL_REASONS = [
    reason
    for reason in StopReason
    if run_ended("x", reason, 0).is_final  # the record's own rule, not a list kept here
]
MAX_OPEN_RUNS = 3
# How often each interesting thing happened, printed by the machine tests (run with -s):
# proof that the rules reach deep runs, crashes, torn tails and both lock outcomes.
MACHINE_EVENTS: collections.Counter[str] = collections.Counter()


@dataclasses.dataclass
class RunModel:
    """What must be read back for one run: every acknowledged write, in order."""

    records: list[Record] = dataclasses.field(default_factory=list)
    phase: str = BOUNDARY
    step: int = 0
    lines: int = 0  # write calls (one line each in a JSON-lines file)


def _sever_descriptors_under(directory: Path) -> bool:
    """Close, as the kernel does when a process dies, every descriptor open under ``directory``.

    Each such descriptor is replaced (``dup2``) by one on ``/dev/null``: the open file
    description behind it goes away, and with it every ``flock`` it held, exactly as at
    process death; the store object still owns a harmless descriptor that it may close
    later. Returns False where descriptors cannot be listed (no ``/proc``).
    """
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        return False
    root = os.path.realpath(directory) + os.sep
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir(fd_dir):
            try:
                target = os.readlink(fd_dir / name)
            except OSError:
                continue  # the listing's own descriptor, already gone
            if target.startswith(root):
                os.dup2(null, int(name))
    finally:
        os.close(null)
    return True


def _drop_server_connections(conninfo: str) -> None:
    """Make the server lose every other connection to this test's database, and wait.

    This is what the server sees when a worker process dies: its sessions end, their
    transactions roll back and their advisory (writer) locks are released.
    """
    with psycopg.connect(conninfo, autocommit=True) as admin:
        others = (
            "SELECT pid FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        admin.execute(f"SELECT pg_terminate_backend(pid) FROM ({others}) AS o")
        deadline = time.monotonic() + 10
        while admin.execute(f"SELECT count(*) FROM ({others}) AS o").fetchone() != (0,):
            assert time.monotonic() < deadline, "terminated sessions did not go away"
            time.sleep(0.005)


class StoreMachine(RuleBasedStateMachine):
    """Writes runs in valid order through one store, crashing and reopening it at will."""

    def __init__(self, kind: str, backend: str, conninfo: str | None) -> None:
        super().__init__()
        self.kind = kind
        self.durable = kind != "memory"
        self.conninfo = conninfo
        self._exit = contextlib.ExitStack()
        self.portal = self._exit.enter_context(anyio.from_thread.start_blocking_portal(backend))
        self.scratch = Path(tempfile.mkdtemp(prefix="polyloop-fuzz-"))
        self.token = uuid.uuid4().hex[:10]
        self.runs: dict[str, RunModel] = {}
        self.held: set[str] = set()  # runs whose claim the current object holds
        self.graveyard: list[Any] = []  # abandoned objects, closed at teardown
        self.store = self.open()

    # -- plumbing ---------------------------------------------------------------------

    def open(self) -> Any:
        if self.kind == "memory":
            return MemoryStore()
        if self.kind == "jsonl":
            return JsonlStore(self.scratch / "runs")
        if self.kind == "sqlite":
            return SqliteStore(self.scratch / "runs.db")
        assert self.conninfo is not None
        return PostgresStore(self.conninfo, pool_size=2, max_writer_connections=2)

    def call(self, store: Any, method: str, *args: Any) -> Any:
        return self.portal.call(getattr(store, method), *args)

    def claim(self, run_id: str) -> None:
        """Make the current object the run's writer, unless it already is."""
        if run_id not in self.held:
            self.call(self.store, "claim_run", run_id)
            self.held.add(run_id)
            MACHINE_EVENTS["claim"] += 1

    def write(self, run_id: str, method: str, *args: Any) -> None:
        """An acknowledged write (claimed first): the model gets it once the store returns."""
        self.claim(run_id)
        self.call(self.store, method, *args)
        model = self.runs[run_id]
        if method == "write_step":
            step, result = args
            model.records += [result, step] if result is not None else [step]
        else:
            model.records.append(args[0])
        model.lines += 1
        if method == "end_run":
            self.held.discard(run_id)  # an end record gives the claim up
        MACHINE_EVENTS[f"write {method}"] += 1
        deepest = "steps of the longest run"
        MACHINE_EVENTS[deepest] = max(MACHINE_EVENTS[deepest], model.step)

    def pick(self, phases: Sequence[str], index: int) -> str:
        eligible = [run_id for run_id, m in self.runs.items() if m.phase in phases]
        return eligible[index % len(eligible)]

    def open_runs(self) -> int:
        return sum(1 for m in self.runs.values() if m.phase != FINISHED)

    def any_in(self, *phases: str) -> bool:
        return any(m.phase in phases for m in self.runs.values())

    def teardown(self) -> None:
        try:
            for store in [*self.graveyard, self.store]:
                if self.durable:
                    self.call(store, "aclose")
        finally:
            self._exit.close()
            shutil.rmtree(self.scratch, ignore_errors=True)

    # -- writes, in the order the kernel makes them -------------------------------------

    @precondition(lambda self: self.open_runs() < MAX_OPEN_RUNS)
    @rule(
        suffix=st.sampled_from(RUN_SUFFIXES),
        snapshot=st.dictionaries(texts, small_json, max_size=3),
    )
    def start_run(self, suffix: str, snapshot: dict[str, JSONValue]) -> None:
        run_id = f"{suffix}-{self.token}"
        record = RunStarted(run_id=run_id, snapshot=snapshot)
        if run_id in self.runs:
            self.claim(run_id)  # a started (even a finished) run may be claimed
            with pytest.raises(RunAlreadyExists):
                self.call(self.store, "start_run", record)
            MACHINE_EVENTS["second start refused"] += 1
            return
        self.runs[run_id] = RunModel()
        self.write(run_id, "start_run", record)

    @precondition(lambda self: self.any_in(*OPEN))
    @rule(index=st.integers(0, 99), data=st.data())
    def advance(self, index: int, data: st.DataObject) -> None:
        """Up to twelve writes to a run, each one the kernel may write next."""
        run_id = self.pick(OPEN, index)
        model = self.runs[run_id]
        for _ in range(data.draw(st.integers(1, 12), label="writes")):
            if model.phase == FINISHED:
                return
            what = data.draw(st.sampled_from(NEXT_WRITES[model.phase]), label="write")
            k = model.step
            if what == "model_intent":
                replay = data.draw(st.sampled_from(Replay), label="replay")
                self.write(run_id, "write_intent", model_intent(run_id, k, replay=replay))
                model.phase = MODEL_INTENT
            elif what == "model_result":
                text = data.draw(texts, label="reply")
                self.write(run_id, "write_result", model_result(run_id, k, text))
                model.phase = MODEL_RESULT
            elif what == "action_intent":
                arguments = data.draw(small_json, label="arguments")
                self.write(run_id, "write_intent", action_intent(run_id, k, arguments))
                model.phase = ACTION_INTENT
            elif what in ("step_with_action", "step_without_action"):
                text = data.draw(texts, label="observation")
                action = what == "step_with_action"
                self.write(
                    run_id,
                    "write_step",
                    step_record(run_id, k, text, with_action=action),
                    action_result(run_id, k, text) if action else None,
                )
                model.phase, model.step = BOUNDARY, k + 1
            elif what == "end_final":
                reason = data.draw(st.sampled_from(FINAL_REASONS), label="reason")
                self.write(run_id, "end_run", run_ended(run_id, reason, k))
                model.phase = FINISHED
            else:
                # A cancelled end may come anywhere; the run goes on from where it was.
                assert what == "end_cancelled"
                detail = data.draw(st.none() | texts, label="detail")
                self.write(run_id, "end_run", run_ended(run_id, StopReason.CANCELLED, k, detail))

    @precondition(lambda self: self.any_in(*OPEN))
    @rule(index=st.integers(0, 99), data=st.data())
    def advance_another(self, index: int, data: st.DataObject) -> None:
        """The same as :meth:`advance`: a second rule gives writes more of the steps
        (hypothesis picks among the enabled rules, and turns some off per example)."""
        self.advance(index, data)

    @precondition(lambda self: self.held or self.any_in(FINISHED))
    @rule(index=st.integers(0, 99), release=st.booleans())
    def refused_write(self, index: int, release: bool) -> None:
        """A write that must be refused and write nothing: one without the claim (after
        ``release_run`` gave it up), or one after a final end record (claim or not)."""
        finished = [run_id for run_id, m in self.runs.items() if m.phase == FINISHED]
        if (release or not finished) and self.held:
            run_id = sorted(self.held)[index % len(self.held)]
            self.call(self.store, "release_run", run_id)
            self.held.discard(run_id)
            self.call(self.store, "release_run", run_id)  # nothing held: nothing happens
            record = run_ended(run_id, StopReason.CANCELLED, self.runs[run_id].step, "unclaimed")
            with pytest.raises(RunLocked):
                self.call(self.store, "end_run", record)
            MACHINE_EVENTS["write without the claim refused"] += 1
            return
        run_id = finished[index % len(finished)]
        self.claim(run_id)
        record = run_ended(run_id, StopReason.CANCELLED, self.runs[run_id].step, "after the end")
        with pytest.raises(StoreError) as refused:
            self.call(self.store, "end_run", record)
        assert not isinstance(refused.value, RunLocked)
        MACHINE_EVENTS["write after a final end refused"] += 1

    # -- crashes, reopening, a second writer --------------------------------------------

    @precondition(lambda self: self.durable)
    @rule(
        what=st.sampled_from(["crash", "reopen", "second writer"]),
        index=st.integers(0, 99),
        tear=st.booleans(),
        length=st.integers(1, 10_000),
    )
    def disrupt(self, what: str, index: int, tear: bool, length: int) -> None:
        """A crash, an orderly reopen, or a second store object on the same data.

        One rule for all three keeps them from crowding out the writes.
        """
        MACHINE_EVENTS[what] += 1
        if what == "crash":
            self.crash(index, length if tear else None)
        elif what == "reopen":
            self.call(self.store, "aclose")
            self.held.clear()
            self.store = self.open()
        elif self.any_in(*OPEN):
            self.second_object_writes(index)

    def crash(self, index: int, torn: int | None) -> None:
        """Abandon the store object as a dying process would, then open a new one.

        JSON lines: every descriptor under the directory is severed (the writer locks go
        with them), and optionally a run file gets a torn, unterminated last line, the
        trace of a write that died half way and was never acknowledged. SQLite: the owner's
        lock file is severed the same way; the abandoned connection is left open until the
        example ends, so the write-ahead log is not checkpointed behind the new object's
        back (SQLite shares locks and shared memory between the connections of one
        process, so its own descriptors cannot be pulled away faithfully; every write
        it acknowledged was a committed transaction). PostgreSQL: the server drops every
        session of the abandoned object, as it does when the process dies.
        """
        old, self.store = self.store, None
        if self.kind == "jsonl":
            if _sever_descriptors_under(self.scratch / "runs"):
                self.call(old, "aclose")  # frees its /dev/null descriptors only
            else:
                self.call(old, "aclose")  # no /proc: an orderly close stands in
            if torn is not None and self.runs:
                self.tear(index, torn)
        elif self.kind == "sqlite":
            if _sever_descriptors_under(self.scratch / "runs.db.claims"):
                self.graveyard.append(old)
            else:
                self.call(old, "aclose")
        else:
            assert self.conninfo is not None
            _drop_server_connections(self.conninfo)
            self.call(old, "aclose")  # stops its pool; its sessions are already gone
        self.held.clear()
        self.store = self.open()

    def tear(self, index: int, length: int) -> None:
        run_id = list(self.runs)[index % len(self.runs)]
        line = dumps(run_ended(run_id, StopReason.CANCELLED, 0, detail="torn")).encode()
        piece = line[: 1 + length % (len(line) - 1)]
        path = self.scratch / "runs" / f"{safe_name(run_id)}.jsonl"
        with open(path, "ab") as file:
            file.write(piece)
        MACHINE_EVENTS["torn tail left behind"] += 1

    def second_object_writes(self, index: int) -> None:
        """Another store object reads every run, and may write one only while no object
        holds its claim."""
        run_id = self.pick(OPEN, index)
        model = self.runs[run_id]
        record = run_ended(run_id, StopReason.CANCELLED, model.step, "from another object")
        other = self.open()
        try:
            self.check_logs(other)  # readers are never locked out
            with pytest.raises(RunLocked):  # no object writes without the claim
                self.call(other, "end_run", record)
            if run_id in self.held:
                with pytest.raises(RunLocked):
                    self.call(other, "claim_run", run_id)
                MACHINE_EVENTS["second writer locked out"] += 1
            else:
                self.call(other, "claim_run", run_id)
                self.call(other, "end_run", record)  # and gives the claim up at once
                model.records.append(record)
                model.lines += 1
                MACHINE_EVENTS["second writer took over"] += 1
        finally:
            self.call(other, "aclose")

    # -- what must hold after every step ------------------------------------------------

    @invariant()
    def every_acknowledged_write_reads_back_in_order(self) -> None:
        self.check_logs(self.store)

    def check_logs(self, store: Any) -> None:
        async def read_all() -> tuple[dict[str, list[Record]], list[Record], Any]:
            logs = {run_id: list((await store.read_log(run_id)).records) for run_id in self.runs}
            unknown = list((await store.read_log(f"never-{self.token}")).records)
            ids = tuple(run.run_id for run in await store.list_runs())
            return logs, unknown, ids

        logs, unknown, ids = self.portal.call(read_all)
        for run_id, model in self.runs.items():
            assert logs[run_id] == model.records, f"run {run_id!r} reads back differently"
        assert unknown == []
        mine = {run_id for run_id in ids if run_id.endswith(self.token)}
        assert mine == set(self.runs)
        if self.kind == "jsonl":
            self.check_files()

    def check_files(self) -> None:
        for run_id, model in self.runs.items():
            data = (self.scratch / "runs" / f"{safe_name(run_id)}.jsonl").read_bytes()
            complete = data[: data.rfind(b"\n") + 1]
            assert complete.count(b"\n") == model.lines
            assert len(complete.decode("utf-8").splitlines()) == model.lines


MACHINE_SETTINGS = settings(
    max_examples=fuzz_budget.examples(25, floor=5),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_store_keeps_every_acknowledged_write_across_crashes(
    kind: str, backend: str, request: pytest.FixtureRequest
) -> None:
    conninfo = request.getfixturevalue("postgres_conninfo") if kind == "postgresql" else None
    MACHINE_EVENTS.clear()
    began = time.perf_counter()
    run_state_machine_as_test(
        lambda: StoreMachine(kind, backend, conninfo), settings=MACHINE_SETTINGS
    )
    print(
        f"\n{kind}/{backend}: {MACHINE_SETTINGS.max_examples} examples in "
        f"{time.perf_counter() - began:.1f}s; "
        + ", ".join(f"{name}: {count}" for name, count in sorted(MACHINE_EVENTS.items()))
    )
