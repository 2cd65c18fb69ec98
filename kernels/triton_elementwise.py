"""Elementwise Triton helpers that more than one kernel module computes with, so their values agree bit for bit.

``rounded`` is torch's rounding of an fp32 value to bf16 (or another dtype), the same in the interpreter and on the
GPU; ``silu_mul`` is SwiGLU's silu(gate) * up as ``triton_norm.silu_mul`` stores it, which the decode GEMV
(``triton_fp8_gemm``) also forms in its registers for the down projection.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dt: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dt``, kept in fp32. bf16 by hand: Triton's interpreter truncates
    fp32 -> bf16 casts, the GPU rounds; the bit trick rounds the same on both."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def silu_mul(g, u, OUT: tl.constexpr):
    """silu(g) * u stored in ``OUT`` (kept in fp32): silu rounded to g's dtype like F.silu's output, the product
    rounded to OUT."""
    gf = g.to(tl.float32)
    s = rounded(gf / (1.0 + tl.exp(-gf)), g.dtype)
    return rounded(s * u.to(tl.float32), OUT)
