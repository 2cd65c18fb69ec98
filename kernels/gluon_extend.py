"""Gluon extend (chunked-prefill) attention on nvfp4 pages for Hopper: unpacking overlapped with async ``wgmma``.

Same problem as ``triton_prefill._extend_kernel4`` (a chunk of new tokens against
the packed cached prefix plus itself, causal, one online softmax); this kernel
changes how a step is scheduled, which is what bound the ``tl`` kernel
(docs/performance-log/kernels.md, session 6: unpack, wgmma and softmax ran one after
the other, every wgmma waited at once).

One program = BLOCK_T chunk tokens x the G query heads of one kv head (M =
BLOCK_T * G = 128 rows, 8 warps = two warpgroups of 64 rows), N = PPI * P = 128
prefix keys per step. Two pairs of K / V tiles in shared memory (NVMMA-swizzled,
written by the unpackers), used alternately: the loop runs two steps per
iteration so each tile is its own allocation. Per step i (``_step``)::

    load step i+2's packed bytes and step i+3's page ids    (global -> registers, used a step later)
    issue S_i = q K_i^T               (wgmma, async; q in shared memory, pre-scaled by the wrapper)
    unpack step i+1's K into the other K tile               (ALU work while S_i runs)
    wait S_i; online softmax; acc *= alpha
    issue acc += P_i V_i              (wgmma, async, P from registers)
    unpack step i+1's V into the other V tile               (ALU work while PV_i runs)
    wait PV_i; fence (generic -> async proxy); one CTA barrier

The other tiles were last read by step i-1's wgmma, which both warpgroups
waited for before step i-1's barrier. (Keeping PV_i in flight into step i+1,
as FlashAttention-3 does, makes ptxas serialize every wgmma of the kernel:
docs/performance-log/kernels.md, session 8.)

Channels stay in the four quarters of ``triton_prefill._extend_kernel4`` (quarter k = channels
4j + k, what one shift of the packed 16-bit words gives): the unpacked K / V
tiles are [N, D] with the quarters side by side (column k * D/4 + j), q
arrives in the same order (QPRE), and the output is un-permuted at the store.
The chunk's own keys (fp16, quarter-major from the wrapper) run after the
prefix, one synchronous step per N keys, causal.

Supported (``supported``): nvfp4 pages, head_dim 128, page size 16, 4 query
heads per kv head, a V fold (global scale times 2^7) of at least VFOLD_MIN; the
PTX unpackers and ``wgmma`` need a Hopper GPU, so the interpreter and other
calls run ``triton_prefill``. ``tests/kernels/test_gluon_extend.py`` compiles the
kernel for sm_90 on CPU and the gpu tests hold it to fp64 attention.

Warp-specialized (``_gl_extend_ws_kernel``, TUNING WS 1): the same step split between two partitions. A
producer of LOAD_WARPS warps (LOAD_REGS registers after setmaxnreg) loads step i+1's packed bytes while it
unpacks step i into a ring of SLOTS K / V tile pairs and arrives on its ``full`` barrier; the kernel's 8 warps
wait on ``full``, run S, the softmax and PV, and release the slot on ``empty``. The unpack leaves the attending
warps' path (H200, session 9: 1.07-1.16x the one-partition kernel). Both warpgroups release a slot together
(Gluon's mbarrier arrive is one thread of a partition, after a barrier of the partition), so they run in lockstep.

Two consumer partitions (``_gl_extend_pp_kernel``, the default: TUNING WS 2): each warpgroup is its own
partition of 4 warps with half the rows (its own q tile), and releases a slot for itself (``empty`` counts 2),
so no barrier joins the two and one's softmax runs while the other's wgmma does; the producer stages the chunk's
own keys into the ring after the prefix (cp.async), so the chunk is pipelined too. H200, session 10: 1.10-1.15x
WS 1 (taking turns at the wgmma through named barriers, FlashAttention-3's ping-pong, was 1-5% slower than
letting them drift: docs/performance-log/kernels.md). q is read as the caller holds it (scaled and put quarter-major in
the kernel), and the chunk blocks run last-first (REV 1: the blocks with the most causal keys first). The
producer's rows sit in lanes that make its 16-byte tile stores free of bank conflicts (CF 1, ``cf_bases``: ncu
counted 16.9 M conflicts in 48.1 M store wavefronts before, 0.16 M in 27.3 M after; 2-5% faster, session 12).

Triaxial pages (INT4 + INT2, pages of 32) run the WS 2 kernel with another producer: ``gluon_extend_tri``
(the consumers ``_pp_attend`` and the chunk's ``_pp_chunk`` live in ``gluon_attend``, shared by both; paged_ops
runs it for triaxial pages since session 12).

Tuning (``TUNING``): WS 0 runs ``_gl_extend_kernel`` (the schedule above in one partition); there OVERLAP 0 waits
each wgmma at once (the unpack after it), PAIR 0 uses the session-6 quarter unpacker, PAIR 2 int32 word pairs,
PROBE is for measurements only (wrong output; WS 2 has its own, see _ws_load). See docs/performance-log/kernels.md,
sessions 8-10.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .gluon_attend import (_as_type, _cta_barrier, _load_q, _mma_layout, _pp_attend, _pp_chunk_any,
                           _pp_setup, _ring, _row_coords, _row_layout, _softmax, chunk_kv, chunk_rows, launch_io,
                           launch_pages)
from .layout import PageLayout
from .paged_kv import PagedKV
from .triton_codec import asm_e2m1_pair, asm_quarters
from .triton_common import LOG2E, VFOLD_MIN, field_offsets, folded_scales

ASM_E2M1_Q: gl.constexpr = gl.constexpr(asm_quarters("e2m1"))
ASM_E2M1_PAIR: gl.constexpr = gl.constexpr(asm_e2m1_pair())
ASM_E2M1_PAIR_H: gl.constexpr = gl.constexpr(asm_e2m1_pair(half_scale=True))


@gluon.constexpr_function
def _word_layout(w: int) -> Any:
    """[rows, D/4 words] of packed 16-bit words: 8 words (16 bytes) per thread and row, 4 threads per row."""
    return gl.BlockedLayout([1, 8], [8, 4], [w, 1], [1, 0])


@gluon.constexpr_function
def _pair_layout(w: int) -> Any:
    """[rows, D/8 word pairs] of packed int32 (two 16-bit words each): 4 pairs (16 bytes) per thread and row, the
    rows of _word_layout."""
    return gl.BlockedLayout([1, 4], [8, 4], [w, 1], [1, 0])


@gluon.constexpr_function
def _scale_layout(w: int) -> Any:
    """[rows, D/16 block scales]: the 2 blocks of a thread's 8 words (same rows per thread as _word_layout)."""
    return gl.BlockedLayout([1, 2], [8, 4], [w, 1], [1, 0])


