"""Gluon decode attention for nvfp4, triaxial (INT4 + INT2) and fp8 pages: unpacked straight into tensor-core fragments.

Why a second decode kernel: the ``tl`` kernels in ``triton_decode.py`` dequantize
a tile in a blocked layout and Triton then moves the fp16 tile through shared
memory into the ``mma`` operand layout; for 4- and 2-bit pages that round trip
costs more than reading the bytes, and even fp8 pages read well below the chip's
bandwidth that way. Gluon lets the
kernel choose every layout, so here each thread loads exactly the bytes whose
values its ``mma.m16n8k16`` fragments hold, unpacks them with a few integer ops
and one ``f16x2`` multiply (or fma) per pair, and hands the registers to the
tensor core: no shared-memory round trip of unpacked values in the loop.

One program = one (split, kv head, sequence), W warps. Each warp runs its own
online softmax over its own pages (NT = pages-per-warp x page-size tokens per
step) and the warps merge by log-sum-exp at the end. The splits of a (sequence, kv head) merge in the kernel
with ``FUSE`` 1, by the last of them to finish (``gluon_merge.py``: ``merge_pairs``, or ``merge_wide`` with
``MERGE_SC`` n > 0); with ``FUSE`` 0 (plans of more than FUSE_MAX_SPLITS splits, or
``KernelOptions.fused_merge`` off) ``triton_common._merge_kernel``'s launch merges them.
A step's bytes are staged by ``cp.async`` in a shared-memory ring one step ahead (``STAGES``; each thread copies the bytes
it later reads, in the layouts below), so the next step's loads are in flight
while this one unpacks. A copy's address is its page's pointer plus a
loop-invariant offset and an immediate, and only a split's last step masks, which keeps the step's address
arithmetic to a few instructions (the ring, its copies and the reads back: ``gluon_ring.py``). Per warp and step::

    S^T[NT, HP] = K[NT, D] . q^T[D, HP]         K: A operand (rows = tokens), HP = query heads padded to 8
    O^T[D, HP] += V^T[D, NT] . P^T[NT, HP]      V^T: A operand (rows = channels), P^T: B operand

A-operand fragments of m16n8k16 hold, in thread (g = lane / 4, c = lane % 4),
rows g and g+8 and the column pairs (2c, 2c+1), (2c+8, 2c+9) of every 16-wide
k step. The contraction order is free (q is permuted to match) and so is the
row order of O^T (un-permuted at the store), so the kernel picks both to make
every thread's bytes contiguous:

    K rows (tokens g, g+8, ...):  thread c loads bytes [c*KB/4, (c+1)*KB/4) of the token's row (16 bytes = 32
                                  nvfp4/int4 values, 8 bytes = 32 INT2 values, 32 bytes = 32 fp8 values): one
                                  nvfp4 block pair or one INT4/INT2 group, so one block scale (or one scale +
                                  zero) per register;
    V^T rows (channels):          thread g owns channels [g*D/8, (g+1)*D/8) = 8 bytes of nvfp4/int4, 4 of INT2,
                                  16 of fp8 of tokens 2c, 2c+1, 2c+8, 2c+9 (+16): an mma register pairs two
                                  *tokens*, so the unpacker takes bytes of two tokens in one 32-bit word.

How packed bytes become fragments (PTX unpackers, register relabelling): ``gluon_fragments.py``.

The triaxial tuning sets LEAN, which shrinks what a step holds in registers so that the kernel compiles under a
cap of 128 registers without spills (4 programs of 4 warps an SM where 168 allowed 3): the score mma takes the
nibbles / crumbs of each unpacked K word one k-step after the other (``weave_a``), so a word's pieces die together
instead of three of four waiting for the first piece's whole mma chain; the V bytes and scales are read from the
ring after the softmax instead of with K; and the token masks compare each register's constant part with a
per-thread limit (``in_limit``) instead of holding every element's token index across the loop. The same sums, in
another k order. nvfp4 and fp8 keep LEAN 0 (their steps fit their caps as they are).

Supported (``supported``): head_dim 128, up to 16 query heads per kv head,
page size 16 (nvfp4, fp8) or 32 (triaxial); for anything else, and in the
interpreter, ``paged_ops`` (the one dispatch point) runs ``triton_decode``.
The unpackers are PTX, so these kernels run on a GPU only (sm_89+: ``mma.sync``,
the E4M3 conversions; ``cp.async``);
``tests/kernels/test_gluon_decode.py`` compiles them for sm_90 on CPU and the
gpu tests hold them to the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .capability import device_choice
from .gluon_merge import arrival_counters, merge_if_last, merge_step
from .gluon_ring import (
    in_limit,
    make_rings,
    read_kb,
    read_kscales,
    read_step,
    read_v,
    row_bytes,
    stage_step,
    valid_tokens,
)
from .gluon_fragments import (
    ASM_FP8_K,
    ASM_FP8_V,
    ASM_INT2_K,
    ASM_INT2_V,
    GL_FMT_FP8,
    GL_FMT_INT2,
    GL_FMT_NVFP4,
    as_a_channels,
    as_a_rows,
    crumbs,
    fp8_as_a_rows,
    idx3,
    pairs_to_tokens,
    q_k_dims,
    rescale,
    swap_t0_j0,
    two_tiles,
    unpack_nibbles,
    v_layouts,
    warp_any,
    weave_a,
    weave_b,
)
from .layout import PageLayout
from . import triton_pdl
from .paged_kv import PagedKV
from .triton_common import (
    LOG2E,
    field_offsets,
    folded_scales,
    merge_splits,
    plan_splits,
    WAVE_FILL_WARPS,
    pick_plan,
    plan_waves,
    prepare_splits,
    sm_count,
)

# LAZY softmax: a row's reference max moves only when its scores pass it by more than this (base 2), so the
# probabilities stay <= 2^8 in fp16 and the rescale of the accumulator is rare
TAU: gl.constexpr = gl.constexpr(8.0)


# ----------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------


@gluon.jit
def _load_q_piece(q_row_ptr, G, KB: gl.constexpr, PER: gl.constexpr, PIECE: gl.constexpr, W: gl.constexpr,
                  HP: gl.constexpr, B: gl.constexpr, SCALE: gl.constexpr):  # fmt: skip
    """q^T piece [W, KB, HP] (same for every warp) times SCALE in the B-operand layout, rows in the kernel's k order."""
    wi, ki, hi = idx3(B, W, KB, HP)
    ch = q_k_dims(ki, KB, PER, PIECE)
    q = gl.load(q_row_ptr + hi * 128 + ch + wi * 0, mask=(hi < G) & (wi >= 0), other=0.0)
    return (q.to(gl.float32) * SCALE).to(gl.float16)


