"""Operator layers (STYLE.md 2 and 4): rendering and decisions are pure, and
only kube.py talks to the Kubernetes API; kopf is confined to the glue."""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR = Path(__file__).resolve().parents[2] / "operator"
PURE = {"spec.py", "render.py", "status.py", "dashboard.py", "names.py", "kv_health.py"}
IO_LIBRARIES = {"aiohttp", "kopf", "kubernetes", "requests", "httpx", "socket", "subprocess"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_pure_modules_do_no_io() -> None:
    for name in PURE:
        assert not _imports(OPERATOR / name) & IO_LIBRARIES, name


def test_only_kube_and_the_kv_sampler_talk_http() -> None:
    # kube.py: the Kubernetes API; kv_sampler.py: the workers' /internal/kv/stats
    users = sorted(p.name for p in OPERATOR.glob("*.py") if "aiohttp" in _imports(p))
    assert users == ["kube.py", "kv_sampler.py"]


def test_kopf_stays_in_the_glue() -> None:
    users = sorted(p.name for p in OPERATOR.glob("*.py") if "kopf" in _imports(p))
    assert users == ["handlers.py", "kube.py", "main.py", "rbac.py"]


def test_operator_folder_has_no_init() -> None:
    assert not (OPERATOR / "__init__.py").exists()  # it would shadow the standard library's operator
