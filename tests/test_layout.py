"""Guards of the repository layout and packaging (DESIGN.md, Repository layout)."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench_module import load_bench

import kvserving

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, *, cwd: Path, safe_path: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_operator_folder_has_no_init_so_it_cannot_shadow_stdlib() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_stdlib_operator_wins_even_from_repo_root_without_safe_path() -> None:
    # `python -c` puts the cwd (the repo root) first on sys.path; a namespace
    # portion never beats the standard library's compiled `operator` module.
    result = _python("import operator; print(operator.add(2, 3), operator.__name__)", cwd=ROOT, safe_path=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["5", "operator"]


def test_subpackages_import_from_mapped_folders() -> None:
    for sub in ("kernels", "worker", "gateway", "operator", "agents", "calibrate", "sim", "local"):
        mod = importlib.import_module(f"kvserving.{sub}")
        paths = [Path(p).resolve() for p in mod.__path__]
        # strict editable mode links the files into a build tree; the links
        # resolve to the repo folder of the same name.
        assert paths, sub
    assert kvserving.__version__


def test_kernels_folder_does_not_shadow_pypi_name_under_safe_path() -> None:
    # With PYTHONSAFEPATH=1 the repo root is not on sys.path, so the folder
    # `kernels/` is not importable as a top-level package `kernels`.
    result = _python("import importlib.util as u; print(u.find_spec('kernels') is None)", cwd=ROOT, safe_path=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_makefile_and_ci_use_safe_path_and_make_test() -> None:
    assert "PYTHONSAFEPATH=1" in (ROOT / "Makefile").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_top_level_folder_has_a_readme_line() -> None:
    readme = (ROOT / "README.md").read_text()
    for folder in (
        "kernels/",
        "worker/",
        "gateway/",
        "operator/",
        "agents/",
        "calibrate/",
        "sim/",
        "local/",
        "crds/",
        "manifests/",
        "tests/",
        "e2e/",
        "bench/",
    ):
        assert f"`{folder}`" in readme, folder


def test_every_result_file_is_quoted_on_the_results_page_and_every_quoted_one_exists() -> None:
    page = (ROOT / "docs" / "results.md").read_text()
    files = {p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_file()}
    assert sorted(f for f in files if f not in page) == []  # by path or, in a table, by name
    quoted = set(re.findall(r"bench/results/([A-Za-z0-9_.-]+\.(?:json|png))", page))
    assert sorted(quoted - files) == []


# a result file is named <bench>_<machine>: the machine a CPU run or the device kind it ran on
RESULT_NAME = re.compile(r"(?P<bench>[a-z0-9_]+?)_(?P<machine>cpu|h[12]00(?:x\d+)?)\.(?P<ext>json|png)")


def test_one_result_file_per_bench_and_machine() -> None:
    names = sorted(p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_file())
    parsed = {name: RESULT_NAME.fullmatch(name) for name in names}
    assert [name for name, m in parsed.items() if m is None] == []  # a configuration is a section of the file, not a suffix
    runs = {(m["bench"], m["machine"]) for m in parsed.values() if m and m["ext"] == "json"}
    # a figure is drawn from its bench's file on that machine
    assert sorted(n for n, m in parsed.items() if m and m["ext"] == "png" and (m["bench"], m["machine"]) not in runs) == []
    # no bench of a machine is another's name plus a configuration (engine_gpu_iso beside engine_gpu); a bench
    # script of its own is not one (fidelity_weights beside fidelity)
    for bench, machine in runs:
        longer = [b for b, m in runs if m == machine and b.startswith(bench + "_")]
        assert [b for b in longer if not (ROOT / "bench" / f"{b}.py").is_file()] == [], (bench, machine)


@pytest.mark.parametrize(
    ("script", "result", "argv"),
    [
        ("engine_gpu", "engine_gpu_h200.json", ["--out"]),
        ("engine_gpu", "engine_gpu_h100.json", ["--out"]),
        ("agents", "agents_gpu_h100.json", ["--json"]),
        ("agents", "agents_gpu_h200.json", ["--json"]),
        ("sim_agents_per_gpu", "sim_agents_per_gpu_h200.json", ["--json"]),
        ("pd_gpu", "pd_gpu_h200x2.json", ["--out"]),
        ("fidelity", "fidelity_cpu.json", ["--out"]),
        ("fidelity", "fidelity_gpu_h200.json", ["--out"]),
    ],
)
def test_a_committed_result_is_what_its_bench_combine_writes(
    script: str, result: str, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # joining the one file with nothing else gives it back: its shape is the bench's, not edited by hand
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    bench = load_bench(script)
    committed = ROOT / "bench" / "results" / result
    out = tmp_path / result
    monkeypatch.setattr(sys, "argv", [script, "--combine", str(committed), *argv, str(out)])
    bench.main()
    assert out.read_text() == committed.read_text()  # the same values, laid out as the bench writes them


def test_every_result_file_is_laid_out_as_the_benches_write_it() -> None:
    # kvserving.jsonfmt: a list of numbers or a table row on one line, so a result reads (and diffs) row by row
    from kvserving.jsonfmt import dumps

    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        text = path.read_text()
        assert dumps(json.loads(text)) == text, f"{path.name}: write it with kvserving.jsonfmt.dumps"


def test_a_run_writes_its_section_and_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    results_file = load_bench("results_file")

    def name_of(run: dict[str, Any]) -> str:
        return str(run["kind"])

    path = tmp_path / "x_cpu.json"
    results_file.write_section(path, "a", {"kind": "a", "v": 1}, what="w", name_of=name_of)
    results_file.write_section(path, "b", {"kind": "b", "v": 2}, what="w", name_of=name_of)
    results_file.write_section(path, "a", {"kind": "a", "v": 3}, what="w", name_of=name_of)
    assert json.loads(path.read_text()) == {"what": "w", "sections": {"a": {"kind": "a", "v": 3}, "b": {"kind": "b", "v": 2}}}
    single = tmp_path / "run.json"  # one run written before the sections: named by name_of
    single.write_text(json.dumps({"kind": "c", "v": 4}))
    doc = results_file.combine([path, single], tmp_path / "all.json", what="w", name_of=name_of)
    assert list(doc["sections"]) == ["a", "b", "c"] and results_file.read_section(tmp_path / "all.json", "c")["v"] == 4
    with pytest.raises(KeyError, match="has no section 'd' \\(it has: a, b, c\\)"):
        results_file.read_section(tmp_path / "all.json", "d")


def test_every_section_of_a_result_file_of_sections_is_named_on_the_results_page() -> None:
    # each configuration a bench runs is a section of its one file per machine (bench/results_file.py)
    page = (ROOT / "docs" / "results.md").read_text()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        sections = data.get("sections") if isinstance(data, dict) else None
        if isinstance(sections, dict):
            assert sorted(name for name in sections if f"`{name}`" not in page) == [], path.name
