"""KV bytes per token and tokens per GPU for each KV format (``kvserving capacity``).

Bytes per token count K and V of every layer and KV head with every scale
and zero byte the page layout stores (``kernels/layout.py``), per value:

    bf16       16 bits
    fp8_e4m3    8 bits                     (its fp32 scale is per layer, excluded)
    nvfp4       4 + 8/16   = 4.5 bits      (E4M3 block scale per 16 values) = 9/16 of fp8
    int4        4 + 2*16/32 = 5 bits       (fp16 scale + zero per 32 channels)
    int2        2 + 2*16/32 = 3 bits       (values: per 32 channels; keys: per channel
                                            over a 32-token page, the same 1 bit/value)
    triaxial   (1 - f) * int4 + f * int2   (f = fraction of tokens stored INT2)

Per-layer global scales (fp8, nvfp4) are per layer, not per token, so they are
excluded; the 16-byte alignment padding of page fields is excluded too (it is
zero for head_dim a multiple of 32 and page sizes of 16 or 32).

A bit budget B is the average code width on the 2/4-bit scale,
``B = 2 f + 4 (1 - f)``, so ``f = (4 - B) / 2``; B = 2.7 gives f = 0.65.

Weights share the GPU with the KV: with ``--weights FORMAT`` the budget is the GPU's memory
less the model's weights (``decode_weight_bytes`` plus the embedding table), per linear layer

    bf16        2 bytes per weight
    fp8         1 byte per weight + one fp32 scale per output row (merged q/k/v, gate/up keep
                each checkpoint tensor's own scale on its rows)
    fp8_block   1 byte per weight + one fp32 scale per 128x128 tile

Embedding, lm_head and norms stay in the model dtype, as FP8 checkpoints ship them.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

DTYPES = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")
# Stored bits per value, metadata included (see the module docstring).
_BITS_PER_VALUE = {"bf16": 16.0, "fp8_e4m3": 8.0, "nvfp4": 4.5}
INT4_BITS_PER_VALUE = 5.0
INT2_BITS_PER_VALUE = 3.0
_HEAD_DIM_MULTIPLE = {"bf16": 1, "fp8_e4m3": 1, "nvfp4": 16, "triaxial": 32}
WEIGHT_FORMATS = ("bf16", "fp8", "fp8_block")
WEIGHT_BLOCK = 128


def _positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def bytes_per_token(dtype: str, *, layers: int, kv_heads: int, head_dim: int, frac_int2: float = 0.0) -> float:
    """KV bytes one token occupies across all layers (K and V, scales and zeros included)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    _positive_int(layers, "layers")
    _positive_int(kv_heads, "kv_heads")
    _positive_int(head_dim, "head_dim")
    if head_dim % _HEAD_DIM_MULTIPLE[dtype]:
        raise ValueError(f"head_dim must be a multiple of {_HEAD_DIM_MULTIPLE[dtype]} for {dtype}, got {head_dim}")
    if not (isinstance(frac_int2, (int, float)) and 0.0 <= frac_int2 <= 1.0):
        raise ValueError(f"frac_int2 must be in [0, 1], got {frac_int2!r}")
    if frac_int2 and dtype != "triaxial":
        raise ValueError(f"frac_int2 applies only to triaxial, got {frac_int2} for {dtype}")
    if dtype == "triaxial":
        bits = (1.0 - frac_int2) * INT4_BITS_PER_VALUE + frac_int2 * INT2_BITS_PER_VALUE
    else:
        bits = _BITS_PER_VALUE[dtype]
    values = 2 * layers * kv_heads * head_dim  # K and V
    return values * bits / 8


def linear_weight_bytes(n: int, k: int, weight_format: str, *, dtype_bytes: int = 2) -> int:
    """Bytes of an [n, k] linear weight as stored (codes and scales; see the module docstring)."""
    if weight_format == "bf16":
        return n * k * dtype_bytes
    if weight_format == "fp8":
        return n * k + 4 * n
    if weight_format == "fp8_block":
        return n * k + 4 * math.ceil(n / WEIGHT_BLOCK) * math.ceil(k / WEIGHT_BLOCK)
    raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")


