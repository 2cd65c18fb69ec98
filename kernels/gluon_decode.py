"""Gluon decode attention for packed pages (nvfp4, triaxial INT4 and INT2): unpacked straight into tensor-core fragments.

Why a second decode kernel: the ``tl`` kernels in ``triton_decode.py`` dequantize
a tile in a blocked layout and Triton then moves the fp16 tile through shared
memory into the ``mma`` operand layout; for 4- and 2-bit pages that round trip
costs more than reading the bytes (bench/NOTES-kernels.md). Gluon lets the
kernel choose every layout, so here each thread loads exactly the bytes whose
values its ``mma.m16n8k16`` fragments hold, unpacks them with a few integer ops
and one ``f16x2`` multiply (or fma) per pair, and hands the registers to the
tensor core: no shared memory in the loop.

One program = one (split, kv head, sequence), W warps. Each warp runs its own
online softmax over its own pages (NT = pages-per-warp x page-size tokens per
step) and the warps merge by log-sum-exp at the end; the splits merge in
``triton_decode._merge_kernel``. Per warp and step::

    S^T[NT, HP] = K[NT, D] . q^T[D, HP]         K: A operand (rows = tokens), HP = query heads padded to 8
    O^T[D, HP] += V^T[D, NT] . P^T[NT, HP]      V^T: A operand (rows = channels), P^T: B operand

A-operand fragments of m16n8k16 hold, in thread (g = lane / 4, c = lane % 4),
rows g and g+8 and the column pairs (2c, 2c+1), (2c+8, 2c+9) of every 16-wide
k step. The contraction order is free (q is permuted to match) and so is the
row order of O^T (un-permuted at the store), so the kernel picks both to make
every thread's bytes contiguous:

    K rows (tokens g, g+8, ...):  thread c loads bytes [c*KB/4, (c+1)*KB/4) of the token's row (16 bytes = 32
                                  nvfp4/int4 values or 8 bytes = 32 INT2 values): one nvfp4 block pair or one
                                  INT4/INT2 group, so one block scale (or one scale + zero) per register;
    V^T rows (channels):          thread g owns channels [g*D/8, (g+1)*D/8) = 8 bytes of nvfp4/int4 or 4 of INT2
                                  of tokens 2c, 2c+1, 2c+8, 2c+9 (+16): an mma register pairs two *tokens*, so
                                  the unpacker takes bytes of two tokens in one 32-bit word.

Unpacking one 32-bit word ``x`` (bytes b0 b1 b2 b3) makes fp16 pairs from
bytes (b0, b2) and (b1, b3), whose nibbles sit 16 bits apart, so one mask and
one shift serve both halves::

    nvfp4 nibble s e1 e0 m -> fp16 bits s 0 0 e1 e0 m 0..0  (= e2m1 * 2^-14), times (block scale * 2^7)
    int4 / int2 value c    -> fp16 0x6400 | c (= 1024 + c), minus 1024, times scale plus zero
    INT2 key c (crumb k)   -> fp16 0x6400 | c << 2k, minus 1024: the exact integer c * 4^k; the page's
                              per-channel scale (and 4^-k) is folded into q once per page, its zero into
                              one per-page term (see _step), so a key pair costs two instructions

The register order that results (b0, b2, b1, b3) is relabelled with
reshape / permute, which Triton proves free (``assert_trivial``) at compile time.
Value scales and zeros of int4 / int2 pages are stored token-minor (layout.py):
one 32-bit load gives the (s_a, s_b) pair of the two tokens an unpacker word holds.

Supported: head_dim 128, up to 16 query heads per kv head, page size 16
(nvfp4) or 32 (triaxial); anything else, and the interpreter, uses
``triton_decode``. The unpackers are PTX, so these kernels run on a GPU only
(sm_80+: ``mma.sync``; sm_89+ for the E4M3 scale conversion);
``tests/kernels/test_gluon_decode.py`` compiles them for sm_90 on CPU and the
gpu tests hold them to the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .layout import INT2_PAGE_FLAG, PageLayout

GL_FMT_NVFP4: gl.constexpr = gl.constexpr(0)
GL_FMT_INT4: gl.constexpr = gl.constexpr(1)
GL_FMT_INT2: gl.constexpr = gl.constexpr(2)
FLAG: gl.constexpr = gl.constexpr(INT2_PAGE_FLAG)
LOG2E = 1.4426950408889634
NVFP4_FOLD = 128.0  # nvfp4 values decode to value * 2^-7


# ----------------------------------------------------------------------------
# unpackers (PTX). Operands: outputs first ($0..), then the packed word, then
# scale (and zero) registers; each fp16 operand of pack=4 is two registers.
# ----------------------------------------------------------------------------

# nvfp4 nibble pairs of one word: (mask, shift of the magnitude, mask, shift of the sign); shift < 0 = right
_E2M1_PAIRS = (
    (0x00070007, 9, 0x00080008, 12),  # lo nibbles of b0, b2
    (0x07000700, 1, 0x08000800, 4),  # lo nibbles of b1, b3
    (0x00700070, 5, 0x00800080, 8),  # hi nibbles of b0, b2
    (0x70007000, -3, 0x80008000, 0),  # hi nibbles of b1, b3
)


def _shift(dst: str, src: str, n: int) -> str:
    if n > 0:
        return f"shl.b32 {dst}, {src}, {n};"
    if n < 0:
        return f"shr.b32 {dst}, {src}, {-n};"
    return f"mov.b32 {dst}, {src};"


def _asm_e2m1(token_pairs: bool) -> str:
    """Outputs lo (2 regs: pairs of b0/b2, b1/b3), hi (2 regs); inputs word $4, scale $5 $6.

    token_pairs: the word holds (a0, a1, b0, b1) of two tokens a, b whose scales arrive as (sa, sa), (sb, sb);
    a prmt makes (sa, sb). Otherwise all four bytes share one scale.
    """
    code = ["{ .reg .b32 a, b, s;"]
    code.append("prmt.b32 s, $5, $6, 0x5410;" if token_pairs else "mov.b32 s, $5;")
    for i, (mm, ms, sm, ss) in enumerate(_E2M1_PAIRS):
        dst = ("$0", "$1", "$2", "$3")[i]
        code.append(f"and.b32 a, $4, {mm:#010x};" + _shift("a", "a", ms))
        code.append(f"and.b32 b, $4, {sm:#010x};" + _shift("b", "b", ss))
        code.append(f"or.b32 a, a, b; mul.rn.f16x2 {dst}, a, s;")
    code.append("}")
    return "\n".join(code)


def _asm_int4(token_pairs: bool) -> str:
    """Outputs lo (2 regs), hi (2 regs); inputs word $4, then scale and zero; code * scale + zero.

    K (one token): scale $5 $6 and zero $7 $8 hold (s, s) pairs. V (token_pairs, two tokens a, b): scale $5..$8
    and zero $9..$12 are four copies of the word (s_a, s_b) loaded from the token-minor field.
    """
    code = ["{ .reg .b32 t, s, z, magic; mov.b32 magic, 0x64006400;"]
    code.append("mov.b32 s, $5; mov.b32 z, $9;" if token_pairs else "mov.b32 s, $5; mov.b32 z, $7;")
    for i, shift in enumerate((0, 8, 4, 12)):  # lo b0/b2, lo b1/b3, hi b0/b2, hi b1/b3
        code.append(
            _shift("t", "$4", -shift) + "lop3.b32 t, t, 0x000F000F, magic, 0xEA;"
            f"sub.rn.f16x2 t, t, magic; fma.rn.f16x2 ${i}, t, s, z;"
        )
    code.append("}")
    return "\n".join(code)


def _asm_int2_values() -> str:
    """V rows of two tokens a, b: outputs c0..c3 (2 regs each); inputs word $8, scale $9..$12 and zero $13..$16
    (four copies each of the words (s_a, s_b), (z_a, z_b)).

    Crumb k at bit 2k: the odd crumbs are taken in place as c * 4 (exact fp16 integers) and scaled by s / 4, so
    one shift serves two crumbs (s / 4 is exact unless s < 2^-12, where fp16 subnormals round it by < 2^-25
    absolute, far below the INT2 step s).
    """
    code = ["{ .reg .b32 t, u0, u1, s, s4, z, magic; mov.b32 magic, 0x64006400; mov.b32 s4, 0x34003400;"]
    code.append("mov.b32 s, $9; mov.b32 z, $13; mul.rn.f16x2 s4, s, s4;")
    for k in range(4):
        for r in range(2):
            if k % 2 == 0:
                code.append(_shift(f"u{r}", "$8", -(2 * k + 8 * r)))
            mask = 0x00030003 << (2 * (k % 2))
            code.append(f"lop3.b32 t, u{r}, {mask:#010x}, magic, 0xEA; sub.rn.f16x2 t, t, magic;"
                        f"fma.rn.f16x2 ${2 * k + r}, t, {'s4' if k % 2 else 's'}, z;")  # fmt: skip
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


ASM_E2M1_K: gl.constexpr = gl.constexpr(_asm_e2m1(False))
ASM_E2M1_V: gl.constexpr = gl.constexpr(_asm_e2m1(True))
ASM_INT4_K: gl.constexpr = gl.constexpr(_asm_int4(False))
ASM_INT4_V: gl.constexpr = gl.constexpr(_asm_int4(True))
ASM_INT2_K: gl.constexpr = gl.constexpr(_asm_int2_codes())
ASM_INT2_V: gl.constexpr = gl.constexpr(_asm_int2_values())


# ----------------------------------------------------------------------------
# layouts (built on the host, passed as constexpr)
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
    dictates (_crumbs), and then each crumb's tensor is exactly the B-operand layout, rows
    k = (ch4, ch2, ch6, ch5, ch3).
    """
    regs = [_basis(3, 1, 1 << i) for i in range(5)] + ([_basis(3, 2, 8)] if hp > 8 else [])
    lanes = [_basis(3, 1, 32), _basis(3, 1, 64)] + [_basis(3, 2, 1 << i) for i in range(3)]
    return gl.DistributedLinearLayout(regs, lanes, _warp_bases(w, 3), [], [w, 128, hp])


