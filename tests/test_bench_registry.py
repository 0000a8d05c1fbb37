"""``python -m bench`` is the one way in: every benchmark the docs cite is registered.

Nothing here measures. What is checked: ``--help`` lists every registered benchmark with
its one-line summary; every ``python -m bench NAME`` command in the docs, the README
and ``bench/README.md`` names a registered benchmark; no page still cites a script of
``bench/`` run by path; an unknown name is refused; and each benchmark's own ``--help``
answers without running anything.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.__main__ import REGISTRY, main  # noqa: E402

PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"python -m bench ([a-z0-9][a-z0-9-]*)")


def test_help_lists_every_benchmark_with_its_summary() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = {line.split()[0]: line for line in shown.splitlines() if line.startswith("  ")}
    assert set(listed) == set(REGISTRY)
    for name, entry in REGISTRY.items():
        assert listed[name].split(None, 1)[1] == entry.summary


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_benchmark_command_on_a_page_is_registered(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert set(CITED.findall(text)) <= set(REGISTRY), page
    assert not re.search(r"python bench/\w+\.py", text), f"{page.name} runs a script by path"


def test_the_pages_cite_every_benchmark() -> None:
    cited = {name for page in PAGES for name in CITED.findall(page.read_text(encoding="utf-8"))}
    assert set(REGISTRY) <= cited


def test_an_unknown_benchmark_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-benchmark"]) == 2
    assert "unknown benchmark 'no-such-benchmark'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_benchmark_answers_help_without_running(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main([name, "--help"])
    except SystemExit as stop:  # argparse ends its help this way
        status = stop.code if isinstance(stop.code, int) else 1
    assert status == 0
    assert "usage: python -m bench " + name in capsys.readouterr().out
