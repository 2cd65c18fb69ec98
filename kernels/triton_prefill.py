"""Triton paged extend (chunked-prefill) attention: a chunk of new tokens against the packed cached prefix plus itself.

One program handles BLOCK_T query tokens of the chunk and the G query heads
of one kv head: M = BLOCK_T * GP rows (GP = G padded to a power of two), row
``r`` = token ``r // GP``, head ``r % GP``. It runs one online softmax (base 2)
over

1. the cached prefix, read from the pages themselves: each iteration loads
   PPI pages of the kv head's K and V rows (packed bytes, scales, zeros),
   dequantizes them in registers to fp16 (bf16 pages stay bf16) and feeds
   ``tl.dot`` with N = PPI * P keys; no workspace and no second read of
   memory, so the cost of a chunk is linear in the prefix;
2. the chunk itself (the fresh, unquantized K/V in q's dtype), causally.

Triaxial prefixes mix INT2 and INT4 pages; the wrapper lists the INT2 pages
first (a stable device-side sort: the partial last page is INT4 and stays
last) and passes their count, so the kernel runs one loop per precision and
never mixes them in one tile.

Two kernels: ``_extend_kernel`` for bf16 / fp8 pages ([N, D] tiles in channel
order) and ``_extend_kernel4`` for packed pages (nvfp4, triaxial), which keeps
q, the tiles and the accumulator in four channel quarters (below). Its packed
words are unpacked by PTX (two values per instruction, ``triton_codec.asm_quarters``) and
every unpacked tile reaches shared memory (the ``wgmma`` B operand) in 16-byte
stores; q arrives pre-scaled in fp16 and quarter-major, steps over full pages
run without masks and the V fold is applied once at the output (VFOLD, where
the fold is large enough for the chunk's fp16 probabilities).

The global scales of fp8 / nvfp4 (and nvfp4's 2^7) are folded into the
prefix's softmax multiplier (K: into q for the packed kernel) and into the
probabilities before the PV product (V: the bf16 / fp8 kernel) or the output
(packed), so the accumulator holds consistent values for prefix and chunk.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .layout import PageLayout
from .page_ids import INT2_PAGE_FLAG
from .paged_kv import PagedKV
from .triton_codec import asm_quarters, e4m3_to_f16, meta_index
from .triton_common import FMT_BF16, FMT_CODES, FMT_INT2, FMT_NVFP4, LOG2E, VFOLD_MIN, field_offsets, folded_scales, kv_field_offsets

FLAG: tl.constexpr = tl.constexpr(INT2_PAGE_FLAG)


@triton.jit
def _rows(rows, hrow, ok, OFF: tl.constexpr, FMT: tl.constexpr, D: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):
    """bf16 / fp8 K or V of N token rows (``rows``: each row's page base, ``hrow``: head * P + slot) -> [N, D] in DT."""
    d = tl.arange(0, D)[None, :]
    m = ok[:, None]
    if FMT == FMT_BF16:
        x = tl.load((rows[:, None] + OFF).to(tl.pointer_type(tl.bfloat16)) + hrow[:, None] * D + d, mask=m, other=0.0)
    else:
        x = e4m3_to_f16(tl.load(rows[:, None] + OFF + hrow[:, None] * D + d, mask=m, other=0), FAST)
    return x.to(DT)


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
def _prefix_loop(q, m_i, l_i, acc, buf_ptr, pt_ptr, page_lo, page_hi, prefix_len, h, k_mul, v_mul,
                 FMT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PPI: tl.constexpr, PAGE_BYTES: tl.constexpr,
                 K_OFF: tl.constexpr, V_OFF: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """Attend over bf16 / fp8 pages [page_lo, page_hi) of the prefix list, PPI pages per step."""
    N: tl.constexpr = PPI * P
    n = tl.arange(0, N)
    M: tl.constexpr = q.shape[0]
    for it in tl.range(page_lo, page_hi, PPI, num_stages=NUM_STAGES):
        pidx = it + n // P  # list index of each row's page
        slot = n % P
        ok = (pidx * P + slot < prefix_len) & (pidx < page_hi)
        pid = tl.load(pt_ptr + pidx, mask=pidx < page_hi, other=0)
        rows = buf_ptr + pid.to(tl.int64) * PAGE_BYTES
        hrow = h * P + slot  # row inside a [H, P, ...] field
        k = _rows(rows, hrow, ok, K_OFF, FMT, D, FAST, DT)
        v = _rows(rows, hrow, ok, V_OFF, FMT, D, FAST, DT)
        valid = tl.broadcast_to(ok[None, :], (M, N))
        m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, k_mul, v_mul, DT)
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr,  # [n, Hq, D] chunk queries (strides q_s0, q_s1, 1)
    k_ptr,
    v_ptr,  # [n, H, D] the chunk's own K/V, unquantized (strides k_s0, k_s1, 1)
    o_ptr,  # [n, Hq, D] output, q's dtype (strides o_s0, o_s1, 1)
    buf_ptr,  # uint8 layer buffer
    pt_ptr,  # int32 [N] prefix page ids (triaxial: INT2 pages first)
    n2_ptr,  # int32 [1] INT2 pages leading pt (TRIAXIAL only)
    n_new,  # chunk tokens
    prefix_len,  # cached tokens before the chunk
    total_bytes,  # layer buffer bytes (INT2 pages count down from here)
    k_mul_pre,
    v_mul_pre,  # fp32: prefix score multiplier (sm_scale * log2 e * K fold) and V fold
    k_mul_new,  # fp32: chunk score multiplier (sm_scale * log2 e)
    q_s0,
    q_s1,
    k_s0,
    k_s1,
    o_s0,
    o_s1,  # token and head strides
    FMT: tl.constexpr,  # format of `layout` (FMT_*)
    TRIAXIAL: tl.constexpr,  # INT2 pages lead the list: a second layout below
    G: tl.constexpr,  # query heads per kv head
    GP: tl.constexpr,  # G padded to a power of two
    D: tl.constexpr,
    P: tl.constexpr,  # tokens per page
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
    BLOCK_T: tl.constexpr,  # chunk tokens per program
    BLOCK_N: tl.constexpr,  # chunk keys per step
    PPI: tl.constexpr,  # prefix pages per step
    PPI2: tl.constexpr,  # INT2 pages per step
    NUM_STAGES: tl.constexpr,
    FAST: tl.constexpr,  # inline-assembly decoders
    DT: tl.constexpr,  # dot operand type: fp16, or bf16 for bf16 pages (fp32 in the interpreter)
):
    """bf16 / fp8 pages in channel order. The scale, zero and INT2 arguments are not read here: both kernels
    take one launch signature (extend_attention)."""
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
    m_i, l_i, acc = _prefix_loop(q, m_i, l_i, acc, buf_ptr, pt_ptr, 0, tl.cdiv(prefix_len, P), prefix_len, h, k_mul_pre,
                                 v_mul_pre, FMT, D, P, PPI, PAGE_BYTES, K_OFF, V_OFF, FAST, DT, NUM_STAGES)  # fmt: skip
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


