"""How packed KV bytes become tensor-core fragments in the Gluon decode kernels: PTX unpackers and layouts.

``gluon_decode.py`` loads, per thread, exactly the bytes whose values its
``mma.m16n8k16`` fragments hold; this module turns them into those fragments.
Unpacking one 32-bit word ``x`` (bytes b0 b1 b2 b3) makes fp16 pairs from
bytes (b0, b2) and (b1, b3), whose nibbles sit 16 bits apart, so one mask and
one shift serve both halves::

    nvfp4 nibble s e1 e0 m -> fp16 bits s 0 0 e1 e0 m 0..0  (= e2m1 * 2^-14), times (block scale * 2^7)
    int4 / int2 value c    -> fp16 0x6400 | c (= 1024 + c), minus 1024, times scale plus zero
    INT2 key c (crumb k)   -> fp16 0x6400 | c << 2k, minus 1024: the exact integer c * 4^k; the page's
                              per-channel scale (and 4^-k) is folded into q once per page, its zero into
                              one per-page term (gluon_decode._step), so a key pair costs two instructions

The register order that results (b0, b2, b1, b3) is relabelled with
reshape / permute, which Triton proves free (``assert_trivial``) at compile time.
Value scales and zeros of int4 / int2 pages are stored token-minor (layout.py):
one 32-bit load gives the (s_a, s_b) pair of the two tokens an unpacker word holds.

The unpackers are PTX strings, held to the page formats on CPU by a small PTX
interpreter (``tests/kernels/test_gluon_unpackers.py``).
"""

from __future__ import annotations

from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# cp.async global -> shared: `async_copy_global_to_shared` in triton 3.6 (the device), renamed `async_load` by 3.9 (CI)
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

GL_FMT_NVFP4: gl.constexpr = gl.constexpr(0)
GL_FMT_INT4: gl.constexpr = gl.constexpr(1)
GL_FMT_INT2: gl.constexpr = gl.constexpr(2)
GL_FMT_FP8: gl.constexpr = gl.constexpr(3)

# ----------------------------------------------------------------------------
# unpackers (PTX). Operands: outputs first ($0..), then the packed word, then
# scale (and zero) registers; each fp16 operand of pack=4 is two registers.
# ----------------------------------------------------------------------------


def _asm_e2m1(token_pairs: bool) -> str:
    """Outputs lo (2 regs: pairs of b0/b2, b1/b3), hi (2 regs); inputs word $4, scale $5 ($5 $6, or $5..$8).

    The four hi nibbles of the word become fp16 *high bytes* s 0 0 e1 e0 m 0 in one go (sign in place at bit 7,
    magnitude shifted right 3), the four lo nibbles likewise after shifts left 1 / 4; a prmt per pair then places two
    such bytes over zero low bytes (fp16 = e2m1 * 2^-14) and one f16x2 multiply applies the scale: 15 instructions
    per word of 8 values, where the nibble-pair masks and shifts took ~19.

    token_pairs: the word holds (a0, a1, b0, b1) of two tokens a, b whose scales arrive as one int32 word
    (sa, sb) (scale_pairs; four copies, $5..$8). Otherwise all four bytes share one scale, $5 = (s, s).
    """
    code = ["{ .reg .b32 a, b, h, l, s;", "mov.b32 s, $5;"]
    code.append("shr.b32 a, $4, 3; and.b32 b, $4, 0x80808080; lop3.b32 h, a, 0x0E0E0E0E, b, 0xEA;")  # (a & m) | b
    code.append("shl.b32 a, $4, 1; shl.b32 b, $4, 4; and.b32 b, b, 0x80808080; lop3.b32 l, a, 0x0E0E0E0E, b, 0xEA;")
    for i, (src, sel) in enumerate((("l", 0x2404), ("l", 0x3414), ("h", 0x2404), ("h", 0x3414))):
        # bytes 0/2 (or 1/3) of the high-byte word into the fp16 high bytes, zeros (byte 4 of {0, x}) below
        code.append(f"prmt.b32 ${i}, {src}, 0, {sel:#06x}; mul.rn.f16x2 ${i}, ${i}, s;")
    code.append("}")
    return "\n".join(code)


