"""FP8 weight GEMMs against bf16 at the Qwen3-8B projection shapes: the block GEMM's tile shapes side by side, one run.

    python bench/fp8_gemm_gpu.py --out $OUT/fp8_gemm_gpu.json [--tokens 1,2,4,16] [--tiles 16x32w4s3k1,16x64w4s4k2]
                                 [--gemv g32x512w4s1,g16x512w4s2k1]

For M (tokens) in ``--tokens`` and each projection (N x K: merged q/k/v, o, merged gate/up,
down), the median of CUDA-graph replays (``decode_gpu.time_ms``) of:

    bf16            F.linear (cuBLAS)
    rows            per-token activation quantization + torch._scaled_mm, row-wise scales
    rows_gemm       torch._scaled_mm alone (activation quantized beforehand)
    block           per-token-per-128 quantization + cuBLASLt's 1x128 x 128x128 scaling (where torch has it)
    quant           the per-token-per-128 quantizer alone (a part of every triton path)
    triton:default  the quantizer + our block GEMM at ``tile_config``'s launch shape for (M, N, K)
    triton:<tiles>  the same at each ``--tiles`` shape (``Tiles.label``: BMxBN, warps, stages, K splits),
                    handed to the launch through ``tiles_override``
    gemv:default    (M <= 4) our GEMV on the bf16 activations at ``gemv_config``'s launch shape
    gemv:<launch>   the same at each ``--gemv`` shape (``Gemv.label``: gBNxBK, warps, stages, K splits; without
                    ``k<S>`` the splits follow ``gemv_split`` at each shape)
    dispatch        ``linear_cuda`` as the engine calls it (backend "triton": ``launch_config``'s kernel;
                    at M <= 4 the same launch as gemv:default, so the two differ by the noise)
    bf16_gemv:default  (M <= 4) the same GEMV on the bf16 weight, unscaled, at ``gemv_config``'s launch shape
                    (what ``worker.model.product`` runs at M <= 2 unless ``KVSERVING_BF16_GEMV=0``)
    bf16_gemv:<launch> the same at each ``--bf16-gemv`` shape
    bf16_tiles:default  (M > 2) the block GEMM on the bf16 weight and activations, unscaled, at ``bf16_tile_config``'s
                    launch (the candidate for a bf16 model's projections at decode batch sizes, beside cuBLAS)
    bf16_tiles:<launch> the same at each ``--bf16-tiles`` shape (a Tiles label without its BLOCK_M, which is the
                    row tile holding M: ``64w4s4k4``, ``128w8s3k2b64``)

Each call reads its weight from HBM: the weights rotate over copies whose total passes
``--rotate-mb`` (L2 is 50-60 MB; a decode step's layers never find their weight there).
Each path's output is checked once per shape against ``fp8_gemm.gemm_error_bound``; a path
outside it, or one that does not compile, is reported and left out of the ranking.
Printed: per M a table of us and speed-up over bf16, the weight bytes read per second against
the chip's streaming read measured in the same run, and the one-layer sums; JSON holds all.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
from decode_gpu import read_bandwidth, time_ms
from triton.errors import TritonError

from kvserving import jsonfmt
from kvserving.kernels import fp8_gemm, triton_fp8_gemm
from kvserving.kernels.gemm_plan import (
    GEMV_ROWS,
    Gemv,
    Tiles,
    bf16_tile_config,
    gemv_config,
    gemv_split,
    row_tile,
    tile_config,
    tiles_override,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
# The former fixed decode shape first, then narrower tiles and fewer splits than tile_config's picks, more splits,
# stages, warps and wider column tiles around them.
CANDIDATES = (
    "16x32w4s3k1", "16x32w4s4k2", "16x64w4s4k1", "16x64w4s4k2", "16x64w4s4k4",
    "16x64w4s4k8", "16x64w4s6k4", "16x64w8s4k4", "16x128w4s4k4",
)  # fmt: skip
# GEMV shapes around gemv_config's g32x512w4s2: no pipelining, deeper, narrower and wider tiles, 8 warps, and 16-row
# tiles with no split (no partials' sum launch; o and down then run 256 programs).
GEMV_CANDIDATES = ("g32x512w4s1", "g32x512w4s3", "g16x512w4s2", "g64x256w4s2", "g32x256w4s2", "g32x512w8s2", "g16x512w4s2k1",
                   "g16x1024w4s2")  # fmt: skip


# bf16 GEMV shapes around gemv_config's (8-row tiles, 1024-2048 wide steps, no split at these shapes): a bf16 step
# holds twice the fp8 one's bytes, so narrower steps and tiles, and more warps, are the neighbours worth timing.
BF16_GEMV_CANDIDATES = ("g8x2048w4s1k1", "g8x1024w4s1k1", "g4x2048w4s1k1", "g4x1024w4s1k1", "g8x512w4s1k1", "g16x1024w4s1k1",
                        "g8x2048w8s1k1", "g16x2048w8s1k1")  # fmt: skip


# bf16 block GEMM shapes around bf16_tile_config's (64 columns, 4 stages of 128, K split to about one program an
# SM): other splits, wider column tiles, 8 warps, 64-wide K steps and deeper pipelines.
BF16_TILE_CANDIDATES = ("64w4s4k2", "64w4s4k8", "128w4s4k4", "128w8s4k4", "128w8s4k2", "128w4s3k8", "64w4s4k4b64",
                        "64w4s6k4b64", "64w8s4k4", "32w4s4k8", "64w4s5k4", "128w8s4k4b64")  # fmt: skip


def _bf16_tiles_list(text: str) -> list[str]:
    labels = [t.strip() for t in text.split(",") if t.strip()]
    for t in labels:
        try:
            Tiles.parse("16x" + t)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return labels


def _bf16_tiles_at(label: str, m: int) -> Tiles:
    """A ``--bf16-tiles`` label at M: its BLOCK_M is the row tile for M (``row_tile``)."""
    return Tiles.parse(f"{row_tile(m)}x{label}")


def _gemv_list(text: str) -> list[str]:
    """Labels with or without ``k<S>`` (without: ``gemv_split`` per shape), checked here."""
    labels = [t.strip() for t in text.split(",") if t.strip()]
    for t in labels:
        try:
            Gemv.parse(t if "k" in t else t + "k1")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return labels


def _gemv_at(label: str, n: int, k: int) -> Gemv:
    """A ``--gemv`` label at one shape: its splits, or ``gemv_split``'s for its tile."""
    if "k" in label:
        return Gemv.parse(label)
    g = Gemv.parse(label + "k1")
    return Gemv(g.block_n, g.block_k, g.warps, g.stages, gemv_split(triton.cdiv(n, g.block_n), k // g.block_k))


def _tiles_list(text: str) -> list[Tiles]:
    try:
        return [Tiles.parse(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: expected comma-separated integers") from None
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"--tokens {text!r}: every M must be >= 1")
    return tokens


def _rotating(copies: list[Any], call: Callable[[Any], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """fn() calling ``call`` on the next copy each time (a CUDA graph of n calls reads n different copies)."""
    state = [0]

    def fn() -> torch.Tensor:
        state[0] += 1
        return call(copies[state[0] % len(copies)])

    return fn


def _copies(tensors: tuple[torch.Tensor, ...], rotate_bytes: int) -> list[tuple[torch.Tensor, ...]]:
    size = sum(t.numel() * t.element_size() for t in tensors)
    n = max(1, math.ceil(rotate_bytes / size))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def _triton_path(x: torch.Tensor, launch: Tiles | Gemv | None) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    def call(w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if launch is None:
            return fp8_gemm.linear_cuda(x, w[0], w[1], scheme="block", backend="triton")
        with tiles_override(launch):
            return fp8_gemm.linear_cuda(x, w[0], w[1], scheme="block", backend="triton")

    return call


def _bf16_gemv_path(x: torch.Tensor, launch: Gemv) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    def call(w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with tiles_override(launch):
            return triton_fp8_gemm.gemv(x, w[0], None)

    return call


def _table(m: int, rows: list[dict[str, Any]], names: list[str], peak: float) -> str:
    head = "| shape (M = %d) | " % m + " | ".join(names) + " | best triton |"
    lines = [head, "|---|" + "---:|" * (len(names) + 1)]
    layer: dict[str, float] = {}
    for row in rows:
        cells = []
        for p in names:
            r = row["paths"].get(p, {})
            if "ms" in r and p == "quant":  # a part of the triton paths, not a GEMM: no ratio
                cells.append(f"{r['ms'] * 1e3:.1f}")
                layer[p] = layer.get(p, 0.0) + r["ms"]
            elif "ms" in r:
                cells.append(f"{r['ms'] * 1e3:.1f} ({r['speedup_vs_bf16']:.2f}x)")
                layer[p] = layer.get(p, 0.0) + r["ms"]
            else:
                cells.append(r.get("error", "-")[:12])
        best = row.get("best_triton")
        b = row["paths"].get(best, {}) if best else {}
        cells.append(f"{best.split(':', 1)[1]} {b['speedup_vs_bf16']:.2f}x, {b['weight_tb_s'] / peak:.0%} read" if b else "-")
        layer["best"] = layer.get("best", 0.0) + (b["ms"] if b else math.nan)
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    bf16 = layer.get("bf16", math.nan)
    cells = [f"{layer[p] * 1e3:.1f}" + ("" if p == "quant" else f" ({bf16 / layer[p]:.2f}x)") if p in layer else "-"
             for p in names + ["best"]]  # fmt: skip
    lines.append("| one layer | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bf16_tiles_path(x: torch.Tensor, launch: Tiles) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    def call(w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with tiles_override(launch):
            return triton_fp8_gemm.bf16_gemm(x, w[0])

    return call


def _bf16_tiles_table(rows: list[dict[str, Any]], peak: float) -> str:
    """Per shape and M > 2: cuBLAS, the bf16 block GEMM's default and its fastest launch, as us and share of the
    streaming read; then one layer per M."""
    lines = ["| shape | M | cuBLAS | bf16_tiles:default | best bf16_tiles |", "|---|---:|---:|---:|---|"]
    layer: dict[int, list[float]] = {}
    for row in rows:
        paths = row["paths"]
        default = next((p for p in paths if p.startswith("bf16_tiles:default=") and "ms" in paths[p]), None)
        timed = [p for p in paths if p.startswith("bf16_tiles:") and "ms" in paths[p]]
        if default is None or not timed:
            continue
        best = min(timed, key=lambda p: paths[p]["ms"])
        cell = lambda p: f"{paths[p]['ms'] * 1e3:.1f} us ({paths[p]['weight_tb_s'] / peak:.0%})"  # noqa: E731
        lines.append(f"| {row['shape']} | {row['m']} | {cell('bf16')} | {cell(default)} | {best.split(':', 1)[1]} {cell(best)} |")
        sums = layer.setdefault(row["m"], [0.0, 0.0, 0.0])
        for i, p in enumerate(("bf16", default, best)):
            sums[i] += paths[p]["ms"]
    for m, (cub, dflt, best) in layer.items():
        lines.append(
            f"| one layer | {m} | {cub * 1e3:.1f} us | {dflt * 1e3:.1f} us ({cub / dflt:.2f}x) | {best * 1e3:.1f} us ({cub / best:.2f}x) |"
        )
    return "\n".join(lines)


def _read_table(rows: list[dict[str, Any]], peak: float) -> str:
    """Weight bytes read per second as a share of the streaming read, per shape and M."""
    paths = ["bf16", "bf16_gemv:default", "rows", "block", "triton:default", "gemv:default", "dispatch", "best"]
    lines = ["| shape | M | " + " | ".join(paths) + " | default tiles |", "|---|---:|" + "---:|" * (len(paths) + 1)]
    for row in rows:
        cells = []
        for p in paths:
            r = row["paths"].get(row["best_triton"] if p == "best" else p, {})
            cells.append(f"{r['weight_tb_s']:.2f} TB/s ({r['weight_tb_s'] / peak:.0%})" if "ms" in r else "-")
        lines.append(f"| {row['shape']} | {row['m']} | " + " | ".join(cells) + f" | {row['default_tiles']} |")
    return "\n".join(lines)


def _best_per_shape(rows: list[dict[str, Any]], prefix: str) -> dict[str, str]:
    """Each shape's fastest timed path among those named ``prefix<launch>`` (the default's ``=`` copy left out)."""
    return {r["shape"]: min((p for p in r["paths"] if p.startswith(prefix) and "ms" in r["paths"][p] and "=" not in p),
                            key=lambda p, r=r: r["paths"][p]["ms"], default="-") for r in rows}  # fmt: skip


def _verdict(results: list[dict[str, Any]], tokens: list[int]) -> str:
    """Per M <= 4: one layer (the four shapes) with the GEMV and with the block GEMM at their default launches, the
    best GEMV candidate per shape, and whether the GEMV keeps the dispatch (it wins the layer and every shape)."""
    lines = []
    for m in (t for t in tokens if t <= GEMV_ROWS):
        rows = [r for r in results if r["m"] == m]
        ms = {p: sum(r["paths"].get(p, {}).get("ms", math.nan) for r in rows) for p in ("bf16", "triton:default", "gemv:default")}
        shapes = {r["shape"]: r["paths"].get("gemv:default", {}).get("ms", math.nan) < r["paths"].get("triton:default", {}).get("ms", math.nan)
                  for r in rows}  # fmt: skip
        best = _best_per_shape(rows, "gemv:")
        keep = ms["gemv:default"] < ms["triton:default"] and all(shapes.values())
        lines.append(f"M = {m}: one layer bf16 {ms['bf16'] * 1e3:.1f} us, block GEMM {ms['triton:default'] * 1e3:.1f} us "
                     f"({ms['bf16'] / ms['triton:default']:.2f}x), GEMV {ms['gemv:default'] * 1e3:.1f} us "
                     f"({ms['bf16'] / ms['gemv:default']:.2f}x); GEMV faster on {[s for s, w in shapes.items() if w]}; "
                     f"best GEMV per shape {best}; GEMV keeps M = {m}: {'yes' if keep else 'NO'}")  # fmt: skip
        gemv16 = sum(r["paths"].get("bf16_gemv:default", {}).get("ms", math.nan) for r in rows)
        faster = [r["shape"] for r in rows if r["paths"].get("bf16_gemv:default", {}).get("ms", math.inf) < r["paths"]["bf16"]["ms"]]
        best16 = _best_per_shape(rows, "bf16_gemv:")
        lines.append(f"M = {m}, bf16 weights: one layer cuBLAS {ms['bf16'] * 1e3:.1f} us, GEMV {gemv16 * 1e3:.1f} us "
                     f"({ms['bf16'] / gemv16:.2f}x); GEMV faster on {faster}; best bf16 GEMV per shape {best16}")  # fmt: skip
    return "\n".join(lines)


def _write(opts: argparse.Namespace, peak: float, read_runs: list[dict[str, Any]], cublas: bool, results: list[dict[str, Any]],
           t0: float) -> None:  # fmt: skip
    Path(opts.out).write_text(jsonfmt.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "read_tb_s": peak, "read_runs": read_runs, "cublas_block": cublas,
                   "rotate_mb": opts.rotate_mb, "tokens": opts.tokens, "tiles": [t.label for t in opts.tiles],
                   "gemv": opts.gemv, "bf16_gemv": opts.bf16_gemv, "bf16_tiles": opts.bf16_tiles, "rows": results, "wall_s": time.monotonic() - t0}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_gemm_gpu.json")
    ap.add_argument("--tokens", type=_tokens, default=[1, 4, 16], help="M values, comma-separated")
    ap.add_argument("--tiles", type=_tiles_list, default=[Tiles.parse(t) for t in CANDIDATES],
                    help="block GEMM launch shapes to time beside tile_config's, e.g. 16x32w4s3k1,16x64w4s4k2")  # fmt: skip
    ap.add_argument("--gemv", type=_gemv_list, default=list(GEMV_CANDIDATES),
                    help="GEMV launch shapes to time beside gemv_config's at M <= 4, e.g. g32x512w4s1,g16x512w4s2k1")  # fmt: skip
    ap.add_argument("--bf16-gemv", type=_gemv_list, default=list(BF16_GEMV_CANDIDATES),
                    help="GEMV launch shapes to time on the bf16 weight at M <= 4, e.g. g8x2048w4s1k1")  # fmt: skip
    ap.add_argument("--bf16-tiles", type=_bf16_tiles_list, default=list(BF16_TILE_CANDIDATES),
                    help="bf16 block GEMM launch shapes (no BLOCK_M) to time at M > 2, e.g. 64w4s4k4,128w8s3k2b64")  # fmt: skip
    ap.add_argument("--rotate-mb", type=int, default=512, help="weights rotate over copies of at least this many MB")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm_gpu: no CUDA GPU visible (run it on the device machine)")

    t0 = time.monotonic()
    peak, read_runs = read_bandwidth()
    cublas = fp8_gemm.cublas_block_supported(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: streaming read {peak:.2f} TB/s; "
          f"cuBLASLt block scaling {'available' if cublas else 'not available'}", flush=True)  # fmt: skip
    rotate = opts.rotate_mb << 20
    results: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        rq, rs = fp8_gemm.quantize_tensor(w)
        rs = rs.expand(n).contiguous()
        bq, bs = fp8_gemm.quantize_blocks(w)
        bf16_w = _copies((w.to(torch.bfloat16),), rotate)
        rows_w = _copies((rq, rs), rotate)
        block_w = _copies((bq, bs, fp8_gemm.cublas_block_scales(bs)), rotate)
        del w
        fp8_bytes = n * k + 4 * bs.numel()
        for m in opts.tokens:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            xq_rows = fp8_gemm.quantize_activations(x, scheme="rows", fused=True)
            paths: dict[str, tuple[Callable[[], torch.Tensor], int, str | None]] = {  # fn, weight bytes, scheme checked
                "bf16": (_rotating(bf16_w, lambda w: F.linear(x, w[0])), 2 * n * k, None),
                "rows": (_rotating(rows_w, lambda w: fp8_gemm.linear_cuda(x, w[0], w[1], scheme="rows")), n * k + 4 * n, "rows"),
                "rows_gemm": (_rotating(rows_w, lambda w: torch._scaled_mm(xq_rows[0], w[0].t(), scale_a=xq_rows[1],
                                                                           scale_b=w[1].view(1, -1), out_dtype=torch.bfloat16)),
                              n * k + 4 * n, "rows"),
                "quant": (lambda: fp8_gemm.quantize_activations(x, scheme="block", fused=True)[0], 0, None),
            }  # fmt: skip
            if cublas:
                paths["block"] = (_rotating(block_w, lambda w: fp8_gemm.linear_cuda(x, w[0], w[1], scheme="block", scale_cublas=w[2],
                                                                                    backend="cublas")), fp8_bytes, "block")  # fmt: skip
            default = tile_config(m, n, k)
            paths[f"triton:default={default.label}"] = (_rotating(block_w, _triton_path(x, default)), fp8_bytes, "block")
            for tiles in opts.tiles:
                paths[f"triton:{tiles.label}"] = (_rotating(block_w, _triton_path(x, tiles)), fp8_bytes, "block")
            if m <= GEMV_ROWS:
                gemv_default = gemv_config(m, n, k)
                paths[f"gemv:default={gemv_default.label}"] = (_rotating(block_w, _triton_path(x, gemv_default)), fp8_bytes, "block")
                for label in opts.gemv:
                    paths[f"gemv:{label}"] = (_rotating(block_w, _triton_path(x, _gemv_at(label, n, k))), fp8_bytes, "block")
                paths[f"bf16_gemv:default={gemv_default.label}"] = (_rotating(bf16_w, _bf16_gemv_path(x, gemv_default)), 2 * n * k, "bf16")
                for label in opts.bf16_gemv:
                    paths[f"bf16_gemv:{label}"] = (_rotating(bf16_w, _bf16_gemv_path(x, _gemv_at(label, n, k))), 2 * n * k, "bf16")
            else:
                bf16_default = bf16_tile_config(m, n, k)
                paths[f"bf16_tiles:default={bf16_default.label}"] = (
                    _rotating(bf16_w, _bf16_tiles_path(x, bf16_default)),
                    2 * n * k,
                    "bf16",
                )
                for label in opts.bf16_tiles:
                    paths[f"bf16_tiles:{label}"] = (_rotating(bf16_w, _bf16_tiles_path(x, _bf16_tiles_at(label, m))), 2 * n * k, "bf16")
            paths["dispatch"] = (_rotating(block_w, _triton_path(x, None)), fp8_bytes, "block")
            ref = {s: fp8_gemm.linear_ref(x.float(), *((rq, rs) if s == "rows" else (bq, bs)), scheme=s) for s in ("rows", "block")}
            bound = {s: fp8_gemm.gemm_error_bound(x.float(), *((rq, rs) if s == "rows" else (bq, bs)), scheme=s) for s in ("rows", "block")}
            # the bf16 GEMV's and block GEMM's paths: the exact product in float64; fp32 sums (K terms: K u of sum
            # |x w|) and the bf16 output (2^-8)
            w64 = bf16_w[0][0].double()
            ref["bf16"] = (x.double() @ w64.t()).float()
            bound["bf16"] = (2.0**-8 * ref["bf16"].abs() + k * 2.0**-24 * (x.double().abs() @ w64.abs().t())).float()
            del w64
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "default_tiles": default.label, "paths": {},
                                   "gemv_default": gemv_config(m, n, k).label if m <= GEMV_ROWS else None,
                                   "bf16_tiles_default": bf16_tile_config(m, n, k).label if m > GEMV_ROWS else None}  # fmt: skip
            for path, (fn, weight_bytes, scheme) in paths.items():
                try:
                    if scheme is not None:
                        excess = ((fn().float() - ref[scheme]).abs() - bound[scheme]).max().item()
                        if excess > 0:
                            print(f"  ERROR {name} M={m} {path}: outside the error bound by {excess:.3g}", flush=True)
                            row["paths"][path] = {"error": "outside bound", "excess": excess}
                            continue
                    ms = time_ms(fn)
                except (RuntimeError, TritonError) as exc:  # a shape that does not compile or launch on this GPU
                    print(f"  ERROR {name} M={m} {path}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    row["paths"][path] = {"error": type(exc).__name__, "message": str(exc)[:400]}
                    continue
                row["paths"][path] = {"ms": ms, "weight_tb_s": weight_bytes / ms / 1e9, "read_frac": weight_bytes / ms / 1e9 / peak}
            base = row["paths"]["bf16"]["ms"]
            for r in row["paths"].values():
                if "ms" in r:
                    r["speedup_vs_bf16"] = base / r["ms"]
            timed = [p for p, r in row["paths"].items() if p.startswith(("triton:", "gemv:")) and "ms" in r]
            row["best_triton"] = min(timed, key=lambda p: row["paths"][p]["ms"]) if timed else None
            results.append(row)
            print(f"  {name:<8} M={m:<3} bf16 {base * 1e3:6.1f} us; best triton {row['best_triton']} "
                  f"{row['paths'][row['best_triton']]['ms'] * 1e3 if timed else math.nan:6.1f} us "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
        del bf16_w, rows_w, block_w
        torch.cuda.empty_cache()
        _write(opts, peak, read_runs, cublas, results, t0)  # each shape's rows as soon as they are measured
    tables = []
    for m in opts.tokens:
        rows = [r for r in results if r["m"] == m]
        names = [p for p in rows[0]["paths"] if not p.startswith(("triton:", "gemv:", "bf16_gemv:", "dispatch"))]
        names += ["triton:default"] + [f"triton:{t.label}" for t in opts.tiles]
        names += ["gemv:default"] + [f"gemv:{g}" for g in opts.gemv] if m <= GEMV_ROWS else []
        names += ["bf16_gemv:default"] + [f"bf16_gemv:{g}" for g in opts.bf16_gemv] if m <= GEMV_ROWS else []
        names += ["dispatch"]
        names += ["bf16_tiles:default"] if m > GEMV_ROWS else []
        for r in rows:  # one column for each default pick, whatever it is at each shape
            for kind, pick in (("triton", r["default_tiles"]), ("gemv", r["gemv_default"]), ("bf16_gemv", r["gemv_default"]),
                               ("bf16_tiles", r.get("bf16_tiles_default"))):  # fmt: skip
                key = next((p for p in r["paths"] if p.startswith(f"{kind}:default=")), None)
                if key is not None:
                    r["paths"][f"{kind}:default"] = dict(r["paths"][key], tiles=pick)
        tables.append(_table(m, rows, names, peak))
    print(f"\nus per call (speed-up over bf16 cuBLAS); streaming read {peak:.2f} TB/s; triton:default = tile_config's pick, "
          f"gemv:default = gemv_config's, dispatch = launch_config's kernel (the engine's)\n")  # fmt: skip
    print("\n\n".join(tables), flush=True)
    print("\n" + _verdict(results, opts.tokens), flush=True)
    print(f"\nweight bytes read per second (share of the {peak:.2f} TB/s streaming read)\n")
    print(_read_table(results, peak), flush=True)
    print(f"\nbf16 weights at M > {GEMV_ROWS}: cuBLAS against the bf16 block GEMM (us, share of the {peak:.2f} TB/s read)\n")
    print(_bf16_tiles_table(results, peak), flush=True)
    _write(opts, peak, read_runs, cublas, results, t0)
    print(f"wrote {opts.out} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