# ----------------------------------------------------------------------------
# packed formats (nvfp4, triaxial): channels in four quarters
# ----------------------------------------------------------------------------
#
# Packed tiles stay split, as in the decode: quarter k holds channels 4j + k, and q, the
# accumulator and the chunk's own K/V use the same map. (Interleaving them back to channel
# order with join + reshape makes S and PV one dot each, but is slower.)
# A quarter is what one shift of the packed words gives::
#
#   nvfp4 / int4: 16-bit word j = bytes 2j, 2j+1 = nibbles k = 0..3 = channels 4j + k
#   int2:         byte j = crumbs k = 0..3 = channels 4j + k


ASM_E2M1_Q: tl.constexpr = tl.constexpr(asm_quarters("e2m1"))
ASM_INT4_Q: tl.constexpr = tl.constexpr(asm_quarters("int4"))
ASM_INT2_Q: tl.constexpr = tl.constexpr(asm_quarters("int2"))
ASM_INT2_CODES_Q: tl.constexpr = tl.constexpr(asm_quarters("int2_codes"))


@triton.jit
def _f16_code(c):
    """Small integer codes (int32 0..1023) -> exact fp16: 0x6400 | c is 1024 + c."""
    return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _e2m1_quarter(w, k: tl.constexpr):
    """Nibble k of each 16-bit word (int32) -> fp16 e2m1 * 2^-14 (sign, exponent and mantissa moved into place)."""
    nib = (w >> (4 * k)) & 0xF
    return (((nib & 8) << 12) | ((nib & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _group_bcast(x, GROUP: tl.constexpr):
    """[N, NG] per-group values -> [N, NG * GROUP] (each repeated for its GROUP words): loading once per group
    keeps the tile's layout row-contiguous (a j // GROUP gather made Triton store the tiles 2 bytes at a time)."""
    N: tl.constexpr = x.shape[0]
    NG: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, :, None], (N, NG, GROUP)), (N, NG * GROUP))