def _asm_e2m1_cvt(token_pairs: bool) -> str:
    """_asm_e2m1's outputs and operands by Blackwell's cvt.rn.f16x2.e2m1x2 (sm_100a / sm_120a; capability.TABLE's
    e2m1 "cvt"): each byte becomes the exact fp16 pair (lo nibble, hi nibble), prmt pairs bytes (b0, b2) and
    (b1, b3) as _asm_e2m1 does, and the scale times 2^-14 (the exponent _asm_e2m1's bit placement leaves; exact
    for a scale whose lowest set bit is >= 2^-10: every fp16 >= 1 and every E4M3 block scale times 2^7) multiplies
    once: the same product, rounded once, as _asm_e2m1's. 14 instructions."""
    code = ["{ .reg .b8 c0, c1, c2, c3; .reg .b32 d0, d1, d2, d3, s, k;", "mov.b32 {c0, c1, c2, c3}, $4;"]
    code += [f"cvt.rn.f16x2.e2m1x2 d{i}, c{i};" for i in range(4)]
    code.append("mov.b32 k, 0x04000400; mul.rn.f16x2 s, $5, k;")  # (2^-14, 2^-14)
    for i, (a, b, sel) in enumerate((("d0", "d2", 0x5410), ("d1", "d3", 0x5410), ("d0", "d2", 0x7632),
                                     ("d1", "d3", 0x7632))):  # fmt: skip
        # lo halves (lo nibbles) of bytes a, b side by side, then the hi halves
        code.append(f"prmt.b32 ${i}, {a}, {b}, {sel:#06x}; mul.rn.f16x2 ${i}, ${i}, s;")
    code.append("}")
    _ = token_pairs  # the scale operands ($5 = (s, s) or (s_a, s_b), copies after it) are _asm_e2m1's
    return "\n".join(code)


# fp16 magics M_k whose mantissa unit is bit 2k of the word's low byte: M_k | (code << 2k) is the fp16 M_k + code
# (1024 step 1, 256 step 1/4, 64 step 1/16, 16 step 1/64), so a nibble or crumb is read in place, without a shift
_MAGIC = (0x6400, 0x5C00, 0x5400, 0x4C00)


def _asm_int4(token_pairs: bool) -> str:
    """Outputs lo (2 regs), hi (2 regs); inputs word $4, then scale and zero; code * scale + zero.

    K (one token): scale $5 $6 and zero $7 $8 hold (s, s) pairs. V (token_pairs, two tokens a, b): scale $5..$8
    and zero $9..$12 are four copies of the word (s_a, s_b) loaded from the token-minor field.
    Each nibble is read in place by its magic (_MAGIC: lo 1024 + c, hi 64 + c), so the bytes b1 / b3 need the
    one shift: 13 instructions per word (shifting each nibble down to bit 0 took 15).
    """
    code = [
        "{ .reg .b32 t, u, s, z, m0, m2;",
        f"mov.b32 m0, {_MAGIC[0] * 0x10001:#010x};",
        f"mov.b32 m2, {_MAGIC[2] * 0x10001:#010x};",
        "shr.b32 u, $4, 8;",
    ]
    code.append("mov.b32 s, $5; mov.b32 z, $9;" if token_pairs else "mov.b32 s, $5; mov.b32 z, $7;")
    for i, (src, mask, magic) in enumerate((("$4", 0x000F000F, "m0"), ("u", 0x000F000F, "m0"),
                                            ("$4", 0x00F000F0, "m2"), ("u", 0x00F000F0, "m2"))):  # fmt: skip
        # lo b0/b2, lo b1/b3, hi b0/b2, hi b1/b3
        code.append(f"lop3.b32 t, {src}, {mask:#010x}, {magic}, 0xEA; sub.rn.f16x2 t, t, {magic};"
                    f"fma.rn.f16x2 ${i}, t, s, z;")  # fmt: skip
    code.append("}")
    return "\n".join(code)


