"""Decoder model code for the Llama, Qwen2 and Qwen3 families (RMSNorm, RoPE,
GQA, SwiGLU, q/k-norm for Qwen3), loaded from Hugging Face safetensors by name.

Attention is not computed here: each layer hands its q/k/v to an
`AttentionOp` that the caller passes to `forward`. The engine plugs in its
paged-KV backend; `DenseCausalAttention` is the simple one-sequence op for
tests and scripts. Tokens are a flat batch `[T]` (no padding): the op knows,
from metadata the caller set before `forward`, which sequence and position
each token belongs to.

    args, model = load_model("tiny/")
    attn = DenseCausalAttention()
    hidden = model(ids, torch.arange(len(ids)), attn)   # prefill
    logits = model.compute_logits(hidden[-1:])           # [1, vocab] fp32

Launches per layer are what a CUDA-graph decode step pays for, so the
projections are merged (q/k/v into one `qkv_proj`, gate/up into one
`gate_up_proj`: one GEMM each, concatenated at load from the checkpoint's
separate tensors) and, on CUDA, the elementwise steps are fused Triton
kernels (`kernels.triton_norm`): RMSNorm with the residual add, q/k-norm +
RoPE, SiLU * up. On CPU, and where autograd needs gradients, the same steps
run as the torch references (`kernels.norm_ref`). The bf16 projections run
cuBLAS, or at 1-2 tokens the Triton GEMV (`product`; the down projection forms
SiLU * up itself, `gated_product`) and at 3-64 tokens, in the CUDA-graph decode,
the Triton block GEMM (`KVSERVING_BF16_GEMV=0` keeps cuBLAS): they read those
weights closer to the memory's limit than cuBLAS does at those sizes
(docs/results.md).

Weights are the model dtype's, or FP8 (`weight_format` "fp8": a scale per
tensor, "fp8_block": a scale per 128x128 tile; `worker.fp8_linear`): an FP8
checkpoint says so in config.json's `quantization_config` and loads as it is;
a bf16 checkpoint or the dummy weights asked for FP8 are quantized at load.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserving.kernels.capacity import decode_weight_bytes
from kvserving.kernels.gemm_plan import bf16_launch
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.norm_ref import add_rms_norm_ref, qk_norm_rope_ref, rms_norm_ref, silu_mul_ref
from kvserving.worker.fp8_linear import Fp8Linear, checkpoint_fp8_layers, checkpoint_fp8_state, quantize_layers
from kvserving.worker.weights import (
    WEIGHT_FORMATS,
    Fp8Scheme,
    load_tensors,
    read_config,
    read_generation_config,
    read_quantization,
    weight_files,
)

# model_type -> what differs between the families. Llama and Qwen3 put a
# bias on q/k/v/o when the config's `attention_bias` says so; Qwen2 always has
# one on q/k/v and never on o; Qwen3 RMS-normalises each head of q and k.
FAMILIES: dict[str, dict[str, bool]] = {
    "llama": {"qk_norm": False, "fixed_qkv_bias": False},
    "qwen2": {"qk_norm": False, "fixed_qkv_bias": True},
    "qwen3": {"qk_norm": True, "fixed_qkv_bias": False},
}
# Merged projections: our module -> the Hugging Face modules whose weights (and biases) it stacks along dim 0.
MERGED: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# The linear layers of each decoder layer: what an FP8 checkpoint stores in FP8 (embedding, lm_head and norms
# stay in the model dtype, as published FP8 checkpoints keep them).
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(slots=True)
class ModelArgs:
    """The architecture, read from a Hugging Face config.json (`from_config`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE, else a dict with "rope_type" in ("linear", "llama3") and its parameters.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_TYPES[1:]:
                raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: None, linear, llama3)")
            keys = ("factor",) if kind == "linear" else LLAMA3_ROPE_KEYS
            for key in keys:
                if not isinstance(self.rope_scaling.get(key), int | float):
                    raise ValueError(f"rope_scaling ({kind}) needs a number for {key!r}")

    @classmethod
    def from_config(cls, config: dict[str, Any], *, generation_config: dict[str, Any] | None = None) -> ModelArgs:
        """Map Hugging Face config.json fields; ValueError names what is missing or wrong.
        End-of-sequence ids are the union of config.json's and generation_config.json's."""
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"config.json lacks {key!r}")
            return config[key]

        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window is not supported")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = config.get("head_dim")
        if head_dim is None:  # Llama configs often leave it implicit
            head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else 0
        theta, scaling = _rope_from_config(config)
        eos_ids: list[int] = []
        for source in (config, generation_config or {}):
            eos = source.get("eos_token_id")
            for token in eos if isinstance(eos, list) else [] if eos is None else [eos]:
                if token not in eos_ids:
                    eos_ids.append(int(token))
        family = FAMILIES[model_type]
        bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=family["qk_norm"],
            qkv_bias=True if family["fixed_qkv_bias"] else bias,
            o_bias=False if family["fixed_qkv_bias"] else bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            eos_token_ids=tuple(eos_ids),
        )


