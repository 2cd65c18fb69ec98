"""FP8 weight GEMMs at Qwen3-8B's projection shapes on one GPU: each path's time and the weight bytes it streams
per second, beside cuBLAS bf16 and the chip's streaming read, in one run.

    python bench/fp8_gemm_gpu.py --out $OUT/fp8_gemm_gpu.json

Paths (``kvserving.kernels.fp8_gemm``): ``bf16`` (F.linear on bf16 weights, cuBLAS), ``rows`` (activations
quantized per token, then torch._scaled_mm with row-wise scales), ``block_triton`` (per-token-per-128
activations, our block-scaled Triton GEMM), ``weight_only_rows`` / ``weight_only_block`` (our weight-only
kernel: bf16 activations, E4M3 weights widened in registers; batches of at most 16 rows). Times are medians
of CUDA-graph replays (``decode_gpu.time_ms``), the quantization of the activations included where the path
needs it; "of read" = weight bytes / time / the streaming read of the same run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from decode_gpu import read_bandwidth, time_ms  # bench/ beside this file

from kvserving.kernels import fp8_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (1, 4, 16, 64)


def paths(m: int, n: int, k: int) -> dict[str, tuple[Callable[[], Any], int]]:
    """name -> (the call, weight bytes it streams)."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    wb = w.to(torch.bfloat16)
    q_rows, s_rows = fp8_gemm.quantize_rows(w)
    s_rows = s_rows.view(n)
    q_block, s_block = fp8_gemm.quantize_blocks(w)
    out: dict[str, tuple[Callable[[], Any], int]] = {
        "bf16": (lambda: F.linear(x, wb), 2 * n * k),
        "rows": (lambda: fp8_gemm.linear_cuda(x, q_rows, s_rows, scheme="rows", backend="triton"), n * k),
        "block_triton": (lambda: fp8_gemm.linear_cuda(x, q_block, s_block, scheme="block", backend="triton"), n * k),
    }
    if m <= fp8_gemm.weight_only_rows():
        out["weight_only_rows"] = (lambda: fp8_gemm.linear_cuda(x, q_rows, s_rows, scheme="rows", backend="weight_only"), n * k)
        out["weight_only_block"] = (lambda: fp8_gemm.linear_cuda(x, q_block, s_block, scheme="block", backend="weight_only"), n * k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_gemm_gpu.json")
    args = ap.parse_args()
    bw, _ = read_bandwidth()
    rows: list[dict[str, Any]] = []
    print(f"{torch.cuda.get_device_name()}, streaming read {bw:.2f} TB/s")
    print(f"{'shape':<8} {'M':>3} " + " ".join(f"{p:>22}" for p in ("bf16", "rows", "block_triton", "weight_only_rows", "weight_only_block")))
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            cells = []
            for path, (fn, nbytes) in paths(m, n, k).items():
                ms = time_ms(fn)
                of_read = nbytes / (ms * 1e-3) / (bw * 1e12)
                rows.append({"shape": name, "n": n, "k": k, "m": m, "path": path, "ms": ms, "of_read": of_read})
                cells.append((path, f"{1e3 * ms:7.1f} us {100 * of_read:5.1f} %"))
            got = dict(cells)
            print(f"{name:<8} {m:>3} " + " ".join(f"{got.get(p, '-'):>22}" for p in
                                                  ("bf16", "rows", "block_triton", "weight_only_rows", "weight_only_block")))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "read_tb_s": bw, "rows": rows}, f, indent=1)
    print("(time per GEMM; % = weight bytes streamed per second / the streaming read)")


if __name__ == "__main__":
    main()
