"""``kvserving demo`` (``make demo``): the whole product on one machine, an
agent conversation whose later turns reuse the KV of earlier ones.

1. The KV-format capacity table for a Qwen3-8B-like shape on an 80 GiB GPU.
2. ``kvserving up``'s stack (gateway + prefill worker + decode worker on
   loopback, real NIXL between the workers) runs a scripted coding-agent
   conversation through the official ``openai`` client twice: with
   bidirectional KV reuse on (the decode worker keeps each turn's KV under a
   lease and the next turn's prefill pulls it back) and off (nothing comes
   back from the decode worker; the prefill worker keeps only its own cache).
   One table per run, a row per turn, the reuse and TTFT ratios, and a PNG
   plot of TTFT per turn.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType

from kvserving.argtypes import check_memory_bytes, check_output_file, float_in, int_in
from kvserving.config import KV_DTYPES, KVCacheConfig, ModelConfig, ServingConfig

DEMO_SESSION = "kvserving-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-gib", type=float_in(0.0, 1 << 20, low_open=True), default=80.0, help="KV memory budget in GiB for the capacity table"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="local model directory, HF format (default: the built-in tiny model, generated locally)"
    )
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="nvfp4", help="KV cache format of the workers")
    parser.add_argument("--max-tokens", type=int_in(1, 4096), default=128, help="new tokens per assistant turn")
    parser.add_argument("--kv-mib", type=int_in(1, 1 << 20), default=64, help="KV pool per worker in MiB")
    parser.add_argument(
        "--plot", type=Path, default=None, help="where the TTFT plot goes (default: kvserving-demo-ttft.png in the temp dir)"
    )


def headline(model_dir: Path, *, builtin: bool, requests: int, max_tokens: int, kv_mib: int) -> str:
    """What is served; only the built-in model's text is called noise (its weights are random)."""
    name = "the built-in tiny model" if builtin else f"model {model_dir}"
    note = " (random weights: the text is noise, the mechanics are real)" if builtin else ""
    return f"{name} serving {requests} chat requests, {max_tokens} tokens each, KV budget {kv_mib} MiB{note}"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from kvserving.local.agent_demo import TRACE, format_table, plot_ttft, run_conversation
    from kvserving.kernels import capacity
    from kvserving.model_dir import resolve_model_dir
    from kvserving.local.stack import LocalStack, StackError, StackSpec, free_ports

    if args.plot is not None:
        check_output_file(args.plot, "--plot")  # before the two runs, not after
    check_memory_bytes(args.kv_mib * 2**20, "--kv-mib", given=str(args.kv_mib))  # each worker's pool
    # SIGTERM ends the demo as Ctrl-C does: the stack's context stops every child on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    builtin = args.model is None
    if args.model is not None:  # refuse a bad model in one line, before any process starts
        from kvserving.worker.generate import chat_prompts, check_model_dir

        check_model_dir(args.model)
        chat_prompts(args.model, ["check that the chat template renders"])
    model_dir = resolve_model_dir(ModelConfig(path=str(args.model or "")))
    print("KV cache capacity, Qwen3-8B-like shape (36 layers, 8 KV heads, head_dim 128):")
    print(capacity.format_table(capacity.capacity_rows(gpu_bytes=int(args.gpu_gib * 2**30))))
    print()
    print(headline(model_dir, builtin=builtin, requests=len(TRACE), max_tokens=args.max_tokens, kv_mib=args.kv_mib))
    base = ServingConfig(
        model=ModelConfig(path=str(model_dir)), kv_cache=KVCacheConfig(dtype=args.kv_dtype, memory_bytes=args.kv_mib * 2**20)
    )
    start = time.perf_counter()
    runs = {}
    tmp = Path(tempfile.mkdtemp(prefix="kvserving-demo-"))  # the stacks' logs: removed unless a stack fails
    failed = False
    try:
        for label, bidirectional in (("reuse on", True), ("reuse off", False)):
            config = replace(base, reuse=replace(base.reuse, bidirectional=bidirectional))
            gateway, prefill, decode = free_ports(3)
            spec = StackSpec(
                config=config, gateway_port=gateway, prefill_port=prefill, decode_port=decode, run_dir=tmp / label.replace(" ", "-")
            )
            try:
                with LocalStack(spec) as stack:
                    stack.start()
                    stack.wait_ready(timeout_s=180)
                    runs[label] = run_conversation(
                        stack.openai_base_url, config.model.served_name, max_tokens=args.max_tokens, session_id=f"{DEMO_SESSION}-{label}"
                    )
            except StackError as exc:
                failed = True
                where = "" if str(tmp) in exc.summary else f" (logs in {tmp})"
                raise ValueError(f"the {label} stack: {exc.summary}{where}") from None
            print()
            print(
                format_table(
                    f"{args.kv_dtype} KV, bidirectional {label} (gateway + prefill + decode workers, NIXL between them):", runs[label]
                )
            )
    finally:
        if not failed:
            shutil.rmtree(tmp, ignore_errors=True)
    plot_path = args.plot or Path(tempfile.gettempdir()) / "kvserving-demo-ttft.png"
    plot_ttft(runs, str(plot_path))
    on, off = runs["reuse on"], runs["reuse off"]
    later = range(1, len(on))
    ttft_on = sum(on[i].ttft_s for i in later)
    ttft_off = sum(off[i].ttft_s for i in later)
    computed_on = sum(r.computed_tokens or 0 for r in on[1:])
    computed_off = sum(r.computed_tokens or 0 for r in off[1:])
    print()
    print(
        f"turns 2..{len(on)}: prompt tokens computed {computed_on:,} with reuse vs {computed_off:,} without "
        f"({computed_off / max(computed_on, 1):.1f}x fewer); TTFT with reuse / without: {ttft_on / max(ttft_off, 1e-9):.2f}"
    )
    print(
        "(on this tiny CPU model recomputing a 128-token reply takes milliseconds, about what pulling it costs;"
        " the GPU numbers at real size are in docs/results.md)"
        if builtin
        else ""
    )
    print(f"TTFT plot: {plot_path}")
    print(f"demo finished in {time.perf_counter() - start:.0f} s")
    return 0
