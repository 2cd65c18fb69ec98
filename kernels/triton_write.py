"""Triton quantize-on-write: new K/V tokens into their pages (bf16, fp8, nvfp4, int4) and whole INT2 pages.

Bit-identical to paged_ref.write_kv / write_int2_pages: the encoders in
triton_codec give the reference codecs' fp32 results bit for bit (the INT
codes divide by their fp16 scale with ``div_f16``: three FMA-pipe
instructions instead of an IEEE division per value).

Two program shapes, both one (block of tokens, kv head) per program for
``write_kv``:

* rows (bf16, fp8, nvfp4): each token's row of K and V is quantized as a
  [BT, D] tile; reductions (nvfp4 block amax) run across lanes.
* groups (int4): one thread owns one group of 32
  consecutive channels of one token, so the group's min/max stay in its registers and its packed codes leave as one 16-byte
  store. The group is loaded as four 16-byte chunks (four [R, 8] loads with
  the same layout) because Triton gives a thread at most 16 bytes of one
  load::

      group r of the program (R = BT * D/32 of them, one per thread):
        x[tok, h, 32g : 32g+32]  = chunk0 | chunk1 | chunk2 | chunk3   (8 values each)
      int4 word i = the 8 nibbles of chunk i (element 8i+j in bits 4j..4j+3)
      page row:  k[h, slot, 16g : 16g+16] = word0 word1 word2 word3  (one 16-byte store)

``write_int2_pages``: two launches. Keys: one program per (page, block of HB
heads), a [P, HB*D] tile in which each thread owns 8 channels of P/2 tokens,
so the per-channel min/max over the page stay in registers (plus one
shuffle). Values: the group-per-thread shape above with 2-bit codes (8 bytes
a group), flat over (page, head, token, group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .page_ids import INT2_PAGE_FLAG
from . import triton_pdl
from .paged_kv import PagedKV
from .triton_codec import e2m1_codes, e4m3_bits, e4m3_value, int_codes, int_stats, meta_index, to_bf16
from .triton_common import FMT_BF16, FMT_CODES, FMT_NVFP4, field_offsets

FLAG: tl.constexpr = tl.constexpr(INT2_PAGE_FLAG)


# ----------------------------------------------------------------------------
# packing
# ----------------------------------------------------------------------------


@triton.jit
def _pack_pairs(codes, SHAPE: tl.constexpr):
    """int32 codes [..., 2n] -> uint8 [..., n]: element 2j in the low nibble, 2j+1 in the high one."""
    lo, hi = tl.split(tl.reshape(codes, SHAPE))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _pack_word(codes, BITS: tl.constexpr):
    """int32 codes [R, 8] (in one thread) -> int32 [R]: element j in bits BITS*j .. BITS*j + BITS-1."""
    shift = BITS * tl.arange(0, 8)[None, :]
    return tl.sum(codes << shift, axis=1)  # the fields do not overlap: the sum is an OR


@triton.jit
def _words4(w0, w1, w2, w3):
    """Four int32 [R] -> [R, 4] (w0 first), one thread's 16 bytes."""
    # join(a, b)[r, i] = (a[r, i], b[r, i]): the outer join interleaves, so pair w0 with w2
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (w0.shape[0], 4))


# ----------------------------------------------------------------------------
# one group of 32 channels per thread
# ----------------------------------------------------------------------------


@triton.jit
def _load_group(src, ok):
    """src: [R] pointers to 32 consecutive values -> four [R, 8] chunks in the input dtype (masked rows read 0)."""
    e = tl.arange(0, 8)[None, :]
    m = ok[:, None]
    c0 = tl.load(src[:, None] + e, mask=m, other=0.0)
    c1 = tl.load(src[:, None] + (e + 8), mask=m, other=0.0)
    c2 = tl.load(src[:, None] + (e + 16), mask=m, other=0.0)
    c3 = tl.load(src[:, None] + (e + 24), mask=m, other=0.0)
    return c0, c1, c2, c3


