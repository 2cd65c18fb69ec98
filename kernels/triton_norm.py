"""Fused Triton kernels for the decoder's elementwise steps: RMSNorm (+ residual add), q/k-norm + RoPE, SiLU * up.

Each replaces several torch elementwise kernels per call (the fp32 RMSNorm alone is ~7) with one launch, for the
decode step under CUDA graphs where launches, not bytes, set the time. The arithmetic follows the references in
``norm_ref`` including where they round to the activation dtype (so bf16 results differ from them only by the order
of the sum of squares and the last bit of ``rsqrt`` / ``exp``)::

    rms_norm       x [T, N]                  -> w * round(x * rsqrt(mean(x^2) + eps))        (fp32 inside)
    add_rms_norm   x, residual [T, N]        -> (rms_norm(h), h),  h = round(residual + x)
    qk_norm_rope   qkv [T, (H + 2 Hkv) * D]  -> q [T, H, D], k [T, Hkv, D] (per head: norm, then rotate), v copied
    silu_mul       gate_up [T, 2 I]          -> round(silu(gate)) * up  [T, I]

Shapes are static per call and nothing reads back to the host, so the kernels run inside CUDA graphs. Each
takes ``pdl``: launched with programmatic dependent launch (``triton_pdl``), it reads its weights while the
kernel before it drains; ``None`` asks the environment (``triton_pdl.resolve``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import triton_elementwise, triton_pdl
from .triton_elementwise import rounded

MAX_NORM_WIDTH = 65536  # one program normalises one whole row in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N] input rows (last dim contiguous)
    res_ptr,  # [T, N] residual rows (HAS_RES) or x_ptr
    w_ptr,  # [N] norm weight
    out_ptr,  # [T, N] normalised output (dtype of weight * x)
    res_out_ptr,  # [T, N] residual + x (HAS_RES) or out_ptr
    x_stride,  # row strides, in elements
    res_stride,
    out_stride,
    res_out_stride,
    n,  # row width N
    eps,  # float: added to the mean square
    HAS_RES: tl.constexpr,  # add the residual first and write the sum
    BLOCK: tl.constexpr,  # next power of two >= N
    PDL: tl.constexpr,  # programmatic dependent launch: triton_pdl.mode (OFF, EARLY, LATE)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    triton_pdl.start(PDL)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel of the step writes it
    triton_pdl.wait(PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = rounded(r.to(tl.float32) + x.to(tl.float32), x.dtype).to(x.dtype)  # h = residual + x, rounded
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = rounded(xf * inv, x.dtype)  # rounded to the activation dtype, as the reference
    dt_out = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * out_stride + cols, rounded(w * normed, dt_out).to(dt_out), mask=mask)


@triton.jit
def _rope_half(x1, x2, c_ptr, s_ptr, offs, mask, HALF: tl.constexpr):
    """Rotated halves of one head: (x1 c1 - x2 s1, x2 c2 + x1 s2), each product and sum rounded to x's dtype."""
    dt = x1.dtype
    c1 = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    a1 = rounded(x1.to(tl.float32) * c1, dt)
    b1 = rounded(-(x2.to(tl.float32)) * s1, dt)
    a2 = rounded(x2.to(tl.float32) * c2, dt)
    b2 = rounded(x1.to(tl.float32) * s2, dt)
    return rounded(a1 + b1, dt).to(dt), rounded(a2 + b2, dt).to(dt)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, (H + 2 HKV) * D] fused projection output: q heads, k heads, v heads
    cos_ptr,  # [T, D] cos of the angles (each half-frequency twice), activation dtype
    sin_ptr,  # [T, D] sin, same layout
    qw_ptr,  # [D] q-norm weight (HAS_NORM) or any pointer
    kw_ptr,  # [D] k-norm weight (HAS_NORM) or any pointer
    q_ptr,  # [T, H, D] out: q normalised and rotated
    k_ptr,  # [T, HKV, D] out: k normalised and rotated
    v_ptr,  # [T, HKV, D] out: v copied
    qkv_stride,  # row stride of qkv, in elements
    cs_stride,  # row stride of cos / sin
    eps,  # float: added to the mean square of a head
    H: tl.constexpr,  # query heads
    HKV: tl.constexpr,  # key/value heads
    D: tl.constexpr,  # head_dim (even)
    HAS_NORM: tl.constexpr,  # Qwen3's per-head RMSNorm of q and k before RoPE
    BLOCK: tl.constexpr,  # next power of two >= D / 2
    PDL: tl.constexpr,  # programmatic dependent launch: triton_pdl.mode (OFF, EARLY, LATE)
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1 q, H..H+HKV-1 k, then v
    is_q = head < H
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    triton_pdl.start(PDL)
    if HAS_NORM:  # the q- or k-norm weight, read before the wait: no kernel of the step writes it
        w1 = tl.where(is_q, tl.load(qw_ptr + offs, mask=mask, other=0.0), tl.load(kw_ptr + offs, mask=mask, other=0.0))
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs, mask=mask, other=0.0),
                      tl.load(kw_ptr + HALF + offs, mask=mask, other=0.0))  # fmt: skip
    triton_pdl.wait(PDL)
    src = qkv_ptr + t * qkv_stride + head * D
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    if head >= H + HKV:
        dst = v_ptr + (t * HKV + (head - H - HKV)) * D
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + HALF + offs, x2, mask=mask)
    else:
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            inv = tl.math.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
            # weight * round(x / rms), rounded: the reference's bf16 product
            dt = x1.dtype
            x1 = rounded(w1.to(tl.float32) * rounded(f1 * inv, dt), dt).to(dt)
            x2 = rounded(w2.to(tl.float32) * rounded(f2 * inv, dt), dt).to(dt)
        o1, o2 = _rope_half(x1, x2, cos_ptr + t * cs_stride, sin_ptr + t * cs_stride, offs, mask, HALF)
        if is_q:
            dst = q_ptr + (t * H + head) * D
        else:
            dst = k_ptr + (t * HKV + (head - H)) * D
        tl.store(dst + offs, o1, mask=mask)
        tl.store(dst + HALF + offs, o2, mask=mask)


