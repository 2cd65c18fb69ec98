"""The package layers of STYLE.md, checked on the source (an import-linter
equivalent that also sees `operator/`, a namespace portion import-linter skips).

    kernels   imports nothing else of ours
    worker    may import kernels (and the shared root modules)
    gateway   imports neither worker nor kernels
    operator  imports neither worker nor kernels
    config    imports no component
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kernels": "kvserving.kernels", "worker": "kvserving.worker", "gateway": "kvserving.gateway", "operator": "kvserving.operator"}
COMPONENTS = tuple(FOLDERS.values())
FORBIDDEN = {
    "kvserving.kernels": ("kvserving.worker", "kvserving.gateway", "kvserving.operator", "kvserving.cli", "kvserving.demo"),
    "kvserving.worker": ("kvserving.gateway", "kvserving.operator"),
    "kvserving.gateway": ("kvserving.worker", "kvserving.kernels", "kvserving.operator"),
    "kvserving.operator": ("kvserving.worker", "kvserving.kernels", "kvserving.gateway"),
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{alias.name}" for alias in node.names)
    return names


def _violations(package: str, files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in files:
        for name in imported_modules(path, package):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_component_layers(folder: str) -> None:
    package = FOLDERS[folder]
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    assert _violations(package, files, FORBIDDEN[package]) == []


def test_config_and_tags_import_no_component() -> None:
    files = [ROOT / "common" / "config.py", ROOT / "common" / "tags.py"]
    assert _violations("kvserving", files, COMPONENTS) == []


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("from ..worker import engine\nimport kvserving.gateway.app\n")
    assert imported_modules(bad, "kvserving.kernels") == {
        "kvserving.worker", "kvserving.worker.engine", "kvserving.gateway.app",
    }
