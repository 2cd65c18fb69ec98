"""FP8 model weights: checkpoints as published FP8 models ship them (per-tensor and 128x128 block scales),
the FP8 dummy weights, the weight bytes of a decode step, and the engine running them.

Bounds:
- an FP8 checkpoint on CPU against its dequantized reference (the same model with plain linear layers
  holding the dequantized weights): the FP8 layer dequantizes and multiplies exactly as the reference
  does, in fp32, so logits agree to fp32 rounding: 1e-5 of their largest magnitude;
- against the unquantized weights the FP8 checkpoint came from, the weights differ by up to half an
  E4M3 step (2^-4 relative): no bound is claimed, the measured difference is reported
  (``test_fp8_weights_cost_little_against_the_unquantized_model``);
- the GPU path (activations quantized to FP8 on the fly, bf16 elsewhere) against the dequantized
  reference in fp32: greedy tokens equal (``gpu`` tests; on CPU the same arithmetic in torch,
  backend "torch", is held to it too).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from kvserving import cli
from kvserving.config import ModelConfig, ServingConfig
from kvserving.kernels import fp8_gemm
from kvserving.kernels.capacity import bytes_per_token, decode_weight_bytes
from kvserving.worker.fp8_linear import Fp8Linear, set_backend
from kvserving.worker.model import (
    DecoderModel,
    DenseCausalAttention,
    load_dummy_model,
    load_model,
    random_model,
    step_weight_bytes,
    weight_bytes_per_step,
    weight_format_of,
)
from kvserving.tiny_model import QWEN3_8B_CONFIG, build_tiny_model
from kvserving.worker.model_files import build_model_dir
from kvserving.worker.weights import Fp8Scheme, read_quantization

VARIANTS = [("fp8", False), ("fp8", True), ("fp8_block", False)]  # (weight format, static input scales)
IDS = ["per-tensor", "per-tensor-static", "block128"]


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {(f, s): build_model_dir(root / f"{f}-{s}", weight_format=f, static_input=s) for f, s in VARIANTS}


def dequantized_reference(model: DecoderModel) -> DecoderModel:
    """The same model with every FP8 layer replaced by an ``nn.Linear`` holding its dequantized weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Fp8Linear):
            parent, _, leaf = name.rpartition(".")
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = nn.Parameter(module.dequantized_weight(), requires_grad=False)
            setattr(model.get_submodule(parent), leaf, plain)
    return model


def prefill_and_decode(model: DecoderModel, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """Logits [len(ids), vocab]: one prefill, then one decode step per remaining id."""
    attn = DenseCausalAttention()
    rows = [model.compute_logits(model(ids[:n_prefill], torch.arange(n_prefill, device=ids.device), attn))]
    for t in range(n_prefill, len(ids)):
        rows.append(model.compute_logits(model(ids[t : t + 1], torch.tensor([t], device=ids.device), attn)))
    return torch.cat(rows)


def greedy(model: DecoderModel, prompt: list[int], n: int, device: str = "cpu") -> list[int]:
    attn = DenseCausalAttention()
    ids = list(prompt)
    hidden = model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), attn)
    out: list[int] = []
    for _ in range(n):
        out.append(int(model.compute_logits(hidden[-1:]).argmax()))
        hidden = model(torch.tensor(out[-1:], device=device), torch.tensor([len(ids)], device=device), attn)
        ids.append(out[-1])
    return out


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))


# -- quantization_config -----------------------------------------------------------------------------
@pytest.mark.parametrize(("quant", "scheme"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, Fp8Scheme("fp8")),
    ({"quant_method": "fp8", "activation_scheme": "static"}, Fp8Scheme("fp8", static_input=True)),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     Fp8Scheme("fp8_block")),
    (None, None),
])  # fmt: skip
def test_quantization_config_names_the_scheme(quant: dict[str, object] | None, scheme: Fp8Scheme | None) -> None:
    config = {} if quant is None else {"quantization_config": quant}
    assert read_quantization(config) == scheme
    if scheme is not None:
        assert read_quantization({"quantization_config": scheme.quantization_config()}) == scheme


