"""``kvserving up``: the whole product on one machine (local mode).

Starts the gateway and one prefill + one decode worker (``--single``: one
``both`` worker) on loopback from one engine config, prints the OpenAI base URL
once every part answers ``/ready``, and supervises them: Ctrl-C or SIGTERM
stops every child and exits 0; a child that dies is reported and the rest are
stopped (exit 1).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType

from kvserving.argtypes import check_listen_address, check_memory_bytes, float_in
from kvserving.config import KV_DTYPES, LOAD_FORMATS, KVCacheConfig, ReuseConfig, ServingConfig


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM before the stack was ready."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=None, help="local model directory (default: the built-in tiny model, generated locally)"
    )
    parser.add_argument("--config", type=Path, default=None, help="engine-config JSON to start from (default: built-in defaults)")
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default=None,
        help="'dummy': every worker builds the same seeded random weights from the model's config.json",
    )
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help="KV cache format (default: the config's, bf16)")
    parser.add_argument("--bit-budget", type=float, default=None, help="average KV bits for triaxial, in [2, 4] (default: 2.7)")
    parser.add_argument("--kv-mib", type=int, default=None, help="KV pool size per worker in MiB (default: the config's)")
    parser.add_argument("--single", action="store_true", help="one worker of role 'both' instead of prefill + decode")
    parser.add_argument("--no-reuse", action="store_true", help="turn bidirectional KV reuse off (every turn recomputes)")
    parser.add_argument("--host", default="127.0.0.1", help="address every part binds to")
    parser.add_argument("--port", type=int, default=8000, help="gateway port; workers take the next two, Prometheus the one after")
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a real Prometheus scraping every part (installs the Debian package if missing)",
    )
    parser.add_argument(
        "--gpus",
        default=None,
        help="GPU of each worker, comma-separated, prefill first (e.g. 0,1: prefill on GPU 0, decode on "
        "GPU 1; one index: every worker on it); default: the environment's CUDA_VISIBLE_DEVICES",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="where logs and the config go (default: a temp dir)")
    parser.add_argument(
        "--ready-timeout",
        type=float_in(0, 1e6),
        default=600.0,
        help="seconds to wait for every part's /ready (a GPU worker loads the model, captures its decode graphs and "
        "compiles its kernels first; a part that dies ends the wait at once)",
    )


def build_config(args: argparse.Namespace) -> ServingConfig:
    """The engine config of the stack (ValueError naming the flag on bad input)."""
    config = ServingConfig.load(args.config) if args.config is not None else ServingConfig()
    if args.model is not None:
        if not args.model.exists():
            raise ValueError(f"--model {args.model}: the directory does not exist")
        if not args.model.is_dir():
            raise ValueError(f"--model {args.model} is not a directory (a model directory holds config.json and the weights)")
        config = replace(config, model=replace(config.model, path=str(args.model.resolve())))
    if args.load_format is not None:
        config = replace(config, model=replace(config.model, load_format=args.load_format))
    if not config.model.path:
        # Resolve the built-in tiny model once here, so the children do not race to build it.
        from kvserving.model_dir import resolve_model_dir

        config = replace(config, model=replace(config.model, path=str(resolve_model_dir(config.model))))
    kv = config.kv_cache
    if args.kv_dtype is not None:
        kv = KVCacheConfig(
            dtype=args.kv_dtype, memory_fraction=kv.memory_fraction, memory_bytes=kv.memory_bytes, allow_emulation=kv.allow_emulation
        )
    if args.bit_budget is not None:
        kv = replace(kv, bit_budget=args.bit_budget)
    if args.kv_mib is not None:
        if args.kv_mib < 1:
            raise ValueError(f"--kv-mib must be >= 1, got {args.kv_mib}")
        kv = replace(kv, memory_bytes=args.kv_mib * 2**20)
    reuse: ReuseConfig = config.reuse
    if args.no_reuse:
        reuse = replace(reuse, bidirectional=False)
    return replace(config, kv_cache=kv, reuse=reuse)


def check_gpus(gpus: str) -> None:
    """Refuse ``--gpus`` on a machine without those GPUs (the workers would run on CPU without a word)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--gpus {gpus}: no CUDA device is visible (torch {torch.__version__}); leave --gpus out to run on CPU")
    indices = [int(i) for g in gpus.split(",") for i in g.split() if i.strip().isdigit()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ and any(i >= count for i in indices):
        raise ValueError(f"--gpus {gpus}: this machine has {count} GPU(s), indices 0..{count - 1}")


def run(args: argparse.Namespace) -> int:
    from kvserving.local.stack import LocalStack, StackError, StackSpec

    config = build_config(args)
    if not 1 <= args.port <= 65532:
        raise ValueError(f"--port must be in 1..65532 (the next three ports are used too), got {args.port}")
    check_listen_address(args.host, 0)  # the ports are the stack's own check, all at once
    if config.kv_cache.memory_bytes is not None:  # each worker's pool: refused here, not by each worker's allocator
        flag, given = ("--kv-mib", str(args.kv_mib)) if args.kv_mib is not None else ("kv_cache.memory_bytes", None)
        check_memory_bytes(config.kv_cache.memory_bytes, flag, given=given)
    if args.run_dir is not None:
        existing = next(p for p in (args.run_dir, *args.run_dir.parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"--run-dir {args.run_dir}: {existing} is not a directory")
    if args.gpus:
        check_gpus(args.gpus)
    spec = StackSpec(
        config=config,
        host=args.host,
        gateway_port=args.port,
        prefill_port=args.port + 1,
        decode_port=args.port + 2,
        single=args.single,
        prometheus_port=args.port + 3 if args.prometheus else None,
        run_dir=args.run_dir,
        gpus=tuple(args.gpus.split(",")) if args.gpus else (),
    )
    stopping = False
    ready = False
    failed = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if not ready:  # still starting: leave the wait at once
            raise _Interrupted

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    stack = LocalStack(spec)
    try:
        stack.start()
        print(f"starting {', '.join(c.name for c in stack.children)} (logs in {stack.run_dir})", flush=True)
        stack.wait_ready(timeout_s=args.ready_timeout)
        ready = True
        print(f"OpenAI base URL: {stack.openai_base_url}  (model {config.model.served_name!r})", flush=True)
        if stack.prometheus_url:
            print(f"Prometheus: {stack.prometheus_url}", flush=True)
        print("ready: every part answers /ready; Ctrl-C stops the stack", flush=True)
        while not stopping:
            dead = stack.check()
            if dead is not None:
                failed = True
                print(f"kvserving up: error: {stack.describe_death(dead)}", file=sys.stderr)
                return 1
            time.sleep(0.25)
        print("stopping", flush=True)
        return 0
    except _Interrupted:
        print("kvserving up: interrupted while starting: stopping", file=sys.stderr)
        return 0
    except StackError as exc:
        failed = any(stack.run_dir.glob("*.log"))  # a child ran: its log says why, and stays
        where = f" (logs in {stack.run_dir})" if failed and str(stack.run_dir) not in exc.summary else ""
        detail = str(exc).removeprefix(exc.summary)  # a child's death: its log's last lines
        print(f"kvserving up: error: {exc.summary}{where}{detail}", file=sys.stderr)
        return 1
    finally:
        stack.close(keep_logs=failed)  # a failure's logs are what the user reads next
        for sig, handler in previous.items():
            signal.signal(sig, handler)
