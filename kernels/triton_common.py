"""What the Triton and Gluon kernels share: format codes, field offsets, the split-K planner, launch preamble and merge.

Both decode kernels (``triton_decode``'s ``tl`` kernel and ``gluon_decode``)
are Flash-Decoding split-K: a grid of (split, kv head, sequence) programs
writes each split's normalised partial output and base-2 log-sum-exp, and
``_merge_kernel`` combines the splits::

    o[B, Hq, S, D] fp32, lse[B, Hq, S] fp32  --merge-->  out[B, Hq, D] (q's dtype) * v_mul

``prepare_splits`` is the host side both run before their launch (plan,
contiguous inputs, partial buffers); ``merge_splits`` the one after. Two
split planners: ``plan_splits`` (the ``tl`` kernels: programs per SM and a
minimum split length) and ``plan_waves`` (whole waves of the programs an SM
holds, ``resident_programs``); the Gluon kernels launch ``pick_plan``'s choice
of the two. The write and gather kernels share the format codes and
``field_offsets``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .layout import PageLayout
from .paged_kv import PagedKV

FMT_BF16: tl.constexpr = tl.constexpr(0)
FMT_FP8: tl.constexpr = tl.constexpr(1)
FMT_NVFP4: tl.constexpr = tl.constexpr(2)
FMT_INT4: tl.constexpr = tl.constexpr(3)
FMT_INT2: tl.constexpr = tl.constexpr(4)
FMT_CODES = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2, "int4": 3, "int2": 4}
LOG2E = 1.4426950408889634
# nvfp4 tiles decode to value * 2^-7 (triton_codec.nibbles_e2m1, gluon_fragments): folded back into the scales
NVFP4_FOLD = 128.0
# the extend kernels' VFOLD scales the chunk's probabilities by 1 / (V fold) in fp16: only where that stays far from
# fp16's range
VFOLD_MIN = 1e-3
MAX_SPLITS = 256


def field_offsets(layout: PageLayout | None, *, stride: int = 0) -> tuple[int, int, int, int, int, int, int]:
    """(page stride, k, k_scale, k_zero, v, v_scale, v_zero) byte offsets; 0 for fields a format lacks. The
    kernels' PAGE_BYTES constexprs take the first: the bytes from one page id to the next, ``stride`` (a
    ``PagedKV``'s ``page_stride`` / ``int2_stride``) or, 0, the page's own bytes (one layer a buffer).

    ``None`` (no INT2 layout): placeholders for the INT2 constexprs of a launch that has no INT2 pages."""
    if layout is None:
        return (16, 0, 0, 0, 0, 0, 0)
    at = {f.name: f.offset for f in layout.fields}
    get = at.get
    return (stride or layout.page_bytes, get("k", 0), get("k_scale", 0), get("k_zero", 0), get("v", 0), get("v_scale", 0),
            get("v_zero", 0))  # fmt: skip


def kv_field_offsets(kv: PagedKV) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``field_offsets`` of ``kv``'s layout and INT2 layout with its page strides: what a launch on ``kv``
    passes with ``kv.base`` and ``kv.int2_top``."""
    return field_offsets(kv.layout, stride=kv.page_stride), field_offsets(kv.int2_layout, stride=kv.int2_stride)


