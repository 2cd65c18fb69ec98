"""What two processes sharing one GPU each get (the one-GPU agent stack runs its prefill and
decode workers as two processes on GPU 0, no MPS): the simulator's ``shared_gpu`` rates.

Two processes with the Qwen3-8B shape's weights (36 layers of bf16 GEMMs: QKV 4096x6144, O
4096x4096, gate+up 4096x24576, down 12288x4096), each timing its own steps:

- prefill: one 4096-token chunk through every layer (compute bound, ~90 ms alone);
- decode: a batch of 16 tokens through every layer, replayed as one CUDA graph (reads the
  14 GB of weights: memory bound, a few ms alone).

Three phases of ``--seconds`` each: the prefill alone, the decode alone, both at once. Each
process's rate together over its rate alone is its share of the GPU; processor sharing with
equal shares gives 0.5 each, and the sum is what the two get together.

    python bench/sim_shared_gpu.py --out $OUT/sim_shared_gpu_h200.json   # on the device machine
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

from kvserving import jsonfmt

LAYERS, HIDDEN, QKV, INTER = 36, 4096, 6144, 12288


def _weights(torch: Any, dev: Any) -> list[tuple[Any, ...]]:
    g = torch.Generator(device=dev).manual_seed(0)

    def w(a: int, b: int) -> Any:
        return torch.randn(a, b, device=dev, dtype=torch.bfloat16, generator=g) * 0.02

    return [(w(HIDDEN, QKV), w(HIDDEN, HIDDEN), w(HIDDEN, 2 * INTER), w(INTER, HIDDEN)) for _ in range(LAYERS)]


def _forward(x: Any, layers: list[tuple[Any, ...]]) -> Any:
    for qkv, o, up, down in layers:
        h = x @ qkv
        x = x + h[:, :HIDDEN] @ o
        g = x @ up
        x = x + (g[:, :INTER] * g[:, INTER:]) @ down
    return x


def worker(role: str, seconds: float, barrier: Any, out: Any) -> None:
    import torch

    dev = torch.device("cuda", 0)
    layers = _weights(torch, dev)
    tokens = 4096 if role == "prefill" else 16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    if role == "decode":
        static = x.clone()
        for _ in range(3):
            _forward(static, layers)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _forward(static, layers)

        def step() -> None:
            graph.replay()
    else:

        def step() -> None:
            _forward(x, layers)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    rates = {}
    for phase in ("prefill_alone", "decode_alone", "both"):
        barrier.wait()
        active = phase == "both" or phase == f"{role}_alone"
        if active:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                step()
                torch.cuda.synchronize()  # one step at a time, as an engine runs them
                n += 1
            rates[phase] = n / (time.perf_counter() - t0)
        barrier.wait()
    out.put((role, rates))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--out", default="sim_shared_gpu.json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(role, args.seconds, barrier, out)) for role in ("prefill", "decode")]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    import torch

    share = {role: results[role]["both"] / results[role][f"{role}_alone"] for role in ("prefill", "decode")}
    doc = {
        "what": "bench/sim_shared_gpu.py: two processes time-slicing one GPU (Qwen3-8B-shaped GEMMs)",
        "device": torch.cuda.get_device_name(0),
        "seconds": args.seconds,
        "steps_per_s": results,
        "step_ms_alone": {role: 1e3 / results[role][f"{role}_alone"] for role in results},
        "share": share,
        "together": share["prefill"] + share["decode"],
    }
    text = jsonfmt.dumps(doc)
    print(text, end="")
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
