"""The documentation builds in strict mode, and its programs run as the pages show.

A page (``docs/getting-started.md`` above all) marks what is executed with two HTML
comments, invisible on the rendered page:

* ``<!-- file: NAME -->`` right before a ```` ```python ```` block: the block is part of
  the file ``NAME``. Blocks of one name are joined in page order into one file, so the
  page can build a program piece by piece and still be checked whole.
* ``<!-- run -->`` right before a ```` ```console ```` block: every line starting with
  ``$ `` is a command (``.venv/bin/python ...``, the interpreter of the environment the
  install commands create, or ``cat FILE``), and the lines up to the next command are
  exactly what it prints. A last line ``Killed`` (what a shell prints for a
  process that died of ``SIGKILL``) means the command must die of ``SIGKILL``.

For each page, all its files are written to a fresh directory first, then its run
blocks are executed there in page order, so later commands see what earlier ones left
behind.

The other checks: every page of ``docs/`` is in the navigation, every Python block in
the docs at least compiles, and every test the docs cite as ``tests/<file>.py::<name>``
exists, so that a guarantee never points at a test that is not there.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GETTING_STARTED = DOCS / "getting-started.md"
VENV_PYTHON = ".venv/bin/python"

_BLOCK = re.compile(
    r"^(?:<!--\s*(?P<marker>[^>]*?)\s*-->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```\s*$",
    re.MULTILINE | re.DOTALL,
)
_CITED_TEST = re.compile(r"tests/(?P<file>[\w/]+\.py)::(?P<name>[\w:]+)")


@dataclass(frozen=True)
class Block:
    marker: str | None
    lang: str
    body: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(m.group("marker"), m.group("lang"), m.group("body")) for m in _BLOCK.finditer(text)
    ]


# -- the build --------------------------------------------------------------------------------


def test_mkdocs_builds_in_strict_mode(tmp_path: Path) -> None:
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()


def test_every_page_is_in_the_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", config, re.MULTILINE))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert pages == listed


# -- the getting-started programs ---------------------------------------------------------------


def _commands(body: str) -> list[tuple[str, list[str]]]:
    """``(command, expected output lines)`` pairs of a console block."""
    commands: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            assert commands, f"output before any command in:\n{body}"
            commands[-1][1].append(line)
    return commands


def _execute(command: str, cwd: Path) -> tuple[int, str]:
    argv = shlex.split(command)
    if argv[0] == "cat":
        assert len(argv) == 2
        return 0, (cwd / argv[1]).read_text(encoding="utf-8")
    # The pages name the environment's interpreter, so they work as written without an
    # activated environment; here that is the interpreter running the tests.
    assert argv[0] == VENV_PYTHON, f"the docs test runs {VENV_PYTHON} and cat only: {command!r}"
    done = subprocess.run(
        [sys.executable, *argv[1:]], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert done.returncode in (0, -signal.SIGKILL), (
        f"{command!r} exited {done.returncode}:\n{done.stderr}"
    )
    return done.returncode, done.stdout


def _marked_pages() -> list[Path]:
    return sorted(
        page for page in DOCS.rglob("*.md") if any(block.marker for block in blocks(page))
    )


def _run_page(page: Path, workdir: Path) -> int:
    """Write the page's files into ``workdir``, run its commands; the number run."""
    found = blocks(page)
    files: dict[str, list[str]] = {}
    for block in found:
        if block.marker and block.marker.startswith("file:"):
            assert block.lang == "python"
            files.setdefault(block.marker.removeprefix("file:").strip(), []).append(block.body)
    for name, parts in files.items():
        (workdir / name).write_text("\n\n".join(parts), encoding="utf-8")

    count = 0
    for block in found:
        if block.marker != "run":
            continue
        assert block.lang == "console"
        for command, expected in _commands(block.body):
            killed = bool(expected) and expected[-1] == "Killed"
            status, out = _execute(command, workdir)
            assert status == (-signal.SIGKILL if killed else 0), command
            shown = expected[:-1] if killed else expected
            assert out.splitlines() == shown, f"{page.name}: {command!r} printed:\n{out}"
            count += 1
    return count


