"""NVFP4 reference codec (torch, CPU): the bit-exact spec of DESIGN.md's nvfp4 format.

Values are E2M1 codes, one E4M3 block scale per 16 consecutive values along
the last dim, one fp32 global scale ``g`` per layer and K/V::

    E2M1 code (4 bits):  bit 3 = sign | bits 2..0 = index into
                         magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6)

    packed byte j of a block (8 bytes per 16 values):
        bit  7 6 5 4 | 3 2 1 0
             x[2j+1] | x[2j]          (element 2j in the low nibble)

    x[..., D]  ->  packed uint8 [..., D/2]  +  scales uint8 [..., D/16] (E4M3 bits)

Quantize one block ``x[0:16]``, every step an IEEE fp32 operation rounded to
nearest (the order matters for bit-exactness)::

    s_bits = e4m3_rne_sat((amax(|x|) / 6) / g)   # saturates at 448 = 0x7E, never 0x7F
    S      = fp32(e4m3(s_bits)) * g              # the *rounded* scale
    code_i = e2m1_rne_sat(x_i / S)                # ties to the even index, |.| > 6 -> 6
    S == 0 (all-zero block, or amax so small that s rounds to 0): every code is 0x0

Rounding on the E2M1 grid: a magnitude halfway between two grid points goes
to the one with the even index (mantissa bit 0), so 0.25 -> 0, 0.75 -> 1,
1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.

Negative zero: the sign bit is the sign bit of ``x_i`` (``torch.signbit``), also
when the magnitude rounds to 0, so ``-0.0`` and e.g. ``-0.1·S`` encode as
``0x8`` and dequantize to ``-0.0`` — as an IEEE rounding of a negative number
would. The exception is a zero block (S == 0), whose codes are all ``0x0``.

Dequantize: ``(e2m1(code) · s) · g`` in fp32, then cast to ``dtype``. The
product ``e2m1 · s`` is exact (2 x 4 significant bits), so only the ``· g``
rounds (and not at all for g = 1); kernels may therefore dequantize to BF16
and fold ``g`` into the softmax / output scale.
"""

from __future__ import annotations

import math

import torch

from kvserving.kernels.fp8 import e4m3_bits, e4m3_values
from kvserving.kernels.intquant import pack_int4, unpack_int4  # same nibble order as INT4
from kvserving.kernels.quant_checks import check_float_tensor, check_out_dtype, check_positive_scale

BLOCK = 16
E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Value of each 4-bit code 0..15 (codes 8..15 are the negatives; 8 is -0.0).
E2M1_VALUES: tuple[float, ...] = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)

# Midpoints between neighbouring magnitudes with the direction a tie goes:
# the index of |t| is the number of midpoints it has passed. Below the even
# index i a tie rounds down (strict >), below an odd index it rounds up (>=).
_MIDPOINTS = tuple((0.5 * (E2M1_MAGNITUDES[i] + E2M1_MAGNITUDES[i + 1]), i % 2 == 1) for i in range(len(E2M1_MAGNITUDES) - 1))


def e2m1_codes(t: torch.Tensor) -> torch.Tensor:
    """fp32 tensor (already divided by the block scale) -> uint8 E2M1 codes, RNE, saturating at ±6."""
    mag = t.abs()
    index = torch.zeros(t.shape, dtype=torch.uint8, device=t.device)
    for midpoint, tie_up in _MIDPOINTS:
        passed = mag >= midpoint if tie_up else mag > midpoint
        index += passed.to(torch.uint8)
    return index | (torch.signbit(t).to(torch.uint8) << 3)


def _check_last_dim(x: torch.Tensor, multiple: int, what: str) -> int:
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % multiple:
        last = x.shape[-1] if x.dim() else "a 0-d tensor"
        raise ValueError(f"{what} last dim must be a positive multiple of {multiple}, got {last}")
    return x.shape[-1]


def quantize_nvfp4(x: torch.Tensor, global_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (packed codes uint8 [..., D/2], block-scale E4M3 bits uint8 [..., D/16])."""
    check_float_tensor(x)
    d = _check_last_dim(x, BLOCK, "x")
    g = check_positive_scale(global_scale, "global_scale")
    # xb: [..., D/16, 16]
    xb = x.to(torch.float32).reshape(*x.shape[:-1], d // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)  # [..., D/16]
    scale_bits = e4m3_bits(amax / E2M1_MAX / g)  # >= 0, so never the sign bit either
    big_s = e4m3_values(scale_bits) * g  # [..., D/16], the rounded scale
    zero_block = big_s == 0
    # Divide only where S > 0 (a zero block would give 0/0 = NaN).
    t = xb / torch.where(zero_block, torch.ones_like(big_s), big_s).unsqueeze(-1)
    codes = e2m1_codes(t)
    codes[zero_block] = 0
    return pack_int4(codes.reshape(x.shape)), scale_bits


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(packed [..., D/2], scales [..., D/16]) -> ``e2m1(code) * s * g`` as ``dtype`` [..., D]."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise ValueError("packed must be a uint8 tensor of packed E2M1 codes")
    s = e4m3_values(scales, "scales")
    g = check_positive_scale(global_scale, "global_scale")
    check_out_dtype(dtype)
    if packed.dim() < 1 or scales.dim() != packed.dim() or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"packed {list(packed.shape)} and scales {list(scales.shape)} must share leading dims")
    if packed.shape[-1] == 0 or packed.shape[-1] != scales.shape[-1] * (BLOCK // 2):
        raise ValueError(f"packed last dim must be 8 x scales last dim (> 0), got {packed.shape[-1]} and {scales.shape[-1]}")
    codes = unpack_int4(packed)  # [..., D]
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]
    d = codes.shape[-1]
    values = values.reshape(*codes.shape[:-1], d // BLOCK, BLOCK)
    out = (values * s.unsqueeze(-1)) * g  # e2m1 * s is exact in fp32; * g rounds once
    return out.reshape(codes.shape).to(dtype)


def calibrated_global_scale(amax: float) -> float:
    """The calibrated global scale ``amax / (6 * 448)`` (1.0 for an all-zero tensor)."""
    if isinstance(amax, bool) or not isinstance(amax, (int, float)) or not math.isfinite(amax) or amax < 0:
        raise ValueError(f"amax must be a finite number >= 0, got {amax!r}")
    if amax == 0:
        return 1.0
    return amax / (E2M1_MAX * 448.0)