# ----------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------


@gluon.jit
def _step(d, m_i, l_i, acc, q0, q1, q2, q3, pt_row, base, hi, num_tokens, h, total_bytes, k_mul, FMT: gl.constexpr,
          P: gl.constexpr, PPW: gl.constexpr, HP: gl.constexpr, PAGE_BYTES: gl.constexpr, QF: gl.constexpr,
          LV_UNPACK: gl.constexpr, E2M1_CVT: gl.constexpr = 0, rings=None, slot=0, LV_LOAD: gl.constexpr = None,
          LEAN: gl.constexpr = 0):  # fmt: skip
    """One step of every warp: scores of its NT tokens, online softmax, O^T += V^T P^T -> (m_i, l_i, acc).

    l_i: the [W, 16, HP] accumulator of ones . P^T (_gl_split reduces it)."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = row_bytes(FMT)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1, 1], instr_shape=[1, 16, 8])
    A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    kb, vb, ks, kz, vs, vz = d
    if FMT == GL_FMT_FP8:
        pass
    elif FMT == GL_FMT_NVFP4:
        ks = ks.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0
        vs = vs.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0
        kz = ks  # unused: nvfp4 has no zero point
        vz = vs
    elif not LEAN:
        vs = pairs_to_tokens(vs, W, NT, gl.SliceLayout(3, LV_UNPACK))
        vz = pairs_to_tokens(vz, W, NT, gl.SliceLayout(3, LV_UNPACK))

    # ---- S^T = K . q^T ----
    if INT2:
        # zero term sum_c z_c q_c QF of the page, the same for all its tokens: products summed over the crumbs
        # in fp16 (as exact as dequantizing k = code * s + z to fp16), then over k by an mma with ones
        z = crumbs(kz, B, W, HP)
        zq = z[0] * q0
        zq = gl.fma(z[1], q1, zq)
        zq = gl.fma(z[2], q2, zq)
        zq = gl.fma(z[3], q3, zq)
        ones = gl.full([W, 16, 32], 1.0, gl.float16, A)
        sc = two_tiles(mma_v2(ones, zq, gl.zeros([W, 16, HP], gl.float32, MMA)), W, HP, MMA)
        # codes times q * 4^-k * s_c
        sk = crumbs(ks, B, W, HP)
        k0, k1, k2, k3 = gl.inline_asm_elementwise(
            ASM_INT2_K, "=r,=r,=r,=r,=r,=r,=r,=r,r", [kb],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
        if LEAN:
            # the four crumbs of a word one k-step after the other (weave_a): one word's codes die together
            a4 = weave_a((as_a_rows(k0, W, NT, KB, A), as_a_rows(k1, W, NT, KB, A), as_a_rows(k2, W, NT, KB, A),
                          as_a_rows(k3, W, NT, KB, A)), A)  # fmt: skip
            b4 = weave_b((q0 * sk[0], q1 * (sk[1] * 0.25), q2 * (sk[2] * 0.0625), q3 * (sk[3] * 0.015625)), B)
            sc = mma_v2(a4, b4, sc)
        else:
            sc = mma_v2(as_a_rows(k0, W, NT, KB, A), q0 * sk[0], sc)
            sc = mma_v2(as_a_rows(k1, W, NT, KB, A), q1 * (sk[1] * 0.25), sc)
            sc = mma_v2(as_a_rows(k2, W, NT, KB, A), q2 * (sk[2] * 0.0625), sc)
            sc = mma_v2(as_a_rows(k3, W, NT, KB, A), q3 * (sk[3] * 0.015625), sc)
    elif FMT == GL_FMT_FP8:
        k8 = gl.inline_asm_elementwise(ASM_FP8_K, "=r,=r,r", [kb], dtype=gl.float16, is_pure=True, pack=4)
        sc = mma_v2(fp8_as_a_rows(k8, W, NT, A), q0, gl.zeros([W, NT, HP], gl.float32, MMA))
    else:
        sc = gl.zeros([W, NT, HP], gl.float32, MMA)
        klo, khi = unpack_nibbles(kb, ks, kz, FMT, False, E2M1_CVT)
        alo = as_a_rows(gl.reshape(klo, [W, NT, KB]), W, NT, KB, A)
        ahi = as_a_rows(gl.reshape(khi, [W, NT, KB]), W, NT, KB, A)
        if LEAN:
            sc = mma_v2(weave_a((alo, ahi), A), weave_b((q0, q1), B), sc)  # a word's two nibbles one after the other
        else:
            sc = mma_v2(alo, q0, sc)
            sc = mma_v2(ahi, q1, sc)

    # ---- online softmax over the warp's tokens (base 2) ----
    mw, mn, mh = idx3(MMA, W, NT, HP)
    # m_i is a reference max that moves only where a row's max passes it by more than TAU (then to that
    # max), so p = 2^(s - m_i) <= 2^TAU stays in fp16, and in most steps no row of the warp moves: the
    # rescale of acc and l is skipped by one uniform branch (rescale); l is summed by the tensor core
    # (ones . P^T, every row the same), not by shuffles. Only a split's last step masks its scores, and
    # they stay raw: k_mul (> 0) scales the row max and enters p's exponent in one fma.
    lim = valid_tokens(base, hi, num_tokens, P)
    if lim < W * NT:
        sc = gl.where(in_limit(lim, mw, mn, NT, 7, LEAN) & (mh >= 0), sc, float("-inf"))
    top = gl.max(sc, axis=1) * k_mul
    grow = top > m_i + TAU
    m_new = gl.where(grow, top, m_i)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.expand_dims(gl.exp2(m_i - m_safe), 1)
    p = gl.exp2(gl.fma(sc, gl.full(sc.shape, k_mul, gl.float32, MMA), -gl.expand_dims(m_safe, 1)))
    moved = gl.expand_dims(warp_any(grow.to(gl.int32), HP // 4), 1)
    pt = gl.convert_layout(p.to(gl.float16), B)
    # before the V unpack, so that the branch does not hold the unpacked V fragments live across it
    acc = rescale(acc, alpha, moved, 32)
    l_i = rescale(l_i, alpha, moved, 4)
    l_i = mma_v2(gl.full([W, 16, NT], 1.0, gl.float16, A), pt, l_i)

    # ---- O^T += V^T . P^T ----
    if LEAN:
        vb, vs, vz = read_v(rings, slot, base, hi, num_tokens, FMT, P, PPW, LV_LOAD, LV_UNPACK, LEAN)
        vs = pairs_to_tokens(vs, W, NT, gl.SliceLayout(3, LV_UNPACK))
        vz = pairs_to_tokens(vz, W, NT, gl.SliceLayout(3, LV_UNPACK))
    vb = gl.convert_layout(vb, LV_UNPACK, assert_trivial=True)
    if INT2:
        v0, v1, v2, v3 = gl.inline_asm_elementwise(
            ASM_INT2_V, "=r,=r,=r,=r,=r,=r,=r,=r,r" + ",r" * 8, [vb, gl.expand_dims(vs, 3), gl.expand_dims(vz, 3)],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4)  # fmt: skip
        v0 = swap_t0_j0(gl.reshape(v0, [W, NT, KB]), W, NT, KB)
        v1 = swap_t0_j0(gl.reshape(v1, [W, NT, KB]), W, NT, KB)
        v2 = swap_t0_j0(gl.reshape(v2, [W, NT, KB]), W, NT, KB)
        v3 = swap_t0_j0(gl.reshape(v3, [W, NT, KB]), W, NT, KB)
        vv = gl.reshape(gl.join(gl.join(v0, v2), gl.join(v1, v3)), [W, NT, D])  # channel 4j + crumb
    elif FMT == GL_FMT_FP8:
        v8 = gl.inline_asm_elementwise(ASM_FP8_V, "=r,=r,r", [vb], dtype=gl.float16, is_pure=True, pack=4)
        vv = swap_t0_j0(gl.reshape(v8, [W, NT, KB]), W, NT, KB)  # channel = byte
    else:
        vlo, vhi = unpack_nibbles(vb, vs, vz, FMT, True, E2M1_CVT)
        vlo = swap_t0_j0(gl.reshape(vlo, [W, NT, KB]), W, NT, KB)
        vhi = swap_t0_j0(gl.reshape(vhi, [W, NT, KB]), W, NT, KB)
        vv = gl.reshape(gl.join(vlo, vhi), [W, NT, D])  # channel 2j + nibble
    acc = mma_v2(as_a_channels(vv, W, NT, D, A), pt, acc)
    return m_new, l_i, acc


@gluon.jit
def _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo, hi, mine,
              FMT: gl.constexpr, G: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
              KS_OFF: gl.constexpr, KZ_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
              VZ_OFF: gl.constexpr, PPW: gl.constexpr, HP: gl.constexpr, LV_LOAD: gl.constexpr,
              LV_UNPACK: gl.constexpr, STAGES: gl.constexpr, E2M1_CVT: gl.constexpr = 0,
              LEAN: gl.constexpr = 0):  # fmt: skip
    """Pages [lo, hi) of one (sequence, kv head) in one format -> this split's rows of o and lse (if mine).

    A ring of STAGES shared-memory slots filled by cp.async STAGES - 1 steps ahead, so that many steps' bytes are
    in flight."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = PPW * P  # tokens per warp per step
    INT2: gl.constexpr = FMT == GL_FMT_INT2
    KB: gl.constexpr = row_bytes(FMT)  # bytes per token row
    PER: gl.constexpr = 4 if INT2 else (1 if FMT == GL_FMT_FP8 else 2)  # values per byte
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
    l_i = gl.zeros([W, 16, HP], gl.float32, MMA)
    acc = gl.zeros([W, D, HP], gl.float32, MMA)
    STEP: gl.constexpr = W * PPW
    rings = make_rings(FMT, NT, HP, STAGES, LV_LOAD)
    for i in gl.static_range(STAGES - 1):
        stage_step(rings, i, pt_row, lo + i * STEP, hi, num_tokens, h, buf_ptr, total_bytes, FMT, P, PPW,
                   PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, LV_LOAD, LEAN)  # fmt: skip
        async_copy.commit_group()
    rd = 0  # the ring slot this step reads; the copies go to the one before it (read by the step before)
    for j in range(0, gl.cdiv(hi - lo, STEP)):
        stage_step(rings, gl.where(rd == 0, STAGES - 1, rd - 1), pt_row, lo + (j + STAGES - 1) * STEP, hi,
                   num_tokens, h, buf_ptr, total_bytes, FMT, P, PPW, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF,
                   VS_OFF, VZ_OFF, LV_LOAD, LEAN)  # fmt: skip
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        base = lo + j * STEP
        if LEAN:
            kb = read_kb(rings, rd, FMT, NT)
            ks, kz = read_kscales(rings, rd, kb, FMT, HP)
            d = (kb, kb, ks, kz, ks, kz)  # V is read inside _step
        else:
            d = read_step(rings, rd, pt_row, base, hi, num_tokens, h, total_bytes, FMT, P, PPW, HP, PAGE_BYTES,
                          LV_LOAD, LV_UNPACK)  # fmt: skip
        cur = rd
        rd = gl.where(rd == STAGES - 1, 0, rd + 1)
        m_i, l_i, acc = _step(d, m_i, l_i, acc, q0, q1, q2, q3, pt_row, base, hi, num_tokens, h, total_bytes,
                              k_mul / QF, FMT, P, PPW, HP, PAGE_BYTES, QF, LV_UNPACK, E2M1_CVT, rings, cur, LV_LOAD,
                              LEAN)  # fmt: skip
    async_copy.wait_group(0)  # the copies past the split (zero-fills) land before the epilogue reuses smem

    l_i = gl.max(l_i, axis=1)  # every row of ones . P^T is the sum
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
    out_ptr,  # [B, H*G, 128] the merged output, q's dtype (FUSE)
    cnt_ptr,  # int32 [B * H] arrival counters, zero between launches (FUSE)
    v_mul,  # fp32 the V format's folded scale (FUSE)
    FMT: gl.constexpr,  # GL_FMT_* of the plain (or triaxial INT4) pages
    TRIAXIAL: gl.constexpr,  # 0: plain pages; 1: triaxial rows (INT2 pages first), both kinds' splits in one launch
    H: gl.constexpr,
    G: gl.constexpr,
    P: gl.constexpr,
    PAGE_BYTES: gl.constexpr,
    K_OFF: gl.constexpr,
    KS_OFF: gl.constexpr,
    KZ_OFF: gl.constexpr,
    V_OFF: gl.constexpr,
    VS_OFF: gl.constexpr,
    VZ_OFF: gl.constexpr,
    PPW: gl.constexpr,  # pages per warp per step
    HP: gl.constexpr,  # query heads padded (8 or 16)
    LV_LOAD: gl.constexpr,
    LV_UNPACK: gl.constexpr,  # V byte layouts (v_layouts), for num_warps warps
    P2: gl.constexpr,
    PAGE_BYTES2: gl.constexpr,
    K_OFF2: gl.constexpr,
    KS_OFF2: gl.constexpr,  # INT2 pages (triaxial)
    KZ_OFF2: gl.constexpr,
    V_OFF2: gl.constexpr,
    VS_OFF2: gl.constexpr,
    VZ_OFF2: gl.constexpr,
    LV_LOAD2: gl.constexpr,
    LV_UNPACK2: gl.constexpr,
    STAGES: gl.constexpr,  # cp.async ring this many steps deep (>= 2)
    E2M1_CVT: gl.constexpr = 0,  # 1: nvfp4 unpacked by cvt.rn.f16x2.e2m1x2 (sm_100a / sm_120a: capability.TABLE)
    LEAN: gl.constexpr = 0,  # 1: a step's live state cut to fit 128 registers (module docstring)
    PDL: gl.constexpr = 0,  # 1: launched with programmatic dependent launch (triton_pdl): wait before any access
    FUSE: gl.constexpr = 0,  # 1: the last split of a (sequence, kv head) to finish merges them into out
    MERGE_SC: gl.constexpr = 0,  # FUSE's merge: 0 merge_pairs (2 splits a step); n merge_wide (up to n a step)
):
    s = gl.program_id(0)
    h = gl.program_id(1)
    b = gl.program_id(2)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    num_tokens = gl.load(lens_ptr + b)
    num_pages = gl.cdiv(num_tokens, P)
    head0 = b * (H * G) + h * G
    q_row = q_ptr + head0.to(gl.int64) * 128
    pt_row = pt_ptr + b.to(gl.int64) * pt_stride
    if TRIAXIAL == 0:
        lo = s * PPS
        _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo,
                  gl.minimum(lo + PPS, num_pages), s >= 0, FMT, G, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF,
                  VZ_OFF, PPW, HP, LV_LOAD, LV_UNPACK, STAGES, E2M1_CVT)  # fmt: skip
    else:
        n2 = gl.load(n2_ptr + b)
        c2 = gl.cdiv(n2, PPS)  # splits that cover the INT2 pages; the rest cover INT4 pages
        if s < c2:
            lo = s * PPS
            _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo,
                      gl.minimum(lo + PPS, n2), s >= 0, GL_FMT_INT2, G, P2, PAGE_BYTES2, K_OFF2, KS_OFF2, KZ_OFF2,
                      V_OFF2, VS_OFF2, VZ_OFF2, 1, HP, LV_LOAD2, LV_UNPACK2, STAGES, 0, LEAN)  # fmt: skip
        else:
            lo = n2 + (s - c2) * PPS
            _gl_split(q_row, o_ptr, lse_ptr, buf_ptr, pt_row, num_tokens, k_mul, total_bytes, S, s, h, head0, lo,
                      gl.minimum(lo + PPS, num_pages), s >= 0, FMT, G, P, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF,
                      VS_OFF, VZ_OFF, PPW, HP, LV_LOAD, LV_UNPACK, STAGES, E2M1_CVT, LEAN)  # fmt: skip
    if FUSE:
        merge_if_last(o_ptr, lse_ptr, out_ptr, cnt_ptr + b * H + h, v_mul, S, head0, G, HP, MERGE_SC)