def _asm_int2_values() -> str:
    """V rows of two tokens a, b: outputs c0..c3 (2 regs each); inputs word $8, scale $9..$12 and zero $13..$16
    (four copies each of the words (s_a, s_b), (z_a, z_b)).

    Crumb k at bit 2k is read in place by its magic (_MAGIC[k] + c), minus the magic leaves the exact code, then
    code * s + z in one fma: one shift per word (for bytes b1 / b3), 25 instructions per 16 values.
    """
    code = ["{ .reg .b32 t, u, s, z, m0, m1, m2, m3;"]
    code += [f"mov.b32 m{k}, {_MAGIC[k] * 0x10001:#010x};" for k in range(4)]
    code.append("mov.b32 s, $9; mov.b32 z, $13; shr.b32 u, $8, 8;")
    for k in range(4):
        for r, src in enumerate(("$8", "u")):
            mask = 0x00030003 << (2 * k)
            code.append(f"lop3.b32 t, {src}, {mask:#010x}, m{k}, 0xEA; sub.rn.f16x2 t, t, m{k};"
                        f"fma.rn.f16x2 ${2 * k + r}, t, s, z;")  # fmt: skip
    code.append("}")
    return "\n".join(code)


def _asm_int2_codes() -> str:
    """K row bytes of one token: outputs c0..c3 (2 regs each: pairs b0/b2, b1/b3); input word $8.

    Codes only, as exact fp16 integers: crumb k sits at bit 2k of its byte, so (x & 3 << 2k) | 0x6400 is the fp16
    1024 + c * 4^k and one subtraction leaves c * 4^k (one shift serves the high bytes). The 4^-k, the
    per-channel key scale and the zero are folded into q (see _step), so a pair costs two instructions.
    """
    code = ["{ .reg .b32 t, u, magic; mov.b32 magic, 0x64006400; shr.b32 u, $8, 8;"]
    for k in range(4):
        for r, src in enumerate(("$8", "u")):
            code.append(f"lop3.b32 t, {src}, {0x00030003 << (2 * k):#010x}, magic, 0xEA;"
                        f"sub.rn.f16x2 ${2 * k + r}, t, magic;")  # fmt: skip
    code.append("}")
    return "\n".join(code)


def _asm_fp8(token_pairs: bool) -> str:
    """fp8 E4M3 bytes -> fp16 pairs: outputs 2 regs, input word $2. K (one token, b0 b1 b2 b3): pairs (b0, b1),
    (b2, b3). V (token_pairs: a_x, a_x+1, b_x, b_x+1 of tokens a, b): pairs (a_x, b_x), (a_x+1, b_x+1)."""
    pair = "prmt.b32 t, $2, 0, 0x3120;" if token_pairs else "mov.b32 t, $2;"
    return "{ .reg .b16 lo, hi; .reg .b32 t; " + pair + " mov.b32 {lo, hi}, t; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"


def _asm_warp_any(n: int) -> str:
    """Outputs $0..$(n-1) all 1 if any input ($n..) of any lane of the warp is non-zero, else 0 (vote.any).

    The result is the same in every lane, so ``rescale`` can branch on it without diverging."""
    code = ["{ .reg .pred p, q;", f"setp.ne.s32 p, ${n}, 0;"]
    code += [f"setp.ne.s32 q, ${n + i}, 0; or.pred p, p, q;" for i in range(1, n)]
    code.append("vote.sync.any.pred p, p, 0xffffffff;")
    code += [f"selp.s32 ${i}, 1, 0, p;" for i in range(n)]
    code.append("}")
    return "\n".join(code)