@pytest.mark.parametrize(("quant", "words"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64] is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme 'sometimes'"),
])  # fmt: skip
def test_an_unsupported_scheme_is_refused_with_one_line(tmp_path: Path, quant: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError) as err:
        read_quantization({"quantization_config": quant})
    assert words in str(err.value) and "\n" not in str(err.value)
    d = build_tiny_model(tmp_path / "m", shape="qwen3-8b")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, quantization_config=quant)))
    with pytest.raises(ValueError, match="quantization_config"):
        load_dummy_model(d, seed=0)


# -- checkpoints -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "static"), VARIANTS, ids=IDS)
def test_tiny_model_writes_the_published_fp8_layout(fp8_dirs: dict[tuple[str, bool], Path], fmt: str, static: bool) -> None:
    d = fp8_dirs[(fmt, static)]
    config = json.loads((d / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["activation_scheme"] == ("static" if static else "dynamic")
    assert config["quantization_config"].get("weight_block_size") == ([128, 128] if fmt == "fp8_block" else None)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # [256, 512]
        assert w.dtype == torch.float8_e4m3fn and w.shape == (256, 512)
        if fmt == "fp8_block":
            assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv").shape == (2, 4)
            assert f.get_tensor("model.layers.0.self_attn.k_proj.weight_scale_inv").shape == (1, 2)
        else:
            assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").shape == ()
        assert ("model.layers.0.self_attn.q_proj.input_scale" in names) == static
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # embedding, lm_head, norms unquantized
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    assert sum(n.endswith(".weight_scale_inv" if fmt == "fp8_block" else ".weight_scale") for n in names) == 4 * 7


@pytest.mark.parametrize(("fmt", "static"), VARIANTS, ids=IDS)
def test_fp8_checkpoint_logits_equal_the_dequantized_reference(fp8_dirs: dict[tuple[str, bool], Path], fmt: str, static: bool) -> None:
    args, model = load_model(fp8_dirs[(fmt, static)])
    assert weight_format_of(model) == fmt
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == torch.float8_e4m3fn
    assert (qkv.input_scale is not None) == static
    _, ref = load_model(fp8_dirs[(fmt, static)])
    ref = dequantized_reference(ref)
    assert weight_format_of(ref) == "bf16"
    ids = _ids(40)
    with torch.no_grad():
        got, want = prefill_and_decode(model, ids, 32), prefill_and_decode(ref, ids, 32)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_per_tensor_scales_stay_on_their_parts_rows(fp8_dirs: dict[tuple[str, bool], Path]) -> None:
    d = fp8_dirs[("fp8", True)]
    _, model = load_model(d)
    qkv = model.layers[1].self_attn.qkv_proj  # q: 512 rows, k and v: 128 each
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        part = {p: f.get_tensor(f"model.layers.1.self_attn.{p}_proj.{s}") for p in "qkv" for s in ("weight_scale",)}
        inputs = [f.get_tensor(f"model.layers.1.self_attn.{p}_proj.input_scale") for p in "qkv"]
    assert torch.equal(qkv.weight_scale, torch.cat([part["q"].expand(512), part["k"].expand(128), part["v"].expand(128)]))
    assert qkv.input_scale is not None and qkv.input_scale.item() == max(s.item() for s in inputs)


def test_a_bf16_checkpoint_quantized_at_load_equals_the_written_fp8_checkpoint(
    tiny_model_dir: Path, fp8_dirs: dict[tuple[str, bool], Path]
) -> None:
    for fmt in ("fp8", "fp8_block"):
        _, online = load_model(tiny_model_dir, weight_format=fmt)
        _, stored = load_model(fp8_dirs[(fmt, False)])
        a, b = online.state_dict(), stored.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_a_weight_format_against_the_checkpoints_is_refused(fp8_dirs: dict[tuple[str, bool], Path]) -> None:
    with pytest.raises(ValueError, match="model.weight_format 'fp8' does not match .* stores fp8_block weights"):
        load_model(fp8_dirs[("fp8_block", False)], weight_format="fp8")
    with pytest.raises(ValueError, match="stores fp8 weights"):
        load_model(fp8_dirs[("fp8", False)], weight_format="bf16")
    with pytest.raises(ValueError, match="model.weight_format"):
        ServingConfig.from_dict({"model": {"weight_format": "int4"}})
    config = ServingConfig.from_dict({"model": {"weight_format": "fp8_block"}})
    assert ServingConfig.from_json(config.to_json()).model.weight_format == "fp8_block"


def test_fp8_weights_cost_little_against_the_unquantized_model(tiny_model_dir: Path, fp8_dirs: dict[tuple[str, bool], Path]) -> None:
    """Measured on the tiny model (random weights), 40 positions: max |logit difference| 0.135 (per tensor)
    and 0.107 (block) of logits up to 3.6; argmax equal at 39 and 40 of 40 positions."""
    _, base = load_model(tiny_model_dir)
    ids = _ids(40)
    with torch.no_grad():
        want = prefill_and_decode(base, ids, 32)
        for fmt in ("fp8", "fp8_block"):
            _, model = load_model(fp8_dirs[(fmt, False)])
            got = prefill_and_decode(model, ids, 32)
            assert 0 < (got - want).abs().max().item() <= 0.2
            assert (got.argmax(-1) == want.argmax(-1)).sum().item() >= 38


@pytest.mark.parametrize(("fmt", "static"), VARIANTS, ids=IDS)
def test_the_gpu_arithmetic_keeps_greedy_tokens(fp8_dirs: dict[tuple[str, bool], Path], fmt: str, static: bool) -> None:
    """Backend "torch": activations quantized per token (per 128 channels for block scales, the static
    scale when the checkpoint has one), as the GPU GEMMs do, against the dequantized reference."""
    _, model = load_model(fp8_dirs[(fmt, static)])
    _, ref = load_model(fp8_dirs[(fmt, static)])
    ref = dequantized_reference(ref)
    assert set_backend(model, "torch") == 16
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(2):
            prompt = torch.randint(0, 4096, (20,), generator=g).tolist()
            assert greedy(model, prompt, 24) == greedy(ref, prompt, 24)


def test_the_engine_generates_from_an_fp8_checkpoint(fp8_dirs: dict[tuple[str, bool], Path]) -> None:
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    d = fp8_dirs[("fp8_block", False)]
    engine = LLMEngine(ServingConfig(model=ModelConfig(path=str(d))))  # the format comes from config.json
    assert weight_format_of(engine.model) == "fp8_block"
    args, ref = load_model(d)
    ref = dequantized_reference(ref)
    prompt = _ids(12, seed=5).tolist()
    out = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))
    with torch.no_grad():
        assert out[0] == greedy(ref, prompt, 10)


