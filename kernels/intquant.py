"""Triaxial INT4/INT2 reference codec (torch, CPU): asymmetric group quantization, the bit-exact spec.

Three quantizers share one rule (DESIGN.md, triaxial), with L = 2^bits - 1,
min/max the group's fp32 extremes and all arithmetic IEEE fp32 unless said::

    zero  = the largest fp16 <= min                 (fp16 round-down)
    span  = max - fp32(zero)                        (fp32 subtract; >= 0)
    scale = the smallest fp16 s with L * s >= span  (fp16 round-up of span / L)
            1 when span is 0 (max == zero), so no code is ever NaN
    code  = clamp( rne( (x - fp32(zero)) / fp32(scale) ), 0, L )
    x^    = code * fp32(scale) + fp32(zero)   then cast to the output dtype

Why round zero down and scale up: then [zero, zero + L*scale] covers the
group, 0 <= fl(x - zero) <= span <= L*scale, so every quotient lies in
[0, L] and the clamp never acts. Rounding zero and scale to nearest instead
lets an fp16 zero sit far below min for a large offset with a narrow range
(a key outlier channel): 16 values 1000.2 and 16 values 1000.3 got zero 1000,
scale 0.0066643, every code clamped to 15 and an error of 0.2 (30 steps).
Now that group gets scale 0.0200043 and an error of 6e-5 (one fp32 ulp).

The bound, for every input the codec accepts (|x| <= 65504)::

    |x - x^| <= scale/2 + 2^-22 |x - zero| + 2^-24 |x^|

with x^ the fp32 value before the cast (the cast adds half an ulp of the
output dtype; the decode kernels dequantize to fp16). scale/2 is rounding
to the nearest code; the rest are the fp32 roundings of x - zero, of the
quotient and of code * scale + zero. scale itself is at most about
(max - min + one fp16 ulp of min) / L: an fp16 zero costs at most one of its
ulps spread over the L steps. ``tests/kernels/test_intquant_bound.py`` checks
the bound on outlier channels, subnormal and near-65504 groups.

The codes use the fp16 scale and zero as stored, so decoding is consistent
with encoding. ``code * scale`` is exact in fp32 (<= 4 + 11 significant bits),
so a kernel's fused multiply-add and this multiply-then-add agree bit for bit.
Every ``(x - zero) / scale`` is an IEEE fp32 division (not a multiply by a
reciprocal). ``L * s`` is exact too, so testing ``L * s >= span`` and
stepping the fp16 nearest to span / L up by one ulp when it falls short gives
the round-up exactly. Inputs must lie within the fp16 range (|x| <= 65504):
then zero >= -65504 is finite and scale <= 2 * 65504 / 3 is too; larger
values are refused rather than stored as inf. (The Triton writers, which do
not read values back to check them on a GPU, clamp min and max to +-65504
first, so an out-of-range value saturates instead of poisoning its group.)

Where the statistics come from:

* ``quantize_groups(x, bits)``: per token, groups of G = 32 consecutive
  channels along the last dim (INT4 keys and values, INT2 values).
* ``quantize_int2_keys(k)``: per channel over the P tokens of a page (dim -2;
  P is 32 in the cache, any P >= 1 is accepted).

Packing, little end first inside a byte (matches ``kernels/layout.py``)::

    INT4, byte j:   bit  7 6 5 4 | 3 2 1 0
                         e[2j+1] | e[2j]

    INT2, byte j:   bit  7 6 | 5 4 | 3 2 | 1 0
                      e[4j+3]|e[4j+2]|e[4j+1]|e[4j]

    x [..., D]       -> codes uint8 [..., D*bits/8], scale/zero fp16 [..., D/32]
    k [..., P, D]    -> codes uint8 [..., P, D/4],   scale/zero fp16 [..., D]
"""

from __future__ import annotations

import torch

from kvserving.kernels.quant_checks import check_float_tensor, check_out_dtype

GROUP = 32
FP16_MAX = 65504.0
BITS = (2, 4)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be 2 or 4, got {bits!r}")
    return (1 << bits) - 1


def _check_quant_input(x: torch.Tensor, name: str, min_dims: int) -> int:
    check_float_tensor(x, name)
    if x.dim() < min_dims:
        raise ValueError(f"{name} must have at least {min_dims} dims, got shape {list(x.shape)}")
    d = x.shape[-1]
    if d == 0 or d % GROUP:
        raise ValueError(f"{name} last dim must be a positive multiple of {GROUP}, got {d}")
    if x.numel() and float(x.abs().max()) > FP16_MAX:
        raise ValueError(f"{name} has |values| above the fp16 maximum {FP16_MAX:g}; scales and zeros are fp16")
    return d


def _fp16_below(x: torch.Tensor) -> torch.Tensor:
    """fp32 x (|x| <= 65504) -> the largest fp16 <= x: round to nearest, one fp16 step down if that went up."""
    h = x.to(torch.float16)
    bits = h.view(torch.int16)
    # one step toward -inf on fp16 bit patterns (sign and magnitude): a positive h
    # loses one, a negative h gains one in magnitude, a zero becomes -2^-24 (0x8001)
    down = torch.where(h > 0, bits - 1, torch.where(h == 0, torch.full_like(bits, -0x7FFF), bits + 1))
    return torch.where(h.to(torch.float32) > x, down.view(torch.float16), h)