def _asm_rescale(n: int) -> str:
    """Outputs $0..$(n-1) (tied to the first n inputs, fp32) times the next n inputs (fp32) where the flag input
    ($3n, warp-uniform: ``warp_any``) is non-zero; one uniform branch skips the n multiplies otherwise."""
    mul = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    return "{ .reg .pred p; setp.eq.s32 p, $" + str(3 * n) + ", 0; @p bra.uni SKIP${:uid}; " + mul + " SKIP${:uid}: }"


ASM_WARP_ANY2: gl.constexpr = gl.constexpr(_asm_warp_any(2))
ASM_WARP_ANY4: gl.constexpr = gl.constexpr(_asm_warp_any(4))
ASM_RESCALE: gl.constexpr = gl.constexpr(_asm_rescale(32))
ASM_RESCALE4: gl.constexpr = gl.constexpr(_asm_rescale(4))
# constraints: n fp32 outputs, the n inputs tied to them, n fp32 factors, n flags
CONS_RESCALE: gl.constexpr = gl.constexpr(",".join(["=f"] * 32 + [str(i) for i in range(32)] + ["f"] * 32 + ["r"] * 32))
CONS_RESCALE4: gl.constexpr = gl.constexpr(",".join(["=f"] * 4 + [str(i) for i in range(4)] + ["f"] * 4 + ["r"] * 4))


ASM_FP8_K: gl.constexpr = gl.constexpr(_asm_fp8(False))
ASM_FP8_V: gl.constexpr = gl.constexpr(_asm_fp8(True))
ASM_E2M1_K: gl.constexpr = gl.constexpr(_asm_e2m1(False))
ASM_E2M1_V: gl.constexpr = gl.constexpr(_asm_e2m1(True))
ASM_E2M1_K_CVT: gl.constexpr = gl.constexpr(_asm_e2m1_cvt(False))  # sm_100a / sm_120a only
ASM_E2M1_V_CVT: gl.constexpr = gl.constexpr(_asm_e2m1_cvt(True))
ASM_INT4_K: gl.constexpr = gl.constexpr(_asm_int4(False))
ASM_INT4_V: gl.constexpr = gl.constexpr(_asm_int4(True))
ASM_INT2_K: gl.constexpr = gl.constexpr(_asm_int2_codes())
ASM_INT2_V: gl.constexpr = gl.constexpr(_asm_int2_values())

# ----------------------------------------------------------------------------
# layouts (built on the host or at compile time, passed as constexpr)
# ----------------------------------------------------------------------------


@gluon.constexpr_function
def _bits(n: int) -> int:
    return n.bit_length() - 1


@gluon.constexpr_function
def _warp_bases(w: int, rank: int) -> list[list[int]]:
    return [[1 << i] + [0] * (rank - 1) for i in range(_bits(w))]


@gluon.constexpr_function
def _basis(rank: int, dim: int, value: int) -> list[int]:
    b = [0] * rank
    b[dim] = value
    return b