def _rope_from_config(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or the
    older `rope_theta` + `rope_scaling` pair."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if kind in (None, "default"):
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, scaling


def rope_inv_freq(args: ModelArgs, *, device: str | torch.device = "cpu") -> Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with the config's scaling."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth
    # blend in between (wavelengths measured against the original context).
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class AttentionOp(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] for the
        T tokens of this forward (RoPE and q/k-norm applied); returns
        [T, num_heads, head_dim]. The op stores k/v as it needs and knows
        which sequence/position each token is from metadata set beforehand."""
        ...


class DenseCausalAttention:
    """AttentionOp for ONE sequence whose tokens arrive in position order:
    each call appends that layer's k/v to an internal list and attends
    causally over everything so far (GQA, fp32 softmax). Enough for prefill
    followed by step-by-step decode in tests and scripts."""

    def __init__(self) -> None:
        self._k: dict[int, Tensor] = {}  # layer -> [S, num_kv_heads, head_dim]
        self._v: dict[int, Tensor] = {}

    def num_tokens(self, layer: int = 0) -> int:
        return 0 if layer not in self._k else self._k[layer].shape[0]

    def reset(self) -> None:
        self._k.clear()
        self._v.clear()

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer in self._k:
            k = torch.cat([self._k[layer], k])
            v = torch.cat([self._v[layer], v])
        self._k[layer], self._v[layer] = k, v
        return dense_causal_attention(q, k, v)


def dense_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """q: [T, H, D] are the last T of the S positions of k/v: [S, Hkv, D].
    Query i sees keys 0..S-T+i. Returns [T, H, D] in q's dtype."""
    t, heads, d = q.shape
    s, kv_heads, _ = k.shape
    group = heads // kv_heads
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) / math.sqrt(d)  # [H, T, S]
    visible = torch.arange(s, device=q.device)[None, :] <= torch.arange(s - t, s, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf  # [H, T, D]
    return out.transpose(0, 1).to(q.dtype)


@functools.cache
def _triton_norm() -> ModuleType:
    from kvserving.kernels import triton_norm  # Triton loads on first CUDA use only

    return triton_norm


def _fused(x: Tensor, *others: Tensor | None) -> ModuleType | None:
    """The fused kernels' module when they can run this call: CUDA, one dtype, no gradient to track."""
    if not x.is_cuda or any(t is not None and t.dtype != x.dtype for t in others):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in others)):
        return None
    return _triton_norm()


@functools.cache
def _gemv_kernels(device: torch.device) -> ModuleType | None:
    """``kernels.triton_fp8_gemm`` when a bf16 weight's product at 1-64 tokens runs its kernels on ``device`` (unless
    ``KVSERVING_BF16_GEMV=0``; the environment read once per device), else None (cuBLAS)."""
    if not KernelOptions.from_env().bf16_gemv or device.type != "cuda":
        return None
    from kvserving.kernels import triton_fp8_gemm  # Triton loads on first CUDA use only

    return triton_fp8_gemm


