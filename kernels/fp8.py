"""FP8 E4M3 reference codec (torch, CPU): the bit-exact spec the Triton kernels are held to.

E4M3 ("fn" variant, as ``torch.float8_e4m3fn``), one byte per value::

    bit  7 | 6 5 4 3 | 2 1 0
       sign| exponent| mantissa      bias 7, no infinities
    exponent 0     : subnormal  m/8 * 2^-6      (smallest 2^-9, 0x01)
    exponent 1..15 : (1 + m/8) * 2^(e-7)        (largest 448, 0x7E)
    0x7F / 0xFF    : NaN — never produced here

Quantize: ``t = fp32(x) / fp32(scale)`` (IEEE fp32 division, round to nearest),
clamp ``t`` to [-448, 448] (saturate; an overflow of the division to ±inf
saturates too), then round to nearest E4M3, ties to even. The sign survives
rounding: ``-0.0`` and negative values that round to zero give ``0x80``
(negative zero), which dequantizes to ``-0.0``.

Dequantize: ``fp32(e4m3(bits)) * fp32(scale)`` (one fp32 rounding; exact when
scale is 1), then cast to the output dtype (round to nearest even).

Bad input (see ``quant_checks``: NaN/Inf, a non-float dtype, a bad scale) raises ValueError.
"""

from __future__ import annotations

import torch

from kvserving.kernels.quant_checks import check_float_tensor, check_out_dtype, check_positive_scale

E4M3_MAX = 448.0
E4M3_MAX_BITS = 0x7E


def e4m3_bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 tensor -> uint8 E4M3 bits, saturating to ±448, ties to even (the sign of zero kept)."""
    # torch's fp32 -> float8_e4m3fn cast rounds to nearest even; clamping first
    # makes saturation explicit instead of relying on the cast's overflow rule.
    return t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(bits: torch.Tensor, name: str = "bits") -> torch.Tensor:
    """uint8 E4M3 bits -> their exact fp32 values; raise ValueError on the NaN codes 0x7F/0xFF."""
    if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8:
        got = bits.dtype if isinstance(bits, torch.Tensor) else type(bits).__name__
        raise ValueError(f"{name} must be a uint8 tensor of E4M3 bits, got {got}")
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError(f"{name} contains the E4M3 NaN code 0x7F/0xFF")
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def quantize_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """E4M3 bits (uint8, same shape as ``x``) of ``x / scale``, saturating at ±448, RNE."""
    check_float_tensor(x)
    scale_f32 = check_positive_scale(scale, "scale")
    return e4m3_bits(x.to(torch.float32) / scale_f32)


def dequantize_fp8(bits: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``e4m3(bits) * scale`` computed in fp32, then cast to ``dtype``."""
    scale_f32 = check_positive_scale(scale, "scale")
    check_out_dtype(dtype)
    return (e4m3_values(bits) * scale_f32).to(dtype)
