"""A bench script under bench/ imported as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str) -> ModuleType:
    """``bench/<script>.py`` as the module ``<script>_bench`` (registered in ``sys.modules``, as
    its dataclasses need)."""
    name = f"{script}_bench"
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
