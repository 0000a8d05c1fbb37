"""What importing PolyLoop pulls in: no optional package, no store, no adapter.

Each check runs in a fresh interpreter, since this test process has long imported
everything.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SOURCE = TESTS.parent / "src" / "polyloop"
OPTIONAL = ("polygateway", "openai", "psycopg", "psycopg_pool", "trio", "mcp", "temporalio")


def modules_after(statement: str, *, extra_path: Path | None = None) -> set[str]:
    """The names in ``sys.modules`` after running ``statement`` in a new interpreter."""
    setup = f"import sys; sys.path.insert(0, {str(extra_path)!r}); " if extra_path else ""
    code = f"{setup}{statement}; import json, sys; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def top_level(names: set[str]) -> set[str]:
    return {name.partition(".")[0] for name in names}


def test_import_polyloop_pulls_in_no_optional_package_store_or_adapter() -> None:
    loaded = modules_after("import polyloop")
    assert "polyloop" in loaded
    assert top_level(loaded).isdisjoint(OPTIONAL), sorted(top_level(loaded) & set(OPTIONAL))
    assert not [
        name for name in loaded if name.startswith(("polyloop.stores", "polyloop.adapters"))
    ]


def test_import_polyloop_adapters_pulls_in_neither_adapter() -> None:
    loaded = modules_after("import polyloop.adapters")
    assert top_level(loaded).isdisjoint(OPTIONAL)
    assert "polyloop.adapters.gateway" not in loaded
    assert "polyloop.adapters.openai" not in loaded


def test_each_adapter_pulls_in_only_its_own_package() -> None:
    openai_side = modules_after("import polyloop.adapters.openai")
    assert "openai" in openai_side
    assert "polygateway" not in top_level(openai_side)

    gateway_side = modules_after(
        "import polyloop.adapters.gateway", extra_path=TESTS / "adapters" / "polygateway_standin"
    )
    assert "polygateway" in gateway_side
    assert "openai" not in top_level(gateway_side)


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.partition(".")[0])
    return roots


@pytest.mark.parametrize("package", ["polygateway", "openai"])
def test_only_its_adapter_module_imports_an_adapter_package(package: str) -> None:
    owner = SOURCE / "adapters" / ("gateway.py" if package == "polygateway" else "openai.py")
    importers = {path for path in SOURCE.rglob("*.py") if package in _imported_roots(path)}
    if package == "openai":
        # The command line may offer a real model; it is outside the import rules.
        importers = {
            path for path in importers if path.relative_to(SOURCE).parts[0] not in ("cli", "cli.py")
        }
    assert importers == {owner}


@pytest.mark.slow  # a fresh interpreter each; the kernel's own rule above stays quick
def test_only_polyloop_mcp_imports_the_mcp_sdk() -> None:
    importers = {path for path in SOURCE.rglob("*.py") if "mcp" in _imported_roots(path)}
    assert importers == {SOURCE / "mcp.py"}
    loaded = modules_after("import polyloop.mcp")
    assert "mcp" in top_level(loaded)
    assert top_level(loaded).isdisjoint(set(OPTIONAL) - {"mcp", "trio"})


@pytest.mark.slow  # a fresh interpreter each; the kernel's own rule above stays quick
def test_only_polyloop_otel_imports_opentelemetry() -> None:
    importers = {path for path in SOURCE.rglob("*.py") if "opentelemetry" in _imported_roots(path)}
    assert importers
    assert {path.relative_to(SOURCE).parts[0] for path in importers} == {"otel"}
    loaded = modules_after("import polyloop.otel")
    assert "opentelemetry" in top_level(loaded)
    # The API only: the SDK is the application's choice.
    assert "opentelemetry.sdk" not in loaded
    assert top_level(loaded).isdisjoint(set(OPTIONAL) - {"trio"})
    # The MCP SDK imports OpenTelemetry itself, so the kernel's freedom of it is checked
    # apart from the other optional packages.
    assert "opentelemetry" not in top_level(modules_after("import polyloop, polyloop.stores"))


@pytest.mark.slow  # a fresh interpreter each; the kernel's own rule above stays quick
def test_only_polyloop_temporal_imports_temporalio() -> None:
    importers = {path for path in SOURCE.rglob("*.py") if "temporalio" in _imported_roots(path)}
    assert importers
    assert {path.relative_to(SOURCE).parts[0] for path in importers} == {"temporal"}
    loaded = modules_after("import polyloop.temporal")
    assert "temporalio" in top_level(loaded)
    # A worker needs nothing else: no store, adapter or other optional package.
    assert top_level(loaded).isdisjoint(set(OPTIONAL) - {"temporalio"})
    assert not [
        name for name in loaded if name.startswith(("polyloop.stores", "polyloop.adapters"))
    ]


@pytest.mark.parametrize(
    ("statement", "missing", "feature", "extra"),
    [
        ("import polyloop.temporal", "temporalio", "polyloop.temporal", "temporal"),
        ("import polyloop.otel", "opentelemetry", "polyloop.otel", "otel"),
        ("import polyloop.mcp", "mcp", "polyloop.mcp", "mcp"),
        ("import polyloop.adapters.openai", "openai", "polyloop.adapters.openai", "openai"),
        ("from polyloop.stores import PostgresStore", "psycopg", "PostgresStore", "postgres"),
        ("from polyloop.stores import PostgresStore", "psycopg_pool", "PostgresStore", "postgres"),
    ],
)
def test_a_missing_optional_package_names_the_extra_to_install(
    statement: str, missing: str, feature: str, extra: str
) -> None:
    # None in sys.modules makes the import fail as if the package were not installed.
    code = (
        f"import json, sys\nsys.modules[{missing!r}] = None\ntry:\n    {statement}\n"
        "except ImportError as exc:\n"
        "    cause = exc.__cause__\n"
        "    print(json.dumps([type(exc).__name__, str(exc), exc.name, type(cause).__name__,"
        " getattr(cause, 'name', None)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    kind, message, name, cause, cause_name = json.loads(done.stdout.splitlines()[-1])
    assert kind == "ModuleNotFoundError"
    hint = f"in the PolyLoop checkout, run pip install -e '.[{extra}]'"
    assert message == f"{feature} needs the {extra} extra: {hint}"
    assert cause == "ModuleNotFoundError"
    assert name == cause_name == missing
