"""Torch references for the decoder's elementwise steps that ``triton_norm`` fuses: RMSNorm (optionally after a
residual add), per-head q/k RMSNorm + RoPE on a fused q/k/v projection, and SiLU(gate) * up.

These are the model's own arithmetic (Hugging Face's rounding: normalise in fp32, round to the activation dtype,
scale by the weight in that dtype; RoPE as ``x * cos + rotate(x) * sin`` in the activation dtype). The model runs
them on CPU and whenever autograd needs them; on CUDA it runs the Triton kernels, held to these in tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., N], weight: [N] -> weight * (x / rms(x)) with the normalisation in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add in x's dtype, then the norm of the sum."""
    h = residual + x
    return rms_norm_ref(h, weight, eps), h


def apply_rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, D]; cos/sin: [T, D] (each half-frequency repeated twice).
    Rotates the pairs (x[i], x[i + D/2])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope_ref(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv: [T, (H + 2 Hkv) * D] (q heads, then k, then v) -> q [T, H, D], k/v [T, Hkv, D].

    q and k are RMS-normalised per head (when the weights [D] are given: Qwen3), then rotated; v is copied out."""
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return apply_rope_ref(q, cos, sin), apply_rope_ref(k, cos, sin), v.contiguous()  # as a v-only GEMM gives it


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """gate_up: [T, 2 I] (gate, then up) -> silu(gate) * up [T, I] (SwiGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
