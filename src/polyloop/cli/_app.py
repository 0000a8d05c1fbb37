"""Argument parsing, the commands, and the one place where errors become one line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
import anyio.to_thread
from rich.console import Console
from rich.text import Text

from polyloop._escaping import escape_field
from polyloop.cli import _demo, _facts, _html, _people, _render, _verify, _worker
from polyloop.cli._common import (
    PROGRAM,
    CliError,
    console,
    escaped_output,
    install_hint,
    print_unwrapped,
)
from polyloop.cli._stores import (
    SYNTAX,
    StoreSpec,
    open_store,
    parse_store,
    require_existing,
    with_schema,
)
from polyloop.cli._view import RunSummary, read_view, summaries, summary_json
from polyloop.types import PolyLoopError

if TYPE_CHECKING:
    from typing import TypeAlias

INTERRUPTED_EXIT_STATUS = 130
_Command = Callable[[argparse.Namespace, Console], Awaitable[int]]


_Commands: TypeAlias = "argparse._SubParsersAction[_Parser]"


class _UsageError(Exception):
    """What the parser found wrong with the command line."""


class _ParserExit(Exception):
    """The parser is done (``--help``): return ``status`` instead of exiting."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and whose exits are returns."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _ParserExit(status)


def run_command(argv: Sequence[str]) -> int:
    """Parse ``argv``, run the command, and map every user error to one line and 1.

    Everything it prints, its errors included, goes out with lone surrogates escaped.
    """
    with escaped_output():
        return _run(argv)


def _run(argv: Sequence[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except _ParserExit as done:
        return done.status
    except _UsageError as exc:
        return _fail(str(exc))
    if args.backend == "trio" and not _trio_installed():
        return _fail(f"the trio backend needs trio: {install_hint('trio')}")
    with _quiet_logging():
        try:
            command: _Command = args.command
            return anyio.run(command, args, console(), backend=args.backend)
        except KeyboardInterrupt:
            return _interrupted(args)
        except Exception as exc:  # noqa: BLE001 - the command never shows a traceback
            if isinstance(_single(exc), BrokenPipeError):
                return _reader_went_away()
            return _fail(_describe(_single(exc)))
        except BaseExceptionGroup as group:
            # Ctrl-C that landed inside a task group (a server's connection, say)
            # arrives wrapped: it is the same interruption.
            if group.split(KeyboardInterrupt)[1] is None:
                return _interrupted(args)
            raise


def _interrupted(args: argparse.Namespace) -> int:
    if getattr(args, "interrupt_ends_normally", False):
        return 0
    print(f"{PROGRAM}: interrupted", file=sys.stderr)
    hint = getattr(args, "interrupted_hint", None)
    if hint is not None:
        print(hint, file=sys.stderr)
    return INTERRUPTED_EXIT_STATUS


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROGRAM,
        description=(
            "Run the PolyLoop demo agent; list, show, verify and prune stored runs; "
            "approve, reject and settle what waits for a person; cancel a run; host agents "
            "in a worker."
        ),
        epilog=f"STORE is {SYNTAX}. Exit status: 0 success, 1 error.",
    )
    _backend_option(parser, default="asyncio")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _demo_parser(commands)
    _runs_parser(commands)
    _show_parser(commands)
    _verify_parser(commands)
    _prune_parser(commands)
    _pending_parser(commands)
    _approve_parser(commands)
    _reject_parser(commands)
    _settle_parser(commands)
    _cancel_parser(commands)
    _serve_parser(commands)
    _worker_parser(commands)
    return parser


def _backend_option(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    parser.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default=default if default is not None else argparse.SUPPRESS,
        help="the async backend (default: asyncio; trio needs polyloop[trio])",
    )


def _add(
    commands: _Commands, name: str, command: _Command, help_text: str
) -> argparse.ArgumentParser:
    sub = commands.add_parser(name, help=help_text, description=help_text)
    sub.set_defaults(command=command)
    _backend_option(sub, default=None)
    return sub


def _store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", metavar="STORE", type=_store_type, help=SYNTAX)
    _schema_option(parser)


def _schema_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schema",
        metavar="NAME",
        default=None,
        help="the PostgreSQL schema of a postgresql:// store (default: polyloop)",
    )


async def _store_of(args: argparse.Namespace) -> StoreSpec:
    """The STORE argument, with ``--schema`` applied, refused unless the store is there."""
    spec: StoreSpec = with_schema(args.store, args.schema)
    await anyio.to_thread.run_sync(require_existing, spec)
    return spec