@gluon.constexpr_function
def cf_bases(w: int, n: int, per_thread: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(register, lane, warp) bases of an [n, 4 * per_thread] layout with per_thread consecutive columns a thread
    and 4 threads a row, as _pair_layout (D/8 columns) and _scale_layout (D/16) hold them, but lanes 4-7 of each 8
    take the row 4 below lanes 0-3's instead of the next one (lane bits: 2 column, then rows +4, +1, +2).

    Why: a 16-byte shared store is served 8 lanes at a time, and the NVMMA 128-byte swizzle XORs the row's low 3
    bits into the 16-byte chunk index; the 4 lanes of a row write one aligned quad of chunks of a 128-byte line
    (one quarter of the tile), and rows r, r+1 (r even) land on the same quad: two wavefronts where one would do.
    Rows r and r+4 land on the two different quads."""
    if n % (8 * w) or per_thread & (per_thread - 1):
        raise ValueError(f"cf_bases: n={n} must be a multiple of 8 * w={8 * w}, per_thread={per_thread} a power of 2")
    reg = [[0, 1 << b] for b in range(per_thread.bit_length() - 1)]
    reg += [[8 * w << b, 0] for b in range((n // (8 * w)).bit_length() - 1)]
    lane = [[0, per_thread], [0, 2 * per_thread], [4, 0], [1, 0], [2, 0]]
    warp = [[8 << b, 0] for b in range(w.bit_length() - 1)]
    return reg, lane, warp


@gluon.constexpr_function
def _cf_layout(w: int, n: int, per_thread: int) -> Any:
    """The layout of cf_bases (CF 1)."""
    reg, lane, warp = cf_bases(w, n, per_thread)
    return gl.DistributedLinearLayout(reg, lane, warp, [], [n, 4 * per_thread])


@gluon.constexpr_function
def _pair_layout_cf(w: int, n: int) -> Any:
    """_pair_layout for n rows with the lanes of _cf_layout (CF 1: conflict-free tile stores)."""
    return _cf_layout(w, n, 4)


@gluon.constexpr_function
def _scale_layout_cf(w: int, n: int) -> Any:
    """_scale_layout with the rows of _pair_layout_cf."""
    return _cf_layout(w, n, 2)


@gluon.jit
def _page_ids(pt_ptr, it, page_hi, N: gl.constexpr, P: gl.constexpr, CF: gl.constexpr = False):
    """Page id of each of the N key rows of the step at list index ``it`` (0 past page_hi), in the rows' layout of
    _word_layout (CF: of _pair_layout_cf): loaded a step before the bytes, so that their addresses do not wait for
    it."""
    if CF:
        n = gl.arange(0, N, layout=gl.SliceLayout(1, _pair_layout_cf(gl.num_warps(), N)))
    else:
        n = gl.arange(0, N, layout=gl.SliceLayout(1, _word_layout(gl.num_warps())))
    pidx = it + n // P
    return gl.load(pt_ptr + pidx, mask=pidx < page_hi, other=0)


@gluon.jit
def _load_raw(buf_ptr, pid, it, prefix_len, h, N: gl.constexpr, P: gl.constexpr, D: gl.constexpr,
              PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr,
              VS_OFF: gl.constexpr, PAIRS: gl.constexpr = False, CF: gl.constexpr = False):  # fmt: skip
    """The packed bytes of the step at list index ``it`` (pid: its rows' page ids): K and V words [N, D/4] (int16),
    K and V block scales [N, D/16] (uint8); keys past prefix_len read 0 (codes and scales 0: the tile is 0, so a
    masked key's probability 0 never meets a NaN that the unwritten slots of a partial page may hold). PAIRS: the
    words as int32 pairs [N, D/8] (half the registers of int16 elements, which take one each); CF (with PAIRS):
    in _pair_layout_cf's rows."""
    W: gl.constexpr = gl.num_warps()
    LW: gl.constexpr = _pair_layout_cf(W, N) if CF else (_pair_layout(W) if PAIRS else _word_layout(W))
    LS: gl.constexpr = _scale_layout_cf(W, N) if CF else _scale_layout(W)
    Q: gl.constexpr = D // 4
    n = gl.arange(0, N, layout=gl.SliceLayout(1, LW))
    inb = it * P + n < prefix_len
    page = gl.convert_layout(pid, gl.SliceLayout(1, LW)).to(gl.int64) * PAGE_BYTES
    hrow = h * P + n % P  # row inside a [H, P, ...] field
    m = inb[:, None]
    if PAIRS:
        j = gl.arange(0, Q // 2, layout=gl.SliceLayout(0, LW))[None, :]
        wp = (buf_ptr + (page + hrow * (D // 2))[:, None]).to(gl.pointer_type(gl.int32), bitcast=True) + j
        kw = gl.load(wp + K_OFF // 4, mask=m, other=0)
        vw = gl.load(wp + V_OFF // 4, mask=m, other=0)
    else:
        j = gl.arange(0, Q, layout=gl.SliceLayout(0, LW))[None, :]
        wp = (buf_ptr + (page + hrow * (D // 2))[:, None]).to(gl.pointer_type(gl.int16), bitcast=True) + j
        kw = gl.load(wp + K_OFF // 2, mask=m, other=0)
        vw = gl.load(wp + V_OFF // 2, mask=m, other=0)
    SL: gl.constexpr = gl.SliceLayout(1, LS)
    srow = gl.convert_layout(page, SL) + gl.convert_layout(hrow, SL) * (D // 16)
    sok = gl.convert_layout(inb, SL)[:, None]
    sp = buf_ptr + srow[:, None] + gl.arange(0, D // 16, layout=gl.SliceLayout(0, LS))[None, :]
    ks = gl.load(sp + KS_OFF, mask=sok, other=0)
    vs = gl.load(sp + VS_OFF, mask=sok, other=0)
    return kw, vw, ks, vs


@gluon.jit
def _unpack(w, s, dst, PAIR: gl.constexpr):
    """Packed nvfp4 words [N, D/4] and their block scales [N, D/16] -> fp16 e2m1 * s * 2^-7 ... * 2^7 = e2m1 * s,
    quarters side by side ([N, D], column k * D/4 + j = channel 4j + k), stored into the shared tile ``dst``."""
    N: gl.constexpr = w.shape[0]
    if PAIR == 2:  # int32 word pairs [N, D/8]: quarters as f16x2 int32, stored through an int32 view of the tile
        Q2: gl.constexpr = w.shape[1]
        sh = s.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0
        sh = gl.convert_layout(gl.reshape(gl.join(sh, sh), [N, Q2]), w.type.layout)  # a block: 2 word pairs
        y0, y1, y2, y3 = gl.inline_asm_elementwise(ASM_E2M1_PAIR_H, "=r,=r,=r,=r,r,h", [w, sh],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)  # fmt: skip
        u = gl.join(gl.join(y0, y1), gl.join(y2, y3))  # [N, Q2, i, o]: quarter k = 2 * o + i
        u = gl.reshape(gl.permute(u, [0, 3, 2, 1]), [N, 4 * Q2])
        LI: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, 4 * Q2], gl.int32)
        _as_type(dst, gl.int32, [N, 4 * Q2], LI).store(u)
    else:
        Q: gl.constexpr = w.shape[1]
        sc = s.to(gl.float8e4nv, bitcast=True).to(gl.float16) * 128.0  # s * 2^7: the unpacker gives e2m1 * 2^-14
        sc = gl.join(gl.join(sc, sc), gl.join(sc, sc))  # each block scale for its 4 words
        sc = gl.convert_layout(gl.reshape(sc, [N, Q]), w.type.layout)
        if PAIR:  # the two int16 words of a pair arrive in one register (pack=2): 15 instructions per 8 values
            x0, x1, x2, x3 = gl.inline_asm_elementwise(ASM_E2M1_PAIR, "=r,=r,=r,=r,r,r", [w, sc],
                                                       dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True,
                                                       pack=2)  # fmt: skip
        else:  # the session-6 unpacker: one word per int32, joined again by a prmt (21 + 3 per 8 values)
            x0, x1, x2, x3 = gl.inline_asm_elementwise(ASM_E2M1_Q, "=r,=r,=r,=r,r,r,r", [w.to(gl.int32), sc],
                                                       dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True,
                                                       pack=2)  # fmt: skip
        t = gl.join(gl.join(x0, x1), gl.join(x2, x3))  # [N, Q, i, o]: quarter k = 2 * o + i
        t = gl.reshape(gl.permute(t, [0, 3, 2, 1]), [N, 4 * Q])
        dst.store(t)


@gluon.jit
def _step(i, q_smem, k_cur, v_cur, k_nxt, v_nxt, s0, m_i, l_i, acc, kw, vw, ks, vs, pid, key, buf_ptr, pt_ptr, num_pages,
          prefix_len, h, N: gl.constexpr, P: gl.constexpr, D: gl.constexpr, PAGE_BYTES: gl.constexpr,
          K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, PPI: gl.constexpr,
          OVERLAP: gl.constexpr, PROBE: gl.constexpr, PAIR: gl.constexpr):  # fmt: skip
    """Prefix step i: S and PV on the tiles in k_cur / v_cur while step i+1's bytes (kw .. vs) are unpacked into
    k_nxt / v_nxt, step i+2's are loaded (pid: its page ids) and step i+3's page ids -> (m, l, acc, step i+2's bytes,
    step i+3's page ids)."""
    A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    # step i+2's bytes: in flight for a whole step
    if PROBE == 2:
        nkw, nvw, nks, nvs, npid = kw, vw, ks, vs, pid
    else:
        nkw, nvw, nks, nvs = _load_raw(buf_ptr, pid, (i + 2) * PPI, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF,
                                       V_OFF, VS_OFF, PAIR == 2)  # fmt: skip
        npid = _page_ids(pt_ptr, (i + 3) * PPI, num_pages, N, P)
    if OVERLAP:
        s_tok = warpgroup_mma(q_smem, k_cur.permute((1, 0)), s0, use_acc=False, is_async=True)
        if PROBE == 0:
            _unpack(kw, ks, k_nxt, PAIR)  # under S_i
        s = warpgroup_mma_wait(0, deps=(s_tok,))
    else:
        s = warpgroup_mma(q_smem, k_cur.permute((1, 0)), s0, use_acc=False)
        if PROBE == 0:
            _unpack(kw, ks, k_nxt, PAIR)
    if (i + 1) * N > prefix_len:  # the last step may end inside a page
        s = gl.where(i * N + key < prefix_len, s, float("-inf"))
        p, m_i, l_i, acc = _softmax(s, m_i, l_i, acc, True)
    else:
        p, m_i, l_i, acc = _softmax(s, m_i, l_i, acc, False)
    pa = gl.convert_layout(p.to(gl.float16), A_P)
    if OVERLAP:
        o_tok = warpgroup_mma(pa, v_cur, acc, is_async=True)
        if PROBE == 0:
            _unpack(vw, vs, v_nxt, PAIR)  # under PV_i
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
    else:
        acc = warpgroup_mma(pa, v_cur, acc)
        if PROBE == 0:
            _unpack(vw, vs, v_nxt, PAIR)
    # the next tiles complete (both warpgroups) and visible to wgmma; the current ones free (S_i, PV_i done)
    fence_async_shared()
    _cta_barrier()
    return m_i, l_i, acc, nkw, nvw, nks, nvs, npid


@gluon.jit
def _finish(q_smem, kc, vc, m_i, l_i, acc, s0, key, k_ptr, v_ptr, o_ptr, n_new, k_mul_new, v_div, k_s0, o_s0, o_s1, qb,
            h, G: gl.constexpr, D: gl.constexpr, BLOCK_T: gl.constexpr):  # fmt: skip
    """After the prefix: the chunk itself, causal, in synchronous steps of N keys through the tiles kc / vc; then
    the output (normalized, the V fold applied, channels un-permuted)."""
    W: gl.constexpr = gl.num_warps()
    M: gl.constexpr = BLOCK_T * G
    N: gl.constexpr = kc.shape[0]
    Q: gl.constexpr = D // 4
    MMA: gl.constexpr = s0.type.layout
    MMA_O: gl.constexpr = acc.type.layout
    A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    LR: gl.constexpr = _row_layout(W)
    tok, qh, c = _row_coords(qb, h, M, G, D, BLOCK_T)
    row_ok = (tok < n_new)[:, None]
    tok_s = gl.convert_layout(tok, gl.SliceLayout(1, MMA))[:, None]
    jr = gl.arange(0, N, layout=gl.SliceLayout(1, LR))
    hi = gl.minimum(n_new, (qb + 1) * BLOCK_T)
    for j0 in range(0, hi, N):
        j = j0 + jr
        off = j[:, None].to(gl.int64) * k_s0 + h * D + c
        jm = (j < n_new)[:, None]
        kc.store(gl.load(k_ptr + off, mask=jm, other=0.0))
        vc.store(gl.load(v_ptr + off, mask=jm, other=0.0))
        fence_async_shared()
        _cta_barrier()
        s = warpgroup_mma(q_smem, kc.permute((1, 0)), s0, use_acc=False)
        s = gl.where((j0 + key <= tok_s) & (j0 + key < n_new), s * k_mul_new, float("-inf"))
        p, m_i, l_i, acc = _softmax(s, m_i, l_i, acc, True)
        acc = warpgroup_mma(gl.convert_layout((p * v_div).to(gl.float16), A_P), vc, acc)
        _cta_barrier()  # both warpgroups done with the tile before the next one overwrites it
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, MMA_O))
    out = acc * (1.0 / (gl.where(l_o > 0, l_o, 1.0) * v_div))[:, None]
    out = gl.convert_layout(out, LR)
    ch = 4 * (c % Q) + c // Q  # column k * D/4 + j holds channel 4j + k
    gl.store(o_ptr + tok[:, None].to(gl.int64) * o_s0 + qh[:, None] * o_s1 + ch, out.to(o_ptr.dtype.element_ty),
             mask=row_ok)  # fmt: skip


@gluon.jit
def _gl_extend_kernel(
    q_ptr,  # [n, Hq, D]: the chunk's queries (strides q_s0, q_s1, 1), any float dtype
    k_ptr, v_ptr,  # [n, H, 4, D/4] fp16: the chunk's own K / V, quarter-major
    o_ptr,  # [n, Hq, D] output (strides o_s0, o_s1, 1)
    buf_ptr, pt_ptr,  # uint8 layer buffer, int32 prefix page ids
    n_new, prefix_len,
    q_mul,  # fp32: the prefix's score multiplier (sm_scale * log2(e) * K's fold), applied to q as it is loaded
    k_mul_new,  # fp32: the chunk's score multiplier relative to q's
    v_div,  # fp32: 1 / (V fold): the chunk's P is scaled by it, the output by its inverse
    q_s0, q_s1, k_s0, o_s0, o_s1,
    G: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
    KS_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr,
    BLOCK_T: gl.constexpr, PPI: gl.constexpr, OVERLAP: gl.constexpr,
    PAIR: gl.constexpr,  # the word-pair unpacker (triton_codec.asm_e2m1_pair); 0: asm_quarters
    PROBE: gl.constexpr,  # measurement only: 1 = no unpacking in the loop (tiles keep stale values), 2 = no loads either
):  # fmt: skip
    W: gl.constexpr = gl.num_warps()
    M: gl.constexpr = BLOCK_T * G
    N: gl.constexpr = PPI * P
    Q: gl.constexpr = D // 4
    qb = gl.program_id(0)
    h = gl.program_id(1)
    MMA: gl.constexpr = _mma_layout(W, N)  # S [M, N]
    MMA_O: gl.constexpr = _mma_layout(W, D)  # O [M, D]
    A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    TILE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D], gl.float16)
    q_smem = _load_q(q_ptr, n_new, q_s0, q_s1, q_mul, qb, h, G, D, BLOCK_T)
    k_a = gl.allocate_shared_memory(gl.float16, [N, D], TILE)
    v_a = gl.allocate_shared_memory(gl.float16, [N, D], TILE)
    k_b = gl.allocate_shared_memory(gl.float16, [N, D], TILE)
    v_b = gl.allocate_shared_memory(gl.float16, [N, D], TILE)

    m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([M, D], gl.float32, layout=MMA_O)
    s0 = gl.zeros([M, N], gl.float32, layout=MMA)

    num_pages = gl.cdiv(prefix_len, P)
    steps = gl.cdiv(num_pages, PPI)
    # prologue: step 0 unpacked into slot 0, step 1's bytes in registers
    pid = _page_ids(pt_ptr, 0, num_pages, N, P)
    kw, vw, ks, vs = _load_raw(buf_ptr, pid, 0, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF, PAIR == 2)
    pid = _page_ids(pt_ptr, PPI, num_pages, N, P)
    pid2 = _page_ids(pt_ptr, 2 * PPI, num_pages, N, P)
    _unpack(kw, ks, k_a, PAIR)
    _unpack(vw, vs, v_a, PAIR)
    kw, vw, ks, vs = _load_raw(buf_ptr, pid, PPI, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF, PAIR == 2)
    pid = pid2
    fence_async_shared()
    _cta_barrier()
    key = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))[None, :]
    # steps in pairs: slots a then b, so that each tile is its own allocation (no barrier for a dynamic index)
    for i in range(0, steps, 2):
        m_i, l_i, acc, kw, vw, ks, vs, pid = _step(i, q_smem, k_a, v_a, k_b, v_b, s0, m_i, l_i, acc, kw, vw, ks, vs, pid, key,
                                              buf_ptr, pt_ptr, num_pages, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF,
                                              KS_OFF, V_OFF, VS_OFF, PPI, OVERLAP, PROBE, PAIR)  # fmt: skip
        if i + 1 < steps:
            m_i, l_i, acc, kw, vw, ks, vs, pid = _step(i + 1, q_smem, k_b, v_b, k_a, v_a, s0, m_i, l_i, acc, kw, vw, ks, vs,
                                                       pid, key,
                                                  buf_ptr, pt_ptr, num_pages, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF,
                                                  KS_OFF, V_OFF, VS_OFF, PPI, OVERLAP, PROBE, PAIR)  # fmt: skip

    _finish(q_smem, k_a, v_a, m_i, l_i, acc, s0, key, k_ptr, v_ptr, o_ptr, n_new, k_mul_new, v_div, k_s0, o_s0, o_s1,
            qb, h, G, D, BLOCK_T)  # fmt: skip


@gluon.jit
def _ws_load(buf_ptr, pt_ptr, k_ring, v_ring, full, empty, prefix_len, h, P: gl.constexpr, D: gl.constexpr,
             PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr,
             VS_OFF: gl.constexpr, PPI: gl.constexpr, PAIR: gl.constexpr, PROBE: gl.constexpr = 0,
             CF: gl.constexpr = False):  # fmt: skip
    """WS producer partition: loads and unpacks step i into ring slot i % SLOTS once the consumers released it
    (``empty``), then signals ``full``; step i+1's bytes and step i+2's page ids are in flight meanwhile. PROBE
    (measurement only, wrong output): 1 no unpacking, the slots keep what they held; 2 the unpack without the
    generic -> async proxy fence (ptxas' MEMBAR.ALL.CTA; racy); 3 zero tiles stored instead of the unpack (the
    shared-memory stores without the unpacking arithmetic). CF (PAIR 2): rows in _pair_layout_cf's lanes, so the
    tile stores are free of bank conflicts."""
    N: gl.constexpr = PPI * P
    SLOTS: gl.constexpr = k_ring.shape[0]
    num_pages = gl.cdiv(prefix_len, P)
    steps = gl.cdiv(num_pages, PPI)
    pid = _page_ids(pt_ptr, 0, num_pages, N, P, CF)
    kw, vw, ks, vs = _load_raw(buf_ptr, pid, 0, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF, PAIR == 2,
                               CF)  # fmt: skip
    pid = _page_ids(pt_ptr, PPI, num_pages, N, P, CF)
    for i in range(steps):
        slot = i % SLOTS
        nkw, nvw, nks, nvs = _load_raw(buf_ptr, pid, (i + 1) * PPI, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF,
                                       V_OFF, VS_OFF, PAIR == 2, CF)  # fmt: skip
        pid = _page_ids(pt_ptr, (i + 2) * PPI, num_pages, N, P, CF)
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)  # a fresh mbarrier counts as released once
        if PROBE == 0 or PROBE == 2:
            _unpack(kw, ks, k_ring.index(slot), PAIR)
            _unpack(vw, vs, v_ring.index(slot), PAIR)
        if PROBE == 3:
            zero = gl.zeros([N, D], gl.float16, layout=_row_layout(gl.num_warps()))
            k_ring.index(slot).store(zero)
            v_ring.index(slot).store(zero)
        if PROBE != 2:
            fence_async_shared()
        _cta_barrier()  # the partition's stores are done: its thread 0 arrives for all
        mbarrier.arrive(full.index(slot), count=1)
        kw, vw, ks, vs = nkw, nvw, nks, nvs


@gluon.jit
def _ws_attend(q_smem, k_ring, v_ring, full, empty, m_i, l_i, acc, s0, key, prefix_len, P: gl.constexpr,
               PPI: gl.constexpr):  # fmt: skip
    """WS consumer partition (the kernel's warps, two warpgroups): S, softmax and PV on ring slot i % SLOTS once the
    producer filled it, then releases the slot."""
    N: gl.constexpr = PPI * P
    SLOTS: gl.constexpr = k_ring.shape[0]
    A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    steps = gl.cdiv(gl.cdiv(prefix_len, P), PPI)
    for i in range(steps):
        slot = i % SLOTS
        mbarrier.wait(full.index(slot), (i // SLOTS) & 1)
        s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s0, use_acc=False)
        if (i + 1) * N > prefix_len:  # the last step may end inside a page
            s = gl.where(i * N + key < prefix_len, s, float("-inf"))
            p, m_i, l_i, acc = _softmax(s, m_i, l_i, acc, True)
        else:
            p, m_i, l_i, acc = _softmax(s, m_i, l_i, acc, False)
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.float16), A_P), v_ring.index(slot), acc)
        _cta_barrier()  # both warpgroups are done reading the slot: thread 0 releases it
        mbarrier.arrive(empty.index(slot), count=1)
    return m_i, l_i, acc


@gluon.jit
def _gl_extend_ws_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, buf_ptr, pt_ptr, n_new, prefix_len, q_mul, k_mul_new, v_div, q_s0, q_s1, k_s0, o_s0, o_s1,
    G: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
    KS_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, BLOCK_T: gl.constexpr, PPI: gl.constexpr,
    PAIR: gl.constexpr,
    SLOTS: gl.constexpr,  # K / V tile pairs in the ring
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,  # the producer partition
):  # fmt: skip
    """_gl_extend_kernel warp-specialized (WS): a producer partition of LOAD_WARPS warps loads and unpacks the
    prefix into a ring of SLOTS tile pairs (mbarriers full / empty), the kernel's own warps only attend; then the
    chunk as in _gl_extend_kernel. The default in session 9 (H200: 0.76-0.81x FlashInfer bf16 from 32K cached,
    1.07-1.16x _gl_extend_kernel; docs/performance-log/kernels.md), WS 1 since session 10."""
    W: gl.constexpr = gl.num_warps()
    M: gl.constexpr = BLOCK_T * G
    N: gl.constexpr = PPI * P
    qb = gl.program_id(0)
    h = gl.program_id(1)
    MMA: gl.constexpr = _mma_layout(W, N)
    q_smem = _load_q(q_ptr, n_new, q_s0, q_s1, q_mul, qb, h, G, D, BLOCK_T)
    k_ring, v_ring, full, empty = _ring(N, D, SLOTS, 1)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([M, D], gl.float32, layout=_mma_layout(W, D))
    s0 = gl.zeros([M, N], gl.float32, layout=MMA)
    key = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))[None, :]
    m_i, l_i, acc = gl.warp_specialize([
        (_ws_attend, (q_smem, k_ring, v_ring, full, empty, m_i, l_i, acc, s0, key, prefix_len, P, PPI)),
        (_ws_load, (buf_ptr, pt_ptr, k_ring, v_ring, full, empty, prefix_len, h, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF,
                    VS_OFF, PPI, PAIR)),
    ], [LOAD_WARPS], [LOAD_REGS])  # fmt: skip
    _cta_barrier()
    _finish(q_smem, k_ring.index(0), v_ring.index(0), m_i, l_i, acc, s0, key, k_ptr, v_ptr, o_ptr, n_new, k_mul_new,
            v_div, k_s0, o_s0, o_s1, qb, h, G, D, BLOCK_T)  # fmt: skip


@gluon.jit
def _pp_load(buf_ptr, pt_ptr, k_ptr, v_ptr, k_ring, v_ring, full, empty, prefix_len, n_new, k_s0, qb, h, P: gl.constexpr,
             D: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr,
             VS_OFF: gl.constexpr, PPI: gl.constexpr, PAIR: gl.constexpr, BLOCK_T: gl.constexpr,
             PROBE: gl.constexpr, CF: gl.constexpr, CKV: gl.constexpr):  # fmt: skip
    """WS 2 producer: the prefix as _ws_load, then the chunk's own keys (_pp_chunk; CKV: _pp_chunk_rows) into the
    same ring."""
    _ws_load(buf_ptr, pt_ptr, k_ring, v_ring, full, empty, prefix_len, h, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF,
             PPI, PAIR, PROBE, CF)  # fmt: skip
    first = gl.cdiv(gl.cdiv(prefix_len, P), PPI)
    _pp_chunk_any(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D, BLOCK_T, CKV)


@gluon.jit
def _gl_extend_pp_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, buf_ptr, pt_ptr, n_new, prefix_len, q_mul, k_mul_new, v_div, q_s0, q_s1, k_s0, o_s0, o_s1,
    G: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
    KS_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, BLOCK_T: gl.constexpr, PPI: gl.constexpr,
    PAIR: gl.constexpr,
    SLOTS: gl.constexpr,  # K / V tile pairs in the ring
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,  # the producer partition
    ATT_REGS: gl.constexpr,  # the second warpgroup's registers (the first, the kernel's own 4 warps, gets the rest)
    REV: gl.constexpr,  # 1: chunk blocks in reverse order (the last, with the most causal keys, first: a shorter tail)
    PROBE: gl.constexpr,  # measurement only (wrong output): 1 no unpacking, 2 no proxy fence, 3 zero tiles (_ws_load)
    CF: gl.constexpr,  # 1: the producer's rows in _pair_layout_cf's lanes (tile stores free of bank conflicts)
    CKV: gl.constexpr,  # 1: the chunk's k, v read as the caller holds them (no fp16 copies by the wrapper)
    LAZY: gl.constexpr = 0,  # 1: the consumers' lazy softmax on full prefix steps (gluon_attend._softmax_lazy)
    TREE: gl.constexpr = 0,  # 1: the consumers' row max / sum as trees (gluon_attend._row_reduce)
):  # fmt: skip
    """WS 2: the two warpgroups of _gl_extend_ws_kernel as two partitions of 4 warps, each with half the rows (its
    own q tile) and its own release of a slot (``empty`` counts 2), so they drift apart and one's softmax can run
    under the other's wgmma; the producer also stages the chunk's own keys, so the chunk runs through the ring too.
    The kernel's num_warps is the first warpgroup's (4)."""
    H2: gl.constexpr = BLOCK_T * G // 2
    qb, h, q_0, q_1, k_ring, v_ring, full, empty = _pp_setup(q_ptr, n_new, q_s0, q_s1, q_mul, G, D, P, PPI, BLOCK_T,
                                                             SLOTS, REV)
    gl.warp_specialize([
        (_pp_attend, (q_0, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h, 0,
                      G, D, P, PPI, BLOCK_T, LAZY, TREE)),
        (_pp_attend, (q_1, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h, H2,
                      G, D, P, PPI, BLOCK_T, LAZY, TREE)),
        (_pp_load, (buf_ptr, pt_ptr, k_ptr, v_ptr, k_ring, v_ring, full, empty, prefix_len, n_new, k_s0, qb, h, P, D,
                    PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF, PPI, PAIR, BLOCK_T, PROBE, CF, CKV)),
    ], [4, LOAD_WARPS], [ATT_REGS, LOAD_REGS])  # fmt: skip


# tiles: 32 chunk tokens x 4 heads = 128 rows, 8 pages of 16 = 128 prefix keys (and 128 chunk keys) per step
TUNING: dict[str, int] = {"BLOCK_T": 32, "PPI": 8, "OVERLAP": 1, "PAIR": 2, "PROBE": 0, "num_warps": 8,
                          "WS": 2, "SLOTS": 2, "LOAD_WARPS": 4, "LOAD_REGS": 136, "maxnreg": 168, "ATT_REGS": 184, "REV": 1, "CF": 1, "CKV": 0, "LAZY": 1,
                          "TREE": 1}  # fmt: skip
# WS 2 (the default): _gl_extend_pp_kernel, num_warps 8 = two consumer warpgroups (the kernel's own 4 warps and a
# partition of 4 with ATT_REGS) + the producer's LOAD_WARPS with LOAD_REGS: 168 * 12 = 4 x 136 + 8 x 184.
# WS 1: _gl_extend_ws_kernel, the kernel's 8 warps get what maxnreg * (num_warps + LOAD_WARPS) leaves
# (168 * 12 - 136 * 4 = 8 x 184). Compiled with triton 3.6 and PAIR 2: at 136 the producer's loop spills nothing
# (at 120 it spilled ~12 values a step). WS 0: _gl_extend_kernel (PAIR 1 there). CF (WS 2): the producer's lanes
# (cf_bases; CF 0: _pair_layout's, whose tile stores take two wavefronts per 8 lanes). CKV 1 (WS 2): the chunk's k, v
# read by the producer as the caller holds them (gluon_attend._pp_chunk_rows) instead of the wrapper's fp16 copies;
# slower than CKV 0 at 4-5 of the 6 bench shapes on an H200 (1-6%, docs/performance-log/kernels.md session 14), so not the default here
# (triaxial's, gluon_extend_tri, where it is 1-3% faster at 512 new tokens). LAZY 1 (WS 2): the consumers' lazy
# softmax (gluon_attend._softmax_lazy: acc *= alpha only in steps where a row's reference max moved); H200, session
# 15: 1-3% faster at all 6 bench shapes, same output to 4 digits (LAZY 0: the exact max every step). TREE 1 (the
# consumers' row max / sum as trees, gluon_attend._row_reduce): H200, session 16, faster than LAZY 1 alone at all 6 bench
# shapes (-0.8..-3.4%, both rows of each beside two default rows; docs/performance-log/kernels.md session 16).


def _launch_meta(cfg: dict[str, int]) -> tuple[Any, dict[str, Any]]:
    """(kernel, its tile constexprs and launch options) for a tuning."""
    meta: dict[str, Any] = dict(BLOCK_T=cfg["BLOCK_T"], PPI=cfg["PPI"], PAIR=cfg["PAIR"], num_warps=cfg["num_warps"])
    if cfg["WS"]:
        meta.update(SLOTS=cfg["SLOTS"], LOAD_WARPS=cfg["LOAD_WARPS"], LOAD_REGS=cfg["LOAD_REGS"], maxnreg=cfg["maxnreg"])
        if cfg["WS"] == 2:  # the kernel's own warps are the first consumer warpgroup
            meta.update(ATT_REGS=cfg["ATT_REGS"], REV=cfg["REV"], PROBE=cfg["PROBE"], CF=cfg["CF"], CKV=cfg["CKV"],
                        LAZY=cfg["LAZY"], TREE=cfg["TREE"], num_warps=cfg["num_warps"] // 2)
            return _gl_extend_pp_kernel, meta
        return _gl_extend_ws_kernel, meta
    meta.update(OVERLAP=cfg["OVERLAP"], PROBE=cfg["PROBE"])
    return _gl_extend_kernel, meta


def supported(kv: PagedKV, q: torch.Tensor) -> bool:
    """Calls this kernel runs: nvfp4 pages of 16 tokens, head_dim 128, 4 query heads per kv head, on a Hopper GPU
    (not the interpreter), with a V fold the chunk's fp16 probabilities can carry."""
    lay = kv.layout
    if lay.fmt != "nvfp4" or kv.triaxial or lay.page_size != 16 or lay.head_dim != 128 or q.shape[-1] != 128:
        return False
    if q.shape[1] != 4 * lay.kv_heads or q.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return folded_scales(kv)[1] >= VFOLD_MIN


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, prefix_pages: torch.Tensor,
                     prefix_len: int, *, sm_scale: float, tuning: dict[str, int] | None = None) -> torch.Tensor:  # fmt: skip
    """Launch the kernel (arguments checked by paged_ops; ``supported`` must hold) -> [n, Hq, D] in q.dtype."""
    if not supported(kv, q):
        raise ValueError("gluon_extend does not support this call (see gluon_extend.supported)")
    lay = kv.layout
    n, hq, d = q.shape
    h = lay.kv_heads
    q, out = launch_io(q)
    if n == 0:
        return out
    cfg = {**TUNING, **(tuning or {})}
    p = lay.page_size
    pages = launch_pages(prefix_pages[: triton.cdiv(prefix_len, p)], q.device)
    k_fold, v_fold = folded_scales(kv)
    k_mul_pre = sm_scale * LOG2E * k_fold
    ckv = cfg["WS"] == 2 and cfg["CKV"]
    k_in, v_in = chunk_rows(k, v) if ckv else chunk_kv(k, v)  # q is read as it is (the kernel scales and permutes it)
    a = field_offsets(lay)
    grid = (triton.cdiv(n, cfg["BLOCK_T"]), h)
    kernel, meta = _launch_meta(cfg)
    kernel[grid](
        q, k_in, v_in, out, kv.buffer, pages, n, prefix_len, k_mul_pre, sm_scale * LOG2E / k_mul_pre, 1.0 / v_fold,
        q.stride(0), q.stride(1), k_in.stride(0), out.stride(0), out.stride(1),
        G=hq // h, D=d, P=p, PAGE_BYTES=a[0], K_OFF=a[1], KS_OFF=a[2], V_OFF=a[4], VS_OFF=a[5], **meta,
    )  # fmt: skip
    return out


def compile_report_args(*, tuning: dict[str, int] | None = None) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """(kernel, signature, constexprs incl. num_warps and for WS maxnreg) to compile the extend kernel for sm_90
    without a GPU at the bench's shape (32 q / 8 kv heads, d 128, nvfp4 pages of 16), e.g. with
    compile_report.report(..., gluon=True)."""
    cfg = {**TUNING, **(tuning or {})}
    lay = PageLayout.build("nvfp4", page_size=16, kv_heads=8, head_dim=128)
    a = field_offsets(lay)
    sig = {"q_ptr": "*bf16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*bf16", "buf_ptr": "*u8", "pt_ptr": "*i32",
           "n_new": "i32", "prefix_len": "i32", "q_mul": "fp32", "k_mul_new": "fp32", "v_div": "fp32", "q_s0": "i32",
           "q_s1": "i32", "k_s0": "i32", "o_s0": "i32", "o_s1": "i32"}  # fmt: skip
    kernel, meta = _launch_meta(cfg)
    const: dict[str, Any] = dict(G=4, D=128, P=16, PAGE_BYTES=a[0], K_OFF=a[1], KS_OFF=a[2], V_OFF=a[4], VS_OFF=a[5],
                                 **meta)  # fmt: skip
    return kernel, sig, const
