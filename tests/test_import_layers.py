"""The package layers of STYLE.md, checked on the source (an import-linter
equivalent that also sees `operator/`, a namespace portion import-linter skips).

    kernels   imports nothing else of ours
    worker    may import kernels (and the shared root modules)
    gateway   imports neither worker nor kernels
    operator  imports neither worker nor kernels
    config    imports no component

Inside ``worker/``, the engine's layers, lowest first (a module never imports,
directly or through other worker modules, one ranked above it)::

    page_pool < triaxial_pool < precision, sequence < kv_manager < kv_cache
      < scheduler < model_runner < engine < async_engine and the server side
      (server, main, metrics, kv_transfer, nixl_io)

Worker modules not listed (model code, storage, new files) are not ranked: what
they import is not checked, but a ranked module that imports one inherits its
imports, so an unlisted module cannot smuggle a higher layer into a lower one.

Inside ``kernels/``: page_ids < layout < paged_kv < paged_ops, and paged_ops
(the one dispatch point) is imported by no other kernels module. Neither
folder has an import cycle (e.g. gluon_decode <-> triton_decode).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kernels": "kvserving.kernels", "worker": "kvserving.worker", "gateway": "kvserving.gateway", "operator": "kvserving.operator"}
COMPONENTS = tuple(FOLDERS.values())
FORBIDDEN = {
    "kvserving.kernels": ("kvserving.worker", "kvserving.gateway", "kvserving.operator", "kvserving.cli", "kvserving.local.demo"),
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
    # (model_dir.py imports the worker's tiny model on purpose, lazily: it builds it on demand)
    files = [ROOT / "common" / n for n in ("config.py", "tags.py", "bits.py", "agent_pages_data.py")]
    assert _violations("kvserving", files, COMPONENTS) == []
    # the generated page mix is data: it imports nothing at all
    assert "import" not in (ROOT / "common" / "agent_pages_data.py").read_text().replace("Imports nothing", "")


WORKER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("page_pool",),
    ("triaxial_pool",),
    ("precision", "sequence"),
    ("kv_manager",),
    ("kv_cache",),
    ("scheduler",),
    ("model_runner",),
    ("engine",),
    ("async_engine", "server", "main", "metrics", "kv_transfer", "nixl_io"),
)


KERNEL_LAYERS: tuple[tuple[str, ...], ...] = (("page_ids",), ("layout",), ("paged_kv",), ("paged_ops",))


def folder_imports(folder: str) -> dict[str, set[str]]:
    """module -> the modules of the same folder it imports (lazy imports inside functions included)."""
    package = FOLDERS[folder]
    prefix = package + "."
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        names = imported_modules(path, package)
        graph[path.stem] = {n[len(prefix):].split(".")[0] for n in names if n.startswith(prefix)} - {path.stem}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle once, as the path that closes it (depth-first, sorted order)."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return cycles


def layer_violations(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    rank = {m: i for i, group in enumerate(layers) for m in group}
    bad = []
    for module in sorted(m for m in graph if m in rank):
        seen: set[str] = set()
        todo = [(dep, (module, dep)) for dep in sorted(graph[module])]
        while todo:
            dep, chain = todo.pop()
            if dep in seen:
                continue
            seen.add(dep)
            if rank.get(dep, -1) > rank[module]:
                bad.append(" -> ".join(chain))
            todo.extend((d, (*chain, d)) for d in sorted(graph.get(dep, ())))
    return bad


def test_worker_layers() -> None:
    graph = folder_imports("worker")
    missing = [m for group in WORKER_LAYERS for m in group[:1] if m not in graph]
    assert missing == []  # the first module of every layer exists (the rule is not vacuous)
    assert layer_violations(graph, WORKER_LAYERS) == []


def test_kernel_layers() -> None:
    graph = folder_imports("kernels")
    assert [m for (m,) in KERNEL_LAYERS if m not in graph] == []
    assert layer_violations(graph, KERNEL_LAYERS) == []
    assert sorted(m for m, deps in graph.items() if "paged_ops" in deps) == []


@pytest.mark.parametrize("folder", ["kernels", "worker"])
def test_no_import_cycles(folder: str) -> None:
    assert import_cycles(folder_imports(folder)) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]


def test_the_worker_checker_follows_unlisted_modules() -> None:
    layers = (("low",), ("high",))
    graph = {"low": {"helper"}, "helper": {"high"}, "high": {"low"}, "other": {"high"}}
    assert layer_violations(graph, layers) == ["low -> helper -> high"]


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("from ..worker import engine\nimport kvserving.gateway.app\n")
    assert imported_modules(bad, "kvserving.kernels") == {
        "kvserving.worker", "kvserving.worker.engine", "kvserving.gateway.app",
    }
