"""Gluon extend (chunked-prefill) attention on nvfp4 pages for Hopper: unpacking overlapped with ``wgmma``.

Same problem as ``triton_prefill._extend_kernel4`` (a chunk of new tokens against
the packed cached prefix plus itself, causal, one online softmax); this kernel
takes the unpacking off the attending warps' path, which is what binds the
``tl`` kernel (unpack, wgmma and softmax run one after the other there).

One program = BLOCK_T chunk tokens x the G query heads of one kv head (M =
BLOCK_T * G = 128 rows), N = PPI * P = 128 prefix keys per step. Three
partitions share a ring of SLOTS K / V tile pairs in shared memory
(NVMMA-swizzled, fp16; ``gluon_attend._ring``):

    producer (LOAD_WARPS warps, LOAD_REGS registers after setmaxnreg): loads step i+1's packed bytes and step
        i+2's page ids while it unpacks step i into slot i % SLOTS, fences, arrives on ``full``; after the prefix
        it stages the chunk's own keys into the ring the same way (``gluon_attend._pp_chunk``)
    consumer 0 / 1 (one warpgroup of 4 warps each, half the rows and its own q tile): waits on ``full``, runs
        S = q K^T, the online softmax and PV by wgmma, releases the slot on ``empty`` (which counts both)

No barrier joins the two consumers, so one's softmax runs while the other's
wgmma does (letting them drift is faster than making them take turns at the
tensor core through named barriers, FlashAttention-3's ping-pong). The chunk
blocks run last-first (the blocks with the most causal keys first: a shorter
tail). The consumers use the lazy softmax on full prefix steps and reduce each
row's max / sum as trees (``gluon_attend._softmax_lazy``, ``_row_reduce``).

Channels stay in the four quarters of ``triton_prefill._extend_kernel4`` (quarter k = channels
4j + k, what one shift of the packed 16-bit words gives): the unpacked K / V
tiles are [N, D] with the quarters side by side (column k * D/4 + j), q is
read as the caller holds it and put in the same order by the kernel, and the
output is un-permuted at the store. The chunk's own k, v come as fp16
quarter-major copies made by the wrapper (``gluon_attend.chunk_kv``). The
producer's rows sit in lanes that make its 16-byte tile stores free of bank
conflicts (``cf_bases``).

Supported (``supported``): nvfp4 pages, head_dim 128, page size 16, 4 query
heads per kv head, a V fold (global scale times 2^7) of at least VFOLD_MIN; the
PTX unpackers and ``wgmma`` need a Hopper GPU, so the interpreter and other
calls run ``triton_prefill``. ``tests/kernels/test_gluon_extend.py`` compiles the
kernel for sm_90 on CPU and the gpu tests hold it to fp64 attention.

Triaxial pages (INT4 + INT2, pages of 32) run the same schedule with another
producer: ``gluon_extend_tri`` (the consumers ``_pp_attend`` and the chunk's
staging live in ``gluon_attend``, shared by both).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .capability import device_choice
from .gluon_attend import _as_type, _cta_barrier, _pp_attend, _pp_chunk_any, _pp_setup, chunk_kv, launch_io, launch_pages
from .layout import PageLayout
from .paged_kv import PagedKV
from .triton_codec import asm_e2m1_pair
from .triton_common import LOG2E, VFOLD_MIN, field_offsets, folded_scales

ASM_E2M1_PAIR_H: gl.constexpr = gl.constexpr(asm_e2m1_pair(half_scale=True))


@gluon.constexpr_function
def cf_bases(w: int, n: int, per_thread: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(register, lane, warp) bases of an [n, 4 * per_thread] layout with per_thread consecutive columns a thread
    and 4 threads a row, but lanes 4-7 of each 8 take the row 4 below lanes 0-3's instead of the next one (lane
    bits: 2 column, then rows +4, +1, +2).

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
    """The layout of cf_bases."""
    reg, lane, warp = cf_bases(w, n, per_thread)
    return gl.DistributedLinearLayout(reg, lane, warp, [], [n, 4 * per_thread])


@gluon.constexpr_function
def _pair_layout_cf(w: int, n: int) -> Any:
    """[n rows, D/8 word pairs] of packed int32 (two 16-bit words each): 4 pairs (16 bytes) per thread, 4 threads
    a row, in the lanes of _cf_layout (conflict-free tile stores)."""
    return _cf_layout(w, n, 4)


@gluon.constexpr_function
def _scale_layout_cf(w: int, n: int) -> Any:
    """[n rows, D/16 block scales]: the 2 blocks of a thread's 4 word pairs, the rows of _pair_layout_cf."""
    return _cf_layout(w, n, 2)


