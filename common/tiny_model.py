"""The built-in tiny model: a Qwen3-style decoder with seeded random weights,
written locally in Hugging Face format (`kvserving tiny-model DIR`, whose command and FP8
checkpoints live in ``kvserving.worker.model_files``: quantizing needs the engine's kernels).

Nothing downloads. `transformers`' AutoTokenizer and AutoModelForCausalLM load
the directory unchanged; the worker's own model code (kvserving.worker.model)
loads it too, and the tests hold the two to each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvserving import tokenizer_data

if TYPE_CHECKING:
    import torch

# config.json of the tiny model: ~5.0M parameters (1M embedding, 1M untied
# lm_head, 0.7M per layer).
TINY_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": tokenizer_data.VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "float32",
}


# config.json at the Qwen3-8B shape (36 layers, 32 query / 8 KV heads of 128,
# MLP 12288) over the built-in tokenizer: its vocabulary (4,096) replaces
# Qwen3's 151,936, since ids past the tokenizer's would decode to nothing.
# Weights are never written: workers build them with ``model.load_format: dummy``.
QWEN3_8B_CONFIG: dict[str, object] = dict(
    TINY_CONFIG,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    torch_dtype="bfloat16",
)
SHAPES: dict[str, dict[str, object]] = {"tiny": TINY_CONFIG, "qwen3-8b": QWEN3_8B_CONFIG}


def random_weights(config: dict[str, object], *, seed: int = 0, std: float = 0.02, attn_std: float = 0.0675) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face's Qwen3 tensor names.

    Pure noise makes a poor test model: its next-token logits are nearly
    flat, so the top two often differ by ~0.001 of their spread and any
    rounding (a bf16 KV cache, another summation order) flips greedy tokens.
    So the weights carry a little structure, all drawn from `seed`:

    - embedding ~ N(0, 1): the residual stream starts at unit scale;
    - lm_head row v = std * embedding[perm[v]] + N(0, std) for a random
      permutation `perm`: a "bigram table" whose clear winner is the token
      that the permutation maps the current one to, so greedy decoding walks
      a long permutation cycle (neither collapsing onto one token nor tied);
    - q/k/v/o ~ N(0, attn_std), larger than the MLP's N(0, std), so earlier
      tokens move the logits (KV-cache mistakes show) without drowning
      the winner;
    - all norms 1.
    """
    import torch  # here, not at import: the gateway finds the cached model's tokenizer through this module

    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])  # type: ignore[call-overload]
    inter = int(config["intermediate_size"])  # type: ignore[call-overload]
    heads = int(config["num_attention_heads"])  # type: ignore[call-overload]
    kv_heads = int(config["num_key_value_heads"])  # type: ignore[call-overload]
    head_dim = int(config["head_dim"])  # type: ignore[call-overload]
    vocab = int(config["vocab_size"])  # type: ignore[call-overload]

    def normal(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    embed = normal(vocab, hidden, scale=1.0)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(int(config["num_hidden_layers"])):  # type: ignore[call-overload]
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden, scale=attn_std)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden, scale=attn_std)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden, scale=attn_std)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim, scale=attn_std)
        w[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
        w[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    w["model.norm.weight"] = torch.ones(hidden)
    if not config["tie_word_embeddings"]:
        perm = torch.randperm(vocab, generator=gen)
        w["lm_head.weight"] = embed[perm] * std + normal(vocab, hidden)
    return w


def build_tiny_model(out_dir: str | Path, *, seed: int = 0, shape: str = "tiny") -> Path:
    """Write config, weights, tokenizer and generation config to `out_dir`
    (created if missing; existing files of the same names are replaced).

    A ``shape`` other than "tiny" writes no weights: config and tokenizer only,
    for the dummy load format."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {sorted(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = tokenizer_data.train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(tokenizer_data.EOS_TOKEN)
    pad_id = tokenizer.token_to_id(tokenizer_data.PAD_TOKEN)
    _write_json(out / "tokenizer_config.json", tokenizer_data.tokenizer_config(tokenizer))

    config = dict(SHAPES[shape], bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": None,
            "eos_token_id": [eos_id, pad_id],
            "pad_token_id": pad_id,
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
        },
    )
    if shape == "tiny":
        from safetensors.torch import save_file

        save_file(random_weights(config, seed=seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
