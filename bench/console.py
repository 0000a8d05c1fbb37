"""Benchmark 10: how fast the web console answers on a store with a long history.

The store is built once per kind through its own write path and kept between runs of
the benchmark (its building takes minutes). What is measured: ``bench/README.md``,
benchmark 10.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import anyio.lowlevel

from bench._common import (
    STORE_NAMES,
    Context,
    Row,
    at_once,
    drop_schema,
    history,
    median,
    missing,
    now,
    postgres_schema,
    settle,
    skipped,
)
from bench._sampling import beside_ticker, python_peak_bytes
from bench.agents import definition, object_schema, request
from polyloop import Replay, ToolRegistry, ToolSpec, start_or_resume
from polyloop import run as run_agent
from polyloop.cli._console._listing import PER_PAGE
from polyloop.ports import ManagedStore
from polyloop.stores import SqliteStore
from polyloop.testing import FaultyStore, JsonActionInterpreter, ScriptedModelClient, SimulatedCrash

TITLE = "10. The web console on a store with a long history"
COLUMNS = [
    ("name", "store / request"),
    ("ttfb_ms", "first byte ms"),
    ("full_ms", "full response ms"),
    ("logs_read", "logs read"),
    ("stall_ms", "longest loop stall ms"),
    ("peak_mb", "peak MB"),
    ("repeats", "repeats"),
]
STORES = ("sqlite", "postgres")
# Runs written at once while a store is built: each task writes whole runs, one after
# another; the store batches the writes that wait at the same moment into one commit.
BUILDERS = 500
CACHE_ENV = "POLYLOOP_BENCH_CACHE"
NUMBER_SCHEMA = object_schema(n={"type": "integer"})
ENV_SCHEMA = object_schema(env={"type": "string"})


@dataclass(frozen=True)
class ConsoleSizes:
    """The store's runs, the deep page asked for, and the repetitions of each figure."""

    finished: int
    unfinished: int
    deep_page: int
    repeats: int

    @property
    def tag(self) -> str:
        return f"{self.finished}-{self.unfinished}"

    def mix(self) -> dict[str, int]:
        """How many unfinished runs of each kind: half resumable, 3/10 awaiting
        approval, the rest in doubt."""
        resumable = self.unfinished // 2
        awaiting = self.unfinished * 3 // 10
        return {
            "resumable": resumable,
            "awaiting": awaiting,
            "doubt": self.unfinished - resumable - awaiting,
        }


FULL_SIZES = ConsoleSizes(finished=100_000, unfinished=1_000, deep_page=2_000, repeats=5)
QUICK_SIZES = ConsoleSizes(finished=10_000, unfinished=100, deep_page=200, repeats=3)
TINY_SIZES = ConsoleSizes(finished=60, unfinished=10, deep_page=2, repeats=1)


# -- the agent whose runs fill the store ----------------------------------------------------


def _call(name: str, **arguments: Any) -> str:
    return json.dumps({"tool": name, "arguments": arguments})


def _answer(text: str) -> str:
    return json.dumps({"answer": text})


SCRIPTS = {
    "finished": [_call("double", n=1), _answer("done")],
    "resumable": [_call("double", n=1), _call("double", n=2), _answer("done")],
    "awaiting": [_call("double", n=1), _call("deploy", env="prod"), _answer("done")],
    "doubt": [_call("double", n=1), _call("pay", n=5), _answer("done")],
}
# Writes that land before the process "dies": a resumable run's start and first tool
# step; a payment's run up to the announcement of the payment.
CRASH_AFTER = {"resumable": 5, "doubt": 8}


def _tools() -> ToolRegistry:
    def handler(render: Callable[[dict[str, Any]], str]) -> Any:
        async def run_tool(arguments: dict[str, Any], *, result_id: str) -> str:
            await anyio.lowlevel.checkpoint()
            return render(arguments)

        return run_tool

    return ToolRegistry(
        [
            ToolSpec(
                name="double",
                description="Double a number.",
                parameters=NUMBER_SCHEMA,
                handler=handler(lambda a: str(a["n"] * 2)),
                replay=Replay.ALLOWED,
            ),
            ToolSpec(
                name="deploy",
                description="Deploy the build to an environment.",
                parameters=ENV_SCHEMA,
                handler=handler(lambda a: f"deployed to {a['env']}"),
                needs_approval=True,
            ),
            ToolSpec(
                name="pay",
                description="Pay an amount.",
                parameters=NUMBER_SCHEMA,
                handler=handler(lambda a: f"paid {a['n']}"),
            ),
        ],
        max_observation_chars=10_000,
    )


