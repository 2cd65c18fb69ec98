"""Where a graphed decode step's GPU time goes, kernel by kernel, per KV format (Qwen3-8B shape).

    python3 bench/profile_engine_step.py [--formats bf16,nvfp4] [--shapes 1x4096,64x4096] [--top 12]

Uses ``bench/engine_gpu.py``'s model and placement (random weights drawn on the
device, sequences placed with their pages filled by the write kernels), runs a
few warm decode steps through ``LLMEngine.step`` and profiles three more with
``torch.profiler``; prints, per format and shape, the step's kernels grouped by
name: calls per step, microseconds per step, share of the step's kernel time.
With ``--smoke`` it runs on CPU at a toy shape (checks the script only: no GPU
kernel to list).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from kvserving.argtypes import decode_shapes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_gpu.py beside this file
import engine_gpu  # noqa: E402


def kernel_table(engine: engine_gpu.LLMEngine, *, steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, calls per step, microseconds per step), most expensive first; empty when
    the profiler fails or no GPU kernel ran (``--smoke`` on CPU)."""
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for full_name, t in engine_gpu.cuda_kernels(engine, steps=steps) or []:
        name = full_name[:90]
        calls[name] += 1
        us[name] += t
    rows = [(n, calls[n] / steps, us[n] / steps) for n in us]
    return sorted(rows, key=lambda r: -r[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,nvfp4")
    ap.add_argument("--shapes", type=decode_shapes, default="1x4096,64x4096", help="batch x context, comma-separated")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="CPU, toy shape: checks the script")
    args = ap.parse_args()
    shapes = args.shapes
    vocab = 151936
    if args.smoke:
        engine_gpu.DEVICE = "cpu"
        shapes, vocab = [(1, 512), (4, 512)], 1024
    margs = engine_gpu.qwen3_8b_shape(vocab, smoke=args.smoke)
    model = engine_gpu.random_model(margs, seed=0)
    bench = engine_gpu.Bench((margs, model), quick=True, enforce_eager=False)
    gib = 0.6 if args.smoke else 60.0
    for fmt in args.formats.split(","):
        engine = bench.engine(fmt, gib)
        for b, ctx in shapes:
            seqs = bench.place(engine, b, ctx - engine_gpu.HEADROOM, computed=ctx - engine_gpu.HEADROOM - 1)
            times = bench.timed_steps(engine, warmup=3)
            rows = kernel_table(engine, steps=3)
            total = sum(r[2] for r in rows)
            step_ms = 1e3 * sorted(times)[len(times) // 2]
            print(f"{fmt} {len(seqs)}x{ctx}: step {step_ms:.2f} ms, kernels {total / 1e3:.2f} ms ({sum(r[1] for r in rows):.0f} per step)")
            for name, n, t in rows[: args.top]:
                print(f"  {t:9.1f} us {100 * t / max(total, 1e-9):5.1f}%  x{n:5.1f}  {name}")
            bench.clear(engine)
        del engine
        engine_gpu.release()


if __name__ == "__main__":
    main()
