"""Every command a user types answers bad input with exactly one line on stderr
(no traceback) and a non-zero exit code (issue 10, "One-line errors").

Each case runs the real command in its own process (``python -m kvserving.cli``,
as the ``kvserving`` script does). The processes of all cases start together
from one module fixture, a few at a time, so the ~1-4 s start of each Python
(and of torch, where a case needs it) overlaps; each case then has its own test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import kvserving

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "manifests" / "samples"
TIMEOUT_S = 180
PARALLEL = 4


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    code: int  # expected exit code
    message: str  # expected (part of) the one stderr line


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str


def cli_env(**extra: str) -> dict[str, str]:
    # The Hub switches are dropped on purpose: the commands themselves must never try it.
    drop = {"PYTHONSAFEPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "KUBECONFIG", "CUDA_VISIBLE_DEVICES"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONSAFEPATH": "1", **extra}


def run_cli(argv: tuple[str, ...], *, cwd: Path, env: dict[str, str] | None = None) -> Result:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserving.cli", *argv],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def assert_one_line(result: Result, case: Case) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.code == case.code, result.stderr
    assert case.message in lines[0], lines[0]


# ----------------------------------------------------------------- the inputs


def _sample(name: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())
    return body


def _with(name: str, edit: Callable[[dict[str, Any]], None]) -> str:
    body = _sample(name)
    edit(body)
    return yaml.safe_dump(body, sort_keys=False)


def _rename_kv_cache(body: dict[str, Any]) -> None:
    body["spec"]["kvcache"] = body["spec"].pop("kvCache")


def _set(*path_and_value: Any) -> Callable[[dict[str, Any]], None]:
    *path, value = path_and_value

    def edit(body: dict[str, Any]) -> None:
        node = body
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value

    return edit


MANIFESTS: dict[str, str] = {
    "invalid.yaml": "spec: [1,\n",
    "empty.yaml": "",
    "list.yaml": "- 1\n- 2\n",
    "multi.yaml": (SAMPLES / "nvfp4.yaml").read_text() + "---\n" + (SAMPLES / "triaxial.yaml").read_text(),
    "kvcache.yaml": _with("nvfp4", _rename_kv_cache),
    "name.yaml": _with("nvfp4", _set("metadata", "name", "Qwen3_NVFP4")),
    "labelz.yaml": _with("nvfp4", _set("metadata", "labelz", {"team": "a"})),
    "label-int.yaml": _with("nvfp4", _set("metadata", "labels", {"tier": 1})),
    "dtype.yaml": _with("nvfp4", _set("spec", "kvCache", "dtype", "fp16")),
    "budget.yaml": _with("triaxial", _set("spec", "kvCache", "bitBudget", 9)),
    "replicas.yaml": _with("triaxial", _set("spec", "decode", "replicas", -2)),
    "pagesize.yaml": _with("triaxial", _set("spec", "kvCache", "pageSize", 16)),
    "lease.yaml": _with("triaxial", _set("spec", "reuse", "leaseTTLSeconds", 600)),
    "calibrated.yaml": _with("triaxial", _set("spec", "kvCache", "globalScale", "calibrated")),
}


def render(file: str) -> tuple[str, ...]:
    return ("operator", "--render", file)


def generate(model: str, *extra: str) -> tuple[str, ...]:
    return ("generate", "--model", model, "--prompt", "x", *extra)


CASES: dict[str, Case] = {
    # kvserving operator --render
    "render-missing": Case(render("missing.yaml"), 1, "error: missing.yaml does not exist"),
    "render-directory": Case(render("."), 1, "error: . is a directory, not a KVServing manifest"),
    "render-invalid-yaml": Case(render("invalid.yaml"), 1, "error: invalid.yaml is not valid YAML at line 2, column 1"),
    "render-binary": Case(render("binary.yaml"), 1, "error: binary.yaml is not a UTF-8 text file, not a KVServing manifest"),
    "render-empty": Case(render("empty.yaml"), 1, "error: empty.yaml is empty: expected one KVServing object"),
    "render-list": Case(render("list.yaml"), 1, "error: list.yaml holds a YAML list, not a KVServing object"),
    "render-multi-document": Case(render("multi.yaml"), 1, "error: multi.yaml holds 2 YAML documents: expected one KVServing object"),
    "render-not-a-kvserving": Case(
        render(str(ROOT / "manifests" / "operator.yaml")),
        1,
        "operator.yaml: the manifest is a Deployment (apps/v1), not a KVServing (kvserving.dev/v1alpha1)",
    ),
    "render-misspelled-key": Case(render("kvcache.yaml"), 1, "error: kvcache.yaml: spec.kvcache: unknown field"),
    "render-invalid-name": Case(render("name.yaml"), 1, "name.yaml: metadata.name: 'Qwen3_NVFP4' is not a DNS-1035 label"),
    "render-unknown-metadata-field": Case(render("labelz.yaml"), 1, "error: labelz.yaml: metadata.labelz: unknown field"),
    "render-number-label": Case(
        render("label-int.yaml"), 1, "label-int.yaml: metadata.labels: must map strings to strings (quote numbers and booleans)"
    ),
    "render-unknown-dtype": Case(
        render("dtype.yaml"), 1, "dtype.yaml: spec.kvCache.dtype: 'fp16' is not one of ['bf16', 'fp8_e4m3', 'nvfp4', 'triaxial']"
    ),
    "render-bit-budget-9": Case(render("budget.yaml"), 1, "budget.yaml: spec.kvCache.bitBudget: bitBudget must be within [2, 4]"),
    "render-negative-replicas": Case(render("replicas.yaml"), 1, "replicas.yaml: spec.decode.replicas: replicas must not be negative"),
    "render-triaxial-page-size-16": Case(render("pagesize.yaml"), 1, "pagesize.yaml: spec.kvCache: pageSize must be 32 for dtype triaxial"),
    "render-lease-not-below-retention": Case(
        render("lease.yaml"), 1, "lease.yaml: spec.reuse: leaseTTLSeconds must be less than retentionTTLSeconds"
    ),
    "render-calibrated-triaxial": Case(
        render("calibrated.yaml"), 1, "calibrated.yaml: spec.kvCache: globalScale calibrated needs dtype fp8_e4m3 or nvfp4"
    ),
    # kvserving generate
    "generate-kv-bytes-0": Case(generate("tiny", "--kv-bytes", "0"), 2, "argument --kv-bytes: must be an integer >= 1, got 0"),
    "generate-kv-bytes-negative": Case(generate("tiny", "--kv-bytes", "-5"), 2, "argument --kv-bytes: must be an integer >= 1, got -5"),
    "generate-chunk-size-0": Case(generate("tiny", "--chunk-size", "0"), 2, "argument --chunk-size: must be an integer >= 1, got 0"),
    "generate-chunk-size-negative": Case(
        generate("tiny", "--chunk-size", "-1"), 2, "argument --chunk-size: must be an integer >= 1, got -1"
    ),
    "generate-missing-model": Case(generate("/nonexistent"), 1, "kvserving generate: error: model directory /nonexistent does not exist"),
    "generate-model-is-a-file": Case(generate("a-file"), 1, "kvserving generate: error: model path a-file is not a directory"),
    "generate-truncated-safetensors": Case(
        generate("truncated"), 1, "truncated/model.safetensors is not a readable safetensors file (truncated or corrupt?)"
    ),
    "generate-chat-without-template": Case(
        generate("no-template", "--chat"),
        1,
        "kvserving generate: error: the model in no-template has no chat template (needed for chat prompts)",
    ),
    "generate-broken-template": Case(
        generate("broken-template", "--chat"),
        1,
        "error: the chat template of the model in broken-template fails to render: No filter named 'nofilter'",
    ),
    "demo-model-without-template": Case(
        ("demo", "--model", "no-template"),
        1,
        "kvserving demo: error: the model in no-template has no chat template (needed for chat prompts)",
    ),
    "generate-max-tokens-over-context": Case(
        generate("short", "--max-tokens", "100000000000"),
        0,
        "note: --max-tokens 100000000000 is more than the context length allows: "
        "generation stops at 24 tokens (prompt included, at most 23 new)",
    ),
    # kvserving demo
    "demo-missing-model": Case(
        ("demo", "--model", "/nonexistent"), 1, "kvserving demo: error: model directory /nonexistent does not exist"
    ),
    "demo-max-tokens-0": Case(("demo", "--max-tokens", "0"), 2, "argument --max-tokens: must be an integer in 1..4096, got 0"),
    "demo-kv-mib-0": Case(("demo", "--kv-mib", "0"), 2, "argument --kv-mib: must be an integer in 1..1048576, got 0"),
    "demo-gpu-gib-negative": Case(("demo", "--gpu-gib", "-1"), 2, "argument --gpu-gib: must be a number in (0, 1.04858e+06], got -1"),
    # kvserving tiny-model
    "tiny-model-onto-a-file": Case(("tiny-model", "a-file"), 1, "kvserving tiny-model: error: a-file exists and is not a directory"),
    "tiny-model-non-empty-dir": Case(
        ("tiny-model", "full"), 1, "kvserving tiny-model: error: full already holds files; pass --force to overwrite"
    ),
    "tiny-model-empty-dir": Case(("tiny-model", ""), 2, "argument dir: must be a path, got an empty string"),
    "tiny-model-over-a-model": Case(
        ("tiny-model", "tiny"), 1, "kvserving tiny-model: error: tiny already holds a model; pass --force to overwrite"
    ),
    # kvserving capacity
    "capacity-negative-gpu": Case(
        ("capacity", "--gpu-gib", "-80"), 2, "kvserving capacity: error: --gpu-gib must be in (0, 1048576], got -80"
    ),
    "capacity-huge-gpu": Case(
        ("capacity", "--gpu-gib", "1e30"), 2, "kvserving capacity: error: --gpu-gib must be in (0, 1048576], got 1e+30"
    ),
    "capacity-huge-layers": Case(
        ("capacity", "--layers", "100000"), 2, "kvserving capacity: error: --layers must be in 1..1024, got 100000"
    ),
    "operator-bad-namespace": Case(
        ("operator", "--namespace", "Team_A"),
        1,
        "kvserving operator: error: --namespace 'Team_A' is not a valid namespace name (a DNS-1123 label)",
    ),
    # the command itself
    "unknown-command": Case(("serve",), 2, "kvserving: error: argument COMMAND: invalid choice: 'serve'"),
    "unknown-flag": Case(
        ("capacity", "--gpus", "8"), 2, "kvserving capacity: error: unrecognized arguments: --gpus 8 (see kvserving capacity --help)"
    ),
    "unknown-flag-without-command": Case(("--bogus",), 2, "kvserving: error: unrecognized arguments: --bogus (see kvserving --help)"),
    # a wrong type in the engine config, for every command that reads one
    **{
        f"{cmd}-config-wrong-type": Case(
            (cmd, *extra, "--config", "wrong-type.json"),
            1,
            f'kvserving {cmd}: error: engine config scheduler.max_num_seqs must be an integer, got "many"',
        )
        for cmd, extra in (("worker", ("--role", "both")), ("gateway", ()), ("up", ()))
    },
    **{
        f"{cmd}-config-missing": Case(
            (cmd, *extra, "--config", "missing.json"),
            1,
            f"kvserving {cmd}: error: engine config missing.json: no such file (kvserving config writes one)",
        )
        for cmd, extra in (("worker", ("--role", "both")), ("gateway", ()), ("up", ()))
    },
    "gateway-config-not-json": Case(
        ("gateway", "--config", "a-file"), 1, "kvserving gateway: error: engine config a-file is not valid JSON: Expecting value"
    ),
    "config-set-wrong-type": Case(
        ("config", "--set", "scheduler.max_num_seqs=many"),
        1,
        'kvserving config: error: engine config scheduler.max_num_seqs must be an integer, got "many"',
    ),
    "config-set-unknown-key": Case(
        ("config", "--set", "scheduler.max_seqs=4"),
        1,
        "kvserving config: error: --set 'scheduler.max_seqs=4': section 'scheduler' has no key 'max_seqs'",
    ),
    # a device, a memory budget or an output path that cannot work: refused before the work
    "calibrate-device-not-here": Case(
        ("calibrate", "--data", "a-file", "--device", "cuda:64", "--out", "c.json"), 1, "kvserving calibrate: error: --device cuda:64: "
    ),
    "calibrate-out-no-directory": Case(
        ("calibrate", "--data", "a-file", "--out", "nodir/c.json"),
        1,
        "kvserving calibrate: error: --out nodir/c.json: the directory nodir does not exist",
    ),
    "calibrate-out-a-directory": Case(
        ("calibrate", "--data", "a-file", "--out", "full"), 1, "kvserving calibrate: error: --out full is a directory, not a file"
    ),
    "up-ready-timeout-negative": Case(
        ("up", "--model", "tiny", "--ready-timeout", "-1"), 2, "argument --ready-timeout: must be a number in [0, 1e+06], got -1"
    ),
    "up-host-not-an-address-here": Case(
        ("up", "--model", "tiny", "--host", "999.1.1.1"), 1, "kvserving up: error: --host 999.1.1.1: cannot listen on that address"
    ),
    "demo-plot-no-directory": Case(
        ("demo", "--model", "tiny", "--plot", "nodir/ttft.png"),
        1,
        "kvserving demo: error: --plot nodir/ttft.png: the directory nodir does not exist",
    ),
    "config-out-no-directory": Case(
        ("config", "--out", "nodir/engine.json"), 1, "kvserving config: error: --out nodir/engine.json: the directory nodir does not exist"
    ),
    "simulate-json-no-directory": Case(
        ("simulate", "--agents", "10", "--gpus", "2", "--json", "nodir/sim.json"),
        1,
        "kvserving simulate: error: --json nodir/sim.json: the directory nodir does not exist",
    ),
    "simulate-validate-missing": Case(
        ("simulate", "--validate", "nothere.json"),
        1,
        "kvserving simulate: error: --validate nothere.json: no such file (a bench/agents.py result, e.g. bench/results/agents_cpu.json)",
    ),
    "simulate-validate-not-json": Case(
        ("simulate", "--validate", "a-file"),
        1,
        "kvserving simulate: error: --validate a-file is not valid JSON: ",
    ),
    "generate-kv-bytes-beyond-memory": Case(
        generate("tiny", "--kv-bytes", "1000000000000000"), 1, "kvserving generate: error: --kv-bytes 1000000000000000 is more than "
    ),
    # kvserving up
    "up-model-is-a-file": Case(("up", "--model", "a-file"), 1, "kvserving up: error: --model a-file is not a directory"),
    "up-gpus-not-here": Case(("up", "--model", "tiny", "--gpus", "0,99"), 1, "kvserving up: error: --gpus 0,99: "),
    "up-run-dir-a-file": Case(
        ("up", "--model", "tiny", "--run-dir", "a-file/logs"), 1, "kvserving up: error: --run-dir a-file/logs: a-file is not a directory"
    ),
    "up-kv-mib-beyond-memory": Case(
        ("up", "--model", "tiny", "--kv-mib", "100000000"), 1, "kvserving up: error: --kv-mib 100000000 is more than "
    ),
    "demo-kv-mib-beyond-memory": Case(
        ("demo", "--model", "tiny", "--kv-mib", "1048576"), 1, "kvserving demo: error: --kv-mib 1048576 is more than "
    ),
    # kvserving gateway and worker: refused before the tokenizer or the model loads
    "gateway-no-workers": Case(
        ("gateway",), 1, "kvserving gateway: error: no workers: give --decode URL (and --prefill URL) or gateway.decode_service"
    ),
    "gateway-host-not-an-address-here": Case(
        ("gateway", "--config", "token.json", "--decode", "http://127.0.0.1:9", "--host", "999.1.1.1"),
        1,
        "kvserving gateway: error: --host 999.1.1.1: cannot listen on that address",
    ),
    "worker-host-not-an-address-here": Case(
        ("worker", "--role", "both", "--config", "token.json", "--host", "999.1.1.1"),
        1,
        "kvserving worker: error: --host 999.1.1.1: cannot listen on that address",
    ),
    "worker-advertise-url-not-a-url": Case(
        ("worker", "--role", "both", "--config", "token.json", "--advertise-url", "worker-0:8000"),
        1,
        "kvserving worker: error: --advertise-url: 'worker-0:8000' is not a worker URL; give http://HOST:PORT",
    ),
    # more outputs and inputs of the wrong kind
    "config-out-under-a-file": Case(
        ("config", "--out", "a-file/engine.json"), 1, "kvserving config: error: --out a-file/engine.json: a-file is not a directory"
    ),
    "simulate-validate-a-list": Case(
        ("simulate", "--validate", "list.json"),
        1,
        "kvserving simulate: error: --validate list.json holds a JSON list, not a bench/agents.py result",
    ),
    "calibrate-chunk-negative": Case(
        ("calibrate", "--data", "a-file", "--out", "c.json", "--chunk", "-1"), 2, "argument --chunk: must be an integer >= 0, got -1"
    ),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvserving.tiny_model import build_tiny_model

    work = tmp_path_factory.mktemp("cli_errors")
    for name, text in MANIFESTS.items():
        (work / name).write_text(text)
    tiny = build_tiny_model(work / "tiny")
    truncated = shutil.copytree(tiny, work / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    no_template = shutil.copytree(tiny, work / "no-template")
    config_path = no_template / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    broken = shutil.copytree(tiny, work / "broken-template")
    config["chat_template"] = "{% for m in messages %}{{ m.content | nofilter }}{% endfor %}"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    short = shutil.copytree(tiny, work / "short")
    model_config = json.loads((short / "config.json").read_text())
    model_config["max_position_embeddings"] = 24
    (short / "config.json").write_text(json.dumps(model_config))
    (work / "a-file").write_text("not a directory\n")
    (work / "wrong-type.json").write_text('{"scheduler": {"max_num_seqs": "many"}}')
    (work / "list.json").write_text("[1, 2]\n")
    (work / "token").write_text("not-a-secret\n")
    (work / "token.json").write_text(json.dumps({"security": {"internal_token_file": str(work / "token")}}))
    # a model whose config the engine refuses (not the CLI's own checks): the worker exits on it
    odd = shutil.copytree(tiny, work / "odd-activation")
    model_config = json.loads((odd / "config.json").read_text())
    model_config["hidden_act"] = "gelu_tanh"
    (odd / "config.json").write_text(json.dumps(model_config))
    (work / "binary.yaml").write_bytes(bytes(range(128, 256)))
    (work / "full").mkdir()
    (work / "full" / "notes.txt").write_text("keep me\n")
    return work


@pytest.fixture(scope="module")
def results(workdir: Path) -> dict[str, Result]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {name: pool.submit(run_cli, case.argv, cwd=workdir) for name, case in CASES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line_and_a_non_zero_exit(name: str, results: dict[str, Result]) -> None:
    assert_one_line(results[name], CASES[name])


def test_refused_commands_leave_files_alone(results: dict[str, Result], workdir: Path) -> None:
    assert results["tiny-model-non-empty-dir"].code == 1
    assert sorted(p.name for p in (workdir / "full").iterdir()) == ["notes.txt"]
    assert (workdir / "a-file").read_text() == "not a directory\n"
    assert not (workdir / "c.json").exists() and not (workdir / "nodir").exists()


def test_config_writes_every_field_and_the_readme_worker_example_uses_it(tmp_path: Path) -> None:
    from dataclasses import fields

    from kvserving.config import _SECTION_TYPES, ServingConfig

    plain = run_cli(("config",), cwd=tmp_path)
    assert (plain.code, plain.stderr) == (0, "")
    data = json.loads(plain.stdout)
    assert {s: sorted(v) for s, v in data.items()} == {s: sorted(f.name for f in fields(c)) for s, c in _SECTION_TYPES.items()}
    assert ServingConfig.from_dict(data) == ServingConfig()
    # the README's worker example, as written there
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "kvserving config --set" in ln)
    argv = tuple(line.split("kvserving ", 1)[1].replace("/tmp/", f"{tmp_path}/").split())
    assert argv[:2] == ("config", "--set")
    written = run_cli(argv, cwd=tmp_path)
    assert (written.code, written.stdout) == (0, ""), written.stderr
    config = ServingConfig.load(tmp_path / "engine.json")
    assert config.security.internal_token_file == f"{tmp_path}/kv-token"
    assert config.scheduler == ServingConfig().scheduler
    assert "--config /tmp/engine.json" in readme


def test_up_keeps_its_logs_when_it_fails_and_says_where(workdir: Path) -> None:
    from kvserving.local.stack import free_ports, port_is_free

    port = next(p for p in (free_ports(1)[0] for _ in range(50)) if port_is_free("127.0.0.1", p + 1))
    result = run_cli(("up", "--model", "tiny", "--single", "--kv-mib", "8", "--port", str(port), "--ready-timeout", "0"), cwd=workdir)
    assert result.code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("kvserving up: error: not ready after 0 s: worker, gateway (logs in ")
    run_dir = Path(line.rsplit("(logs in ", 1)[1].rstrip(")"))
    try:
        assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "gateway.log", "worker.log"]  # the credential went
        assert _processes_naming(run_dir) == []
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


REFUSED = "exited with code 1: could not start the engine: hidden_act 'gelu_tanh' is not supported (only silu / SwiGLU) (log: "


def test_a_part_that_dies_while_starting_is_named_with_its_error_and_its_logs_are_kept(workdir: Path) -> None:
    # the engine, not the CLI's own checks, refuses the model: the stack's failure names the part, its error and its log
    from kvserving.local.stack import free_ports, port_is_free

    port = next(p for p in (free_ports(1)[0] for _ in range(50)) if all(port_is_free("127.0.0.1", p + i) for i in (1, 2)))
    up = run_cli(("up", "--model", "odd-activation", "--kv-mib", "8", "--port", str(port)), cwd=workdir)
    demo = run_cli(("demo", "--model", "odd-activation", "--max-tokens", "2", "--kv-mib", "8"), cwd=workdir)
    logs = [Path(r.stderr.split("(log: ", 1)[1].split(")", 1)[0]) for r in (up, demo) if "(log: " in r.stderr]
    try:
        assert up.code == 1 and "Traceback" not in up.stderr, up.stderr
        first, *tail = up.stderr.splitlines()  # then the log's last lines
        assert re.fullmatch(rf"kvserving up: error: (prefill|decode) {re.escape(REFUSED)}\S+\.log\)", first), first
        assert tail[0] == "its last lines:" and any("could not start the engine" in line for line in tail)
        assert (demo.code, "Traceback" in demo.stderr) == (1, False), demo.stderr
        (line,) = demo.stderr.splitlines()  # the first worker to die (both load the model) is named
        assert re.fullmatch(rf"kvserving demo: error: the reuse on stack: (prefill|decode) {re.escape(REFUSED)}\S+\.log\)", line), line
        assert len(logs) == 2 and all(log.is_file() for log in logs)  # kept for the user to read
    finally:
        for log in logs:
            shutil.rmtree(log.parent.parent if log.parent.name == "reuse-on" else log.parent, ignore_errors=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("up", "--model", "tiny"),
            "kvserving up: error: already in use on 127.0.0.1: gateway port {port} (choose other ports with --port)",
        ),
        (
            ("gateway", "--config", "token.json", "--decode", "http://127.0.0.1:9"),
            "kvserving gateway: error: --port {port}: already in use on 127.0.0.1",
        ),
        (("worker", "--role", "both", "--config", "token.json"), "kvserving worker: error: --port {port}: already in use on 127.0.0.1"),
    ],
    ids=["up", "gateway", "worker"],
)
def test_a_port_in_use_is_refused_before_the_model_loads(workdir: Path, argv: tuple[str, ...], message: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli((*argv, "--port", str(port)), cwd=workdir)
    assert (result.code, result.stderr) == (1, message.format(port=port) + "\n")


def _processes_naming(text: Path) -> list[int]:
    """Live processes whose command line holds ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(text) in cmd and state not in ("Z", "X"):
                pids.append(int(entry.name))
    return pids


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                out.append(int(entry.name))
    return out


