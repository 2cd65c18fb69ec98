"""The whole local stack on two GPUs, started as a user starts it: ``kvserving up --gpus 0,1``.

One engine config (the JSON the operator renders) starts the gateway, a prefill
worker on GPU 0 and a decode worker on GPU 1 (``--gpus 0,1`` sets one
``CUDA_VISIBLE_DEVICES`` per worker). The scripted coding-agent conversation of
``make demo`` (``kvserving.local.agent_demo``: system prompt with tool schemas, user
turns, tool calls, tool results) runs through the official ``openai`` client
against the gateway, once per mode:

- ``on``: bidirectional reuse: turn n > 1 pulls the decode worker's KV back
  over NIXL (UCX on GPU memory) instead of recomputing it;
- ``timeout``: the same, with ``reuse.transfer_timeout_s`` so short that every
  D->P READ is cut while in flight: each later turn must fall back to
  recompute (``usage.kvserving.reuse_fallback == "transfer_timeout"``) and
  still answer;
- ``off``: ``reuse.bidirectional: false``: nothing comes back.

The UCX transport of the READs is read from the workers' logs
(``UCX_PROTO_INFO=y``). A row per turn and mode: prompt tokens, pulled,
computed, fallback, TTFT; replies of ``on`` and ``timeout`` compared with
``off`` (greedy, so equal KV gives equal text). JSON goes to ``--out``.

    python3 bench/up_gpu.py --out OUT [--model DIR] [--kv-dtype nvfp4,bf16] [--gpus 0,1]
    python3 bench/up_gpu.py --out OUT --cpu   # the same on CPU memory (checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvserving import jsonfmt
from kvserving.local.agent_demo import run_conversation
from kvserving.config import KVCacheConfig, ModelConfig, ServingConfig
from kvserving.local.stack import free_port, port_is_free

MODES = ("on", "timeout", "off")
TIMEOUT_S = 1e-6  # shorter than any READ: the deadline passes while the transfer is in flight
TRANSPORTS = ("cuda_ipc", "cuda_copy", "gdr_copy", "rc_mlx5", "tcp", "sysv", "posix", "cma")


def mode_config(base: ServingConfig, mode: str) -> ServingConfig:
    if mode == "timeout":
        return replace(base, reuse=replace(base.reuse, transfer_timeout_s=TIMEOUT_S))
    if mode == "off":
        return replace(base, reuse=replace(base.reuse, bidirectional=False))
    return base


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserving up exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s:.0f} s")


def consecutive_ports(n: int) -> int:
    """A port whose next n - 1 are free too (``kvserving up --port P`` takes P .. P + 2)."""
    for _ in range(100):
        port = free_port()
        if port + n <= 65535 and all(port_is_free("127.0.0.1", port + k) for k in range(1, n)):
            return port
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def transports(run_dir: Path) -> dict[str, int]:
    """How many UCX_PROTO_INFO lines name each transport, over every log of the run."""
    counts: dict[str, int] = {}
    for log in run_dir.rglob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "|" not in line and "proto" not in line.lower():
                continue
            for name in TRANSPORTS:
                if re.search(rf"\b{name}\b", line):
                    counts[name] = counts.get(name, 0) + 1
    return counts


def run_mode(config: ServingConfig, mode: str, *, gpus: str | None, work: Path, max_tokens: int) -> dict[str, Any]:
    run_dir = work / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "engine-config.json"
    cfg.write_text(mode_config(config, mode).to_json())
    port = consecutive_ports(3)
    cmd = [sys.executable, "-m", "kvserving.cli", "up", "--config", str(cfg), "--port", str(port), "--run-dir", str(run_dir / "stack")]
    if gpus:
        cmd += ["--gpus", gpus]
    env = dict(os.environ, UCX_PROTO_INFO="y")
    out = open(run_dir / "up.out", "wb")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout_s=600)  # the workers capture their decode graphs and warm up first
        start = time.perf_counter()
        turns = run_conversation(url + "/v1", config.model.served_name, max_tokens=max_tokens, session_id=f"up-gpu-{mode}", timeout_s=120)
        wall = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        out.close()
    return {"mode": mode, "turns": [asdict(t) for t in turns], "wall_s": wall, "up_exit": rc, "transports": transports(run_dir)}


def check(runs: dict[str, dict[str, Any]]) -> list[str]:
    """What the runs must show; each failed expectation is one line."""
    bad: list[str] = []
    on, off = runs.get("on"), runs.get("off")
    if on is not None:
        later = on["turns"][1:]
        if not any((t["pulled_tokens"] or 0) > 0 for t in later):
            bad.append("on: no later turn pulled KV from the decode worker")
        if any(t["reuse_fallback"] for t in later):
            bad.append(f"on: fallbacks {[t['reuse_fallback'] for t in later]}")
    to = runs.get("timeout")
    if to is not None:
        for t in to["turns"][1:]:
            if t["reuse_fallback"] != "transfer_timeout" or (t["pulled_tokens"] or 0) != 0:
                bad.append(f"timeout: turn {t['turn']} fallback {t['reuse_fallback']!r}, pulled {t['pulled_tokens']}")
            if (t["computed_tokens"] or 0) + (t["local_tokens"] or 0) != t["prompt_tokens"]:
                bad.append(f"timeout: turn {t['turn']} computed + local != prompt")
    if off is not None and any((t["pulled_tokens"] or 0) for t in off["turns"]):
        bad.append("off: a turn pulled KV with reuse off")
    for name, run in runs.items():
        if run["up_exit"] != 0:
            bad.append(f"{name}: kvserving up exited {run['up_exit']} on SIGTERM")
    return bad


def table(dtype: str, runs: dict[str, dict[str, Any]]) -> str:
    lines = [f"{dtype}: turn | prompt | on pulled/computed/TTFT ms | timeout fallback/computed/TTFT ms | off computed/TTFT ms"]
    n = max(len(r["turns"]) for r in runs.values())
    for i in range(n):
        cells = []
        for mode in MODES:
            if mode not in runs or i >= len(runs[mode]["turns"]):
                cells.append("-")
                continue
            t = runs[mode]["turns"][i]
            ttft = f"{1e3 * t['ttft_s']:.0f}"
            if mode == "on":
                cells.append(f"{t['pulled_tokens']}/{t['computed_tokens']}/{ttft}")
            elif mode == "timeout":
                cells.append(f"{t['reuse_fallback'] or '-'}/{t['computed_tokens']}/{ttft}")
            else:
                cells.append(f"{t['computed_tokens']}/{ttft}")
        prompt = next(r["turns"][i]["prompt_tokens"] for r in runs.values() if i < len(r["turns"]))
        lines.append(f"  {i + 1} | {prompt} | " + " | ".join(cells))
    for mode, run in runs.items():
        if mode != "off" and "off" in runs:
            same = sum(a["reply"] == b["reply"] for a, b in zip(run["turns"], runs["off"]["turns"]))
            lines.append(f"  replies equal to off: {mode} {same}/{len(run['turns'])}")
        lines.append(f"  UCX transports ({mode}): {run['transports']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="up_gpu.json and the runs' logs go here")
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--kv-dtype", default="nvfp4,bf16", help="comma-separated KV formats")
    ap.add_argument("--gpus", default="0,1", help="kvserving up --gpus (prefill first)")
    ap.add_argument("--kv-mib", type=int, default=512, help="KV pool per worker in MiB")
    ap.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per assistant turn (>= the recompute threshold, 64, or nothing is pulled)"
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--cpu", action="store_true", help="no GPUs: the same stack on CPU memory")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = ModelConfig(path=str(args.model.resolve())) if args.model else ModelConfig()
    modes = [m for m in MODES if m in args.modes.split(",")]
    out_json = args.out / "up_gpu.json"
    result: dict[str, Any] = json.loads(out_json.read_text()) if out_json.exists() else {"formats": {}}
    result["gpus"] = None if args.cpu else args.gpus
    failures: list[str] = []
    for dtype in args.kv_dtype.split(","):
        base = ServingConfig(model=model, kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=args.kv_mib * 2**20))
        runs = {
            mode: run_mode(base, mode, gpus=None if args.cpu else args.gpus, work=args.out / dtype, max_tokens=args.max_tokens)
            for mode in modes
        }
        bad = check(runs)
        failures += [f"{dtype} {line}" for line in bad]
        result["formats"][dtype] = {"runs": runs, "failed": bad}
        print(table(dtype, runs), flush=True)
        out_json.write_text(jsonfmt.dumps(result))
    for line in failures:
        print(f"FAILED: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