BF16_GEMV_ROWS = 2  # the most tokens a bf16 product gives the GEMV (its fp32 sums per row grow with M)
# the most tokens a bf16 product gives the Triton block GEMM (bf16_tile_config's one program an SM): on an H100 it
# reads the Qwen3-8B projections about as fast as cuBLAS at 24-64 tokens alone (one layer 0.99-1.04x) and faster
# at 8-16, and in the engine's step, where its PDL launch overlaps the kernel before it, the step is 1-3 % shorter
# at 24-64 sequences (docs/performance-log/engine-gpu.md); above 64 cuBLAS is faster
BF16_BLOCK_ROWS = 64

# Set while the CUDA-graph decode runs its forward (the eager run before each capture, and the capture): there a
# Triton launch's host time is paid once. Run eagerly, the block GEMM's launches (~40 us of host time each, its
# partials' sum another) cost more than they save: on an H100 the engine's eager step at 64 x 4K took 36.9-37.3 ms
# with them against 29.3-29.5 with cuBLAS, its kernels 21.0 against 21.1 ms.
_GRAPH_PASS: contextvars.ContextVar[bool] = contextvars.ContextVar("graph_pass", default=False)


@contextlib.contextmanager
def graph_pass() -> Iterator[None]:
    """Forward passes inside run as the CUDA-graph decode's: ``product`` may take the bf16 block GEMM."""
    token = _GRAPH_PASS.set(True)
    try:
        yield
    finally:
        _GRAPH_PASS.reset(token)


def _gemv_for(x: Tensor, weight: Tensor) -> ModuleType | None:
    """The Triton kernels' module when they run ``x`` [T, *] times ``weight`` [N, K]: CUDA, bf16, T <= 64, K a
    multiple of 128, no gradient, and ``_gemv_kernels`` says so."""
    k = _gemv_kernels(x.device) if x.is_cuda else None
    if (k is None or x.dim() != 2 or x.shape[0] > BF16_BLOCK_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or weight.shape[1] % k.GROUP or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):  # fmt: skip
        return None
    return k