# -- dummy weights -----------------------------------------------------------------------------------
_DIGEST_SCRIPT = """
import hashlib, sys, torch
from kvserving.worker.model import DenseCausalAttention, load_dummy_model, weight_format_of
model_dir, seed, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
args, model = load_dummy_model(model_dir, seed=seed, dtype=dtype, device=device)
ids = torch.tensor([5, 17, 300, 42, 99, 7, 1000, 3], device=device)
with torch.no_grad():
    logits = model.compute_logits(model(ids, torch.arange(len(ids), device=device), DenseCausalAttention())[-1:])
print(weight_format_of(model), hashlib.sha256(logits[0].cpu().numpy().tobytes()).hexdigest())
"""


def _child_digest(model_dir: Path, seed: int, device: str = "cpu") -> str:
    out = subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT, str(model_dir), str(seed), device],
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def _weightless(tmp_path: Path, fmt: str) -> Path:
    """The tiny shape's config (with the FP8 quantization_config) and tokenizer, no weights."""
    d = build_model_dir(tmp_path / fmt, weight_format=fmt)
    (d / "model.safetensors").unlink()
    return d


def test_fp8_dummy_weights_are_drawn_then_quantized_the_same_in_every_process(tmp_path: Path) -> None:
    d = _weightless(tmp_path, "fp8_block")
    args, a = load_dummy_model(d, seed=4)  # "auto": config.json's quantization_config says fp8_block
    assert weight_format_of(a) == "fp8_block"
    drawn = random_model(args, seed=4)  # the same draw, unquantized
    qkv = a.layers[2].self_attn.qkv_proj
    codes, scale = fp8_gemm.quantize_blocks(drawn.layers[2].self_attn.qkv_proj.weight)
    assert torch.equal(qkv.weight.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(qkv.weight_scale, scale)
    assert torch.equal(a.lm_head.weight, drawn.lm_head.weight)  # lm_head stays unquantized
    _, b = load_dummy_model(d, seed=4)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)
    with torch.no_grad():
        ids = torch.tensor([5, 17, 300, 42, 99, 7, 1000, 3])
        logits = a.compute_logits(a(ids, torch.arange(8), DenseCausalAttention())[-1:])
    import hashlib

    digest = hashlib.sha256(logits[0].numpy().tobytes()).hexdigest()
    assert _child_digest(d, 4) == f"fp8_block {digest}"
    assert _child_digest(d, 5) != f"fp8_block {digest}"


