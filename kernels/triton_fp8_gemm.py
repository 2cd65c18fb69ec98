"""FP8 activation quantizers and the block-scaled FP8 GEMM in Triton (weights per 128x128 tile).

The quantizers turn a bf16 activation into E4M3 codes and fp32 scales in one launch (per token, or
per token per 128 channels), where torch takes ~7 elementwise kernels: a decode step runs one per
linear layer, 144 at the Qwen3-8B shape. They round as ``fp8_gemm.quantize_rows`` /
``quantize_groups`` do: IEEE division by the scale (``div_rn``), saturate at 448, round to nearest even.

    y[m, n] = sum_kb  sa[m, kb] * sw[n // 128, kb] * sum_{k in kb} qa[m, k] * qw[n, k]

One program computes a BLOCK_M x BLOCK_N tile of y, walking K in steps of 128 (one
scale group): each step is one FP8 tensor-core dot accumulated in fp32, then scaled by
the step's activation scales (one per row) and the tile's weight scale (one: BLOCK_N
divides 128, so a program's columns lie in one 128-row weight tile). The spec is
``fp8_gemm.linear_quantized_ref``; the wrapper checks shapes, dtypes and strides.

Decode steps multiply a few tokens by a large weight, so the step reads the weight once
and the grid must keep enough weight bytes in flight on every SM: ``tile_config`` picks the
tile per (M, N, K) (``Tiles``: BLOCK_M x BLOCK_N, warps, pipeline stages, K splits). A split
K writes fp32 partials [S, M, N], summed in a fixed order by a second launch, so the output
does not depend on scheduling.

At M = 1, and at M = 2 where the block GEMM splits K (its column tiles alone do not fill the grid),
``linear`` takes the GEMV instead (it runs M <= 4, ``GEMV_ROWS``): no activation quantization
and no tensor cores. A program streams a [BLOCK_N, BLOCK_K] tile of the E4M3 weight per step,
converts it to fp32 in registers and reduces it along K against each activation row, the
row scaled by the step's weight tile scales first (one multiply per activation value, not per
weight value)::

    y[m, n] = sum_k  qw[n, k] * (x[m, k] * sw[n // 128, k // 128])      (fp32, x unquantized)

The same kernel multiplies by a bf16 weight (``gemv(x, weight, None)``: no scales): a bf16 model's projections at
M <= 2 (``worker.model.product``) instead of cuBLAS. On an H100 at M = 1 it reads the Qwen3-8B projections at 79-96 %
of the streaming read where cuBLAS reads 64-89 % (one layer 135 us against 148).

Which kernel runs a product and at what launch shape is ``gemm_plan``'s (``launch_config``: a ``Gemv`` or a
``Tiles``); each wrapper here takes the launch ``gemm_plan.tiles_override`` set, where one is.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import triton_elementwise, triton_pdl
from .gemm_plan import GEMV_ROWS, GROUP, SMS, Gemv, Tiles, bf16_tile_config, gemv_config, launch_config, override, tile_config
from .options import KernelOptions


@triton.jit
def _block_gemm_kernel(
    a_ptr,  # [M, K] activations (row-major): e4m3 codes, or bf16 values when not SCALED or A16
    sa_ptr,  # [M, K/128] fp32 activation scales (row-major); unused when not SCALED or A16
    w_ptr,  # [N, K] weight (row-major: K contiguous, what the dot's B wants): e4m3 codes, or bf16 values
    sw_ptr,  # [N/128, K/128] fp32 weight tile scales (row-major); unused when not SCALED
    c_ptr,  # [M, N] output (bf16 or fp32); with SPLIT_K > 1: [SPLIT_K, M, N] fp32 partials
    m,  # rows of a and c
    n,  # rows of w, columns of c
    k,  # columns of a and w, a multiple of BLOCK_K
    stride_am,  # row strides, in elements
    stride_sam,
    stride_wn,
    stride_swn,
    stride_cm,
    stride_cs,  # c's stride between K splits (unused at SPLIT_K 1)
    BLOCK_M: tl.constexpr,  # output rows per program (>= 16: the dot's smallest M)
    BLOCK_N: tl.constexpr,  # output columns per program, divides 128
    BLOCK_K: tl.constexpr,  # K per step: 128 (one scale group) when SCALED
    SPLIT_K: tl.constexpr,  # programs along K: split s takes a contiguous run of the K / BLOCK_K steps
    SCALED: tl.constexpr,  # w holds e4m3 codes with per-tile scales (and a codes with per-row-group scales, unless
    # A16); False: both hold bf16 values
    A16: tl.constexpr,  # SCALED with bf16 activations as they are: each weight tile widened to bf16 in registers
    PDL: tl.constexpr,  # triton_pdl.mode (OFF, EARLY, LATE): wait before any access
    NATIVE: tl.constexpr,  # bf16 values enter the dot as they are; 0 in the interpreter, whose bf16 dot is wrong
    # (numpy has no bf16): they enter as fp32 there, where bf16 values and their products are exact
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    a_row = a_ptr + rows.to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    w_col = w_ptr + cols.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    sa_row = sa_ptr + rows.to(tl.int64) * stride_sam  # [BLOCK_M]
    sw_tile = sw_ptr + (pid_n * BLOCK_N // 128) * stride_swn  # this program's weight tile row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = tl.cdiv(k, BLOCK_K)
    per_split = tl.cdiv(steps, SPLIT_K)
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    for kb in range(pid_k * per_split, tl.minimum(steps, (pid_k + 1) * per_split)):
        kk = kb * BLOCK_K + ks
        a = tl.load(a_row + kk[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_col + kk[:, None], mask=col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if SCALED and A16:  # e4m3 is exact in bf16: the step's products are exact, its sum fp32
            sw = tl.load(sw_tile + kb)
            if NATIVE:
                acc += tl.dot(a, w.to(tl.bfloat16), out_dtype=tl.float32) * sw
            else:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32) * sw
        elif SCALED:
            sa = tl.load(sa_row + kb, mask=row_ok, other=0.0)  # [BLOCK_M]
            sw = tl.load(sw_tile + kb)
            acc += tl.dot(a, w, out_dtype=tl.float32) * (sa[:, None] * sw)
        elif NATIVE:
            acc = tl.dot(a, w, acc, out_dtype=tl.float32)
        else:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
    c = c_ptr + pid_k.to(tl.int64) * stride_cs + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(
    p_ptr,  # [SPLIT_K, total] fp32 partials (contiguous)
    c_ptr,  # [total] output (bf16 or fp32)
    total,  # M * N
    SPLIT_K: tl.constexpr,  # partials per element, summed in order 0, 1, ... (deterministic)
    BLOCK: tl.constexpr,  # elements per program
    PDL: tl.constexpr,  # triton_pdl.mode (OFF, EARLY, LATE): wait before any access
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _lane_sums(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANE: tl.constexpr):
    """p [BLOCK_N, BLOCK_K] -> [BLOCK_N, BLOCK_K / LANE]: each run of LANE columns summed (within a thread)."""
    return tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // LANE, LANE)), axis=2)


@triton.jit
def _row(x_ptr, kk, sw, k, SCALED: tl.constexpr, GATED: tl.constexpr):
    """One activation row's columns ``kk`` in fp32 -- with GATED, silu(gate) * up of a [gate | up] row of 2 K, as
    ``triton_norm.silu_mul`` would have stored it -- times their weight tile scales ``sw`` when the weight is scaled."""
    if GATED:
        x = triton_elementwise.silu_mul(tl.load(x_ptr + kk), tl.load(x_ptr + k + kk), x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + kk).to(tl.float32)
    if SCALED:
        x = x * sw
    return x


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations (bf16 or fp32, row-major), M <= 4: read as they are, never quantized; with GATED
    # [M, 2 K]: gate then up columns, the product's input silu(gate) * up formed in registers
    w_ptr,  # [N, K] weight (row-major: a program streams BLOCK_N rows, K contiguous): e4m3 codes, or bf16 values
    sw_ptr,  # [ceil(N/128), K/128] fp32 weight tile scales (row-major); unused when not SCALED
    c_ptr,  # [M, N] output (bf16 or fp32); with SPLIT_K > 1: [SPLIT_K, M, N] fp32 partials
    n,  # rows of w, columns of c
    k,  # columns of x and w, a multiple of BLOCK_K
    stride_xm,  # row strides, in elements
    stride_wn,
    stride_swn,
    stride_cm,
    stride_cs,  # c's stride between K splits (unused at SPLIT_K 1)
    ROWS: tl.constexpr,  # M, 1..4: one fp32 accumulator [BLOCK_N, BLOCK_K / 16] per activation row
    BLOCK_N: tl.constexpr,  # weight rows per program, divides 128 (one tile scale per 128 columns of a step)
    BLOCK_K: tl.constexpr,  # weight columns per step, a multiple of 128 dividing K
    SPLIT_K: tl.constexpr,  # programs along K: split s takes a contiguous run of the K / BLOCK_K steps
    STAGES: tl.constexpr,  # steps whose weight loads the compiler issues ahead of their use (1: none)
    SCALED: tl.constexpr,  # w holds e4m3 codes scaled per 128x128 tile by sw; False: w holds bf16 values
    LANE: tl.constexpr,  # weight values a thread loads at once (16 bytes: 16 codes, 8 bf16), summed in the thread
    GATED: tl.constexpr,  # x is [gate | up]: SwiGLU's silu_mul runs inside the product (one launch less a layer)
    PDL: tl.constexpr,  # triton_pdl.mode (OFF, EARLY, LATE): the first step's weights are
    # loaded before the wait (no kernel of the step writes them), x after it
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < n
    w_tile = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K]: a step's tile
    sw_row = sw_ptr + (pid_n * BLOCK_N // 128) * stride_swn  # this program's row of tile scales
    # per row and LANE-column lane: partial sums kept across steps (a lane = one 16-byte load a thread), so a step
    # sums within each thread and the sum across lanes runs once, after the loop
    acc0 = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K // LANE), dtype=tl.float32)
    steps = k // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    triton_pdl.start(PDL)
    for step in tl.range(first, tl.minimum(steps, (pid_k + 1) * per_split), num_stages=STAGES):
        kk = step * BLOCK_K + ks  # [BLOCK_K]
        w = tl.load(w_tile + step * BLOCK_K, mask=row_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if SCALED:
            sw = tl.load(sw_row + kk // 128)  # [BLOCK_K]: each column's tile scale (BLOCK_K / 128 distinct values)
        else:
            sw = 1.0
        if step == first:
            triton_pdl.wait(PDL)
        # each row: x[m, kk] * sw (the tile scale moved onto the activation), then the dot along K
        acc0 += _lane_sums(w * _row(x_ptr, kk, sw, k, SCALED, GATED)[None, :], BLOCK_N, BLOCK_K, LANE)
        if ROWS > 1:
            acc1 += _lane_sums(w * _row(x_ptr + stride_xm, kk, sw, k, SCALED, GATED)[None, :], BLOCK_N, BLOCK_K, LANE)
        if ROWS > 2:
            acc2 += _lane_sums(w * _row(x_ptr + 2 * stride_xm, kk, sw, k, SCALED, GATED)[None, :], BLOCK_N, BLOCK_K, LANE)
        if ROWS > 3:
            acc3 += _lane_sums(w * _row(x_ptr + 3 * stride_xm, kk, sw, k, SCALED, GATED)[None, :], BLOCK_N, BLOCK_K, LANE)
    triton_pdl.wait(PDL)  # before any store (a program with no step has not waited yet)
    c = c_ptr + pid_k.to(tl.int64) * stride_cs + rows
    tl.store(c, tl.sum(acc0, axis=1).to(c_ptr.dtype.element_ty), mask=row_ok)
    if ROWS > 1:
        tl.store(c + stride_cm, tl.sum(acc1, axis=1).to(c_ptr.dtype.element_ty), mask=row_ok)
    if ROWS > 2:
        tl.store(c + 2 * stride_cm, tl.sum(acc2, axis=1).to(c_ptr.dtype.element_ty), mask=row_ok)
    if ROWS > 3:
        tl.store(c + 3 * stride_cm, tl.sum(acc3, axis=1).to(c_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _round_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to nearest-even E4M3, kept in fp32, so the cast after it is exact. By hand:
    Triton's interpreter rounds fp32 -> fp8 casts wrongly where the mantissa carries; the GPU rounds; this rounds
    the same on both. Normal range (|v| >= 2^-6): keep 3 mantissa bits; below: multiples of 2^-9, by adding and
    removing 1.5 * 2^14 (the fp32 add rounds to nearest even at 2^-9)."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) >= 0.015625, normal, sub)


@triton.jit
def _encode(x, s):
    """fp32 values ``x`` over scale ``s`` -> E4M3 values in fp32, bit for bit as torch's division and cast (a value
    that rounds to zero keeps its sign). A zero numerator is divided as ``s`` instead and its zero put back: the
    IEEE division's operand check sends exponent-field-0 numerators to its slow path."""
    zero = x == 0.0
    q = _round_e4m3(tl.clamp(tl.math.div_rn(tl.where(zero, s, x), s), -448.0, 448.0))
    signed_zero = (x.to(tl.uint32, bitcast=True) & 0x80000000).to(tl.float32, bitcast=True)
    return tl.where(zero | (q == 0.0), signed_zero, q)