def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias) -> [T, N]: where the Triton kernels run this call (``_gemv_for``) the GEMV
    at T <= 2 and, in a CUDA graph's pass (``graph_pass``), at 3-64 tokens the bf16 block GEMM where its grid fills
    the SMs (``bf16_launch``), else ``F.linear`` (cuBLAS)."""
    k = _gemv_for(x, weight)
    if k is None:
        return F.linear(x, weight, bias)
    if x.shape[0] <= BF16_GEMV_ROWS:
        out = k.gemv(x, weight, None, out_dtype=x.dtype)
    elif _GRAPH_PASS.get() and (tiles := bf16_launch(x.shape[0], weight.shape[0], weight.shape[1])) is not None:
        out = k.bf16_gemm(x, weight, out_dtype=x.dtype, tiles=tiles)
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out + bias


def gated_product(gate_up: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """silu(gate) * up @ weight^T (+ bias) for gate_up [T, 2 I], weight [N, I], in one GEMV launch (the SwiGLU
    product formed in its registers, equal to ``silu_mul``'s bit for bit) where the GEMV runs it; else None."""
    k = _gemv_for(gate_up, weight)
    if k is None or gate_up.shape[0] > BF16_GEMV_ROWS or gate_up.shape[1] != 2 * weight.shape[1]:
        return None
    out = k.gemv(gate_up, weight, None, out_dtype=gate_up.dtype, gated=True)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """``nn.Linear`` through ``product``: the decoder's projections (cuBLAS, or the Triton kernels at 1-64 tokens)."""

    def forward(self, x: Tensor) -> Tensor:
        return product(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the model dtype (as Hugging Face does).
        k = _fused(x, self.weight)
        return rms_norm_ref(x, self.weight, self.eps) if k is None else k.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(residual + x), residual + x): the residual add and the next norm in one kernel."""
        k = _fused(x, residual, self.weight)
        if k is None:
            return add_rms_norm_ref(x, residual, self.weight, self.eps)
        return k.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.eps = args.rms_norm_eps
        # q, k, v stacked: one GEMM -> [T, (H + 2 Hkv) * D]
        self.qkv_proj = Linear(h, (args.num_heads + 2 * args.num_kv_heads) * d, bias=args.qkv_bias)
        self.o_proj = Linear(args.num_heads * d, h, bias=args.o_bias)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionOp) -> Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * D]
        qw = None if self.q_norm is None else self.q_norm.weight
        kw = None if self.k_norm is None else self.k_norm.weight
        # q [T, H, D], k/v [T, Hkv, D]: q/k-norm per head (Qwen3), then RoPE
        k = _fused(qkv, cos, sin, qw, kw)
        q, key, v = (qk_norm_rope_ref if k is None else k.qk_norm_rope)(
            qkv, cos, sin, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            q_weight=qw, k_weight=kw, eps=self.eps,
        )  # fmt: skip
        out = attn(layer, q, key, v)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, i, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_up_proj = Linear(h, 2 * i, bias=b)  # gate and up stacked: one GEMM -> [T, 2 I]
        self.down_proj = Linear(i, h, bias=b)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        fused = gated_product(gate_up, down.weight, down.bias) if isinstance(down, Linear) else None
        if fused is not None:  # the GEMV formed silu(gate) * up itself
            return fused
        k = _fused(gate_up)
        return self.down_proj(silu_mul_ref(gate_up) if k is None else k.silu_mul(gate_up))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, layer: int, x: Tensor, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionOp, next_norm: RMSNorm
    ) -> tuple[Tensor, Tensor]:
        """x = input_layernorm(h) (done by the previous layer's last add) -> (next_norm(h'), h'), h' this
        layer's output residual stream: each residual add runs with the norm after it."""
        x, h = self.post_attention_layernorm.add_forward(self.self_attn(layer, x, cos, sin, attn), h)
        return next_norm.add_forward(self.mlp(x), h)


class DecoderModel(nn.Module):
    """Parameter names are Hugging Face's without the leading "model."
    (`hf_name` maps them), so checkpoints load by name."""

    inv_freq: Tensor  # RoPE inverse frequencies, an fp32 buffer

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @staticmethod
    def hf_name(name: str) -> str:
        return name if name.startswith("lm_head.") else "model." + name

    def hf_tensors(self) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Our parameter name -> the Hugging Face tensors (name, shape) it is, stacked along dim 0 in order:
        one for most, q/k/v for `qkv_proj`, gate/up for `gate_up_proj`."""
        a = self.args
        q, kv, i = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
        rows = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (i, i)}
        out: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, param in self.named_parameters():
            module, _, leaf = name.rpartition(".")
            merged = next((m for m in MERGED if module.endswith("." + m)), None)
            if merged is None:
                out[name] = [(self.hf_name(name), tuple(param.shape))]
                continue
            base = module[: -len(merged)]
            out[name] = [(self.hf_name(f"{base}{part}.{leaf}"), (n, *param.shape[1:]))
                         for part, n in zip(MERGED[merged], rows[merged], strict=True)]  # fmt: skip
        return out

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The parameters under Hugging Face's names, merged projections split back (views)."""
        params = dict(self.named_parameters())
        state: dict[str, Tensor] = {}
        for name, parts in self.hf_tensors().items():
            pieces = params[name].split([shape[0] for _, shape in parts])
            state.update((hf, piece) for (hf, _), piece in zip(parts, pieces, strict=True))
        return state

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionOp) -> Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)  # [T, hidden]
        # Angles in fp32 whatever the model dtype: bf16 positions lose whole tokens past 256.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            x, h = layer(i, x, h, cos, sin, attn, layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm)
        return x

    def compute_logits(self, hidden: Tensor, *, out: Tensor | None = None) -> Tensor:
        """hidden: [N, hidden] (from `forward`) -> logits [N, vocab] in fp32; ``out`` [N, vocab] fp32: written there
        (and returned) by the widening copy itself, with no fp32 intermediate to copy again (at 64 rows of a 151,936
        vocabulary that copy is 39 MB each way)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)  # cuBLAS reads this wide weight at ~92 % of the read at batch 1
        return logits.float() if out is None else out.copy_(logits)


def resolve_weight_format(requested: str, stored: Fp8Scheme | None, *, where: str | Path) -> str:
    """The weight format to run: the checkpoint's ("auto"), or the one asked for. A bf16 checkpoint may be
    quantized to FP8 at load; an FP8 checkpoint runs only as it is stored (ValueError, one line, otherwise)."""
    have = "bf16" if stored is None else stored.weight_format
    if requested == "auto":
        return have
    if requested not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be 'auto' or one of {WEIGHT_FORMATS}, got {requested!r}")
    if stored is not None and requested != have:
        raise ValueError(f"model.weight_format {requested!r} does not match the checkpoint in {where}: "
                         f"its quantization_config stores {have} weights")  # fmt: skip
    return requested


def _linear(model: nn.Module, name: str) -> nn.Linear:
    module = model.get_submodule(name)
    assert isinstance(module, nn.Linear), name
    return module


def linear_parts(model: DecoderModel) -> dict[str, list[tuple[str, int]]]:
    """Each decoder linear layer (``layers.3.mlp.gate_up_proj``) -> its Hugging Face parts (module name, rows)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name, parts in model.hf_tensors().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.endswith(LINEARS):
            out[module] = [(hf.removesuffix(".weight"), shape[0]) for hf, shape in parts]
    return out