def _store_type(text: str) -> StoreSpec:
    try:
        return parse_store(text)
    except CliError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


_N = TypeVar("_N", int, float)


def _number_between(text: str, parse: Callable[[str], _N], low: _N, high: _N, expected: str) -> _N:
    """``text`` read by ``parse`` and within ``[low, high]``, or the argument error that
    says what was ``expected``."""
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}")
    return value


def _seconds(text: str) -> float:
    return _number_between(text, float, 0.0, 60.0, "seconds between 0 and 60")


# -- demo ----------------------------------------------------------------------------------


def _demo_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "demo",
        _demo_command,
        "Run a self-contained agent on a durable store, step by step.",
    )
    sub.add_argument(
        "--store",
        type=_store_type,
        default=None,
        metavar="STORE",
        help=f"where the run is kept (default: {_demo.DEFAULT_STORE})",
    )
    _schema_option(sub)
    sub.add_argument("--resume", metavar="RUN_ID", help="finish an interrupted demo run")
    sub.add_argument(
        "--crash-after-writes",
        type=_positive,
        metavar="N",
        help="end the process (os._exit) right after the N-th store write",
    )
    sub.add_argument(
        "--model",
        choices=("scripted", "openai"),
        default="scripted",
        help="the deterministic scripted model (default) or an OpenAI-compatible server",
    )
    sub.add_argument("--base-url", metavar="URL", help="the server's base URL (--model openai)")
    sub.add_argument("--model-name", metavar="NAME", help="the model name (--model openai)")
    sub.add_argument(
        "--api-key", metavar="KEY", help="API key (--model openai; default: $OPENAI_API_KEY)"
    )
    sub.add_argument(
        "--pace",
        type=_seconds,
        default=0.3,
        metavar="SECONDS",
        help="how long the scripted model thinks per step (default: 0.3)",
    )


async def _demo_command(args: argparse.Namespace, out: Console) -> int:
    options = _demo_options(args)
    # Shown if the user interrupts the run.
    args.interrupted_hint = f"resume it with: {_demo.resume_command(options, options.run_id)}"
    return await _demo.demo(options, out)


def _demo_options(args: argparse.Namespace) -> _demo.DemoOptions:
    if args.model == "openai":
        missing = [
            flag
            for flag, value in (("--base-url", args.base_url), ("--model-name", args.model_name))
            if not value
        ]
        if missing:
            raise CliError(f"--model openai needs {' and '.join(missing)}")
    else:
        given = [
            flag
            for flag, value in (
                ("--base-url", args.base_url),
                ("--model-name", args.model_name),
                ("--api-key", args.api_key),
            )
            if value
        ]
        if given:
            raise CliError(f"{', '.join(given)}: only with --model openai")
    return _demo.DemoOptions(
        run_id=args.resume or _demo.new_run_id(),
        store=with_schema(args.store or parse_store(_demo.DEFAULT_STORE), args.schema),
        store_given=args.store is not None,
        resume=args.resume,
        crash_after_writes=args.crash_after_writes,
        model=args.model,
        base_url=args.base_url,
        model_name=args.model_name,
        api_key=args.api_key,
        pace=args.pace,
    )


# -- runs ----------------------------------------------------------------------------------


def _runs_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "runs",
        _runs_command,
        "List every run of a store with its state, stop reason and steps.",
    )
    _store_argument(sub)
    form = sub.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON object per line and run")
    form.add_argument(
        "--watch",
        type=_watch_seconds,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="list again every SECONDS (default 2) until Ctrl-C",
    )


def _watch_seconds(text: str) -> float:
    return _number_between(text, float, 0.1, 3600.0, "seconds between 0.1 and 3600")


async def _runs_command(args: argparse.Namespace, out: Console) -> int:
    spec = await _store_of(args)
    async with open_store(spec) as store:
        if args.watch is not None:
            args.interrupt_ends_normally = True  # Ctrl-C is how a watch is stopped
            while True:
                out.clear()
                out.print(
                    f"{spec.shown} at {datetime.now(UTC):%H:%M:%S}Z, every {args.watch:g} s "
                    "(Ctrl-C stops)",
                    markup=False,
                    soft_wrap=True,  # one line, however long the store's name
                )
                _print_runs(out, spec, await summaries(store))
                await anyio.sleep(args.watch)
        listed = await summaries(store)
    if args.json:
        for run in listed:
            _write_line(json.dumps(summary_json(run), ensure_ascii=False))
    else:
        _print_runs(out, spec, listed)
    return 0


