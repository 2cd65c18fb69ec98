"""What the Gluon extend kernels share: the q tile, the consumer warpgroups and the chunk's staging.

``gluon_extend`` (nvfp4 pages) and ``gluon_extend_tri`` (triaxial pages) run the
same warp-specialized schedule (``gluon_extend`` module docstring): a producer partition
fills a ring of fp16 K / V tiles (channels quarter-major: column k * D/4 + j =
channel 4j + k) and signals ``full``; two consumer warpgroups (``_pp_attend``)
each run S = q K^T, the online softmax and PV by ``wgmma`` on their half of
the rows and release the slot on ``empty``. What differs between the formats
is only the producer's prefix; the chunk's own keys are staged the same way
(``_pp_chunk``). Everything here is device code of those kernels, but for what
both launches prepare on the host: q and the output (``launch_io``), the
chunk's k, v in that layout (``chunk_kv``) and the page-id list the kernel
reads (``launch_pages``). ``_cta_barrier``, ``_as_type`` and ``_row_major_shared`` serve the Gluon decode and its
merge too.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import shared_memory_descriptor
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from .gluon_fragments import cp_async, rescale, warp_any

# LAZY: a row's reference max moves only when the step's max passes it by more than TAU (base 2; decode's TAU)
TAU: gl.constexpr = gl.constexpr(8.0)


def chunk_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's k, v [n, H, D] as fp16 quarter-major [n, H, 4, D/4] (channel 4j + i at i * D/4 + j: the ring's
    column order), one copy each."""
    n, h, d = k.shape
    k_in = torch.empty((n, h, 4, d // 4), dtype=torch.float16, device=k.device)
    k_in.copy_(k.view(n, h, d // 4, 4).transpose(2, 3))
    v_in = torch.empty_like(k_in)
    v_in.copy_(v.view(n, h, d // 4, 4).transpose(2, 3))
    return k_in, v_in


def chunk_rows(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's k, v [n, H, D] for a kernel that reads them as they are (_pp_chunk_rows): heads and channels
    packed (strides D, 1) and one token stride for both; no copy when they already are (rows of one projection
    output, or contiguous tensors), else contiguous copies."""
    n, h, d = k.shape

    def packed(x: torch.Tensor) -> bool:
        return (d == 1 or x.stride(2) == 1) and (h == 1 or x.stride(1) == d)

    if packed(k) and packed(v) and (n <= 1 or k.stride(0) == v.stride(0)):
        return k, v
    return k.contiguous(), v.contiguous()


def launch_io(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q with its channels at unit stride (the kernel reads them so), and the output [n, Hq, D] in q's dtype, its
    channels at unit stride too."""
    out = torch.empty_like(q)
    if out.stride(2) != 1:
        out = out.contiguous()
    if q.stride(2) != 1:
        q = q.contiguous()
    return q, out


def launch_pages(pages: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The prefix's page ids as the kernel reads them: contiguous, or one id never read (an empty prefix) so that
    the pointer is valid on ``device``."""
    pages = pages.contiguous()
    if pages.numel() == 0:
        pages = torch.zeros(1, dtype=torch.int32, device=device)
    return pages


# CTA barrier: `thread_barrier` in triton 3.6 (the device), `barrier` by 3.9 (CI)
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.constexpr_function
def _row_layout(w: int) -> Any:
    """[rows, D] fp16 rows (q, the chunk's K / V, the output): 8 channels (16 bytes) per thread."""
    return gl.BlockedLayout([1, 8], [2, 16], [w, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(w: int, n: int) -> Any:
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[w, 1], instr_shape=[16, n, 16])


@gluon.jit
def _row_coords(qb, h, M: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BLOCK_T: gl.constexpr, R0: gl.constexpr = 0):
    """Row r of an [M, D] tile in _row_layout (the program's rows R0 ..) is chunk token qb * BLOCK_T + (R0 + r) // G
    and query head h * G + (R0 + r) % G -> (tok [M], qh [M], channel c [1, D])."""
    LR: gl.constexpr = _row_layout(gl.num_warps())
    r = R0 + gl.arange(0, M, layout=gl.SliceLayout(1, LR))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, LR))[None, :]
    return qb * BLOCK_T + r // G, h * G + r % G, c


@gluon.jit
def _load_q(q_ptr, n_new, q_s0, q_s1, q_mul, qb, h, G: gl.constexpr, D: gl.constexpr, BLOCK_T: gl.constexpr,
            R0: gl.constexpr = 0, ROWS: gl.constexpr = 0):  # fmt: skip
    """The program's queries, rows R0 .. R0 + ROWS (0: all BLOCK_T * G), times q_mul (the prefix's score multiplier),
    in fp16 with the channels quarter-major (channel 4j + k at column k * D/4 + j, as the unpacked tiles), rows past
    the chunk 0 -> a shared [M, D] tile, the A operand of every S. Read from the caller's q as it is (any float
    dtype): no copy of q before the launch."""
    M: gl.constexpr = ROWS if ROWS else BLOCK_T * G
    tok, qh, c = _row_coords(qb, h, M, G, D, BLOCK_T, R0)
    x = gl.load(q_ptr + tok[:, None].to(gl.int64) * q_s0 + qh[:, None] * q_s1 + c, mask=(tok < n_new)[:, None], other=0.0)
    x = (x.to(gl.float32) * q_mul).to(gl.float16)
    x = gl.reshape(gl.permute(gl.reshape(x, [M, D // 4, 4]), [0, 2, 1]), [M, D])  # [M, j, k] -> [M, k, j]
    return gl.allocate_shared_memory(gl.float16, [M, D], gl.NVMMASharedLayout.get_default_for([M, D], gl.float16), x)


@gluon.jit
def _as_type_36(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _as_type_39(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return smem.reinterpret(dtype, shape, layout)


# a shared tile viewed as another type: `_reinterpret` in triton 3.6 (the device), `reinterpret` by 3.9 (CI)
_as_type = _as_type_39 if hasattr(shared_memory_descriptor, "reinterpret") else _as_type_36


@gluon.constexpr_function
def _row_major_shared(rank: int) -> Any:
    """Plain row-major shared layout of rank dims, unswizzled: the threads that read a slot wrote it in the same layout
    (the decode's staging rings, the merge's weights)."""
    return gl.SwizzledSharedLayout(1, 1, 1, list(range(rank - 1, -1, -1)))


@gluon.jit
def _reduce(x, axis: gl.constexpr, MAX: gl.constexpr):
    """max (MAX) or sum of x along ``axis``."""
    if MAX:
        return gl.max(x, axis=axis)
    else:
        return gl.sum(x, axis=axis)


@gluon.jit
def _halve(x, MAX: gl.constexpr):
    """[M, C] -> [M, C/2]: column c combined with column c + C/2 (max or sum), one independent op per pair."""
    return _reduce(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), 1, MAX)


@gluon.jit
def _row_reduce(x, MAX: gl.constexpr, TREE: gl.constexpr):
    """max (MAX) or sum over a [M, N] wgmma tile's rows. TREE 1: the thread's 32 values of a row as a tree, 4
    halvings of the columns (bits 64 .. 8: registers of the wgmma layout) then 2 values in the thread and the lanes'
    shuffles, a dependent chain of 5 + 2 instead of Triton's serial 31 + 2 (the sum reassociated, the same adds)."""
    if TREE:
        r = _reduce(_halve(_halve(_halve(_halve(x, MAX), MAX), MAX), MAX), 1, MAX)
        return gl.convert_layout(r, gl.SliceLayout(1, x.type.layout))
    else:
        return _reduce(x, 1, MAX)


@gluon.jit
def _softmax(s, m_i, l_i, acc, MASKED: gl.constexpr, TREE: gl.constexpr = 0):
    """One online-softmax step (base 2) on scores s [M, N] (masked entries -inf) -> (P fp16, m, l, acc * alpha)."""
    m_new = gl.maximum(m_i, _row_reduce(s, True, TREE))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + _row_reduce(p, False, TREE)
    return p, m_new, l_i, acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _softmax_lazy(s, m_i, l_i, acc, TREE: gl.constexpr = 0):
    """_softmax on an unmasked step, with a reference max m_i that moves only where the step's row max
    passes it by more than TAU (then to that max): p = 2^(s - m_i) <= 2^TAU stays exact enough in fp16, and in most
    steps no row of a warp moves, so ``acc *= alpha`` (64 multiplies a thread) sits behind one warp-uniform branch
    (gluon_fragments.rescale, as the decode kernel's lazy softmax). TREE: the row max and sum as trees (_row_reduce)."""
    top = _row_reduce(s, True, TREE)
    grow = top > m_i + TAU  # m_i = -inf at the first step: every row moves
    m_new = gl.where(grow, top, m_i)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + _row_reduce(p, False, TREE)
    SA: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    moved = warp_any(gl.convert_layout(grow.to(gl.int32), SA), 2)
    acc = rescale(acc, gl.convert_layout(alpha, SA)[:, None], moved[:, None], 32)
    return p, m_new, l_i, acc


@gluon.jit
def _pp_chunk(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D: gl.constexpr,
              BLOCK_T: gl.constexpr):  # fmt: skip
    """The end of a producer (any page format): the chunk's own keys up to the program's last token (fp16
    quarter-major rows, cp.async into the slot, rows past the chunk zero-filled), N per step, into the ring after the
    ``first`` steps the prefix took."""
    N: gl.constexpr = k_ring.shape[1]
    SLOTS: gl.constexpr = k_ring.shape[0]
    LR: gl.constexpr = _row_layout(gl.num_warps())
    jr = gl.arange(0, N, layout=gl.SliceLayout(1, LR))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, LR))[None, :]
    hi = gl.minimum(n_new, (qb + 1) * BLOCK_T)
    for j0 in range(0, hi, N):
        i = first + j0 // N
        slot = i % SLOTS
        j = j0 + jr
        off = j[:, None].to(gl.int64) * k_s0 + h * D + c
        jm = (j < n_new)[:, None]
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)
        cp_async(k_ring.index(slot), k_ptr + off, mask=jm)
        cp_async(v_ring.index(slot), v_ptr + off, mask=jm)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(full.index(slot), count=1)


@gluon.jit
def _chunk_tile(ptr, s0, j, h, mask, D: gl.constexpr):
    """Rows j [N] of head h of a chunk k or v [n, H, D] as the caller holds it (any float dtype, token stride s0, head
    stride D, unit channel stride: chunk_rows), rows outside ``mask`` 0 -> fp16 [N, D] with the channels
    quarter-major (as _load_q puts q)."""
    N: gl.constexpr = j.shape[0]
    c = gl.arange(0, D, layout=gl.SliceLayout(0, _row_layout(gl.num_warps())))[None, :]
    x = gl.load(ptr + j[:, None].to(gl.int64) * s0 + h * D + c, mask=mask, other=0.0).to(gl.float16)
    return gl.reshape(gl.permute(gl.reshape(x, [N, D // 4, 4]), [0, 2, 1]), [N, D])  # [N, j, k] -> [N, k, j]


@gluon.jit
def _pp_chunk_rows(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D: gl.constexpr,
                   BLOCK_T: gl.constexpr):  # fmt: skip
    """_pp_chunk reading the chunk's k, v as the caller holds them (chunk_rows: one token stride k_s0 for
    both): through registers (fp16, channels permuted) into the slot, so the wrapper copies neither (chunk_kv: two
    kernels and a read and write of k and v per call)."""
    N: gl.constexpr = k_ring.shape[1]
    SLOTS: gl.constexpr = k_ring.shape[0]
    jr = gl.arange(0, N, layout=gl.SliceLayout(1, _row_layout(gl.num_warps())))
    hi = gl.minimum(n_new, (qb + 1) * BLOCK_T)
    for j0 in range(0, hi, N):
        i = first + j0 // N
        slot = i % SLOTS
        j = j0 + jr
        jm = (j < n_new)[:, None]
        kt = _chunk_tile(k_ptr, k_s0, j, h, jm, D)  # issued before the wait: in flight while the slot drains
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)
        k_ring.index(slot).store(kt)
        v_ring.index(slot).store(_chunk_tile(v_ptr, k_s0, j, h, jm, D))
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(full.index(slot), count=1)


@gluon.jit
def _pp_setup(
    q_ptr,
    n_new,
    q_s0,
    q_s1,
    q_mul,
    G: gl.constexpr,
    D: gl.constexpr,
    P: gl.constexpr,
    PPI: gl.constexpr,
    BLOCK_T: gl.constexpr,
    SLOTS: gl.constexpr,
):
    """The extend kernels' preamble (nvfp4 and triaxial producers alike): the program's chunk block ``qb`` (the
    last block first: it has the most causal keys, so the grid's tail is shorter) and KV head ``h``, each warpgroup's q tile (half the rows each), the K / V rings of SLOTS steps of
    PPI pages and their ``full`` / ``empty`` barriers (``empty`` counts the two consumers), initialised and fenced."""
    M: gl.constexpr = BLOCK_T * G
    H2: gl.constexpr = M // 2
    N: gl.constexpr = PPI * P
    qb = gl.num_programs(0) - 1 - gl.program_id(0)
    h = gl.program_id(1)
    q_0 = _load_q(q_ptr, n_new, q_s0, q_s1, q_mul, qb, h, G, D, BLOCK_T, 0, H2)
    q_1 = _load_q(q_ptr, n_new, q_s0, q_s1, q_mul, qb, h, G, D, BLOCK_T, H2, H2)
    k_ring, v_ring, full, empty = _ring(N, D, SLOTS, 2)
    return qb, h, q_0, q_1, k_ring, v_ring, full, empty


@gluon.jit
def _ring(N: gl.constexpr, D: gl.constexpr, SLOTS: gl.constexpr, CONSUMERS: gl.constexpr):
    """The extend kernels' ring: SLOTS K / V tile pairs [N, D] fp16 in shared memory and their mbarriers,
    ``full`` (the producer's arrival) and ``empty`` (counting the CONSUMERS that release a slot), initialised and
    fenced for the async proxy and the CTA."""
    TILE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, D], gl.float16)
    k_ring = gl.allocate_shared_memory(gl.float16, [SLOTS, N, D], TILE)
    v_ring = gl.allocate_shared_memory(gl.float16, [SLOTS, N, D], TILE)
    full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(SLOTS):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(empty.index(j), count=CONSUMERS)
    fence_async_shared()
    _cta_barrier()
    return k_ring, v_ring, full, empty


@gluon.jit
def _pp_chunk_any(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D: gl.constexpr,
                  BLOCK_T: gl.constexpr, CKV: gl.constexpr):  # fmt: skip
    """The chunk's keys into the ring: CKV 1 reads them as the caller holds them (_pp_chunk_rows: the triaxial
    kernel), 0 from the wrapper's fp16 quarter-major copies (_pp_chunk: the nvfp4 kernel)."""
    if CKV:
        _pp_chunk_rows(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D, BLOCK_T)
    else:
        _pp_chunk(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D, BLOCK_T)


@gluon.jit
def _pp_attend(q_smem, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h,
               R0: gl.constexpr, G: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PPI: gl.constexpr,
               BLOCK_T: gl.constexpr, LAZY: gl.constexpr = 0, TREE: gl.constexpr = 0):  # fmt: skip
    """Consumer partition: one warpgroup, the program's rows R0 .. R0 + M (its own q tile): prefix steps, then the chunk's
    (causal), all from the ring; releases each slot for itself (``empty`` counts both warpgroups), so neither waits
    for the other's softmax; then its rows of the output. LAZY: the lazy softmax on full prefix steps
    (_softmax_lazy); TREE: row max / sum as trees (every step). The nvfp4 kernel runs both, the triaxial one
    neither (they do not pay there)."""
    W: gl.constexpr = gl.num_warps()
    M: gl.constexpr = q_smem.shape[0]
    N: gl.constexpr = PPI * P
    SLOTS: gl.constexpr = k_ring.shape[0]
    MMA: gl.constexpr = _mma_layout(W, N)
    MMA_O: gl.constexpr = _mma_layout(W, D)
    A_P: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([M, D], gl.float32, layout=MMA_O)
    s0 = gl.zeros([M, N], gl.float32, layout=MMA)
    key = gl.arange(0, N, layout=gl.SliceLayout(0, MMA))[None, :]
    tok_s = (qb * BLOCK_T + (R0 + gl.arange(0, M, layout=gl.SliceLayout(1, MMA))) // G)[:, None]
    first = gl.cdiv(gl.cdiv(prefix_len, P), PPI)
    steps = first + gl.cdiv(gl.minimum(n_new, (qb + 1) * BLOCK_T), N)
    for i in range(steps):
        slot = i % SLOTS
        mbarrier.wait(full.index(slot), (i // SLOTS) & 1)
        s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s0, use_acc=False)
        if i >= first:  # the chunk's own keys j0 ..: causal, their own score multiplier and V fold
            j = (i - first) * N + key
            s = gl.where((j <= tok_s) & (j < n_new), s * k_mul_new, float("-inf"))
            p, m_new, l_i, acc = _softmax(s, m_i, l_i, acc, True, TREE)
            p = p * v_div
        elif (i + 1) * N > prefix_len:  # the last prefix step may end inside a page
            s = gl.where(i * N + key < prefix_len, s, float("-inf"))
            p, m_new, l_i, acc = _softmax(s, m_i, l_i, acc, True, TREE)
        elif LAZY:  # the full prefix steps (the chunk's keep the exact max: p <= 1 there, p * v_div in fp16)
            p, m_new, l_i, acc = _softmax_lazy(s, m_i, l_i, acc, TREE)
        else:
            p, m_new, l_i, acc = _softmax(s, m_i, l_i, acc, False, TREE)
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.float16), A_P), v_ring.index(slot), acc)
        m_i = m_new
        _cta_barrier()  # this warpgroup is done reading the slot: its thread 0 releases it
        mbarrier.arrive(empty.index(slot), count=1)
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, MMA_O))
    out = gl.convert_layout(acc * (1.0 / (gl.where(l_o > 0, l_o, 1.0) * v_div))[:, None], _row_layout(W))
    tok, qh, c = _row_coords(qb, h, M, G, D, BLOCK_T, R0)
    ch = 4 * (c % (D // 4)) + c // (D // 4)  # column k * D/4 + j holds channel 4j + k
    gl.store(o_ptr + tok[:, None].to(gl.int64) * o_s0 + qh[:, None] * o_s1 + ch, out.to(o_ptr.dtype.element_ty),
             mask=(tok < n_new)[:, None])  # fmt: skip
