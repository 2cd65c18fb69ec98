"""FP8 E4M3 weights for linear layers: quantizers, the torch references, and the GPU GEMM dispatch.

Two weight layouts, as published FP8 checkpoints ship them (``config.json``'s
``quantization_config``, quant_method ``fp8``)::

    rows     w ~ q[n, k] * s[n]                one fp32 scale per output row. A checkpoint's
                                               per-tensor ``weight_scale`` is this with every row
                                               of a tensor sharing it; merged projections (q/k/v,
                                               gate/up) keep each part's scale on its rows.
    block    w ~ q[n, k] * s[n // 128, k // 128]  one fp32 scale per 128x128 tile
                                               (``weight_scale_inv``, ``weight_block_size: [128, 128]``)

Activations are quantized on the fly for the GPU GEMMs: per token (rows; or one static
``input_scale`` when the checkpoint has one) and per token per 128 channels (block), so
every K-step of 128 has one activation scale per row and one weight scale per tile:

    y[m, n] = sum_kb  sa[m, kb] * sw[n // 128, kb] * sum_{k in kb} qa[m, k] * qw[n, k]

Quantize: ``s = amax / 448`` (1 for an all-zero group), codes = E4M3(x / s), saturating at
±448, round to nearest even (torch's cast). E4M3 keeps 4 significant bits, so a value in the
normal range moves by at most 2^-4 of itself; below 2^-6 * s (subnormal codes) by at most
2^-10 * s. That gives the GPU GEMMs' bound against ``linear_ref`` (exact-weight, unquantized
activations, fp32): per output element

    |y - y_ref| <= sum_k (2^-4 |x_k| + 2^-10 s_k) |w_k|  +  2^-8 |y_ref|  (bf16 output rounding)
                   + fp32 accumulation (K * 2^-24 * sum |x_k w_k|, negligible)

plus, with a static ``input_scale``, all of the excess of a value past 448 * s (saturated).

(``gemm_error_bound``). The paths:

- ``linear_ref``: dequantize the weight, ``F.linear`` in the activation's dtype: the CPU
  path and the reference the model's logits are held to;
- ``linear_quantized_ref``: the GPU paths' arithmetic in fp32 torch (activations quantized
  the same way): the spec the kernels are tested against at tiny sizes;
- ``linear_cuda``: rows through ``torch._scaled_mm`` (row-wise scales, CUTLASS); block
  at M = 1, and at M = 2 on weights whose column tiles do not fill the GPU (``launch_config``), through our Triton GEMV,
  and at M = 3-4 on weights whose block GEMM splits K through our Triton block GEMM on the bf16 activations as they
  are (``a16``): both read the activations unquantized (``unquantized``: only the fp32 sums and the bf16 output
  round), else through ``torch.nn.functional.scaled_mm`` with BlockWise1x128 x
  BlockWise128x128 scales (cuBLASLt >= 12.9, sm_90 only) or our Triton block GEMM
  (``triton_fp8_gemm``; every other GPU, and on request).
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from .gemm_plan import Gemv, launch_config

E4M3_MAX = 448.0
BLOCK = 128  # the block-scaled layout's tile edge and the activation group
SCHEMES = ("rows", "block")
BLOCK_BACKENDS = ("auto", "cublas", "triton")
# The smallest scale a quantizer uses: an all-zero row or group gets scale 1 instead (codes 0).
_TINY = 1e-12


def _scale_of(amax: Tensor) -> Tensor:
    """fp32 scales amax / 448, 1 where amax is 0 (so a zero group dequantizes to zeros, never NaN)."""
    s = amax.float() / E4M3_MAX
    return torch.where(s > _TINY, s, torch.ones_like(s))


def to_e4m3(x: Tensor, scale: Tensor) -> Tensor:
    """fp32(x) / scale, saturated to ±448, rounded to E4M3 (nearest even)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# -- weights -----------------------------------------------------------------------------------------
