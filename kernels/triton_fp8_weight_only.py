"""FP8 weights times bf16 activations for decode-sized batches: the weight streams once, nothing is quantized.

    y[m, n] = s[n] * sum_k x[m, k] * q[n, k]                          (rows: one scale per output row)
    y[m, n] = sum_kb s[n // 128, kb] * sum_{k in kb} x[m, k] * q[n, k]   (block: one scale per 128x128 tile)

A decode step multiplies a few tokens by each weight, so its time is the weight's bytes over
the read bandwidth. Quantizing the activations first (what the FP8 tensor-core GEMMs need)
costs an amax, a divide and a cast per linear layer: more time at batch 1 than reading the
FP8 weight itself. Here each program widens its E4M3 weight tile to bf16 in registers (every
E4M3 value is exact in bf16) and runs a bf16 tensor-core dot against the activation rows,
accumulating in fp32: the result is the dequantized-weight product up to the sum order and
the bf16 rounding of the output (``fp8_gemm.linear_ref``'s arithmetic). Triton's interpreter
has no bf16 dot, so there (CPU tests) the same tiles are multiplied in fp32, which holds the
same values: a bf16 activation and a widened E4M3 code are exact in both.

Tiles: BLOCK_M = 16 (the dot's smallest M; rows past M are masked), BLOCK_N = 16 output
columns per program so that N / 16 programs (256 for N = 4096) keep every SM streaming, and
BLOCK_K = 128 (one block-scale group per step; row scales apply once at the end).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvserving.kernels.options import KernelOptions

GROUP = 128  # the block layout's tile edge
MAX_M = 16  # rows this kernel takes; larger batches use the FP8 tensor-core GEMMs
SCHEME_CODES = {"rows": 0, "block": 1}


@triton.jit
def _weight_only_kernel(
    x_ptr,  # [M, K] bf16 activations (row-major)
    w_ptr,  # [N, K] e4m3 weight codes (row-major: K contiguous)
    s_ptr,  # rows: [N] fp32; block: [N/128, K/128] fp32 (row-major)
    bias_ptr,  # [N] bias in the output dtype, or the weight pointer when HAS_BIAS is 0 (never read)
    y_ptr,  # [M, N] output (bf16)
    m,  # rows of x and y (<= BLOCK_M)
    n,  # rows of w, columns of y
    k,  # columns of x and w, a multiple of BLOCK_K
    stride_xm,  # row strides, in elements
    stride_wn,
    stride_sn,  # block scales' row stride (unused for rows)
    stride_ym,
    SCHEME: tl.constexpr,  # 0 rows, 1 block
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= 16, >= m
    BLOCK_N: tl.constexpr,  # output columns per program; divides 128 (block: one weight tile row per program)
    BLOCK_K: tl.constexpr,  # = 128: one block-scale group per step
    DOT: tl.constexpr,  # the dot's operand type: bf16 (tensor cores); fp32 under the interpreter (no bf16 dot)
):
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    x_row = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]
    # The weight is read unmasked: the last program's columns past N re-read row N - 1 (their results are not
    # stored) and K is a multiple of BLOCK_K, so no E4M3 lane is ever a fill value (0x7F would be NaN).
    w_col = w_ptr + tl.minimum(cols, n - 1).to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, k // BLOCK_K):
        kk = kb * BLOCK_K + ks
        x = tl.load(x_row + kk[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K] bf16
        q = tl.load(w_col + kk[:, None])  # [BLOCK_K, BLOCK_N] e4m3
        part = tl.dot(x.to(DOT), q.to(DOT), out_dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
        if SCHEME == 1:
            acc += part * tl.load(s_ptr + (pid_n * BLOCK_N // 128) * stride_sn + kb)
        else:
            acc += part
    if SCHEME == 0:
        acc *= tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _dot_type() -> tl.dtype:
    """bf16 tensor-core dots; fp32 under Triton's interpreter, which has no bf16 dot (read once)."""
    return tl.float32 if KernelOptions.from_env().interpret else tl.bfloat16


def weight_only_gemm(x: Tensor, codes: Tensor, scale: Tensor, *, scheme: str, bias: Tensor | None = None) -> Tensor:
    """x [M, K] bf16 (M <= MAX_M), codes [N, K] e4m3, scale rows [N] / block [ceil(N/128), K/128] fp32 ->
    [M, N] bf16 (``fp8_gemm.linear_ref``'s product up to sum order and output rounding)."""
    if scheme not in SCHEME_CODES:
        raise ValueError(f"weight_only_gemm: scheme must be one of {sorted(SCHEME_CODES)}, got {scheme!r}")
    if x.dim() != 2 or codes.dim() != 2 or x.shape[1] != codes.shape[1]:
        raise ValueError(f"weight_only_gemm: x {tuple(x.shape)} and codes {tuple(codes.shape)} must be [M, K] and [N, K]")
    m, k = x.shape
    n = codes.shape[0]
    if k % GROUP:
        raise ValueError(f"weight_only_gemm: K = {k} must be a multiple of {GROUP}")
    if m > MAX_M:
        raise ValueError(f"weight_only_gemm: M = {m} rows; at most {MAX_M} (larger batches use the FP8 GEMMs)")
    if x.dtype != torch.bfloat16 or codes.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise ValueError(f"weight_only_gemm: x bf16, codes float8_e4m3fn, scale float32; got {x.dtype}, "
                         f"{codes.dtype}, {scale.dtype}")  # fmt: skip
    want = (n,) if scheme == "rows" else ((n + GROUP - 1) // GROUP, (k + GROUP - 1) // GROUP)
    if tuple(scale.shape) != want:
        raise ValueError(f"weight_only_gemm: {scheme} scale {tuple(scale.shape)} must be {want}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"weight_only_gemm: bias {tuple(bias.shape)} must be ({n},)")
    x, codes, scale = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, codes, scale))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_n = 16
    _weight_only_kernel[(triton.cdiv(n, block_n),)](
        x, codes, scale, codes if bias is None else bias.contiguous(), y, m, n, k,
        x.stride(0), codes.stride(0), scale.stride(0) if scheme == "block" else 0, y.stride(0),
        SCHEME=SCHEME_CODES[scheme], HAS_BIAS=int(bias is not None), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=GROUP,
        DOT=_dot_type(), num_warps=4, num_stages=4,
    )  # fmt: skip
    return y
