"""FP8 weight GEMMs against bf16 at the Qwen3-8B projection shapes, each path timed in the same run.

    python bench/fp8_gemm_gpu.py --out $OUT/fp8_gemm_gpu.json

For M (tokens) in {1, 16, 64, 256, 4096} and each projection (N x K: merged q/k/v, o, merged
gate/up, down), the median of CUDA-graph replays (``decode_gpu.time_ms``) of:

    bf16        F.linear (cuBLAS)
    fp8         per-token activation quantization + torch._scaled_mm, row-wise scales
    block       per-token-per-128 activation quantization + cuBLASLt's 1x128 x 128x128 block scaling
    triton      the same quantization + our Triton block GEMM (kernels/triton_fp8_gemm.py)

Each row gives ms, the weight bytes read over time (TB/s: decode-sized M is bound by reading the
weight) against the chip's streaming read measured in the same run, and the speed-up over bf16.
Outputs are checked against ``fp8_gemm.gemm_error_bound`` once per shape before timing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from decode_gpu import read_bandwidth, time_ms

from kvserving import jsonfmt
from kvserving.kernels import fp8_gemm

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
TOKENS = (1, 16, 64, 256, 4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_gemm_gpu.json")
    opts = ap.parse_args()
    peak, _ = read_bandwidth()
    cublas = fp8_gemm.cublas_block_supported(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: streaming read {peak:.2f} TB/s; "
          f"cuBLASLt block scaling {'available' if cublas else 'not available'}", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        wb = w.to(torch.bfloat16)
        rq, rs = fp8_gemm.quantize_tensor(w)
        rs = rs.expand(n).contiguous()
        bq, bs = fp8_gemm.quantize_blocks(w)
        bs_cublas = fp8_gemm.cublas_block_scales(bs)
        del w
        for m in TOKENS:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            paths = {
                "bf16": (lambda: F.linear(x, wb), n * k * 2),
                "fp8": (lambda: fp8_gemm.linear_cuda(x, rq, rs, scheme="rows"), n * k + 4 * n),
                "triton": (lambda: fp8_gemm.linear_cuda(x, bq, bs, scheme="block", backend="triton"), n * k + 4 * bs.numel()),
            }  # fmt: skip
            if cublas:
                paths["block"] = (lambda: fp8_gemm.linear_cuda(x, bq, bs, scheme="block", scale_cublas=bs_cublas,
                                                               backend="cublas"), n * k + 4 * bs.numel())  # fmt: skip
            for path in ("fp8", "block", "triton"):
                if path in paths:
                    codes, scale, scheme = (rq, rs, "rows") if path == "fp8" else (bq, bs, "block")
                    err = (paths[path][0]().float() - fp8_gemm.linear_ref(x.float(), codes, scale, scheme=scheme)).abs()
                    assert (err <= fp8_gemm.gemm_error_bound(x.float(), codes, scale, scheme=scheme)).all(), (name, m, path)
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
            for path, (fn, weight_bytes) in paths.items():
                ms = time_ms(fn)
                row[path] = {"ms": ms, "weight_tb_s": weight_bytes / ms / 1e9}
            for path in paths:
                row[path]["speedup_vs_bf16"] = row["bf16"]["ms"] / row[path]["ms"]
            rows.append(row)
            print(f"  {name:<8} M={m:<5} " + "  ".join(
                f"{p} {row[p]['ms'] * 1e3:7.1f} us ({row[p]['weight_tb_s']:.2f} TB/s, {row[p]['speedup_vs_bf16']:.2f}x)"
                for p in paths), flush=True)  # fmt: skip
    Path(opts.out).write_text(jsonfmt.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "read_tb_s": peak,
                                             "cublas_block": cublas, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
