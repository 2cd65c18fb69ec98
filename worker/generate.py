"""``kvserving generate``: offline generation with the engine, for a quick look
at a model and KV format without any server."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvserving.argtypes import check_memory_bytes, float_in, int_in
from kvserving.config import KV_DTYPES, LOAD_FORMATS, KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig

if TYPE_CHECKING:
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

PROGRESS_EVERY_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="local model directory (HF format; never downloaded)")
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="'dummy': seeded random weights from config.json alone (no weight file read)",
    )
    parser.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES, help="KV-cache format")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn with the model's chat template")
    parser.add_argument("--max-tokens", type=int_in(1), default=32, help="new tokens per prompt (stops at the context length)")
    parser.add_argument("--temperature", type=float_in(0.0, 100.0), default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int_in(0), default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--kv-bytes", type=int_in(1), default=None, help="KV pool budget in bytes (default: the config's memory fraction)")
    parser.add_argument("--chunk-size", type=int_in(1), default=512, help="prompt tokens per sequence per step (chunked prefill)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (on CPU there are none)")


def check_model_dir(model_dir: Path) -> None:
    """Refuse a model path that is not a local model directory (nothing is ever looked up on a hub)."""
    if not model_dir.exists():
        raise ValueError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise ValueError(f"model path {model_dir} is not a directory")
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json in {model_dir}")


def chat_prompts(model_dir: Path, prompts: list[str]) -> list[str]:
    """Each prompt as one user turn rendered with the model's chat template."""
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if not getattr(hf_tok, "chat_template", None):
        raise ValueError(f"the model in {model_dir} has no chat template (needed for chat prompts)")
    try:
        return [
            str(hf_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)) for p in prompts
        ]
    except TemplateError as exc:
        raise ValueError(f"the chat template of the model in {model_dir} fails to render: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    model_dir = Path(args.model)
    check_model_dir(model_dir)
    if args.kv_bytes is not None:
        check_memory_bytes(args.kv_bytes, "--kv-bytes")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = chat_prompts(model_dir, list(args.prompt)) if args.chat else list(args.prompt)
    # torch comes with the engine: imported once the model directory and the prompts are known good, so refused
    # input answers in a fraction of a second
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    config = ServingConfig(
        model=ModelConfig(path=str(model_dir), load_format=args.load_format),
        kv_cache=KVCacheConfig(dtype=args.kv_dtype, memory_bytes=args.kv_bytes),
        scheduler=SchedulerConfig(chunk_size=args.chunk_size),
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    # one batch of prompts: each decode shape is captured when it is first met, not all of them up front
    engine = LLMEngine(config, enforce_eager=args.enforce_eager, warm_graphs=False)
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    longest = max(len(i) for i in ids)
    if longest + args.max_tokens > engine.max_model_len:
        print(
            f"note: --max-tokens {args.max_tokens} is more than the context length allows: generation stops at "
            f"{engine.max_model_len} tokens (prompt included, at most {max(0, engine.max_model_len - longest)} new)",
            file=sys.stderr,
        )
    start = time.perf_counter()
    outs = _generate(engine, ids, params, progress=sys.stderr.isatty())
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outs):
        print(f"--- prompt: {prompt!r}")
        print(tokenizer.decode(out, skip_special_tokens=False))
    n = sum(len(o) for o in outs)
    print(f"--- {n} tokens in {elapsed:.2f} s, kv {args.kv_dtype}, pool {engine.capacity_tokens} tokens")
    return 0


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, *, progress: bool) -> list[list[int]]:
    """Run every prompt to completion; on a terminal, show the token count as it grows."""
    ids = [f"generate-{n}" for n in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    total = sum(min(params.max_tokens, max(0, engine.max_model_len - len(p))) for p in prompts)
    done, shown = 0, float("-inf")  # the first step shows progress at once
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
            done += len(out.new_token_ids)
        if progress and time.monotonic() - shown > PROGRESS_EVERY_S:
            print(f"\rgenerated {done}/{total} tokens", end="", file=sys.stderr, flush=True)
            shown = time.monotonic()
    if progress:
        print("\r\033[K", end="", file=sys.stderr, flush=True)  # clear the progress line
    return [results[rid] for rid in ids]
