"""The split merge of the Gluon decode, run in the kernel by the last split of a (sequence, kv head) to finish.

A decode launch splits each sequence's pages over S programs; each stores its partial rows (normalised by its
own softmax sum) and their base-2 log-sum-exp. With ``FUSE`` 1 every program then counts itself in on its pair's
arrival counter (``merge_if_last``) and the last to arrive merges the S rows into the output by log-sum-exp,
which saves the launch and the round trip of ``triton_common._merge_kernel``:

    merge_pairs   two splits a step, two passes (the maximum, then the weighted sums): ~S dependent L2 round
                  trips, cheaper than the merge launch up to gluon_decode.FUSE_MAX_SPLITS splits
    merge_wide    (MERGE_SC n > 0, up to MERGE_MAX_SPLITS splits) one load of every split's lse, the weights in
                  shared memory, then n splits' rows in flight a step: 1 + ceil(S / n) round trips

The host side: ``merge_step`` (the launch's MERGE_SC) and ``arrival_counters`` (the counters' buffer).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_attend import _as_type, _cta_barrier, _row_major_shared


@gluon.jit
def merge_pairs(o_ptr, lse_ptr, out_ptr, v_mul, S, head0, G: gl.constexpr, HP: gl.constexpr):
    """The G query heads' rows of ``out`` from the S splits' partial rows of o and lse (each normalised by its own
    softmax sum), by log-sum-exp, times ``v_mul``: what ``triton_common._merge_kernel`` computes, run by the last
    program of a (sequence, kv head) to arrive. Two passes over the splits, SC at a time (the maximum, then the
    weighted sums); the loads bypass L1 (``.cg``): the rows were written by other SMs."""
    D: gl.constexpr = 128
    SC: gl.constexpr = 2  # splits a step: [HP, SC, D] fp32 in registers
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [gl.num_warps(), 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)  # [HP, SC]: lse
    LO: gl.constexpr = gl.SliceLayout(1, L3)  # [HP, D]: the sums
    gs = gl.expand_dims(gl.arange(0, HP, layout=gl.SliceLayout(1, LS)), 1)  # [HP, 1] head
    js = gl.expand_dims(gl.arange(0, SC, layout=gl.SliceLayout(0, LS)), 0)  # [1, SC] split within the step
    rows = (head0 + gs).to(gl.int64) * S  # [HP, 1] the heads' first partial rows
    top = gl.full([HP], float("-inf"), gl.float32, gl.SliceLayout(1, LS))
    for s0 in range(0, S, SC):
        lse = gl.load(lse_ptr + rows + s0 + js, mask=(gs < G) & (s0 + js < S), other=float("-inf"), cache_modifier=".cg")
        top = gl.maximum(top, gl.max(lse, axis=1))
    top2 = gl.expand_dims(gl.where(top == float("-inf"), 0.0, top), 1)  # all -inf (empty sequence): zeros below
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, LO)), 0), 1)  # [1, 1, D]
    acc = gl.zeros([HP, D], gl.float32, LO)
    total = gl.zeros([HP], gl.float32, gl.SliceLayout(1, LS))
    for s0 in range(0, S, SC):
        m = (gs < G) & (s0 + js < S)
        lse = gl.load(lse_ptr + rows + s0 + js, mask=m, other=float("-inf"), cache_modifier=".cg")
        w = gl.where(lse > float("-inf"), gl.exp2(lse - top2), 0.0)  # [HP, SC]
        total += gl.sum(w, axis=1)
        o = gl.load(o_ptr + gl.expand_dims((rows + s0 + js) * D, 2) + d3, mask=gl.expand_dims(m, 2) & (d3 >= 0),
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        acc += gl.sum(gl.expand_dims(w, 2) * o, axis=1)
    inv = v_mul / gl.where(total > 0, total, 1.0)
    out = acc * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, LO)), 1)
    go = gl.expand_dims(gl.arange(0, HP, layout=gl.SliceLayout(1, LO)), 1)
    do = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, LO)), 0)
    gl.store(out_ptr + (head0 + go).to(gl.int64) * D + do, out.to(out_ptr.dtype.element_ty), mask=(go < G) & (do >= 0))


# The wide merge (MERGE_SC > 0) holds every split's weight of the G heads at once: up to this many splits.
MERGE_MAX_SPLITS = 64
_MERGE_MAX: gl.constexpr = gl.constexpr(MERGE_MAX_SPLITS)


@gluon.constexpr_function
def _merge_heads(g: int) -> int:
    """Rows of the wide merge's tiles: G padded to a power of two (not to HP: padded rows cost registers)."""
    return 1 << (g - 1).bit_length()


