"""What FP8 weights cost in model quality, beside each KV format, on the model bench/fidelity.py trains (CPU).

    .venv/bin/python bench/fidelity_weights.py [--eval-seqs 8]   # writes bench/results/fidelity_weights_cpu.json

Trains bench/fidelity.py's CPU model (the same seed, data and steps), then scores held-out agent
conversations at 2K context through the engine (pages from its pool, quantize-on-write, chunked
prefill over the cached prefix) for weights {model dtype (fp32 on CPU), fp8 (a scale per tensor),
fp8_block (per 128x128 tile)} x KV {bf16, fp8_e4m3, nvfp4 (global scale 1), triaxial at the default
2.7-bit table}: perplexity, and KL / top-1 agreement of the next-token distribution against the
model-dtype weights with unquantized KV. FP8 weights are quantized at load from the trained
checkpoint and run the GPU GEMMs' arithmetic in torch (``fp8_linear.set_backend(model, "torch")``:
activations quantized per token, or per token per 128 channels, as on the GPU).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from fidelity import CPU, LayerError, Score, conversation_ids, evaluation_conversations, joined_text, model_config
from fidelity import save_model, score, stdlib_files, train

from kvserving import jsonfmt
from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.gateway.chat_template import ChatTemplate
from kvserving.gateway.tagger import ChatTagger
from kvserving.gateway.tokenizer import TextTokenizer
from kvserving.model_dir import tiny_model_dir
from kvserving.worker.engine import LLMEngine
from kvserving.worker.fp8_linear import set_backend

WEIGHTS = ("bf16", "fp8", "fp8_block")
KV = ("bf16", "fp8_e4m3", "nvfp4", "triaxial")


def engine_for(model_dir: Path, weights: str, kv: str, *, ctx: int, chunk: int) -> LLMEngine:
    cfg = ServingConfig(
        model=ModelConfig(path=str(model_dir), max_model_len=ctx + 64, weight_format=weights),
        kv_cache=KVCacheConfig(dtype=kv, memory_bytes=256 * 2**20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max(chunk, 8), chunk_size=chunk),
    )
    engine = LLMEngine(cfg, device="cpu")
    if weights != "bf16":
        set_backend(engine.model, "torch")
    return engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-seqs", type=int, default=8, help="held-out conversations scored")
    ap.add_argument("--train-steps", type=int, default=CPU.train_steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fidelity_weights_cpu.json")
    opts = ap.parse_args()
    s = CPU if opts.train_steps == CPU.train_steps else type(CPU)(**{**CPU.__dict__, "train_steps": opts.train_steps})
    ctx = s.contexts[0]
    t0 = time.time()
    tok_dir = tiny_model_dir()
    tokenizer = TextTokenizer.from_dir(tok_dir)
    tagger = ChatTagger(tokenizer, ChatTemplate.from_dir(tok_dir))
    train_files, held_files = stdlib_files()
    eval_text = joined_text(held_files[0::2], 10**9)
    ids = torch.tensor(conversation_ids(joined_text(train_files, s.train_chars), tagger, context=ctx, seed=opts.seed))
    val = torch.tensor(conversation_ids(eval_text[: s.val_chars], tagger, context=ctx, seed=opts.seed + 1))
    cfg = model_config(s, tokenizer.vocab_size, tokenizer.token_to_id("<|im_end|>") or 0, max(ctx + 256, 4096))
    model, _, val_losses = train(s, cfg, ids, val, device=torch.device("cpu"), seed=opts.seed)
    work = Path(tempfile.mkdtemp(prefix="kvs-fidelity-weights-"))
    rows: dict[str, Any] = {}
    try:
        model_dir = work / "model"
        save_model(model, cfg, model_dir, tok_dir)
        eval_path = work / "evaluation_text.py"
        eval_path.write_text(eval_text)
        seqs, _ = evaluation_conversations(eval_path, work / "extra.py", tagger, ctx=ctx, n=opts.eval_seqs)
        ref: list[list[torch.Tensor]] = [[] for _ in seqs]  # model-dtype weights, bf16 KV: log-probs per chunk
        for weights in WEIGHTS:
            for kv in KV:
                t = time.time()
                engine = engine_for(model_dir, weights, kv, ctx=ctx, chunk=s.chunk)
                rec, acc = LayerError(engine.attention, engine.args.num_layers), Score()
                for q, r in zip(seqs, ref):
                    score(engine, q.ids, q.tags, s.chunk, rec, acc, r)
                rows[f"{weights} weights, {kv} KV"] = {
                    "weights": weights, "kv": kv, "ppl": math.exp(acc.nll / acc.count), "tokens": acc.count,
                    "kl": acc.kl / acc.count, "top1": acc.top1 / acc.count, "seconds": round(time.time() - t, 1),
                }  # fmt: skip
                print(f"  {weights} weights, {kv} KV: ppl {rows[f'{weights} weights, {kv} KV']['ppl']:.4f}, "
                      f"KL {acc.kl / acc.count:.2e}", file=sys.stderr, flush=True)  # fmt: skip
                del engine
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows["bf16 weights, bf16 KV"]["ppl"]
    for r in rows.values():
        r["ppl_vs_base_pct"] = 100.0 * (r["ppl"] / base - 1.0)
    out = {"model": {"layers": s.layers, "hidden": s.hidden, "train_steps": s.train_steps,
                     "held_out_loss": val_losses[-1][1]},
           "context": ctx, "sequences": len(seqs), "seed": opts.seed, "seconds": round(time.time() - t0, 1),
           "rows": rows}  # fmt: skip
    opts.out.write_text(jsonfmt.dumps(out))
    print(f"\n{'weights':<10} {'KV':<10} {'ppl':>8} {'vs base':>8} {'KL':>9} {'top-1':>6}")
    for r in rows.values():
        print(f"{r['weights']:<10} {r['kv']:<10} {r['ppl']:8.4f} {r['ppl_vs_base_pct']:+7.2f}% {r['kl']:9.2e} {r['top1']:6.3f}")
    print("(base: model-dtype weights (fp32 on CPU), bf16 KV; KL and top-1 against it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