# ----------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------

GL_FMT = {"nvfp4": 0, "int4": 1, "int2": 2, "fp8_e4m3": 3}
INT2_ARGS = ("P", "PAGE_BYTES", "K_OFF", "KS_OFF", "KZ_OFF", "V_OFF", "VS_OFF", "VZ_OFF", "LV_LOAD", "LV_UNPACK")
# Per format: warps per program, pages per warp per step (PPW), the programs per SM the min-length planner aims
# for (PPSM), the cp.async ring's depth (STAGES: 2 is the fastest; deeper rings take shared memory and programs),
# the register cap (nvfp4 / fp8 128: 16 warps per SM without spills; triaxial 128 with LEAN: 4 programs of 4 warps
# per SM with both kinds' branches; 16 query heads per kv head run uncapped), and the programs per SM the compiled kernel
# allows with 4 (RES) or 16 (RES16) query heads per kv head (triton_common.resident_programs of the device's
# compile, held by tests/kernels/test_gluon_decode.py: a tuning that changes warps, STAGES or maxnreg sets RES
# too). FILLW: the warps of fill a wave costs in pick_plan (fp8 0: 3 programs an SM already saturate its reads).
# FUSE is not a tuning: decode_attention launches _gl_decode_kernel's FUSE 1 (the splits merged by their last
# program instead of triton_common's merge launch) wherever KernelOptions.fused_merge holds (the default) and the
# plan has at most FUSE_MAX_SPLITS splits. MERGE_SC (absent: 0) picks FUSE's merge: 0 merge_pairs, two passes of two
# splits a step; n merge_wide, one load of every lse and up to n splits' rows in flight a step (merge_step).
# LEAN: _gl_decode_kernel's LEAN (triaxial 1: 128 registers without spills, so 4 programs of 4 warps an SM at up to 8
# query heads per kv head; 16 heads run uncapped, 202 registers, 2 programs; the other formats 0).
GL_TUNING: dict[str, dict[str, int]] = {
    "nvfp4": {"num_warps": 2, "PPW": 2, "PPSM": 16, "STAGES": 2, "maxnreg": 128, "RES": 8, "RES16": 5},
    "int4": {"num_warps": 4, "PPW": 1, "PPSM": 16, "maxnreg": 128, "STAGES": 2, "RES": 4, "RES16": 2, "LEAN": 1},  # triaxial
    "fp8_e4m3": {"num_warps": 2, "PPW": 2, "PPSM": 16, "STAGES": 2, "maxnreg": 128, "RES": 6, "RES16": 5, "FILLW": 0},
}
# The last program merges the splits two at a time, one L2 round trip each: up to 8 splits that costs less than
# the merge launch it replaces (the decode 1-6 % faster at 2-4 splits), past it more (13-43 % slower at 32-64).
FUSE_MAX_SPLITS = 8
# the min-length planner's splits: at least SPLIT_MIN_TOKENS tokens, unless that leaves fewer than SPLIT_MIN_FILL
# programs per SM
SPLIT_MIN_TOKENS = 1536
SPLIT_MIN_FILL = 2


