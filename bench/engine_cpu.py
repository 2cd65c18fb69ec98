"""CPU engine benchmark on the built-in tiny model: prefill and decode tokens/s
at batch 1, 8, 32 for every KV format (ratios to bf16), and the pool capacity
of each format for one byte budget.

    PYTHONSAFEPATH=1 .venv/bin/python bench/engine_cpu.py [--model DIR] [--json OUT]

On CPU the model runs in fp32, so the unquantized "bf16" format stores fp32
KV here (bf16 on a GPU); quantized formats run the torch reference ops, which
dequantize in Python-level torch code: these numbers describe the CPU engine,
not the GPU kernels (bench/decode_gpu.py measures those).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.worker.engine import LLMEngine
from kvserving.worker.sampling import SamplingParams
from kvserving.tiny_model import build_tiny_model

FORMATS = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")
BATCHES = (1, 8, 32)


def engine_for(model: Path, dtype: str, budget: int) -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=budget),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, chunk_size=512),
        )
    )


def measure(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for one batch run to completion."""
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    tag = len(engine.requests) + engine.stats.steps
    for n in range(batch):
        engine.add_request(f"b{batch}-{tag}-{n}", torch.randint(10, engine.vocab_size, (prompt_len,), generator=g).tolist(), params)
    prefill_s = decode_s = 0.0
    prefill_tok = decode_tok = 0
    while engine.has_unfinished():
        before = engine.stats.prompt_tokens_computed, engine.stats.decode_tokens
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        p = engine.stats.prompt_tokens_computed - before[0]
        d = engine.stats.decode_tokens - before[1]
        if p:
            prefill_s += dt
            prefill_tok += p
        else:
            decode_s += dt
            decode_tok += d
    return prefill_tok / prefill_s, decode_tok / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="model dir (default: build the tiny model)")
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable on shared machines)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        budget = args.budget_mib * 2**20
        results: dict[str, dict] = {}
        for fmt in FORMATS:
            engine = engine_for(model, fmt, budget)
            engine.generate([[5] * 40], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            row = {"capacity_tokens": engine.capacity_tokens, "bytes_per_token": engine.storage.bytes_per_token}
            for b in BATCHES:
                # best of two runs: the first of each batch size also pays one-time allocator growth
                runs = [measure(engine, b, args.prompt_len, args.new_tokens) for _ in range(2)]
                row[f"prefill_b{b}"] = max(r[0] for r in runs)
                row[f"decode_b{b}"] = max(r[1] for r in runs)
            results[fmt] = row
    base = results["bf16"]
    cols = [f"{k}_b{b}" for k in ("prefill", "decode") for b in BATCHES]
    print(
        f"tiny model, prompt {args.prompt_len}, {args.new_tokens} new tokens, KV budget {args.budget_mib} MiB, "
        f"{torch.get_num_threads()} threads"
    )
    head = f"{'format':<10}" + "".join(f"{c + ' tok/s':>18}" for c in cols) + f"{'pool tokens':>14}{'vs bf16':>9}"
    print(head)
    print("-" * len(head))
    for fmt, row in results.items():
        cells = "".join(f"{row[c]:>9.0f} ({row[c] / base[c]:4.2f}x)" for c in cols)
        print(f"{fmt:<10}{cells}{row['capacity_tokens']:>14,}{row['capacity_tokens'] / base['capacity_tokens']:>8.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
