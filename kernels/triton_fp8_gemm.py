"""Block-scaled FP8 GEMM in Triton: activations per token per 128 channels, weights per 128x128 tile.

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
