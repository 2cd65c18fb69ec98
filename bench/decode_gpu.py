"""GPU benchmark of the paged-KV kernels: decode attention, quantize-on-write, extend gather. One table + JSON.

Run on the device machine (bench/gpu_run.sh bench)::

    python bench/decode_gpu.py --out $OUT/decode.json [--flashinfer] [--sweep]

Shape: Qwen3-8B-like (32 query heads, 8 KV heads, head_dim 128); pages of
16 tokens (32 for triaxial); (batch, context) in {(64, 4K), (32, 32K),
(4, 128K), (1, 128K)}. Triaxial runs at 2.7 average code bits: 65% of each
sequence's pages INT2 (listed first), 35% INT4. Every pool is filled by our
quantize-on-write kernels with random K/V and read through a shuffled page
table. Effective bandwidth = bytes of the pages read (scales and zeros
included) / median time. The yardstick ("% read") is the chip's read
bandwidth measured in the same run by an SM-driven streaming-read Triton
kernel (several sizes, best of 4 / 8 / 16 programs per SM); the
graph-captured ``copy_`` (bytes read + written; a memcpy node served by the
copy engines, ~1.5x below what the SMs read) is kept for reference as
"% copy". Timings replay CUDA graphs, so launch gaps are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from kvserving import jsonfmt
from kvserving.argtypes import decode_shapes
from kvserving.kernels import paged_ops, triton_decode, triton_gather, triton_write
from kvserving.kernels.layout import PageLayout
from kvserving.kernels.options import KernelOptions
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.kernels.paged_kv import PagedKV

HQ, H, D = 32, 8, 128
SHAPES = [(64, 4096), (32, 32768), (4, 131072), (1, 131072)]
FORMATS = ["bf16", "fp8_e4m3", "nvfp4", "triaxial"]
INT2_SHARE = 0.65  # of pages: 0.65 * 2 + 0.35 * 4 = 2.7 average code bits
FP8_SCALE = 0.05
NVFP4_G = 1.0 / (6 * 448) * 8
OPTIONS = KernelOptions.from_env()  # the production choice of decode kernel and decoders


def time_ms(fn: Callable[[], object], *, target_ms: float = 30.0) -> float:
    """Median ms of fn, replayed from a CUDA graph of several calls (events-per-call if capture fails)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end), 1e-3)
    n = max(1, min(200, int(target_ms / est)))
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        runs = []
        for _ in range(7):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) / n)
        return statistics.median(runs)
    except RuntimeError:
        runs = []
        for _ in range(max(5, n)):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end))
        return statistics.median(runs)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 2 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = min(time_ms(lambda: dst.copy_(src)), time_ms(lambda: dst.view(torch.int64).copy_(src.view(torch.int64))))
    del src, dst
    return 2 * n / ms / 1e9  # TB/s


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Grid-stride read of int32 [n]: each program xors its blocks together and stores one word (so no load is dead)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.int32)
    for start in range(pid * BLOCK, n, step):
        acc ^= tl.load(x_ptr + start + offs, mask=start + offs < n, other=0)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


