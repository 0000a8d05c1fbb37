"""The runnable OpenAI-compatible example, loaded as a module for the adapter's tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent.py"


def load_example(module_name: str) -> ModuleType:
    """A fresh copy of ``examples/openai_agent.py`` under ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