def v_layouts(w: int, nt: int, groups: int, per_group: int, per_thread: int) -> tuple[Any, Any]:
    """(load, unpack) layouts of V bytes [W, NT, groups, per_group]; thread (g, c) holds per_thread contiguous
    bytes of tokens 2c, 2c+1, 2c+8, 2c+9 (+16...), lanes g spread over the D/8-channel slices.

    The unpack layout only reorders registers so a pack of 4 is (a_x, a_x+1, b_x, b_x+1) for tokens a, b.
    """
    r = 4
    byte_regs = [_basis(r, 3, 1 << i) for i in range(_bits(per_thread))]
    tok_regs = [_basis(r, 1, 1)] + [_basis(r, 1, 8 << i) for i in range(_bits(nt // 8))]
    # lanes: c -> tokens 2, 4; g -> the next three byte bits (within a group, then across groups)
    g_bits = []
    v = per_thread
    for _ in range(3):
        g_bits.append(_basis(r, 3, v) if v < per_group else _basis(r, 2, v // per_group))
        v *= 2
    lanes = [_basis(r, 1, 2), _basis(r, 1, 4)] + g_bits
    shape = [w, nt, groups, per_group]
    load = gl.DistributedLinearLayout(byte_regs + tok_regs, lanes, _warp_bases(w, r), [], shape)
    unpack = gl.DistributedLinearLayout(byte_regs[:1] + tok_regs[:1] + byte_regs[1:] + tok_regs[1:], lanes,
                                        _warp_bases(w, r), [], shape)  # fmt: skip
    return load, unpack


@gluon.constexpr_function
def pair_layout(unpack: Any) -> Any:
    """[W, NT/2, groups] layout of one word per V token pair (2c, 2c+1): V's unpack layout without the byte
    dimension and token bit 0 (the two tokens whose bytes share an unpacker word)."""

    def cut(b: list[int]) -> list[int]:
        return [b[0], b[1] // 2, b[2]]

    regs = [cut(b) for b in unpack.reg_bases if b[3] == 0 and b[1] != 1]
    s = unpack.shape
    return gl.DistributedLinearLayout(regs, [cut(b) for b in unpack.lane_bases], [cut(b) for b in unpack.warp_bases],
                                      [], [s[0], s[1] // 2, s[2]])  # fmt: skip


@gluon.constexpr_function
def chan_layout(w: int, hp: int) -> Any:
    """Layout [W, D, HP] of one INT2 page's per-channel key scales or zeros, repeated for every head column.

    Thread c of every lane group g loads the 32 contiguous channels c*32 .. c*32+31 (four 16-byte vectors);
    the g lanes (the heads) repeat them. Channel bits 0..6 relabel to (crumb, k) as the unpacker's order
    dictates (crumbs), and then each crumb's tensor is exactly the B-operand layout, rows
    k = (ch4, ch2, ch6, ch5, ch3).
    """
    regs = [_basis(3, 1, 1 << i) for i in range(5)] + ([_basis(3, 2, 8)] if hp > 8 else [])
    lanes = [_basis(3, 1, 32), _basis(3, 1, 64)] + [_basis(3, 2, 1 << i) for i in range(3)]
    return gl.DistributedLinearLayout(regs, lanes, _warp_bases(w, 3), [], [w, 128, hp])


# ----------------------------------------------------------------------------
# relabelling registers (all free: reshape / permute / split, checked by assert_trivial)
# ----------------------------------------------------------------------------


@gluon.jit
def idx3(L: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr):
    """Broadcastable int32 index tensors [S0,1,1], [1,S1,1], [1,1,S2] in layout L."""
    i0 = gl.arange(0, S0, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    i1 = gl.arange(0, S1, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    i2 = gl.arange(0, S2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    return (gl.expand_dims(gl.expand_dims(i0, 1), 2), gl.expand_dims(gl.expand_dims(i1, 0), 2),
            gl.expand_dims(gl.expand_dims(i2, 0), 1))  # fmt: skip


@gluon.jit
def idx4(L: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S3: gl.constexpr):
    """Broadcastable int32 index tensors of a 4-D layout L."""
    i0 = gl.arange(0, S0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    i1 = gl.arange(0, S1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))
    i2 = gl.arange(0, S2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))
    i3 = gl.arange(0, S3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))
    e0 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i0, 1), 2), 3)
    e1 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i1, 0), 2), 3)
    e2 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i2, 0), 1), 3)
    e3 = gl.expand_dims(gl.expand_dims(gl.expand_dims(i3, 0), 1), 2)
    return e0, e1, e2, e3