TOOLS = _tools()


def _definition(store: Any, kind: str) -> Any:
    return definition(ScriptedModelClient(list(SCRIPTS[kind])), JsonActionInterpreter(), store)


def _request(run_id: str) -> Any:
    return request(
        run_id,
        TOOLS,
        TOOLS.executor(),
        max_steps=10,
        max_context_chars=100_000,
        system="You are an operations agent.",
        goal="Double 1, then do the task.",
        model_replay=Replay.ALLOWED,
    )


async def _write_run(store: ManagedStore, kind: str, run_id: str) -> None:
    """One run of ``kind``, written through the kernel as a worker would write it."""
    crash_after = CRASH_AFTER.get(kind)
    if crash_after is None:
        await run_agent(_definition(store, kind), _request(run_id))
        return
    with contextlib.suppress(SimulatedCrash):
        faulty = FaultyStore(store, fail_after_writes=crash_after)
        await run_agent(_definition(faulty, kind), _request(run_id))
    if kind == "doubt":  # the next worker finds the payment announced and never finished
        await start_or_resume(_definition(store, kind), _request(run_id))


def _interleaved(mix: dict[str, int]) -> list[str]:
    """The kinds of ``mix`` spread through one list (round-robin while each lasts)."""
    left = dict(mix)
    out: list[str] = []
    while any(left.values()):
        for kind in mix:
            if left[kind]:
                out.append(kind)
                left[kind] -= 1
    return out


async def fill(store: ManagedStore, sizes: ConsoleSizes) -> None:
    """Write every run, each kind of unfinished run all along the history, ``BUILDERS``
    at a time."""
    runs = history(_interleaved(sizes.mix()), sizes.finished)
    await at_once((functools.partial(_write_run, store, *run) for run in runs), BUILDERS)


# -- the stores, built once and kept --------------------------------------------------------


def cache_dir() -> Path:
    """Where built SQLite stores are kept between runs of the benchmark."""
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "polyloop-bench-cache")


async def _complete(store: ManagedStore, sizes: ConsoleSizes) -> bool:
    """Whether ``store`` holds every run of the plan (a build cut short does not)."""
    listed = await store.list_runs()
    unfinished = sum(1 for item in listed if not item.finished)
    return (len(listed) - unfinished, unfinished) == (sizes.finished, sizes.unfinished)


@contextlib.asynccontextmanager
async def opened(
    ctx: Context, kind: str, sizes: ConsoleSizes, *, keep: bool
) -> AsyncIterator[ManagedStore]:
    """The built store of ``kind``: the kept one if it is whole, else built now (and kept
    if ``keep``; a tiny one lives in the work directory, or a schema dropped after)."""
    with _location(ctx, kind, sizes, keep=keep) as (make, discard):
        async with make() as store:
            if await _complete(store, sizes):
                ctx.say(f"    {STORE_NAMES[kind]}: using the store built before")
                yield store
                return
        discard()
        async with make() as store:
            began = now()
            await fill(store, sizes)
            ctx.say(
                f"    {STORE_NAMES[kind]}: built {sizes.finished:,} finished + "
                f"{sizes.unfinished:,} unfinished runs in {now() - began:.0f} s"
            )
            if not await _complete(store, sizes):
                raise AssertionError(f"the {kind} store built for the console lacks runs")
            yield store


@contextlib.contextmanager
def _location(
    ctx: Context, kind: str, sizes: ConsoleSizes, *, keep: bool
) -> Iterator[tuple[Callable[[], Any], Callable[[], None]]]:
    """How to open the store of ``kind`` and how to throw its contents away."""
    if kind == "sqlite":
        folder = cache_dir() if keep else ctx.scratch("console-sqlite")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"console-{sizes.tag}.sqlite"

        def discard_file() -> None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)

        yield (lambda: SqliteStore(path)), discard_file
        return
    from polyloop.stores import PostgresStore

    conninfo = ctx.postgres
    assert conninfo is not None
    with contextlib.ExitStack() as stack:
        schema = (
            f"polyloop_bench_console_{sizes.tag.replace('-', '_')}"
            if keep
            else stack.enter_context(postgres_schema(conninfo))
        )
        yield (
            (lambda: PostgresStore(conninfo, schema=schema)),
            lambda: drop_schema(conninfo, schema),
        )