def _stats(xf: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values -> (fp16 scale, fp16 zero) over ``dim`` by the shared rule."""
    # the clamp only acts in the Triton writers' unchecked path; kept here so both compute the same
    lo = xf.amin(dim=dim).clamp(-FP16_MAX, FP16_MAX)
    hi = xf.amax(dim=dim).clamp(-FP16_MAX, FP16_MAX)
    zero = _fp16_below(lo)
    span = hi - zero.to(torch.float32)  # >= 0: zero <= lo <= hi
    scale = (span / levels).to(torch.float16)  # nearest; at most one fp16 step short (module docstring)
    short = scale.to(torch.float32) * levels < span  # exact product
    scale = torch.where(short, (scale.view(torch.int16) + 1).view(torch.float16), scale)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, zero


def _codes(xf: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    """fp32 values and broadcastable fp16 scale/zero -> uint8 codes 0..levels."""
    t = (xf - zero.to(torch.float32)) / scale.to(torch.float32)
    return torch.round(t).clamp(0, levels).to(torch.uint8)  # torch.round is half to even


def quantize_groups(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D*bits/8], scale fp16 [..., D/32], zero fp16 [..., D/32])."""
    levels = _check_bits(bits)
    d = _check_quant_input(x, "x", 1)
    # xg: [..., D/32, 32]
    xg = x.to(torch.float32).reshape(*x.shape[:-1], d // GROUP, GROUP)
    scale, zero = _stats(xg, -1, levels)
    codes = _codes(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), levels).reshape(x.shape)
    return (pack_int4(codes) if bits == 4 else pack_int2(codes)), scale, zero


def dequantize_groups(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(codes [..., D*bits/8], scale/zero fp16 [..., D/32]) -> ``code*scale+zero`` as ``dtype`` [..., D]."""
    _check_bits(bits)
    check_out_dtype(dtype)
    _check_meta(scale, zero)
    per_byte = 8 // bits
    _check_codes(codes, leading=scale.shape[:-1], last=scale.shape[-1] * GROUP // per_byte)
    values = unpack_int4(codes) if bits == 4 else unpack_int2(codes)
    d = values.shape[-1]
    vg = values.to(torch.float32).reshape(*values.shape[:-1], d // GROUP, GROUP)
    out = vg * scale.to(torch.float32).unsqueeze(-1) + zero.to(torch.float32).unsqueeze(-1)
    return out.reshape(values.shape).to(dtype)


def quantize_int2_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [..., P, D] -> (codes uint8 [..., P, D/4], scale fp16 [..., D], zero fp16 [..., D]); stats over P."""
    _check_quant_input(k, "k", 2)
    if k.shape[-2] == 0:
        raise ValueError("k must hold at least one token (dim -2 >= 1)")
    kf = k.to(torch.float32)
    scale, zero = _stats(kf, -2, 3)
    codes = _codes(kf, scale.unsqueeze(-2), zero.unsqueeze(-2), 3)
    return pack_int2(codes), scale, zero


def dequantize_int2_keys(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(codes [..., P, D/4], scale/zero fp16 [..., D]) -> ``code*scale+zero`` as ``dtype`` [..., P, D]."""
    check_out_dtype(dtype)
    _check_meta(scale, zero)
    if not isinstance(codes, torch.Tensor) or codes.dim() != scale.dim() + 1:
        raise ValueError(f"codes must be [..., P, D/4] with one more dim than scale {list(scale.shape)}")
    _check_codes(codes, leading=(*scale.shape[:-1], codes.shape[-2]), last=scale.shape[-1] // 4)
    if scale.shape[-1] % GROUP:
        raise ValueError(f"scale last dim (D) must be a positive multiple of {GROUP}, got {scale.shape[-1]}")
    values = unpack_int2(codes).to(torch.float32)  # [..., P, D]
    out = values * scale.to(torch.float32).unsqueeze(-2) + zero.to(torch.float32).unsqueeze(-2)
    return out.to(dtype)


def _check_meta(scale: torch.Tensor, zero: torch.Tensor) -> None:
    for name, t in (("scale", scale), ("zero", zero)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float16:
            raise ValueError(f"{name} must be a float16 tensor")
        if t.dim() < 1 or t.shape[-1] == 0:
            raise ValueError(f"{name} must have a non-empty last dim, got shape {list(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf")
    if scale.shape != zero.shape:
        raise ValueError(f"scale {list(scale.shape)} and zero {list(zero.shape)} must have the same shape")


def _check_codes(codes: torch.Tensor, *, leading: tuple[int, ...], last: int) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError("codes must be a uint8 tensor of packed codes")
    expected = [*leading, last]
    if list(codes.shape) != expected:
        raise ValueError(f"codes shape must be {expected} to match scale/zero, got {list(codes.shape)}")


def _check_pack_input(codes: torch.Tensor, per_byte: int, max_code: int) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError("codes to pack must be a uint8 tensor")
    if codes.dim() < 1 or codes.shape[-1] % per_byte:
        raise ValueError(f"codes last dim must be a multiple of {per_byte}, got shape {list(codes.shape)}")
    if codes.numel() and int(codes.max()) > max_code:
        raise ValueError(f"codes must be in 0..{max_code}, got {int(codes.max())}")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., N] -> [..., N/2]: element 2j in bits 0-3, 2j+1 in bits 4-7."""
    _check_pack_input(codes, 2, 15)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 [..., N/2] -> codes [..., N]."""
    _check_pack_input(packed, 1, 255)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..3 [..., N] -> [..., N/4]: element 4j+i in bits 2i..2i+1."""
    _check_pack_input(codes, 4, 3)
    quads = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int2``: uint8 [..., N/4] -> codes [..., N]."""
    _check_pack_input(packed, 1, 255)
    parts = [(packed >> shift) & 0x3 for shift in (0, 2, 4, 6)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 4)