@pytest.mark.parametrize(
    ("argv", "parts"),
    [
        (("demo", "--model", "tiny", "--max-tokens", "4", "--kv-mib", "8"), 3),  # prefill, decode, gateway
        (("up", "--model", "tiny", "--single", "--kv-mib", "8"), 2),  # worker, gateway
    ],
    ids=["demo", "up"],
)
def test_sigterm_ends_every_child_as_ctrl_c_does(workdir: Path, argv: tuple[str, ...], parts: int) -> None:
    import signal
    import time

    from kvserving.local.stack import group_alive

    if argv[0] == "up":
        from kvserving.local.stack import free_ports, port_is_free

        port = next(p for p in (free_ports(1)[0] for _ in range(50)) if port_is_free("127.0.0.1", p + 1))
        argv = (*argv, "--port", str(port))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserving.cli", *argv],
        cwd=workdir,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(children) < parts:  # every part started (each leads its own process group)
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, f"{argv[0]} started {len(children)} of {parts} parts"
            children = _children(proc.pid)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == (0 if argv[0] == "up" else 130)  # up: a requested stop; demo: interrupted, as on Ctrl-C
        deadline = time.monotonic() + 30
        while any(group_alive(c) for c in children):
            assert time.monotonic() < deadline, [c for c in children if group_alive(c)]
            time.sleep(0.1)
    finally:
        for pgid in (proc.pid, *children):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def test_demo_calls_only_the_builtin_models_text_noise() -> None:
    from kvserving.local.demo import headline

    assert headline(Path("/models/qwen3"), builtin=False, requests=4, max_tokens=2, kv_mib=16) == (
        "model /models/qwen3 serving 4 chat requests, 2 tokens each, KV budget 16 MiB"
    )
    assert headline(Path("/tmp/x/tiny-model"), builtin=True, requests=4, max_tokens=2, kv_mib=16) == (
        "the built-in tiny model serving 4 chat requests, 2 tokens each, KV budget 16 MiB"
        " (random weights: the text is noise, the mechanics are real)"
    )


