"""Triton paged decode attention for bf16, fp8, nvfp4 and triaxial (INT2 + INT4) pages: split-K with a log-sum-exp merge.

One program handles one (sequence, kv head, split): all G query heads of
that kv head at once (padded to 16 rows for ``tl.dot``), over a run of pages.
Each iteration loads PPI pages of K and V for the head (each page's [P, ...]
rows are contiguous, so loads are 16-byte vectors), dequantizes them in
registers to fp16 (bf16 pages stay bf16) and runs an online softmax in base 2.
A second small kernel merges the splits by log-sum-exp (triton_common.py,
shared with the Gluon decode, as are the split planner and launch preamble).

Head dim is handled as four quarters of D/4 channels, each a separate
``tl.dot``, so packed formats never interleave nibbles in registers: a
quarter is the set of channels one unpacking step yields::

    bf16, fp8:   quarter i = channels i*D/4 + j            (contiguous)
    nvfp4, int4: quarter i = channels (i//2)*D/2 + 2j + i%2  (lo / hi nibbles of a half row)
    int2:        quarter i = channels 4j + i               (crumb i of every byte)

q is loaded and the output stored through the same channel map.

Triaxial rows list INT2 pages first. Splits are pure: split s < ceil(n2/PPS)
covers INT2 pages, the rest cover INT4 pages, so no loop mixes precisions;
the two kinds run as two launches over one grid (each compiled for one
precision, fewer registers) and share the merge. INT2 keys' per-channel
scale and zero (one per page, head and channel) are applied in registers,
broadcast over the page's rows.

What limits these kernels on a GPU is instruction issue and the shared-memory
layout conversions of the unpacked fp16 tiles, not bytes: on Hopper and Ada
paged_ops runs the Gluon decode (gluon_decode.py) instead where it can.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .page_ids import INT2_PAGE_FLAG
from .paged_kv import PagedKV
from .triton_codec import crumb_codes, crumbs_int2, e4m3_to_f16, meta_index, nibbles_e2m1, nibbles_int4
from .triton_common import (
    FMT_BF16,
    FMT_CODES,
    FMT_FP8,
    FMT_INT2,
    FMT_INT4,
    FMT_NVFP4,
    LOG2E,
    kv_field_offsets,
    folded_scales,
    merge_splits,
    prepare_splits,
)

FLAG: tl.constexpr = tl.constexpr(INT2_PAGE_FLAG)


@triton.jit
def _channels(FMT: tl.constexpr, D: tl.constexpr, i: tl.constexpr):
    """Channel index of each of the D/4 columns of quarter i."""
    j = tl.arange(0, D // 4)
    if FMT == FMT_BF16 or FMT == FMT_FP8:
        ch = i * (D // 4) + j
    elif FMT == FMT_INT2:
        ch = 4 * j + i
    else:
        ch = (i // 2) * (D // 2) + 2 * j + (i % 2)
    return ch


@triton.jit
def _plain_rows(rows_ptr, hrow, ok, OFF: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr):
    """bf16 / fp8 rows: loads only -> four [N, D/4] tiles (bf16, or E4M3 bytes)."""
    Q: tl.constexpr = D // 4
    j = tl.arange(0, Q)[None, :]
    m = ok[:, None]
    if FMT == FMT_BF16:
        base = (rows_ptr[:, None] + OFF).to(tl.pointer_type(tl.bfloat16)) + hrow[:, None] * D + j
    else:
        base = rows_ptr[:, None] + OFF + hrow[:, None] * D + j
    t0 = tl.load(base, mask=m, other=0)
    t1 = tl.load(base + Q, mask=m, other=0)
    t2 = tl.load(base + 2 * Q, mask=m, other=0)
    t3 = tl.load(base + 3 * Q, mask=m, other=0)
    return t0, t1, t2, t3


@triton.jit
def _plain_decode(t0, t1, t2, t3, FMT: tl.constexpr, FAST: tl.constexpr):
    if FMT == FMT_FP8:
        t0 = e4m3_to_f16(t0, FAST)
        t1 = e4m3_to_f16(t1, FAST)
        t2 = e4m3_to_f16(t2, FAST)
        t3 = e4m3_to_f16(t3, FAST)
    return t0, t1, t2, t3


@triton.jit
def _nibble_rows(
    rows_ptr, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, TM: tl.constexpr
):
    """nvfp4 / int4 rows, loads only: packed halves [N, D/4] u8 (16-byte vectors) and each half's scales (and zeros);
    TM: the int4 scale order (meta_index)."""
    Q: tl.constexpr = D // 4
    j = tl.arange(0, Q)[None, :]
    p2 = rows_ptr[:, None]
    r = hrow[:, None]
    m = ok[:, None]
    d0 = tl.load(p2 + OFF + r * (D // 2) + j, mask=m, other=0)
    d1 = tl.load(p2 + OFF + r * (D // 2) + Q + j, mask=m, other=0)
    if FMT == FMT_NVFP4:
        NB: tl.constexpr = D // 32  # E4M3 block scales per half row
        b = tl.arange(0, NB)[None, :]
        s0 = tl.load(p2 + SOFF + r * (D // 16) + b, mask=m, other=0)
        s1 = tl.load(p2 + SOFF + r * (D // 16) + NB + b, mask=m, other=0)
        z0 = s0
        z1 = s1
    else:
        NG: tl.constexpr = D // 64  # fp16 group scale / zero per half row
        g = tl.arange(0, NG)[None, :]
        sp = (p2 + SOFF).to(tl.pointer_type(tl.float16))
        zp = (p2 + ZOFF).to(tl.pointer_type(tl.float16))
        i0 = meta_index(r, g, D // 32, TM)
        i1 = meta_index(r, g + NG, D // 32, TM)
        s0 = tl.load(sp + i0, mask=m, other=0.0)
        s1 = tl.load(sp + i1, mask=m, other=0.0)
        z0 = tl.load(zp + i0, mask=m, other=0.0)
        z1 = tl.load(zp + i1, mask=m, other=0.0)
    return d0, d1, s0, s1, z0, z1


@triton.jit
def _nibble_decode(d, s, z, FMT: tl.constexpr, D: tl.constexpr, FAST: tl.constexpr):
    """Half a row of nibbles [N, D/4] -> its (lo, hi) quarters, fp16 [N, D/4]."""
    N: tl.constexpr = d.shape[0]
    if FMT == FMT_NVFP4:
        NB: tl.constexpr = D // 32
        scale = tl.broadcast_to((e4m3_to_f16(s, FAST) * 128.0)[:, :, None], (N, NB, 8))  # s * 2^7, exact in fp16
        lo, hi = nibbles_e2m1(tl.reshape(d, (N, NB, 8)), scale, FAST)
    else:
        NG: tl.constexpr = D // 64
        sc = tl.broadcast_to(s[:, :, None], (N, NG, 16))
        zr = tl.broadcast_to(z[:, :, None], (N, NG, 16))
        lo, hi = nibbles_int4(tl.reshape(d, (N, NG, 16)), sc, zr, FAST)
    return tl.reshape(lo, (N, D // 4)), tl.reshape(hi, (N, D // 4))


@triton.jit
def _crumb_rows(rows_ptr, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, D: tl.constexpr,
                P: tl.constexpr):  # fmt: skip
    """INT2 value rows, loads only: codes [N, D/4] u8 and per-token group scale / zero [N, D/32] fp16 (token-minor)."""
    Q: tl.constexpr = D // 4
    NG: tl.constexpr = D // 32
    j = tl.arange(0, Q)[None, :]
    g = tl.arange(0, NG)[None, :]
    p2 = rows_ptr[:, None]
    r = hrow[:, None]
    m = ok[:, None]
    d = tl.load(p2 + OFF + r * Q + j, mask=m, other=0)
    meta = meta_index(r, g, NG, P)
    s = tl.load((p2 + SOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m, other=0.0)
    z = tl.load((p2 + ZOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m, other=0.0)
    return d, s, z


@triton.jit
def _crumb_values(d, s, z, D: tl.constexpr, FAST: tl.constexpr):
    """INT2 values [N, D/4] u8 with group scale / zero [N, D/32] -> four fp16 quarters [N, D/4]."""
    N: tl.constexpr = d.shape[0]
    NG: tl.constexpr = D // 32
    sc = tl.broadcast_to(s[:, :, None], (N, NG, 8))
    zr = tl.broadcast_to(z[:, :, None], (N, NG, 8))
    c0, c1, c2, c3 = crumbs_int2(tl.reshape(d, (N, NG, 8)), sc, zr, FAST)
    Q: tl.constexpr = D // 4
    return tl.reshape(c0, (N, Q)), tl.reshape(c1, (N, Q)), tl.reshape(c2, (N, Q)), tl.reshape(c3, (N, Q))


@triton.jit
def _crumb_key_meta(page_ptr, h, OFF: tl.constexpr, i: tl.constexpr, D: tl.constexpr):
    """Per-channel INT2 key scale (or zero) of quarter i for each page of the iteration: [PPI, 1, D/4] fp16."""
    ch = 4 * tl.arange(0, D // 4) + i
    return tl.load((page_ptr[:, None] + OFF).to(tl.pointer_type(tl.float16)) + h * D + ch[None, :])[:, None, :]


@triton.jit
def _split(
    q_row_ptr,  # first query row of this kv head: [G, D] at stride D
    o_row_ptr,  # fp32 partial output of (b, h*G, s): rows at stride S*D
    lse_row_ptr,  # fp32 partial lse of (b, h*G, s): rows at stride S
    buf_ptr,  # uint8 layer buffer
    pt_row_ptr,  # int32 page-table row of this sequence
    page_lo,  # first page (index into the row) of this split
    page_hi,  # one past the last page of this split
    num_tokens,  # tokens of the sequence (masks the tail of the last page)
    h,  # kv head
    total_bytes,  # layer buffer bytes (INT2 pages count down from here)
    k_mul,  # fp32 factor turning q.k into base-2 logits
    S,  # splits per (sequence, head)
    FMT: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    D: tl.constexpr,
    P: tl.constexpr,  # tokens per page
    PAGE_BYTES: tl.constexpr,
    K_OFF: tl.constexpr,
    KS_OFF: tl.constexpr,
    KZ_OFF: tl.constexpr,  # byte offsets of K fields in a page
    V_OFF: tl.constexpr,
    VS_OFF: tl.constexpr,
    VZ_OFF: tl.constexpr,  # and of V fields
    BLOCK_H: tl.constexpr,  # G rounded up to >= 16
    PPI: tl.constexpr,  # pages per loop iteration
    NUM_STAGES: tl.constexpr,
    FAST: tl.constexpr,
):
    Q: tl.constexpr = D // 4
    N: tl.constexpr = PPI * P
    if FMT == FMT_BF16 and FAST:
        DT: tl.constexpr = tl.bfloat16
    elif FMT == FMT_BF16:
        # the interpreter's bf16 dot is wrong (numpy has no bf16); bf16 values are exact in tf32/fp32
        DT: tl.constexpr = tl.float32  # type: ignore[no-redef]
    else:
        DT: tl.constexpr = tl.float16  # type: ignore[no-redef]
    rh = tl.arange(0, BLOCK_H)[:, None]
    qmask = rh < G
    c0 = _channels(FMT, D, 0)[None, :]
    c1 = _channels(FMT, D, 1)[None, :]
    c2 = _channels(FMT, D, 2)[None, :]
    c3 = _channels(FMT, D, 3)[None, :]
    q0 = tl.load(q_row_ptr + rh * D + c0, mask=qmask, other=0.0).to(DT)
    q1 = tl.load(q_row_ptr + rh * D + c1, mask=qmask, other=0.0).to(DT)
    q2 = tl.load(q_row_ptr + rh * D + c2, mask=qmask, other=0.0).to(DT)
    q3 = tl.load(q_row_ptr + rh * D + c3, mask=qmask, other=0.0).to(DT)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0 = tl.zeros((BLOCK_H, Q), tl.float32)
    a1 = tl.zeros((BLOCK_H, Q), tl.float32)
    a2 = tl.zeros((BLOCK_H, Q), tl.float32)
    a3 = tl.zeros((BLOCK_H, Q), tl.float32)
    n = tl.arange(0, N)
    for it in tl.range(page_lo, page_hi, PPI, num_stages=NUM_STAGES):
        pidx = it + n // P  # page of each row (index into the page-table row)
        slot = n % P
        ok = (pidx * P + slot < num_tokens) & (pidx < page_hi)
        pid = tl.load(pt_row_ptr + pidx, mask=pidx < page_hi, other=0)
        if FMT == FMT_INT2:
            page = total_bytes - ((pid & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES
        else:
            page = pid.to(tl.int64) * PAGE_BYTES
        rows_ptr = buf_ptr + page  # [N] page base of each row
        hrow = h * P + slot  # row inside a [H, P, ...] field
        # all loads of the iteration first (K and V), then decode: more bytes in flight per program
        if FMT == FMT_INT2:
            ip = tl.arange(0, PPI)
            pids = tl.load(pt_row_ptr + it + ip, mask=it + ip < page_hi, other=0)
            pages = buf_ptr + total_bytes - ((pids & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES  # [PPI]
            kd = tl.load(rows_ptr[:, None] + K_OFF + hrow[:, None] * Q + tl.arange(0, Q)[None, :], mask=ok[:, None], other=0)
            ks0 = _crumb_key_meta(pages, h, KS_OFF, 0, D)
            ks1 = _crumb_key_meta(pages, h, KS_OFF, 1, D)
            ks2 = _crumb_key_meta(pages, h, KS_OFF, 2, D)
            ks3 = _crumb_key_meta(pages, h, KS_OFF, 3, D)
            kz0 = _crumb_key_meta(pages, h, KZ_OFF, 0, D)
            kz1 = _crumb_key_meta(pages, h, KZ_OFF, 1, D)
            kz2 = _crumb_key_meta(pages, h, KZ_OFF, 2, D)
            kz3 = _crumb_key_meta(pages, h, KZ_OFF, 3, D)
            vd, vs, vz = _crumb_rows(rows_ptr, hrow, ok, V_OFF, VS_OFF, VZ_OFF, D, P)
            # keys: per-channel scale / zero of each page, broadcast over its P rows
            e0, e1, e2, e3 = crumb_codes(tl.reshape(kd, (PPI, P, Q)), FAST)
            k0 = tl.reshape(e0 * ks0 + kz0, (N, Q)).to(DT)
            k1 = tl.reshape(e1 * ks1 + kz1, (N, Q)).to(DT)
            k2 = tl.reshape(e2 * ks2 + kz2, (N, Q)).to(DT)
            k3 = tl.reshape(e3 * ks3 + kz3, (N, Q)).to(DT)
            v0, v1, v2, v3 = _crumb_values(vd, vs, vz, D, FAST)
        elif FMT == FMT_NVFP4 or FMT == FMT_INT4:
            kd0, kd1, ks0, ks1, kz0, kz1 = _nibble_rows(rows_ptr, hrow, ok, K_OFF, KS_OFF, KZ_OFF, FMT, D, 0)
            vd0, vd1, vs0, vs1, vz0, vz1 = _nibble_rows(rows_ptr, hrow, ok, V_OFF, VS_OFF, VZ_OFF, FMT, D, P)
            k0, k1 = _nibble_decode(kd0, ks0, kz0, FMT, D, FAST)
            k2, k3 = _nibble_decode(kd1, ks1, kz1, FMT, D, FAST)
            v0, v1 = _nibble_decode(vd0, vs0, vz0, FMT, D, FAST)
            v2, v3 = _nibble_decode(vd1, vs1, vz1, FMT, D, FAST)
        else:
            k0, k1, k2, k3 = _plain_rows(rows_ptr, hrow, ok, K_OFF, FMT, D)
            v0, v1, v2, v3 = _plain_rows(rows_ptr, hrow, ok, V_OFF, FMT, D)
            k0, k1, k2, k3 = _plain_decode(k0, k1, k2, k3, FMT, FAST)
            v0, v1, v2, v3 = _plain_decode(v0, v1, v2, v3, FMT, FAST)
        sc = tl.dot(q0, tl.trans(k0.to(DT)))
        sc = tl.dot(q1, tl.trans(k1.to(DT)), sc)
        sc = tl.dot(q2, tl.trans(k2.to(DT)), sc)
        sc = tl.dot(q3, tl.trans(k3.to(DT)), sc)
        sc = tl.where(ok[None, :], sc * k_mul, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pt = p.to(DT)
        a0 = tl.dot(pt, v0.to(DT), a0 * alpha[:, None])
        a1 = tl.dot(pt, v1.to(DT), a1 * alpha[:, None])
        a2 = tl.dot(pt, v2.to(DT), a2 * alpha[:, None])
        a3 = tl.dot(pt, v3.to(DT), a3 * alpha[:, None])
        m_i = m_new
    # an empty split (no pages) reports lse = -inf and zeros, which the merge weighs by 0
    has = l_i > 0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)[:, None]
    hh = tl.arange(0, BLOCK_H)
    tl.store(lse_row_ptr + hh * S, tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=hh < G)
    tl.store(o_row_ptr + rh * (S * D) + c0, a0 * inv, mask=qmask)
    tl.store(o_row_ptr + rh * (S * D) + c1, a1 * inv, mask=qmask)
    tl.store(o_row_ptr + rh * (S * D) + c2, a2 * inv, mask=qmask)
    tl.store(o_row_ptr + rh * (S * D) + c3, a3 * inv, mask=qmask)


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, H*G, D] queries, contiguous
    o_ptr,  # fp32 [B, H*G, S, D] per-split outputs (normalised by their own softmax sums)
    lse_ptr,  # fp32 [B, H*G, S] per-split base-2 log-sum-exp (-inf for an empty split)
    buf_ptr,  # uint8 [total_bytes] the layer's pages
    pt_ptr,  # int32 [B, pt_stride] page tables
    lens_ptr,  # int32 [B] cached tokens per sequence
    n2_ptr,  # int32 [B] INT2 pages leading each row (TRIAXIAL only)
    k_mul,  # fp32 sm_scale * log2(e) * the K format's folded scale
    total_bytes,  # layer buffer size in bytes
    pt_stride,  # page-table row stride (elements)
    S,  # splits per (sequence, head); grid axis 0 (runtime, so batch shapes share one compiled kernel)
    PPS,  # pages per split
    FMT: tl.constexpr,  # page format of `layout` (FMT_*)
    PART: tl.constexpr,  # 0: plain pages; triaxial rows (INT2 pages first): 2 runs the INT2 splits, 4 the INT4 splits
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    K_OFF: tl.constexpr,
    KS_OFF: tl.constexpr,
    KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr,
    VS_OFF: tl.constexpr,
    VZ_OFF: tl.constexpr,
    PAGE_BYTES2: tl.constexpr,
    K_OFF2: tl.constexpr,
    KS_OFF2: tl.constexpr,
    KZ_OFF2: tl.constexpr,  # INT2 layout
    V_OFF2: tl.constexpr,
    VS_OFF2: tl.constexpr,
    VZ_OFF2: tl.constexpr,
    BLOCK_H: tl.constexpr,  # G padded to >= 16
    PPI: tl.constexpr,  # pages per loop iteration
    NUM_STAGES: tl.constexpr,
    FAST: tl.constexpr,  # 0 portable arithmetic, 1 inline-assembly decoders (GPU), 2 and E2M1 by cvt (Blackwell)
    PDL: tl.constexpr = False,  # triton_pdl.mode (OFF, EARLY, LATE): wait before any access
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    num_tokens = tl.load(lens_ptr + b)
    num_pages = tl.cdiv(num_tokens, P)
    head0 = b * (H * G) + h * G  # first query head of this kv head
    q_row = q_ptr + head0.to(tl.int64) * D
    o_row = o_ptr + (head0.to(tl.int64) * S + s) * D
    lse_row = lse_ptr + head0.to(tl.int64) * S + s
    pt_row = pt_ptr + b.to(tl.int64) * pt_stride
    if PART == 0:
        lo = s * PPS
        _split(
            q_row,
            o_row,
            lse_row,
            buf_ptr,
            pt_row,
            lo,
            tl.minimum(lo + PPS, num_pages),
            num_tokens,
            h,
            total_bytes,
            k_mul,
            S,
            FMT,
            G,
            D,
            P,
            PAGE_BYTES,
            K_OFF,
            KS_OFF,
            KZ_OFF,
            V_OFF,
            VS_OFF,
            VZ_OFF,
            BLOCK_H,
            PPI,
            NUM_STAGES,
            FAST,
        )
    else:
        # triaxial: two launches over the same grid, each compiled for one precision (fewer registers)
        n2 = tl.load(n2_ptr + b)
        c2 = tl.cdiv(n2, PPS)  # splits that cover the INT2 pages
        if PART == 2:
            if s < c2:
                lo = s * PPS
                _split(
                    q_row,
                    o_row,
                    lse_row,
                    buf_ptr,
                    pt_row,
                    lo,
                    tl.minimum(lo + PPS, n2),
                    num_tokens,
                    h,
                    total_bytes,
                    k_mul,
                    S,
                    FMT_INT2,
                    G,
                    D,
                    P,
                    PAGE_BYTES2,
                    K_OFF2,
                    KS_OFF2,
                    KZ_OFF2,
                    V_OFF2,
                    VS_OFF2,
                    VZ_OFF2,
                    BLOCK_H,
                    PPI,
                    NUM_STAGES,
                    FAST,
                )
        else:
            if s >= c2:
                lo = n2 + (s - c2) * PPS
                _split(
                    q_row,
                    o_row,
                    lse_row,
                    buf_ptr,
                    pt_row,
                    lo,
                    tl.minimum(lo + PPS, num_pages),
                    num_tokens,
                    h,
                    total_bytes,
                    k_mul,
                    S,
                    FMT,
                    G,
                    D,
                    P,
                    PAGE_BYTES,
                    K_OFF,
                    KS_OFF,
                    KZ_OFF,
                    V_OFF,
                    VS_OFF,
                    VZ_OFF,
                    BLOCK_H,
                    PPI,
                    NUM_STAGES,
                    FAST,
                )


# Per format: pages per loop iteration, warps, pipeline stages, and programs per SM the split
# planner aims for (enough waves that the last one's tail is small): the fastest of bench/decode_gpu.py --sweep.
TUNING: dict[str, dict[str, int]] = {
    "bf16": {"PPI": 4, "num_warps": 4, "NUM_STAGES": 2, "PPSM": 16},
    "fp8_e4m3": {"PPI": 8, "num_warps": 4, "NUM_STAGES": 2, "PPSM": 16},
    "nvfp4": {"PPI": 8, "num_warps": 4, "NUM_STAGES": 2, "PPSM": 16, "maxnreg": 128},
    # int4 pages, alone or (triaxial) with INT2 pages: PPI2 INT2 pages per iteration
    "int4": {"PPI": 4, "PPI2": 2, "num_warps": 4, "NUM_STAGES": 2, "PPSM": 16, "maxnreg": 128},
}


def decode_attention(
    q: torch.Tensor,
    kv: PagedKV,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    num_int2_pages: torch.Tensor | None = None,
    fast: bool,
    e2m1_cvt: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """Launch the tl decode (arguments checked by paged_ops) -> [B, Hq, D] in q.dtype: TUNING's kernel on the
    planner's splits. fast: inline-assembly decoders (KernelOptions.fast_decoders); e2m1_cvt: with fast, nvfp4
    nibbles by Blackwell's cvt.rn.f16x2.e2m1x2 (capability.TABLE's e2m1 "cvt"); pdl: the decode and the split
    merge with programmatic dependent launch."""
    if kv.layout.fmt not in TUNING:
        raise ValueError(f"no Triton decode for {kv.layout.fmt!r} pages (fp32 pages run on the reference path)")
    out, _ = launch_decode(q, kv, page_table, seq_lens, sm_scale=sm_scale, num_int2_pages=num_int2_pages, fast=fast,
                           e2m1_cvt=e2m1_cvt, cfg=TUNING[kv.layout.fmt], pdl=pdl)  # fmt: skip
    return out


def launch_decode(
    q: torch.Tensor,
    kv: PagedKV,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float,
    num_int2_pages: torch.Tensor | None,
    fast: bool,
    cfg: dict[str, int],
    plan: tuple[int, int] | None = None,
    e2m1_cvt: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, Any]:
    """The launch of ``decode_attention`` with its tuning ``cfg`` given and, optionally, its split plan (splits,
    pages per split; None: triton_common.plan_splits') -> (output, the last compiled kernel). decode_attention
    passes TUNING's; tests and benchmarks pass their own."""
    layout = kv.layout
    if layout.fmt not in TUNING:
        raise ValueError(f"no Triton decode for {layout.fmt!r} pages (fp32 pages run on the reference path)")
    ppi2 = cfg.get("PPI2", cfg["PPI"])  # INT2 pages per iteration (triaxial)
    run = prepare_splits(q, kv, page_table, seq_lens, num_int2_pages, pages_per_iter=cfg["PPI"],
                         programs_per_sm=cfg["PPSM"], splits=plan)  # fmt: skip
    k_fold, v_fold = folded_scales(kv)
    lay, lay2 = kv_field_offsets(kv)
    # triaxial: two launches over the same grid, the INT2 splits' (PART 2) and the INT4 splits' (PART 4)
    parts = (2, 4) if kv.triaxial else (0,)
    extra = {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}
    kernel = None
    for part in parts:
        kernel = _decode_kernel[run.grid](
            run.q, run.o, run.lse, kv.base, run.page_table, seq_lens, run.n2,
            sm_scale * LOG2E * k_fold, kv.int2_top, run.page_table.stride(0), run.splits, run.pages_per_split,
            FMT=FMT_CODES[layout.fmt], PART=part, H=run.kv_heads, G=run.group, D=layout.head_dim, P=layout.page_size,
            PAGE_BYTES=lay[0], K_OFF=lay[1], KS_OFF=lay[2], KZ_OFF=lay[3], V_OFF=lay[4], VS_OFF=lay[5], VZ_OFF=lay[6],
            PAGE_BYTES2=lay2[0], K_OFF2=lay2[1], KS_OFF2=lay2[2], KZ_OFF2=lay2[3], V_OFF2=lay2[4], VS_OFF2=lay2[5],
            VZ_OFF2=lay2[6], BLOCK_H=max(16, triton.next_power_of_2(run.group)),
            PPI=ppi2 if part == 2 else cfg["PPI"], NUM_STAGES=cfg["NUM_STAGES"],
            FAST=2 if fast and e2m1_cvt else int(fast), num_warps=cfg["num_warps"], **extra,
            **triton_pdl.launch(pdl, q.shape[0]),
        )  # fmt: skip
    return merge_splits(run, v_mul=v_fold, pdl=pdl), kernel