def quantize_tensor(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (codes [N, K] e4m3, scale [] fp32): one scale for the tensor (a checkpoint's ``weight_scale``)."""
    scale = _scale_of(w.detach().abs().amax())
    return to_e4m3(w, scale), scale


def quantize_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> (codes [N, K] e4m3, scale [ceil(N/128), ceil(K/128)] fp32): one scale per 128x128 tile
    (a checkpoint's ``weight_scale_inv``: the factor that dequantizes, despite the name)."""
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = F.pad(w.detach().float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    tiles = padded.view(nb, BLOCK, kb, BLOCK)
    scale = _scale_of(tiles.abs().amax(dim=(1, 3)))  # [nb, kb]
    codes = to_e4m3(tiles, scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:n, :k]
    return codes.contiguous(), scale


def expand_blocks(scale: Tensor, n: int, k: int) -> Tensor:
    """Tile scales [ceil(N/128), ceil(K/128)] -> one scale per element [N, K]."""
    return scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]


def dequantize(codes: Tensor, scale: Tensor, *, scheme: str) -> Tensor:
    """The fp32 weight [N, K] that ``codes`` and ``scale`` (rows: [N]; block: [N/128, K/128]) stand for."""
    n, k = codes.shape
    if scheme == "rows":
        return codes.float() * scale.float().view(n, 1)
    if scheme == "block":
        return codes.float() * expand_blocks(scale, n, k)
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


# -- activations -------------------------------------------------------------------------------------
def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (codes [M, K], scale [M, 1] fp32): per token, dynamic."""
    scale = _scale_of(x.detach().abs().amax(dim=1, keepdim=True))
    return to_e4m3(x, scale), scale


def quantize_groups(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of 128) -> (codes [M, K], scale [M, K/128] fp32): per token per 128 channels."""
    m, k = x.shape
    groups = x.view(m, k // BLOCK, BLOCK)
    scale = _scale_of(groups.detach().abs().amax(dim=2))  # [M, K/128]
    return to_e4m3(groups, scale[:, :, None]).view(m, k), scale


def quantize_static(x: Tensor, input_scale: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] with the checkpoint's one ``input_scale`` -> (codes, scale [M, 1])."""
    scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return to_e4m3(x, scale), scale.contiguous()


def quantize_activations(
    x: Tensor, *, scheme: str, input_scale: Tensor | None = None, fused: bool = False, column_major: bool = False
) -> tuple[Tensor, Tensor]:
    """The GPU paths' activation quantization: (codes [M, K], scale [M, 1] rows or [M, K/128] block).
    ``fused``: one Triton launch (``triton_fp8_gemm.quantize``, the same rounding) instead of torch's ops,
    with ``column_major`` scales if asked (cuBLASLt's layout)."""
    if input_scale is not None and scheme == "rows":
        return quantize_static(x, input_scale)
    if fused:
        return _triton_gemm().quantize(x, group=BLOCK if scheme == "block" else None, column_major=column_major)
    return quantize_groups(x) if scheme == "block" else quantize_rows(x)


# -- references --------------------------------------------------------------------------------------
def linear_ref(x: Tensor, codes: Tensor, scale: Tensor, *, scheme: str, bias: Tensor | None = None) -> Tensor:
    """x [..., K] -> [..., N]: the weight dequantized, then ``F.linear`` in x's dtype (activations not quantized)."""
    return F.linear(x, dequantize(codes, scale, scheme=scheme).to(x.dtype), bias)


def linear_quantized_ref(
    x: Tensor, codes: Tensor, scale: Tensor, *, scheme: str, input_scale: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The GPU paths' arithmetic in fp32 torch: activations quantized as ``quantize_activations`` does, each
    128-wide K-step's product scaled by its activation and weight scales, summed in fp32. x [M, K] -> [M, N] fp32."""
    qa, sa = quantize_activations(x, scheme=scheme, input_scale=input_scale)
    if scheme == "rows":
        out = (qa.float() @ codes.float().t()) * sa * scale.float().view(1, -1)
    else:
        n, k = codes.shape
        sw = scale.float().repeat_interleave(BLOCK, 0)[:n]  # [N, K/128]
        a = qa.float().view(-1, k // BLOCK, BLOCK).transpose(0, 1)  # [K/128, M, 128]
        w = codes.float().view(n, k // BLOCK, BLOCK).transpose(0, 1)  # [K/128, N, 128]
        partial = a @ w.transpose(1, 2)  # [K/128, M, N]
        out = (partial * sa.t()[:, :, None] * sw.t()[:, None, :]).sum(0)
    return out if bias is None else out + bias.float()


def gemm_error_bound(x: Tensor, codes: Tensor, scale: Tensor, *, scheme: str, input_scale: Tensor | None = None) -> Tensor:
    """Per-element bound [M, N] on |GPU GEMM - linear_ref in fp32| (the module docstring's formula)."""
    _, sa = quantize_activations(x, scheme=scheme, input_scale=input_scale)
    k = x.shape[1]
    sa_full = sa.expand(-1, k) if scheme == "rows" else sa.repeat_interleave(BLOCK, 1)  # [M, K]
    w = dequantize(codes, scale, scheme=scheme).abs()
    xf = x.float().abs()
    # values past 448 * s (only with a static input scale) saturate: off by all of the excess
    act = 2.0**-4 * xf.minimum(E4M3_MAX * sa_full) + 2.0**-10 * sa_full + (xf - E4M3_MAX * sa_full).clamp(min=0)
    ref = (x.float() @ dequantize(codes, scale, scheme=scheme).t()).abs()
    accumulate = k * 2.0**-24 * (xf @ w.t())
    return act @ w.t() + 2.0**-8 * ref + accumulate


# -- GPU ---------------------------------------------------------------------------------------------
@functools.cache
def _triton_gemm() -> ModuleType:
    from kvserving.kernels import triton_fp8_gemm  # Triton loads on first use only

    return triton_fp8_gemm


def cublas_block_scales(scale: Tensor) -> Tensor:
    """Tile scales [N/128, K/128] -> the layout cuBLASLt's 128x128 weight scaling reads: [round_up(K/128, 4), N/128]
    with strides (1, round_up(K/128, 4)), the pad rows zero. Built once at load."""
    nb, kb = scale.shape
    l4 = (kb + 3) // 4 * 4
    padded = torch.zeros(nb, l4, dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale.float()
    return padded.t()


def _block_cublas(qa: Tensor, sa: Tensor, codes: Tensor, scale_cublas: Tensor, out_dtype: torch.dtype) -> Tensor:
    # scale_a: [M, K/128] with strides (1, M) (column-major), as cuBLASLt's 1x128 activation scaling reads it
    # (no copy when the quantizer wrote it so).
    sa_cm = sa.t().contiguous().t()
    return F.scaled_mm(
        qa, codes.t(), sa_cm, F.ScalingType.BlockWise1x128, scale_cublas, F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )  # fmt: skip


@functools.cache
def cublas_block_supported(device_index: int) -> bool:
    """Whether torch's cuBLASLt 1x128 x 128x128 scaled GEMM runs on this GPU (sm_90, cuBLASLt >= 12.9): one
    small GEMM tried eagerly, never inside a CUDA graph capture (the first FP8 forward is an eager warm-up)."""
    if torch.cuda.get_device_capability(torch.device("cuda", device_index))[0] != 9:
        return False
    try:
        out = cublas_block_probe(device_index)
        return bool(torch.allclose(out.float(), torch.full_like(out, 256.0, dtype=torch.float32)))
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def cublas_block_probe(device_index: int) -> Tensor:
    """The call ``cublas_block_supported`` tries: ones [3, 256] x ones [256, 256] through cuBLASLt's
    1x128 x 128x128 scaling (every output 256), raising what the library raises."""
    dev = torch.device("cuda", device_index)
    codes, scale = quantize_blocks(torch.ones(256, 256, device=dev))
    qa, sa = quantize_groups(torch.ones(3, 256, device=dev, dtype=torch.bfloat16))
    return _block_cublas(qa, sa, codes, cublas_block_scales(scale), torch.bfloat16)


def cuda_supported(x: Tensor) -> bool:
    """The GPU GEMMs run this call: a CUDA bf16 activation on a GPU with FP8 tensor cores (sm_89 and later)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 9)


def linear_cuda(
    x: Tensor, codes: Tensor, scale: Tensor, *, scheme: str, input_scale: Tensor | None = None,
    bias: Tensor | None = None, scale_cublas: Tensor | None = None, backend: str = "auto",
) -> Tensor:  # fmt: skip
    """x [M, K] bf16 (CUDA) -> [M, N] bf16. ``scale``: rows [N] or block [N/128, K/128] fp32;
    ``scale_cublas``: ``cublas_block_scales(scale)`` (block, built once at load); ``backend`` picks the block
    GEMM: "auto" (Triton where ``unquantized``, else cuBLASLt where it runs, else Triton's block GEMM), "cublas" or
    "triton" (the GEMV, the block GEMM on unquantized activations or the quantizer and the block GEMM, as
    ``gemm_plan.launch_config`` says)."""
    if backend not in BLOCK_BACKENDS:
        raise ValueError(f"backend must be one of {BLOCK_BACKENDS}, got {backend!r}")
    if scheme == "rows":
        qa, sa = quantize_activations(x, scheme=scheme, input_scale=input_scale, fused=True)
        # Row-wise scaled GEMM (both operands per row): scale_a [M, 1], scale_b [1, N]; B column-major.
        return torch._scaled_mm(qa, codes.t(), scale_a=sa, scale_b=scale.view(1, -1), bias=bias, out_dtype=x.dtype)
    if backend == "cublas" or (backend == "auto" and not unquantized(x.shape[0], codes.shape[0], x.shape[1])
                               and cublas_block_supported(x.device.index or 0)):  # fmt: skip
        qa, sa = quantize_activations(x, scheme=scheme, fused=True, column_major=True)
        out = _block_cublas(qa, sa, codes, cublas_block_scales(scale) if scale_cublas is None else scale_cublas, x.dtype)
    else:
        out = _triton_gemm().linear(x, codes, scale, out_dtype=x.dtype)  # the GEMV or the quantizer + block GEMM
    return out if bias is None else out + bias


def unquantized(m: int, n: int, k: int) -> bool:
    """Whether the block-scaled product of M tokens by an [N, K] weight runs Triton on the activations as they are
    (the GEMV, or the block GEMM's ``a16`` tiles) rather than an MMA GEMM on quantized activations:
    ``gemm_plan.launch_config``'s dispatch."""
    launch = launch_config(m, n, k)
    return isinstance(launch, Gemv) or launch.a16