@pytest.fixture(scope="module")
def getting_started(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The getting-started page run once for the module: its directory and the number of
    commands run. A test that goes on from there works on a copy of the directory."""
    workdir = tmp_path_factory.mktemp("getting-started")
    return workdir, _run_page(GETTING_STARTED, workdir)


def test_getting_started_programs_run_as_shown(getting_started: tuple[Path, int]) -> None:
    workdir, commands = getting_started
    # first.py twice, agent.py twice, crash.py, the resume and the two cats.
    assert commands >= 8
    assert (workdir / "agent.py").is_file() and (workdir / "crash.py").is_file()
    # The second runs read the finished runs back: each submit happened once.
    assert (workdir / "submitted.txt").read_text().splitlines() == [
        "task-1:2:action 1173",
        "task-2:2:action 1173",
    ]


def test_getting_started_makes_a_working_directory_before_its_first_file() -> None:
    """The page's files must not land in the checkout: before its first program it makes
    a directory next to the checkout, with an environment of its own, and goes there."""
    found = blocks(GETTING_STARTED)
    first = next(i for i, b in enumerate(found) if b.marker and b.marker.startswith("file:"))
    commands = [c for b in found[:first] if b.lang == "console" for c, _ in _commands(b.body)]
    assert "mkdir ../polyloop-tour" in commands
    assert any(c.startswith("python3 -m venv ../polyloop-tour/.venv &&") for c in commands)
    assert commands[-1] == "cd ../polyloop-tour"


def test_getting_started_agent_refuses_changed_inputs_in_one_line(
    getting_started: tuple[Path, int], tmp_path: Path
) -> None:
    """Changed inputs on a second run: one line, as the page shows it, and no traceback."""
    shutil.copytree(getting_started[0], tmp_path, dirs_exist_ok=True)
    agent = tmp_path / "agent.py"
    source = agent.read_text(encoding="utf-8")
    assert source.count("max_steps=10") == 1
    agent.write_text(source.replace("max_steps=10", "max_steps=20"), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "agent.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert "budget.max_steps (10 then, 20 now)" in line
    assert "start a new run under a new run id" in line
    assert line in GETTING_STARTED.read_text(encoding="utf-8")
    # Nothing was written for the refused attempt: with the budget put back, the run
    # reads as it ended.
    agent.write_text(source, encoding="utf-8")
    again = subprocess.run(
        [sys.executable, "agent.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout == "submitted after 3 steps (resumed: True)\n"


def test_marked_pages_run_the_environments_python() -> None:
    """A bare ``python`` on a page would not find PolyLoop outside an activated venv."""
    for page in _marked_pages():
        for block in blocks(page):
            if block.marker == "run":
                for command, _ in _commands(block.body):
                    assert command.startswith((f"{VENV_PYTHON} ", "cat ")), (page.name, command)


@pytest.mark.parametrize(
    "page", [p for p in _marked_pages() if p != GETTING_STARTED], ids=lambda p: p.name
)
def test_other_marked_programs_run_as_shown(page: Path, tmp_path: Path) -> None:
    assert _run_page(page, tmp_path) >= 1


@pytest.mark.parametrize("page", _marked_pages(), ids=lambda p: p.name)
def test_every_marker_is_known(page: Path) -> None:
    markers = {block.marker for block in blocks(page) if block.marker}
    assert all(m == "run" or m.startswith("file:") for m in markers), markers


# -- every Python block compiles; every cited test exists ---------------------------------------


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: p.name)
def test_python_blocks_compile(page: Path) -> None:
    for index, block in enumerate(blocks(page)):
        if block.lang == "python":
            # Fragments may use await at the top level, as in an async REPL.
            compile(
                block.body,
                f"{page.name}[block {index}]",
                "exec",
                flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            )


def _cited_tests() -> list[tuple[str, str, str]]:
    cited = set()
    for page in DOCS.rglob("*.md"):
        for match in _CITED_TEST.finditer(page.read_text(encoding="utf-8")):
            cited.add((page.name, match.group("file"), match.group("name")))
    return sorted(cited)


def test_the_docs_cite_tests() -> None:
    assert len(_cited_tests()) >= 30


@pytest.mark.parametrize(("page", "file", "name"), _cited_tests(), ids=lambda value: str(value))
def test_every_cited_test_exists(page: str, file: str, name: str) -> None:
    source = ROOT / "tests" / file
    assert source.is_file(), f"{page} cites a missing file tests/{file}"
    text = source.read_text(encoding="utf-8")
    *classes, function = name.split("::")
    for cls in classes:
        assert re.search(rf"^class {cls}\b", text, re.MULTILINE), (
            f"{page} cites tests/{file}::{name}, but there is no class {cls}"
        )
    if classes and not re.search(rf"^\s+(async )?def {function}\b", text, re.MULTILINE):
        # A test a contract class inherits from one of the suites in polyloop.testing.
        contracts = (ROOT / "src" / "polyloop" / "testing").glob("*_contract.py")
        text = "\n".join(contract.read_text(encoding="utf-8") for contract in contracts)
    assert re.search(rf"^\s*(async )?def {function}\b", text, re.MULTILINE), (
        f"{page} cites tests/{file}::{name}, which does not exist"
    )


# -- the performance page shows the committed reference run -------------------------------

REPORT_START = (
    "<!-- report of bench/results/reference.json: "
    "python -m bench render bench/results/reference.json -->"
)
REPORT_END = "<!-- end of report -->"


def test_performance_page_holds_the_report_of_the_reference_run() -> None:
    """Every figure in the page's tables comes from the committed results file."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from bench.report import render

    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert REPORT_START in page and REPORT_END in page
    shown = page.split(REPORT_START, 1)[1].split(REPORT_END, 1)[0].strip()
    reference = json.loads((ROOT / "bench" / "results" / "reference.json").read_text())
    assert shown == render(reference).strip()


CONSOLE_REPORT_START = (
    "<!-- report of bench/results/console.json: "
    "python -m bench render bench/results/console.json -->"
)


def test_console_page_holds_the_report_of_the_console_benchmark() -> None:
    """The console page's speed figures are the rendering of the committed results file."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from bench.report import render

    page = (DOCS / "console.md").read_text(encoding="utf-8")
    assert CONSOLE_REPORT_START in page and REPORT_END in page
    shown = page.split(CONSOLE_REPORT_START, 1)[1].split(REPORT_END, 1)[0].strip()
    committed = json.loads((ROOT / "bench" / "results" / "console.json").read_text())
    assert set(committed["benchmarks"]) == {"console"}
    assert committed["meta"]["mode"] == "full"
    assert shown == render(committed).strip()


HOSTING_REPORT_START = (
    "<!-- report of bench/results/hosting.json: "
    "python -m bench render bench/results/hosting.json -->"
)


def test_performance_page_holds_the_report_of_the_worker_benchmark() -> None:
    """The worker's latency and idle figures on the performance page are the rendering
    of the committed results file, from a full run."""
    _check_full_report(HOSTING_REPORT_START, "hosting.json")


def _check_full_report(start: str, results: str) -> None:
    """The performance page shows, after ``start``, the rendering of the committed full
    run in ``bench/results/<results>``."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from bench.report import render

    page = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert start in page
    shown = page.split(start, 1)[1].split(REPORT_END, 1)[0].strip()
    committed = json.loads((ROOT / "bench" / "results" / results).read_text())
    assert committed["mode"] == "full"
    assert shown == render(committed).strip()


FOLLOWING_REPORT_START = (
    "<!-- report of bench/results/following.json: "
    "python -m bench render bench/results/following.json -->"
)


def test_performance_page_holds_the_report_of_the_following_benchmark() -> None:
    """The followers' cost and latency on the performance page are the rendering of the
    committed results file, from a full run."""
    _check_full_report(FOLLOWING_REPORT_START, "following.json")


THROUGHPUT_BLOCK = re.compile(
    r"<!-- python -m bench render (?P<file>\S+) -->\n(?P<shown>.*?)"
    r"<!-- end of throughput results -->",
    re.DOTALL,
)


def test_performance_page_holds_the_committed_throughput_results() -> None:
    """Every throughput table on the page, or in the research record that keeps the
    history of a piece of work, is the rendering of a committed results file, and every
    committed results file is shown once."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from bench.report import render

    pages = [DOCS / "performance.md", *sorted((ROOT / "research-wiki").glob("[0-9]*.md"))]
    blocks = [
        (match["file"], match["shown"].strip())
        for page in pages
        for match in THROUGHPUT_BLOCK.finditer(page.read_text(encoding="utf-8"))
    ]
    committed = sorted((ROOT / "bench" / "results" / "throughput").glob("*.json"))
    assert sorted(name for name, _ in blocks) == [
        path.relative_to(ROOT).as_posix() for path in committed
    ]
    for name, shown in blocks:
        assert shown == render(json.loads((ROOT / name).read_text())), name


def test_the_readme_program_runs_as_written() -> None:
    """The README's first program, with a scripted model as its ``my_model``."""
    from polyloop import StopReason
    from polyloop.testing import ScriptedModelClient

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    program = text.split("## Using it", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    model = ScriptedModelClient(['{"tool": "submit", "arguments": {"answer": "42"}}'])
    namespace: dict[str, object] = {"my_model": model}
    exec(compile(program, "README.md", "exec"), namespace)
    result = namespace["result"]
    assert getattr(result, "stop_reason", None) is StopReason.SUBMITTED
    assert getattr(result, "steps", ())[0].observation == "submitted 42"
