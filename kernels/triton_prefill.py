"""Triton paged extend (chunked-prefill) attention: a chunk of new tokens against the packed cached prefix plus itself.

One program handles BLOCK_T query tokens of the chunk and the G query heads
of one kv head: M = BLOCK_T * GP rows (GP = G padded to a power of two), row
``r`` = token ``r // GP``, head ``r % GP``. It runs one online softmax (base 2)
over

1. the cached prefix, read from the pages themselves: each iteration loads
   PPI pages of the kv head's K and V rows (packed bytes, scales, zeros),
   dequantizes them in registers to fp16 (bf16 pages stay bf16) in channel
   order, and feeds ``tl.dot`` with [N = PPI * P, D] tiles; no workspace and
   no second pass over memory, so the cost of a chunk is linear in the prefix;
2. the chunk itself (the fresh, unquantized K/V in q's dtype), causally.

Triaxial prefixes mix INT2 and INT4 pages; the wrapper lists the INT2 pages
first (a stable device-side sort: the partial last page is INT4 and stays
last) and passes their count, so the kernel runs one loop per precision and
never mixes them in one tile.

Unpacked tiles, per format (decoders in triton_codec.py, the same as decode)::

    bf16      [N, D] loads                  fp8      E4M3 bytes -> fp16 (value / scale)
    nvfp4     bytes [N, D/16, 8] -> lo, hi nibbles -> join -> [N, D] fp16 (value / (g * 2^7))
    int4      bytes [N, D/32, 16], fp16 scale / zero per token group -> join -> [N, D]
    int2 v    bytes [N, D/32, 8] -> four crumbs -> join(join(c0, c2), join(c1, c3)) -> [N, D]
    int2 k    crumb codes as fp16, times the page's per-channel scale plus zero ([D] per page and head)

The global scales of fp8 / nvfp4 (and nvfp4's 2^7) are folded into the
prefix's softmax multiplier (K) and into the probabilities before the PV
product (V), so the accumulator holds true values for prefix and chunk alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .page_ids import INT2_PAGE_FLAG
from .paged_kv import PagedKV
from .triton_codec import crumb_codes, crumbs_int2, e4m3_to_f16, meta_index, nibbles_e2m1, nibbles_int4
from .triton_common import FMT_BF16, FMT_CODES, FMT_FP8, FMT_INT2, FMT_INT4, FMT_NVFP4, LOG2E, field_offsets, folded_scales

FLAG: tl.constexpr = tl.constexpr(INT2_PAGE_FLAG)


@triton.jit
def _rows(rows, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, FMT: tl.constexpr,
          D: tl.constexpr, TM: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """K or V of N token rows (``rows``: each row's page base, ``hrow``: head * P + slot) -> [N, D] in DT, channel order.

    INT2 keys are not here (per-channel scales: ``_int2_keys``); TM: the scale order of int4 / int2 values (meta_index).
    """
    N: tl.constexpr = rows.shape[0]
    m = ok[:, None]
    if FMT == FMT_BF16 or FMT == FMT_FP8:
        d = tl.arange(0, D)[None, :]
        if FMT == FMT_BF16:
            x = tl.load((rows[:, None] + OFF).to(tl.pointer_type(tl.bfloat16)) + hrow[:, None] * D + d, mask=m, other=0.0)
        else:
            x = e4m3_to_f16(tl.load(rows[:, None] + OFF + hrow[:, None] * D + d, mask=m, other=0), FAST)
    elif FMT == FMT_NVFP4:
        NB: tl.constexpr = D // 16  # blocks of 16 values: 8 bytes and one E4M3 scale each
        b = tl.arange(0, NB)
        jj = tl.arange(0, 8)[None, None, :]
        m3 = ok[:, None, None]
        packed = tl.load(rows[:, None, None] + OFF + hrow[:, None, None] * (D // 2) + b[None, :, None] * 8 + jj, mask=m3, other=0)
        s = tl.load(rows[:, None] + SOFF + hrow[:, None] * NB + b[None, :], mask=m, other=0)
        scale = tl.broadcast_to((e4m3_to_f16(s, FAST) * 128.0)[:, :, None], (N, NB, 8))  # s * 2^7, exact in fp16
        lo, hi = nibbles_e2m1(packed, scale, FAST)
        x = tl.reshape(tl.join(lo, hi), (N, D))
    else:
        NG: tl.constexpr = D // 32  # groups of 32 channels with an fp16 scale and zero per token
        g = tl.arange(0, NG)
        m3 = ok[:, None, None]
        meta = meta_index(hrow[:, None], g[None, :], NG, TM)
        sc = tl.load((rows[:, None] + SOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m, other=0.0)
        zr = tl.load((rows[:, None] + ZOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m, other=0.0)
        if FMT == FMT_INT4:
            jj = tl.arange(0, 16)[None, None, :]
            packed = tl.load(rows[:, None, None] + OFF + hrow[:, None, None] * (D // 2) + g[None, :, None] * 16 + jj, mask=m3, other=0)
            lo, hi = nibbles_int4(packed, tl.broadcast_to(sc[:, :, None], (N, NG, 16)), tl.broadcast_to(zr[:, :, None], (N, NG, 16)), FAST)
            x = tl.reshape(tl.join(lo, hi), (N, D))
        else:
            jj = tl.arange(0, 8)[None, None, :]
            packed = tl.load(rows[:, None, None] + OFF + hrow[:, None, None] * (D // 4) + g[None, :, None] * 8 + jj, mask=m3, other=0)
            c0, c1, c2, c3 = crumbs_int2(packed, tl.broadcast_to(sc[:, :, None], (N, NG, 8)), tl.broadcast_to(zr[:, :, None], (N, NG, 8)), FAST)
            x = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (N, D))  # crumb k of byte j is channel 4j + k
    return x.to(DT)


@triton.jit
def _int2_keys(rows, pages, h, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, D: tl.constexpr,
               P: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """INT2 keys of N = PPI * P rows -> fp16 [N, D]: codes times each page's per-channel scale plus its zero."""
    N: tl.constexpr = rows.shape[0]
    PPI: tl.constexpr = pages.shape[0]
    NG: tl.constexpr = D // 32
    g = tl.arange(0, NG)[None, :, None]
    jj = tl.arange(0, 8)[None, None, :]
    packed = tl.load(rows[:, None, None] + OFF + hrow[:, None, None] * (D // 4) + g * 8 + jj, mask=ok[:, None, None], other=0)
    c0, c1, c2, c3 = crumb_codes(packed, FAST)
    codes = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (PPI, P, D))
    ch = h * D + tl.arange(0, D)[None, :]
    sc = tl.load((pages[:, None] + SOFF).to(tl.pointer_type(tl.float16)) + ch)  # [PPI, D]
    zr = tl.load((pages[:, None] + ZOFF).to(tl.pointer_type(tl.float16)) + ch)
    return tl.reshape(codes * sc[:, None, :] + zr[:, None, :], (N, D))


@triton.jit
def _attend(q, k, v, valid, m_i, l_i, acc, k_mul, v_mul, DT: tl.constexpr):
    """One online-softmax step (base 2) of q [M, D] over a tile k, v [N, D]; valid [M, N] masks scores."""
    s = tl.dot(q, tl.trans(k))
    s = tl.where(valid, s * k_mul, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet: exp2 gives zeros, not NaN
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot((p * v_mul).to(DT), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _prefix_loop(q, m_i, l_i, acc, buf_ptr, pt_ptr, page_lo, page_hi, prefix_len, h, total_bytes, k_mul, v_mul,
                 FMT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PPI: tl.constexpr, PAGE_BYTES: tl.constexpr,
                 K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
                 V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
                 FAST: tl.constexpr, DT: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """Attend over pages [page_lo, page_hi) of the (sorted) prefix list, all of format FMT, PPI pages per step."""
    N: tl.constexpr = PPI * P
    n = tl.arange(0, N)
    M: tl.constexpr = q.shape[0]
    for it in tl.range(page_lo, page_hi, PPI, num_stages=NUM_STAGES):
        pidx = it + n // P  # list index of each row's page
        slot = n % P
        ok = (pidx * P + slot < prefix_len) & (pidx < page_hi)
        pid = tl.load(pt_ptr + pidx, mask=pidx < page_hi, other=0)
        if FMT == FMT_INT2:
            rows = buf_ptr + total_bytes - ((pid & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES  # INT2 pages count down
        else:
            rows = buf_ptr + pid.to(tl.int64) * PAGE_BYTES
        hrow = h * P + slot  # row inside a [H, P, ...] field
        if FMT == FMT_INT2:
            ip = tl.arange(0, PPI)
            pids = tl.load(pt_ptr + it + ip, mask=it + ip < page_hi, other=0)
            pages = buf_ptr + total_bytes - ((pids & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES  # [PPI]
            k = _int2_keys(rows, pages, h, hrow, ok, K_OFF, KS_OFF, KZ_OFF, D, P, FAST).to(DT)
        else:
            k = _rows(rows, hrow, ok, K_OFF, KS_OFF, KZ_OFF, FMT, D, 0, FAST, DT)
        v = _rows(rows, hrow, ok, V_OFF, VS_OFF, VZ_OFF, FMT, D, P, FAST, DT)
        valid = tl.broadcast_to(ok[None, :], (M, N))
        m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, k_mul, v_mul, DT)
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr,  # [n, Hq, D] chunk queries (strides q_s0, q_s1, 1)
    k_ptr, v_ptr,  # [n, H, D] the chunk's own K/V, unquantized (strides k_s0, k_s1, 1)
    o_ptr,  # [n, Hq, D] output, q's dtype (strides o_s0, o_s1, 1)
    buf_ptr,  # uint8 layer buffer
    pt_ptr,  # int32 [N] prefix page ids (triaxial: INT2 pages first)
    n2_ptr,  # int32 [1] INT2 pages leading pt (TRIAXIAL only)
    n_new,  # chunk tokens
    prefix_len,  # cached tokens before the chunk
    total_bytes,  # layer buffer bytes (INT2 pages count down from here)
    k_mul_pre, v_mul_pre,  # fp32: prefix score multiplier (sm_scale * log2 e * K fold) and V fold
    k_mul_new,  # fp32: chunk score multiplier (sm_scale * log2 e)
    q_s0, q_s1, k_s0, k_s1, o_s0, o_s1,  # token and head strides
    FMT: tl.constexpr,  # format of `layout` (FMT_*)
    TRIAXIAL: tl.constexpr,  # INT2 pages lead the list: a second layout below
    G: tl.constexpr,  # query heads per kv head
    GP: tl.constexpr,  # G padded to a power of two
    D: tl.constexpr,
    P: tl.constexpr,  # tokens per page
    PAGE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
    PAGE_BYTES2: tl.constexpr, K_OFF2: tl.constexpr, KS_OFF2: tl.constexpr, KZ_OFF2: tl.constexpr,  # INT2 layout
    V_OFF2: tl.constexpr, VS_OFF2: tl.constexpr, VZ_OFF2: tl.constexpr,
    BLOCK_T: tl.constexpr,  # chunk tokens per program
    BLOCK_N: tl.constexpr,  # chunk keys per step
    PPI: tl.constexpr,  # prefix pages per step
    PPI2: tl.constexpr,  # INT2 pages per step
    NUM_STAGES: tl.constexpr,
    FAST: tl.constexpr,  # inline-assembly decoders
    DT: tl.constexpr,  # dot operand type: fp16, or bf16 for bf16 pages (fp32 in the interpreter)
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    M: tl.constexpr = BLOCK_T * GP
    r = tl.arange(0, M)
    tok = qb * BLOCK_T + r // GP  # chunk token of each row
    hd = r % GP
    row_ok = (tok < n_new) & (hd < G)
    d = tl.arange(0, D)[None, :]
    qh = h * G + hd
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * q_s0 + qh[:, None] * q_s1 + d, mask=row_ok[:, None], other=0.0).to(DT)
    m_i = tl.full((M,), float("-inf"), tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    acc = tl.zeros((M, D), tl.float32)
    num_pages = tl.cdiv(prefix_len, P)
    if TRIAXIAL:
        n2 = tl.load(n2_ptr)
        m_i, l_i, acc = _prefix_loop(q, m_i, l_i, acc, buf_ptr, pt_ptr, 0, n2, prefix_len, h, total_bytes, k_mul_pre, v_mul_pre,
                                     FMT_INT2, D, P, PPI2, PAGE_BYTES2, K_OFF2, KS_OFF2, KZ_OFF2, V_OFF2, VS_OFF2, VZ_OFF2,
                                     FAST, DT, NUM_STAGES)  # fmt: skip
    else:
        n2 = 0
    m_i, l_i, acc = _prefix_loop(q, m_i, l_i, acc, buf_ptr, pt_ptr, n2, num_pages, prefix_len, h, total_bytes, k_mul_pre, v_mul_pre,
                                 FMT, D, P, PPI, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF,
                                 FAST, DT, NUM_STAGES)  # fmt: skip
    # the chunk itself, causal: token t sees chunk keys j <= t
    hi = tl.minimum(n_new, (qb + 1) * BLOCK_T)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = (j < n_new)[:, None]
        kv_off = j[:, None].to(tl.int64) * k_s0 + h * k_s1 + d
        k = tl.load(k_ptr + kv_off, mask=jm, other=0.0).to(DT)
        v = tl.load(v_ptr + kv_off, mask=jm, other=0.0).to(DT)
        valid = (j[None, :] <= tok[:, None]) & (j < n_new)[None, :]
        m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, k_mul_new, 1.0, DT)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None].to(tl.int64) * o_s0 + qh[:, None] * o_s1 + d, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


# Per format: chunk tokens per program, prefix pages per step (PPI * page size = 64 keys), warps, stages.
TUNING: dict[str, dict[str, int]] = {
    "bf16": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 4, "num_warps": 8, "NUM_STAGES": 2},
    "fp8_e4m3": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 4, "num_warps": 8, "NUM_STAGES": 2},
    "nvfp4": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 4, "num_warps": 8, "NUM_STAGES": 2},
    "int4": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 2, "PPI2": 2, "num_warps": 8, "NUM_STAGES": 2},
}


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    prefix_pages: torch.Tensor,
    prefix_len: int,
    *,
    sm_scale: float,
    fast: bool,
    tuning: dict[str, int] | None = None,
) -> torch.Tensor:
    """Launch the extend kernel (arguments checked by paged_ops) -> [n, Hq, D] in q.dtype.

    q: [n, Hq, D] at positions prefix_len..; k, v: [n, H, D]; prefix_pages: int32 ids in token order.
    fast: inline-assembly decoders (KernelOptions.fast_decoders); tuning overrides TUNING[fmt]."""
    layout = kv.layout
    if layout.fmt not in TUNING:
        raise ValueError(f"no Triton extend for {layout.fmt!r} pages (fp32 pages run on the reference path)")
    n, hq, d = q.shape
    h = layout.kv_heads
    if d < 32 or d & (d - 1):
        raise ValueError(f"the Triton extend needs a power-of-two head_dim >= 32, got {d}")
    out = torch.empty_like(q)
    if n == 0:
        return out
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride() != k.stride():
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = {**TUNING[layout.fmt], **(tuning or {})}
    cfg.setdefault("PPI2", cfg["PPI"])
    p = layout.page_size
    pages = prefix_pages[: triton.cdiv(prefix_len, p)]
    n2 = torch.zeros(1, dtype=torch.int32, device=q.device)
    if kv.triaxial and pages.numel():
        # INT2 pages first, order kept (device-side, no sync): the partial last page is INT4 and stays last
        flagged = (pages & INT2_PAGE_FLAG) != 0
        pages = pages[torch.argsort((~flagged).to(torch.int8), stable=True)]
        n2 = flagged.sum(dtype=torch.int32).reshape(1)
    pages = pages.contiguous()
    if pages.numel() == 0:
        pages = torch.zeros(1, dtype=torch.int32, device=q.device)  # never read (prefix_len 0), but a valid pointer
    k_fold, v_fold = folded_scales(kv)
    lay, lay2 = field_offsets(layout), field_offsets(kv.int2_layout)
    group = hq // h
    interpret = q.device.type == "cpu"
    dt = tl.float16 if layout.fmt != "bf16" else (tl.float32 if interpret else tl.bfloat16)
    grid = (triton.cdiv(n, cfg["BLOCK_T"]), h)
    _extend_kernel[grid](
        q, k, v, out, kv.buffer, pages, n2, n, prefix_len, kv.total_bytes,
        sm_scale * LOG2E * k_fold, v_fold, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        FMT=FMT_CODES[layout.fmt], TRIAXIAL=kv.triaxial, G=group, GP=triton.next_power_of_2(group), D=d, P=p,
        PAGE_BYTES=lay[0], K_OFF=lay[1], KS_OFF=lay[2], KZ_OFF=lay[3], V_OFF=lay[4], VS_OFF=lay[5], VZ_OFF=lay[6],
        PAGE_BYTES2=lay2[0], K_OFF2=lay2[1], KS_OFF2=lay2[2], KZ_OFF2=lay2[3], V_OFF2=lay2[4], VS_OFF2=lay2[5],
        VZ_OFF2=lay2[6], BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], PPI=cfg["PPI"], PPI2=cfg["PPI2"],
        NUM_STAGES=cfg["NUM_STAGES"], FAST=fast, DT=dt, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out