def decode_weight_bytes(
    *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
    weight_format: str, dtype_bytes: int = 2, qk_norm: bool = True, tie_word_embeddings: bool = False,
    qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False,
) -> int:  # fmt: skip
    """Weight bytes a decode step reads for a Llama/Qwen-style decoder: every layer's linear layers (merged
    q/k/v and gate/up), biases and norms, the final norm and the lm_head; not the embedding table (a lookup
    of a few rows), unless it is tied and so read whole as the lm_head."""
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = (
        linear_weight_bytes(q + 2 * kv, hidden, weight_format, dtype_bytes=dtype_bytes)
        + linear_weight_bytes(hidden, q, weight_format, dtype_bytes=dtype_bytes)
        + linear_weight_bytes(2 * intermediate, hidden, weight_format, dtype_bytes=dtype_bytes)
        + linear_weight_bytes(hidden, intermediate, weight_format, dtype_bytes=dtype_bytes)
    )
    small = 2 * hidden + (2 * head_dim if qk_norm else 0)  # the two norms, q/k-norm
    small += (q + 2 * kv) * qkv_bias + hidden * o_bias + (2 * intermediate + hidden) * mlp_bias
    return layers * (linears + small * dtype_bytes) + (hidden + vocab * hidden) * dtype_bytes


def model_weight_bytes(**shape: Any) -> int:
    """All weight bytes a GPU holds: ``decode_weight_bytes`` plus the embedding table when it is not tied."""
    extra = 0 if shape.get("tie_word_embeddings") else shape["vocab"] * shape["hidden"] * shape.get("dtype_bytes", 2)
    return decode_weight_bytes(**shape) + extra


def frac_int2_for_budget(bit_budget: float) -> float:
    """Fraction of INT2 tokens that makes the average code width ``bit_budget`` (2..4 bits)."""
    if not (isinstance(bit_budget, (int, float)) and 2.0 <= bit_budget <= 4.0):
        raise ValueError(f"bit_budget must be in [2, 4], got {bit_budget!r}")
    return (4.0 - bit_budget) / 2.0


def capacity_rows(
    *,
    gpu_bytes: int = 80 * 2**30,
    layers: int = 36,
    kv_heads: int = 8,
    head_dim: int = 128,
    bit_budget: float = 2.7,
) -> list[dict[str, Any]]:
    """One row per format: bytes/token, tokens fitting in ``gpu_bytes``, size ratios to bf16 and fp8."""
    _positive_int(gpu_bytes, "gpu_bytes")
    f = frac_int2_for_budget(bit_budget)
    shape = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    formats = [
        ("bf16", "bf16", 0.0),
        ("fp8_e4m3", "fp8_e4m3", 0.0),
        ("nvfp4", "nvfp4", 0.0),
        (f"triaxial {bit_budget:g}b", "triaxial", f),
        ("triaxial all-int4", "triaxial", 0.0),
        ("triaxial all-int2", "triaxial", 1.0),
    ]
    bf16 = bytes_per_token("bf16", **shape)
    fp8 = bytes_per_token("fp8_e4m3", **shape)
    rows = []
    for label, dtype, frac in formats:
        b = bytes_per_token(dtype, frac_int2=frac, **shape)
        rows.append(
            {
                "format": label,
                "dtype": dtype,
                "frac_int2": frac,
                "bits_per_value": b * 8 / (2 * layers * kv_heads * head_dim),
                "bytes_per_token": b,
                "tokens": math.floor(gpu_bytes / b),
                "vs_bf16": b / bf16,
                "vs_fp8": b / fp8,
            }
        )
    return rows


_COLUMNS = (
    ("format", "format", "{}"),
    ("bits/value", "bits_per_value", "{:.3f}"),
    ("bytes/token", "bytes_per_token", "{:.1f}"),
    ("tokens", "tokens", "{:,}"),
    ("vs bf16", "vs_bf16", "ratio"),
    ("vs fp8", "vs_fp8", "ratio"),
)