@triton.jit
def _int_group(c0, c1, c2, c3, LEVELS: tl.constexpr, BITS: tl.constexpr):
    """Four [R, 8] chunks of a group -> (four packed int32 [R] words, fp16 scale [R], fp16 zero [R])."""
    c0, c1, c2, c3 = c0.to(tl.float32), c1.to(tl.float32), c2.to(tl.float32), c3.to(tl.float32)
    lo = tl.min(tl.minimum(tl.minimum(c0, c1), tl.minimum(c2, c3)), axis=1)
    hi = tl.max(tl.maximum(tl.maximum(c0, c1), tl.maximum(c2, c3)), axis=1)
    scale, zero = int_stats(lo, hi, LEVELS)
    s = scale.to(tl.float32)[:, None]
    z = zero.to(tl.float32)[:, None]
    inv = 1.0 / s  # within 2 ulp: all div_f16 needs
    w0 = _pack_word(int_codes(c0, s, z, inv, LEVELS), BITS)
    w1 = _pack_word(int_codes(c1, s, z, inv, LEVELS), BITS)
    w2 = _pack_word(int_codes(c2, s, z, inv, LEVELS), BITS)
    w3 = _pack_word(int_codes(c3, s, z, inv, LEVELS), BITS)
    return w0, w1, w2, w3, scale, zero