def weight_format_of(model: DecoderModel) -> str:
    """ "fp8" / "fp8_block" when the model's linear layers are FP8, else "bf16" (the model dtype)."""
    fp8 = {m.weight_format for m in model.modules() if isinstance(m, Fp8Linear)}
    return fp8.pop() if len(fp8) == 1 else "bf16"


def quantize_linears(model: DecoderModel, weight_format: str) -> DecoderModel:
    """Replace every decoder linear layer by its FP8 quantization (each checkpoint part per tensor, or 128x128
    tiles), in place, one layer at a time (the unquantized weight is freed as its layer is done)."""
    if weight_format != "bf16":
        quantize_layers(model, linear_parts(model), weight_format=weight_format)
    return model


def step_weight_bytes(model: DecoderModel) -> int:
    """Bytes of weights one decode step reads: every stored tensor but the embedding table (a lookup of a few
    rows; when tied, it is read whole as the lm_head and counted). FP8 layers count their codes and scales."""
    skip = {"embed_tokens.weight"} if model.lm_head is not None else set()
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if name not in skip)


def weight_bytes_per_step(args: ModelArgs, weight_format: str, *, dtype: torch.dtype = torch.bfloat16) -> int:
    """``step_weight_bytes`` of the model ``args`` describes in ``weight_format``, without building it (the
    roofline of a benchmark at real shape)."""
    return decode_weight_bytes(
        layers=args.num_layers, hidden=args.hidden_size, intermediate=args.intermediate_size, heads=args.num_heads,
        kv_heads=args.num_kv_heads, head_dim=args.head_dim, vocab=args.vocab_size, weight_format=weight_format,
        dtype_bytes=torch.empty((), dtype=dtype).element_size(), qk_norm=args.qk_norm,
        tie_word_embeddings=args.tie_word_embeddings, qkv_bias=args.qkv_bias, o_bias=args.o_bias, mlp_bias=args.mlp_bias,
    )  # fmt: skip


