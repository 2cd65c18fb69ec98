"""The package layers of DESIGN.md (Repository layout) and STYLE.md, checked on
the source (an import-linter equivalent that also sees `operator/`, a namespace
portion import-linter skips). Lazy imports inside functions count.

Three layers, lowest first; a module imports only its own layer or lower::

    base          the root package `kvserving` (common/): config, tags, cli,
                  argtypes, model_dir, tiny model, bits, calibration data
    components    kernels, worker, gateway, operator
    applications  agents, calibrate, sim, local

Among the components:

    kernels   imports nothing else of ours
    worker    may import kernels (and the base)
    gateway   imports neither worker nor kernels
    operator  imports neither worker nor kernels

No import cycle anywhere, between modules or between packages, the root
included.

Inside ``worker/``, the engine's layers, lowest first (a module never imports,
directly or through other worker modules, one ranked above it)::

    kv.page_runs < kv.page_pool < triaxial_pool, kv.leases < precision, sequence < kv.manager < kv.cache
      < scheduler < model_runner < engine < async_engine and the server side
      (server, main, metrics, kv.transfer, kv.puller, kv.nixl_io)

(kv.leases below engine: the engine makes a finished request's lease without calling
back into the connector that asked for it.)

Worker modules not listed (model code, storage, new files) are not ranked: what
they import is not checked, but a ranked module that imports one inherits its
imports, so an unlisted module cannot smuggle a higher layer into a lower one.

Inside ``kernels/``: page_ids < layout < paged_kv < paged_ops, and paged_ops
(the one dispatch point) is imported by no other kernels module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kernels": "kvserving.kernels", "worker": "kvserving.worker", "gateway": "kvserving.gateway", "operator": "kvserving.operator"}
COMPONENTS = tuple(FOLDERS.values())
FORBIDDEN = {
    "kvserving.kernels": ("kvserving.worker", "kvserving.gateway", "kvserving.operator"),
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


def test_the_engine_data_imports_nothing() -> None:
    # the generated page mix is data: it imports nothing at all
    assert "import" not in (ROOT / "common" / "agent_pages_data.py").read_text().replace("Imports nothing", "")


WORKER_LAYERS: tuple[tuple[str, ...], ...] = (
    ("kv.page_runs",),
    ("kv.page_pool",),
    ("triaxial_pool", "kv.leases"),
    ("precision", "sequence"),
    ("kv.manager",),
    ("kv.cache",),
    ("scheduler",),
    ("model_runner",),
    ("engine",),
    ("async_engine", "server", "main", "metrics", "kv.transfer", "kv.puller", "kv.nixl_io"),
)


KERNEL_LAYERS: tuple[tuple[str, ...], ...] = (("page_ids",), ("layout",), ("paged_kv",), ("paged_ops",))


def folder_imports(folder: str) -> dict[str, set[str]]:
    """module -> the modules of the same folder it imports (lazy imports inside functions included);
    a subfolder's modules by dotted name (``kv.page_pool``)."""
    package = FOLDERS[folder]
    prefix = package + "."
    paths = sorted((ROOT / folder).rglob("*.py"))
    names_of = {p: ".".join(p.relative_to(ROOT / folder).with_suffix("").parts) for p in paths}
    modules = {n.removesuffix(".__init__") for n in names_of.values()}

    def module_of(name: str) -> str:
        parts = name[len(prefix) :].split(".")
        return next((m for k in range(len(parts), 0, -1) if (m := ".".join(parts[:k])) in modules), parts[0])

    graph: dict[str, set[str]] = {}
    for path, name in names_of.items():
        name = name.removesuffix(".__init__")
        pkg = f"{package}.{name}".rsplit(".", 1)[0] if path.stem != "__init__" else f"{package}.{name}"
        found = imported_modules(path, pkg)
        graph[name] = {module_of(n) for n in found if n.startswith(prefix)} - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each cycle once, as the path that closes it (depth-first, sorted order)."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
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
        "kvserving.worker",
        "kvserving.worker.engine",
        "kvserving.gateway.app",
    }


# ----------------------------------------------------------------------------- the whole package
# folder -> (package, layer): 0 base, 1 components, 2 applications
PACKAGES = {
    "common": ("kvserving", 0),
    "kernels": ("kvserving.kernels", 1),
    "worker": ("kvserving.worker", 1),
    "gateway": ("kvserving.gateway", 1),
    "operator": ("kvserving.operator", 1),
    "agents": ("kvserving.agents", 2),
    "calibrate": ("kvserving.calibrate", 2),
    "sim": ("kvserving.sim", 2),
    "local": ("kvserving.local", 2),
}
LAYER_NAMES = ("base", "components", "applications")


