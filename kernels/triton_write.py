"""Triton quantize-on-write: new K/V tokens into their pages (bf16, fp8, nvfp4, int4) and whole INT2 pages, one launch each.

Bit-identical to paged_ref.write_kv / write_int2_pages: the encoders in
triton_codec repeat the reference codecs' fp32 operations in order.

``write_kv``: one program per (block of BT tokens, kv head); each token's
row of K and V is quantized and stored at ``page * page_bytes + field +
(h * P + slot) * row_bytes``.
``write_int2_pages``: one program per (page, kv head): the page's [P, D] key
tile gives per-channel scales (min/max over its P tokens), values use
per-token groups of 32 channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import INT2_PAGE_FLAG, PageLayout
from .triton_codec import e2m1_codes, e4m3_bits, e4m3_value, int_codes, int_stats, to_bf16
from .triton_decode import FMT_BF16, FMT_CODES, FMT_FP8, FMT_INT4, FMT_NVFP4, field_offsets

FLAG: tl.constexpr = tl.constexpr(INT2_PAGE_FLAG)


@triton.jit
def _pack_pairs(codes, SHAPE: tl.constexpr):
    """int32 codes [..., 2n] -> uint8 [..., n]: element 2j in the low nibble, 2j+1 in the high one."""
    lo, hi = tl.split(tl.reshape(codes, SHAPE))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _pack_quads(codes, SHAPE: tl.constexpr):
    """int32 codes [..., 4n] -> uint8 [..., n]: element 4j+k in bits 2k..2k+1 (SHAPE = [..., n, 2, 2])."""
    even, odd = tl.split(tl.reshape(codes, SHAPE))  # element 4j + {0, 2} and 4j + {1, 3}
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return (c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)).to(tl.uint8)


@triton.jit
def _write_rows(x_ptr, tok, tok_ok, h, rows_ptr, hrow, scale, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr,
                FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
    """Quantize x[tok, h, :] (fp32) into each token's row ``hrow`` of the page at ``rows_ptr``."""
    src = x_ptr + (tok.to(tl.int64) * H + h) * D  # [BT] row starts of x
    if FMT == FMT_NVFP4:
        NB: tl.constexpr = D // 16
        b = tl.arange(0, NB)[None, :, None]
        e = tl.arange(0, 16)[None, None, :]
        m3 = tok_ok[:, None, None]
        x = tl.load(src[:, None, None] + b * 16 + e, mask=m3, other=0.0).to(tl.float32)  # [BT, NB, 16]
        amax = tl.max(tl.abs(x), axis=2)
        sbits = e4m3_bits(tl.math.div_rn(tl.math.div_rn(amax, 6.0), scale))
        big_s = e4m3_value(sbits) * scale  # the rounded block scale
        zero_block = big_s == 0
        t = tl.math.div_rn(x, tl.where(zero_block, 1.0, big_s)[:, :, None])
        codes = tl.where(zero_block[:, :, None], 0, e2m1_codes(t))
        packed = _pack_pairs(codes, (BT, NB, 8, 2))
        jj = tl.arange(0, 8)[None, None, :]
        tl.store(rows_ptr[:, None, None] + OFF + hrow[:, None, None] * (D // 2) + b * 8 + jj, packed, mask=m3)
        b2 = tl.arange(0, NB)[None, :]
        tl.store(rows_ptr[:, None] + SOFF + hrow[:, None] * NB + b2, sbits.to(tl.uint8), mask=tok_ok[:, None])
    elif FMT == FMT_INT4:
        NG: tl.constexpr = D // 32
        g = tl.arange(0, NG)[None, :, None]
        e = tl.arange(0, 32)[None, None, :]
        m3 = tok_ok[:, None, None]
        x = tl.load(src[:, None, None] + g * 32 + e, mask=m3, other=0.0).to(tl.float32)  # [BT, NG, 32]
        sc, zr = int_stats(tl.min(x, axis=2), tl.max(x, axis=2), 15)
        codes = int_codes(x, sc[:, :, None], zr[:, :, None], 15)
        packed = _pack_pairs(codes, (BT, NG, 16, 2))
        jj = tl.arange(0, 16)[None, None, :]
        tl.store(rows_ptr[:, None, None] + OFF + hrow[:, None, None] * (D // 2) + g * 16 + jj, packed, mask=m3)
        meta = hrow[:, None] * NG + tl.arange(0, NG)[None, :]
        tl.store((rows_ptr[:, None] + SOFF).to(tl.pointer_type(tl.float16)) + meta, sc, mask=tok_ok[:, None])
        tl.store((rows_ptr[:, None] + ZOFF).to(tl.pointer_type(tl.float16)) + meta, zr, mask=tok_ok[:, None])
    else:
        d = tl.arange(0, D)[None, :]
        m = tok_ok[:, None]
        x = tl.load(src[:, None] + d, mask=m, other=0.0).to(tl.float32)
        if FMT == FMT_BF16:
            tl.store((rows_ptr[:, None] + OFF).to(tl.pointer_type(tl.bfloat16)) + hrow[:, None] * D + d, to_bf16(x), mask=m)
        else:  # fp8
            bits = e4m3_bits(tl.math.div_rn(x, scale))
            tl.store(rows_ptr[:, None] + OFF + hrow[:, None] * D + d, bits.to(tl.uint8), mask=m)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, H, D] new keys / values (float, contiguous)
    buf_ptr,  # uint8 layer buffer
    page_ptr, slot_ptr,  # int32 [T] destination page id and slot of each token
    num_tokens,  # T
    k_scale, v_scale,  # fp32 per-layer scales (fp8: divisor; nvfp4: global scale g)
    FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    PAGE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
    BT: tl.constexpr,  # tokens per program
):
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    ok = tok < num_tokens
    page = tl.load(page_ptr + tok, mask=ok, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + tok, mask=ok, other=0)
    rows_ptr = buf_ptr + page * PAGE_BYTES
    hrow = h * P + slot
    _write_rows(k_ptr, tok, ok, h, rows_ptr, hrow, k_scale, K_OFF, KS_OFF, KZ_OFF, FMT, H, D, BT)
    _write_rows(v_ptr, tok, ok, h, rows_ptr, hrow, v_scale, V_OFF, VS_OFF, VZ_OFF, FMT, H, D, BT)


@triton.jit
def _write_int2_kernel(
    k_ptr, v_ptr,  # [N, P, H, D] whole pages of keys / values (float, contiguous)
    buf_ptr,  # uint8 layer buffer
    page_ptr,  # int32 [N] INT2 page ids (with INT2_PAGE_FLAG)
    total_bytes,  # layer buffer size: INT2 page i starts at total_bytes - (i + 1) * PAGE_BYTES
    H: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    PAGE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    pid = tl.load(page_ptr + n)
    page = buf_ptr + total_bytes - ((pid & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES
    p = tl.arange(0, P)
    src = (n.to(tl.int64) * P + p) * H + h  # [P] token rows of this page and head
    # keys: per channel over the page's P tokens
    d = tl.arange(0, D)
    k = tl.load(k_ptr + src[:, None] * D + d[None, :]).to(tl.float32)  # [P, D]
    ks, kz = int_stats(tl.min(k, axis=0), tl.max(k, axis=0), 3)
    kc = _pack_quads(int_codes(k, ks[None, :], kz[None, :], 3), (P, D // 4, 2, 2))
    q = tl.arange(0, D // 4)
    tl.store(page + K_OFF + (h * P + p)[:, None] * (D // 4) + q[None, :], kc)
    tl.store((page + KS_OFF).to(tl.pointer_type(tl.float16)) + h * D + d, ks)
    tl.store((page + KZ_OFF).to(tl.pointer_type(tl.float16)) + h * D + d, kz)
    # values: per token, groups of 32 channels
    NG: tl.constexpr = D // 32
    g = tl.arange(0, NG)[None, :, None]
    e = tl.arange(0, 32)[None, None, :]
    v = tl.load(v_ptr + src[:, None, None] * D + g * 32 + e).to(tl.float32)  # [P, NG, 32]
    vs, vz = int_stats(tl.min(v, axis=2), tl.max(v, axis=2), 3)
    vc = _pack_quads(int_codes(v, vs[:, :, None], vz[:, :, None], 3), (P, NG, 8, 2, 2))
    jj = tl.arange(0, 8)[None, None, :]
    hp = (h * P + p)[:, None, None]
    tl.store(page + V_OFF + hp * (D // 4) + g * 8 + jj, vc)
    meta = (h * P + p)[:, None] * NG + tl.arange(0, NG)[None, :]
    tl.store((page + VS_OFF).to(tl.pointer_type(tl.float16)) + meta, vs)
    tl.store((page + VZ_OFF).to(tl.pointer_type(tl.float16)) + meta, vz)


WRITE_BT = 16  # tokens per program of write_kv


def write_kv(
    buffer: torch.Tensor,
    layout: PageLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Launch quantize-on-write (arguments checked by paged_ops)."""
    if layout.fmt not in ("bf16", "fp8_e4m3", "nvfp4", "int4"):
        raise ValueError(f"no Triton write for {layout.fmt!r} pages (fp32 pages run on the reference path)")
    t, h, d = k.shape
    if t == 0:
        return
    pb, ko, kso, kzo, vo, vso, vzo = field_offsets(layout)
    _write_kv_kernel[(triton.cdiv(t, WRITE_BT), h)](
        k.contiguous(), v.contiguous(), buffer, page_ids, slots, t, float(k_scale), float(v_scale),
        FMT=FMT_CODES[layout.fmt], H=h, D=d, P=layout.page_size,
        PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, V_OFF=vo, VS_OFF=vso, VZ_OFF=vzo,
        BT=WRITE_BT, num_warps=4,
    )  # fmt: skip


def write_int2_pages(
    buffer: torch.Tensor,
    layout: PageLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    page_ids: torch.Tensor,
    *,
    total_bytes: int,
) -> None:
    """Launch the INT2 whole-page writer (arguments checked by paged_ops)."""
    n, p, h, d = k.shape
    if n == 0:
        return
    pb, ko, kso, kzo, vo, vso, vzo = field_offsets(layout)
    _write_int2_kernel[(n, h)](
        k.contiguous(), v.contiguous(), buffer, page_ids, total_bytes,
        H=h, D=d, P=p, PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, V_OFF=vo, VS_OFF=vso, VZ_OFF=vzo,
        num_warps=4,
    )  # fmt: skip
