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
and the grid must cover the GPU: small M takes narrow column tiles (BLOCK_N 32: N/32
programs, 128 for N = 4096) and every program streams its 32 rows of the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

GROUP = 128  # the scale group along K and the weight tile edge


@triton.jit
def _block_gemm_kernel(
    a_ptr,  # [M, K] e4m3 activation codes (row-major)
    sa_ptr,  # [M, K/128] fp32 activation scales (row-major)
    w_ptr,  # [N, K] e4m3 weight codes (row-major: K contiguous, what the dot's B wants)
    sw_ptr,  # [N/128, K/128] fp32 weight tile scales (row-major)
    c_ptr,  # [M, N] output (bf16 or fp32)
    m,  # rows of a and c
    n,  # rows of w, columns of c
    k,  # columns of a and w, a multiple of 128
    stride_am,  # row strides, in elements
    stride_sam,
    stride_wn,
    stride_swn,
    stride_cm,
    BLOCK_M: tl.constexpr,  # output rows per program (>= 16: the dot's smallest M)
    BLOCK_N: tl.constexpr,  # output columns per program, divides 128
    BLOCK_K: tl.constexpr,  # = 128, one scale group per step
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    a_row = a_ptr + rows.to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    w_col = w_ptr + cols.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    sa_row = sa_ptr + rows.to(tl.int64) * stride_sam  # [BLOCK_M]
    sw_tile = sw_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_swn  # this program's weight tile row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(k, BLOCK_K)):
        kk = kb * BLOCK_K + ks
        a = tl.load(a_row + kk[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_col + kk[:, None], mask=col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        sa = tl.load(sa_row + kb, mask=row_ok, other=0.0)  # [BLOCK_M]
        sw = tl.load(sw_tile + kb)
        acc += tl.dot(a, w, out_dtype=tl.float32) * (sa[:, None] * sw)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


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
def _quantize_kernel(
    x_ptr,  # [M, K] activations (bf16 or fp32, row-major)
    q_ptr,  # [M, K] e4m3 codes out
    s_ptr,  # [M, K / GROUP] fp32 scales out (GROUP = K: one per row)
    k,  # row width K
    stride_xm,  # row strides, in elements
    stride_qm,
    stride_sm,  # scales: row and group strides (row- or column-major)
    stride_sg,
    GROUP: tl.constexpr,  # values per scale: 128, or the row padded to a power of two (per token)
    BLOCK: tl.constexpr,  # next power of two >= GROUP
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < k)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.max(tl.abs(x), axis=0) / 448.0
    s = tl.where(s > 1e-12, s, 1.0)  # an all-zero group: scale 1, codes 0
    q = _round_e4m3(tl.clamp(tl.math.div_rn(x, s), -448.0, 448.0))
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, s)


def quantize(x: Tensor, *, group: int | None, column_major: bool = False) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (codes [M, K] e4m3, scales fp32 [M, 1] (``group`` None: per token) or [M, K/group]);
    ``column_major``: the scales with strides (1, M), as cuBLASLt's 1x128 scaling reads them."""
    if x.dim() != 2:
        raise ValueError(f"quantize: x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    if group is not None and k % group:
        raise ValueError(f"quantize: K = {k} must be a multiple of the group {group}")
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = 1 if group is None else k // group
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        s = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        width = k if group is None else group
        block = triton.next_power_of_2(width)
        _quantize_kernel[(m, groups)](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            GROUP=width, BLOCK=block, num_warps=max(1, min(8, block // 512)),
        )  # fmt: skip
    return q, s


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for M rows: narrow column tiles for decode-sized M (enough programs to
    stream the weight from every SM), square tiles for prefill."""
    if m <= 16:
        return 16, 32, 4
    if m <= 64:
        return 64, 64, 4
    return 128, 128, 8


def block_gemm(qa: Tensor, sa: Tensor, codes: Tensor, scale: Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """qa [M, K] e4m3, sa [M, K/128] fp32, codes [N, K] e4m3, scale [ceil(N/128), K/128] fp32 -> [M, N] ``out_dtype``."""
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
    bm, bn, warps = _tiles(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _block_gemm_kernel[grid](
        qa, sa, codes, scale, out, m, n, k,
        qa.stride(0), sa.stride(0), codes.stride(0), scale.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=GROUP, num_warps=warps,
    )  # fmt: skip
    return out