def test_a_weight_format_on_a_bf16_dummy_quantizes_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _weightless(tmp_path, "bf16")
    _, plain = load_dummy_model(d, seed=1)
    _, fp8 = load_dummy_model(d, seed=1, weight_format="fp8")
    assert weight_format_of(plain) == "bf16" and weight_format_of(fp8) == "fp8"
    w = plain.layers[0].mlp.down_proj.weight
    assert torch.equal(fp8.layers[0].mlp.down_proj.weight_scale, fp8_gemm.quantize_tensor(w)[1].expand(w.shape[0]))


# -- weight bytes and capacity -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block"])
def test_weight_bytes_per_step_count_what_the_model_stores(tmp_path: Path, fmt: str) -> None:
    d = _weightless(tmp_path, "bf16")
    args, model = load_dummy_model(d, seed=0, weight_format=fmt)
    assert step_weight_bytes(model) == weight_bytes_per_step(args, fmt, dtype=torch.float32)
    embed = args.vocab_size * args.hidden_size * 4
    assert step_weight_bytes(model) == sum(t.numel() * t.element_size() for t in model.state_dict().values()) - embed


def test_qwen3_8b_weight_bytes_by_hand() -> None:
    shape = dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936)
    linear = 6144 * 4096 + 4096 * 4096 + 24576 * 4096 + 4096 * 12288  # 192,937,984 weights per layer
    small = 2 * 4096 + 2 * 128  # norms and q/k-norm
    lm_head = 151936 * 4096 + 4096
    bf16 = decode_weight_bytes(weight_format="bf16", **shape)
    assert bf16 == 36 * 2 * (linear + small) + 2 * lm_head  # 15.14 GB
    fp8 = decode_weight_bytes(weight_format="fp8", **shape)
    assert fp8 == 36 * (linear + 4 * (6144 + 4096 + 24576 + 4096) + 2 * small) + 2 * lm_head  # 8.20 GB
    block = decode_weight_bytes(weight_format="fp8_block", **shape)
    tiles = 48 * 32 + 32 * 32 + 192 * 32 + 32 * 96
    assert block == 36 * (linear + 4 * tiles + 2 * small) + 2 * lm_head
    assert round(bf16 / 1e9, 2) == 15.14 and round(fp8 / 1e9, 2) == 8.20 and round(bf16 / block, 3) == 1.848


def test_capacity_subtracts_the_weights_in_their_format(capsys: pytest.CaptureFixture[str]) -> None:
    kv = bytes_per_token("fp8_e4m3", layers=36, kv_heads=8, head_dim=128)
    tokens = {}
    for fmt in ("bf16", "fp8"):
        assert cli.main(["capacity", "--gpu-gib", "141", "--weights", fmt]) == 0
        text = capsys.readouterr().out
        row = next(line for line in text.splitlines() if line.startswith("fp8_e4m3"))
        tokens[fmt] = int(row.split()[3].replace(",", ""))
        shape = dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936)
        weights = decode_weight_bytes(weight_format=fmt, **shape) + 151936 * 4096 * 2
        assert tokens[fmt] == math.floor((141 * 2**30 - weights) / kv)
        assert f"of {fmt} weights" in text
    # FP8 weights free 6.94 GB: 94,132 more fp8_e4m3 KV tokens at the 8B shape (73,728 bytes each)
    assert tokens["fp8"] - tokens["bf16"] == 94_132
    assert cli.main(["capacity", "--gpu-gib", "10", "--weights", "bf16"]) == 2
    assert "do not fit --gpu-gib 10" in capsys.readouterr().err


