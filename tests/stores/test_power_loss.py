"""Power loss, not just process death: the JSON-lines store on a simulated disk.

A killed process leaves the kernel's page cache behind, so everything it wrote is still
there. A machine that loses power keeps only what reached the disk: data not covered by
an ``fsync`` may be there, missing, or replaced by other bytes, and a new directory entry
not covered by a directory ``fsync`` may be gone. This module gives the JSON-lines store a
model of such a disk (through the store's private file-operation layer), cuts the power
at every sync point of a six-step run, and checks what recovery finds:

(a) every record acknowledged by a barrier (``start_run`` or ``write_intent`` returned)
    is on the disk, intact, with everything written before it;
(b) no side effect (tool call or model call) ran without its intent on the disk;
(c) recovery on what is left never fails unexpectedly: ``resume`` finishes the run (the
    uninterrupted outcome, or ``IN_DOUBT`` for an open intent that must not be
    replayed), or finds no run at all (``RunNotFound``; only possible before
    ``start_run`` returned), or reports ``CorruptLog`` exactly when the lost power left
    a complete, newline-terminated line that the program never wrote, and only after
    every acknowledged record. Why that last answer is the right one is written down in
    ``research-wiki/0012-simulated-power-loss.md``.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kit.agent import (
    Ledger,
    definition,
    make_tools,
    request,
    same_outcome,
    six_step_script,
)
from kit.fuzz import parse_lines
from kit.store import DURABLE_STORE_BACKENDS, jsonl_store_on
from kit.sweep import every_point
from polyloop import resume, run
from polyloop._recovery import RecoveryState, read_plan
from polyloop.stores._engine import EngineStore
from polyloop.stores._paths import safe_name
from polyloop.testing import FaultyStore, ScriptedModelClient
from polyloop.types import (
    CorruptLog,
    Intent,
    Replay,
    RunEnded,
    RunLocked,
    RunLog,
    RunNotFound,
    RunResult,
    RunStarted,
    StopReason,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=DURABLE_STORE_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


DIRECTORY = Path("/disk/runs")
RUN_FILE = DIRECTORY / f"{safe_name('r')}.jsonl"
# Sync calls of a six-step run: the new directory's entry, the run file and its entry at
# start_run, then one per intent (6 model calls, 5 actions).
SYNC_KINDS = ("dir", "file", "dir", *("file",) * 11)
SEEDS = range(8)


class PowerLoss(Exception):
    """The machine went dark: nothing the program does afterwards reaches the disk."""


# -- the simulated disk -------------------------------------------------------------------


@dataclass(eq=False)
class SimFile:
    """A regular file: what readers see now, what survives for sure, and what is in between.

    ``durable`` is the content at the last ``fsync``. ``pending`` lists the changes made
    since, in order: ``(offset, data)`` for a write, ``(length, None)`` for a truncation.
    ``written`` is every byte the program ever appended (the oracle of the tests).
    """

    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""
    pending: list[tuple[int, bytes | None]] = field(default_factory=list)
    written: bytearray = field(default_factory=bytearray)
    locks: dict[int, int] = field(default_factory=dict)  # locked byte: holding descriptor
    claims_lock: bool = False  # a claims lock file: no data, made again when missing


@dataclass(eq=False)
class SimDir:
    """A directory: its entries now, and the entries its last ``fsync`` made durable."""

    entries: dict[str, SimFile | SimDir] = field(default_factory=dict)
    durable: dict[str, SimFile | SimDir] = field(default_factory=dict)


@dataclass(eq=False)
class OpenFile:
    node: SimFile | SimDir
    flags: int
    position: int = 0


@dataclass(frozen=True)
class Cut:
    """Cut the power at sync call number ``at`` (1-based), just before or just after it."""

    at: int
    before: bool
    seed: int


class SimDisk:
    """An in-memory disk with a volatile cache, behind the store's file-operation layer.

    Writes land in the cache (``SimFile.data``) and are remembered as pending until an
    ``fsync`` of the file makes its whole content durable. A new directory entry is
    durable once its directory is synced; syncing a file does not make its entry durable
    (POSIX promises no more). :meth:`cut_power` builds the disk a reboot would find:
    every pending change is independently kept, dropped, or (for a write) replaced by
    random bytes of the same length; a dropped write followed by a surviving one leaves
    zeros in between, as a file system that updated the size but not the data does; each
    entry not covered by a directory sync is kept or lost.
    """

    def __init__(
        self, cut: Cut | None = None, *, root: SimDir | None = None, ordered: bool = False
    ) -> None:
        self.root = root if root is not None else SimDir()
        if root is None:
            disk = SimDir()
            self.root.entries["disk"] = self.root.durable["disk"] = disk
        self.cut = cut
        self.ordered = ordered
        self.syncs: list[str] = []
        self.image: SimDisk | None = None
        self._fds: dict[int, OpenFile] = {}
        self._next_fd = 1000

    # -- power ------------------------------------------------------------------------

    def cut_power(self, rng: random.Random) -> SimDisk:
        """The disk as found after the power comes back (this one is left as it was)."""
        copies: dict[int, SimFile | SimDir] = {}

        def surviving(node: SimFile | SimDir) -> SimFile | SimDir:
            if id(node) in copies:
                return copies[id(node)]
            if isinstance(node, SimFile) and node.claims_lock:
                copy: SimFile | SimDir = SimFile(claims_lock=True)  # no data, no draws
            elif isinstance(node, SimFile):
                content = _after_loss(node, rng, ordered=self.ordered)
                copy = SimFile(data=bytearray(content), durable=content)
            else:
                kept = dict(node.durable)
                for name in sorted(set(node.entries) - set(node.durable)):
                    if rng.random() < 0.5:
                        kept[name] = node.entries[name]
                copy = SimDir()
                copies[id(node)] = copy
                for name in sorted(kept):
                    copy.entries[name] = surviving(kept[name])
                copy.durable = dict(copy.entries)
            copies[id(node)] = copy
            return copy

        root = surviving(self.root)
        assert isinstance(root, SimDir)
        return SimDisk(root=root)

    def _sync_point(self, kind: str) -> None:
        """Count a sync call; cut the power before it, if that is the plan."""
        self._alive()
        self.syncs.append(kind)
        if self.cut is not None and self.cut.at == len(self.syncs) and self.cut.before:
            self._lose_power()

    def _synced(self) -> None:
        if self.cut is not None and self.cut.at == len(self.syncs) and not self.cut.before:
            self._lose_power()

    def _lose_power(self) -> None:
        assert self.cut is not None
        self.image = self.cut_power(random.Random(self.cut.seed))
        raise PowerLoss(f"power lost at sync {len(self.syncs)}")

    def _alive(self) -> None:
        if self.image is not None:
            raise PowerLoss("the machine is off")

    # -- inspection (for the tests) -----------------------------------------------------

    def lookup(self, path: Path) -> SimFile | SimDir | None:
        node: SimFile | SimDir = self.root
        for part in Path(path).parts[1:]:
            if not isinstance(node, SimDir) or part not in node.entries:
                return None
            node = node.entries[part]
        return node

    def content(self, path: Path) -> bytes | None:
        node = self.lookup(path)
        return bytes(node.data) if isinstance(node, SimFile) else None

    def written(self, path: Path) -> bytes:
        node = self.lookup(path)
        return bytes(node.written) if isinstance(node, SimFile) else b""

    # -- the file-operation layer ---------------------------------------------------------

    def open(self, path: Path, flags: int, mode: int = 0o777) -> int:
        self._alive()
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            if not flags & os.O_CREAT:
                raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
            node = parent.entries[name] = SimFile(claims_lock=name.startswith(".claims-"))
            if node.claims_lock:
                # A claims lock file holds no data and is made again when missing, so
                # whether a power cut keeps it does not matter: the model keeps it, and
                # the random draws of a power cut stay the run files'.
                parent.durable[name] = node
        elif flags & os.O_CREAT and flags & os.O_EXCL:
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        elif isinstance(node, SimDir) and flags & os.O_ACCMODE != os.O_RDONLY:
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = OpenFile(node, flags)
        return fd

    def write(self, fd: int, data: bytes | memoryview) -> int:
        self._alive()
        handle = self._file(fd)
        if handle.flags & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "not open for writing")
        node = handle.node
        assert isinstance(node, SimFile)
        payload = bytes(data)
        offset = len(node.data) if handle.flags & os.O_APPEND else handle.position
        node.data[offset : offset + len(payload)] = payload
        node.pending.append((offset, payload))
        node.written += payload
        handle.position = offset + len(payload)
        return len(payload)

    def read(self, fd: int, size: int) -> bytes:
        handle = self._file(fd)
        chunk = self.pread(fd, size, handle.position)
        handle.position += len(chunk)
        return chunk

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._alive()
        node = self._file(fd).node
        if isinstance(node, SimDir):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        return bytes(node.data[offset : offset + size])

    def fstat(self, fd: int) -> os.stat_result:
        self._alive()
        node = self._file(fd).node
        if isinstance(node, SimDir):
            return os.stat_result((stat.S_IFDIR | 0o700, id(node), 1, 2, 0, 0, 0, 0, 0, 0))
        return os.stat_result((stat.S_IFREG | 0o600, id(node), 1, 1, 0, 0, len(node.data), 0, 0, 0))

    def fsync(self, fd: int) -> None:
        node = self._file(fd).node
        self._sync_point("file")
        if isinstance(node, SimFile):
            node.durable = bytes(node.data)
            node.pending.clear()
        self._synced()

    def fsync_directory(self, directory: Path) -> None:
        node = self.lookup(directory)
        if not isinstance(node, SimDir):
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(directory))
        self._sync_point("dir")
        node.durable = dict(node.entries)
        self._synced()

    def ftruncate(self, fd: int, length: int) -> None:
        self._alive()
        node = self._file(fd).node
        assert isinstance(node, SimFile)
        del node.data[length:]
        node.data.extend(bytes(length - len(node.data)))
        node.pending.append((length, None))

    def close(self, fd: int) -> None:
        handle = self._fds.pop(fd, None)
        if handle is None:
            if self.image is not None:
                return  # closing after the power went out changes nothing
            raise OSError(errno.EBADF, "bad file descriptor")
        if isinstance(handle.node, SimFile):
            for offset in [at for at, holder in handle.node.locks.items() if holder == fd]:
                del handle.node.locks[offset]

    def lock_range(self, fd: int, offset: int, run_id: str) -> None:
        self._alive()
        node = self._file(fd).node
        assert isinstance(node, SimFile)
        if node.locks.get(offset, fd) != fd:
            raise RunLocked("another writer holds this run", run_id=run_id)
        node.locks[offset] = fd

    def wait_range(self, fd: int, offset: int) -> None:
        self.lock_range(fd, offset, "")  # one thread: a byte held elsewhere is a bug here

    def unlock_range(self, fd: int, offset: int) -> None:
        node = self._file(fd).node
        assert isinstance(node, SimFile)
        if node.locks.get(offset) == fd:
            del node.locks[offset]

    def range_held(self, fd: int, offset: int) -> bool:
        """Whether another open description (not ``fd``'s) holds the byte's lock."""
        self._alive()
        node = self._file(fd).node
        assert isinstance(node, SimFile)
        return node.locks.get(offset, fd) != fd

    def names_file(self, fd: int, path: Path) -> bool:
        """Whether ``path`` names, right now, the very file open on ``fd``."""
        self._alive()
        return self.lookup(path) is self._file(fd).node

    def unlink(self, path: Path) -> None:
        """Remove the directory entry (durably gone only once the directory is synced).

        Descriptors open on the file keep it, and its lock, as a removed file's do.
        """
        self._alive()
        parent, name = self._parent(path)
        node = parent.entries.get(name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        if isinstance(node, SimDir):
            raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
        del parent.entries[name]

    def mkdir(self, path: Path) -> None:
        self._alive()
        parent, name = self._parent(path)
        if name in parent.entries:
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        parent.entries[name] = SimDir()

    def is_dir(self, path: Path) -> bool:
        self._alive()
        return isinstance(self.lookup(path), SimDir)

    def listdir(self, directory: Path) -> list[str]:
        self._alive()
        node = self.lookup(directory)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(directory))
        if isinstance(node, SimFile):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
        return list(node.entries)

    def _parent(self, path: Path) -> tuple[SimDir, str]:
        parent = self.lookup(Path(path).parent)
        if parent is None:
            raise FileNotFoundError(errno.ENOENT, "no such directory", str(path))
        if isinstance(parent, SimFile):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
        return parent, Path(path).name

    def _file(self, fd: int) -> OpenFile:
        try:
            return self._fds[fd]
        except KeyError:
            raise OSError(errno.EBADF, "bad file descriptor") from None


def _after_loss(node: SimFile, rng: random.Random, *, ordered: bool = False) -> bytes:
    """The content of ``node`` after a power cut: durable bytes plus what of the rest survives.

    ``ordered`` models a file system that keeps appended data in order (as ext4 does in
    its default ``data=ordered`` mode): the pending changes survive as a prefix, the
    first one that does not survive whole leaves at most a piece of its start followed
    by zeros, and everything after it is gone.

    The fates are drawn first and the random bytes from a stream of their own, one byte
    at a time, so that a seed picks the same fates whatever the lengths of the lines
    (which vary with the timings recorded in them).
    """
    fates = [rng.choice(("keep", "drop", "garbage")) for _ in node.pending]
    noise = random.Random(rng.getrandbits(64))
    content = bytearray(node.durable)
    for (offset, data), fate in zip(node.pending, fates, strict=True):
        if ordered and fate != "keep":
            if fate == "garbage" and data is not None:
                piece = data[: noise.randrange(len(data))]  # never the line's own newline
                zeros = noise.randrange(len(data) - len(piece))
                content[offset:] = piece + bytes(zeros)
            break
        if fate == "drop":
            continue
        if data is None:  # a truncation
            del content[offset:]
            content.extend(bytes(offset - len(content)))
            continue
        payload = data if fate == "keep" else bytes(noise.randrange(256) for _ in data)
        if offset > len(content):
            content.extend(bytes(offset - len(content)))  # a hole reads as zeros
        content[offset : offset + len(payload)] = payload
    return bytes(content)


# -- the run and what the disk says about it ----------------------------------------------


class AckingStore(FaultyStore):
    """Passes every call to ``inner`` and counts the records the store promised to keep.

    ``acked`` is the number of complete lines the run file must hold: the ones it held
    (durably) when this store object started, plus every record whose write had returned
    when the last barrier (``start_run`` or ``write_intent``) returned. No write fails
    here: a power loss, not a crash, ends the store's life.
    """

    def __init__(self, inner: EngineStore, *, initial: int) -> None:
        super().__init__(inner, fail_after_writes=sys.maxsize)
        self.returned = self.acked = initial
        self.started = initial > 0

    async def _write(self, write: Callable[..., Awaitable[None]], *args: Any) -> None:
        await write(*args)
        self.returned += 1

    async def start_run(self, record: RunStarted) -> None:
        await super().start_run(record)
        self.acked, self.started = self.returned, True

    async def write_intent(self, intent: Intent) -> None:
        await super().write_intent(intent)
        self.acked = self.returned


def lines_of(data: bytes | None) -> list[bytes]:
    """The newline-terminated lines of ``data``, each with its newline."""
    return [piece + b"\n" for piece in (data or b"").split(b"\n")[:-1]]


class Subject:
    """One run across the lives of its machine: its tools, model, ledger and replay."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        self.ledger = Ledger()
        self.tools = make_tools(self.ledger, replay=replay)
        self.model = ScriptedModelClient(six_step_script())

    def definition(self, store: Any) -> Any:
        return definition(store, model=self.model)

    def request(self) -> Any:
        return request("r", self.tools, model_replay=self.replay)


@dataclass
class Life:
    """One life of the machine: the disk as the program left it, and as the reboot found it."""

    disk: SimDisk
    image: SimDisk
    store: AckingStore
    cut_fired: bool


async def live(subject: Subject, disk: SimDisk, *, resuming: bool, seed: int) -> Life:
    """Drive the run on ``disk`` until its power cut fires, or else cut it after the call."""
    store = AckingStore(
        jsonl_store_on(DIRECTORY, disk), initial=len(lines_of(disk.content(RUN_FILE)))
    )
    drive = resume if resuming else run
    try:
        await drive(subject.definition(store), subject.request())
    except PowerLoss:
        assert disk.image is not None
        return Life(disk, disk.image, store, cut_fired=True)
    await store.inner.aclose()
    return Life(disk, disk.cut_power(random.Random(seed)), store, cut_fired=False)


@dataclass
class Outcome:
    kind: str  # "finished", "in-doubt", "fresh" or "corrupt"
    torn: bool  # the reboot found bytes after the last complete line


_EXPECTED: dict[Replay, RunResult] = {}


async def expected(replay: Replay) -> RunResult:
    """The uninterrupted six-step run (on a disk that never loses power)."""
    if replay not in _EXPECTED:
        store = jsonl_store_on(DIRECTORY, SimDisk())
        _EXPECTED[replay] = await run(
            definition(store, script=six_step_script()),
            request("r", make_tools(Ledger(), replay=replay), model_replay=replay),
        )
        await store.aclose()
    return _EXPECTED[replay]


async def aftermath(subject: Subject, life: Life, where: str) -> Outcome:
    """Check (a), (b) and (c) on what ``life`` left behind; say what recovery found."""
    intended = lines_of(life.disk.content(RUN_FILE))  # what a reader saw before the cut
    content = life.image.content(RUN_FILE)
    found = lines_of(content)
    genuine = 0
    while genuine < min(len(found), len(intended)) and found[genuine] == intended[genuine]:
        genuine += 1
    durable = parse_lines(b"".join(intended[:genuine]), RUN_FILE.name, "r")
    torn = bool(content) and not (content or b"").endswith(b"\n")

    # (a) What a barrier acknowledged is there, intact, with everything written before it.
    if life.store.started:
        assert content is not None, where
    assert genuine >= life.store.acked, where

    # (b) Every side effect that ran has its intent on the disk.
    intents = {record.result_id for record in durable if isinstance(record, Intent)}
    for _, result_id in subject.ledger.calls:
        assert result_id in intents, where
    for call in subject.model.calls:
        assert f"r:{call.call_index}:model" in intents, where
    effects_before = len(subject.ledger.calls)

    # (c) Recovery on what is left.
    store = jsonl_store_on(DIRECTORY, life.image)
    try:
        if not found:
            assert not life.store.started, where  # only an unacknowledged start can vanish
            with pytest.raises(RunNotFound):
                await resume(subject.definition(store), subject.request())
            # Nothing is there, so the run can be started afresh.
            fresh = await run(subject.definition(store), subject.request())
            assert same_outcome(fresh, await expected(subject.replay)), where
            return Outcome("fresh", torn)
        if genuine < len(found):
            with pytest.raises(CorruptLog) as caught:
                await resume(subject.definition(store), subject.request())
            assert caught.value.location == f"{RUN_FILE}:{genuine + 1}", where
            # Nothing was written; the only change is the claim's cut of a torn tail (bytes
            # after the last newline, never a record), made before the log was read.
            assert content is not None, where
            complete = content[: content.rfind(b"\n") + 1]
            assert life.image.content(RUN_FILE) == complete, where
            assert effects_before == len(subject.ledger.calls), where
            return Outcome("corrupt", torn)
        plan = read_plan(RunLog(run_id="r", records=tuple(durable)))
        resumed = await resume(subject.definition(store), subject.request())
        if plan.state is RecoveryState.IN_DOUBT or (
            plan.ended is not None and plan.ended.stop_reason is StopReason.IN_DOUBT
        ):
            assert resumed.stop_reason is StopReason.IN_DOUBT, where
            kind = "in-doubt"
        else:
            assert same_outcome(resumed, await expected(subject.replay)), where
            kind = "finished"
        records = (await store.read_log("r")).records
        assert isinstance(records[-1], RunEnded), where
        assert list(records[: len(durable)]) == durable, where  # recovery kept what it found
        assert (life.image.content(RUN_FILE) or b"").endswith(b"\n"), where
    finally:
        await store.aclose()

    # Over every life of the run, a forbidden replay never happened.
    if subject.replay is Replay.NEVER:
        results = [result_id for _, result_id in subject.ledger.calls]
        assert len(results) == len(set(results)), where
        indexes = [call.call_index for call in subject.model.calls]
        assert len(indexes) == len(set(indexes)), where
    return Outcome(kind, torn)


def replay_for(seed: int) -> Replay:
    return Replay.ALLOWED if seed % 2 == 0 else Replay.NEVER


async def power_loss_scenario(
    at: int | None, before: bool, seed: int, *, ordered: bool = False
) -> Outcome:
    """Cut the power at sync ``at`` (``None``: after the run ended), reboot and recover."""
    subject = Subject(replay_for(seed))
    where = f"cut at sync {at} ({'before' if before else 'after'}), seed {seed}"
    disk = SimDisk(Cut(at, before, seed) if at is not None else None, ordered=ordered)
    life = await live(subject, disk, resuming=False, seed=seed)
    outcome = await aftermath(subject, life, where)
    assert life.cut_fired is (at is not None), where  # the enumeration reached the point
    return outcome


# -- the tests ----------------------------------------------------------------------------


async def test_the_sync_points_of_a_six_step_run() -> None:
    """Pins the enumeration below: 14 syncs, in this order, and nothing else."""
    disk = SimDisk()
    store = jsonl_store_on(DIRECTORY, disk)
    result = await run(
        definition(store, script=six_step_script()),
        request("r", make_tools(Ledger()), model_replay=Replay.NEVER),
    )
    await store.aclose()
    assert result.stop_reason is StopReason.SUBMITTED
    assert tuple(disk.syncs) == SYNC_KINDS
    # With the power on, the model loses nothing: the file holds every line.
    content = disk.content(RUN_FILE)
    assert content is not None and content == disk.written(RUN_FILE)
    assert content.count(b"\n") == 25


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
@pytest.mark.parametrize("at", every_point(range(1, len(SYNC_KINDS) + 1)))
async def test_power_loss_at_every_sync_point(at: int, before: bool) -> None:
    for seed in SEEDS:
        await power_loss_scenario(at, before, seed)


async def test_power_loss_after_the_run_ended() -> None:
    """The last step and the end record were never synced: either may be lost or damaged."""
    for seed in SEEDS:
        await power_loss_scenario(None, False, seed)


@pytest.mark.slow
async def test_the_simulated_faults_reach_every_outcome() -> None:
    """The disk model is not too kind: every kind of aftermath really happens."""
    seen: set[str] = set()
    torn = False
    for at in range(1, len(SYNC_KINDS) + 1):
        for before in (True, False):
            for seed in range(4):
                outcome = await power_loss_scenario(at, before, seed)
                seen.add(outcome.kind)
                torn = torn or outcome.torn
    assert seen == {"finished", "in-doubt", "fresh", "corrupt"}
    assert torn


@pytest.mark.parametrize("at", every_point([*range(1, len(SYNC_KINDS) + 1), None]))
async def test_power_loss_on_an_ordered_file_system_never_needs_a_human(at: int | None) -> None:
    """When lost appends can only shorten the file (a torn last line, zeros after it, no
    line of foreign bytes), every power cut recovers by itself: never ``CorruptLog``."""
    seen: set[str] = set()
    for seed in range(4):
        for before in (True, False) if at is not None else (False,):
            outcome = await power_loss_scenario(at, before, seed, ordered=True)
            assert outcome.kind != "corrupt"
            seen.add(outcome.kind)
    assert seen


def test_the_ordered_model_only_shortens() -> None:
    torn = False
    for seed in range(64):
        node = SimFile(
            data=bytearray(b"aaaa\nbbbb\ncccc\n"),
            durable=b"aaaa\n",
            pending=[(5, b"bbbb\n"), (10, b"cccc\n")],
        )
        after = _after_loss(node, random.Random(seed), ordered=True)
        complete = after[: after.rfind(b"\n") + 1]
        assert complete in (b"aaaa\n", b"aaaa\nbbbb\n", b"aaaa\nbbbb\ncccc\n")
        tail = after[len(complete) :]
        assert b"\n" not in tail
        torn = torn or bool(tail)
    assert torn


async def test_a_lost_directory_entry_makes_the_run_fresh_not_corrupt() -> None:
    """The run file's entry is durable only once ``start_run`` synced the directory."""
    lost = kept = 0
    for seed in range(16):
        disk = SimDisk(Cut(3, True, seed))  # just before the directory sync of start_run
        with pytest.raises(PowerLoss):
            await run(
                definition(jsonl_store_on(DIRECTORY, disk), script=six_step_script()),
                request("r", make_tools(Ledger())),
            )
        assert disk.image is not None
        store = jsonl_store_on(DIRECTORY, disk.image)
        if disk.image.content(RUN_FILE) is None:
            lost += 1
            assert (await store.read_log("r")).records == ()
            assert tuple(run.run_id for run in await store.list_runs()) == ()
            with pytest.raises(RunNotFound):
                await resume(
                    definition(store, script=six_step_script()), request("r", make_tools(Ledger()))
                )
        else:
            # The file was synced before its entry: when the entry survives, so does it.
            kept += 1
            assert [type(r) for r in (await store.read_log("r")).records] == [RunStarted]
            assert tuple(run.run_id for run in await store.list_runs()) == ("r",)
        await store.aclose()
    assert lost and kept


def test_the_disk_model_keeps_drops_and_garbles_pending_writes() -> None:
    """The fault model itself: durable bytes never change; the rest is kept, lost or garbled."""
    fates: set[str] = set()
    for seed in range(64):
        node = SimFile(
            data=bytearray(b"aaaa\nbbbb\ncccc\n"),
            durable=b"aaaa\n",
            pending=[(5, b"bbbb\n"), (10, b"cccc\n")],
        )
        after = _after_loss(node, random.Random(seed))
        assert after.startswith(b"aaaa\n")
        assert len(after) in (5, 10, 15)
        for piece, original in ((after[5:10], b"bbbb\n"), (after[10:15], b"cccc\n")):
            if piece == original:
                fates.add("keep")
            elif piece in (b"", bytes(5)):
                fates.add("drop")
            else:
                fates.add("garbage")
    assert fates == {"keep", "drop", "garbage"}


def test_the_disk_model_locks_names_and_unlinks_like_a_file_system() -> None:
    """A byte's lock belongs to one open description; a removed path names nothing, and a
    new file at the path is another file; a removal is durable only once its directory is."""
    disk = SimDisk()
    disk.mkdir(DIRECTORY)
    disk.fsync_directory(DIRECTORY.parent)
    first = disk.open(RUN_FILE, os.O_RDWR | os.O_CREAT)
    second = disk.open(RUN_FILE, os.O_RDONLY)
    assert not disk.range_held(first, 7) and not disk.range_held(second, 7)
    disk.lock_range(first, 7, "r")
    assert not disk.range_held(first, 7) and disk.range_held(second, 7)
    assert not disk.range_held(second, 8)  # another byte is another run
    with pytest.raises(RunLocked):
        disk.lock_range(second, 7, "r")
    disk.lock_range(second, 8, "s")
    disk.unlock_range(second, 8)
    assert not disk.range_held(first, 8)
    assert disk.names_file(first, RUN_FILE) and disk.names_file(second, RUN_FILE)
    disk.fsync_directory(DIRECTORY)
    disk.unlink(RUN_FILE)
    assert disk.lookup(RUN_FILE) is None
    assert not disk.names_file(first, RUN_FILE)
    assert disk.range_held(second, 7)  # the removed file keeps its lock while it is open
    with pytest.raises(FileNotFoundError):
        disk.unlink(RUN_FILE)
    with pytest.raises(IsADirectoryError):
        disk.unlink(DIRECTORY)
    successor = disk.open(RUN_FILE, os.O_RDWR | os.O_CREAT)
    assert disk.names_file(successor, RUN_FILE) and not disk.names_file(first, RUN_FILE)
    assert not disk.range_held(successor, 7)
    disk.close(first)
    assert not disk.range_held(second, 7)
    # Before the directory is synced again, a power cut may bring the removed file back.
    assert disk.cut_power(random.Random(0)).lookup(RUN_FILE) is not None


async def test_a_claim_that_starts_nothing_leaves_no_entry_and_claims_are_seen() -> None:
    disk = SimDisk()
    holder = jsonl_store_on(DIRECTORY, disk)
    watcher = jsonl_store_on(DIRECTORY, disk)
    await holder.claim_run("r")
    assert disk.content(RUN_FILE) == b""
    with pytest.raises(RunLocked):
        await watcher.claim_run("r")
    assert await watcher.describe_run("r") is None  # claimed, never started: no run
    await holder.release_run("r")
    assert disk.lookup(RUN_FILE) is None
    await holder.claim_run("r")
    await holder.start_run(RunStarted(run_id="r", snapshot={}))
    seen = await watcher.describe_run("r")
    assert seen is not None and seen.claimed and not seen.finished
    await holder.release_run("r")  # a started run keeps its file
    assert lines_of(disk.content(RUN_FILE))
    (seen,) = await watcher.list_runs()
    assert seen.run_id == "r" and not seen.claimed
    await holder.aclose()
    await watcher.aclose()


@pytest.mark.parametrize("first_cut", [5, 8, 14])
async def test_recovery_survives_a_second_power_loss(first_cut: int) -> None:
    """Power fails again while recovering: the recovery's own writes and its cut of the torn
    tail are pending changes like any other, and a third boot still recovers."""
    seen: set[str] = set()
    for seed in range(6):
        for at, before in ((1, True), (1, False), (2, True), (2, False)):
            subject = Subject(replay_for(seed))
            where = f"first cut {first_cut}, second cut {at} {before}, seed {seed}"
            first = await live(
                subject, SimDisk(Cut(first_cut, True, seed)), resuming=False, seed=seed
            )
            content = first.image.content(RUN_FILE)
            intended = lines_of(first.disk.content(RUN_FILE))
            if not lines_of(content) or lines_of(content) != intended[: len(lines_of(content))]:
                continue  # nothing to resume, or a corrupt line: the single-loss tests cover it
            # A second machine life on a copy of what the first reboot found.
            copy = first.image.cut_power(random.Random(0))
            second = await live(
                subject,
                SimDisk(Cut(at, before, seed + 1000), root=copy.root),
                resuming=True,
                seed=seed,
            )
            outcome = await aftermath(subject, second, where)
            seen.add(outcome.kind)
            if not content.endswith(b"\n"):
                seen.add("torn before the second loss")
    assert {"finished", "torn before the second loss"} <= seen