def _print_runs(out: Console, spec: StoreSpec, listed: list[RunSummary]) -> None:
    if listed:
        print_unwrapped(out, _render.runs_table(listed, now=datetime.now(UTC)))
    else:
        out.print(f"no runs in {spec.shown}", markup=False)
    # A watch's reader sees each listing as soon as it is printed, even through a pipe.
    out.file.flush()


# -- show ----------------------------------------------------------------------------------


def _show_parser(commands: _Commands) -> None:
    sub = _add(commands, "show", _show_command, "Show the trajectory of one run, step by step.")
    _store_argument(sub)
    sub.add_argument("run_id", metavar="RUN_ID")
    form = sub.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="one JSON document for machines")
    form.add_argument(
        "--html",
        metavar="FILE",
        type=Path,
        help="write a self-contained HTML page of the trajectory to FILE",
    )


async def _show_command(args: argparse.Namespace, out: Console) -> int:
    spec = await _store_of(args)
    async with open_store(spec) as store:
        view = await read_view(store, spec, args.run_id)
    if args.json:
        _write_line(json.dumps(_facts.show_json(view), ensure_ascii=False, indent=2))
    elif args.html is not None:
        try:
            await anyio.Path(args.html).write_text(_html.page(view), encoding="utf-8")
        except OSError as exc:  # the page's path is at fault, not the run or the store
            raise CliError(
                f"cannot write the HTML page to {args.html}: {exc.strerror or exc}"
            ) from None
        out.print(f"wrote {args.html}", markup=False)
    else:
        out.print(_render.trajectory(view))
    return 0


# -- verify --------------------------------------------------------------------------------


def _verify_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "verify",
        _verify_command,
        "Check stored logs: torn tails (warnings), corrupt records, another schema "
        "major and records out of order (errors). Exit status 1 on any error.",
    )
    _store_argument(sub)
    sub.add_argument("run_id", metavar="RUN_ID", nargs="?", help="check only this run")


async def _verify_command(args: argparse.Namespace, out: Console) -> int:
    spec = await _store_of(args)
    async with open_store(spec) as store:
        checks = await _verify.verify(store, spec, args.run_id)
    for check in checks:
        _print_check(check, out)
    errors = sum(1 for check in checks if check.errors)
    warned = sum(1 for check in checks if check.findings and not check.errors)
    clean = len(checks) - errors - warned
    runs = f"{len(checks)} run{'' if len(checks) == 1 else 's'}"
    summary = Text(
        f"{runs} checked: {clean} clean, {warned} with warnings, {errors} with errors",
        style="bold red" if errors else "bold",
    )
    out.print(summary, soft_wrap=True)
    return 1 if errors else 0


def _print_check(check: _verify.RunCheck, out: Console) -> None:
    for note in check.notes:
        line = Text()
        line.append("note     ", style="cyan")
        line.append(f"{escape_field(check.name)}: {escape_field(note)}")
        out.print(line, soft_wrap=True)
    if not check.findings:
        line = Text()
        line.append("ok       ", style="green")
        line.append(f"{escape_field(check.name)} ({check.records} records)")
        out.print(line, soft_wrap=True)
        return
    for finding in check.findings:
        style = "red" if finding.level == "error" else "yellow"
        line = Text()
        line.append(f"{finding.level:<9}", style=style)
        where = f"{escape_field(check.name)}  {escape_field(finding.location)}"
        line.append(f"{where}: {escape_field(finding.message)}")
        out.print(line, soft_wrap=True)


# -- prune ---------------------------------------------------------------------------------


def _prune_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "prune",
        _prune_command,
        "Delete the runs that finished before a date, archiving them first if asked. "
        "Runs that are unfinished, in doubt or being driven are never touched.",
    )
    _store_argument(sub)
    sub.add_argument(
        "--finished-before",
        required=True,
        type=_moment,
        metavar="DATE",
        help="an ISO date or time (UTC unless it says otherwise)",
    )
    sub.add_argument(
        "--archive",
        metavar="DIR",
        type=Path,
        help="write each run's log to DIR first (a JSONL store: polyloop show jsonl:DIR RUN_ID)",
    )


