"""Our decoder model code gives the logits `transformers` gives, for the tiny
Qwen3 model and for Llama configs, in prefill and in step-by-step decode; bad
configs and checkpoints are refused with the problem named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvserving.worker.model import DenseCausalAttention, ModelArgs, dense_causal_attention, load_model

TOL = 1e-4  # fp32, max abs difference of logits


def _hf_prefill_and_decode(hf: torch.nn.Module, ids: torch.Tensor, n_prefill: int) -> list[torch.Tensor]:
    """Logits of transformers' model: [prefill rows, then one row per decode step]."""
    with torch.no_grad():
        out = hf(ids[None, :n_prefill], use_cache=True)
        rows = [out.logits[0]]
        cache = out.cache  # transformers' own KV cache (named past_key_values before 5.x)
        for t in range(n_prefill, len(ids)):
            out = hf(ids[None, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0])
    return rows


def _ours_prefill_and_decode(model: torch.nn.Module, ids: torch.Tensor, n_prefill: int) -> list[torch.Tensor]:
    attn = DenseCausalAttention()
    rows = [model.compute_logits(model(ids[:n_prefill], torch.arange(n_prefill), attn))]
    for t in range(n_prefill, len(ids)):
        rows.append(model.compute_logits(model(ids[t : t + 1], torch.tensor([t]), attn)))
    assert attn.num_tokens(layer=0) == len(ids)
    return rows


def _assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.dtype == torch.float32 and a.shape == b.shape, step
        diff = (a - b.float()).abs().max().item()
        assert diff < TOL, f"step {step}: max abs diff {diff}"


def _ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_tiny_model_prefill_logits_match_transformers(tiny_model_dir: Path) -> None:
    args, model = load_model(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = _ids(40, args.vocab_size)
    _assert_close(_ours_prefill_and_decode(model, ids, 40), _hf_prefill_and_decode(hf, ids, 40))


def test_tiny_model_step_by_step_decode_matches_transformers(tiny_model_dir: Path) -> None:
    args, model = load_model(tiny_model_dir)
    assert (args.model_type, args.qk_norm, args.tie_word_embeddings) == ("qwen3", True, False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = _ids(24, args.vocab_size, seed=2)
    _assert_close(_ours_prefill_and_decode(model, ids, 9), _hf_prefill_and_decode(hf, ids, 9))


def test_chunked_prefill_equals_one_prefill(tiny_model_dir: Path) -> None:
    _, model = load_model(tiny_model_dir)
    ids = _ids(30, 4096, seed=3)
    whole = model(ids, torch.arange(30), DenseCausalAttention())
    attn = DenseCausalAttention()
    parts = [model(ids[a:b], torch.arange(a, b), attn) for a, b in ((0, 7), (7, 20), (20, 30))]
    assert (torch.cat(parts) - whole).abs().max().item() < 1e-5


FAMILY_CASES = {
    "llama-untied-default-rope": ("llama", {}),
    "llama-tied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "max_position_embeddings": 512,
        },
    ),
    "llama-biases-linear-rope": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "qwen2-qkv-bias": ("qwen2", {}),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_other_families_match_transformers(tmp_path: Path, case: str) -> None:
    """A tiny random Llama (or Qwen2), saved by transformers itself, loads into our code."""
    model_type, extra = FAMILY_CASES[case]
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = classes[model_type]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        **extra,
    )
    hf = model_cls(config).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    args, model = load_model(tmp_path)
    assert args.model_type == model_type and not args.qk_norm and args.head_dim == 16
    assert args.tie_word_embeddings == config.tie_word_embeddings
    llama_bias = bool(getattr(config, "attention_bias", False))
    assert (args.qkv_bias, args.o_bias) == ((True, False) if model_type == "qwen2" else (llama_bias, llama_bias))
    ids = _ids(70, 300)  # past original_max_position_embeddings of the llama3 case
    _assert_close(_ours_prefill_and_decode(model, ids, 60), _hf_prefill_and_decode(hf, ids, 60))


def test_eos_ids_join_config_and_generation_config(tiny_model_dir: Path) -> None:
    args, _ = load_model(tiny_model_dir)
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert args.eos_token_ids == tuple(generation["eos_token_id"])  # <|im_end|> then <|endoftext|>