def folded_scales(kv: PagedKV) -> tuple[float, float]:
    """(K, V) factors the decode kernels fold into the softmax scale and the merged output: the global scale
    of fp8 / nvfp4 pages (times 2^7 for nvfp4's scaled tiles); 1 for bf16 and the self-scaled INT formats."""
    fmt = kv.layout.fmt
    if fmt == "fp8_e4m3":
        return kv.k_scale, kv.v_scale
    if fmt == "nvfp4":
        return kv.k_scale * NVFP4_FOLD, kv.v_scale * NVFP4_FOLD
    return 1.0, 1.0


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 off the GPU: the interpreter tests' planner)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_splits(batch_heads: int, max_pages: int, ppi: int, device: torch.device, *, triaxial: bool,
                programs_per_sm: int = 16, min_pages: int = 1, min_fill: int = 0) -> tuple[int, int]:  # fmt: skip
    """The ``tl`` kernels' planner, and the Gluon decode's min-length plan (gluon_decode.min_length_plan).

    (splits, pages per split) from the page-table width: about programs_per_sm programs per SM, but no split
    shorter than min_pages (a program's fixed cost, and the merge's per split, must stay small) -- unless that
    leaves fewer than min_fill programs per SM: a small batch over short contexts (1 x 4K: 3 splits x 8 heads =
    24 programs on 132 SMs) then splits down to ppi pages, since an idle SM costs more than a short split."""
    sms = sm_count(device)
    bh = max(batch_heads, 1)
    want = max(1, math.ceil(programs_per_sm * sms / bh))
    by_len = math.ceil(max_pages / min_pages)
    if min_fill and by_len * bh < min_fill * sms:
        by_len = math.ceil(min_fill * sms / bh)
    splits = max(1, min(want, MAX_SPLITS, math.ceil(max_pages / ppi), by_len))
    pps = math.ceil(math.ceil(max(max_pages, 1) / splits) / ppi) * ppi
    splits = math.ceil(max(max_pages, 1) / pps) + (1 if triaxial else 0)
    return splits, pps


# One sm_90 (H100 / H200) multiprocessor: what its resident programs share
SM90_REGS = 65536  # 32-bit registers, allocated per warp in units of 256
SM90_SHARED = 233472  # bytes of shared memory (228 KB), of which each resident program also reserves 1 KB
SM90_WARPS = 64
SM90_PROGRAMS = 32
# The wave model of plan_waves, fitted to split sweeps on an H200 (31 shapes x formats, 2-3 plans each): a wave of
# k resident programs takes time L * (k + FILL_WARPS / warps) --
# the SM's rate rises with its programs as k / (k + k0), and each wave pays a fill and drain of k0 programs (3
# warps) -- where L, a program's pages, is the mean of the splits' average and longest length (triaxial rows split
# their INT2 and INT4 pages apart: 3 splits of 512 pages are programs of 512, 154 and 358 at 32 x 32K) plus
# FIXED_STEPS steps for its prologue (q, the ring's first stages) and epilogue (warp merge, stores)
WAVE_FILL_WARPS = 3
WAVE_FIXED_STEPS = 2
WAVE_MAX_SPLITS = 128  # merge_block's one-step merge (more splits merge in two steps: slower)