def _moment(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO date or time such as 2026-11-30 or 2026-11-30T12:00, not {text!r}"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


async def _prune_command(args: argparse.Namespace, out: Console) -> int:
    spec = await _store_of(args)
    async with open_store(spec) as store:
        before = len(await store.list_runs())
        pruned = await store.prune(finished_before=args.finished_before, archive=args.archive)
        after = len(await store.list_runs())
    where = f", archived to {args.archive}" if args.archive is not None else ""
    out.print(
        f"pruned {len(pruned)} of {before} runs (finished before "
        f"{args.finished_before.isoformat()}){where}; {after} left",
        markup=False,
        soft_wrap=True,
    )
    return 0


# -- a person in the loop ------------------------------------------------------------------


def _pending_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "pending",
        _pending_command,
        "List the runs that wait for a person: an action to approve or reject, or an "
        "action or model call in doubt to settle, each with the commands that answer it.",
    )
    _store_argument(sub)
    sub.add_argument("--json", action="store_true", help="one JSON object per line and run")


async def _pending_command(args: argparse.Namespace, out: Console) -> int:
    spec = await _store_of(args)
    return await _people.pending(spec, out, as_json=args.json)


def _answer_parser(
    commands: _Commands, name: str, command: _Command, help_text: str, *aliases: str
) -> Any:
    sub = _add(commands, name, command, help_text)
    _store_argument(sub)
    sub.add_argument("run_id", metavar="RUN_ID")
    sub.add_argument("--by", required=True, metavar="NAME", help="who answers (recorded)")
    sub.add_argument(
        "--result-id",
        *aliases,
        dest="result_id",
        metavar="RESULT_ID",
        help="the result id of what you answer, as 'polyloop pending' shows it: the answer "
        "is refused, and nothing written, if that is no longer what the run waits on",
    )
    return sub


def _approve_parser(commands: _Commands) -> None:
    sub = _answer_parser(
        commands,
        "approve",
        _approve_command,
        "Approve the action a run waits on; resuming the run then runs it.",
    )
    sub.add_argument(
        "--arguments",
        metavar="JSON",
        help="run it with these arguments instead (a JSON object, checked against the "
        "tool's schema)",
    )


async def _approve_command(args: argparse.Namespace, out: Console) -> int:
    given = _people.Answer(
        by=args.by,
        approve=True,
        arguments=_people.parse_arguments(args.arguments),
        result_id=args.result_id,
    )
    return await _answer(args, given, out)


def _reject_parser(commands: _Commands) -> None:
    sub = _answer_parser(
        commands,
        "reject",
        _reject_command,
        "Reject the action a run waits on; the model is told it was not executed, and why.",
    )
    sub.add_argument("--reason", required=True, metavar="TEXT", help="told to the model")


async def _reject_command(args: argparse.Namespace, out: Console) -> int:
    given = _people.Answer(by=args.by, approve=False, reason=args.reason, result_id=args.result_id)
    return await _answer(args, given, out)


def _settle_parser(commands: _Commands) -> None:
    sub = _answer_parser(
        commands,
        "settle",
        _settle_command,
        "Say what became of the action or model call a run is in doubt about: it ran "
        "(--ran --observation TEXT) or it did not (--did-not-run --reason TEXT). A model "
        "call that did not run is made again; one that ran, its reply lost, ends the run "
        "model_failure.",
        "--intent",
    )
    how = sub.add_mutually_exclusive_group(required=True)
    how.add_argument("--ran", action="store_true", help="it ran")
    how.add_argument("--did-not-run", action="store_true", help="it did not run")
    sub.add_argument("--observation", metavar="TEXT", help="what it gave, or a note (--ran)")
    sub.add_argument("--reason", metavar="TEXT", help="why it did not run (--did-not-run)")


async def _settle_command(args: argparse.Namespace, out: Console) -> int:
    if args.ran and (args.observation is None or args.reason is not None):
        raise CliError("--ran needs --observation TEXT (and takes no --reason)")
    if args.did_not_run and (args.reason is None or args.observation is not None):
        raise CliError("--did-not-run needs --reason TEXT (and takes no --observation)")
    given = _people.Answer(
        by=args.by,
        ran=bool(args.ran),
        observation=args.observation if args.ran else args.reason,
        result_id=args.result_id,
    )
    return await _answer(args, given, out)


async def _answer(args: argparse.Namespace, given: _people.Answer, out: Console) -> int:
    spec = await _store_of(args)
    return await _people.answer(spec, args.run_id, given, out)