@gluon.constexpr_function
def _merge_step(merge_sc: int, gp: int, threads: int) -> int:
    """Splits a step of the wide merge: MERGE_SC, fewer where the step's [GP, SC, 128] fp32 tile would take more
    than 64 registers a thread (half the cap of 128: the accumulator, addresses and masks take the rest), or 32 at
    16 heads, whose uncapped kernel (about 200 registers) would otherwise take its peak from the merge and lose a
    program per SM."""
    budget = 64 if gp <= 8 else 32
    return max(1, min(merge_sc, budget * threads // (gp * 128), MERGE_MAX_SPLITS))


@gluon.constexpr_function
def _merge_warps(w: int, n: int) -> int:
    """Of w warps (or lanes), the ones that spread over a dimension of n: min(w, n)."""
    return min(w, n)


@gluon.jit
def merge_wide(o_ptr, lse_ptr, out_ptr, v_mul, S, head0, G: gl.constexpr, MERGE_SC: gl.constexpr):
    """What ``merge_pairs`` computes (S <= MERGE_MAX_SPLITS) in 1 + ceil(S / SC) dependent L2 round trips instead of
    about S: one load of all the splits' lse gives the maximum, the sums and the weights; then SC splits' partial
    rows a step, the step's loads issued together so that their latencies overlap. The weights wait in shared
    memory, one broadcast read a step: every lane of a warp needs its heads' weights, so registers would hold
    GP * 64 / warps of them in each thread (128 at 4 heads and 2 warps). Loads bypass L1 (``.cg``) like
    merge_pairs': the rows were written by other SMs."""
    D: gl.constexpr = 128
    W: gl.constexpr = gl.num_warps()
    GP: gl.constexpr = _merge_heads(G)
    SC: gl.constexpr = _merge_step(MERGE_SC, GP, 32 * W)
    NK: gl.constexpr = _MERGE_MAX // SC  # steps that cover MERGE_MAX_SPLITS splits
    WG: gl.constexpr = _merge_warps(W, GP)  # warps over the heads, the rest over D
    WD: gl.constexpr = W // WG
    # [GP, SC, D] a step's partial rows: a warp reads a row's 512 contiguous bytes, 16 (8, 4) bytes a lane; the
    # splits and the warp's heads are each thread's registers, so the sum over the splits is the thread's FFMAs
    L3: gl.constexpr = gl.BlockedLayout([1, 1, D // (32 * WD)], [1, 1, 32], [WG, 1, WD], [2, 1, 0])
    LW: gl.constexpr = gl.SliceLayout(2, L3)  # [GP, SC] the step's weights (every lane of a warp holds its rows')
    LO: gl.constexpr = gl.SliceLayout(1, L3)  # [GP, D] the sums
    # [NK, GP, SC] every split's lse: split k * SC + j of head g
    TS: gl.constexpr = _merge_warps(32, SC)  # lanes over a step's splits, the rest over the steps
    LL: gl.constexpr = gl.BlockedLayout([1, 1, 1], [32 // TS, 1, TS], [1, WG, WD], [2, 1, 0])
    k3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NK, layout=gl.SliceLayout(1, gl.SliceLayout(2, LL))), 1), 2)
    g3 = gl.expand_dims(gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(0, gl.SliceLayout(2, LL))), 0), 2)
    j3 = gl.expand_dims(gl.expand_dims(gl.arange(0, SC, layout=gl.SliceLayout(0, gl.SliceLayout(1, LL))), 0), 1)
    sj = k3 * SC + j3
    lse = gl.load(lse_ptr + (head0 + g3).to(gl.int64) * S + sj, mask=(g3 < G) & (sj < S), other=float("-inf"),
                  cache_modifier=".cg")  # fmt: skip
    top = gl.max(gl.max(lse, axis=2), axis=0)  # [GP]
    top = gl.expand_dims(gl.expand_dims(gl.where(top == float("-inf"), 0.0, top), 0), 2)  # all -inf: zeros below
    w = gl.where(lse > float("-inf"), gl.exp2(lse - top), 0.0)  # [NK, GP, SC]
    total = gl.sum(gl.sum(w, axis=2), axis=0)  # [GP]
    # step k's [GP, SC] is wts.index(k) (a layout of rank 2); the store sees the same bytes as one
    # [NK, GP, SC] tensor (a layout of rank 3)
    wts = gl.allocate_shared_memory(gl.float32, [NK, GP, SC], _row_major_shared(2))
    whole = _as_type(wts, gl.float32, [NK, GP, SC], _row_major_shared(3))
    whole.store(w)
    _cta_barrier()  # every thread's weights are stored before any thread reads a step's

    gs = gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(1, LW)), 1)  # [GP, 1] head
    js = gl.expand_dims(gl.arange(0, SC, layout=gl.SliceLayout(0, LW)), 0)  # [1, SC] split within the step
    d3 = gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, LO)), 0), 1)  # [1, 1, D]
    o_rows = o_ptr + gl.expand_dims(((head0 + gs).to(gl.int64) * S + js) * D, 2) + d3  # [GP, SC, D] step 0's
    acc = gl.zeros([GP, D], gl.float32, LO)
    for k in range(0, gl.cdiv(S, SC)):
        m = gl.expand_dims((gs < G) & (js < S - k * SC), 2) & (d3 >= 0)
        o = gl.load(o_rows + k * (SC * D), mask=m, other=0.0, cache_modifier=".cg")
        acc += gl.sum(gl.expand_dims(wts.index(k).load(LW), 2) * o, axis=1)
    inv = v_mul / gl.where(total > 0, total, 1.0)
    out = acc * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, LO)), 1)
    go = gl.expand_dims(gl.arange(0, GP, layout=gl.SliceLayout(1, LO)), 1)
    do = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, LO)), 0)
    gl.store(out_ptr + (head0 + go).to(gl.int64) * D + do, out.to(out_ptr.dtype.element_ty), mask=(go < G) & (do >= 0))