@triton.jit
def _quantize_kernel(
    x_ptr,  # [M, K] activations (bf16 or fp32, row-major)
    q_ptr,  # [M, K] e4m3 codes out
    s_ptr,  # [M, K / width] fp32 scales out (width = K: one per row)
    width,  # values per scale: 128, or K (per token)
    stride_xm,  # row strides, in elements
    stride_qm,
    stride_sm,  # scales: row and group strides (row- or column-major)
    stride_sg,
    CHUNK: tl.constexpr,  # values a step reads: a power of two >= 128
    ONE_STEP: tl.constexpr,  # CHUNK == width: the group is read once and kept in registers
    GROUPS: tl.constexpr,  # groups a program quantizes (ONE_STEP only; else 1): program g takes groups
    # g * GROUPS ... g * GROUPS + GROUPS - 1 of its row
    PDL: tl.constexpr,  # triton_pdl.mode (OFF, EARLY, LATE): wait before any access
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lanes = tl.arange(0, CHUNK)
    triton_pdl.start(PDL)
    triton_pdl.wait(PDL)
    if ONE_STEP:
        # x: [GROUPS, CHUNK], one group a row, from group g * GROUPS on
        groups = g * GROUPS + tl.arange(0, GROUPS)
        at = groups.to(tl.int64)[:, None] * width + lanes[None, :]
        x = tl.load(x_ptr + row * stride_xm + at).to(tl.float32)
        s = tl.max(tl.abs(x), axis=1) / 448.0  # [GROUPS]
        s = tl.where(s > 1e-12, s, 1.0)  # an all-zero group: scale 1, codes 0
        tl.store(q_ptr + row * stride_qm + at, _encode(x, s[:, None]).to(q_ptr.dtype.element_ty))
        tl.store(s_ptr + row * stride_sm + groups * stride_sg, s)
    else:  # two passes over the row in CHUNK steps (amax, then codes); only a last partial step is masked
        x_row = x_ptr + row * stride_xm + g * width
        q_row = q_ptr + row * stride_qm + g * width
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for c in range(0, width, CHUNK):
            x = tl.load(x_row + c + lanes, mask=c + lanes < width, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = tl.max(amax, axis=0) / 448.0
        s = tl.where(s > 1e-12, s, 1.0)
        for c in range(0, width, CHUNK):
            ok = c + lanes < width
            x = tl.load(x_row + c + lanes, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_row + c + lanes, _encode(x, s).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row * stride_sm + g * stride_sg, s)


# Programs the per-128 quantizer aims for (``quantize_groups_per_program``): two per SM.
QUANTIZE_PROGRAMS = 2 * SMS
# Rows up to which the per-128 quantizer takes one group a program (``quantize_groups_per_program``).
QUANTIZE_ONE_GROUP_ROWS = 128


def quantize_groups_per_program(m: int, groups: int) -> int:
    """Groups one program of the per-128 quantizer takes, of a row's ``groups``: one up to QUANTIZE_ONE_GROUP_ROWS
    rows; above, powers of two dividing them, up to 16 (2,048 values), while the grid keeps >= QUANTIZE_PROGRAMS
    programs. One group a program makes M x K/128 programs of one warp, each moving 384 bytes: 8,192 to 24,576 of
    them at a decode step of 256 tokens, where 16 groups a program ran the step 2.8 % faster on an H100 (FP8 weights,
    nvfp4 KV, 256 x 4K: 24.77 -> 24.07 ms); at 64 tokens 4-16 a program ran it 1.4 % slower (9.10 -> 9.23 ms)."""
    if m <= QUANTIZE_ONE_GROUP_ROWS:
        return 1
    g = 1
    while g < 16 and groups % (g * 2) == 0 and m * (groups // (g * 2)) >= QUANTIZE_PROGRAMS:
        g *= 2
    return g


def quantize_chunk(width: int) -> int:
    """Values per step of the quantizer over groups of ``width``: the largest power of two dividing it, from 128
    to 4096 (K 12,288 in three steps, 4,096 in one; no lane past the row), 128 when none of those does."""
    return max(128, min(4096, width & -width))


def quantize(x: Tensor, *, group: int | None, column_major: bool = False, pdl: bool = False) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (codes [M, K] e4m3, scales fp32 [M, 1] (``group`` None: per token) or [M, K/group]);
    ``column_major``: the scales with strides (1, M), as cuBLASLt's 1x128 scaling reads them; ``pdl``: launched
    with programmatic dependent launch."""
    if x.dim() != 2:
        raise ValueError(f"quantize: x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    if group is not None and (k % group or group & (group - 1) or group < 128):
        raise ValueError(f"quantize: the group {group} must be a power of two >= 128 dividing K = {k}")
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = 1 if group is None else k // group
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        s = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and k:
        width = k if group is None else group
        chunk = quantize_chunk(width)
        per = quantize_groups_per_program(m, groups) if chunk == width else 1
        _quantize_kernel[(m, groups // per)](
            x, q, s, width, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            CHUNK=chunk, ONE_STEP=chunk == width, GROUPS=per, num_warps=max(1, min(8, per * chunk // 512)),
            **triton_pdl.launch(pdl, m),
        )  # fmt: skip
    return q, s


def block_gemm(qa: Tensor, sa: Tensor, codes: Tensor, scale: Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
               pdl: bool = False) -> Tensor:  # fmt: skip
    """qa [M, K] e4m3, sa [M, K/128] fp32, codes [N, K] e4m3, scale [ceil(N/128), K/128] fp32 -> [M, N] ``out_dtype``;
    ``pdl``: it and the partials' sum launched with programmatic dependent launch."""
    if qa.dim() != 2 or codes.dim() != 2 or qa.shape[1] != codes.shape[1]:
        raise ValueError(f"block_gemm: qa {tuple(qa.shape)} and codes {tuple(codes.shape)} must be [M, K] and [N, K]")
    m, k = qa.shape
    n = codes.shape[0]
    if k % GROUP:
        raise ValueError(f"block_gemm: K = {k} must be a multiple of {GROUP}")
    if qa.dtype != torch.float8_e4m3fn or codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_gemm: qa and codes must be float8_e4m3fn, got {qa.dtype} and {codes.dtype}")
    if sa.shape != (m, k // GROUP) or scale.shape != ((n + GROUP - 1) // GROUP, k // GROUP):
        raise ValueError(f"block_gemm: scales {tuple(sa.shape)} / {tuple(scale.shape)} must be "
                         f"{(m, k // GROUP)} / {((n + GROUP - 1) // GROUP, k // GROUP)}")  # fmt: skip
    if sa.dtype != torch.float32 or scale.dtype != torch.float32:
        raise ValueError(f"block_gemm: scales must be float32, got {sa.dtype} and {scale.dtype}")
    qa, sa, codes, scale = (t if t.stride(1) == 1 else t.contiguous() for t in (qa, sa, codes, scale))
    out = torch.empty((m, n), dtype=out_dtype, device=qa.device)
    if m == 0 or n == 0:
        return out
    o = override()
    t = o if isinstance(o, Tiles) else tile_config(m, n, k)
    if t.block_k != GROUP or t.a16:
        raise ValueError(f"block_gemm: quantized activations step K by their scale group, {GROUP}; tiles {t.label} do not")
    return _launch(qa, sa, codes, scale, t, out, scaled=True, a16=False, pdl=pdl)


def _launch(a: Tensor, sa: Tensor, w: Tensor, sw: Tensor, t: Tiles, out: Tensor, *, scaled: bool, a16: bool,
            pdl: bool) -> Tensor:  # fmt: skip
    """``_block_gemm_kernel`` at tiles ``t`` into ``out`` [M, N] (checked operands, K a multiple of t.block_k), and the
    partials' sum where K is split."""
    m, k = a.shape
    n = w.shape[0]
    # c: the output, or [S, M, N] fp32 partials that the second launch sums in split order
    c = out if t.split_k == 1 else torch.empty((t.split_k, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    _block_gemm_kernel[grid](
        a, sa, w, sw, c, m, n, k,
        a.stride(0), sa.stride(0) if scaled and not a16 else 0, w.stride(0), sw.stride(0) if scaled else 0, c.stride(-2),
        c.stride(0) if t.split_k > 1 else 0,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, SCALED=scaled, A16=a16,
        NATIVE=_native_dot(a.device), num_warps=t.warps, num_stages=t.stages, **triton_pdl.launch(pdl, m),
    )  # fmt: skip
    if t.split_k > 1:
        _sum_splits(c, out, pdl=pdl)
    return out


@functools.cache
def _native_dot(device: torch.device) -> bool:
    """bf16 values enter the block GEMM's dot as they are: a CUDA device not under the interpreter (the environment
    read once per device)."""
    return device.type == "cuda" and not KernelOptions.from_env().interpret


def bf16_gemm(x: Tensor, weight: Tensor, *, out_dtype: torch.dtype = torch.bfloat16, tiles: Tiles | None = None,
              pdl: bool | None = None) -> Tensor:  # fmt: skip
    """x [M, K] bf16 times a bf16 weight [N, K] -> [M, N] ``out_dtype``: the block GEMM's tiles on unscaled values,
    fp32 sums (tensor cores), at ``tiles_override``'s launch, else ``tiles`` (a caller's ``bf16_launch``), else
    ``bf16_tile_config``'s. ``pdl``: with programmatic dependent launch (None: ``triton_pdl.resolve``'s choice)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"bf16_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [M, K] and [N, K]")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"bf16_gemm: x and weight must be bfloat16, got {x.dtype} and {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    o = override()
    t = o if isinstance(o, Tiles) else tiles or bf16_tile_config(m, n, k)
    if k % t.block_k:
        raise ValueError(f"bf16_gemm: BLOCK_K {t.block_k} must divide K = {k}")
    if t.a16:
        raise ValueError(f"bf16_gemm: tiles {t.label} are for FP8 weights (a16)")
    x, weight = (v if v.stride(1) == 1 else v.contiguous() for v in (x, weight))
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    return _launch(x, x, weight, weight, t, out, scaled=False, a16=False, pdl=triton_pdl.resolve(pdl, x.device))


def block_gemm_a16(x: Tensor, codes: Tensor, scale: Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                   pdl: bool | None = None) -> Tensor:  # fmt: skip
    """x [M, K] bf16 as it is (no activation quantization) times e4m3 ``codes`` [N, K] with ``scale`` [ceil(N/128),
    K/128] fp32 -> [M, N] ``out_dtype``: each weight tile widened to bf16 in registers (exact), tensor-core dot with
    fp32 sums, scaled per 128-wide step, at ``tiles_override``'s launch or ``tile_config``'s with ``a16``.
    ``pdl``: with programmatic dependent launch (None: ``triton_pdl.resolve``'s choice)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"block_gemm_a16: x must be bfloat16 [M, K], got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"block_gemm_a16: K = {k} must be a multiple of {GROUP}")
    _check_weight("block_gemm_a16", k, codes, scale)
    n = codes.shape[0]
    o = override()
    t = o if isinstance(o, Tiles) else dataclasses.replace(tile_config(m, n, k), a16=True)
    if t.block_k != GROUP or not t.a16:
        raise ValueError(f"block_gemm_a16: FP8 weights step K by their scale group, {GROUP}, with a16 tiles; got {t.label}")
    x, codes, scale = (v if v.stride(1) == 1 else v.contiguous() for v in (x, codes, scale))
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    return _launch(x, x, codes, scale, t, out, scaled=True, a16=True, pdl=triton_pdl.resolve(pdl, x.device))


def _sum_splits(partials: Tensor, out: Tensor, *, pdl: bool = False) -> None:
    """out [M, N] = partials [S, M, N] (fp32, contiguous) summed over S in split order."""
    block = 1024
    total = out.numel()
    _sum_splits_kernel[(triton.cdiv(total, block),)](partials, out, total, SPLIT_K=partials.shape[0], BLOCK=block,
                                                     num_warps=4, **triton_pdl.launch(pdl, out.shape[0]))  # fmt: skip


def _check_weight(name: str, k: int, codes: Tensor, scale: Tensor) -> None:
    if codes.dim() != 2 or codes.shape[1] != k:
        raise ValueError(f"{name}: codes {tuple(codes.shape)} must be [N, K] with K = {k}")
    n = codes.shape[0]
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: codes must be float8_e4m3fn, got {codes.dtype}")
    if scale.shape != ((n + GROUP - 1) // GROUP, k // GROUP) or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale {tuple(scale.shape)} {scale.dtype} must be float32 {((n + GROUP - 1) // GROUP, k // GROUP)}")


def gemv(x: Tensor, weight: Tensor, scale: Tensor | None, *, out_dtype: torch.dtype = torch.bfloat16,
         gated: bool = False, pdl: bool | None = None) -> Tensor:  # fmt: skip
    """x [M, K] bf16 or fp32 (M <= 4, K a multiple of 128) times an [N, K] weight -> [M, N] ``out_dtype``: the
    product with x as it is (no activation quantization), fp32 sums. The weight is e4m3 codes with ``scale``
    [ceil(N/128), K/128] fp32, or bf16 values with ``scale`` None. ``gated``: x is SwiGLU's [M, 2 K] gate and up,
    and the product's input is ``triton_norm.silu_mul(x)`` (formed in registers, equal to it bit for bit).
    ``pdl``: with programmatic dependent launch (None: ``triton_pdl.resolve``'s choice)."""
    if x.dim() != 2 or x.shape[0] > GEMV_ROWS:
        raise ValueError(f"gemv: x {tuple(x.shape)} must be [M, K] with M <= {GEMV_ROWS}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemv: x must be bfloat16 or float32, got {x.dtype}")
    if gated and x.shape[1] % 2:
        raise ValueError(f"gemv: a gated x must be [M, 2 K] (gate, then up), got {tuple(x.shape)}")
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    if k % GROUP:
        raise ValueError(f"gemv: K = {k} must be a multiple of {GROUP}")
    if scale is None:
        if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != torch.bfloat16:
            raise ValueError(f"gemv: an unscaled weight must be bfloat16 [N, K] with K = {k}, got {weight.dtype} {tuple(weight.shape)}")
    else:
        _check_weight("gemv", k, weight, scale)
    n = weight.shape[0]
    o = override()
    g = o if isinstance(o, Gemv) else gemv_config(m, n, k)
    if k % g.block_k:
        raise ValueError(f"gemv: BLOCK_K {g.block_k} must divide K = {k}")
    x, weight = (t if t.stride(1) == 1 else t.contiguous() for t in (x, weight))
    scaled = scale is not None
    sw = weight if scale is None else scale if scale.stride(1) == 1 else scale.contiguous()  # unscaled: never read
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    # c: the output, or [S, M, N] fp32 partials that the second launch sums in split order
    c = out if g.split_k == 1 else torch.empty((g.split_k, m, n), dtype=torch.float32, device=x.device)
    on = triton_pdl.resolve(pdl, x.device)
    _gemv_kernel[(triton.cdiv(n, g.block_n), g.split_k)](
        x, weight, sw, c, n, k, x.stride(0), weight.stride(0), sw.stride(0), c.stride(-2), c.stride(0) if g.split_k > 1 else 0,
        ROWS=m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, SPLIT_K=g.split_k, STAGES=g.stages, SCALED=scaled, LANE=16 // weight.element_size(),
        GATED=gated, num_warps=g.warps, **triton_pdl.launch(on, m),
    )  # fmt: skip
    if g.split_k > 1:
        _sum_splits(c, out, pdl=on)
    return out


# Rows at which the activation quantizer launches with PDL (the block GEMM after it takes PDL at every M, as the
# device allows). The engine's decode step with FP8 block weights on an H100, TPOT ms at B x 4K with fp8 / nvfp4 KV
# (docs/results.md): the quantizer plain and the GEMM with PDL against both with PDL, 8 tokens 5.10 / 4.79 against
# 5.78 / 5.83, 16: 5.96 / 5.53 against 7.30 / 6.13, 24: 7.28 / 6.29 against 7.35 / 6.37, 128: 19.10 / 13.96
# against 19.45 / 14.31; at 32 and 64 both with PDL are 0-1.1 % faster (64: 11.67 / 9.10 against 11.74 / 9.20).
QUANTIZER_PDL_ROWS = range(32, 65)


def quantizer_pdl(m: int) -> bool:
    """The activation quantizer on M rows may launch with PDL (``QUANTIZER_PDL_ROWS``)."""
    return m in QUANTIZER_PDL_ROWS


def linear(x: Tensor, codes: Tensor, scale: Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """x [M, K] bf16 -> [M, N] ``out_dtype`` through the kernel ``launch_config`` (or ``tiles_override``) picks: the
    GEMV on x as it is, the block GEMM on x as it is (``a16`` tiles), or the per-128 quantizer and the block GEMM.
    Every launch takes programmatic dependent launch where ``triton_pdl.resolve`` turns it on, but the quantizer
    only at ``QUANTIZER_PDL_ROWS`` (``quantizer_pdl``)."""
    if x.dim() != 2:
        raise ValueError(f"linear: x must be [M, K], got {tuple(x.shape)}")
    launch = override() or launch_config(x.shape[0], codes.shape[0], x.shape[1])
    if isinstance(launch, Gemv):
        return gemv(x, codes, scale, out_dtype=out_dtype)
    if launch.a16:
        return block_gemm_a16(x, codes, scale, out_dtype=out_dtype)
    pdl = triton_pdl.resolve(None, x.device)
    qa, sa = quantize(x, group=GROUP, pdl=pdl and quantizer_pdl(x.shape[0]))
    return block_gemm(qa, sa, codes, scale, out_dtype=out_dtype, pdl=pdl)