def _cancel_parser(commands: _Commands) -> None:
    sub = _answer_parser(
        commands,
        "cancel",
        _cancel_command,
        "Stop a run for good: nothing it has not started yet runs, and no worker drives it "
        "again. A run nobody drives ends now; a run a worker drives ends before its next "
        "effect (an action already running finishes first).",
    )
    sub.add_argument("--reason", required=True, metavar="TEXT", help="why (recorded)")


async def _cancel_command(args: argparse.Namespace, out: Console) -> int:
    spec = await _store_of(args)
    given = _people.Answer(by=args.by, reason=args.reason, result_id=args.result_id)
    return await _people.cancel_run(spec, args.run_id, given, out)


# -- the web console ----------------------------------------------------------------------

REFUSED_EXIT_STATUS = 2
DEFAULT_PORT = 8765
_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")


def _serve_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "serve",
        _serve_command,
        "Serve a web console over a store: every run live, and approve, reject and settle "
        "in the browser. Listens on 127.0.0.1 unless told otherwise; any other address "
        "needs an access token or an authenticating proxy.",
    )
    _store_argument(sub)
    sub.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)"
    )
    sub.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"the port (default: {DEFAULT_PORT}; 0 picks a free one)",
    )
    sub.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="a file holding the access token every request must carry (or set "
        "$POLYLOOP_CONSOLE_TOKEN; never on the command line, where others can read it)",
    )
    sub.add_argument(
        "--user-header",
        metavar="NAME",
        help="behind an authenticating proxy: the request header naming the person "
        "(such as X-Forwarded-User), recorded as who answered; requests without it are refused",
    )
    sub.add_argument(
        "--read-only", action="store_true", help="show runs only: no forms, every POST refused"
    )
    sub.add_argument(
        "--poll",
        type=_poll_seconds,
        default=1.0,
        metavar="SECONDS",
        help="how often the live list looks at the store for changes (default: 1)",
    )
    sub.add_argument(
        "--trace-url",
        metavar="TEMPLATE",
        help="link each run's page to its trace in a tracing UI: an http(s) address with "
        "{trace_id} (the run's OpenTelemetry trace id) and {run_id}, such as "
        "https://tempo.example/trace/{trace_id}",
    )
    sub.add_argument(
        "--temporal-url",
        metavar="TEMPLATE",
        help="link each run's page to its Temporal workflow: an http(s) address with "
        "{run_id} (the workflow id) and {trace_id}, such as "
        "http://localhost:8233/namespaces/default/workflows/{run_id}",
    )


def _port(text: str) -> int:
    return _number_between(text, int, 0, 65535, "a port from 0 to 65535")


def _poll_seconds(text: str) -> float:
    value = _seconds(text)
    if value < 0.05:
        raise argparse.ArgumentTypeError(f"expected at least 0.05 seconds, not {text!r}")
    return value


async def _serve_command(args: argparse.Namespace, out: Console) -> int:
    console_parts = _web_extra()
    from polyloop.cli._console import _serve

    if args.user_header is not None and not _HEADER_NAME.fullmatch(args.user_header):
        raise CliError(f"--user-header {args.user_header!r} is not a header name")
    access = console_parts.Access(
        token=await _console_token(args.token_file),
        user_header=args.user_header,
        read_only=args.read_only,
    )
    trace_link = console_parts.parsed_link(args.trace_url, "--trace-url")
    temporal_link = console_parts.parsed_link(args.temporal_url, "--temporal-url")
    problem = console_parts.exposure_problem(args.host, access)
    if problem is not None:
        print(f"{PROGRAM}: error: {problem}", file=sys.stderr)
        return REFUSED_EXIT_STATUS
    spec = await _store_of(args)
    async with open_store(spec) as store:
        listener = await anyio.to_thread.run_sync(_serve.listen, args.host, args.port)
        settings = console_parts.Settings(
            spec.shown,
            access,
            poll_s=args.poll,
            trace_link=trace_link,
            temporal_link=temporal_link,
        )
        app = console_parts.create_app(store, settings)
        _say_where(out, spec.shown, listener.url, access)
        await _serve.serve(app, listener, args.backend)
    return 0