def test_tiny_model_cli_writes_an_8b_fp8_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q8b"
    assert cli.main(["tiny-model", str(out), "--shape", "qwen3-8b", "--weights", "fp8_block"]) == 0
    assert "quantized at load" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == QWEN3_8B_CONFIG["hidden_size"]
    assert read_quantization(config) == Fp8Scheme("fp8_block") and not list(out.glob("*.safetensors"))


def test_tiny_model_offers_every_weight_format_a_checkpoint_can_hold() -> None:
    # its --weights choices come from the engine config (torch-free) while the writer checks worker.weights'
    from kvserving.config import WEIGHT_FORMATS as ENGINE
    from kvserving.worker.weights import WEIGHT_FORMATS as CHECKPOINT

    assert [f for f in ENGINE if f != "auto"] == list(CHECKPOINT)


def test_the_operator_renders_the_weight_format_the_crd_admits() -> None:
    import yaml

    from kvserving.config import WEIGHT_FORMATS
    from kvserving.operator.spec import parse_spec

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "kvserving.yaml").read_text())
    model = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["model"]
    assert model["properties"]["weightFormat"]["enum"] == list(WEIGHT_FORMATS)
    assert model["properties"]["weightFormat"]["default"] == "auto"
    assert parse_spec({}).serving.model.weight_format == "auto"
    assert parse_spec({"model": {"weightFormat": "fp8_block"}}).serving.model.weight_format == "fp8_block"
    with pytest.raises(ValueError, match="model.weight_format"):
        parse_spec({"model": {"weightFormat": "int4"}})


# -- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize(("fmt", "static"), VARIANTS, ids=IDS)
def test_gpu_fp8_greedy_tokens_equal_the_dequantized_reference(
    fp8_dirs: dict[tuple[str, bool], Path], fmt: str, static: bool, backend: str
) -> None:
    """The FP8 GEMMs (bf16 activations quantized on the fly) against the dequantized weights in fp32."""
    _, model = load_model(fp8_dirs[(fmt, static)], dtype=torch.bfloat16, device="cuda")
    set_backend(model, backend)
    _, ref = load_model(fp8_dirs[(fmt, static)], device="cuda")
    ref = dequantized_reference(ref)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(4):
            prompt = torch.randint(0, 4096, (20,), generator=g).tolist()
            assert greedy(model, prompt, 32, "cuda") == greedy(ref, prompt, 32, "cuda")


@pytest.mark.gpu
@pytest.mark.gpu_alone
@pytest.mark.parametrize("fmt", ["fp8", "fp8_block"])
def test_gpu_engine_serves_the_8b_fp8_dummy_model(tmp_path: Path, fmt: str) -> None:
    """The 8B-shaped dummy model in FP8 through the engine with CUDA graphs: the weights a step reads are what
    ``weight_bytes_per_step`` says, and decode steps replay graphs."""
    from kvserving.config import KVCacheConfig
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    d = build_model_dir(tmp_path / "q8b", shape="qwen3-8b", weight_format=fmt)
    config = ServingConfig(model=ModelConfig(path=str(d), load_format="dummy"),
                           kv_cache=KVCacheConfig(dtype="bf16", memory_bytes=2 << 30))  # fmt: skip
    engine = LLMEngine(config)
    assert weight_format_of(engine.model) == fmt
    assert step_weight_bytes(engine.model) == weight_bytes_per_step(engine.args, fmt)
    out = engine.generate([_ids(64, seed=2).tolist()], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0 and len(out[0]) == 16


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "static"), VARIANTS, ids=IDS)
def test_gpu_fp8_graphs_on_and_off_give_the_same_tokens(fp8_dirs: dict[tuple[str, bool], Path], fmt: str, static: bool) -> None:
    """FP8 layers inside captured decode graphs (activation quantization, scaled GEMMs) decode as eager steps do."""
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    config = ServingConfig(model=ModelConfig(path=str(fp8_dirs[(fmt, static)])))
    prompts = [_ids(20 + 7 * i, seed=10 + i).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    graphed = LLMEngine(config, device="cuda")
    out = graphed.generate(prompts, params)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.replays > 0
    assert weight_format_of(graphed.model) == fmt
    assert out == LLMEngine(config, device="cuda", enforce_eager=True).generate(prompts, params)
