"""GPU benchmark of quantize-on-write: write_kv (fp8, nvfp4, int4, bf16) and write_int2_pages against a device copy.

Run on the device machine, with the repo importable as ``kvserving`` (see
bench/gpu_run.sh, which sets PYTHONPATH=/tmp/kvpkg)::

    python3 bench/write_gpu.py --out $OUT/write.json

Shape: 32K new tokens x 8 kv heads x head_dim 128 (bf16 K and V), into
pages of 16 tokens (bf16, fp8, nvfp4) or 32 (int4), page order shuffled,
slots in order; 1024 whole INT2 pages of 32 tokens. Bytes of an op = bf16 K
and V read + page bytes written (scales and zeros included). The copy row
copies the same K and V input bytes device to device (read + write).
Timings are medians of CUDA-graph replays (``time_ms`` from decode_gpu.py).

Each format's launch shape (WRITE_TUNING, INT2_TUNING) and a few others are timed, and each
shape's bytes are compared once with the torch reference (paged_ref on CPU
copies of the inputs): OK or MISMATCH (exit code 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

from kvserving import jsonfmt
from kvserving.kernels import paged_ref, triton_write
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.kernels.paged_kv import PagedKV

T, H, D = 32768, 8, 128
INT2_PAGES = 1024
BRIEF_COPY_TBS = 2.99  # the H100's device-to-device copy bandwidth from the brief (read + write)
SCALES = {"bf16": 1.0, "fp8_e4m3": 0.05, "nvfp4": 1.0 / (6 * 448) * 8, "int4": 1.0}
PAGE = {"bf16": 16, "fp8_e4m3": 16, "nvfp4": 16, "int4": 32}

# (label, format, launch_write_kv's num_warps and bt; None: write_kv's own shape); (label, launch_int2_keys' heads
# and num_warps, launch_int2_values' num_warps; None: write_int2_pages' own)
KV_VARIANTS: list[tuple[str, str, tuple[int, int] | None]] = [
    ("write_kv fp8_e4m3", "fp8_e4m3", None),
    ("write_kv bf16", "bf16", None),
    ("write_kv nvfp4 (rows)", "nvfp4", None),
    ("write_kv int4 (groups, 4 warps)", "int4", None),
    ("write_kv int4 (groups, 2 warps)", "int4", (2, 0)),
    ("write_kv int4 (groups, 8 warps)", "int4", (8, 0)),
]
INT2_VARIANTS: list[tuple[str, tuple[int, int, int] | None]] = [
    ("write_int2_pages (keys 1 head/1 warp, values 4 warps)", None),
    ("write_int2_pages (values 8 warps)", (1, 1, 8)),
    ("write_int2_pages (keys 2 heads/2 warps)", (2, 2, 4)),
]


def write_kv(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor,
             shape: tuple[int, int] | None) -> None:  # fmt: skip
    if shape is None:
        triton_write.write_kv(kv, k, v, ids, slots)
    else:
        triton_write.launch_write_kv(kv, k, v, ids, slots, num_warps=shape[0], bt=shape[1])


def write_int2_pages(kv: PagedKV, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor,
                     shape: tuple[int, int, int] | None) -> None:  # fmt: skip
    if shape is None:
        triton_write.write_int2_pages(kv, k, v, ids)
    else:
        triton_write.launch_int2_keys(kv, k, ids, heads=shape[0], num_warps=shape[1])
        triton_write.launch_int2_values(kv, v, ids, num_warps=shape[2])


# ----------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------


def _time_ms() -> Callable[..., float]:
    """``time_ms`` of bench/decode_gpu.py (loaded by path: bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("decode_gpu", Path(__file__).with_name("decode_gpu.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn: Callable[..., float] = mod.time_ms
    return fn


def main() -> int:
    ap = argparse.ArgumentParser(description="time the quantize-on-write kernels against a device copy")
    ap.add_argument("--out", default="write_gpu.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("write_gpu.py needs a CUDA device (run it on the device machine)", file=sys.stderr)
        return 2
    time_ms = _time_ms()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    k = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) * 2
    v = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = k.cpu(), v.cpu()
    in_bytes = 2 * k.numel() * k.element_size()

    dst_k, dst_v = torch.empty_like(k), torch.empty_like(v)

    def copy() -> None:
        dst_k.copy_(k)
        dst_v.copy_(v)

    copy_ms = time_ms(copy)
    copy_tbs = 2 * in_bytes / copy_ms / 1e9
    print(f"device: {dev}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows: list[dict[str, Any]] = []

    def record(op: str, ms: float, nbytes: int, check: str) -> None:
        tbs = nbytes / ms / 1e9
        rows.append(
            {"op": op, "ms": ms, "bytes": nbytes, "tb_s": tbs, "of_copy": tbs / copy_tbs, "of_brief": tbs / BRIEF_COPY_TBS, "check": check}
        )
        print(f"{op:<58} {ms:7.4f} ms {tbs:5.2f} TB/s {100 * tbs / copy_tbs:5.1f}% {100 * tbs / BRIEF_COPY_TBS:5.1f}%  {check}", flush=True)

    record("copy K and V (torch copy_, read + write)", copy_ms, 2 * in_bytes, "-")

    tok = torch.arange(T, device="cuda")
    refs: dict[str, torch.Tensor] = {}
    for label, fmt, tuning in KV_VARIANTS:
        p = PAGE[fmt]
        layout = PageLayout.build(fmt, page_size=p, kv_heads=H, head_dim=D)
        n = T // p
        gen = torch.Generator().manual_seed(1)
        ids = torch.randperm(n, generator=gen).int().cuda()[tok // p].contiguous()
        slots = (tok % p).int()
        buf = torch.zeros(n * layout.page_bytes, dtype=torch.uint8, device="cuda")
        sc = SCALES[fmt]
        kv = PagedKV(buf, layout, sc, sc)
        write_kv(kv, k, v, ids, slots, tuning)
        if fmt not in refs:
            ref = torch.zeros(n * layout.page_bytes, dtype=torch.uint8)
            paged_ref.write_kv(PagedKV(ref, layout, sc, sc), kc, vc, ids.cpu(), slots.cpu())
            refs[fmt] = ref
        check = "OK" if torch.equal(buf.cpu(), refs[fmt]) else "MISMATCH"
        ms = time_ms(lambda: write_kv(kv, k, v, ids, slots, tuning))
        record(label, ms, in_bytes + n * layout.page_bytes, check)

    # whole INT2 pages: K and V [N, P, H, D]
    layout2 = PageLayout.build("int2", page_size=32, kv_heads=H, head_dim=D)
    pk = k[: INT2_PAGES * 32].reshape(INT2_PAGES, 32, H, D)
    pv = v[: INT2_PAGES * 32].reshape(INT2_PAGES, 32, H, D)
    total = INT2_PAGES * layout2.page_bytes
    ids2 = (torch.randperm(INT2_PAGES, generator=torch.Generator().manual_seed(2)) | INT2_PAGE_FLAG).int()
    ref2 = torch.zeros(total, dtype=torch.uint8)
    layout4 = PageLayout.build("int4", page_size=32, kv_heads=H, head_dim=D)
    paged_ref.write_int2_pages(PagedKV(ref2, layout4, int2_layout=layout2), pk.cpu(), pv.cpu(), ids2)
    ids2 = ids2.cuda()
    buf2 = torch.zeros(total, dtype=torch.uint8, device="cuda")
    kv2 = PagedKV(buf2, layout4, int2_layout=layout2)
    in2 = 2 * pk.numel() * pk.element_size()
    for label, tuning2 in INT2_VARIANTS:
        buf2.zero_()
        write_int2_pages(kv2, pk, pv, ids2, tuning2)
        check = "OK" if torch.equal(buf2.cpu(), ref2) else "MISMATCH"
        ms = time_ms(lambda: write_int2_pages(kv2, pk, pv, ids2, tuning2))
        record(label, ms, in2 + total, check)
    # the two launches apart (bytes: their half of the input + their fields of the pages)
    cfg = triton_write.INT2_TUNING
    key_bytes = sum(layout2.field(f).nbytes for f in ("k", "k_scale", "k_zero")) * INT2_PAGES
    ms = time_ms(lambda: triton_write.launch_int2_keys(kv2, pk, ids2, heads=cfg["heads"], num_warps=cfg["key_warps"]))
    record("  INT2 keys launch alone", ms, in2 // 2 + key_bytes, "-")
    ms = time_ms(lambda: triton_write.launch_int2_values(kv2, pv, ids2, num_warps=cfg["value_warps"]))
    record("  INT2 values launch alone", ms, in2 // 2 + total - key_bytes, "-")

    print(f"\n{'op':<58} | {'ms':>7} | {'TB/s':>5} | {'% of copy':>9} | {'% of 2.99':>9} | check")
    for r in rows:
        print(f"{r['op']:<58} | {r['ms']:7.4f} | {r['tb_s']:5.2f} | {100 * r['of_copy']:9.1f} | {100 * r['of_brief']:9.1f} | {r['check']}")
    print(f"copy of the same input bytes: {copy_tbs:.2f} TB/s on {dev}")
    Path(args.out).write_text(
        jsonfmt.dumps(
            {"device": dev, "copy_tb_s": copy_tbs, "tokens": T, "kv_heads": H, "head_dim": D, "int2_pages": INT2_PAGES, "rows": rows}
        )
    )
    return 1 if any(r["check"] == "MISMATCH" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