@gluon.jit
def as_a_rows(x, W: gl.constexpr, NT: gl.constexpr, KB: gl.constexpr, A: gl.constexpr):
    """K halves [W, NT, KB] in the byte layout (thread c holds bytes c*KB/4 .. +KB/4, unpacked as b0 b2 b1 b3)
    -> the A operand, relabelling byte j to k = (j >> 1 & (KB/8 - 1)) << 3 | (j >> R) << 1 | (j & 1)."""
    y = gl.reshape(x, [W, NT, 4, KB // 8, 2])
    y = gl.permute(y, [0, 1, 3, 2, 4])
    return gl.convert_layout(gl.reshape(y, [W, NT, KB]), A, assert_trivial=True)


@gluon.jit
def fp8_as_a_rows(x, W: gl.constexpr, NT: gl.constexpr, A: gl.constexpr):
    """fp8 K rows converted in place [W, NT, 128] (thread c holds bytes c*32 .. c*32+31 of its tokens, in order)
    -> the A operand: byte j = c*32 + kstep*4 + half*2 + e becomes k = kstep*16 + half*8 + c*2 + e."""
    y = gl.reshape(x, [W, NT, 4, 8, 2, 2])
    y = gl.permute(y, [0, 1, 3, 4, 2, 5])
    return gl.convert_layout(gl.reshape(y, [W, NT, 128]), A, assert_trivial=True)


@gluon.jit
def q_k_dims(k, KB: gl.constexpr, PER: gl.constexpr, PIECE: gl.constexpr):
    """Channel of logical k (0..KB-1) of piece PIECE (nibble / crumb index): the inverse of as_a_rows and of the
    unpackers' b0 b2 b1 b3 order; PER = values per byte (2 or 4)."""
    R: gl.constexpr = KB // 4  # bytes per thread
    if PER == 1:  # fp8: the inverse of fp8_as_a_rows, one value per byte
        ch = ((k >> 1) & 3) * R + (k >> 4) * 4 + ((k >> 3) & 1) * 2 + (k & 1)
    else:
        j = ((k >> 1) & 3) * R + ((k >> 3) << 1) + (k & 1)
        byte = (j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1)
        ch = byte * PER + PIECE
    return ch


@gluon.jit
def unpack_nibbles(x, scale, zero, FMT: gl.constexpr, TOKEN_PAIRS: gl.constexpr, E2M1_CVT: gl.constexpr = 0):
    """Packed nvfp4 / int4 bytes [W, NT, groups, bytes] and per-group scale (zero) [W, NT, groups] -> (lo, hi)
    fp16 halves, each 4-pack in the unpackers' order (K: b0 b2 b1 b3 of one token; V: two tokens' bytes).
    E2M1_CVT: nvfp4 by cvt.rn.f16x2.e2m1x2 (Blackwell), the same values."""
    if FMT == GL_FMT_NVFP4 and TOKEN_PAIRS and E2M1_CVT:
        lo, hi = gl.inline_asm_elementwise(ASM_E2M1_V_CVT, "=r,=r,=r,=r,r,r,r,r,r",
                                           [x, gl.expand_dims(scale_pairs(scale), 3)], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=4)  # fmt: skip
    elif FMT == GL_FMT_NVFP4 and E2M1_CVT:
        lo, hi = gl.inline_asm_elementwise(ASM_E2M1_K_CVT, "=r,=r,=r,=r,r,r,r",
                                           [x, gl.expand_dims(scale, 3)], dtype=(gl.float16, gl.float16), is_pure=True,
                                           pack=4)  # fmt: skip
    elif FMT == GL_FMT_NVFP4 and TOKEN_PAIRS:  # one (s_a, s_b) word per token pair, made once, not per unpacked word
        lo, hi = gl.inline_asm_elementwise(ASM_E2M1_V, "=r,=r,=r,=r,r,r,r,r,r",
                                           [x, gl.expand_dims(scale_pairs(scale), 3)], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=4)  # fmt: skip
    elif FMT == GL_FMT_NVFP4:
        lo, hi = gl.inline_asm_elementwise(ASM_E2M1_K, "=r,=r,=r,=r,r,r,r",
                                           [x, gl.expand_dims(scale, 3)], dtype=(gl.float16, gl.float16), is_pure=True,
                                           pack=4)  # fmt: skip
    elif TOKEN_PAIRS:  # scale / zero: int32 words (s_a, s_b) per token pair (pairs_to_tokens)
        lo, hi = gl.inline_asm_elementwise(ASM_INT4_V, "=r,=r,=r,=r,r" + ",r" * 8,
                                           [x, gl.expand_dims(scale, 3), gl.expand_dims(zero, 3)],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
    else:
        lo, hi = gl.inline_asm_elementwise(ASM_INT4_K, "=r,=r,=r,=r,r,r,r,r,r",
                                           [x, gl.expand_dims(scale, 3), gl.expand_dims(zero, 3)],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
    return lo, hi


@gluon.jit
def scale_pairs(s):
    """fp16 per-token scales [W, NT, groups] whose token bit 0 is the layout's first register bit (V's unpack
    layout) -> int32 [W, NT, groups]: both tokens of a pair (2i, 2i+1) hold the word (s_2i, s_2i+1), which the
    e2m1 V unpacker multiplies by as is (the two halves already sit in one register: pack=2, no prmt)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $2; mov.b32 $1, $2;", "=r,=r,r", [s], dtype=gl.int32,
                                     is_pure=True, pack=2)  # fmt: skip


@gluon.jit
def swap_t0_j0(x, W: gl.constexpr, NT: gl.constexpr, KB: gl.constexpr):
    """Unpacked V [W, NT, KB] whose 4-packs are (a_x, b_x, a_x+1, b_x+1) -> tensor indexed by (token, byte)."""
    y = gl.reshape(x, [W, NT // 2, 2, KB // 2, 2])
    y = gl.permute(y, [0, 1, 4, 3, 2])
    return gl.reshape(y, [W, NT, KB])


@gluon.jit
def as_a_channels(x, W: gl.constexpr, NT: gl.constexpr, D: gl.constexpr, A: gl.constexpr):
    """V [W, NT, D] (channels in memory order; thread g holds channels g*D/8 ..) -> A operand V^T [W, D, NT],
    row m = channel (m & 7) * D/8 + (m >> 3)."""
    y = gl.permute(x, [0, 2, 1])
    y = gl.reshape(y, [W, 8, D // 8, NT])
    y = gl.permute(y, [0, 2, 1, 3])
    return gl.convert_layout(gl.reshape(y, [W, D, NT]), A, assert_trivial=True)


@gluon.jit
def crumbs(x, B: gl.constexpr, W: gl.constexpr, HP: gl.constexpr):
    """Per-channel vector [W, D, HP] in chan_layout -> one [W, 32, HP] tensor per crumb in the B-operand layout,
    row k = (ch4, ch2, ch6, ch5, ch3) of channel ch = (byte << 2) | crumb (the inverse of q_k_dims)."""
    y = gl.reshape(x, [W, 2, 2, 2, 2, 2, 2, 2, HP])  # dims 1..7: ch6 .. ch0
    y = gl.permute(y, [0, 3, 5, 1, 2, 4, 8, 6, 7])
    e, o = gl.split(gl.reshape(y, [W, 32, HP, 2, 2]))  # ch0
    c0, c2 = gl.split(e)  # ch1
    c1, c3 = gl.split(o)
    return (gl.convert_layout(c0, B, assert_trivial=True), gl.convert_layout(c1, B, assert_trivial=True),
            gl.convert_layout(c2, B, assert_trivial=True), gl.convert_layout(c3, B, assert_trivial=True))  # fmt: skip


@gluon.jit
def pairs_to_tokens(x, W: gl.constexpr, NT: gl.constexpr, L: gl.constexpr):
    """[W, NT/2, groups] words of token pairs -> [W, NT, groups] (both tokens of a pair hold the word) in L."""
    y = gl.permute(gl.join(x, x), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(y, [W, NT, y.shape[3]]), L, assert_trivial=True)


@gluon.jit
def two_tiles(x, W: gl.constexpr, HP: gl.constexpr, MMA: gl.constexpr):
    """[W, 16, HP] accumulator -> [W, 32, HP], both row tiles the same (a per-page term of every token)."""
    y = gl.permute(gl.join(x, x), [0, 3, 1, 2])
    return gl.convert_layout(gl.reshape(y, [W, 32, HP]), MMA, assert_trivial=True)


@gluon.jit
def warp_any(x, PER_THREAD: gl.constexpr):
    """int32 [W, HP] (PER_THREAD elements a thread, the warp's heads) -> 1 everywhere in a warp where any element
    of that warp is non-zero, else 0: one vote, no shuffles."""
    if PER_THREAD == 2:
        return gl.inline_asm_elementwise(ASM_WARP_ANY2, "=r,=r,r,r", [x], dtype=gl.int32, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(ASM_WARP_ANY4, "=r,=r,=r,=r,r,r,r,r", [x], dtype=gl.int32, is_pure=True,
                                         pack=4)  # fmt: skip


@gluon.jit
def rescale(acc, alpha, flag, PACK: gl.constexpr):
    """acc * alpha (fp32, alpha broadcast to acc's shape) where the warp-uniform flag is set, else acc unchanged,
    skipping the multiplies by a uniform branch (``_asm_rescale``): the online softmax's ``acc *= alpha`` costs
    nothing in the steps where no row's reference max moved. PACK: 32 (the [W, D, HP] accumulator) or 4 (l's)."""
    if PACK == 32:
        return gl.inline_asm_elementwise(ASM_RESCALE, CONS_RESCALE, [acc, alpha, flag], dtype=gl.float32,
                                         is_pure=True, pack=32)  # fmt: skip
    else:
        return gl.inline_asm_elementwise(ASM_RESCALE4, CONS_RESCALE4, [acc, alpha, flag], dtype=gl.float32,
                                         is_pure=True, pack=4)  # fmt: skip


@gluon.jit
def weave_a(xs, A: gl.constexpr):
    """A tuple of 2 or 4 A operands [W, M, K] -> one A operand [W, M, n*K] whose k-step s*n + i is k-step s of
    xs[i]: an mma over it takes the n pieces of one unpacked word (the nibbles or crumbs that one unpacker call
    makes) one after the other, so the pieces of a word die together instead of waiting for a whole operand's
    mma chain."""
    N: gl.constexpr = len(xs)
    W: gl.constexpr = xs[0].shape[0]
    M: gl.constexpr = xs[0].shape[1]
    K: gl.constexpr = xs[0].shape[2]
    if N == 2:
        y = gl.reshape(gl.join(xs[0], xs[1]), [W, M, K // 16, 16, 2])
        y = gl.permute(y, [0, 1, 2, 4, 3])
    else:
        y = gl.reshape(gl.join(gl.join(xs[0], xs[1]), gl.join(xs[2], xs[3])), [W, M, K // 16, 16, 2, 2])
        y = gl.permute(y, [0, 1, 2, 5, 4, 3])
    return gl.convert_layout(gl.reshape(y, [W, M, N * K]), A, assert_trivial=True)


@gluon.jit
def weave_b(xs, B: gl.constexpr):
    """A tuple of 2 or 4 B operands [W, K, HP] -> one B operand [W, n*K, HP] in weave_a's k order."""
    N: gl.constexpr = len(xs)
    W: gl.constexpr = xs[0].shape[0]
    K: gl.constexpr = xs[0].shape[1]
    HP: gl.constexpr = xs[0].shape[2]
    if N == 2:
        y = gl.reshape(gl.join(xs[0], xs[1]), [W, K // 16, 16, HP, 2])
        y = gl.permute(y, [0, 1, 4, 2, 3])
    else:
        y = gl.reshape(gl.join(gl.join(xs[0], xs[1]), gl.join(xs[2], xs[3])), [W, K // 16, 16, HP, 2, 2])
        y = gl.permute(y, [0, 1, 5, 4, 2, 3])
    return gl.convert_layout(gl.reshape(y, [W, N * K, HP]), B, assert_trivial=True)
