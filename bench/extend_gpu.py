"""GPU benchmark of the extend (chunked-prefill) path: a chunk of new tokens after a long cached prefix. One table + JSON.

Run on the device machine (bench/gpu_run.sh extend)::

    python bench/extend_gpu.py --out $OUT/extend.json [--flashinfer] [--sweep]

Shape: Qwen3-8B-like (32 query heads, 8 KV heads, head_dim 128), one
sequence; a chunk of n in {512, 2048} new tokens after L in {8K, 32K, 128K}
cached tokens, per format (pages of 16 tokens, 32 for triaxial at 2.7 bits:
65% INT2 pages). Rows:

- ``ours``: paged_ops.extend_attention, the paged prefill kernel
  (kernels/triton_prefill.py; for nvfp4 on Hopper the Gluon kernel,
  kernels/gluon_extend.py) reading the packed prefix pages;
- ``dequant+sdpa``: what the engine ran before, the dequantize-then-attend
  path: triton_gather into a bf16 workspace, the chunk appended, masked SDPA;
- ``flashinfer``: FlashInfer's paged prefill (BatchPrefillWithPagedKVCacheWrapper,
  causal) over bf16 / fp8 pages holding prefix and chunk, in the same run.

TFLOP/s counts the causal attention's multiply-adds (2 x 2 x n x (L + (n+1)/2) x
Hq x D); "x fi bf16" is FlashInfer bf16's time on the same shape over ours.
Timings replay CUDA graphs (decode_gpu.time_ms).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from decode_gpu import HQ, D, H, Pool, read_bandwidth, time_ms

from kvserving import jsonfmt
from kvserving.kernels import paged_ops, triton_gather, triton_prefill
from kvserving.kernels.options import KernelOptions
from kvserving.worker.attention import causal_attention

PREFIXES = [8192, 32768, 131072]
CHUNKS = [512, 2048]
FORMATS = ["bf16", "fp8_e4m3", "nvfp4", "triaxial"]
OPTIONS = KernelOptions.from_env()
SM = D**-0.5
SWEEP = [(16, 4, 4, 2), (64, 8, 4, 2), (32, 8, 8, 2)]  # (chunk tokens per program, warps, prefix pages per step, stages)
SWEEP_FORMATS = ("nvfp4",)
# --variants: tl packed-kernel tilings timed on every shape: name -> (tile overrides of triton_prefill.TUNING,
# PTX unpackers)
VARIANTS: dict[str, tuple[dict[str, int], bool]] = {
    "new": ({}, True),  # the tl kernel (triton_prefill: not the Gluon kernels paged_ops runs by default on Hopper)
    "noasm": ({}, False),
    "t32-ppi8": ({"BLOCK_T": 32, "PPI": 8}, True),
    "t64-ppi4": ({"BLOCK_T": 64, "PPI": 4}, True),
    "t16-w4-ppi8": ({"BLOCK_T": 16, "PPI": 8, "num_warps": 4}, True),
    "t64-ppi2": ({"BLOCK_T": 64, "PPI": 2, "PPI2": 2}, True),
    "t32-ppi4": ({"BLOCK_T": 32, "PPI": 4, "PPI2": 4}, True),
    "s3": ({"NUM_STAGES": 3}, True),
}
# tiles meant for the other format's page size (nvfp4 16 tokens, triaxial 32)
VARIANT_SKIP = {"nvfp4": ("t64-ppi2", "t32-ppi4"), "triaxial": ("t32-ppi8", "t16-w4-ppi8", "t64-ppi4")}


def flops(n: int, prefix: int) -> float:
    return 4.0 * n * (prefix + (n + 1) / 2) * HQ * D


def flashinfer_prefill(
    fmt: str, n: int, prefix: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
) -> tuple[Callable[[], torch.Tensor], Pool]:
    """FlashInfer's paged prefill over bf16 / fp8 pages holding the prefix and the chunk (our page is its HND page)."""
    import flashinfer

    pool = Pool(fmt, 1, prefix + n)  # the chunk's pages hold random K/V too: same bytes and arithmetic
    kv_dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    kv = pool.buffer.view(kv_dtype).view(pool.pages4, 2, H, pool.p, D)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    # FA3 (the sm_90 default) has no bf16-query / fp8-KV prefill in 0.6.0 (its JIT build fails): fp8 runs on FA2
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="HND", backend="auto" if fmt == "bf16" else "fa2")
    qo = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, pool.n4], dtype=torch.int32, device="cuda")
    last = torch.full((1,), pool.p, dtype=torch.int32, device="cuda")
    wrapper.plan(qo, kv_indptr, pool.page_table.flatten(), last, HQ, H, D, pool.p, causal=True, pos_encoding_mode="NONE",
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype)  # fmt: skip
    if fmt == "bf16":
        return (lambda: wrapper.run(q, kv)), pool
    return (lambda: wrapper.run(q, kv, k_scale=pool.scale, v_scale=pool.scale)), pool


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="extend_gpu.json")
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="tuning variants of our kernel at 2K new on 32K cached")
    ap.add_argument("--prefixes", default=",".join(map(str, PREFIXES)))
    ap.add_argument("--chunks", default=",".join(map(str, CHUNKS)))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-read", action="store_true", help="skip the streaming-read yardstick")
    ap.add_argument("--no-before", action="store_true", help="skip the dequantize-then-attend rows")
    ap.add_argument("--variants", default="", help="comma-separated VARIANTS names, timed for nvfp4 / triaxial")
    ap.add_argument("--warm", action="store_true", help="only JIT-compile FlashInfer's prefill (bf16, fp8) on a tiny shape")
    args = ap.parse_args()
    if args.warm:
        for fmt in os.environ.get("WARM_FORMATS", "bf16,fp8_e4m3").split(","):  # gpu_run.sh WARM_FI=1 runs this
            q = torch.randn(64, HQ, D, device="cuda", dtype=torch.bfloat16)
            try:
                fn, _ = flashinfer_prefill(fmt, 64, 1024, q, q[:, :H], q[:, :H])
                fn()
                torch.cuda.synchronize()
                print(f"flashinfer {fmt} prefill compiled", flush=True)
            except Exception as exc:  # noqa: BLE001 - the benchmark reports it again
                print(f"flashinfer {fmt} warm-up failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        return
    prefixes = [int(x) for x in args.prefixes.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    formats = args.formats.split(",")
    dev = torch.cuda.get_device_name()
    read_tbs = 0.0
    if not args.no_read:
        read_tbs, _ = read_bandwidth(sizes_gib=(2,), ppsm=(8, 16))
    print(f"device: {dev}; read {read_tbs:.2f} TB/s; torch {torch.__version__}", flush=True)
    rows: list[dict[str, Any]] = []

    def record(fmt: str, n: int, prefix: int, impl: str, ms: float, **extra: object) -> None:
        tf = flops(n, prefix) / ms / 1e9
        rows.append({"format": fmt, "new": n, "prefix": prefix, "impl": impl, "ms": ms, "tflop_s": tf, **extra})
        print(f"{fmt:<9} {n:>5} on {prefix:>6} {impl:<30} {ms:8.3f} ms {tf:6.1f} TFLOP/s", flush=True)

    torch.manual_seed(0)
    for prefix in prefixes:
        for fmt in formats:
            pool = Pool(fmt, 1, prefix)
            row = pool.page_table[0].contiguous()
            for n in chunks:
                q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
                k_new = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16) * 2
                v_new = torch.randn_like(k_new)

                def ours(cfg: dict[str, int] | None = None) -> torch.Tensor:
                    if cfg is None:
                        return paged_ops.extend_attention(q, k_new, v_new, pool.kv, row, prefix, sm_scale=SM, options=OPTIONS)
                    return triton_prefill.launch_extend(q, k_new, v_new, pool.kv, row, prefix, sm_scale=SM, fast=True, cfg=cfg)

                ws_k = torch.empty(prefix + n, H, D, device="cuda", dtype=torch.bfloat16)
                ws_v = torch.empty_like(ws_k)

                def dequant_sdpa() -> torch.Tensor:
                    triton_gather.gather_kv(pool.kv, row, prefix, ws_k, ws_v)
                    ws_k[prefix:] = k_new
                    ws_v[prefix:] = v_new
                    return causal_attention(q, ws_k, ws_v, q_offset=prefix, sm_scale=SM)

                out = ours().float()
                ref = dequant_sdpa().float()
                err = float((out - ref).norm() / ref.norm())
                record(fmt, n, prefix, "ours", time_ms(ours), rel_diff_vs_dequant=err)
                print(f"      ours vs dequant+sdpa rel diff {err:.2e}", flush=True)
                if not args.no_before:
                    record(fmt, n, prefix, "dequant+sdpa (before)", time_ms(dequant_sdpa))
                for name in [x for x in args.variants.split(",") if x] if fmt in ("nvfp4", "triaxial") else []:
                    if name in VARIANT_SKIP.get(fmt, ()):
                        continue
                    try:
                        if name not in VARIANTS:
                            raise ValueError(f"unknown variant {name!r}: one of {sorted(VARIANTS)}")
                        tun, fast = VARIANTS[name]
                        vcfg = {**triton_prefill.TUNING[pool.layout.fmt], **tun}

                        def run() -> torch.Tensor:
                            return triton_prefill.launch_extend(q, k_new, v_new, pool.kv, row, prefix, sm_scale=SM,
                                                                fast=fast, cfg=vcfg)  # fmt: skip

                        verr = float((run().float() - ref).norm() / ref.norm())
                        record(fmt, n, prefix, f"  v {name}", time_ms(run), rel_diff_vs_dequant=verr)
                    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                        print(f"  {fmt} variant {name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                if args.sweep and prefix == 32768 and fmt in SWEEP_FORMATS:
                    base = triton_prefill.TUNING[pool.layout.fmt]
                    for bt, warps, ppi, stages in SWEEP:
                        cfg = {**base, "BLOCK_T": bt, "num_warps": warps, "PPI": ppi, "PPI2": max(1, ppi // 2), "NUM_STAGES": stages}
                        try:
                            t = time_ms(lambda: ours(cfg))
                        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                            print(f"  {fmt} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                            continue
                        record(fmt, n, prefix, f"  ours t{bt} w{warps} ppi{ppi} s{stages}", t, tuning=cfg)
                if args.flashinfer and fmt in ("bf16", "fp8_e4m3"):
                    try:
                        fn, fpool = flashinfer_prefill(fmt, n, prefix, q, k_new, v_new)
                        fi = fn().float()
                        record(fmt, n, prefix, f"flashinfer {fmt}", time_ms(fn), out_finite=bool(fi.isfinite().all()))
                        del fpool
                    except Exception as exc:  # noqa: BLE001 - report and go on: FlashInfer is a comparison only
                        print(f"flashinfer {fmt}: skipped ({type(exc).__name__}: {str(exc)[:400]})", flush=True)
                del ws_k, ws_v
            del pool
            torch.cuda.empty_cache()
            # after every format: a step cut short by its time limit keeps its rows
            Path(args.out).write_text(jsonfmt.dumps({"device": dev, "read_tb_s": read_tbs, "rows": rows}))
    fi_bf16 = {(r["new"], r["prefix"]): r["ms"] for r in rows if r["impl"] == "flashinfer bf16"}
    for r in rows:
        if (r["new"], r["prefix"]) in fi_bf16:
            r["x_fi_bf16"] = fi_bf16[(r["new"], r["prefix"])] / r["ms"]
    Path(args.out).write_text(jsonfmt.dumps({"device": dev, "read_tb_s": read_tbs, "rows": rows}))
    print(f"\n{'format':<9} {'new':>5} {'prefix':>7} {'impl':<30} {'ms':>8} {'TFLOP/s':>8} {'x fi bf16':>9} {'ms/1K ctx':>9}")
    for r in rows:
        x = f"{r['x_fi_bf16']:.2f}" if "x_fi_bf16" in r else "-"
        per = r["ms"] / ((r["prefix"] + r["new"]) / 1024)
        print(f"{r['format']:<9} {r['new']:>5} {r['prefix']:>7} {r['impl']:<30} {r['ms']:8.3f} {r['tflop_s']:8.1f} {x:>9} {per:9.4f}")
    print(f"x fi bf16 = FlashInfer bf16 paged prefill ms / this row's ms on the same shape; {dev}")


if __name__ == "__main__":
    main()