def _web_extra() -> Any:
    """The console's package, or one line saying how to install what it needs."""
    try:
        import hypercorn  # noqa: F401
        import jinja2  # noqa: F401
        import python_multipart  # noqa: F401
        import starlette  # noqa: F401
    except ImportError as exc:
        raise CliError(f"polyloop serve needs {exc.name}: {install_hint('web')}") from None
    from polyloop.cli import _console

    return _console


async def _console_token(path: Path | None) -> str | None:
    """The access token from ``--token-file``, else from the environment, else none."""
    from polyloop.cli._console._guard import MIN_TOKEN_CHARS, TOKEN_ENV

    if path is not None:
        try:
            token = (await anyio.Path(path).read_text(encoding="utf-8")).strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise CliError(f"cannot read the token file {path}: {reason or exc}") from None
        where = f"the token file {path}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        where = f"${TOKEN_ENV}"
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS or not token.isprintable():
        raise CliError(
            f"{where} must hold a token of at least {MIN_TOKEN_CHARS} printable characters "
            "(for example: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def _say_where(out: Console, store: str, url: str, access: Any) -> None:
    out.print(f"console for {store}", markup=False, soft_wrap=True)
    out.print(f"open {url}", markup=False, soft_wrap=True)
    notes = []
    if access.token is not None:
        notes.append(f"log in with the access token at {url}login")
    if access.user_header is not None:
        notes.append(f"people are named by the {access.user_header} header of the proxy")
    if access.read_only:
        notes.append("read-only: no answers can be given here")
    notes.append("Ctrl-C stops it")
    for note in notes:
        out.print(note, markup=False, soft_wrap=True)
    out.file.flush()


# -- the worker ----------------------------------------------------------------------------


def _worker_parser(commands: _Commands) -> None:
    sub = _add(
        commands,
        "worker",
        _worker_command,
        "Host the agents MODULE:ATTR names (an Agent, a sequence or mapping of them, or a "
        "function returning an async context manager that yields them): drive every run "
        "of theirs that can go on, one line per run it drives, stops or leaves waiting. "
        "SIGTERM or Ctrl-C drains (each run stops at its next step boundary); a second "
        "one stops at once. Runs stay resumable either way.",
    )
    sub.add_argument("target", metavar="MODULE:ATTR", help="the agents to host, as app:agents")
    sub.add_argument(
        "--concurrency",
        type=_positive,
        default=10,
        metavar="N",
        help="drive at most N runs at once (default: 10)",
    )
    sub.add_argument(
        "--poll-s",
        type=_poll_seconds,
        default=0.5,
        metavar="SECONDS",
        help=(
            "how often each store is listed for runs that changed (default: 0.5); "
            "PostgreSQL stores notify the worker instead and are listed every 5 s"
        ),
    )
    sub.add_argument(
        "--drain-grace-s",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long a drain waits for runs to reach a step boundary before it "
        "cancels them (default: 30)",
    )
    sub.add_argument("--json", action="store_true", help="one JSON object per line")


async def _worker_command(args: argparse.Namespace, out: Console) -> int:
    options = _worker.WorkerOptions(
        target=args.target,
        concurrency=args.concurrency,
        poll_s=args.poll_s,
        drain_grace_s=args.drain_grace_s,
        as_json=args.json,
    )
    return await _worker.worker(options)


# -- plumbing ------------------------------------------------------------------------------


def _write_line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _reader_went_away() -> int:
    """The reader of standard output stopped (``polyloop runs | head``): say nothing.

    What is still buffered goes to the null device, so that Python's own flush at exit
    does not fail on the closed pipe a second time; the status is 1, as Python's own.
    """
    try:
        target = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture): nothing to silence
        return 1
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, target)
    os.close(devnull)
    return 1


def _fail(message: str) -> int:
    one_line = " ".join(message.split())
    print(f"{PROGRAM}: error: {one_line}", file=sys.stderr)
    return 1


def _trio_installed() -> bool:
    try:
        import trio  # noqa: F401
    except ImportError:
        return False
    return True


def _single(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CliError | PolyLoopError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    return f"unexpected {type(exc).__name__}: {exc}"


class _OneLine(logging.Handler):
    """Prints log records as one warning line each, never with a traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        message = " ".join(record.getMessage().split())
        print(f"{PROGRAM}: warning: {message}", file=sys.stderr)


@contextmanager
def _quiet_logging() -> Iterator[None]:
    """While a command runs, library warnings (the kernel's, psycopg's) are one line."""
    handler = _OneLine(level=logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("polyloop", "psycopg")]
    saved = [(logger, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