# -- measuring ------------------------------------------------------------------------------


class CountingStore:
    """The store, counting the logs read through it (``read_log`` calls)."""

    def __init__(self, store: ManagedStore) -> None:
        self._store = store
        self.logs_read = 0

    async def read_log(self, run_id: str) -> Any:
        self.logs_read += 1
        return await self._store.read_log(run_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@dataclass
class Sample:
    ttfb_s: float
    full_s: float
    logs_read: int
    body: str
    stall_s: float = 0.0


async def with_ticker(request: Callable[[], Awaitable[Sample]]) -> Sample:
    """``request()``, with the longest event-loop stall during it: how long a 1 ms ticker
    beside it was kept from waking (as another request, or a run, would be)."""
    sample, ticker = await beside_ticker(request, 0.001)
    sample.stall_s = max(ticker.lateness_s, default=0.0)
    return sample


class _Timed:
    """An ASGI application that notes when the wrapped one sends its first byte."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.first_byte: float | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def noted(message: Any) -> None:
            if message["type"] == "http.response.start" and self.first_byte is None:
                self.first_byte = now()
            await send(message)

        await self.app(scope, receive, noted)


EVENTS = "/events?v=stale"


class Console:
    """A console application over the counting store, and a client speaking to it."""

    def __init__(self, store: ManagedStore) -> None:
        from polyloop.cli._console import Settings, create_app

        self.counting = CountingStore(store)
        self.timed = _Timed(create_app(self.counting, Settings("bench")))

    async def get(self, path: str) -> Sample:
        import httpx

        transport = httpx.ASGITransport(app=self.timed)
        async with httpx.AsyncClient(transport=transport, base_url="http://console.test") as client:
            self.timed.first_byte, read_before = None, self.counting.logs_read
            began = now()
            response = await client.get(path)
            full = now() - began
        if response.status_code != 200:
            raise AssertionError(f"GET {path} answered {response.status_code}")
        assert self.timed.first_byte is not None
        return Sample(
            self.timed.first_byte - began,
            full,
            self.counting.logs_read - read_before,
            response.text,
        )

    async def request(self, path: str) -> Sample:
        return await (self.first_change() if path == EVENTS else self.get(path))

    async def first_change(self) -> Sample:
        """How long the list's live updates take to look at the store once: the stream
        opened with a version that is out of date answers "changed" after one look.
        Driven as raw ASGI, since the stream never ends by itself."""
        got_event = anyio.Event()
        first_byte: list[float] = []

        async def receive() -> dict[str, Any]:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                first_byte.append(now())
            elif b"event: changed" in message.get("body", b""):
                got_event.set()

        path, _, query = EVENTS.partition("?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "headers": [(b"host", b"console.test")],
            "client": ("127.0.0.1", 1),
            "server": ("console.test", 80),
        }
        read_before = self.counting.logs_read
        began = now()
        async with anyio.create_task_group() as group:
            group.start_soon(self.timed.app, scope, receive, send)
            await got_event.wait()
            full = now() - began
            group.cancel_scope.cancel()
        return Sample(first_byte[0] - began, full, self.counting.logs_read - read_before, "")


@dataclass(frozen=True)
class Probe:
    """One figure: the request made (``path``), and whether on a new application."""

    key: str
    name: str
    path: str
    cold: bool
    check: Callable[[str, ConsoleSizes], None]
    # Read the logs one run at a time, as the console did before it read several at once.
    one_at_a_time: bool = False


def _lists(run_ids: list[str]) -> Callable[[str, ConsoleSizes], None]:
    """A check that the list page shows these runs, in this order."""

    def check(body: str, sizes: ConsoleSizes) -> None:
        places = [body.find(f">{run_id}</a>") for run_id in run_ids]
        if -1 in places or places != sorted(places):
            raise AssertionError(f"the page does not list {run_ids[0]}... in order")

    return check


def _shows(total: int) -> Callable[[str, ConsoleSizes], None]:
    """A check that the list page says it lists ``total`` runs."""

    def check(body: str, sizes: ConsoleSizes) -> None:
        if f"{total:,}" not in body and str(total) not in body:
            raise AssertionError(f"the page does not say it lists {total} runs")

    return check


@dataclass(frozen=True)
class Pages:
    """The runs the first page and the deep page show, and the deep page's cursor, as
    the store's own ``page_runs`` says."""

    first: list[str]
    deep: list[str]
    deep_cursor: str

    @classmethod
    async def of(cls, store: ManagedStore, sizes: ConsoleSizes) -> Pages:
        first = await store.page_runs(limit=PER_PAGE)  # type: ignore[attr-defined]
        above = await store.page_runs(limit=(sizes.deep_page - 1) * PER_PAGE)  # type: ignore[attr-defined]
        deep = await store.page_runs(limit=PER_PAGE, after=above.older)  # type: ignore[attr-defined]
        ids = [run.run_id for run in first.runs], [run.run_id for run in deep.runs]
        return cls(*ids, deep_cursor=above.older)


def probes(sizes: ConsoleSizes, approval_run: str, pages: Pages) -> list[Probe]:
    doubts = _shows(sizes.mix()["doubt"])

    def run_page(body: str, _: ConsoleSizes) -> None:
        if approval_run not in body or "Approve" not in body:
            raise AssertionError(f"the page of {approval_run} offers no approval")

    in_doubt = "/?state=" + quote("in doubt")
    deep = "/?after=" + quote(pages.deep_cursor)
    first = _lists(pages.first)
    return [
        Probe("first-cold", "/ (first page), cold", "/", True, first),
        Probe("first-warm", "/ (first page), warm", "/", False, first),
        Probe("doubt-cold", "/?state=in doubt, cold", in_doubt, True, doubts),
        Probe(
            "doubt-cold-serial",
            "/?state=in doubt, cold, one log at a time",
            in_doubt,
            True,
            doubts,
            one_at_a_time=True,
        ),
        Probe("doubt-warm", "/?state=in doubt, warm", in_doubt, False, doubts),
        Probe(
            "deep-cold",
            f"page {sizes.deep_page:,} (after its cursor), cold",
            deep,
            True,
            _lists(pages.deep),
        ),
        Probe(
            "run-cold",
            "/runs/RUN_ID (awaiting approval), cold",
            run_path(approval_run),
            True,
            run_page,
        ),
        Probe("events-look", "/events: one look at the store", EVENTS, True, _no_check),
    ]


def _no_check(body: str, sizes: ConsoleSizes) -> None:
    """The stream's one answer, "changed", is what ends the request: nothing to check."""


def run_path(run_id: str) -> str:
    from polyloop.cli._console import run_path as path

    return path(run_id)


@contextlib.contextmanager
def _reading(probe: Probe) -> Iterator[None]:
    """The console reading logs as ``probe`` asks: several at once, or one at a time."""
    from polyloop.cli._console import _data

    at_once = _data.READ_AT_ONCE
    _data.READ_AT_ONCE = 1 if probe.one_at_a_time else at_once
    try:
        yield
    finally:
        _data.READ_AT_ONCE = at_once


async def _application(store: ManagedStore, probe: Probe) -> Console:
    """A new application for ``probe`` (warmed by its request first if the probe is warm)."""
    console = Console(store)
    if not probe.cold:
        await console.get(probe.path)
    return console


async def _sample(store: ManagedStore, probe: Probe, sizes: ConsoleSizes) -> Sample:
    """One request of ``probe``, checked, on a new application."""
    with _reading(probe):
        console = await _application(store, probe)
        settle()
        sample = await with_ticker(lambda: console.request(probe.path))
    probe.check(sample.body, sizes)
    return sample


async def _peak_mb(store: ManagedStore, probe: Probe) -> float:
    """The peak of Python allocations during the probe's request, above the level before."""
    with _reading(probe):
        console = await _application(store, probe)
        return await python_peak_bytes(lambda: console.request(probe.path)) / 2**20


async def _list_runs_rows(
    store: ManagedStore, kind: str, backend: str, sizes: ConsoleSizes
) -> list[Row]:
    rows = []
    for unfinished_only, label in ((False, "every run"), (True, "unfinished runs")):
        times = []
        for _ in range(sizes.repeats):
            settle()
            began = now()
            listed = await store.list_runs(unfinished_only=unfinished_only)
            times.append(now() - began)
            expected = sizes.unfinished + (0 if unfinished_only else sizes.finished)
            if len(listed) != expected:
                raise AssertionError(f"listed {len(listed)} runs, not {expected}")
        rows.append(
            {
                "key": f"{kind}-{backend}-list-{'unfinished' if unfinished_only else 'all'}",
                "store": kind,
                "backend": backend,
                "name": f"{STORE_NAMES[kind]}, {backend}: list_runs() of {label}",
                "full_ms": median(times) * 1e3,
                "repeats": len(times),
            }
        )
    times = []
    for _ in range(sizes.repeats):
        settle()
        began = now()
        page = await store.page_runs(limit=PER_PAGE)  # type: ignore[attr-defined]
        times.append(now() - began)
        if len(page.runs) != PER_PAGE:
            raise AssertionError(f"a page of {len(page.runs)} runs, not {PER_PAGE}")
    rows.append(
        {
            "key": f"{kind}-{backend}-page",
            "store": kind,
            "backend": backend,
            "name": f"{STORE_NAMES[kind]}, {backend}: page_runs() of the {PER_PAGE} most recent",
            "full_ms": median(times) * 1e3,
            "repeats": len(times),
        }
    )
    return rows


async def _probe_rows(
    store: ManagedStore, kind: str, backend: str, sizes: ConsoleSizes, chosen: list[Probe]
) -> list[Row]:
    rows = []
    for probe in chosen:
        samples = [await _sample(store, probe, sizes) for _ in range(sizes.repeats)]
        reads = {sample.logs_read for sample in samples}
        rows.append(
            {
                "key": f"{kind}-{backend}-{probe.key}",
                "store": kind,
                "backend": backend,
                "name": f"{STORE_NAMES[kind]}, {backend}: {probe.name}",
                "ttfb_ms": median([s.ttfb_s for s in samples]) * 1e3,
                "full_ms": median([s.full_s for s in samples]) * 1e3,
                "logs_read": max(reads),
                "stall_ms": median([s.stall_s for s in samples]) * 1e3,
                "peak_mb": await _peak_mb(store, probe),
                "repeats": len(samples),
            }
        )
    return rows


async def _measure(
    ctx: Context, kind: str, backend: str, sizes: ConsoleSizes, keep: bool
) -> list[Row]:
    async with opened(ctx, kind, sizes, keep=keep) as store:
        unfinished = await store.list_runs(unfinished_only=True)
        approval_run = min(r.run_id for r in unfinished if r.run_id.startswith("awaiting-"))
        every = probes(sizes, approval_run, await Pages.of(store, sizes))
        # Under Trio, the first page only: the figure that says the backend changes nothing.
        chosen = every if backend == "asyncio" else every[:2]
        rows = await _list_runs_rows(store, kind, backend, sizes)
        return rows + await _probe_rows(store, kind, backend, sizes, chosen)


def run(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes.pick(FULL_SIZES, QUICK_SIZES, TINY_SIZES)
    keep = sizes != TINY_SIZES
    rows: list[Row] = []
    web = next(
        filter(None, map(missing, ("starlette", "jinja2", "python_multipart", "httpx"))), None
    )
    for kind in STORES:
        for backend in ("asyncio", "trio"):
            problem = web or ctx.unavailable(kind)
            if problem is not None:
                rows.append(
                    skipped(
                        {
                            "key": f"{kind}-{backend}",
                            "store": kind,
                            "backend": backend,
                            "name": f"{STORE_NAMES[kind]}, {backend}",
                        },
                        problem,
                    )
                )
                continue
            rows += anyio.run(_measure, ctx, kind, backend, sizes, keep, backend=backend)
    return {
        "title": TITLE,
        "columns": COLUMNS,
        "rows": rows,
        "targets": [],
        "sizes": {**asdict(sizes), "mix": sizes.mix()},
    }