@gluon.jit
def merge_if_last(o_ptr, lse_ptr, out_ptr, cnt_ptr, v_mul, S, head0, G: gl.constexpr, HP: gl.constexpr,
                  MERGE_SC: gl.constexpr):  # fmt: skip
    """Counts this program in on its (sequence, kv head)'s arrival counter ``cnt_ptr`` after its partial rows are
    stored; the last of the S to arrive merges them (``merge_wide`` with MERGE_SC n > 0, else ``merge_pairs``)
    and zeroes the counter for the next launch."""
    _cta_barrier()  # every thread's partial rows are stored: the counter's release covers them
    arrived = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:  # the last split of this (sequence, kv head)
        if MERGE_SC:
            merge_wide(o_ptr, lse_ptr, out_ptr, v_mul, S, head0, G, MERGE_SC)
        else:
            merge_pairs(o_ptr, lse_ptr, out_ptr, v_mul, S, head0, G, HP)
        gl.store(cnt_ptr, 0)  # zero again for the next launch


# ----------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------


def merge_step(cfg: dict[str, int], *, splits: int) -> int:
    """The MERGE_SC of a FUSE 1 launch of ``splits`` splits with tuning ``cfg``: cfg's MERGE_SC (0 when absent:
    merge_pairs), 0 past MERGE_MAX_SPLITS splits, which merge_wide does not hold."""
    sc = cfg.get("MERGE_SC", 0)
    if sc < 0 or sc & (sc - 1):
        raise ValueError(f"MERGE_SC must be 0 or a power of two, got {sc}")
    return sc if splits <= MERGE_MAX_SPLITS else 0


# Per device: the fused merge's arrival counters (int32, one per (sequence, kv head) of a launch), zero between
# launches: the last program of each pair resets its own. Grown only outside a CUDA-graph capture (a launch that
# needs more during a capture merges by triton_common's launch instead); the newest buffer serves every launch, and
# an outgrown one stays allocated, since the graphs captured before the growth replay on it.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least ``n`` zeroed arrival counters on ``device`` (shared by every launch of the fused merge there),
    or None where they would have to be allocated during a CUDA-graph capture."""
    buffers = _COUNTERS.setdefault(device, [])
    if buffers and buffers[-1].numel() >= n:
        return buffers[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    buffers.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return buffers[-1]