def test_tiny_model_into_a_read_only_place(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root writes through permission bits; sysfs refuses new directories even to root.
        target, message = Path("/sys/kvserving-tiny-model-test"), "error: Operation not permitted: /sys/kvserving-tiny-model-test"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        target, message = locked / "tiny", f"error: Permission denied: {locked / 'tiny'}"
    assert_one_line(run_cli(("tiny-model", str(target)), cwd=tmp_path), Case((), 1, message))


def test_operator_without_credentials_exits_at_once(tmp_path: Path) -> None:
    # HOME without ~/.kube/config and no KUBECONFIG: kopf would retry the login every minute.
    result = run_cli(("operator",), cwd=tmp_path, env=cli_env(HOME=str(tmp_path)))
    assert_one_line(
        result, Case((), 1, "kvserving operator: error: no cluster credentials: no service account token and no kubeconfig found")
    )
    (tmp_path / "kubeconfig").write_text("current-context: prod\n")
    result = run_cli(("operator",), cwd=tmp_path, env=cli_env(HOME=str(tmp_path), KUBECONFIG=str(tmp_path / "kubeconfig")))
    assert_one_line(result, Case((), 1, "no cluster credentials: the kubeconfig names 'prod' but does not define it"))


def test_version_prints_the_package_version(tmp_path: Path) -> None:
    result = run_cli(("--version",), cwd=tmp_path)
    assert (result.code, result.stdout, result.stderr) == (0, f"kvserving {kvserving.__version__}\n", "")


NVIDIA_SMI = "echo 'NVIDIA H200, 1980 MHz, 3201 MHz, 30'"  # what gpu_run.sh asks of the GPU


def gpu_run(tmp_path: Path, step: str, fakes: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``bench/gpu_run.sh STEP`` with ``fakes`` (command name -> bash body) first on PATH: a stand-in GPU machine."""
    path = "/usr/bin:/bin"
    if fakes:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, body in fakes.items():
            (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
            (bin_dir / name).chmod(0o755)
        path = f"{bin_dir}:{path}"
    env = {"PATH": path, "OUT": str(tmp_path / "out"), "KVPKG": str(tmp_path / "pkg"), "HOME": str(tmp_path)}
    return subprocess.run(["bash", "bench/gpu_run.sh", step], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_gpu_run_fails_loudly_without_a_gpu(tmp_path: Path) -> None:
    # PATH without nvidia-smi: the script must refuse before running anything.
    proc = gpu_run(tmp_path, "all")
    assert proc.returncode == 1
    assert proc.stderr == "gpu_run.sh: error: no GPU: nvidia-smi not found (run this on the device machine)\n"


def test_gpu_run_exits_non_zero_when_the_gpu_tests_fail(tmp_path: Path) -> None:
    # A stand-in GPU machine: nvidia-smi answers, python3 passes the device check,
    # the test run fails and the benchmark succeeds; the script must still fail.
    proc = gpu_run(
        tmp_path,
        "all",
        {
            "nvidia-smi": NVIDIA_SMI,
            "python3": 'case "$*" in *"-m pytest"*) echo "1 failed, 3 passed"; exit 1;; *) echo "python3 $*"; exit 0;; esac',
        },
    )
    assert proc.returncode == 1
    assert "1 failed, 3 passed" in proc.stdout
    assert "python3 bench/decode_gpu.py" in proc.stdout  # the benchmark still ran
    out = tmp_path / "out"
    assert proc.stderr == f"gpu_run.sh: error: gpu tests failed (exit 1, log in {out}/gpu_tests.log)\n"


def test_gpu_run_tests_step_runs_every_file_with_a_gpu_test(tmp_path: Path) -> None:
    # the stand-in machine's python3 prints its pytest arguments: the default set is every test file holding a
    # gpu-marked test (the worker's included), and no file without one
    proc = gpu_run(tmp_path, "tests", {"nvidia-smi": NVIDIA_SMI, "python3": 'case "$*" in *"-m pytest"*) echo "PYTEST $*";; esac; exit 0'})
    assert proc.returncode == 0, proc.stderr
    shared, alone = [ln for ln in proc.stdout.splitlines() if ln.startswith("PYTEST ")]
    # the tests that share the GPU side by side (the stand-in has no pytest-xdist: one process), then the rest alone
    assert "-m gpu and not gpu_alone " in shared and "-m gpu and gpu_alone " in alone
    ran = {a for a in shared.split() if a.startswith("tests/")}
    assert ran == {a for a in alone.split() if a.startswith("tests/")}
    marked = {str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"mark\.gpu|pytestmark.*gpu", f.read_text())}  # fmt: skip
    assert ran == marked and "tests/worker/test_engine_gpu.py" in ran and "tests/kernels/test_gluon_decode.py" in ran
    assert "tests/worker/test_server.py" not in ran  # no gpu test: its imports stay off the device's collection


def test_gpu_run_tests_step_fails_once_with_the_first_failing_part(tmp_path: Path) -> None:
    # the shared part passes, the alone part fails with 2; a part that selects nothing (exit 5) is not a failure
    fake = 'case "$*" in *"not gpu_alone"*) echo "shared"; exit 5;; *"-m pytest"*) echo "1 failed"; exit 2;; esac; exit 0'
    proc = gpu_run(tmp_path, "tests", {"nvidia-smi": NVIDIA_SMI, "python3": fake})
    out = tmp_path / "out"
    assert proc.returncode == 1
    assert (out / "gpu_tests.log").read_text() == "shared\n1 failed\n"
    assert proc.stderr == f"gpu_run.sh: error: gpu tests failed (exit 2, log in {out}/gpu_tests.log)\n"


def test_gpu_run_nixl_and_agents_steps_run_their_benches_and_fail_with_them(tmp_path: Path) -> None:
    # the stand-in python3 prints its arguments; the agents bench fails: the script says so and exits 1
    fake = 'case "$*" in *agents.py*) echo "python3 $*"; exit 3;; *) echo "python3 $*"; exit 0;; esac'
    proc = gpu_run(tmp_path, "nixl,agents", {"nvidia-smi": NVIDIA_SMI, "python3": fake})
    out = tmp_path / "out"
    assert proc.returncode == 1
    assert f"python3 bench/nixl_read_gpu.py --require-transport cuda_ipc --out {out}/nixl_read_gpu.json" in proc.stdout
    agents = (out / "agents.log").read_text()
    assert (
        f"python3 agents.py --gpu --formats fp8 --modes lease --concurrency 12,16,24 --point-s 110 --json {out}/agents_gpu.json" in agents
    )
    assert proc.stderr == f"gpu_run.sh: error: agents.py failed (exit 3, log in {out}/agents.log)\n"


def test_gpu_run_engine_step_writes_both_weight_formats_tables_into_one_file(tmp_path: Path) -> None:
    # the stand-in python3 prints its arguments and a table line; the FP8 run fails: the script says so and exits 1
    fake = 'echo "python3 $*"; case "$*" in *engine_gpu.py*) echo "format  1x4K";; esac; case "$*" in *fp8_block*) exit 3;; esac'
    proc = gpu_run(tmp_path, "engine", {"nvidia-smi": NVIDIA_SMI, "python3": fake})
    out = tmp_path / "out"
    bf16 = f"python3 bench/engine_gpu.py --speed-kv-gib 40 --out {out}/engine_gpu.json\nformat  1x4K\n"
    assert (out / "engine_bf16.log").read_text() == bf16
    assert (out / "engine_fp8_block.log").read_text().splitlines()[0] == (
        f"python3 bench/engine_gpu.py --speed-kv-gib 40 --weights fp8_block --no-breakdown --out {out}/engine_gpu.json"
    )
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith(("== ", "format"))] == [
        "== engine, bf16 weights (exit 0)", "format  1x4K", "== engine, fp8_block weights (exit 3)", "format  1x4K",
    ]  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == f"gpu_run.sh: error: engine_gpu.py failed with fp8_block weights (exit 3, log in {out}/engine_fp8_block.log)\n"


@pytest.mark.parametrize(("step", "var"), [("pdl", "KVSERVING_PDL"), ("gemv", "KVSERVING_BF16_GEMV"), ("merge", "KVSERVING_FUSED_MERGE")])
def test_gpu_run_ab_steps_alternate_the_engine_bench_off_and_on_twice(tmp_path: Path, step: str, var: str) -> None:
    # the stand-in python3 prints the step's variable and its arguments; the second run with it on fails
    fake = f'echo "{var}=${var} python3 $*"; case "${var} $*" in "1 "*{step}1_2*) exit 4;; esac; exit 0'
    proc = gpu_run(tmp_path, step, {"nvidia-smi": NVIDIA_SMI, "python3": fake})
    out = tmp_path / "out"
    runs = [(out / f"engine_{step}{v}_{i}.log").read_text().splitlines()[-1] for i in (1, 2) for v in (0, 1)]
    assert runs == [
        f"{var}={v} python3 bench/engine_gpu.py --quick --no-breakdown --speed-kv-gib 40 --section {step}{v}_{i} --out {out}/engine_{step}.json"
        for i in (1, 2) for v in (0, 1)
    ]  # fmt: skip
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("== ")] == [
        f"== {var}=0, run 1 (exit 0)", f"== {var}=1, run 1 (exit 0)", f"== {var}=0, run 2 (exit 0)", f"== {var}=1, run 2 (exit 4)",
    ]  # fmt: skip
    if step == "gemv":  # the projections' sweep first, with the variable unset
        assert (out / "gemm.log").read_text() == (f"{var}= python3 bench/fp8_gemm_gpu.py --tokens 1,2,8,16 --tiles 16x64w4s4k4 "
                                                  f"--gemv g8x2048w4s1k1 --bf16-tiles 64w4s4k2,128w8s4k2 "
                                                  f"--out {out}/fp8_gemm_gpu.json\n")  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == f"gpu_run.sh: error: engine_gpu.py failed with {var}=1 (exit 4, log in {out}/engine_{step}1_2.log)\n"


def test_gpu_run_skips_the_agents_step_when_the_read_is_not_over_cuda_ipc(tmp_path: Path) -> None:
    fake = 'case "$*" in *nixl_read_gpu.py*) echo "python3 $*"; exit 1;; *) echo "python3 $*"; exit 0;; esac'
    proc = gpu_run(tmp_path, "nixl,agents", {"nvidia-smi": NVIDIA_SMI, "python3": fake})
    out = tmp_path / "out"
    assert proc.returncode == 1 and not (out / "agents.log").exists()
    assert proc.stderr == (
        f"gpu_run.sh: error: nixl_read_gpu.py failed (exit 1, log in {out}/nixl.log)\n"
        "gpu_run.sh: error: agents step skipped: the READ between two processes on the GPU is not over CUDA IPC\n"
    )


def test_the_packaged_crd_is_the_repositorys_and_admits_every_sample() -> None:
    from kvserving.operator.main import load_crd
    from kvserving.operator.validate import admit

    crd = load_crd()
    assert crd == yaml.safe_load((ROOT / "crds" / "kvserving.yaml").read_text())
    for path in sorted(SAMPLES.glob("*.yaml")):
        admission = admit(yaml.safe_load(path.read_text()), crd=crd)
        assert admission.problems == (), path.name
        assert admission.body["spec"]["reuse"]["recomputeThresholdTokens"] == 64  # a CRD default filled in


def test_generate_shows_progress_on_a_terminal_only(workdir: Path) -> None:
    import pty

    argv = generate("short", "--max-tokens", "3")
    primary, secondary = pty.openpty()
    try:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "kvserving.cli", *argv],
                cwd=workdir,
                env=cli_env(),
                stdout=subprocess.PIPE,
                stderr=secondary,
                text=True,
                timeout=TIMEOUT_S,
            )
        finally:
            os.close(secondary)
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(primary)
    terminal = b"".join(chunks).decode()
    assert proc.returncode == 0
    assert "\rgenerated 1/3 tokens" in terminal
    assert terminal.endswith("\r\x1b[K")  # the progress line is cleared before the output
    assert "--- 3 tokens in" in proc.stdout
    piped = run_cli(argv, cwd=workdir)  # stderr is a pipe: no progress
    assert (piped.code, piped.stderr) == (0, "")


def test_a_null_spec_is_pruned_and_defaulted_as_the_api_server_does() -> None:
    from kvserving.operator.main import load_crd
    from kvserving.operator.validate import admit

    body = {"apiVersion": "kvserving.dev/v1alpha1", "kind": "KVServing", "metadata": {"name": "tiny"}, "spec": None}
    admission = admit(body, crd=load_crd())
    assert admission.problems == ()
    assert admission.body["spec"]["kvCache"]["dtype"] == "bf16"
    assert admission.body["spec"]["model"]["path"] == ""  # the built-in tiny model


def test_tiny_model_force_writes_into_a_non_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvserving.cli import main

    (tmp_path / "notes.txt").write_text("keep me\n")
    assert main(["tiny-model", str(tmp_path), "--force"]) == 0
    assert capsys.readouterr().out == f"wrote tiny model to {tmp_path}\n"
    assert {"notes.txt", "config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in tmp_path.iterdir()}


def test_render_prints_one_line_per_problem(tmp_path: Path) -> None:
    body = _sample("triaxial")
    body["spec"]["kvCache"]["bitBudget"] = 9
    body["spec"]["decode"]["replicas"] = -2
    body["spec"]["reuse"]["leaseTTLSeconds"] = 600
    (tmp_path / "three.yaml").write_text(yaml.safe_dump(body))
    result = run_cli(render("three.yaml"), cwd=tmp_path)
    assert (result.code, result.stdout) == (1, "")
    assert sorted(result.stderr.splitlines()) == [
        "kvserving operator: error: three.yaml: spec.decode.replicas: replicas must not be negative",
        "kvserving operator: error: three.yaml: spec.kvCache.bitBudget: bitBudget must be within [2, 4]",
        "kvserving operator: error: three.yaml: spec.reuse: leaseTTLSeconds must be less than retentionTTLSeconds "
        "(a gateway lease must expire before the worker drops the KV)",
    ]


def test_gpu_run_layout_step_reads_and_runs_the_engine_with_each_kv_layout(tmp_path: Path) -> None:
    # the stand-in python3 prints its arguments; the second page-major engine run fails
    fake = 'echo "python3 $*"; case "$*" in *page_major_2*) exit 5;; esac; exit 0'
    proc = gpu_run(tmp_path, "layout", {"nvidia-smi": NVIDIA_SMI, "python3": fake})
    out = tmp_path / "out"
    reads = [(out / f"nixl_read_{lay}.log").read_text().strip() for lay in ("layer_major", "page_major")]
    assert reads == [
        f"python3 bench/nixl_read_gpu.py --kv-layout {lay} --out {out}/nixl_read_{lay}.json" for lay in ("layer_major", "page_major")
    ]
    runs = [(out / f"engine_{lay}_{i}.log").read_text().strip() for i in (1, 2) for lay in ("layer_major", "page_major")]
    assert runs == [
        f"python3 bench/engine_gpu.py --quick --no-breakdown --speed-kv-gib 40 --formats nvfp4,triaxial --kv-layout {lay} "
        f"--section {lay}_{i} --out {out}/engine_layout.json"
        for i in (1, 2) for lay in ("layer_major", "page_major")
    ]  # fmt: skip
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("== ")] == [
        "== READ, kv_cache.layout layer_major (exit 0)", "== READ, kv_cache.layout page_major (exit 0)",
        "== engine, kv_cache.layout layer_major, run 1 (exit 0)", "== engine, kv_cache.layout page_major, run 1 (exit 0)",
        "== engine, kv_cache.layout layer_major, run 2 (exit 0)", "== engine, kv_cache.layout page_major, run 2 (exit 5)",
    ]  # fmt: skip
    assert proc.returncode == 1
    assert (
        proc.stderr
        == f"gpu_run.sh: error: engine_gpu.py failed with --kv-layout page_major (exit 5, log in {out}/engine_page_major_2.log)\n"
    )