@triton.jit
def _quarters(rows, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, FMT: tl.constexpr,
              D: tl.constexpr, TM: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """nvfp4 / int4 / int2-value rows -> four fp16 quarters [N, D/4] (quarter k: channels 4j + k); TM as in _rows.

    nvfp4 quarters are e2m1 * s * 2^-7 (the caller folds 2^7 and the global scale back in). FAST: PTX unpackers
    (two values per instruction)."""
    Q: tl.constexpr = D // 4
    j = tl.arange(0, Q)[None, :]
    m = ok[:, None]
    r = hrow[:, None]
    if FMT == FMT_INT2:
        w = tl.load(rows[:, None] + OFF + r * Q + j, mask=m, other=0).to(tl.int32)  # byte j: 4 crumbs
    else:
        w = tl.load((rows[:, None] + OFF).to(tl.pointer_type(tl.uint16)) + r * Q + j, mask=m, other=0).to(tl.int32)
    if FMT == FMT_NVFP4:
        # block of word j: j // 4, one E4M3 byte per 16 channels
        s = tl.load(rows[:, None] + SOFF + r * (D // 16) + tl.arange(0, D // 16)[None, :], mask=m, other=0)
        sc = _group_bcast(e4m3_to_f16(s, FAST) * 128.0, 4)  # s * 2^7, exact in fp16
        if FAST:
            x0, x1, x2, x3 = tl.inline_asm_elementwise(ASM_E2M1_Q, "=r,=r,=r,=r,r,r,r", [w, sc],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                                       pack=2)  # fmt: skip
        else:
            x0 = _e2m1_quarter(w, 0) * sc
            x1 = _e2m1_quarter(w, 1) * sc
            x2 = _e2m1_quarter(w, 2) * sc
            x3 = _e2m1_quarter(w, 3) * sc
    else:
        meta = meta_index(r, tl.arange(0, D // 32)[None, :], D // 32, TM)  # groups of 32 channels = 8 words / bytes
        sc = _group_bcast(tl.load((rows[:, None] + SOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m, other=0.0), 8)
        zr = _group_bcast(tl.load((rows[:, None] + ZOFF).to(tl.pointer_type(tl.float16)) + meta, mask=m, other=0.0), 8)
        B: tl.constexpr = 2 if FMT == FMT_INT2 else 4
        if FAST:
            x0, x1, x2, x3 = tl.inline_asm_elementwise(ASM_INT2_Q if B == 2 else ASM_INT4_Q, "=r,=r,=r,=r,r,r,r,r",
                                                       [w, sc, zr], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=2)  # fmt: skip
        else:
            MASK: tl.constexpr = (1 << B) - 1
            x0 = _f16_code(w & MASK) * sc + zr
            x1 = _f16_code((w >> B) & MASK) * sc + zr
            x2 = _f16_code((w >> (2 * B)) & MASK) * sc + zr
            x3 = _f16_code((w >> (3 * B)) & MASK) * sc + zr
    return x0, x1, x2, x3


@triton.jit
def _channel_quarters(pages, OFF: tl.constexpr, D: tl.constexpr):
    """A per-channel fp16 row [D] at byte OFF of each page (pages: [PPI] byte pointers) -> its quarters [PPI, D/4]
    (quarter k: channels 4j + k), loaded as whole rows and split in registers."""
    PPI: tl.constexpr = pages.shape[0]
    x = tl.load((pages[:, None] + OFF).to(tl.pointer_type(tl.float16)) + tl.arange(0, D)[None, :])
    ev, od = tl.split(tl.reshape(x, (PPI, D // 4, 2, 2)))  # last dim: k % 2
    x0, x2 = tl.split(ev)
    x1, x3 = tl.split(od)
    return x0, x1, x2, x3


@triton.jit
def _int2_key_quarters(rows, pages, h, hrow, ok, OFF: tl.constexpr, SOFF: tl.constexpr, ZOFF: tl.constexpr, D: tl.constexpr,
                       P: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """INT2 keys -> four fp16 quarters [N, D/4]: code times the page's per-channel scale plus its zero."""
    N: tl.constexpr = rows.shape[0]
    PPI: tl.constexpr = pages.shape[0]
    Q: tl.constexpr = D // 4
    j = tl.arange(0, Q)
    b = tl.load(rows[:, None] + OFF + hrow[:, None] * Q + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
    if FAST:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(ASM_INT2_CODES_Q, "=r,=r,=r,=r,r,r", [b],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                                                   pack=2)  # fmt: skip
    else:
        c0, c1, c2, c3 = _f16_code(b & 3), _f16_code((b >> 2) & 3), _f16_code((b >> 4) & 3), _f16_code((b >> 6) & 3)
    s0, s1, s2, s3 = _channel_quarters(pages, SOFF + h * D * 2, D)
    z0, z1, z2, z3 = _channel_quarters(pages, ZOFF + h * D * 2, D)
    x0 = tl.reshape(tl.reshape(c0, (PPI, P, Q)) * s0[:, None, :] + z0[:, None, :], (N, Q))
    x1 = tl.reshape(tl.reshape(c1, (PPI, P, Q)) * s1[:, None, :] + z1[:, None, :], (N, Q))
    x2 = tl.reshape(tl.reshape(c2, (PPI, P, Q)) * s2[:, None, :] + z2[:, None, :], (N, Q))
    x3 = tl.reshape(tl.reshape(c3, (PPI, P, Q)) * s3[:, None, :] + z3[:, None, :], (N, Q))
    return x0, x1, x2, x3


@triton.jit
def _attend4(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, k_mul, v_mul,
             MASK: tl.constexpr, KMUL: tl.constexpr, VMUL: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """_attend on quarters: S = sum_k q_k k_k^T, a_k += P v_k.

    MASK: apply ``valid`` (a step with every key valid skips the selects); KMUL / VMUL: multiply the scores by
    k_mul / the probabilities by v_mul (off where the wrapper folded them into q / the output)."""
    s = tl.dot(q0, tl.trans(k0.to(DT)))
    s = tl.dot(q1, tl.trans(k1.to(DT)), s)
    s = tl.dot(q2, tl.trans(k2.to(DT)), s)
    s = tl.dot(q3, tl.trans(k3.to(DT)), s)
    if KMUL:
        s = s * k_mul
    if MASK:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new  # every score finite: so is the maximum
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if VMUL:
        p = p * v_mul
    pt = p.to(DT)
    a0 = tl.dot(pt, v0.to(DT), a0 * alpha[:, None])
    a1 = tl.dot(pt, v1.to(DT), a1 * alpha[:, None])
    a2 = tl.dot(pt, v2.to(DT), a2 * alpha[:, None])
    a3 = tl.dot(pt, v3.to(DT), a3 * alpha[:, None])
    return m_new, l_i, a0, a1, a2, a3


@triton.jit
def _prefix_step4(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, it, buf_ptr, pt_ptr, page_hi, prefix_len, h, total_bytes,
                  k_mul, v_mul, FMT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PPI: tl.constexpr,
                  PAGE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
                  V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr, MASK: tl.constexpr,
                  KMUL: tl.constexpr, VMUL: tl.constexpr, DT: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """One step over prefix pages it .. it + PPI - 1 of the list (MASK: some of its keys may be invalid)."""
    N: tl.constexpr = PPI * P
    n = tl.arange(0, N)
    M: tl.constexpr = q0.shape[0]
    pidx = it + n // P
    slot = n % P
    if MASK:
        ok = (pidx * P + slot < prefix_len) & (pidx < page_hi)
        pid = tl.load(pt_ptr + pidx, mask=pidx < page_hi, other=0)
    else:
        ok = n >= 0
        pid = tl.load(pt_ptr + pidx)
    if FMT == FMT_INT2:
        rows = buf_ptr + total_bytes - ((pid & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES
        ip = tl.arange(0, PPI)
        pids = tl.load(pt_ptr + it + ip, mask=it + ip < page_hi, other=0)
        pages = buf_ptr + total_bytes - ((pids & ~FLAG) + 1).to(tl.int64) * PAGE_BYTES  # [PPI]
        k0, k1, k2, k3 = _int2_key_quarters(rows, pages, h, h * P + slot, ok, K_OFF, KS_OFF, KZ_OFF, D, P, FAST)
    else:
        rows = buf_ptr + pid.to(tl.int64) * PAGE_BYTES
        k0, k1, k2, k3 = _quarters(rows, h * P + slot, ok, K_OFF, KS_OFF, KZ_OFF, FMT, D, 0, FAST)
    v0, v1, v2, v3 = _quarters(rows, h * P + slot, ok, V_OFF, VS_OFF, VZ_OFF, FMT, D, P, FAST)
    valid = tl.broadcast_to(ok[None, :], (M, N))
    return _attend4(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3, k_mul, v_mul,
                    MASK, KMUL, VMUL, DT)  # fmt: skip


@triton.jit
def _prefix_loop4(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, buf_ptr, pt_ptr, page_lo, page_hi, prefix_len, h, total_bytes,
                  k_mul, v_mul, FMT: tl.constexpr, D: tl.constexpr, P: tl.constexpr, PPI: tl.constexpr,
                  PAGE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
                  V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
                  KMUL: tl.constexpr, VMUL: tl.constexpr, DT: tl.constexpr, NUM_STAGES: tl.constexpr,
                  FAST: tl.constexpr):  # fmt: skip
    """_prefix_loop on quarters (nvfp4, int4, int2 pages): the steps whose PPI pages are all full run without
    masks, then at most one masked step (only the list's last page can be partial)."""
    full = tl.maximum(tl.minimum(page_hi, prefix_len // P) - page_lo, 0) // PPI * PPI
    tail = page_lo + full
    for it in tl.range(page_lo, tail, PPI, num_stages=NUM_STAGES):
        m_i, l_i, a0, a1, a2, a3 = _prefix_step4(
            q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, it, buf_ptr, pt_ptr, page_hi, prefix_len, h, total_bytes,
            k_mul, v_mul, FMT, D, P, PPI, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, False, KMUL,
            VMUL, DT, FAST)  # fmt: skip
    for it in tl.range(tail, page_hi, PPI, num_stages=NUM_STAGES):
        m_i, l_i, a0, a1, a2, a3 = _prefix_step4(
            q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, it, buf_ptr, pt_ptr, page_hi, prefix_len, h, total_bytes,
            k_mul, v_mul, FMT, D, P, PPI, PAGE_BYTES, K_OFF, KS_OFF, KZ_OFF, V_OFF, VS_OFF, VZ_OFF, True, KMUL, VMUL,
            DT, FAST)  # fmt: skip
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _extend_kernel4(
    q_ptr,  # [n, Hq, 4, D/4] in DT: q times k_mul_pre, quarter-major (k_mul_new is relative to it)
    k_ptr, v_ptr, o_ptr, buf_ptr, pt_ptr, n2_ptr,  # as _extend_kernel; k, v: [n, H, 4, D/4] (quarter-major)
    n_new, prefix_len, total_bytes, k_mul_pre, v_mul_pre, k_mul_new,
    q_s0, q_s1, k_s0, k_s1, o_s0, o_s1,
    FMT: tl.constexpr, TRIAXIAL: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    PAGE_BYTES: tl.constexpr, K_OFF: tl.constexpr, KS_OFF: tl.constexpr, KZ_OFF: tl.constexpr,
    V_OFF: tl.constexpr, VS_OFF: tl.constexpr, VZ_OFF: tl.constexpr,
    PAGE_BYTES2: tl.constexpr, K_OFF2: tl.constexpr, KS_OFF2: tl.constexpr, KZ_OFF2: tl.constexpr,
    V_OFF2: tl.constexpr, VS_OFF2: tl.constexpr, VZ_OFF2: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PPI: tl.constexpr, PPI2: tl.constexpr, NUM_STAGES: tl.constexpr,
    DT: tl.constexpr,
    VFOLD: tl.constexpr,  # the prefix's P is not scaled: the chunk's P times v_mul_pre (= 1 / V fold), out * fold
    FAST: tl.constexpr,  # PTX unpackers (triton_codec.asm_quarters); off in the interpreter
):  # fmt: skip
    """_extend_kernel for packed pages, on channel quarters (see above)."""
    qb = tl.program_id(0)
    h = tl.program_id(1)
    M: tl.constexpr = BLOCK_T * GP
    Q: tl.constexpr = D // 4
    r = tl.arange(0, M)
    tok = qb * BLOCK_T + r // GP
    hd = r % GP
    row_ok = (tok < n_new) & (hd < G)
    qrow = q_ptr + tok[:, None].to(tl.int64) * q_s0 + (h * G + hd)[:, None] * q_s1
    jq = tl.arange(0, Q)[None, :]
    ch = 4 * jq
    q0 = tl.load(qrow + jq, mask=row_ok[:, None], other=0.0)
    q1 = tl.load(qrow + Q + jq, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(qrow + 2 * Q + jq, mask=row_ok[:, None], other=0.0)
    q3 = tl.load(qrow + 3 * Q + jq, mask=row_ok[:, None], other=0.0)
    m_i = tl.full((M,), float("-inf"), tl.float32)
    l_i = tl.zeros((M,), tl.float32)
    a0 = tl.zeros((M, Q), tl.float32)
    a1 = tl.zeros((M, Q), tl.float32)
    a2 = tl.zeros((M, Q), tl.float32)
    a3 = tl.zeros((M, Q), tl.float32)
    num_pages = tl.cdiv(prefix_len, P)
    if TRIAXIAL:
        n2 = tl.load(n2_ptr)
        m_i, l_i, a0, a1, a2, a3 = _prefix_loop4(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, buf_ptr, pt_ptr, 0, n2, prefix_len, h,
                                                 total_bytes, k_mul_pre, v_mul_pre, FMT_INT2, D, P, PPI2, PAGE_BYTES2, K_OFF2,
                                                 KS_OFF2, KZ_OFF2, V_OFF2, VS_OFF2, VZ_OFF2, False, not VFOLD, DT,
                                                 NUM_STAGES, FAST)  # fmt: skip
    else:
        n2 = 0
    m_i, l_i, a0, a1, a2, a3 = _prefix_loop4(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, buf_ptr, pt_ptr, n2, num_pages, prefix_len,
                                             h, total_bytes, k_mul_pre, v_mul_pre, FMT, D, P, PPI, PAGE_BYTES, K_OFF, KS_OFF,
                                             KZ_OFF, V_OFF, VS_OFF, VZ_OFF, False, not VFOLD, DT, NUM_STAGES,
                                             FAST)  # fmt: skip
    hi = tl.minimum(n_new, (qb + 1) * BLOCK_T)
    for j0 in range(0, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = (j < n_new)[:, None]
        off = j[:, None].to(tl.int64) * k_s0 + h * k_s1 + jq
        k0 = tl.load(k_ptr + off, mask=jm, other=0.0)
        k1 = tl.load(k_ptr + off + Q, mask=jm, other=0.0)
        k2 = tl.load(k_ptr + off + 2 * Q, mask=jm, other=0.0)
        k3 = tl.load(k_ptr + off + 3 * Q, mask=jm, other=0.0)
        v0 = tl.load(v_ptr + off, mask=jm, other=0.0)
        v1 = tl.load(v_ptr + off + Q, mask=jm, other=0.0)
        v2 = tl.load(v_ptr + off + 2 * Q, mask=jm, other=0.0)
        v3 = tl.load(v_ptr + off + 3 * Q, mask=jm, other=0.0)
        valid = (j[None, :] <= tok[:, None]) & (j < n_new)[None, :]
        m_i, l_i, a0, a1, a2, a3 = _attend4(q0, q1, q2, q3, k0, k1, k2, k3, v0, v1, v2, v3, valid, m_i, l_i, a0, a1, a2, a3,
                                            k_mul_new, v_mul_pre, True, True, VFOLD, DT)  # fmt: skip
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    if VFOLD:
        inv = inv / v_mul_pre
    inv = inv[:, None]
    orow = o_ptr + tok[:, None].to(tl.int64) * o_s0 + (h * G + hd)[:, None] * o_s1
    ty = o_ptr.dtype.element_ty
    tl.store(orow + ch, (a0 * inv).to(ty), mask=row_ok[:, None])
    tl.store(orow + ch + 1, (a1 * inv).to(ty), mask=row_ok[:, None])
    tl.store(orow + ch + 2, (a2 * inv).to(ty), mask=row_ok[:, None])
    tl.store(orow + ch + 3, (a3 * inv).to(ty), mask=row_ok[:, None])


# Per format: chunk tokens per program, chunk keys per step, prefix pages per step (PPI2: INT2 pages), warps, stages.
# Packed formats: 128 prefix keys per step for every chunk length (faster than 64 at every bench shape).
TUNING: dict[str, dict[str, int]] = {
    "bf16": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 4, "num_warps": 8, "NUM_STAGES": 2},
    "fp8_e4m3": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 4, "num_warps": 8, "NUM_STAGES": 2},
    "nvfp4": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 8, "num_warps": 8, "NUM_STAGES": 2},
    "int4": {"BLOCK_T": 32, "BLOCK_N": 64, "PPI": 4, "PPI2": 4, "num_warps": 8, "NUM_STAGES": 2},
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
) -> torch.Tensor:
    """Launch the extend kernel (arguments checked by paged_ops) with TUNING's tiles -> [n, Hq, D] in q.dtype.

    q: [n, Hq, D] at positions prefix_len..; k, v: [n, H, D]; prefix_pages: int32 ids in token order.
    fast: inline-assembly decoders (KernelOptions.fast_decoders)."""
    if kv.layout.fmt not in TUNING:
        raise ValueError(f"no Triton extend for {kv.layout.fmt!r} pages (fp32 pages run on the reference path)")
    return launch_extend(q, k, v, kv, prefix_pages, prefix_len, sm_scale=sm_scale, fast=fast, cfg=TUNING[kv.layout.fmt])


def launch_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKV,
    prefix_pages: torch.Tensor,
    prefix_len: int,
    *,
    sm_scale: float,
    fast: bool,
    cfg: dict[str, int],
) -> torch.Tensor:
    """``extend_attention`` with its tiles ``cfg`` (TUNING[fmt]'s keys) given: tests run small tiles in the
    interpreter, benchmarks time others."""
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
    ppi2 = cfg.get("PPI2", cfg["PPI"])
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
    lay, lay2 = kv_field_offsets(kv)
    group = hq // h
    interpret = q.device.type == "cpu"
    dt = tl.float16 if layout.fmt != "bf16" else (tl.float32 if interpret else tl.bfloat16)
    grid = (triton.cdiv(n, cfg["BLOCK_T"]), h)
    quarters = layout.fmt in ("nvfp4", "int4")
    q_in = q
    if quarters:
        # the chunk's K/V with each quarter (channels 4j + k) contiguous, in the tile type: [n, H, 4, D/4]
        k = k.view(n, h, d // 4, 4).transpose(2, 3).to(torch.float16).contiguous()
        v = v.view(n, h, d // 4, 4).transpose(2, 3).to(torch.float16).contiguous()
    k_mul_pre, v_mul_pre, k_mul_new = sm_scale * LOG2E * k_fold, v_fold, sm_scale * LOG2E
    vfold = 0
    if quarters:
        # q times the prefix's score multiplier, in the tile type, quarter-major like k and v: [n, Hq, 4, D/4]
        q_in = (q.float() * k_mul_pre).view(n, hq, d // 4, 4).transpose(2, 3).to(torch.float16).contiguous()
        k_mul_new = k_mul_new / k_mul_pre
        vfold = int(v_fold >= VFOLD_MIN)  # the chunk's probabilities times 1 / fold must stay in fp16's range
        if vfold:
            v_mul_pre = 1.0 / v_fold
    args = (q_in, k, v, out, kv.base, pages, n2, n, prefix_len, kv.int2_top, k_mul_pre, v_mul_pre, k_mul_new,
            q_in.stride(0), q_in.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1))  # fmt: skip
    meta = dict(
        FMT=FMT_CODES[layout.fmt], TRIAXIAL=kv.triaxial, G=group, GP=triton.next_power_of_2(group), D=d, P=p,
        PAGE_BYTES=lay[0], K_OFF=lay[1], KS_OFF=lay[2], KZ_OFF=lay[3], V_OFF=lay[4], VS_OFF=lay[5], VZ_OFF=lay[6],
        PAGE_BYTES2=lay2[0], K_OFF2=lay2[1], KS_OFF2=lay2[2], KZ_OFF2=lay2[3], V_OFF2=lay2[4], VS_OFF2=lay2[5],
        VZ_OFF2=lay2[6], BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], PPI=cfg["PPI"], PPI2=ppi2,
        NUM_STAGES=cfg["NUM_STAGES"], DT=dt, num_warps=cfg["num_warps"],
    )  # fmt: skip
    if quarters:
        _extend_kernel4[grid](*args, **meta, VFOLD=vfold, FAST=fast)
    else:
        _extend_kernel[grid](*args, **meta, FAST=fast)
    return out


# integer arguments the JIT specializes as multiples of 16 at the bench's shapes (compile_report's ``aligned``)
REPORT_ALIGNED = ("total_bytes", "q_s0", "q_s1", "k_s0", "k_s1", "o_s0", "o_s1")


def compile_report_args(fmt: str) -> tuple[Any, dict[str, str], dict[str, Any], int]:
    """(kernel, signature, constexprs, num_warps) to compile the extend kernel as launched (TUNING, a V fold applied
    at the output) without a GPU, e.g. ``compile_report.report(kernel, sig, const, num_warps=w,
    aligned=REPORT_ALIGNED)``.

    fmt: "nvfp4" or "triaxial" (the packed kernel), "bf16" / "fp8_e4m3"; the real shape (32 q / 8 kv heads, d 128)."""
    plain = "int4" if fmt == "triaxial" else fmt
    packed = plain in ("nvfp4", "int4")
    lay = PageLayout.build(plain, page_size=32 if fmt == "triaxial" else 16, kv_heads=8, head_dim=128)
    lay2 = PageLayout.build("int2", page_size=32, kv_heads=8, head_dim=128) if fmt == "triaxial" else None
    cfg = TUNING[plain]
    a, a2 = field_offsets(lay), field_offsets(lay2)
    chunk = "*fp16" if packed else "*bf16"  # the wrapper hands the packed kernel q and the chunk's k, v in fp16
    sig = {"q_ptr": chunk, "k_ptr": chunk, "v_ptr": chunk, "o_ptr": "*bf16",
           "buf_ptr": "*u8", "pt_ptr": "*i32", "n2_ptr": "*i32", "n_new": "i32", "prefix_len": "i32",
           "total_bytes": "i64", "k_mul_pre": "fp32", "v_mul_pre": "fp32", "k_mul_new": "fp32", "q_s0": "i32",
           "q_s1": "i32", "k_s0": "i32", "k_s1": "i32", "o_s0": "i32", "o_s1": "i32"}  # fmt: skip
    const: dict[str, Any] = dict(
        FMT=FMT_CODES[plain], TRIAXIAL=fmt == "triaxial", G=4, GP=4, D=128, P=lay.page_size,
        PAGE_BYTES=a[0], K_OFF=a[1], KS_OFF=a[2], KZ_OFF=a[3], V_OFF=a[4], VS_OFF=a[5], VZ_OFF=a[6],
        PAGE_BYTES2=a2[0], K_OFF2=a2[1], KS_OFF2=a2[2], KZ_OFF2=a2[3], V_OFF2=a2[4], VS_OFF2=a2[5], VZ_OFF2=a2[6],
        BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], PPI=cfg["PPI"], PPI2=cfg.get("PPI2", cfg["PPI"]),
        NUM_STAGES=cfg["NUM_STAGES"], DT=tl.float16 if plain != "bf16" else tl.bfloat16, FAST=True,
        **({"VFOLD": 1} if packed else {}),
    )  # fmt: skip
    return (_extend_kernel4 if packed else _extend_kernel), sig, const, cfg["num_warps"]