# ----------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------


@gluon.jit
def _idx3(L: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr):
    """Broadcastable int32 index tensors [S0,1,1], [1,S1,1], [1,1,S2] in layout L."""
    i0 = gl.arange(0, S0, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    i1 = gl.arange(0, S1, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    i2 = gl.arange(0, S2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    return (gl.expand_dims(gl.expand_dims(i0, 1), 2), gl.expand_dims(gl.expand_dims(i1, 0), 2),
            gl.expand_dims(gl.expand_dims(i2, 0), 1))  # fmt: skip


@gluon.jit
def _idx4(L: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, S3: gl.constexpr):
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
def _rows(pt_row_ptr, base, page_hi, num_tokens, h, total_bytes, wi, ni,
          P: gl.constexpr, PPW: gl.constexpr, PAGE_BYTES: gl.constexpr, INT2: gl.constexpr):  # fmt: skip
    """Page byte offset (int64), row index inside a [H, P, ...] field and validity of each token (wi, ni)."""
    pidx = base + wi * PPW + ni // P
    slot = ni % P
    inb = pidx < page_hi
    ok = inb & (pidx * P + slot < num_tokens)
    pid = gl.load(pt_row_ptr + pidx, mask=inb, other=0)
    if INT2:
        off = total_bytes - ((pid & ~FLAG) + 1).to(gl.int64) * PAGE_BYTES
    else:
        off = pid.to(gl.int64) * PAGE_BYTES
    return off, h * P + slot, ok


@gluon.jit
def _int2_page(pt_row_ptr, pidx, page_hi, h, buf_ptr, total_bytes, PAGE_BYTES: gl.constexpr, FIELD: gl.constexpr):
    """fp16 pointer to kv head h's row of a per-channel field of INT2 page pidx (page ids grow from the top)."""
    pid = gl.load(pt_row_ptr + pidx, mask=pidx < page_hi, other=0)
    page = buf_ptr + total_bytes - ((pid & ~FLAG) + 1).to(gl.int64) * PAGE_BYTES + FIELD
    return page.to(gl.pointer_type(gl.float16), bitcast=True) + h * 128


@gluon.jit
def _as_a_rows(x, W: gl.constexpr, NT: gl.constexpr, KB: gl.constexpr, A: gl.constexpr):
    """K halves [W, NT, KB] in the byte layout (thread c holds bytes c*KB/4 .. +KB/4, unpacked as b0 b2 b1 b3)
    -> the A operand, relabelling byte j to k = (j >> 1 & (KB/8 - 1)) << 3 | (j >> R) << 1 | (j & 1)."""
    y = gl.reshape(x, [W, NT, 4, KB // 8, 2])
    y = gl.permute(y, [0, 1, 3, 2, 4])
    return gl.convert_layout(gl.reshape(y, [W, NT, KB]), A, assert_trivial=True)


@gluon.jit
def _q_k_dims(k, KB: gl.constexpr, PER: gl.constexpr, PIECE: gl.constexpr):
    """Channel of logical k (0..KB-1) of piece PIECE (nibble / crumb index): the inverse of _as_a_rows and of the
    unpackers' b0 b2 b1 b3 order; PER = values per byte (2 or 4)."""
    R: gl.constexpr = KB // 4  # bytes per thread
    j = ((k >> 1) & 3) * R + ((k >> 3) << 1) + (k & 1)
    byte = (j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1)
    return byte * PER + PIECE


@gluon.jit
def _unpack_nibbles(x, scale, zero, FMT: gl.constexpr, TOKEN_PAIRS: gl.constexpr):
    """Packed nvfp4 / int4 bytes [W, NT, groups, bytes] and per-group scale (zero) [W, NT, groups] -> (lo, hi)
    fp16 halves, each 4-pack in the unpackers' order (K: b0 b2 b1 b3 of one token; V: two tokens' bytes)."""
    if FMT == GL_FMT_NVFP4:
        lo, hi = gl.inline_asm_elementwise(ASM_E2M1_V if TOKEN_PAIRS else ASM_E2M1_K, "=r,=r,=r,=r,r,r,r",
                                           [x, gl.expand_dims(scale, 3)], dtype=(gl.float16, gl.float16), is_pure=True,
                                           pack=4)  # fmt: skip
    elif TOKEN_PAIRS:  # scale / zero: int32 words (s_a, s_b) per token pair (_pairs_to_tokens)
        lo, hi = gl.inline_asm_elementwise(ASM_INT4_V, "=r,=r,=r,=r,r" + ",r" * 8,
                                           [x, gl.expand_dims(scale, 3), gl.expand_dims(zero, 3)],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
    else:
        lo, hi = gl.inline_asm_elementwise(ASM_INT4_K, "=r,=r,=r,=r,r,r,r,r,r",
                                           [x, gl.expand_dims(scale, 3), gl.expand_dims(zero, 3)],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
    return lo, hi


@gluon.jit
def _swap_t0_j0(x, W: gl.constexpr, NT: gl.constexpr, KB: gl.constexpr):
    """Unpacked V [W, NT, KB] whose 4-packs are (a_x, b_x, a_x+1, b_x+1) -> tensor indexed by (token, byte)."""
    y = gl.reshape(x, [W, NT // 2, 2, KB // 2, 2])
    y = gl.permute(y, [0, 1, 4, 3, 2])
    return gl.reshape(y, [W, NT, KB])


@gluon.jit
def _as_a_channels(x, W: gl.constexpr, NT: gl.constexpr, D: gl.constexpr, A: gl.constexpr):
    """V [W, NT, D] (channels in memory order; thread g holds channels g*D/8 ..) -> A operand V^T [W, D, NT],
    row m = channel (m & 7) * D/8 + (m >> 3)."""
    y = gl.permute(x, [0, 2, 1])
    y = gl.reshape(y, [W, 8, D // 8, NT])
    y = gl.permute(y, [0, 2, 1, 3])
    return gl.convert_layout(gl.reshape(y, [W, D, NT]), A, assert_trivial=True)


@gluon.jit
def _crumbs(x, B: gl.constexpr, W: gl.constexpr, HP: gl.constexpr):
    """Per-channel vector [W, D, HP] in chan_layout -> one [W, 32, HP] tensor per crumb in the B-operand layout,
    row k = (ch4, ch2, ch6, ch5, ch3) of channel ch = (byte << 2) | crumb (the inverse of _q_k_dims)."""
    y = gl.reshape(x, [W, 2, 2, 2, 2, 2, 2, 2, HP])  # dims 1..7: ch6 .. ch0
    y = gl.permute(y, [0, 3, 5, 1, 2, 4, 8, 6, 7])
    e, o = gl.split(gl.reshape(y, [W, 32, HP, 2, 2]))  # ch0
    c0, c2 = gl.split(e)  # ch1
    c1, c3 = gl.split(o)
    return (gl.convert_layout(c0, B, assert_trivial=True), gl.convert_layout(c1, B, assert_trivial=True),
            gl.convert_layout(c2, B, assert_trivial=True), gl.convert_layout(c3, B, assert_trivial=True))  # fmt: skip


@gluon.jit
def _pairs_to_tokens(x, W: gl.constexpr, NT: gl.constexpr, L: gl.constexpr):
    """[W, NT/2, groups] words of token pairs -> [W, NT, groups] (both tokens of a pair hold the word) in L."""
    y = gl.permute(gl.join(x, x), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(y, [W, NT, y.shape[3]]), L, assert_trivial=True)


@gluon.jit
def _two_tiles(x, W: gl.constexpr, HP: gl.constexpr, MMA: gl.constexpr):
    """[W, 16, HP] accumulator -> [W, 32, HP], both row tiles the same (a per-page term of every token)."""
    y = gl.permute(gl.join(x, x), [0, 3, 1, 2])
    return gl.convert_layout(gl.reshape(y, [W, 32, HP]), MMA, assert_trivial=True)


@gluon.jit
def _load_q_piece(q_row_ptr, G, KB: gl.constexpr, PER: gl.constexpr, PIECE: gl.constexpr, W: gl.constexpr,
                  HP: gl.constexpr, B: gl.constexpr, SCALE: gl.constexpr):  # fmt: skip
    """q^T piece [W, KB, HP] (same for every warp) times SCALE in the B-operand layout, rows in the kernel's k order."""
    wi, ki, hi = _idx3(B, W, KB, HP)
    ch = _q_k_dims(ki, KB, PER, PIECE)
    q = gl.load(q_row_ptr + hi * 128 + ch + wi * 0, mask=(hi < G) & (wi >= 0), other=0.0)
    return (q.to(gl.float32) * SCALE).to(gl.float16)


@gluon.jit
def _load_step(pt_row, base, hi, num_tokens, h, buf_ptr, total_bytes, FMT: gl.constexpr, P: gl.constexpr,
               PPW: gl.constexpr, HP: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
               KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
               VZ_OFF: gl.constexpr, LV_LOAD: gl.constexpr, LV_UNPACK: gl.constexpr):  # fmt: skip
    """The bytes of one step (pages base + w*PPW .. of warp w), raw: (K bytes, V bytes, K scales, K zeros,
    V scales, V zeros); tokens past the split or the sequence read as 0."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = D // 4 if INT2 else D // 2  # bytes per token row
    # K bytes: thread c holds KB/4 contiguous bytes of tokens g, g+8, ...: [W, NT, groups, bytes per group]
    # bytes per scale group: an E4M3-scaled block (nvfp4), a 32-channel group (INT4), a thread's row share (INT2)
    KG: gl.constexpr = 8 if FMT == GL_FMT_NVFP4 else (16 if FMT == GL_FMT_INT4 else KB // 4)
    NGR: gl.constexpr = D // 32  # INT4 / INT2 scale groups per row
    LK: gl.constexpr = gl.BlockedLayout([1, 1, (KB // 4) // KG, KG], [1, 8, 4, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    LK3: gl.constexpr = gl.BlockedLayout([1, 1, KB // 4], [1, 8, 4], [W, 1, 1], [2, 1, 0])
    kw, kn, kj = _idx3(LK3, W, NT, KB)  # loaded as 3-D rows: one 16-byte (8 for INT2) vector per token
    koff, krow, kok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, kw, kn, P, PPW, PAGE_BYTES, INT2)
    kb = gl.load(buf_ptr + koff + K_OFF + krow * KB + kj, mask=kok, other=0)
    if not INT2:
        kb = gl.convert_layout(gl.reshape(kb, [W, NT, KB // KG, KG]), LK, assert_trivial=True)
    # V bytes [W, NT, groups, bytes per group] in the channel-slice layout (see v_layouts)
    VG: gl.constexpr = 8 if FMT == GL_FMT_NVFP4 else KB // 4  # bytes per scale group
    vw, vn, vg, vj = _idx4(LV_LOAD, W, NT, KB // VG, VG)
    voff, vrow, vok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, vw, vn, P, PPW, PAGE_BYTES, INT2)
    vb = gl.load(buf_ptr + voff + V_OFF + vrow * KB + vg * VG + vj, mask=vok, other=0)
    tw, tn, tg = _idx3(gl.SliceLayout(3, LV_UNPACK), W, NT, KB // VG)
    toff, trow, tok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, tw, tn, P, PPW, PAGE_BYTES, INT2)
    if FMT == GL_FMT_NVFP4:
        sw, sn, sg = _idx3(gl.SliceLayout(3, LK), W, NT, KB // KG)
        soff, srow, sok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, sw, sn, P, PPW, PAGE_BYTES, INT2)
        ks = gl.load(buf_ptr + soff + KS_OFF + srow * (D // 16) + sg, mask=sok, other=0)
        vs = gl.load(buf_ptr + toff + VS_OFF + trow * (D // 16) + tg, mask=tok, other=0)
        kz = ks  # unused: nvfp4 has no zero point
        vz = vs
    else:
        # V scale / zero: one int32 word (s_a, s_b) per token pair (2c, 2c+1) and group, from the token-minor
        # fields [H, D/32, P] (layout.py); a second token past the sequence (partial page) reads 0 like masked ones
        LVP: gl.constexpr = pair_layout(LV_UNPACK)
        pw, pn, pg = _idx3(LVP, W, NT // 2, KB // VG)
        poff, prow, pok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, pw, 2 * pn, P, PPW, PAGE_BYTES, INT2)
        _o, _r, bok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, pw, 2 * pn + 1, P, PPW, PAGE_BYTES, INT2)
        keep = gl.where(bok, -1, 0xFFFF)
        vp = (buf_ptr + poff).to(gl.pointer_type(gl.int32), bitcast=True)
        pi = ((prow // P) * NGR + pg) * (P // 2) + (prow % P) // 2
        vs = gl.load(vp + (VS_OFF // 4 + pi), mask=pok, other=0) & keep
        vz = gl.load(vp + (VZ_OFF // 4 + pi), mask=pok, other=0) & keep
        if FMT == GL_FMT_INT4:
            sw, sn, sg = _idx3(gl.SliceLayout(3, LK), W, NT, KB // KG)
            soff, srow, sok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, sw, sn, P, PPW, PAGE_BYTES, INT2)
            kp = (buf_ptr + soff).to(gl.pointer_type(gl.float16), bitcast=True) + srow * NGR + sg
            ks = gl.load(kp + (KS_OFF // 2), mask=sok, other=0.0)
            kz = gl.load(kp + (KZ_OFF // 2), mask=sok, other=0.0)
        else:
            # the warp's page (NT == P): per-channel key scales and zeros [W, D, HP], one 16-byte vector per 8
            # channels (relabelled to crumbs by _crumbs)
            bw, bc, bh = _idx3(chan_layout(W, HP), W, D, HP)
            cok = (base + bw < hi) & (bh >= 0)
            ks = gl.load(_int2_page(pt_row, base + bw, hi, h, buf_ptr, total_bytes, PAGE_BYTES, KS_OFF) + bc,
                         mask=cok, other=0.0)  # fmt: skip
            kz = gl.load(_int2_page(pt_row, base + bw, hi, h, buf_ptr, total_bytes, PAGE_BYTES, KZ_OFF) + bc,
                         mask=cok, other=0.0)  # fmt: skip
    return kb, vb, ks, kz, vs, vz


# ----------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------


@gluon.jit
def _step(d, m_i, l_i, acc, q0, q1, q2, q3, pt_row, base, hi, num_tokens, h, total_bytes, k_mul, FMT: gl.constexpr,
          P: gl.constexpr, PPW: gl.constexpr, HP: gl.constexpr, PAGE_BYTES: gl.constexpr, QF: gl.constexpr,
          LV_UNPACK: gl.constexpr):  # fmt: skip
    """One step of every warp: scores of its NT tokens, online softmax, O^T += V^T P^T -> (m_i, l_i, acc)."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = D // 4 if INT2 else D // 2
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    kb, vb, ks, kz, vs, vz = d
    if FMT == GL_FMT_NVFP4:
        ks = ks.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0
        vs = vs.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0
        kz = ks  # unused: nvfp4 has no zero point
        vz = vs
    else:
        vs = _pairs_to_tokens(vs, W, NT, gl.SliceLayout(3, LV_UNPACK))
        vz = _pairs_to_tokens(vz, W, NT, gl.SliceLayout(3, LV_UNPACK))

    # ---- S^T = K . q^T ----
    if INT2:
        # zero term sum_c z_c q_c QF of the page, the same for all its tokens: products summed over the crumbs
        # in fp16 (as exact as dequantizing k = code * s + z to fp16), then over k by an mma with ones
        z = _crumbs(kz, B, W, HP)
        zq = z[0] * q0
        zq = gl.fma(z[1], q1, zq)
        zq = gl.fma(z[2], q2, zq)
        zq = gl.fma(z[3], q3, zq)
        ones = gl.full([W, 16, 32], 1.0, gl.float16, A)
        sc = _two_tiles(mma_v2(ones, zq, gl.zeros([W, 16, HP], gl.float32, MMA)), W, HP, MMA)
        # codes times q * 4^-k * s_c
        sk = _crumbs(ks, B, W, HP)
        k0, k1, k2, k3 = gl.inline_asm_elementwise(
            ASM_INT2_K, "=r,=r,=r,=r,=r,=r,=r,=r,r", [kb],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
        sc = mma_v2(_as_a_rows(k0, W, NT, KB, A), q0 * sk[0], sc)
        sc = mma_v2(_as_a_rows(k1, W, NT, KB, A), q1 * (sk[1] * 0.25), sc)
        sc = mma_v2(_as_a_rows(k2, W, NT, KB, A), q2 * (sk[2] * 0.0625), sc)
        sc = mma_v2(_as_a_rows(k3, W, NT, KB, A), q3 * (sk[3] * 0.015625), sc)
    else:
        sc = gl.zeros([W, NT, HP], gl.float32, MMA)
        klo, khi = _unpack_nibbles(kb, ks, kz, FMT, False)
        sc = mma_v2(_as_a_rows(gl.reshape(klo, [W, NT, KB]), W, NT, KB, A), q0, sc)
        sc = mma_v2(_as_a_rows(gl.reshape(khi, [W, NT, KB]), W, NT, KB, A), q1, sc)

    # ---- online softmax over the warp's tokens (base 2) ----
    mw, mn, mh = _idx3(MMA, W, NT, HP)
    _o, _r, mok = _rows(pt_row, base, hi, num_tokens, h, total_bytes, mw, mn, P, PPW, PAGE_BYTES, INT2)
    sc = gl.where(mok & (mh >= 0), sc * k_mul, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sc - gl.expand_dims(m_safe, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pt = gl.convert_layout(p.to(gl.float16), B)

    # ---- O^T += V^T . P^T ----
    vb = gl.convert_layout(vb, LV_UNPACK, assert_trivial=True)
    if INT2:
        v0, v1, v2, v3 = gl.inline_asm_elementwise(
            ASM_INT2_V, "=r,=r,=r,=r,=r,=r,=r,=r,r" + ",r" * 8, [vb, gl.expand_dims(vs, 3), gl.expand_dims(vz, 3)],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
        v0 = _swap_t0_j0(gl.reshape(v0, [W, NT, KB]), W, NT, KB)
        v1 = _swap_t0_j0(gl.reshape(v1, [W, NT, KB]), W, NT, KB)
        v2 = _swap_t0_j0(gl.reshape(v2, [W, NT, KB]), W, NT, KB)
        v3 = _swap_t0_j0(gl.reshape(v3, [W, NT, KB]), W, NT, KB)
        vv = gl.reshape(gl.join(gl.join(v0, v2), gl.join(v1, v3)), [W, NT, D])  # channel 4j + crumb
    else:
        vlo, vhi = _unpack_nibbles(vb, vs, vz, FMT, True)
        vlo = _swap_t0_j0(gl.reshape(vlo, [W, NT, KB]), W, NT, KB)
        vhi = _swap_t0_j0(gl.reshape(vhi, [W, NT, KB]), W, NT, KB)
        vv = gl.reshape(gl.join(vlo, vhi), [W, NT, D])  # channel 2j + nibble
    acc = acc * gl.expand_dims(alpha, 1)
    acc = mma_v2(_as_a_channels(vv, W, NT, D, A), pt, acc)
    return m_new, l_i, acc


@gluon.jit
def _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo, hi, mine,
              FMT: gl.constexpr, G: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
              KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
              VZ_OFF: gl.constexpr, PPW: gl.constexpr, HP: gl.constexpr, LV_LOAD: gl.constexpr,
              LV_UNPACK: gl.constexpr):  # fmt: skip
    """Pages [lo, hi) of one (sequence, kv head) in one format -> this split's rows of o and lse (if mine)."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P  # tokens per warp per step
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = D // 4 if INT2 else D // 2  # bytes per token row
    PER: gl.constexpr = 4 if INT2 else 2  # values per byte
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)

    # q^T pieces, one per nibble (2) or crumb (4), in the B-operand layout. INT2 keys (per-channel scale s_c and
    # zero z_c over the page): S = sum_c (code s_c + z_c) q_c = QF^-1 (sum_c (code 4^k) (q_c QF 4^-k s_c)
    # + sum_c z_c q_c QF): the codes enter the mma as exact integers code * 4^k (k = the crumb), q is scaled by
    # QF 4^-k once and by the page's s_c each step, and the zero term is one small mma per page.
    # QF = 2^-4 keeps the products q_c s_c QF inside fp16 for |q_c s_c| < 2^20.
    QF: gl.constexpr = 0.0625 if INT2 else 1.0
    q0 = _load_q_piece(q_row, G, KB, PER, 0, W, HP, B, QF)
    q1 = _load_q_piece(q_row, G, KB, PER, 1, W, HP, B, QF)
    q2 = q0  # unused unless INT2
    q3 = q0
    if INT2:
        q2 = _load_q_piece(q_row, G, KB, PER, 2, W, HP, B, QF)
        q3 = _load_q_piece(q_row, G, KB, PER, 3, W, HP, B, QF)

    m_i = gl.full([W, HP], float("-inf"), gl.float32, gl.SliceLayout(1, MMA))
    l_i = gl.zeros([W, HP], gl.float32, gl.SliceLayout(1, MMA))
    acc = gl.zeros([W, D, HP], gl.float32, MMA)
    for base in range(lo, hi, W * PPW):
        d = _load_step(pt_row, base, hi, num_tokens, h, buf_ptr, total_bytes, FMT, P, PPW, HP, PAGE_BYTES, K_OFF,
                       KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, LV_LOAD, LV_UNPACK)  # fmt: skip
        m_i, l_i, acc = _step(d, m_i, l_i, acc, q0, q1, q2, q3, pt_row, base, hi, num_tokens, h, total_bytes,
                              k_mul / QF, FMT, P, PPW, HP, PAGE_BYTES, QF, LV_UNPACK)  # fmt: skip

    # ---- merge the warps by log-sum-exp; store this split's rows ----
    top = gl.max(m_i, axis=0)  # [HP]
    top_safe = gl.where(top == float("-inf"), 0.0, top)
    wgt = gl.exp2(m_i - gl.expand_dims(top_safe, 0))  # [W, HP]; 0 for empty warps
    l_all = gl.sum(l_i * wgt, axis=0)
    o = gl.sum(acc * gl.expand_dims(wgt, 1), axis=0)  # [D, HP]
    has = l_all > 0
    inv = gl.where(has, 1.0 / gl.where(has, l_all, 1.0), 0.0)
    LO: gl.constexpr = gl.SliceLayout(0, MMA)
    o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(0, LO)), 0)
    om = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(1, LO)), 1)
    oh = gl.expand_dims(gl.arange(0, HP, layout=gl.SliceLayout(0, LO)), 0)
    ch = (om & 7) * (D // 8) + (om >> 3)  # row m of O^T is channel (m & 7) * D/8 + (m >> 3)
    orow = (head0 + oh).to(gl.int64) * S + s
    gl.store(o_ptr + orow * D + ch, o, mask=(oh < G) & (om >= 0) & mine)
    lse = gl.where(has, top_safe + gl.log2(gl.where(has, l_all, 1.0)), float("-inf"))
    lh = gl.arange(0, HP, layout=lse.type.layout)
    gl.store(lse_ptr + (head0 + lh).to(gl.int64) * S + s, lse, mask=(lh < G) & mine)



@gluon.jit
def _gl_decode_kernel(
    q_ptr,  # [B, H*G, 128] queries, contiguous
    o_ptr,  # fp32 [B, H*G, S, 128] per-split outputs (normalised by their own softmax sums)
    lse_ptr,  # fp32 [B, H*G, S] per-split base-2 log-sum-exp (-inf for an empty split)
    buf_ptr,  # uint8 [total_bytes] the layer's pages
    pt_ptr,  # int32 [B, pt_stride] page tables
    lens_ptr,  # int32 [B] cached tokens per sequence
    n2_ptr,  # int32 [B] INT2 pages leading each row (triaxial only)
    k_mul,  # fp32 sm_scale * log2(e) * the K format's folded scale
    total_bytes,  # layer buffer size in bytes
    pt_stride,  # page-table row stride (elements)
    S,  # splits per (sequence, head)
    PPS,  # pages per split
    FMT: gl.constexpr,  # GL_FMT_* of the plain (or triaxial INT4) pages
    PART: gl.constexpr,  # 0: plain pages; triaxial rows (INT2 pages first): 1 both kinds, 2 the INT2 splits only, 4 the INT4 ones
    H: gl.constexpr, G: gl.constexpr, P: gl.constexpr,
    PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr,
    V_OFF: gl.constexpr, VS_OFF: gl.constexpr, VZ_OFF: gl.constexpr,
    PPW: gl.constexpr,  # pages per warp per step
    HP: gl.constexpr,  # query heads padded (8 or 16)
    LV_LOAD: gl.constexpr, LV_UNPACK: gl.constexpr,  # V byte layouts (v_layouts), for num_warps warps
    P2: gl.constexpr, PAGE_BYTES2: gl.constexpr, K_OFF2: gl.constexpr, KS_OFF2: gl.constexpr,  # INT2 pages (triaxial)
    KZ_OFF2: gl.constexpr, V_OFF2: gl.constexpr, VS_OFF2: gl.constexpr, VZ_OFF2: gl.constexpr,
    LV_LOAD2: gl.constexpr, LV_UNPACK2: gl.constexpr,
):
    s = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    num_tokens = gl.load(lens_ptr + b)
    num_pages = gl.cdiv(num_tokens, P)
    head0 = b * (H * G) + h * G
    q_row = q_ptr + head0.to(gl.int64) * 128
    pt_row = pt_ptr + b.to(gl.int64) * pt_stride
    if PART == 0:
        lo = s * PPS
        _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo,
                  gl.minimum(lo + PPS, num_pages), s >= 0, FMT, G, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF,
                  VZ_OFF, PPW, HP, LV_LOAD, LV_UNPACK)  # fmt: skip
    else:
        n2 = gl.load(n2_ptr + b)
        c2 = gl.cdiv(n2, PPS)  # splits that cover the INT2 pages; the rest cover INT4 pages
        if s < c2:
            if PART != 4:
                lo = s * PPS
                _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo,
                          gl.minimum(lo + PPS, n2), s >= 0, GL_FMT_INT2, G, P2, PAGE_BYTES2, K_OFF2, KS_OFF2, KZ_OFF2,
                          V_OFF2, VS_OFF2, VZ_OFF2, 1, HP, LV_LOAD2, LV_UNPACK2)  # fmt: skip
        else:
            if PART != 2:
                lo = n2 + (s - c2) * PPS
                _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo,
                          gl.minimum(lo + PPS, num_pages), s >= 0, FMT, G, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF,
                          VS_OFF, VZ_OFF, PPW, HP, LV_LOAD, LV_UNPACK)  # fmt: skip


# ----------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------

GL_FMT = {"nvfp4": 0, "int4": 1, "int2": 2}
INT2_ARGS = ("P", "PAGE_BYTES", "K_OFF", "KS_OFF", "KZ_OFF", "V_OFF", "VS_OFF", "VZ_OFF", "LV_LOAD", "LV_UNPACK")
# warps per program, pages per warp per step, programs per SM the split planner aims for, register cap (triaxial:
# both branches in one kernel take 175 registers, 2 programs of 4 warps per SM; 168 fits 3, without spills)
# no split shorter than this many tokens: measured on an H200 (bench/NOTES-kernels.md), batch 1 x 128K and
# 64 x 4K were 10-25% faster with 1.5K-2K tokens per split than with 16 programs per SM's shorter splits
SPLIT_MIN_TOKENS = 1536
GL_TUNING: dict[str, dict[str, int]] = {
    "nvfp4": {"num_warps": 2, "PPW": 2, "PPSM": 16},
    "int4": {"num_warps": 4, "PPW": 1, "PPSM": 16, "maxnreg": 168},  # triaxial (INT4 and INT2 splits)
}


def supported(layout: PageLayout, q: torch.Tensor, int2_layout: PageLayout | None) -> bool:
    """Whether the Gluon kernel handles this call (else triton_decode's ``tl`` kernel runs)."""
    if layout.fmt not in ("nvfp4", "int4") or layout.head_dim != 128 or not q.is_cuda:
        return False
    if torch.cuda.get_device_capability(q.device) < (8, 9):
        return False
    g = q.shape[1] // layout.kv_heads
    if g > 16:
        return False
    want_p = 16 if layout.fmt == "nvfp4" else 32
    if layout.page_size != want_p or (int2_layout is not None and int2_layout.page_size != 32):
        return False
    return True


def kernel_args(fmt: str, layout: PageLayout, *, num_warps: int, ppw: int) -> dict[str, Any]:
    """Constexpr arguments of one launch for page format ``fmt`` (its layout's field offsets included)."""
    from .triton_decode import field_offsets

    p = layout.page_size
    nt = ppw * p
    kb = 32 if fmt == "int2" else 64
    vg = 8 if fmt == "nvfp4" else kb // 4
    per_thread = kb // 8
    lv_load, lv_unpack = v_layouts(num_warps, nt, kb // vg, vg, per_thread)
    pb, ko, kso, kzo, vo, vso, vzo = field_offsets(layout)
    return dict(FMT=GL_FMT[fmt], P=p, PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, V_OFF=vo, VS_OFF=vso,
                VZ_OFF=vzo, PPW=ppw, LV_LOAD=lv_load, LV_UNPACK=lv_unpack, num_warps=num_warps)  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    buffer: torch.Tensor,
    layout: PageLayout,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    int2_layout: PageLayout | None = None,
    num_int2_pages: torch.Tensor | None = None,
    total_bytes: int | None = None,
    tuning: dict[str, int] | None = None,
    splits: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Launch the Gluon decode (arguments checked by paged_ops; ``supported`` must hold) -> [B, Hq, D] in q.dtype."""
    from .triton_decode import LAST_KERNEL, _merge_kernel, plan_splits

    b, hq, d = q.shape
    h = layout.kv_heads
    g = hq // h
    total = buffer.numel() if total_bytes is None else total_bytes
    cfg = {**GL_TUNING[layout.fmt], **(tuning or {})}
    triaxial = int2_layout is not None
    ppi = cfg["num_warps"] * cfg["PPW"]
    if splits is None:
        splits = plan_splits(b * h, page_table.shape[1], ppi, q.device, triaxial=triaxial, programs_per_sm=cfg["PPSM"],
                             min_pages=-(-SPLIT_MIN_TOKENS // layout.page_size))  # fmt: skip
    s, pps = splits
    if pps % ppi:
        raise ValueError(f"pages per split ({pps}) must be a multiple of pages per step ({ppi})")
    q = q.contiguous()
    page_table = page_table.contiguous()
    o = torch.empty(b, hq, s, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    fold = NVFP4_FOLD if layout.fmt == "nvfp4" else 1.0
    k_fold = (k_scale if layout.fmt == "nvfp4" else 1.0) * fold
    v_fold = (v_scale if layout.fmt == "nvfp4" else 1.0) * fold
    n2 = num_int2_pages if num_int2_pages is not None else seq_lens
    hp = 8 if g <= 8 else 16
    common = dict(H=h, G=g, HP=hp)
    part = 0
    args = kernel_args(layout.fmt, layout, num_warps=cfg["num_warps"], ppw=cfg["PPW"])
    args2 = {k + "2": v for k, v in args.items() if k in INT2_ARGS}
    if triaxial:
        assert int2_layout is not None
        part = cfg.get("PART", 1)  # 2 or 4: benchmark only, time one precision (the other's splits stay unset)
        a2 = kernel_args("int2", int2_layout, num_warps=cfg["num_warps"], ppw=1)
        args2 = {k + "2": v for k, v in a2.items() if k in INT2_ARGS}
    kernel = _gl_decode_kernel[(s, h, b)](
        q, o, lse, buffer, page_table, seq_lens, n2, sm_scale * LOG2E * k_fold, total, page_table.stride(0),
        s, pps, PART=part, **common, **args, **args2, **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
    )  # fmt: skip
    LAST_KERNEL[:] = [kernel]
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    _merge_kernel[(b * hq,)](o, lse, out, v_fold, s, BLOCK_S=16, D=d, num_warps=4)
    return out


def compile_report_args(fmt: str, *, num_warps: int = 4, ppw: int | None = None, heads: int = 4) -> tuple[dict[str, str], dict[str, Any]]:
    """(signature, constexprs) to compile ``_gl_decode_kernel`` without a GPU (compile_report.py, tests).

    fmt "int2" / "int4" compile the triaxial kernel with only that precision's branch (PART 2 / 4), "triaxial"
    with both (PART 1, as launched)."""
    plain = "int4" if fmt in ("int2", "triaxial") else fmt
    p = 16 if plain == "nvfp4" else 32
    ppw = ppw or (2 if plain == "nvfp4" else 1)
    lay = PageLayout.build(plain, page_size=p, kv_heads=8, head_dim=128)
    lay2 = PageLayout.build("int2", page_size=32, kv_heads=8, head_dim=128)
    a2 = kernel_args("int2", lay2, num_warps=num_warps, ppw=1)
    sig = {"q_ptr": "*bf16", "o_ptr": "*fp32", "lse_ptr": "*fp32", "buf_ptr": "*u8", "pt_ptr": "*i32", "lens_ptr": "*i32",
           "n2_ptr": "*i32", "k_mul": "fp32", "total_bytes": "i64", "pt_stride": "i32", "S": "i32", "PPS": "i32"}  # fmt: skip
    const = dict(PART={"nvfp4": 0, "int2": 2, "int4": 4, "triaxial": 1}[fmt], H=8, G=heads, HP=8 if heads <= 8 else 16,
                 **kernel_args(plain, lay, num_warps=num_warps, ppw=ppw),
                 **{k + "2": v for k, v in a2.items() if k in INT2_ARGS})  # fmt: skip
    return sig, const