def test_dense_causal_attention_matches_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, h, 16, generator=g) for h in (8, 2, 2))
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(4, 1).transpose(0, 1),
        v.repeat_interleave(4, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert (dense_causal_attention(q, k, v) - ref).abs().max().item() < 1e-5
    # The last 3 queries over all 10 keys equal the last 3 rows of the full result.
    assert (dense_causal_attention(q[7:], k, v) - ref[7:]).abs().max().item() < 1e-5


def test_bf16_load_keeps_logits_fp32(tiny_model_dir: Path) -> None:
    _, model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.inv_freq.dtype == torch.float32
    _, ref_model = load_model(tiny_model_dir)
    ids = _ids(16, 4096)
    logits = model.compute_logits(model(ids, torch.arange(16), DenseCausalAttention()))
    ref = ref_model.compute_logits(ref_model(ids, torch.arange(16), DenseCausalAttention()))
    assert logits.dtype == torch.float32 and (logits - ref).abs().max().item() < 0.1


def test_logits_written_into_a_buffer_equal_the_returned_ones(tiny_model_dir: Path) -> None:
    """``compute_logits(out=)`` (the CUDA-graph decode's static buffer) widens the bf16 logits into the buffer
    itself: the same values as the fp32 tensor it returns otherwise, the buffer returned, its other rows untouched."""
    _, model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    hidden = model(_ids(6, 4096), torch.arange(6), DenseCausalAttention())
    buf = torch.full((8, model.embed_tokens.weight.shape[0]), -7.0)
    got = model.compute_logits(hidden, out=buf[:6])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:6], model.compute_logits(hidden))
    assert bool((buf[6:] == -7.0).all())


# --- bad input ---------------------------------------------------------------------