def load_model(
    model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    weight_format: str = "auto",
) -> tuple[ModelArgs, DecoderModel]:  # fmt: skip
    """Build the model from `model_dir`'s config.json and safetensors weights.

    ``weight_format`` "auto" runs the checkpoint's (FP8 when config.json's quantization_config says so);
    "fp8" / "fp8_block" quantize a bf16 checkpoint at load (``resolve_weight_format``).
    ValueError on an unsupported or incomplete config and on missing or
    unexpected tensor names (the message names them)."""
    config = read_config(model_dir)
    scheme = read_quantization(config)
    fmt = resolve_weight_format(weight_format, scheme, where=model_dir)
    args = ModelArgs.from_config(config, generation_config=read_generation_config(model_dir))
    with torch.device("meta"):
        model = DecoderModel(args)
    in_features = {m: _linear(model, m).in_features for m in linear_parts(model)}
    fp8_parts = {} if scheme is None else checkpoint_fp8_layers(model, linear_parts(model), scheme, set(weight_files(model_dir)))
    layout = model.hf_tensors()
    fp8_names = []
    for fp8_layer in fp8_parts.values():
        for hf, _ in fp8_layer:
            fp8_names += [f"{hf}.weight", f"{hf}.{scheme.scale_name}"]  # type: ignore[union-attr]
            fp8_names += [f"{hf}.input_scale"] if scheme.static_input else []  # type: ignore[union-attr]
    tensors = load_tensors(
        model_dir,
        [hf for parts in layout.values() for hf, _ in parts] + fp8_names,
        # Tied checkpoints sometimes store the copy anyway.
        optional=["lm_head.weight"] if args.tie_word_embeddings else [],
        dtype=dtype,
        device=device,
        stored_dtype=set(fp8_names),
    )
    state: dict[str, Tensor] = {}
    for name, parts in layout.items():
        pieces = []
        for hf, shape in parts:
            tensor = tensors.pop(hf)
            if tuple(tensor.shape) != shape:
                raise ValueError(f"tensor {hf} has shape {tuple(tensor.shape)}, config implies {shape}")
            pieces.append(tensor)
        state[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # q/k/v, gate/up: one weight each
    if scheme is not None:
        state.update(checkpoint_fp8_state(fp8_parts, tensors, scheme, in_features))
    model.load_state_dict(state, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(args, device=device)  # replaces the meta buffer; stays fp32
    model.requires_grad_(False)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.prepare()
    if scheme is None:
        quantize_linears(model, fmt)
    return args, model.eval()


@torch.no_grad()
def random_model(
    args: ModelArgs, *, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    weight_format: str = "bf16",
) -> DecoderModel:  # fmt: skip
    """The model of ``args`` with seeded random weights drawn on ``device``: N(0, 0.02)
    everywhere, norms 1 (vLLM's dummy load format); with ``weight_format`` "fp8" or
    "fp8_block" the linear layers' draws are then quantized (``quantize_linears``).

    Parameters are drawn in ``named_parameters`` order from one generator seeded with
    ``seed``, so processes on the same kind of device build the same weights."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    with torch.device("meta"):
        model = DecoderModel(args).to(dtype=dtype)  # meta: no memory until to_empty
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(args, device=device)
    return quantize_linears(model.requires_grad_(False).eval(), weight_format)


def load_dummy_model(
    model_dir: str | Path, *, seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    weight_format: str = "auto",
) -> tuple[ModelArgs, DecoderModel]:  # fmt: skip
    """The model `model_dir`'s config.json describes, with `random_model` weights: no
    weight file is read (real-shape benchmarks on a directory holding only config and tokenizer).
    ``weight_format`` "auto" follows config.json's quantization_config (FP8 when it has one)."""
    config = read_config(model_dir)
    fmt = resolve_weight_format(weight_format, read_quantization(config), where=model_dir)
    args = ModelArgs.from_config(config, generation_config=read_generation_config(model_dir))
    return args, random_model(args, seed=seed, dtype=dtype, device=device, weight_format=fmt)