def resident_programs(*, regs: int, warps: int, shared: int) -> int:
    """Programs of one kernel (``regs`` registers a thread, ``warps`` warps, ``shared`` bytes of shared memory) that
    one sm_90 multiprocessor holds at once: the least of what its register file, its shared memory, its 64 warps
    and its 32 program slots allow."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = SM90_REGS // max(per_warp, 256) // warps
    by_shared = SM90_SHARED // (shared + 1024)
    return max(1, min(by_regs, by_shared, SM90_WARPS // warps, SM90_PROGRAMS))


def wave_cost(batch_heads: int, max_pages: int, splits: int, pps: int, ppi: int, sms: int, *, resident: int,
              warps: int) -> float:  # fmt: skip
    """Modelled time (in pages of one program) of a grid of batch_heads x splits programs of at most pps pages:
    the busiest SM runs n = ceil(programs / sms) of them in ceil(n / resident) waves."""
    n = -(-batch_heads * splits // sms)
    waves = -(-n // resident)
    pages = (max_pages / splits + pps) / 2 + WAVE_FIXED_STEPS * ppi
    return pages * (n + waves * WAVE_FILL_WARPS / warps)


@lru_cache(maxsize=4096)
def plan_waves(batch_heads: int, max_pages: int, ppi: int, sms: int, *, resident: int, warps: int, triaxial: bool,
               max_splits: int = WAVE_MAX_SPLITS) -> tuple[int, int]:  # fmt: skip
    """(splits, pages per split) for a kernel of which ``resident`` programs of ``warps`` warps fit on one of ``sms``
    SMs: the split count of least ``wave_cost``, so that the grid ends on a whole wave of resident programs (or
    close) instead of a short last wave of long programs (64 x 4K nvfp4: 3 splits are 1536 programs, 1.45 waves
    of 8 per SM, slower than 2 splits' one wave; fp8, 6 per SM: the other way round).

    Pages per split are a multiple of ppi (one step); triaxial rows get one more split (the INT2 / INT4 boundary)."""
    top = max(1, -(-max_pages // ppi))
    plans: list[tuple[int, int, int]] = []  # (waves, splits, pages per split)
    for want in range(1, min(max_splits, top) + 1):
        pps = -(-(-(-max(max_pages, 1) // want)) // ppi) * ppi
        splits = -(-max(max_pages, 1) // pps) + (1 if triaxial else 0)
        if splits > max_splits and plans:
            break
        if not plans or plans[-1][1] != splits:
            plans.append((-(-(-(-batch_heads * splits // sms)) // resident), splits, pps))
    cost = [wave_cost(batch_heads, max_pages, s, pps, ppi, sms, resident=resident, warps=warps) for _, s, pps in plans]
    best = min(range(len(plans)), key=lambda i: (round(cost[i], 9), i))  # ties: fewer splits
    return plans[best][1], plans[best][2]


def busiest_sm_cost(batch_heads: int, max_pages: int, splits: int, sms: int, ppi: int, *, resident: int,
                    fill: float) -> float:  # fmt: skip
    """Modelled time (in pages of one program) of the busiest SM of a grid of batch_heads x splits programs: its
    n = ceil(programs / sms) programs of the *average* split (max_pages / splits: a triaxial row's split count
    includes its INT2 / INT4 boundary's, so its two short splits count) plus WAVE_FIXED_STEPS steps, and ``fill``
    programs' time for each of its ceil(n / resident) waves. Unlike ``wave_cost`` it does not weigh the longest
    split: for ``pick_plan``, which compares the wave plan with the min-length plan only."""
    n = -(-batch_heads * splits // sms)
    waves = -(-n // resident)
    return (max_pages / splits + WAVE_FIXED_STEPS * ppi) * (n + waves * fill)


@lru_cache(maxsize=4096)
def pick_plan(batch_heads: int, max_pages: int, ppi: int, sms: int, *, wave: tuple[int, int], old: tuple[int, int],
              resident: int, fill: float) -> tuple[int, int]:  # fmt: skip
    """``wave`` (plan_waves' plan) unless ``old`` (plan_splits' min-length plan) has the lower
    ``busiest_sm_cost``; ties keep the wave plan.

    Why both: plan_waves alone is slower than the min-length plan where the old grid already runs many waves (more,
    shorter splits: each program pays its prologue and epilogue, and a triaxial row's two short boundary splits),
    and where fp8 already saturates memory with 3 programs an SM (``fill`` 0); this comparison picks the faster
    measured plan of the two at the bench shapes of every format."""
    if wave == old:
        return wave
    cost_old = busiest_sm_cost(batch_heads, max_pages, old[0], sms, ppi, resident=resident, fill=fill)
    cost_wave = busiest_sm_cost(batch_heads, max_pages, wave[0], sms, ppi, resident=resident, fill=fill)
    return old if cost_old < cost_wave else wave


@dataclass(frozen=True, slots=True)
class SplitLaunch:
    """Host-side state of one split-K decode launch (grid: splits x kv_heads x batch)."""

    q: torch.Tensor  # [B, Hq, D] contiguous
    page_table: torch.Tensor  # int32 [B, max_pages] contiguous
    n2: torch.Tensor  # int32 [B] INT2 pages leading each row (triaxial; else any int32 [B], never read)
    o: torch.Tensor  # fp32 [B, Hq, S, D] per-split outputs
    lse: torch.Tensor  # fp32 [B, Hq, S] per-split base-2 log-sum-exp
    splits: int  # S
    pages_per_split: int
    kv_heads: int
    group: int  # query heads per kv head

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.splits, self.kv_heads, self.q.shape[0])


def prepare_splits(
    q: torch.Tensor,
    kv: PagedKV,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_int2_pages: torch.Tensor | None,
    *,
    pages_per_iter: int,
    programs_per_sm: int,
    splits: tuple[int, int] | None = None,
) -> SplitLaunch:
    """Plan the splits by ``plan_splits`` (unless given: the Gluon decode's ``split_plan``, tests and benchmarks)
    and allocate the partial outputs."""
    b, hq, d = q.shape
    h = kv.layout.kv_heads
    if splits is None:
        splits = plan_splits(b * h, page_table.shape[1], pages_per_iter, q.device, triaxial=kv.triaxial,
                             programs_per_sm=programs_per_sm)  # fmt: skip
    s, pps = splits
    o = torch.empty(b, hq, s, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, s, dtype=torch.float32, device=q.device)
    n2 = num_int2_pages if num_int2_pages is not None else seq_lens
    return SplitLaunch(q.contiguous(), page_table.contiguous(), n2, o, lse, s, pps, h, hq // h)


@triton.jit
def _merge_kernel(
    o_ptr,  # fp32 [R, S, D] per-split outputs (R = B * Hq rows)
    lse_ptr,  # fp32 [R, S] per-split base-2 log-sum-exp
    out_ptr,  # [R, D] result, q's dtype
    v_mul,  # fp32 the V format's folded scale
    S,  # splits
    BLOCK_S: tl.constexpr,  # splits per step
    D: tl.constexpr,
    ONE: tl.constexpr,  # S <= BLOCK_S: one step, lse and o loaded together (one round trip instead of two)
    PDL: tl.constexpr,  # triton_pdl.mode (OFF, EARLY, LATE): wait before any access
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    if ONE:
        s = tl.arange(0, BLOCK_S)
        lse = tl.load(lse_ptr + row * S + s, mask=s < S, other=float("-inf"))
        o = tl.load(o_ptr + (row * S + s[:, None]) * D + d[None, :], mask=(s < S)[:, None], other=0.0)
        top = tl.max(lse, axis=0)
        w = tl.where(lse > float("-inf"), tl.math.exp2(lse - top), 0.0)  # all -inf (empty sequence): zeros
        total = tl.sum(w, axis=0)
        acc = tl.sum(w[:, None] * o, axis=0)
    else:
        top = float("-inf")
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            top = tl.maximum(top, tl.max(tl.load(lse_ptr + row * S + s, mask=s < S, other=float("-inf")), axis=0))
        acc = tl.zeros((D,), tl.float32)
        total = 0.0
        for s0 in range(0, S, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            lse = tl.load(lse_ptr + row * S + s, mask=s < S, other=float("-inf"))
            w = tl.where(lse > float("-inf"), tl.math.exp2(lse - top), 0.0)
            total += tl.sum(w, axis=0)
            o = tl.load(o_ptr + (row * S + s[:, None]) * D + d[None, :], mask=(s < S)[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o, axis=0)
    out = acc * (v_mul / tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def merge_block(splits: int) -> int:
    """Splits per step of ``_merge_kernel``: the next power of two from 16 up to 128, so that up to 128 splits
    (1 x 128K: 86) merge in one step, lse and o loaded together: each step of the two-loop merge is a dependent
    round trip to memory."""
    return min(128, max(16, triton.next_power_of_2(splits)))


def merge_splits(launch: SplitLaunch, *, v_mul: float, pdl: bool = False) -> torch.Tensor:
    """Merge the splits' partial outputs by log-sum-exp -> [B, Hq, D] in q's dtype, times ``v_mul`` (one step up to
    merge_block's 128 splits, the two-loop merge beyond); ``pdl``: with programmatic dependent launch."""
    b, hq, d = launch.q.shape
    out = torch.empty(b, hq, d, dtype=launch.q.dtype, device=launch.q.device)
    bs = merge_block(launch.splits)
    one = launch.splits <= bs
    _merge_kernel[(b * hq,)](launch.o, launch.lse, out, v_mul, launch.splits, BLOCK_S=bs, D=d, ONE=one,
                             num_warps=4 if bs <= 32 else 8, **triton_pdl.launch(pdl, b))  # fmt: skip
    return out