def _cell(value: Any, fmt: str) -> str:
    if fmt != "ratio":
        return fmt.format(value)
    # Up to 5 decimals without trailing zeros, so 9/16 prints as 0.5625.
    text = f"{value:.5f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def format_table(rows: list[dict[str, Any]]) -> str:
    """Aligned plain-text table of ``capacity_rows`` output (first column left, the rest right)."""
    cells = [[title for title, _, _ in _COLUMNS]]
    cells += [[_cell(row[key], fmt) for _, key, fmt in _COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


# Command-line bounds: a GPU's KV budget and a decoder's shape, generously.
MAX_GPU_GIB = 1 << 20  # 1 PiB
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_MODEL_DIM = 1 << 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-gib", type=float, default=80.0, help=f"KV memory budget in GiB, (0, {MAX_GPU_GIB}]")
    parser.add_argument("--layers", type=int, default=36, help=f"decoder layers, 1..{MAX_LAYERS}")
    parser.add_argument("--kv-heads", type=int, default=8, help=f"KV heads per layer, 1..{MAX_KV_HEADS}")
    parser.add_argument("--head-dim", type=int, default=128, help=f"head dim, 1..{MAX_HEAD_DIM}")
    parser.add_argument("--bit-budget", type=float, default=2.7, help="triaxial average bits, 2..4")
    parser.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default=None,
        help="--gpu-gib is the GPU's memory, and the model's weights in this format (shape: the "
        "flags above and below) take their share first; unset: --gpu-gib is all KV",
    )
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (with --weights)")
    parser.add_argument("--intermediate", type=int, default=12288, help="MLP intermediate size (with --weights)")
    parser.add_argument("--heads", type=int, default=32, help="query heads (with --weights)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary (with --weights)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag that is out of its bounds."""
    if not (math.isfinite(args.gpu_gib) and 0 < args.gpu_gib <= MAX_GPU_GIB):
        raise ValueError(f"--gpu-gib must be in (0, {MAX_GPU_GIB}], got {args.gpu_gib:g}")
    for flag, value, high in (
        ("--layers", args.layers, MAX_LAYERS),
        ("--kv-heads", args.kv_heads, MAX_KV_HEADS),
        ("--head-dim", args.head_dim, MAX_HEAD_DIM),
    ):
        if not 1 <= value <= high:
            raise ValueError(f"{flag} must be in 1..{high}, got {value}")
    for flag, value in (("--hidden", args.hidden), ("--intermediate", args.intermediate), ("--heads", args.heads),
                        ("--vocab", args.vocab)):  # fmt: skip
        if not 1 <= value <= MAX_MODEL_DIM:
            raise ValueError(f"{flag} must be in 1..{MAX_MODEL_DIM}, got {value}")


def kv_gpu_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """(KV bytes, weight bytes) of the command line: all of --gpu-gib, or what the weights leave of it."""
    total = max(1, int(args.gpu_gib * 2**30))
    if args.weights is None:
        return total, 0
    weights = model_weight_bytes(
        layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, vocab=args.vocab, weight_format=args.weights,
    )  # fmt: skip
    if weights >= total:
        raise ValueError(f"the {args.weights} weights ({weights / 2**30:.2f} GiB) do not fit --gpu-gib {args.gpu_gib:g}")
    return total - weights, weights


def run(args: argparse.Namespace) -> int:
    try:
        check_arguments(args)
        kv_bytes, weights = kv_gpu_bytes(args)
        rows = capacity_rows(
            gpu_bytes=kv_bytes,
            layers=args.layers,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            bit_budget=args.bit_budget,
        )
    except ValueError as exc:
        print(f"kvserving capacity: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"KV cache per token: {args.layers} layers x {args.kv_heads} KV heads x head_dim {args.head_dim}, "
        f"K and V; tokens in {args.gpu_gib:g} GiB"
        + ("" if args.weights is None else f" less {weights / 2**30:.2f} GiB of {args.weights} weights ({kv_bytes / 2**30:.2f} GiB of KV)")
    )
    print(format_table(rows))
    return 0