def read_bandwidth(sizes_gib: tuple[int, ...] = (1, 2, 4), ppsm: tuple[int, ...] = (4, 8, 16)) -> tuple[float, list[dict[str, Any]]]:
    """The chip's read bandwidth (TB/s): an SM-driven streaming read, best over sizes and programs per SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs: list[dict[str, Any]] = []
    for gib in sizes_gib:
        x = torch.randint(-(2**31), 2**31 - 1, (gib << 28,), dtype=torch.int32, device="cuda")
        for per_sm in ppsm:
            grid = sms * per_sm
            out = torch.empty(grid, dtype=torch.int32, device="cuda")
            ms = time_ms(lambda: _stream_read_kernel[(grid,)](x, out, x.numel(), BLOCK=4096, num_warps=8))
            runs.append({"gib": gib, "programs_per_sm": per_sm, "ms": ms, "tb_s": x.numel() * 4 / ms / 1e9})
        del x
        torch.cuda.empty_cache()
    return max(r["tb_s"] for r in runs), runs


class Pool:
    """One layer's pages for a batch, filled through our write kernels, with its page table."""

    def __init__(self, fmt: str, batch: int, ctx: int) -> None:
        torch.manual_seed(1234)  # same K/V for bf16 / fp8 / nvfp4, so their outputs can be compared
        self.fmt = fmt
        self.tri = fmt == "triaxial"
        self.p = 32 if self.tri else 16
        self.layout = PageLayout.build("int4" if self.tri else fmt, page_size=self.p, kv_heads=H, head_dim=D)
        self.int2 = PageLayout.build("int2", page_size=self.p, kv_heads=H, head_dim=D) if self.tri else None
        per_seq = ctx // self.p
        self.n2 = round(INT2_SHARE * per_seq) if self.tri else 0
        self.n4 = per_seq - self.n2
        self.pages4, self.pages2 = batch * self.n4, batch * self.n2
        self.bytes_total = self.pages4 * self.layout.page_bytes + (self.pages2 * self.int2.page_bytes if self.int2 else 0)
        self.buffer = torch.empty(self.bytes_total, dtype=torch.uint8, device="cuda")
        ids4 = torch.randperm(self.pages4, device="cuda").int()
        ids2 = torch.randperm(self.pages2, device="cuda").int() | INT2_PAGE_FLAG
        self.page_table = torch.cat([ids2.view(batch, self.n2), ids4.view(batch, self.n4)], dim=1).contiguous()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.num_int2 = torch.full((batch,), self.n2, dtype=torch.int32, device="cuda") if self.tri else None
        self.scale = {"fp8_e4m3": FP8_SCALE, "nvfp4": NVFP4_G}.get(fmt, 1.0)
        self.kv = PagedKV(self.buffer, self.layout, self.scale, self.scale, self.int2, self.bytes_total)
        self.last_kernel: Any = None  # compiled kernel of the last decode (resources)
        self.last_plan = ""  # the Gluon launch's split plan
        self._fill(ids4, ids2)

    @property
    def int2_pages(self) -> PageLayout:
        assert self.int2 is not None, "not a triaxial pool"
        return self.int2

    def _fill(self, ids4: torch.Tensor, ids2: torch.Tensor) -> None:
        chunk = 1 << 16
        tok_total = self.pages4 * self.p
        for t0 in range(0, tok_total, chunk):
            tok = torch.arange(t0, min(t0 + chunk, tok_total), device="cuda")
            k = torch.randn(tok.numel(), H, D, device="cuda", dtype=torch.bfloat16) * 2
            v = torch.randn_like(k)
            triton_write.write_kv(self.kv, k, v, ids4[tok // self.p], (tok % self.p).int())
        for p0 in range(0, self.pages2, 1024):
            n = min(1024, self.pages2 - p0)
            k = torch.randn(n, self.p, H, D, device="cuda", dtype=torch.bfloat16) * 2
            v = torch.randn_like(k)
            triton_write.write_int2_pages(self.kv, k, v, ids2[p0 : p0 + n])

    def decode(self, q: torch.Tensor, *, kernel: str | None = None, tuning: dict[str, int] | None = None,
               fast: bool | None = None) -> torch.Tensor:  # fmt: skip
        """Decode through ``kernel`` ("tl", "gluon"; None: the one paged_ops.decode_kernel picks), keeping the
        compiled kernel. ``tuning`` overrides the kernel's tuning table; for the Gluon kernel its key SPLITS
        launches forced_plan's plan instead of the planner's."""
        kernel = kernel or paged_ops.decode_kernel(q, self.kv, options=OPTIONS)
        args = (q, self.kv, self.page_table, self.seq_lens)
        kw: dict[str, Any] = dict(sm_scale=D**-0.5, num_int2_pages=self.num_int2)
        if kernel == "gluon":
            from kvserving.kernels import gluon_decode

            cfg = {**gluon_decode.GL_TUNING[self.layout.fmt], **(tuning or {})}
            if "SPLITS" in cfg:
                plan = forced_plan(self.page_table.shape[1], cfg["num_warps"] * cfg["PPW"], cfg.pop("SPLITS"),
                                   triaxial=self.kv.triaxial)  # fmt: skip
            else:
                plan = gluon_decode.split_plan(q, self.kv, self.page_table, cfg)
            # the merge as decode_attention launches it unless the tuning says: in the kernel at few splits
            cfg.setdefault("FUSE", int(gluon_decode.merges_in_kernel(plan[0], fused_merge=OPTIONS.fused_merge)))
            out, self.last_kernel = gluon_decode.launch_decode(*args, **kw, cfg=cfg, plan=plan)
            merged = ", merged in the kernel" if cfg["FUSE"] else ""
            self.last_plan = f"splits {plan[0]} x {plan[1]} pages, {q.shape[0] * H * plan[0]} programs{merged}"
        else:
            fast = OPTIONS.fast_decoders(q.device) if fast is None else fast
            cfg = {**triton_decode.TUNING[self.layout.fmt], **(tuning or {})}
            out, self.last_kernel = triton_decode.launch_decode(*args, **kw, fast=fast, cfg=cfg)
            self.last_plan = ""
        return out


def forced_plan(pages: int, ppi: int, splits: int, *, triaxial: bool) -> tuple[int, int]:
    """(splits, pages per split) of the variant key SPLITS: time a plan the planners would not pick.

    Plain pages: ``splits`` chunks of the page-table width, ceil(pages / splits) pages each rounded up to a whole
    step (ppi pages; the kernel's loop needs it), so the grid can come out with fewer splits than asked (256 pages,
    SPLITS 3: 3 x 88; SPLITS 100 at 4 pages a step: 64 x 4). Triaxial: SPLITS counts the grid's splits as the
    planners do, the INT2 / INT4 boundary's included -- a row runs ceil(n2 / pps) INT2 and ceil(n4 / pps) INT4
    programs, at most one more than ceil(pages / pps) (the kernel's ``c2``), so SPLITS k cuts the width into
    k - 1 chunks, and k must be at least 2."""
    least = 2 if triaxial else 1
    if splits < least:
        why = " for triaxial pages (one split is the INT2 / INT4 boundary's)" if triaxial else ""
        raise ValueError(f"SPLITS must be >= {least}{why}, got {splits}")
    chunks = splits - (1 if triaxial else 0)
    pps = -(-(-(-max(pages, 1) // chunks)) // ppi) * ppi
    return -(-max(pages, 1) // pps) + (1 if triaxial else 0), pps


def flashinfer_decode(pool: Pool, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged decode over the same pages (our bf16/fp8 page is FlashInfer's HND [2, H, P, D])."""
    import flashinfer

    b = q.shape[0]
    kv_dtype = torch.bfloat16 if pool.fmt == "bf16" else torch.float8_e4m3fn
    kv = pool.buffer.view(kv_dtype).view(pool.pages4, 2, H, pool.p, D)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND")
    indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * pool.n4
    last = torch.full((b,), pool.p, dtype=torch.int32, device="cuda")
    wrapper.plan(indptr, pool.page_table.flatten(), last, HQ, H, D, pool.p, pos_encoding_mode="NONE",
                 q_data_type=torch.bfloat16, kv_data_type=kv_dtype)  # fmt: skip
    if pool.fmt == "bf16":
        return lambda: wrapper.run(q, kv)
    return lambda: wrapper.run(q, kv, k_scale=pool.scale, v_scale=pool.scale)


SWEEP = [  # (pages per iteration, INT2 pages per iteration, warps, pipeline stages, register cap)
    (8, 8, 4, 2, 128),
    (8, 8, 4, 2, 144),
    (8, 8, 4, 3, 128),
    (4, 1, 4, 2, 0),
    (4, 2, 4, 2, 0),
    (4, 2, 4, 2, 128),
    (8, 2, 4, 2, 128),
    (4, 1, 4, 3, 0),
]


def resources(pool: Pool) -> str:
    k = pool.last_kernel
    if k is None:
        return ""
    return f"regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} smem {k.metadata.shared} {pool.last_plan}".rstrip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_gpu.json")
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time tuning variants (Gluon: every shape; tl: 32x32K)")
    ap.add_argument("--shapes", type=decode_shapes, default=",".join(f"{b}x{c}" for b, c in SHAPES))
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--variants", default="", help='JSON list of Gluon tunings timed next to the default, e.g. [{"SPLITS": 3}]')
    ap.add_argument("--no-tl", action="store_true", help="skip the tl kernel rows of the packed formats")
    ap.add_argument("--no-writes", action="store_true", help="skip the write / gather rows")
    args = ap.parse_args()
    gl_variants: list[dict[str, Any]] = json.loads(args.variants) if args.variants else []
    shapes = args.shapes
    formats = args.formats.split(",")
    if unknown := [f for f in formats if f not in FORMATS]:
        ap.error(f"--formats: unknown {', '.join(unknown)}; expected some of {', '.join(FORMATS)}")
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    copy_tbs = copy_bandwidth()
    read_tbs, read_runs = read_bandwidth()
    for r in read_runs:
        print(f"streaming read {r['gib']} GiB, {r['programs_per_sm']:>2} programs/SM: {r['ms']:.3f} ms {r['tb_s']:.2f} TB/s", flush=True)
    print(f"device: {dev}; read {read_tbs:.2f} TB/s (SM streaming read, the yardstick); copy {copy_tbs:.2f} TB/s "
          f"(graph-captured copy_, read+write, reference only); torch {torch.__version__}", flush=True)  # fmt: skip
    rows: list[dict[str, Any]] = []

    def record(shape: tuple[int, int], impl: str, ms: float, nbytes: int, **extra: object) -> None:
        tbs = nbytes / ms / 1e9
        rows.append({"batch": shape[0], "context": shape[1], "impl": impl, "ms": ms, "bytes": nbytes,
                     "tb_s": tbs, "of_read": tbs / read_tbs, "of_copy": tbs / copy_tbs, **extra})  # fmt: skip
        print(f"{shape[0]:>3}x{shape[1]:<6} {impl:<26} {ms:8.3f} ms {nbytes / 1e9:7.3f} GB {tbs:5.2f} TB/s "
              f"{100 * tbs / read_tbs:5.1f}% read {100 * tbs / copy_tbs:5.1f}% copy", flush=True)  # fmt: skip

    for shape in shapes:
        b, ctx = shape
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        outs: dict[str, torch.Tensor] = {}
        for fmt in formats:
            pool = Pool(fmt, b, ctx)
            pool_bytes = pool.bytes_total
            ms = time_ms(lambda: pool.decode(q))
            outs[fmt] = pool.decode(q).float()
            record(shape, f"ours {fmt}", ms, pool_bytes, resources=resources(pool))
            print("      " + resources(pool), flush=True)
            if fmt in ("nvfp4", "triaxial", "fp8_e4m3") and gl_variants:
                from kvserving.kernels import gluon_decode

                base = gluon_decode.GL_TUNING.get(pool.layout.fmt, {})
                for var in gl_variants:
                    if fmt not in var.get("FORMATS", fmt).split(","):  # a variant may name the formats it is for
                        continue
                    tune = {k: v for k, v in var.items() if k != "FORMATS"}
                    cfg = {**base, **tune}
                    name = " ".join(f"{k}{v}" for k, v in tune.items())
                    try:
                        t = time_ms(lambda: pool.decode(q, kernel="gluon", tuning=cfg))
                        err = float((pool.decode(q, kernel="gluon", tuning=cfg).float() - outs[fmt]).norm() / outs[fmt].norm())
                    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                        print(f"  {fmt} gluon {name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        continue
                    record(shape, f"  {fmt} {name}", t, pool_bytes, tuning=cfg, rel_diff_vs_default=err,
                           resources=resources(pool))  # fmt: skip
                    print(f"      {resources(pool)}; vs default output rel diff {err:.2e}", flush=True)
            if (
                fmt in ("nvfp4", "triaxial", "fp8_e4m3")
                and not args.no_tl
                and paged_ops.decode_kernel(q, pool.kv, options=OPTIONS) == "gluon"
            ):
                # the tl kernel (what CI's interpreter runs) next to the default Gluon one
                t = time_ms(lambda: pool.decode(q, kernel="tl"))
                err = float((pool.decode(q, kernel="tl").float() - outs[fmt]).norm() / outs[fmt].norm())
                record(shape, f"  {fmt} tl kernel", t, pool_bytes, rel_diff_vs_gluon=err)
                print(f"      tl vs gluon output rel diff {err:.2e}", flush=True)
            if args.sweep and fmt in ("nvfp4", "triaxial"):
                from kvserving.kernels import gluon_decode

                base = gluon_decode.GL_TUNING[pool.layout.fmt]
                variants = ((4, 4), (4, 8), (4, 32), (2, 8), (2, 32)) if fmt == "triaxial" else ((2, 4), (2, 8), (2, 32), (4, 16))
                for warps, ppsm in variants:
                    regs = base.get("maxnreg", 0)
                    cfg = {**base, "num_warps": warps, "PPSM": ppsm, "maxnreg": regs}
                    try:
                        t = time_ms(lambda: pool.decode(q, kernel="gluon", tuning=cfg))
                    except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                        print(f"  {fmt} gluon {cfg}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        continue
                    record(shape, f"  {fmt} gluon w{warps} ppsm{ppsm} r{regs}", t, pool_bytes, tuning=cfg, resources=resources(pool))
                    print("      " + resources(pool), flush=True)
            if args.sweep and shape == (32, 32768) and fmt not in ("nvfp4", "triaxial"):
                for ppi, ppi2, warps, stages, regs in SWEEP:
                    if fmt != "triaxial" and ppi2 != ppi:
                        continue
                    cfg = {"PPI": ppi, "PPI2": ppi2, "num_warps": warps, "NUM_STAGES": stages, "PPSM": 16, "maxnreg": regs}
                    try:
                        t = time_ms(lambda: pool.decode(q, kernel="tl", tuning=cfg))
                    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                        print(f"  {fmt} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    record(shape, f"  {fmt} {ppi}/{ppi2}/{warps}/{stages}/r{regs}", t, pool_bytes, tuning=cfg, resources=resources(pool))
                    print("      " + resources(pool), flush=True)
                t = time_ms(lambda: pool.decode(q, kernel="tl", fast=False))
                record(shape, f"  {fmt} arithmetic decoders", t, pool_bytes)
            if args.flashinfer and fmt in ("bf16", "fp8_e4m3"):
                try:
                    fn = flashinfer_decode(pool, q)
                    ref = fn().float()
                    err = float((ref - outs[fmt]).norm() / ref.norm())
                    record(shape, f"flashinfer {fmt}", time_ms(fn), pool_bytes, rel_diff_vs_ours=err)
                except Exception as exc:  # noqa: BLE001 - report and go on: FlashInfer is a comparison only
                    print(f"flashinfer {fmt}: skipped ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
            if shape == (32, 32768) and not args.no_writes:
                # quantize-on-write: 32K new tokens into this pool's pages; bytes = bf16 in + pages out
                tok = torch.arange(32768, device="cuda")
                k = torch.randn(32768, H, D, device="cuda", dtype=torch.bfloat16)
                ids = pool.page_table[:, pool.n2 :].flatten()[tok // pool.p].contiguous()
                slots = (tok % pool.p).int()
                wbytes = 2 * k.numel() * 2 + 32768 // pool.p * pool.layout.page_bytes
                t = time_ms(lambda: triton_write.write_kv(pool.kv, k, k, ids, slots))
                record(shape, f"write_kv {pool.layout.fmt}", t, wbytes)
                if pool.tri:
                    pk = torch.randn(1024, pool.p, H, D, device="cuda", dtype=torch.bfloat16)
                    ids2 = pool.page_table[:, : pool.n2].flatten()[:1024].contiguous()
                    wb2 = 2 * pk.numel() * 2 + 1024 * pool.int2_pages.page_bytes
                    t = time_ms(lambda: triton_write.write_int2_pages(pool.kv, pk, pk, ids2))
                    record(shape, "write_int2_pages", t, wb2)
                # extend: dequantize one sequence's whole cached prefix into a bf16 workspace
                ws_k = torch.empty(ctx, H, D, device="cuda", dtype=torch.bfloat16)
                ws_v = torch.empty_like(ws_k)
                row = pool.page_table[0]
                gbytes = pool.n4 * pool.layout.page_bytes + pool.n2 * (pool.int2.page_bytes if pool.int2 else 0) + 2 * ws_k.numel() * 2
                t = time_ms(lambda: triton_gather.gather_kv(pool.kv, row, ctx, ws_k, ws_v))
                record(shape, f"gather_kv {fmt} ({ctx} tok)", t, gbytes)
            del pool
            torch.cuda.empty_cache()
        # after every shape: a run cut short by its time limit keeps its rows
        Path(args.out).write_text(jsonfmt.dumps({"device": dev, "read_tb_s": read_tbs, "read_runs": read_runs, "copy_tb_s": copy_tbs,
                                                 "yardstick": "read", "rows": rows, "partial": True}))  # fmt: skip
        if "bf16" in outs:
            for fmt, o in outs.items():
                if fmt not in ("bf16", "triaxial"):
                    print(f"    {fmt} vs bf16 output rel diff {float((o - outs['bf16']).norm() / outs['bf16'].norm()):.3e}")
    copy_end = copy_bandwidth()
    read_end, _ = read_bandwidth(sizes_gib=(2,), ppsm=(8, 16))
    print(f"copy bandwidth at the start {copy_tbs:.2f}, at the end {copy_end:.2f} TB/s; read {read_tbs:.2f} / {read_end:.2f}", flush=True)
    Path(args.out).write_text(jsonfmt.dumps({"device": dev, "read_tb_s": read_tbs, "read_tb_s_end": read_end, "read_runs": read_runs,
                                             "copy_tb_s": copy_tbs, "copy_tb_s_end": copy_end, "yardstick": "read", "rows": rows}))  # fmt: skip
    print(
        f"\n% read = of the SM streaming-read yardstick {read_tbs:.2f} TB/s; % copy = of the graph-captured copy_ {copy_tbs:.2f} TB/s (reference)"
    )
    print(f"{'shape':<10} {'impl':<26} {'ms':>8} {'TB/s':>6} {'%read':>6} {'%copy':>6}")
    for r in rows:
        print(
            f"{r['batch']}x{r['context']:<7} {r['impl']:<26} {r['ms']:8.3f} {r['tb_s']:6.2f} {100 * r['of_read']:5.1f}% {100 * r['of_copy']:5.1f}%"
        )
    print(f"read {read_tbs:.2f} TB/s (yardstick), copy {copy_tbs:.2f} TB/s, on {dev}")


if __name__ == "__main__":
    main()
