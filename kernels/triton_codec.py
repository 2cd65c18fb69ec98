"""Triton device functions that encode and decode the KV formats, bit-exact with the reference codecs.

Two kinds live here:

* encoders (E4M3, E2M1, INT codes) in plain fp32/int32 arithmetic that gives
  the same bits as the IEEE operations of ``fp8.py`` / ``nvfp4.py`` /
  ``intquant.py``. Triton's ``/`` on fp32 lowers to an approximate
  ``div.full.f32`` on NVIDIA GPUs, so divisions are either ``div_rn`` or, where
  the divisor is an fp16 value (INT scales), ``div_f16``: the same correctly
  rounded quotient from three fused multiply-adds;
* decoders to fp16 for the attention kernels, each in two versions chosen at
  compile time by ``FAST``: portable bit arithmetic (runs under
  ``TRITON_INTERPRET=1``, so CI runs every kernel) and PTX inline assembly that
  works on four packed bytes per instruction stream (the device path; the GPU
  tests hold it to the same reference).

Decoding to fp16 is exact for every stored value: E4M3 values and E2M1 x E4M3
products fit in 11 significant bits and fp16's range once pre-scaled (see
``nibbles_e2m1``), and INT codes are small integers.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 1.5 * 2^23: adding it to an fp32 |x| < 2^22 leaves rne(x) in the low mantissa bits
RNE_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
RNE_MAGIC_BITS: tl.constexpr = tl.constexpr(0x4B400000)  # its fp32 bits: the integer n sits in the low bits of n + RNE_MAGIC


@triton.jit
def rne(x):
    """Round fp32 to the nearest integer, ties to even (valid for |x| < 2^22)."""
    return (x + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def sign_bit(x):
    """1 where the fp32 sign bit is set (also for -0.0), else 0; int32."""
    return (x.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def to_bf16(x):
    """fp32 -> bf16, round to nearest even, done in integer arithmetic (finite x).

    The hardware conversion does the same on a GPU, but the interpreter
    truncates; this keeps CPU and GPU bytes identical.
    """
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


# ----------------------------------------------------------------------------
# encoders (quantize-on-write)
# ----------------------------------------------------------------------------


@triton.jit
def e4m3_bits(t):
    """fp32 -> E4M3 bits (int32 0..255), saturating at +-448, ties to even, the sign of zero kept.

    |t| lies in a binade [2^e, 2^(e+1)) with e >= -6 (smaller values share the
    subnormal grid of e = -6), where E4M3 steps by q = 2^(e-3). rne(|t| / q)
    is then r in 0..16 and the code is (e + 6) * 8 + r: r = 16 carries into
    the next exponent by itself, and subnormals (e = -6, r < 8) come out as r.
    """
    a = tl.minimum(tl.abs(t), 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    inv_q = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): |t| * inv_q is exact
    r = rne(a * inv_q).to(tl.int32)
    return ((e + 6) * 8 + r) | (sign_bit(t) << 7)


@triton.jit
def e4m3_value(bits):
    """E4M3 bits (int32 0..255, never NaN codes) -> exact fp32 value."""
    e = (bits >> 3) & 0xF
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((bits & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_codes(t):
    """fp32 (already divided by the block scale) -> E2M1 code (int32 0..15), ties to even, saturating at 6."""
    a = tl.abs(t)
    # the magnitude index is the number of midpoints passed; ties go to the even index
    idx = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    idx += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return idx | (sign_bit(t) << 3)


@triton.jit
def div_f16(d, s, inv_s):
    """fp32 ``d / s`` rounded to nearest even (bit-equal to ``div_rn``, but +0 for d = -0) when ``s > 0`` holds an fp16 value.

    ``inv_s`` is any approximation of 1/s within 2^-20 relative (one per
    group: ``1.0 / s`` is within 2 ulp). The quotient comes from the residual,
    as in the fast path of a hardware division, but per value it is one
    multiply and two fused multiply-adds instead of a reciprocal, a range check
    and five more::

        q0 = d * inv_s                 within 2^-20 relative of t = d / s
        r  = fma(q0, -s, d)            = d - q0 * s exactly (see below)
        q1 = fma(r, inv_s, q0)         = t + (t - q0) * err, |err| <= 2^-20

    Why q1 is the correctly rounded t: s has at most 11 significant bits and
    d at most 24, so d - q0 * s is a multiple of 2^(e(d) - 35) below
    2^(e(d) - 18): it fits in 24 bits and the first fma is exact. The second
    fma rounds once a value within 2^-39 |t| of t. No fp32 midpoint M (25
    significant bits, the last odd) lies that close to t: M * s would need 25
    or more significant bits, so d != M * s, and |d - M * s| is a nonzero
    multiple of 2^min(e(d) - 23, e(M) - 24 + e(s) - 10), which puts |t - M|
    above 2^-37 |t|. A value and t on the same side of every midpoint round
    alike. The argument assumes no underflow, which holds for |d| >= 2^-115;
    smaller d give |t| < 2^-90, which quantizes to 0 whatever its last bits.
    A zero quotient comes out +0 (r and q0 are zeros of opposite signs); the
    INT codes clamp at 0 and cannot tell.
    (``tests/kernels/test_triton_paged.py`` checks quotients near every kind
    of midpoint against numpy's IEEE division.)
    """
    q0 = d * inv_s
    # (-s), not (-q0): LLVM rewrites -(d * inv_s) into a second product
    r = tl.fma(q0, -s, d)
    return tl.fma(r, inv_s, q0)


@triton.jit
def meta_index(hrow, g, NG: tl.constexpr, TM: tl.constexpr):
    """fp16 index of group g's scale (or zero) of row ``hrow`` (= head * P + slot) in a per-token field:
    [H, P, NG] when TM is 0; token-minor [H, NG, P] with P = TM (value scales of int4 / int2 pages, layout.py)."""
    if TM == 0:
        return hrow * NG + g
    else:
        return (hrow // TM * NG + g) * TM + hrow % TM


@triton.jit
def f16_below(x):
    """fp32 x (|x| <= 65504) -> the largest fp16 <= x (intquant._fp16_below): nearest, then one step down if above x."""
    h = x.to(tl.float16)
    b = h.to(tl.int16, bitcast=True).to(tl.int32)
    # one fp16 step toward -inf on the sign-magnitude bits; a zero becomes -2^-24 (0x8001)
    down = tl.where(h > 0, b - 1, tl.where(h == 0, -0x7FFF, b + 1))
    return tl.where(h.to(tl.float32) > x, down.to(tl.int16).to(tl.float16, bitcast=True), h)


@triton.jit
def int_stats(lo, hi, LEVELS: tl.constexpr):
    """Group min/max (fp32) -> (scale, zero) as fp16 by intquant's rule: zero = the largest fp16 <= lo,
    scale = the smallest fp16 s with L * s >= hi - zero (1 when that is 0).

    lo and hi are clamped to +-65504 first (a no-op on the inputs the reference
    accepts), so a value out of fp16 range saturates instead of making zero inf.
    """
    lo = tl.minimum(tl.maximum(lo, -65504.0), 65504.0)
    hi = tl.minimum(tl.maximum(hi, -65504.0), 65504.0)
    zero = f16_below(lo)
    span = hi - zero.to(tl.float32)  # >= 0
    # L = 3 or 15 is an fp16 value, so div_f16 gives div_rn's quotient; 1/L is a constant
    near = div_f16(span, LEVELS * 1.0, 1.0 / LEVELS).to(tl.float16)
    # the nearest fp16 is at most one step short of span / L; L * near is exact
    up = (near.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    scale = tl.where(near.to(tl.float32) * LEVELS < span, up, near)
    scale = tl.where(scale == 0, 1.0, scale).to(tl.float16)
    return scale, zero


@triton.jit
def int_codes(x, s, z, inv_s, LEVELS: tl.constexpr):
    """fp32 values, broadcastable fp32 scale s (an fp16 value), zero z and ~1/s -> int32 codes clamp(rne((x - z) / s), 0, L)."""
    t = div_f16(x - z, s, inv_s)
    # clamping to the integers 0..L before rounding gives the same codes and
    # keeps the argument small enough for the magic-number rounding; the code
    # is then the low bits of t + 1.5 * 2^23
    t = tl.minimum(tl.maximum(t, 0.0), LEVELS * 1.0)
    return (t + RNE_MAGIC).to(tl.int32, bitcast=True) - RNE_MAGIC_BITS


# ----------------------------------------------------------------------------
# decoders to fp16 (attention); FAST selects the inline-assembly version
# ----------------------------------------------------------------------------
#
# Packed bytes, and the fp16 each decoder builds from a code (bits of a half):
#
#   nvfp4 byte:  hi nibble = element 2j+1 | lo nibble = element 2j
#                nibble s e1 e0 m  ->  fp16  s 0 0 e1 e0 m 0..0   (= e2m1 * 2^-14)
#   int4 byte:   same nibble order; code c -> fp16 0x6400 | c  (= 1024 + c), minus 1024
#   int2 byte:   bits 7-6 | 5-4 | 3-2 | 1-0 = elements 4j+3 | 4j+2 | 4j+1 | 4j
#
# In the assembly, one 32-bit register holds four bytes b0..b3 of a tensor and
# each fp16 output register holds two results (b0, b1) or (b2, b3); prmt first
# spreads two bytes into the two 16-bit halves of a register.

_PRMT = """
    mov.b32 zz, 0;
    prmt.b32 lo01, $IN, zz, 0x4140;
    prmt.b32 lo23, $IN, zz, 0x4342;
"""


def _asm_e2m1() -> str:
    # t = b0 | b1 << 16; lo nibble -> bits 15 and 11..9: ((t & 8) << 12) | ((t & 7) << 9)
    out = []
    for pair, reg in ((0, "lo01"), (1, "lo23")):
        for nib, shift in ((0, 0), (1, 4)):  # output 0: lo nibbles, output 1: hi nibbles
            dst = f"${nib * 2 + pair}"
            sc = f"${5 + pair}"
            out.append(
                f"shr.b32 t, {reg}, {shift}; shl.b32 a, t, 12; and.b32 a, a, 0x80008000; "
                f"shl.b32 b, t, 9; and.b32 b, b, 0x0E000E00; or.b32 a, a, b; mul.rn.f16x2 {dst}, a, {sc};"
            )
    return "{ .reg .b32 zz, lo01, lo23, t, a, b;" + _PRMT.replace("$IN", "$4") + "\n".join(out) + "}"


def _asm_e2m1_cvt() -> str:
    # Blackwell (sm_100a / sm_120a): cvt.rn.f16x2.e2m1x2 turns byte b (hi nibble | lo nibble) into the exact fp16
    # pair (lo, hi); prmt regroups the pairs as _asm_e2m1 lays them out ((lo b0, lo b1), (lo b2, lo b3), then the hi
    # nibbles) and one multiply applies s * 2^-14 (the scale folded with the bit placement's 2^-14 once per word).
    # Both products are exact (nibbles_e2m1), so the two decoders agree bit for bit: 14 instructions per word of 8
    # values where _asm_e2m1 takes 30.
    return (
        "{ .reg .b8 c0, c1, c2, c3; .reg .b32 d0, d1, d2, d3, s0, s1, k;"
        " mov.b32 {c0, c1, c2, c3}, $4;"
        " cvt.rn.f16x2.e2m1x2 d0, c0; cvt.rn.f16x2.e2m1x2 d1, c1;"
        " cvt.rn.f16x2.e2m1x2 d2, c2; cvt.rn.f16x2.e2m1x2 d3, c3;"
        " mov.b32 k, 0x04000400; mul.rn.f16x2 s0, $5, k; mul.rn.f16x2 s1, $6, k;"
        " prmt.b32 $0, d0, d1, 0x5410; prmt.b32 $1, d2, d3, 0x5410;"
        " prmt.b32 $2, d0, d1, 0x7632; prmt.b32 $3, d2, d3, 0x7632;"
        " mul.rn.f16x2 $0, $0, s0; mul.rn.f16x2 $1, $1, s1; mul.rn.f16x2 $2, $2, s0; mul.rn.f16x2 $3, $3, s1; }"
    )


def _asm_int(bits: int) -> str:
    # t = b0 | b1 << 16; code k of each byte -> (t >> bits*k) & mask | 0x6400 (1024 + c), then (x - 1024) * s + z
    n = 8 // bits
    mask = (1 << bits) - 1
    mask2 = mask | mask << 16
    ins = 2 * n  # first input operand: outputs are n tensors x 2 registers
    out = []
    for pair, reg in ((0, "lo01"), (1, "lo23")):
        for k in range(n):
            dst = f"${k * 2 + pair}"
            sc, zr = f"${ins + 1 + pair}", f"${ins + 3 + pair}"
            out.append(
                f"shr.b32 t, {reg}, {bits * k}; and.b32 t, t, {mask2:#x}; or.b32 t, t, 0x64006400; "
                f"sub.rn.f16x2 t, t, magic; fma.rn.f16x2 {dst}, t, {sc}, {zr};"
            )
    return "{ .reg .b32 zz, lo01, lo23, t, magic; mov.b32 magic, 0x64006400;" + _PRMT.replace("$IN", f"${ins}") + "\n".join(out) + "}"


def _asm_crumb_codes() -> str:
    # four INT2 codes per byte -> fp16 code values (no scale): ((t >> 2k) & 3 | 0x6400) - 1024
    out = []
    for pair, reg in ((0, "lo01"), (1, "lo23")):
        for k in range(4):
            out.append(
                f"shr.b32 t, {reg}, {2 * k}; and.b32 t, t, 0x30003; or.b32 t, t, 0x64006400; sub.rn.f16x2 ${k * 2 + pair}, t, magic;"
            )
    return "{ .reg .b32 zz, lo01, lo23, t, magic; mov.b32 magic, 0x64006400;" + _PRMT.replace("$IN", "$8") + "\n".join(out) + "}"


ASM_E2M1: tl.constexpr = tl.constexpr(_asm_e2m1())
ASM_E2M1_CVT: tl.constexpr = tl.constexpr(_asm_e2m1_cvt())  # sm_100a / sm_120a only (capability.TABLE, e2m1 "cvt")
ASM_CRUMB_CODES: tl.constexpr = tl.constexpr(_asm_crumb_codes())
ASM_INT4: tl.constexpr = tl.constexpr(_asm_int(4))
ASM_INT2: tl.constexpr = tl.constexpr(_asm_int(2))


@triton.jit
def nibbles_e2m1(packed, scale, FAST: tl.constexpr):
    """uint8 packed E2M1 pairs, fp16 scale (E4M3 block scale * 2^7, broadcast) -> (lo, hi) fp16 = e2m1 * s * 2^-7.

    The 2^-7 keeps s * 2^7 <= 448 * 128 inside fp16 and every product exact
    (the smallest, 0.5 * 2^-9 * 2^-7, is an fp16 subnormal on the grid); the
    caller folds 2^7 back into its softmax or output scale.

    FAST: 0 portable arithmetic, 1 bit placement in assembly (any GPU), 2 Blackwell's
    cvt.rn.f16x2.e2m1x2 (sm_100a / sm_120a; s * 2^-14 is exact in fp16 for every E4M3 scale, so the product
    is the same as 1's).
    """
    if FAST == 2:
        lo, hi = tl.inline_asm_elementwise(
            ASM_E2M1_CVT, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    elif FAST:
        lo, hi = tl.inline_asm_elementwise(
            ASM_E2M1, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        b = packed.to(tl.int32)
        lo16 = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
        hi16 = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
        lo = lo16 * scale
        hi = hi16 * scale
    return lo, hi


@triton.jit
def nibbles_int4(packed, scale, zero, FAST: tl.constexpr):
    """uint8 packed INT4 pairs, fp16 scale/zero (broadcast) -> (lo, hi) fp16 = code * scale + zero."""
    if FAST:
        lo, hi = tl.inline_asm_elementwise(
            ASM_INT4, "=r,=r,=r,=r,r,r,r,r,r", [packed, scale, zero], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        # fp32 multiply-add, one rounding to fp16 at the end (as fma.rn.f16x2 up to double rounding)
        b = packed.to(tl.int32)
        s32, z32 = scale.to(tl.float32), zero.to(tl.float32)
        lo = ((b & 0xF).to(tl.float32) * s32 + z32).to(tl.float16)
        hi = ((b >> 4).to(tl.float32) * s32 + z32).to(tl.float16)
    return lo, hi


@triton.jit
def crumbs_int2(packed, scale, zero, FAST: tl.constexpr):
    """uint8 packed INT2 quads, fp16 scale/zero (broadcast) -> four fp16 tensors, element 4j+k = code_k * scale + zero."""
    if FAST:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            ASM_INT2,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r",
            [packed, scale, zero],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        b = packed.to(tl.int32)
        s32, z32 = scale.to(tl.float32), zero.to(tl.float32)
        c0 = ((b & 3).to(tl.float32) * s32 + z32).to(tl.float16)
        c1 = (((b >> 2) & 3).to(tl.float32) * s32 + z32).to(tl.float16)
        c2 = (((b >> 4) & 3).to(tl.float32) * s32 + z32).to(tl.float16)
        c3 = ((b >> 6).to(tl.float32) * s32 + z32).to(tl.float16)
    return c0, c1, c2, c3


@triton.jit
def crumb_codes(packed, FAST: tl.constexpr):
    """uint8 packed INT2 quads -> four fp16 tensors of the raw codes 0..3 (element 4j+k in tensor k)."""
    if FAST:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            ASM_CRUMB_CODES,
            "=r,=r,=r,=r,=r,=r,=r,=r,r",
            [packed],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        # 0x6400 | c is fp16 1024 + c: an exact integer-to-fp16 conversion without I2F
        b = packed.to(tl.int32)
        c0 = ((b & 3) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        c1 = (((b >> 2) & 3) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        c2 = (((b >> 4) & 3) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        c3 = ((b >> 6) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    return c0, c1, c2, c3


@triton.jit
def e4m3_to_f16(bits, FAST: tl.constexpr):
    """uint8 E4M3 bits -> exact fp16 value."""
    if FAST:
        # sm_89+: cvt.rn.f16x2.e4m3x2, two values per instruction
        out = bits.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        b = bits.to(tl.int32)
        # E4M3 (bias 7) exponent and mantissa into fp16 (bias 15): the value times 2^-8, subnormals included
        h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
        out = h * 256.0
    return out


def asm_quarters(kind: str) -> str:
    """PTX of the extend kernels' quarter unpackers (triton_prefill, gluon_extend): two packed words ($4, $5: 16-bit
    words of nvfp4 / int4, bytes of INT2, one per int32) -> the four quarters as f16x2 pairs ($0..$3: element pair
    (word a, word b) of quarter k).

    The words go to the halves of one register x, so every instruction below handles two values:

    - e2m1 ($6: the pair's scales s * 2^7): nibble k = (sign, 3 magnitude bits) -> sign to bit 15, magnitude to
      bits 9..11, i.e. the fp16 e2m1 * 2^-14, times the scale: 2 shifts, 2 logic ops and 1 multiply per pair;
    - int4 / int2 codes ($6 scales, $7 zeros): (x >> Bk) & mask | 0x6400 is the fp16 1024 + code, minus 1024,
      then code * s + z in one fma (codes only, no $6 / $7, for "int2_codes").
    """
    code = ["{ .reg .b32 x, t, u, magic; mov.b32 magic, 0x64006400;", "prmt.b32 x, $4, $5, 0x5410;"]
    for k in range(4):
        if kind == "e2m1":
            sign, mag = 12 - 4 * k, 9 - 4 * k  # left shifts taking bit 4k+3 to 15 and bits 4k..4k+2 to 9..11
            code.append(f"shl.b32 t, x, {sign};" if sign else "mov.b32 t, x;")
            code.append(f"shl.b32 u, x, {mag};" if mag > 0 else f"shr.b32 u, x, {-mag};")
            code.append(f"and.b32 u, u, 0x0E000E00; lop3.b32 t, t, u, 0x80008000, 0xEC; mul.rn.f16x2 ${k}, t, $6;")
        else:
            b = 4 if kind == "int4" else 2
            code.append(f"shr.b32 t, x, {b * k};" if k else "mov.b32 t, x;")
            mask = (1 << b) - 1
            code.append(f"lop3.b32 t, t, {mask | mask << 16:#010x}, magic, 0xEA; sub.rn.f16x2 t, t, magic;")
            code.append(f"mov.b32 ${k}, t;" if kind == "int2_codes" else f"fma.rn.f16x2 ${k}, t, $6, $7;")
    code.append("}")
    return "\n".join(code)


def asm_e2m1_pair(*, half_scale: bool = False) -> str:
    """PTX: the nvfp4 quarters of two 16-bit words from one register ($4 = word a | word b << 16, as a pair of int16
    elements arrives with pack=2) -> $0..$3 = quarter k as the f16x2 pair (word a, word b), times $5 (f16x2 scales
    s * 2^7), bit-identical to asm_quarters("e2m1") on ($4 & 0xFFFF, $4 >> 16).

    Each byte's low nibble and high nibble become fp16 *high bytes* s 0 0 0 m2 m1 m0 0 (= e2m1 * 2^-14 over a zero
    low byte) for all four bytes at once (e: low nibbles, quarters 0 and 2; o: high nibbles, quarters 1 and 3), a prmt
    per quarter places two of them over zero low bytes: 15 instructions per 8 values (asm_quarters: 21 plus the
    prmt that joins two words). half_scale: $5 is one fp16 scale for both words (a 16-bit operand, pack=1).
    """
    head = "{ .reg .b32 e, o, t, u, z; mov.b32 z, 0;"
    s = "$5"
    if half_scale:
        head, s = "{ .reg .b32 e, o, t, u, z, s; mov.b32 z, 0; mov.b32 s, {$5, $5};", "s"
    return "\n".join([
        head,
        "shl.b32 t, $4, 4; shl.b32 u, $4, 1; and.b32 u, u, 0x0E0E0E0E; lop3.b32 e, t, u, 0x80808080, 0xEC;",
        "shr.b32 t, $4, 3; and.b32 t, t, 0x0E0E0E0E; lop3.b32 o, $4, t, 0x80808080, 0xEC;",
        "prmt.b32 t, e, z, 0x2404; mul.rn.f16x2 $0, t, " + s + ";",  # quarter 0: bytes 0 and 2 of e
        "prmt.b32 t, o, z, 0x2404; mul.rn.f16x2 $1, t, " + s + ";",
        "prmt.b32 t, e, z, 0x3414; mul.rn.f16x2 $2, t, " + s + ";",  # quarter 2: bytes 1 and 3 of e
        "prmt.b32 t, o, z, 0x3414; mul.rn.f16x2 $3, t, " + s + ";",
        "}",
    ])  # fmt: skip
