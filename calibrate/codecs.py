"""The KV codecs calibration measures with, on whole prompts in fp32: the engine's
group and INT2-key quantizers applied and undone, and dense causal attention
over the result (the reference every distortion is measured against)."""

from __future__ import annotations

import math

import torch

from kvserving.kernels.intquant import dequantize_groups, dequantize_int2_keys, quantize_groups, quantize_int2_keys
from kvserving.worker.attention import causal_attention

PAGE = 32  # triaxial page: INT2 keys are quantized per channel over this many tokens


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of a whole prompt: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    return causal_attention(q, k, v, q_offset=0, sm_scale=1.0 / math.sqrt(q.shape[-1]))


def head_mse(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T, H, D] x2 -> MSE per head [H]."""
    return (out - ref).pow(2).mean(dim=(0, 2))


def qdq_groups(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x [T, H, D] through the per-token group codec at ``bits`` and back (fp32)."""
    return dequantize_groups(*quantize_groups(x, bits), bits, dtype=torch.float32)


def quantize_positions(k: torch.Tensor, v: torch.Tensor, idx4: torch.Tensor, idx2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v [T, H, D] fp32 with the positions ``idx4`` through INT4 and ``idx2`` through INT2 and back."""
    kq, vq = k.clone(), v.clone()
    if idx4.numel():
        kq[idx4], vq[idx4] = qdq_groups(k[idx4], 4), qdq_groups(v[idx4], 4)
    if idx2.numel():
        kq[idx2], vq[idx2] = qdq_int2_keys(k[idx2]), qdq_groups(v[idx2], 2)
    return kq, vq


def qdq_int2_keys(k: torch.Tensor) -> torch.Tensor:
    """k [T, H, D] -> INT2 per channel over consecutive pages of 32 tokens (last may be shorter), back to fp32."""
    out = torch.empty_like(k)
    t, h, d = k.shape
    full = t - t % PAGE
    if full:  # every whole page at once: [pages, H, P, D]
        pages = k[:full].reshape(full // PAGE, PAGE, h, d).transpose(1, 2)
        out[:full] = dequantize_int2_keys(*quantize_int2_keys(pages), dtype=torch.float32).transpose(1, 2).reshape(full, h, d)
    if full < t:
        page = k[full:].transpose(0, 1)  # [H, P, D]
        out[full:] = dequantize_int2_keys(*quantize_int2_keys(page), dtype=torch.float32).transpose(0, 1)
    return out