@gluon.jit
def _page_ids(pt_ptr, it, page_hi, N: gl.constexpr, P: gl.constexpr):
    """Page id of each of the N key rows of the step at list index ``it`` (0 past page_hi), in the rows' layout of
    _pair_layout_cf: loaded a step before the bytes, so that their addresses do not wait for it."""
    n = gl.arange(0, N, layout=gl.SliceLayout(1, _pair_layout_cf(gl.num_warps(), N)))
    pidx = it + n // P
    return gl.load(pt_ptr + pidx, mask=pidx < page_hi, other=0)


@gluon.jit
def _load_raw(buf_ptr, pid, it, prefix_len, h, N: gl.constexpr, P: gl.constexpr, D: gl.constexpr,
              PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr,
              VS_OFF: gl.constexpr):  # fmt: skip
    """The packed bytes of the step at list index ``it`` (pid: its rows' page ids): K and V words as int32 pairs
    [N, D/8] (half the registers of int16 elements, which take one each), K and V block scales [N, D/16] (uint8),
    in _pair_layout_cf's rows; keys past prefix_len read 0 (codes and scales 0: the tile is 0, so a masked key's
    probability 0 never meets a NaN that the unwritten slots of a partial page may hold)."""
    W: gl.constexpr = gl.num_warps()
    LW: gl.constexpr = _pair_layout_cf(W, N)
    LS: gl.constexpr = _scale_layout_cf(W, N)
    Q: gl.constexpr = D // 4
    n = gl.arange(0, N, layout=gl.SliceLayout(1, LW))
    inb = it * P + n < prefix_len
    page = gl.convert_layout(pid, gl.SliceLayout(1, LW)).to(gl.int64) * PAGE_BYTES
    hrow = h * P + n % P  # row inside a [H, P, ...] field
    m = inb[:, None]
    j = gl.arange(0, Q // 2, layout=gl.SliceLayout(0, LW))[None, :]
    wp = (buf_ptr + (page + hrow * (D // 2))[:, None]).to(gl.pointer_type(gl.int32), bitcast=True) + j
    kw = gl.load(wp + K_OFF // 4, mask=m, other=0)
    vw = gl.load(wp + V_OFF // 4, mask=m, other=0)
    SL: gl.constexpr = gl.SliceLayout(1, LS)
    srow = gl.convert_layout(page, SL) + gl.convert_layout(hrow, SL) * (D // 16)
    sok = gl.convert_layout(inb, SL)[:, None]
    sp = buf_ptr + srow[:, None] + gl.arange(0, D // 16, layout=gl.SliceLayout(0, LS))[None, :]
    ks = gl.load(sp + KS_OFF, mask=sok, other=0)
    vs = gl.load(sp + VS_OFF, mask=sok, other=0)
    return kw, vw, ks, vs


@gluon.jit
def _unpack(w, s, dst):
    """Packed nvfp4 word pairs [N, D/8] and their block scales [N, D/16] -> fp16 e2m1 * s * 2^-7 ... * 2^7 =
    e2m1 * s, quarters side by side ([N, D], column k * D/4 + j = channel 4j + k), stored into the shared tile
    ``dst`` through an int32 view (quarters as f16x2 int32)."""
    N: gl.constexpr = w.shape[0]
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


@gluon.jit
def _load_prefix(buf_ptr, pt_ptr, k_ring, v_ring, full, empty, prefix_len, h, P: gl.constexpr, D: gl.constexpr,
                 PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr,
                 VS_OFF: gl.constexpr, PPI: gl.constexpr):  # fmt: skip
    """The producer's prefix: loads and unpacks step i into ring slot i % SLOTS once the consumers released it
    (``empty``), then signals ``full``; step i+1's bytes and step i+2's page ids are in flight meanwhile."""
    N: gl.constexpr = PPI * P
    SLOTS: gl.constexpr = k_ring.shape[0]
    num_pages = gl.cdiv(prefix_len, P)
    steps = gl.cdiv(num_pages, PPI)
    pid = _page_ids(pt_ptr, 0, num_pages, N, P)
    kw, vw, ks, vs = _load_raw(buf_ptr, pid, 0, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF)
    pid = _page_ids(pt_ptr, PPI, num_pages, N, P)
    for i in range(steps):
        slot = i % SLOTS
        nkw, nvw, nks, nvs = _load_raw(buf_ptr, pid, (i + 1) * PPI, prefix_len, h, N, P, D, PAGE_BYTES, K_OFF, KS_OFF,
                                       V_OFF, VS_OFF)  # fmt: skip
        pid = _page_ids(pt_ptr, (i + 2) * PPI, num_pages, N, P)
        mbarrier.wait(empty.index(slot), ((i // SLOTS) & 1) ^ 1)  # a fresh mbarrier counts as released once
        _unpack(kw, ks, k_ring.index(slot))
        _unpack(vw, vs, v_ring.index(slot))
        fence_async_shared()
        _cta_barrier()  # the partition's stores are done: its thread 0 arrives for all
        mbarrier.arrive(full.index(slot), count=1)
        kw, vw, ks, vs = nkw, nvw, nks, nvs


@gluon.jit
def _pp_load(buf_ptr, pt_ptr, k_ptr, v_ptr, k_ring, v_ring, full, empty, prefix_len, n_new, k_s0, qb, h, P: gl.constexpr,
             D: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr, KS_OFF: gl.constexpr, V_OFF: gl.constexpr,
             VS_OFF: gl.constexpr, PPI: gl.constexpr, BLOCK_T: gl.constexpr):  # fmt: skip
    """Producer partition: the prefix (_load_prefix), then the chunk's own keys from the wrapper's fp16 copies
    (``gluon_attend._pp_chunk``) into the same ring."""
    _load_prefix(buf_ptr, pt_ptr, k_ring, v_ring, full, empty, prefix_len, h, P, D, PAGE_BYTES, K_OFF, KS_OFF, V_OFF,
                 VS_OFF, PPI)  # fmt: skip
    first = gl.cdiv(gl.cdiv(prefix_len, P), PPI)
    _pp_chunk_any(k_ptr, v_ptr, k_ring, v_ring, full, empty, first, n_new, k_s0, qb, h, D, BLOCK_T, 0)


@gluon.jit
def _gl_extend_kernel(
    q_ptr,  # [n, Hq, D]: the chunk's queries (strides q_s0, q_s1, 1), any float dtype
    k_ptr, v_ptr,  # [n, H, 4, D/4] fp16: the chunk's own K / V, quarter-major (chunk_kv)
    o_ptr,  # [n, Hq, D] output (strides o_s0, o_s1, 1)
    buf_ptr, pt_ptr,  # uint8 layer buffer, int32 prefix page ids
    n_new, prefix_len,
    q_mul,  # fp32: the prefix's score multiplier (sm_scale * log2(e) * K's fold), applied to q as it is loaded
    k_mul_new,  # fp32: the chunk's score multiplier relative to q's
    v_div,  # fp32: 1 / (V fold): the chunk's P is scaled by it, the output by its inverse
    q_s0, q_s1, k_s0, o_s0, o_s1,
    G: gl.constexpr, D: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr, K_OFF: gl.constexpr,
    KS_OFF: gl.constexpr, V_OFF: gl.constexpr, VS_OFF: gl.constexpr, BLOCK_T: gl.constexpr, PPI: gl.constexpr,
    SLOTS: gl.constexpr,  # K / V tile pairs in the ring
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,  # the producer partition
    ATT_REGS: gl.constexpr,  # the second warpgroup's registers (the first, the kernel's own 4 warps, gets the rest)
):  # fmt: skip
    """The producer and the two consumer warpgroups (module docstring). The kernel's num_warps is the first
    warpgroup's (4)."""
    H2: gl.constexpr = BLOCK_T * G // 2
    qb, h, q_0, q_1, k_ring, v_ring, full, empty = _pp_setup(q_ptr, n_new, q_s0, q_s1, q_mul, G, D, P, PPI, BLOCK_T, SLOTS)
    gl.warp_specialize([
        (_pp_attend, (q_0, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h, 0,
                      G, D, P, PPI, BLOCK_T, 1, 1)),
        (_pp_attend, (q_1, k_ring, v_ring, full, empty, o_ptr, prefix_len, n_new, k_mul_new, v_div, o_s0, o_s1, qb, h, H2,
                      G, D, P, PPI, BLOCK_T, 1, 1)),
        (_pp_load, (buf_ptr, pt_ptr, k_ptr, v_ptr, k_ring, v_ring, full, empty, prefix_len, n_new, k_s0, qb, h, P, D,
                    PAGE_BYTES, K_OFF, KS_OFF, V_OFF, VS_OFF, PPI, BLOCK_T)),
    ], [4, LOAD_WARPS], [ATT_REGS, LOAD_REGS])  # fmt: skip


# 32 chunk tokens x 4 heads = 128 rows, 8 pages of 16 = 128 prefix keys (and 128 chunk keys) per step; the
# registers split 168 * 12 = 4 x 136 (producer: its loop spills nothing at 136) + 8 x 184 (the two consumers)
TUNING: dict[str, int] = {"BLOCK_T": 32, "PPI": 8, "num_warps": 8, "SLOTS": 2, "LOAD_WARPS": 4, "LOAD_REGS": 136,
                          "maxnreg": 168, "ATT_REGS": 184}  # fmt: skip


def _launch_meta(cfg: dict[str, int]) -> dict[str, Any]:
    """The kernel's tile constexprs and launch options for a tuning (num_warps: the first consumer warpgroup's)."""
    return dict(BLOCK_T=cfg["BLOCK_T"], PPI=cfg["PPI"], SLOTS=cfg["SLOTS"], LOAD_WARPS=cfg["LOAD_WARPS"],
                LOAD_REGS=cfg["LOAD_REGS"], ATT_REGS=cfg["ATT_REGS"], maxnreg=cfg["maxnreg"],
                num_warps=cfg["num_warps"] // 2)  # fmt: skip


def supported(kv: PagedKV, q: torch.Tensor) -> bool:
    """Calls this kernel runs: nvfp4 pages of 16 tokens, head_dim 128, 4 query heads per kv head, on a Hopper GPU
    (not the interpreter), with a V fold the chunk's fp16 probabilities can carry."""
    lay = kv.layout
    if lay.fmt != "nvfp4" or kv.triaxial or lay.page_size != 16 or lay.head_dim != 128 or q.shape[-1] != 128:
        return False
    if q.shape[1] != 4 * lay.kv_heads or q.device.type != "cuda":
        return False
    if device_choice(q.device).extend != "gluon":  # capability.TABLE: wgmma is Hopper's
        return False
    return folded_scales(kv)[1] >= VFOLD_MIN


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: PagedKV, prefix_pages: torch.Tensor,
                     prefix_len: int, *, sm_scale: float) -> torch.Tensor:  # fmt: skip
    """Launch the kernel (arguments checked by paged_ops; ``supported`` must hold) -> [n, Hq, D] in q.dtype."""
    if not supported(kv, q):
        raise ValueError("gluon_extend does not support this call (see gluon_extend.supported)")
    lay = kv.layout
    n, hq, d = q.shape
    h = lay.kv_heads
    q, out = launch_io(q)
    if n == 0:
        return out
    p = lay.page_size
    pages = launch_pages(prefix_pages[: triton.cdiv(prefix_len, p)], q.device)
    k_fold, v_fold = folded_scales(kv)
    k_mul_pre = sm_scale * LOG2E * k_fold
    k_in, v_in = chunk_kv(k, v)  # q is read as it is (the kernel scales and permutes it)
    a = field_offsets(lay, stride=kv.page_stride)
    grid = (triton.cdiv(n, TUNING["BLOCK_T"]), h)
    _gl_extend_kernel[grid](
        q, k_in, v_in, out, kv.base, pages, n, prefix_len, k_mul_pre, sm_scale * LOG2E / k_mul_pre, 1.0 / v_fold,
        q.stride(0), q.stride(1), k_in.stride(0), out.stride(0), out.stride(1),
        G=hq // h, D=d, P=p, PAGE_BYTES=a[0], K_OFF=a[1], KS_OFF=a[2], V_OFF=a[4], VS_OFF=a[5], **_launch_meta(TUNING),
    )  # fmt: skip
    return out


def compile_report_args() -> tuple[Any, dict[str, str], dict[str, Any]]:
    """(kernel, signature, constexprs incl. num_warps and maxnreg) to compile the extend kernel for sm_90 without a
    GPU at the bench's shape (32 q / 8 kv heads, d 128, nvfp4 pages of 16), e.g. with
    compile_report.report(..., gluon=True)."""
    lay = PageLayout.build("nvfp4", page_size=16, kv_heads=8, head_dim=128)
    a = field_offsets(lay)
    sig = {"q_ptr": "*bf16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*bf16", "buf_ptr": "*u8", "pt_ptr": "*i32",
           "n_new": "i32", "prefix_len": "i32", "q_mul": "fp32", "k_mul_new": "fp32", "v_div": "fp32", "q_s0": "i32",
           "q_s1": "i32", "k_s0": "i32", "o_s0": "i32", "o_s1": "i32"}  # fmt: skip
    const: dict[str, Any] = dict(G=4, D=128, P=16, PAGE_BYTES=a[0], K_OFF=a[1], KS_OFF=a[2], V_OFF=a[4], VS_OFF=a[5],
                                 **_launch_meta(TUNING))  # fmt: skip
    return _gl_extend_kernel, sig, const