def module_name(root: Path, folder: str, path: Path) -> tuple[str, str]:
    """(module, the package its relative imports resolve against) of a file under a mapped folder."""
    package = PACKAGES[folder][0]
    parts = list(path.relative_to(root / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        pkg = ".".join([package, *parts])
        return pkg, pkg
    return ".".join([package, *parts]), ".".join([package, *parts[:-1]])


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every module of ``kvserving`` -> the modules of ``kvserving`` it imports (by source file)."""
    files: dict[str, tuple[Path, str]] = {}
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            name, package = module_name(root, folder, path)
            files[name] = (path, package)
    graph: dict[str, set[str]] = {}
    for name, (path, package) in files.items():
        deps = set()
        for imported in imported_modules(path, package):
            # the longest known module that `imported` names (a module, or a name in one)
            parts = imported.split(".")
            for n in range(len(parts), 0, -1):
                if ".".join(parts[:n]) in files:
                    deps.add(".".join(parts[:n]))
                    break
        graph[name] = deps - {name}
    return graph


def package_of(module: str, graph: dict[str, set[str]]) -> str:
    """The mapped package a module belongs to (the root `kvserving` for common/)."""
    for package, _ in PACKAGES.values():
        if package != "kvserving" and (module == package or module.startswith(package + ".")):
            return package
    return "kvserving"


def layer_of(module: str, graph: dict[str, set[str]]) -> int:
    return {package: layer for package, layer in PACKAGES.values()}[package_of(module, graph)]


def cross_layer_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a higher layer than the importer's."""
    bad = []
    for module in sorted(graph):
        for dep in sorted(graph[module]):
            if layer_of(dep, graph) > layer_of(module, graph):
                bad.append(f"{module} ({LAYER_NAMES[layer_of(module, graph)]}) imports {dep} ({LAYER_NAMES[layer_of(dep, graph)]})")
    return bad


def packages_only(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between mapped packages (the root `kvserving` one of them)."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        mine = package_of(module, graph)
        out.setdefault(mine, set()).update(package_of(d, graph) for d in deps)
        out[mine].discard(mine)
    return out


def test_every_mapped_folder_is_a_package_in_pyproject() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    for folder, (package, _) in PACKAGES.items():
        assert f'"{package}" = "{folder}"' in pyproject, folder


def test_base_below_components_below_applications() -> None:
    graph = package_graph()
    assert {"kvserving.config", "kvserving.cli", "kvserving.worker.engine", "kvserving.sim.cluster"} <= set(graph)
    assert cross_layer_imports(graph) == []


def test_no_import_cycle_anywhere_the_root_included() -> None:
    graph = package_graph()
    assert import_cycles(graph) == []
    assert import_cycles(packages_only(graph)) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_package_checks_see_a_root_cycle_and_a_layer_break(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "common/__init__.py": "",
            "common/config.py": "from kvserving.model_dir import resolve\n",
            "common/model_dir.py": "def f():\n    from kvserving import config\n",  # lazy, still an import
            "worker/__init__.py": "",
            "worker/engine.py": "from .model import M\nfrom kvserving.config import C\n",
            "worker/model.py": "from ..sim.cluster import S\n",
            "sim/__init__.py": "",
            "sim/cluster.py": "from kvserving.worker.engine import E\n",
        },
    )
    graph = package_graph(root)
    assert graph["kvserving.worker.model"] == {"kvserving.sim.cluster"}
    assert import_cycles(graph) == [
        ["kvserving.config", "kvserving.model_dir", "kvserving.config"],
        ["kvserving.sim.cluster", "kvserving.worker.engine", "kvserving.worker.model", "kvserving.sim.cluster"],
    ]
    assert cross_layer_imports(graph) == [
        "kvserving.worker.model (components) imports kvserving.sim.cluster (applications)",
    ]
    assert import_cycles(packages_only(graph)) == [["kvserving.sim", "kvserving.worker", "kvserving.sim"]]


def test_the_package_checks_pass_a_clean_tree(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "common/config.py": "",
            "worker/engine.py": "from kvserving.config import C\n",
            "sim/cluster.py": "from kvserving.worker.engine import E\nfrom kvserving import config\n",
        },
    )
    graph = package_graph(root)
    assert graph["kvserving.sim.cluster"] == {"kvserving.worker.engine", "kvserving.config"}
    assert cross_layer_imports(graph) == [] and import_cycles(graph) == []