@triton.jit
def _silu_mul_kernel(
    gu_ptr,  # [T, 2 I] gate columns then up columns (last dim contiguous)
    out_ptr,  # [T, I] out
    gu_stride,  # row strides, in elements
    out_stride,
    inter,  # I
    BLOCK: tl.constexpr,  # columns per program
    PDL: tl.constexpr,  # programmatic dependent launch: triton_pdl.mode (OFF, EARLY, LATE)
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    g = tl.load(gu_ptr + t * gu_stride + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + t * gu_stride + inter + cols, mask=mask, other=0.0)
    dt_out = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * out_stride + cols, triton_elementwise.silu_mul(g, u, dt_out).to(dt_out), mask=mask)


def _rows(x: Tensor, what: str) -> Tensor:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{what} must have a non-empty last dimension, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def _norm_width(fn: str, x: Tensor, weight: Tensor) -> int:
    """N of x [..., N] when weight is [N] and N fits one program's block; ValueError naming ``fn`` otherwise."""
    n = x.shape[-1] if x.dim() else 0
    if weight.shape != (n,) or not 0 < n <= MAX_NORM_WIDTH:
        raise ValueError(f"{fn}: weight {tuple(weight.shape)} must be [N] for x {tuple(x.shape)}, N <= {MAX_NORM_WIDTH}")
    return n


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, pdl: bool | None = None) -> Tensor:
    """x: [..., N], weight: [N] -> [..., N] in the dtype of ``weight * x``."""
    n = _norm_width("rms_norm", x, weight)
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block, on = triton.next_power_of_2(n), triton_pdl.resolve(pdl, x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2, weight, out, out, x2.stride(0), x2.stride(0), out.stride(0), out.stride(0), n, float(eps),
            HAS_RES=False, BLOCK=block, num_warps=_warps(block), **triton_pdl.launch(on, x2.shape[0]),
        )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, pdl: bool | None = None) -> tuple[Tensor, Tensor]:
    """(rms_norm(residual + x), residual + x); x and residual [..., N] of one dtype, weight [N]."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    n = _norm_width("add_rms_norm", x, weight)
    x2, r2 = _rows(x, "x"), _rows(residual, "residual")
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty_like(x2)
    if x2.shape[0]:
        block, on = triton.next_power_of_2(n), triton_pdl.resolve(pdl, x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, h, x2.stride(0), r2.stride(0), out.stride(0), h.stride(0), n, float(eps),
            HAS_RES=True, BLOCK=block, num_warps=_warps(block), **triton_pdl.launch(on, x2.shape[0]),
        )  # fmt: skip
    return out.view(x.shape), h.view(x.shape)


def qk_norm_rope(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv: [T, (H + 2 Hkv) * D] -> contiguous q [T, H, D], k [T, Hkv, D] (normalised per head when both
    weights [D] are given, then rotated by cos/sin [T, D]) and v [T, Hkv, D]."""
    t = qkv.shape[0] if qkv.dim() == 2 else -1
    if t < 0 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)} must be [T, (H + 2 Hkv) * D] with H={num_heads}, "
                         f"Hkv={num_kv_heads}, even D={head_dim}")  # fmt: skip
    if cos.shape != (t, head_dim) or sin.shape != (t, head_dim):
        raise ValueError(f"qk_norm_rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [T, D] = {(t, head_dim)}")
    has_norm = q_weight is not None and k_weight is not None
    if has_norm and (q_weight.shape != (head_dim,) or k_weight.shape != (head_dim,)):  # type: ignore[union-attr]
        raise ValueError(f"qk_norm_rope: q/k-norm weights must be [D] = [{head_dim}]")
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos = cos if cos.stride(1) == 1 and cos.stride(0) == sin.stride(0) and sin.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 and sin.stride(0) == cos.stride(0) else sin.contiguous()
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if t:
        block, on = triton.next_power_of_2(head_dim // 2), triton_pdl.resolve(pdl, qkv.device)
        _qk_norm_rope_kernel[(t, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, q_weight if has_norm else qkv, k_weight if has_norm else qkv, q, k, v,
            qkv.stride(0), cos.stride(0), float(eps),
            H=num_heads, HKV=num_kv_heads, D=head_dim, HAS_NORM=has_norm, BLOCK=block, num_warps=1,
            **triton_pdl.launch(on, t),
        )  # fmt: skip
    return q, k, v


def silu_mul(gate_up: Tensor, *, pdl: bool | None = None) -> Tensor:
    """gate_up: [T, 2 I] (gate, then up) -> silu(gate) * up [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2 I], got {tuple(gate_up.shape)}")
    gu = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    t, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    if t:
        block = min(1024, triton.next_power_of_2(inter))
        on = triton_pdl.resolve(pdl, gu.device)
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, out, gu.stride(0), out.stride(0), inter, BLOCK=block,
                                                         num_warps=4, **triton_pdl.launch(on, t))  # fmt: skip
    return out
