"""Layers inside ``kvserving.kernels``, checked on the source (AST, like tests/test_import_layers.py):

    page_ids, options                   torch-free ids / no kernel imports; only options reads the environment
    layout, paged_kv, codecs, paged_ref, norm_ref  references in torch: import no Triton and no Triton module of ours
    triton_common, triton_pdl           what the kernels share; import no kernel module
    gluon_fragments, gluon_attend       what the Gluon kernels share (device code)
    gluon_merge                         the Gluon decode's in-kernel split merge (device code and its host side)
    gluon_ring                          the Gluon decode's shared-memory ring: a step's copies and reads (device code)
    triton_write/_gather/_decode/_norm/_prefill, gluon_decode/_extend/_extend_tri   kernels: import each other never
    paged_ops                           the dispatch point: imports kernel modules only inside functions
    gemm_plan                           the GEMMs' launch plan: which kernel, what launch shape (stdlib only)
    fp8_gemm, triton_fp8_gemm           FP8 weight GEMMs: torch references and dispatch, the Triton kernels

and no module but page_ids defines INT2_PAGE_FLAG or writes the INT2 offset formula in Python.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
PKG = "kvserving.kernels"
# modules that hold Triton or Gluon kernels (or only make sense next to them)
TRITON_MODULES = {"triton_codec", "triton_common", "triton_decode", "triton_gather", "triton_write", "triton_prefill",
                  "triton_norm", "gluon_decode", "gluon_extend", "gluon_extend_tri", "gluon_fragments", "gluon_attend",
                  "gluon_merge", "gluon_ring", "compile_report", "triton_fp8_gemm", "fp8_gemm", "triton_pdl", "triton_elementwise"}  # fmt: skip
KERNEL_MODULES = {"triton_decode", "triton_gather", "triton_write", "triton_prefill", "triton_norm", "gluon_decode",
                  "gluon_extend", "gluon_extend_tri", "triton_fp8_gemm"}  # fmt: skip
REFERENCES = {"page_ids", "options", "gemm_plan", "layout", "paged_kv", "fp8", "nvfp4", "intquant", "quant_checks", "paged_ref", "capacity", "capability",
              "norm_ref"}  # fmt: skip


def _tree(name: str) -> ast.Module:
    return ast.parse((KERNELS / f"{name}.py").read_text(), filename=f"{name}.py")


def _imports(tree: ast.AST, *, top_level_only: bool = False) -> set[str]:
    """Absolute module names imported (``from . import x`` counts as kvserving.kernels.x)."""
    nodes = tree.body if top_level_only and isinstance(tree, ast.Module) else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = f"{PKG}.{node.module}" if node.level == 1 and node.module else (PKG if node.level == 1 else node.module or "")
            names.add(mod)
            if mod == PKG:
                names.update(f"{PKG}.{a.name}" for a in node.names)
    return names


def _ours(names: set[str]) -> set[str]:
    return {n.removeprefix(PKG + ".") for n in names if n.startswith(PKG + ".")}


def _modules() -> list[str]:
    return sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__")


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph (module names), or []."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_module_lists_cover_every_kernels_module() -> None:
    assert set(_modules()) == TRITON_MODULES | REFERENCES | {"paged_ops"}


def test_no_import_cycle_inside_kernels() -> None:
    graph = {m: _ours(_imports(_tree(m))) for m in _modules()}  # function-level imports included
    assert _cycle(graph) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the checker sees one


def test_kernel_modules_import_no_other_kernel_module() -> None:
    for m in KERNEL_MODULES:
        assert _ours(_imports(_tree(m))) & KERNEL_MODULES == set(), m


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_references_import_no_triton(name: str) -> None:
    names = _imports(_tree(name))
    assert not {n for n in names if n == "triton" or n.startswith("triton.")}, name
    assert _ours(names) & TRITON_MODULES == set(), name


def test_page_ids_is_torch_free_at_run_time() -> None:
    tree = _tree("page_ids")
    stdlib = {"__future__", "typing", "math", "dataclasses"}
    assert {n.split(".")[0] for n in _imports(tree, top_level_only=True)} <= stdlib


def test_gemm_plan_is_pure_rules() -> None:
    stdlib = {"__future__", "contextlib", "contextvars", "dataclasses", "re", "collections"}
    assert {n.split(".")[0] for n in _imports(_tree("gemm_plan"))} <= stdlib


def test_paged_ops_loads_kernels_only_on_first_use() -> None:
    top = _ours(_imports(_tree("paged_ops"), top_level_only=True))
    assert top & TRITON_MODULES == set(), top
    assert _ours(_imports(_tree("paged_ops"))) >= {
        "triton_write",
        "triton_gather",
        "triton_decode",
        "gluon_decode",
        "gluon_extend",
        "gluon_extend_tri",
    }


def _reads_environment(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            return True
    return False


def test_only_options_reads_the_environment() -> None:
    readers = {m for m in _modules() if _reads_environment(_tree(m))}
    assert readers == {"options"}, readers
    assert _reads_environment(ast.parse("import os\nx = os.getenv('KVSERVING_X')"))  # the checker sees one


def test_int2_flag_and_offset_formula_live_in_page_ids_only() -> None:
    for m in _modules():
        tree = _tree(m)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined = {t.id for t in targets if isinstance(t, ast.Name)}
                assert m == "page_ids" or "INT2_PAGE_FLAG" not in defined, m
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift) and m not in ("page_ids",):
                # 1 << 30 spelled out again
                assert not (isinstance(node.left, ast.Constant) and node.left.value == 1
                            and isinstance(node.right, ast.Constant) and node.right.value == 30), m  # fmt: skip
    # the Python formula: "total_bytes - (... + 1) * ..." outside @jit kernels appears only in page_ids
    for m in _modules():
        if m == "page_ids":
            continue
        for fn in ast.walk(_tree(m)):
            if not isinstance(fn, ast.FunctionDef) or any("jit" in ast.unparse(d) for d in fn.decorator_list):
                continue
            src = ast.unparse(fn)
            assert "total_bytes - (" not in src, f"{m}.{fn.name} writes the INT2 offset formula again"
