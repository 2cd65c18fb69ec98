"""``kvserving generate``: offline generation with the engine, for a quick look
at a model and KV format without any server."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvserving.config import KV_DTYPES, KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="local model directory (HF format)")
    parser.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the chat template")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--kv-bytes", type=int, default=None, help="KV pool budget in bytes")
    parser.add_argument("--chunk-size", type=int, default=512)


def run(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    model_dir = Path(args.model)
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise SystemExit(f"error: no tokenizer.json in {model_dir}")
    tokenizer = Tokenizer.from_file(str(tok_path))
    if args.chat:
        from transformers import AutoTokenizer

        hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = [
            hf_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in args.prompt
        ]
    else:
        prompts = list(args.prompt)
    config = ServingConfig(
        model=ModelConfig(path=str(model_dir)),
        kv_cache=KVCacheConfig(dtype=args.kv_dtype, memory_bytes=args.kv_bytes),
        scheduler=SchedulerConfig(chunk_size=args.chunk_size),
    )
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        engine = LLMEngine(config)
        ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
        start = time.perf_counter()
        outs = engine.generate(ids, params)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outs):
        print(f"--- prompt: {prompt!r}")
        print(tokenizer.decode(out, skip_special_tokens=False))
    n = sum(len(o) for o in outs)
    print(f"--- {n} tokens in {elapsed:.2f} s, kv {args.kv_dtype}, pool {engine.capacity_tokens} tokens")
    return 0
