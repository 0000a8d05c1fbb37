"""An import-linter contract type about names rather than modules.

Some seams are names in a shared module (``polyloop.ports``), so which modules may use
them cannot be said with a module-level contract. A ``names`` contract says it: inside
``source_modules`` (and their descendants), only ``allowed_modules`` may mention any of
``names``, whether imported, used as an attribute, or named in an annotation.
pyproject.toml registers it under ``[tool.importlinter] contract_types``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import grimp
from importlinter import Contract, ContractCheck, fields, output


class NamesContract(Contract):
    """Only ``allowed_modules`` among ``source_modules`` mention any of ``names``."""

    type_name = "names"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())
    names = fields.ListField(subfield=fields.StringField())

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        allowed = set(self.allowed_modules)  # type: ignore[call-overload]
        names = set(self.names)  # type: ignore[call-overload]
        found = []
        for source in self.source_modules:  # type: ignore[attr-defined]
            for module in sorted({source} | graph.find_descendants(source)):
                if module in allowed:
                    continue
                found += [(module, name) for name in sorted(_mentioned(module) & names)]
        return ContractCheck(kept=not found, warnings=None, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for module, name in check.metadata["found"]:
            output.print_error(f"{module} mentions {name}")
            output.new_line()


def _mentioned(module: str) -> set[str]:
    """Every name and attribute ``module``'s source mentions."""
    tree = ast.parse(_source(module).read_text(encoding="utf-8"))
    mentioned: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            mentioned.add(node.id)
        elif isinstance(node, ast.Attribute):
            mentioned.add(node.attr)
        elif isinstance(node, ast.alias):
            mentioned.add(node.name.rpartition(".")[2])
            mentioned.add(node.asname or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            mentioned.add(node.value)  # a string annotation
    return mentioned


def _source(module: str) -> Path:
    """The file of ``module``, found without importing it (or its package)."""
    root, _, rest = module.partition(".")
    spec = importlib.util.find_spec(root)
    assert spec is not None and spec.origin is not None, root
    path = Path(spec.origin).parent.joinpath(*rest.split(".")) if rest else Path(spec.origin)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
