"""``kvserving demo``: the main job on the built-in tiny model.

1. The KV format capacity table for a Qwen3-8B-like shape on an 80 GiB GPU.
2. The built-in tiny model (generated locally, never downloaded) served by the
   engine in every KV format: one batch of chat requests, continuous batching
   with chunked prefill, and what each format holds and reproduces.

Later issues extend it to the full stack on loopback (gateway + prefill +
decode workers with KV transfer).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvserving.argtypes import float_in, int_in
from kvserving.worker.generate import chat_prompts, check_model_dir

QUESTIONS = (
    "List the files in the current directory.",
    "What does the function os.path.join do?",
    "Write a loop that sums a list of integers.",
    "Explain what a KV cache is.",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-gib", type=float_in(0.0, 1 << 20, low_open=True), default=80.0,
                        help="KV memory budget in GiB for the capacity table")
    parser.add_argument("--model", type=Path, default=None,
                        help="local model directory, HF format (default: build the tiny model in a temp dir)")
    parser.add_argument("--max-tokens", type=int_in(1, 4096), default=24, help="new tokens per request")
    parser.add_argument("--kv-mib", type=int_in(1, 1 << 20), default=16, help="engine KV budget in MiB")


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        check_model_dir(args.model)
        return _serve(args, args.model, builtin=False)
    from kvserving.worker.tiny_model import build_tiny_model

    # Built fresh each run (under a second), so the demo never serves a stale copy.
    with tempfile.TemporaryDirectory(prefix="kvserving-tiny-") as tmp:
        return _serve(args, build_tiny_model(Path(tmp) / "tiny-model"), builtin=True)


def _serve(args: argparse.Namespace, model_dir: Path, *, builtin: bool) -> int:
    from transformers import AutoTokenizer

    from kvserving.config import KV_DTYPES, KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
    from kvserving.kernels import capacity
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    print("KV cache capacity, Qwen3-8B-like shape (36 layers, 8 KV heads, head_dim 128):")
    print(capacity.format_table(capacity.capacity_rows(gpu_bytes=int(args.gpu_gib * 2**30))))
    print()

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    # render with the chat template (refusing a model without one), then tokenize the text
    # (the template holds its own special tokens)
    texts = chat_prompts(model_dir, list(QUESTIONS))
    prompts: list[list[int]] = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    print(headline(model_dir, builtin=builtin, requests=len(prompts), max_tokens=args.max_tokens, kv_mib=args.kv_mib))
    print(f"{'kv format':<10}{'pool tokens':>12}{'bytes/token':>13}{'tokens/s':>10}{'same tokens as bf16':>21}")
    reference: list[list[int]] | None = None
    for fmt in KV_DTYPES:
        engine = LLMEngine(
            ServingConfig(
                model=ModelConfig(path=str(model_dir)),
                kv_cache=KVCacheConfig(dtype=fmt, memory_bytes=args.kv_mib * 2**20),
                scheduler=SchedulerConfig(chunk_size=32),
            )
        )
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        rate = sum(map(len, outs)) / (time.perf_counter() - start)
        if reference is None:
            reference = outs
        same = sum(a == b for r, o in zip(reference, outs) for a, b in zip(r, o)) / sum(map(len, reference))
        print(f"{fmt:<10}{engine.capacity_tokens:>12,}{engine.storage.bytes_per_token:>13.0f}{rate:>10.0f}{same:>20.0%}")
    assert reference is not None
    print("(on a CPU the model runs in fp32 and the unquantized 'bf16' pool stores fp32, 4 bytes a value)")
    print()
    print(f"first request, bf16 KV: {QUESTIONS[0]!r} ->")
    print("   ", repr(tok.decode(reference[0])))
    return 0


def headline(model_dir: Path, *, builtin: bool, requests: int, max_tokens: int, kv_mib: int) -> str:
    """What is served; only the built-in model's text is called noise (its weights are random)."""
    name = "the built-in tiny model" if builtin else f"model {model_dir}"
    note = " (random weights: the text is noise, the mechanics are real)" if builtin else ""
    return f"{name} serving {requests} chat requests, {max_tokens} tokens each, KV budget {kv_mib} MiB{note}"