def _copy_model(src: Path, dst: Path, *, config_edit: dict | None = None, drop: str | None = None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    for key, value in (config_edit or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    if drop:
        del tensors[drop]
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"model_type": "gpt2"}, "gpt2"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_bad_config_is_refused_naming_the_field(tiny_model_dir: Path, tmp_path: Path, edit: dict, message: str) -> None:
    bad = _copy_model(tiny_model_dir, tmp_path / "bad", config_edit=edit)
    with pytest.raises(ValueError, match=message):
        load_model(bad)


def test_missing_tensor_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = _copy_model(tiny_model_dir, tmp_path / "bad", drop="model.layers.2.self_attn.k_norm.weight")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_norm\.weight"):
        load_model(bad)


def test_wrong_architecture_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A Qwen3 checkpoint labelled llama: the q/k-norm tensors are unknown to Llama.
    bad = _copy_model(tiny_model_dir, tmp_path / "bad", config_edit={"model_type": "llama"})
    with pytest.raises(ValueError, match="does not use: model.layers.0.self_attn.k_norm.weight"):
        load_model(bad)


def test_shape_mismatch_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = _copy_model(tiny_model_dir, tmp_path / "bad", config_edit={"intermediate_size": 256})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        load_model(bad)


def test_missing_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_model_args_validate_themselves() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        ModelArgs(
            model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=3
        )
    with pytest.raises(ValueError, match="num_layers"):
        ModelArgs(
            model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=0, num_heads=2, num_kv_heads=1, head_dim=4
        )


def test_hf_state_dict_gives_back_the_checkpoint(tiny_model_dir: Path) -> None:
    """The merged q/k/v and gate/up weights split back into exactly the checkpoint's tensors."""
    _, model = load_model(tiny_model_dir)
    assert "layers.0.self_attn.qkv_proj.weight" in dict(model.named_parameters())
    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    ours = model.hf_state_dict()
    assert sorted(ours) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(ours[name], tensor.float()), name


def _forced_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the model's fused Triton kernels on CPU tensors (TRITON_INTERPRET=1) instead of the references."""
    from kvserving.kernels import triton_norm
    from kvserving.worker import model as model_module

    def fused(x: torch.Tensor, *others: torch.Tensor | None) -> object:
        same = all(t is None or t.dtype == x.dtype for t in others)
        return triton_norm if same and not torch.is_grad_enabled() else None

    monkeypatch.setattr(model_module, "_fused", fused)


def _decode_rows(model: torch.nn.Module, ids: torch.Tensor, n_prefill: int) -> list[torch.Tensor]:
    with torch.inference_mode():
        return _ours_prefill_and_decode(model, ids, n_prefill)


@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="CPU-tensor kernel tests need TRITON_INTERPRET=1"
)
def test_fused_kernels_give_the_reference_logits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole bf16 model with the Triton kernels (interpreted: slow, so a prefill and one decode step)
    against the torch references: within 2% of the logits' scale (the kernels round where the references
    do; only last-bit differences of rsqrt/exp and the sum order flip a bf16 rounding here and there)."""
    _, model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    ids = _ids(8, 4096, seed=5)
    ref = _decode_rows(model, ids, 7)
    _forced_kernels(monkeypatch)
    fused = _decode_rows(model, ids, 7)
    scale = max(r.abs().max().item() for r in ref)
    diff = max((a - b).abs().max().item() for a, b in zip(fused, ref, strict=True))
    assert diff < 0.02 * scale, (diff, scale)
    assert [r.argmax(-1).tolist() for r in fused] == [r.argmax(-1).tolist() for r in ref]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_model_on_cuda_matches_the_reference_path(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserving.worker import model as model_module

    for dtype, bound in ((torch.float32, TOL), (torch.bfloat16, 0.02)):
        _, model = load_model(tiny_model_dir, dtype=dtype, device="cuda")
        ids = _ids(40, 4096, seed=6).cuda()
        attn = DenseCausalAttention()
        with torch.inference_mode():
            fused = model.compute_logits(model(ids, torch.arange(40, device="cuda"), attn))
            with monkeypatch.context() as m:
                m.setattr(model_module, "_fused", lambda *_: None)
                ref = model.compute_logits(model(ids, torch.arange(40, device="cuda"), DenseCausalAttention()))
        scale = ref.abs().max().item() if dtype == torch.bfloat16 else 1.0
        assert (fused - ref).abs().max().item() < bound * scale, dtype


def test_product_takes_the_block_gemm_only_in_a_graph_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """``product``'s dispatch where the Triton kernels run the call (a stand-in module records which ran): the GEMV at
    1-2 tokens always; the bf16 block GEMM at 3-64 tokens only inside ``graph_pass`` (run eagerly its launches' host
    time costs more than it saves), where ``bf16_launch`` has a launch; cuBLAS otherwise and above 64 tokens."""
    from types import SimpleNamespace

    from kvserving.worker import model

    ran: list[str] = []

    def kernel(name: str, value: float):  # type: ignore[no-untyped-def]
        def run(x: torch.Tensor, w: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
            ran.append(name)
            return torch.full((x.shape[0], w.shape[0]), value, dtype=x.dtype)

        return run

    fake = SimpleNamespace(gemv=kernel("gemv", 1.0), bf16_gemm=kernel("bf16_gemm", 2.0))
    monkeypatch.setattr(model, "_gemv_for", lambda x, w: fake if x.shape[0] <= model.BF16_BLOCK_ROWS else None)
    monkeypatch.setattr(model, "bf16_launch", lambda m, n, k: None if n == 6 else "tiles")
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    got = {}
    for in_graph in (False, True):
        for m in (1, 2, 3, 64, 65):
            ran.clear()
            x = torch.randn(m, 16, dtype=torch.bfloat16)
            if in_graph:
                with model.graph_pass():
                    out = model.product(x, w)
            else:
                out = model.product(x, w)
            got[in_graph, m] = ran[0] if ran else "cublas"
            if not ran:
                assert torch.equal(out, F.linear(x, w))
        ran.clear()
        with model.graph_pass():
            model.product(torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(6, 16, dtype=torch.bfloat16))
        assert ran == []  # no launch for this shape: cuBLAS
    assert got == {
        (False, 1): "gemv", (False, 2): "gemv", (False, 3): "cublas", (False, 64): "cublas", (False, 65): "cublas",
        (True, 1): "gemv", (True, 2): "gemv", (True, 3): "bf16_gemm", (True, 64): "bf16_gemm", (True, 65): "cublas",
    }  # fmt: skip
    assert not model._GRAPH_PASS.get()  # the pass ends with its block