@triton.jit
def _store_group(c0, c1, c2, c3, rows_ptr, hrow, g, ok, scale, OFF: tl.constexpr, SOFF: tl.constexpr,
                 ZOFF: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, TM: tl.constexpr):  # fmt: skip
    """Quantize one int4 group per thread and store its 16 data bytes, its scale and its zero."""
    NG: tl.constexpr = D // 32
    w0, w1, w2, w3, sc, zr = _int_group(c0, c1, c2, c3, 15, 4)
    meta = meta_index(hrow, g, NG, TM)  # [R] fp16 index of the group's scale and zero
    tl.store((rows_ptr + SOFF).to(tl.pointer_type(tl.float16)) + meta, sc, mask=ok)
    tl.store((rows_ptr + ZOFF).to(tl.pointer_type(tl.float16)) + meta, zr, mask=ok)
    # data: D/2 bytes a row, 16 per group -> int32 index (hrow * D/2 + 16g) / 4
    didx = (hrow * (D // 8) + g * 4)[:, None] + tl.arange(0, 4)[None, :]
    tl.store((rows_ptr + OFF).to(tl.pointer_type(tl.int32))[:, None] + didx, _words4(w0, w1, w2, w3), mask=ok[:, None])


# ----------------------------------------------------------------------------
# one token row per tile row (bf16, fp8, nvfp4)
# ----------------------------------------------------------------------------


@triton.jit
def _write_rows(x_ptr, tok, tok_ok, h, rows_ptr, hrow, scale, OFF: tl.constexpr, SOFF: tl.constexpr,
                FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):  # fmt: skip
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
    k_ptr,
    v_ptr,  # [T, H, D] new keys / values (float, contiguous)
    buf_ptr,  # uint8 layer buffer
    page_ptr,
    slot_ptr,  # int32 [T] destination page id and slot of each token
    num_tokens,  # T
    k_scale,
    v_scale,  # fp32 per-layer scales (fp8: divisor; nvfp4: global scale g)
    FMT: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    K_OFF: tl.constexpr,
    KS_OFF: tl.constexpr,
    KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr,
    VS_OFF: tl.constexpr,
    VZ_OFF: tl.constexpr,
    BT: tl.constexpr,  # tokens per program
    GROUPS: tl.constexpr,  # 1: one 32-channel group per thread (int4); 0: token rows
    PDL: tl.constexpr,  # triton_pdl.mode (OFF, EARLY, LATE): wait before any access
):
    h = tl.program_id(1)
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    if GROUPS:
        NG: tl.constexpr = D // 32
        r = tl.arange(0, BT * NG)  # the program's groups, token-major: lanes 4i..4i+3 share a token (D = 128)
        tok = tl.program_id(0) * BT + r // NG
        g = r % NG
        ok = tok < num_tokens
        src = (tok.to(tl.int64) * H + h) * D + g * 32
        # both loads before any store: the compiler may not move a load above a store to another pointer
        k0, k1, k2, k3 = _load_group(k_ptr + src, ok)
        v0, v1, v2, v3 = _load_group(v_ptr + src, ok)
        page = tl.load(page_ptr + tok, mask=ok, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + tok, mask=ok, other=0)
        rows_ptr = buf_ptr + page * PAGE_BYTES
        hrow = h * P + slot
        _store_group(k0, k1, k2, k3, rows_ptr, hrow, g, ok, k_scale, K_OFF, KS_OFF, KZ_OFF, FMT, D, 0)
        _store_group(v0, v1, v2, v3, rows_ptr, hrow, g, ok, v_scale, V_OFF, VS_OFF, VZ_OFF, FMT, D, P)
    else:
        tok = tl.program_id(0) * BT + tl.arange(0, BT)
        ok = tok < num_tokens
        page = tl.load(page_ptr + tok, mask=ok, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + tok, mask=ok, other=0)
        rows_ptr = buf_ptr + page * PAGE_BYTES
        hrow = h * P + slot
        _write_rows(k_ptr, tok, ok, h, rows_ptr, hrow, k_scale, K_OFF, KS_OFF, FMT, H, D, BT)
        _write_rows(v_ptr, tok, ok, h, rows_ptr, hrow, v_scale, V_OFF, VS_OFF, FMT, H, D, BT)


# ----------------------------------------------------------------------------
# whole INT2 pages: keys and values in two launches
# ----------------------------------------------------------------------------


@triton.jit
def _widen(raw):
    """Loaded values -> fp32. For bf16 a shift of the bits: a second conversion the compiler will not merge
    with the first (.to), so the codes loop need not keep the min/max loop's fp32 copy alive."""
    if raw.dtype == tl.bfloat16:
        return (raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _int2_page(buf_ptr, page_ptr, n, total_bytes, PAGE_BYTES: tl.constexpr):
    """Start of INT2 page ``page_ptr[n]``: INT2 page i lies at total_bytes - (i + 1) * PAGE_BYTES."""
    pid = tl.load(page_ptr + n)
    return buf_ptr + total_bytes - ((pid & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES


@triton.jit
def _write_int2_keys_kernel(
    k_ptr,  # [N, P, H, D] whole pages of keys (float, contiguous)
    buf_ptr,  # uint8 layer buffer
    page_ptr,  # int32 [N] INT2 page ids (with INT2_PAGE_FLAG)
    total_bytes,  # layer buffer size
    H: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    K_OFF: tl.constexpr,
    KS_OFF: tl.constexpr,
    KZ_OFF: tl.constexpr,
    HB: tl.constexpr,  # kv heads per program
):
    """Keys of heads h0 .. h0+HB of page n: scale and zero per channel over the page's P tokens.

    The [P, HB*D] tile is HB heads side by side (contiguous in k). With
    HB*D/8 lanes (1 warp for D = 128, HB = 1) Triton gives each thread 8
    adjacent channels of P/2 tokens: the min/max over tokens are in-thread
    plus one shuffle. A thread's 8 channels of a token are 2 bytes of codes.
    """
    n = tl.program_id(0)
    h0 = tl.program_id(1) * HB
    page = _int2_page(buf_ptr, page_ptr, n, total_bytes, PAGE_BYTES)
    C: tl.constexpr = HB * D
    p = tl.arange(0, P)
    col = tl.arange(0, C)
    raw = tl.load(k_ptr + ((n.to(tl.int64) * P + p) * H + h0)[:, None] * D + col[None, :])  # [P, C]
    x = raw.to(tl.float32)
    ks, kz = int_stats(tl.min(x, axis=0), tl.max(x, axis=0), 3)
    s = ks.to(tl.float32)[None, :]
    codes = int_codes(_widen(raw), s, kz.to(tl.float32)[None, :], 1.0 / s, 3)
    # [P, C] -> [P, C/8, 8] -> one 16-bit field per 8 channels
    quads = tl.sum(tl.reshape(codes, (P, C // 8, 8)) << (2 * tl.arange(0, 8))[None, None, :], axis=2)  # [P, C/8]
    j = tl.arange(0, C // 8)
    hrow = (h0 + j // (D // 8))[None, :] * P + p[:, None]  # [P, C/8] row of (head, token)
    at = hrow * (D // 8) + (j % (D // 8))[None, :]  # uint16 index: byte (hrow * D/4 + 2 * (j % (D/8))) / 2
    tl.store((page + K_OFF).to(tl.pointer_type(tl.uint16)) + at, quads.to(tl.uint16))
    tl.store((page + KS_OFF).to(tl.pointer_type(tl.float16)) + h0 * D + col, ks)
    tl.store((page + KZ_OFF).to(tl.pointer_type(tl.float16)) + h0 * D + col, kz)


@triton.jit
def _write_int2_values_kernel(
    v_ptr,  # [N, P, H, D] whole pages of values (float, contiguous)
    buf_ptr,  # uint8 layer buffer
    page_ptr,  # int32 [N] INT2 page ids (with INT2_PAGE_FLAG)
    total_bytes,  # layer buffer size
    num_groups,  # N * P * H * D/32
    H: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    V_OFF: tl.constexpr,
    VS_OFF: tl.constexpr,
    VZ_OFF: tl.constexpr,
    R: tl.constexpr,  # groups per program (one per thread)
):
    """Values: per token, groups of 32 channels, one group per thread; 8 bytes of codes a group.

    Groups are numbered (page, head, token, group) so that adjacent lanes
    write adjacent bytes of the page (rows are head-major there).
    """
    NG: tl.constexpr = D // 32
    gi = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    ok = gi < num_groups
    g = (gi % NG).to(tl.int32)
    p = ((gi // NG) % P).to(tl.int32)
    h = ((gi // (NG * P)) % H).to(tl.int32)
    n = gi // (NG * P * H)
    c0, c1, c2, c3 = _load_group(v_ptr + ((n * P + p) * H + h) * D + g * 32, ok)
    page = _int2_page(buf_ptr, page_ptr + n, 0, total_bytes, PAGE_BYTES)  # [R]
    w0, w1, w2, w3, vs, vz = _int_group(c0, c1, c2, c3, 3, 2)
    hrow = h * P + p
    # chunk i is 16 bits: the group's 8 bytes are two int32 words at index (hrow * D/4 + 8g) / 4
    words = tl.reshape(tl.join(w0 | (w1 << 16), w2 | (w3 << 16)), (R, 2))
    at = (hrow * (D // 16) + g * 2)[:, None] + tl.arange(0, 2)[None, :]
    tl.store((page + V_OFF).to(tl.pointer_type(tl.int32))[:, None] + at, words, mask=ok[:, None])
    meta = meta_index(hrow, g, NG, P)
    tl.store((page + VS_OFF).to(tl.pointer_type(tl.float16)) + meta, vs, mask=ok)
    tl.store((page + VZ_OFF).to(tl.pointer_type(tl.float16)) + meta, vz, mask=ok)


# ----------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------

# Launch shapes by format: int4 writes one 32-channel group per thread ("groups"), the others token rows of
# "bt" tokens a program.
WRITE_TUNING: dict[str, dict[str, int]] = {
    "bf16": {"bt": 16, "num_warps": 4},
    "fp8_e4m3": {"bt": 16, "num_warps": 4},
    "nvfp4": {"bt": 16, "num_warps": 4},
    "int4": {"num_warps": 4},
}
# INT2 pages: kv heads per keys program (at most; a power of two dividing H), warps of the keys
# programs, and groups (= threads) per values program.
INT2_TUNING: dict[str, int] = {"heads": 1, "key_warps": 1, "value_warps": 4}


def write_shape(fmt: str, tokens: int) -> tuple[int, int]:
    """(num_warps, bt) of a write of ``tokens`` tokens: WRITE_TUNING's shape, with token rows cut to the next power
    of two of ``tokens`` (and a warp per token below 4) so that a decode step's few tokens do not run the masked
    rows' quantizer arithmetic: the software E4M3 / E2M1 rounding of 16 rows took ~7 us a layer for one token."""
    tuning = WRITE_TUNING[fmt]
    if "bt" not in tuning:
        return tuning["num_warps"], 0
    bt = min(tuning["bt"], triton.next_power_of_2(max(tokens, 1)))
    return min(tuning["num_warps"], bt), bt


def write_kv(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor, slots: torch.Tensor, *,
             pdl: bool = False) -> None:  # fmt: skip
    """Launch quantize-on-write (arguments checked by paged_ops) with ``write_shape``'s launch shape; ``pdl``:
    with programmatic dependent launch (triton_pdl)."""
    if kv.layout.fmt not in WRITE_TUNING:
        raise ValueError(f"no Triton write for {kv.layout.fmt!r} pages (fp32 pages run on the reference path)")
    num_warps, bt = write_shape(kv.layout.fmt, k.shape[0])
    launch_write_kv(kv, k, v, page_ids, slots, num_warps=num_warps, bt=bt, pdl=pdl)


def launch_write_kv(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor, slots: torch.Tensor, *,
                    num_warps: int, bt: int, pdl: bool = False) -> None:  # fmt: skip
    """write_kv with its launch shape given (tests and benchmarks time others): ``num_warps`` warps a program and,
    for token rows, ``bt`` tokens a program (int4 groups: as many tokens as one group a thread makes)."""
    layout = kv.layout
    if layout.fmt not in WRITE_TUNING:
        raise ValueError(f"no Triton write for {layout.fmt!r} pages (fp32 pages run on the reference path)")
    t, h, d = k.shape
    if t == 0:
        return
    groups = layout.fmt == "int4"
    # one group per thread: 32 * num_warps groups of D/32 per token (Triton gives each thread a whole 8-value chunk
    # only when the tile has 8 values per thread)
    bt = max(1, 32 * num_warps // (d // 32)) if groups else bt
    pb, ko, kso, kzo, vo, vso, vzo = field_offsets(layout, stride=kv.page_stride)
    _write_kv_kernel[(triton.cdiv(t, bt), h)](
        k.contiguous(), v.contiguous(), kv.base, page_ids, slots, t, float(kv.k_scale), float(kv.v_scale),
        FMT=FMT_CODES[layout.fmt], H=h, D=d, P=layout.page_size,
        PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, V_OFF=vo, VS_OFF=vso, VZ_OFF=vzo,
        BT=bt, GROUPS=int(groups), num_warps=num_warps, **triton_pdl.launch(pdl, t),
    )  # fmt: skip


def _int2_heads(h: int, want: int) -> int:
    hb = 1
    while hb * 2 <= want and h % (hb * 2) == 0:
        hb *= 2
    return hb


def write_int2_pages(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Launch the INT2 whole-page writers with INT2_TUNING's shapes, keys then values (arguments checked by
    paged_ops)."""
    if k.shape[0] == 0:
        return
    launch_int2_keys(kv, k, page_ids, heads=INT2_TUNING["heads"], num_warps=INT2_TUNING["key_warps"])
    launch_int2_values(kv, v, page_ids, num_warps=INT2_TUNING["value_warps"])


def launch_int2_keys(kv: PagedKV, k: torch.Tensor, page_ids: torch.Tensor, *, heads: int, num_warps: int) -> None:
    """The keys half of write_int2_pages with its launch shape given (tests and benchmarks time others)."""
    n, p, h, d = k.shape
    hb = _int2_heads(h, heads)
    pb, ko, kso, kzo, _, _, _ = field_offsets(kv.int2, stride=kv.int2_stride)
    _write_int2_keys_kernel[(n, h // hb)](
        k.contiguous(), kv.base, page_ids, kv.int2_top,
        H=h, D=d, P=p, PAGE_BYTES=pb, K_OFF=ko, KS_OFF=kso, KZ_OFF=kzo, HB=hb, num_warps=num_warps,
    )  # fmt: skip


def launch_int2_values(kv: PagedKV, v: torch.Tensor, page_ids: torch.Tensor, *, num_warps: int) -> None:
    """The values half of write_int2_pages with its launch shape given."""
    n, p, h, d = v.shape
    pb, _, _, _, vo, vso, vzo = field_offsets(kv.int2, stride=kv.int2_stride)
    groups = n * p * h * (d // 32)
    r = 32 * num_warps
    _write_int2_values_kernel[(triton.cdiv(groups, r),)](
        v.contiguous(), kv.base, page_ids, kv.int2_top, groups,
        H=h, D=d, P=p, PAGE_BYTES=pb, V_OFF=vo, VS_OFF=vso, VZ_OFF=vzo, R=r, num_warps=num_warps,
    )  # fmt: skip