FORMATS = ("nvfp4", "int4", "fp8_e4m3")  # plain nvfp4 / fp8 pages; int4 pages alone or with INT2 pages (triaxial)


def supported(kv: PagedKV, q: torch.Tensor) -> bool:
    """Whether the Gluon kernel handles this call (paged_ops runs triton_decode's ``tl`` kernel otherwise)."""
    layout = kv.layout
    if layout.fmt not in FORMATS or layout.head_dim != 128 or not q.is_cuda:
        return False
    if device_choice(q.device).decode != "gluon":  # capability.TABLE
        return False
    g = q.shape[1] // layout.kv_heads
    if g > 16:
        return False
    want_p = 32 if layout.fmt == "int4" else 16
    return layout.page_size == want_p and (kv.int2_layout is None or kv.int2_layout.page_size == 32)


def kernel_args(fmt: str, layout: PageLayout, *, num_warps: int, ppw: int, stride: int = 0) -> dict[str, Any]:
    """Constexpr arguments of one launch for page format ``fmt`` (its layout's field offsets included; ``stride``:
    triton_common.field_offsets')."""
    p = layout.page_size
    nt = ppw * p
    kb = {"int2": 32, "fp8_e4m3": 128}.get(fmt, 64)
    vg = {"nvfp4": 8, "fp8_e4m3": 16}.get(fmt, kb // 4)
    per_thread = kb // 8
    lv_load, lv_unpack = v_layouts(num_warps, nt, kb // vg, vg, per_thread)
    pb, ko, kso, kzo, vo, vso, vzo = field_offsets(layout, stride=stride)
    return dict(FMT=GL_FMT[fmt], P=p, PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, V_OFF=vo, VS_OFF=vso,
                VZ_OFF=vzo, PPW=ppw, LV_LOAD=lv_load, LV_UNPACK=lv_unpack, num_warps=num_warps)  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    num_int2_pages: torch.Tensor | None = None,
    pdl: bool = False,
    fused_merge: bool = True,
) -> torch.Tensor:
    """Launch the Gluon decode (arguments checked by paged_ops; ``supported`` must hold) -> [B, Hq, D] in q.dtype:
    GL_TUNING's kernel on split_plan's splits; ``pdl``: it and the split merge with programmatic dependent launch;
    ``fused_merge``: the splits merged in the kernel (FUSE 1) where the plan has at most FUSE_MAX_SPLITS, else
    (and always when off) by the merge launch."""
    tuning = GL_TUNING[kv.layout.fmt]
    plan = split_plan(q, kv, page_table, tuning)
    cfg = tuning | {"FUSE": int(merges_in_kernel(plan[0], fused_merge=fused_merge))}
    out, _ = launch_decode(q, kv, page_table, seq_lens, sm_scale=sm_scale, num_int2_pages=num_int2_pages, cfg=cfg,
                           plan=plan, pdl=pdl)  # fmt: skip
    return out


def merges_in_kernel(splits: int, *, fused_merge: bool) -> bool:
    """Whether a launch of ``splits`` splits merges them in the kernel (FUSE 1): asked for (``fused_merge``, the
    default of KernelOptions) and at most FUSE_MAX_SPLITS of them."""
    return fused_merge and splits <= FUSE_MAX_SPLITS


def min_length_plan(q: torch.Tensor, kv: PagedKV, page_table: torch.Tensor, cfg: dict[str, int]) -> tuple[int, int]:
    """(splits, pages per split) of triton_common.plan_splits: about PPSM programs per SM, no split shorter than
    SPLIT_MIN_TOKENS tokens unless fewer than SPLIT_MIN_FILL programs per SM are left."""
    bh, pages, ppi = q.shape[0] * kv.layout.kv_heads, page_table.shape[1], cfg["num_warps"] * cfg["PPW"]
    return plan_splits(bh, pages, ppi, q.device, triaxial=kv.triaxial, programs_per_sm=cfg["PPSM"],
                       min_pages=-(-SPLIT_MIN_TOKENS // kv.layout.page_size), min_fill=SPLIT_MIN_FILL)  # fmt: skip


def wave_plan(q: torch.Tensor, kv: PagedKV, page_table: torch.Tensor, cfg: dict[str, int]) -> tuple[int, int]:
    """(splits, pages per split) of triton_common.plan_waves on the tuning's programs resident per SM."""
    bh, pages, ppi = q.shape[0] * kv.layout.kv_heads, page_table.shape[1], cfg["num_warps"] * cfg["PPW"]
    resident = cfg["RES" if q.shape[1] // kv.layout.kv_heads <= 8 else "RES16"]
    return plan_waves(bh, pages, ppi, sm_count(q.device), resident=resident, warps=cfg["num_warps"],
                      triaxial=kv.triaxial)  # fmt: skip


def split_plan(q: torch.Tensor, kv: PagedKV, page_table: torch.Tensor, cfg: dict[str, int]) -> tuple[int, int]:
    """(splits, pages per split) of a launch with tuning ``cfg``: triton_common.pick_plan's choice between
    wave_plan and min_length_plan, judged by the busiest SM's pages with FILLW warps of fill a wave (neither plan
    alone is the faster at every shape)."""
    bh, pages, ppi = q.shape[0] * kv.layout.kv_heads, page_table.shape[1], cfg["num_warps"] * cfg["PPW"]
    resident = cfg["RES" if q.shape[1] // kv.layout.kv_heads <= 8 else "RES16"]
    return pick_plan(bh, pages, ppi, sm_count(q.device), wave=wave_plan(q, kv, page_table, cfg),
                     old=min_length_plan(q, kv, page_table, cfg), resident=resident,
                     fill=cfg.get("FILLW", WAVE_FILL_WARPS) / cfg["num_warps"])  # fmt: skip


def launch_decode(
    q: torch.Tensor,
    kv: PagedKV,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    num_int2_pages: torch.Tensor | None,
    cfg: dict[str, int],
    plan: tuple[int, int],
    pdl: bool = False,
) -> tuple[torch.Tensor, Any]:
    """The launch of ``decode_attention`` with its tuning ``cfg`` and split plan (splits, pages per split) given
    -> (output, the compiled kernel). decode_attention passes GL_TUNING's and split_plan's; tests and benchmarks
    pass their own (pages per split a multiple of num_warps * PPW)."""
    layout = kv.layout
    ppi = cfg["num_warps"] * cfg["PPW"]
    run = prepare_splits(q, kv, page_table, seq_lens, num_int2_pages, pages_per_iter=ppi, programs_per_sm=cfg["PPSM"],
                         splits=plan)  # fmt: skip
    if run.pages_per_split % ppi:
        raise ValueError(f"pages per split ({run.pages_per_split}) must be a multiple of pages per step ({ppi})")
    k_fold, v_fold = folded_scales(kv)
    hp = 8 if run.group <= 8 else 16
    args = kernel_args(layout.fmt, layout, num_warps=cfg["num_warps"], ppw=cfg["PPW"], stride=kv.page_stride)
    args2 = {k + "2": v for k, v in args.items() if k in INT2_ARGS}
    if kv.triaxial:  # both precisions' splits in one launch
        a2 = kernel_args("int2", kv.int2, num_warps=cfg["num_warps"], ppw=1, stride=kv.int2_stride)
        args2 = {k + "2": v for k, v in a2.items() if k in INT2_ARGS}
    reg_cap = register_cap("triaxial" if kv.triaxial else layout.fmt, cfg, heads=run.group)
    cap = {"maxnreg": reg_cap} if reg_cap else {}
    counters = arrival_counters(q.device, q.shape[0] * run.kv_heads) if cfg.get("FUSE") else None
    merge_sc = merge_step(cfg, splits=run.splits) if counters is not None else 0
    out = torch.empty_like(run.q) if counters is not None else run.o
    kernel = _gl_decode_kernel[run.grid](
        run.q, run.o, run.lse, kv.base, run.page_table, seq_lens, run.n2, sm_scale * LOG2E * k_fold, kv.int2_top,
        run.page_table.stride(0), run.splits, run.pages_per_split, out, counters if counters is not None else seq_lens,
        v_fold, TRIAXIAL=int(kv.triaxial), H=run.kv_heads, G=run.group, HP=hp, STAGES=cfg["STAGES"], **args, **args2,
        **cap, E2M1_CVT=int(layout.fmt == "nvfp4" and device_choice(q.device).e2m1 == "cvt"), LEAN=cfg.get("LEAN", 0),
        PDL=int(pdl), FUSE=int(counters is not None), MERGE_SC=merge_sc, **triton_pdl.launch_args(pdl),
    )  # fmt: skip
    if counters is None:
        out = merge_splits(run, v_mul=v_fold, pdl=pdl)
    return out, kernel


def register_cap(fmt: str, cfg: dict[str, int], *, heads: int) -> int | None:
    """The register cap of a launch of ``fmt`` ("triaxial", or a plain page format) with tuning ``cfg`` and ``heads``
    query heads per kv head: ``cfg``'s maxnreg up to 8 heads; none at 16 (they need more), and none for plain INT4
    pages under LEAN (a layout only tests build: LEAN's step fits 128 registers with both of triaxial's branches,
    the INT4 branch alone spills under it)."""
    if not cfg.get("maxnreg") or heads > 8 or (fmt == "int4" and cfg.get("LEAN")):
        return None
    return cfg["maxnreg"]


def compile_report_args(fmt: str, *, heads: int = 4, e2m1_cvt: bool = False,
                        fuse: bool | None = None, merge_sc: int = 0) -> tuple[dict[str, str], dict[str, Any]]:  # fmt: skip
    """(signature, constexprs incl. num_warps) to compile ``_gl_decode_kernel`` as launched (GL_TUNING) without a
    GPU (compile_report.py, tests): fmt "nvfp4", "fp8_e4m3", "int4" (plain INT4 pages) or "triaxial"; ``heads``
    query heads per kv head; ``e2m1_cvt``: nvfp4 unpacked by cvt (the launch on a capability whose
    capability.TABLE row says e2m1 "cvt"); ``fuse``: FUSE on or off (None: the tuning's); ``merge_sc``: FUSE's
    MERGE_SC. The launch caps the registers at ``register_cap``."""
    plain = "int4" if fmt == "triaxial" else fmt
    cfg = GL_TUNING[plain]
    p = 32 if plain == "int4" else 16
    lay = PageLayout.build(plain, page_size=p, kv_heads=8, head_dim=128)
    lay2 = PageLayout.build("int2", page_size=32, kv_heads=8, head_dim=128)
    a2 = kernel_args("int2", lay2, num_warps=cfg["num_warps"], ppw=1)
    sig = {"q_ptr": "*bf16", "o_ptr": "*fp32", "lse_ptr": "*fp32", "buf_ptr": "*u8", "pt_ptr": "*i32", "lens_ptr": "*i32",
           "n2_ptr": "*i32", "k_mul": "fp32", "total_bytes": "i64", "pt_stride": "i32", "S": "i32", "PPS": "i32",
           "out_ptr": "*bf16", "cnt_ptr": "*i32", "v_mul": "fp32"}  # fmt: skip
    const = dict(TRIAXIAL=int(fmt == "triaxial"), H=8, G=heads, HP=8 if heads <= 8 else 16, STAGES=cfg["STAGES"],
                 **kernel_args(plain, lay, num_warps=cfg["num_warps"], ppw=cfg["PPW"]),
                 **{k + "2": v for k, v in a2.items() if k in INT2_ARGS}, E2M1_CVT=int(e2m1_cvt and fmt == "nvfp4"),
                 LEAN=cfg.get("LEAN", 0), PDL=0, FUSE=int(cfg.get("FUSE", 0) if fuse is None else fuse),
                 MERGE_SC=merge_sc)  # fmt: skip
    return sig, const
