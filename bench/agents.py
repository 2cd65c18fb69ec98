"""Agents at scale on the real stack: prefix hit rate and throughput vs the number
of concurrent agents, at one fixed KV memory, per KV format (issue 18).

    PYTHONSAFEPATH=1 .venv/bin/python bench/agents.py [--formats bf16,fp8,nvfp4,triaxial]
        [--concurrency 1,2,4,6,8,11,16,22] [--kv-kib 3072] [--modes lease,ttl,off] [--mode-format fp8]
        [--mode-concurrency 4,8,11] [--json OUT] [--png OUT]

Per format (and reuse mode) one local stack (``kvserving.local.stack.LocalStack``:
gateway + prefill + decode worker processes on loopback, the built-in tiny
model, every worker's KV pool ``--kv-kib``). Per concurrency point N, N agents
of ``kvserving.agents.load`` (a system prompt with tool schemas, turns of user
text / reply + tool call / tool result, think time between turns, the whole
history resent each turn) run all their turns against the gateway with the
official ``openai`` AsyncOpenAI client, streaming; every request is recorded:
prompt tokens, ``usage.prompt_tokens_details.cached_tokens``, the gateway's
``usage.kvserving`` split (local prefix cache / pulled from the decode worker
/ computed), TTFT and output tokens. Point N runs agents ``1000 N .. 1000 N +
N - 1`` (``point_agents``) in every format and mode, so formats are compared
on the same traffic and no stack sees an agent twice; each point starts by
releasing every lease the workers hold, so it does not inherit the previous
point's pinned KV (stale unpinned pages stay in the LRU and go first).

Reuse modes: ``lease`` is the product default (the decode worker retains each
conversation's KV under a lease for ``retention_ttl_s`` = 480 s, the gateway
renews it while the conversation is active and the prefill pulls it back);
``ttl`` keeps the D->P pull but with a short fixed retention (``--ttl-s``),
after which retained pages return to the decode worker's LRU; ``off`` turns
bidirectional reuse off (the prefill worker's own prefix cache only).

Per point: hit rate = cached / prompt tokens (all turns; and turns 2+, since
every agent's first turn is cold), reuse by source, prefix-cache pages evicted
on each worker (``kvserving_worker_kv_evicted_pages_total``), preemptions,
requests/s and output tokens/s over the point's wall time, TTFT p50/p99.
The hit rate is about capacity, not speed: the tiny model's KV costs 1024
(fp8), 576 (nvfp4), 640 (triaxial INT4, 384 INT2) bytes per token, and bf16
2048 on a GPU but 4096 on CPU (the CPU engine keeps it as float32), so at
equal memory nvfp4 holds 1.78x the tokens of fp8. Results and every attempt:
docs/performance-log/agents.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvserving import jsonfmt
from kvserving.agents.load import REUSE_MODES, AgentSpec, Conversation, Dist, LoadSpec, agent, fixed, reuse_for_mode
from kvserving.config import KV_LAYOUTS, KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.local.stack import LocalStack, StackError, StackSpec, free_ports
from kvserving.progress import add_quiet_argument, progress
from kvserving.sim.cluster import means_per_event

# bench name -> (kv_cache.dtype, bit budget)
FORMATS: dict[str, tuple[str, float | None]] = {
    "bf16": ("bf16", None),
    "fp8": ("fp8_e4m3", None),
    "nvfp4": ("nvfp4", None),
    "triaxial": ("triaxial", 2.7),
    "tri-hold": ("triaxial", 2.7),
}
# bench names whose workers hold the bit budget (kv_cache.bit_budget_control "hold"; the others: the fixed table)
HELD = {"tri-hold"}
MODES = REUSE_MODES
HERE = Path(__file__).resolve().parent


def cpu_load(seed: int, *, think_s: float, turns: int | None = None) -> LoadSpec:
    """Agents scaled to the tiny model on 2 CPU cores: a ~290-token prefix (system prompt,
    two tools), ~6 turns adding ~90 tokens each (histories end at <= 700 tokens), 8-token
    replies, think time ~``think_s``; ``turns`` fixes every agent's turn count (quick runs)."""
    return LoadSpec(
        seed=seed,
        system_tokens=Dist("uniform", 50, 20, 1),
        num_tools=Dist("uniform", 2, 1, 1, 12),
        tool_description_tokens=Dist("uniform", 8, 4, 1),
        turns=Dist("uniform", 6, 2, 1) if turns is None else fixed(turns),
        user_tokens=Dist("lognormal", 25, 0.5, 4, 100),
        output_tokens=Dist("fixed", 8, 0, 8, 8),
        tool_call_prob=0.6,
        tool_args_tokens=Dist("uniform", 5, 3, 1),
        tool_result_tokens=Dist("lognormal", 50, 0.6, 4, 200),
        think_time_s=Dist("exponential", think_s, 0.0, 0.0, 4 * think_s),
        # every request fits the smallest pool of the default sweep: bf16 at 3 MiB holds 768
        # tokens on CPU (the CPU engine stores "bf16" KV as float32, 4096 B per token)
        max_context_tokens=700,
    )


def gpu_load(seed: int, *, think_s: float, turns: int | None = None) -> LoadSpec:
    """Coding agents for the Qwen3-8B-shaped model on one GPU: a system prompt with tool
    schemas of ~3.5K tokens (2K of instructions, 6 +- 2 tools of ~250 tokens), turns that
    mostly carry a tool result of 0.5-4K tokens (lognormal, median ~1.3K), 48-token replies
    (the reasoning before the next call), 10 +- 2 turns, ~``think_s`` between turns:
    histories end at ~12-25K tokens. Each agent has its own system prompt, so what is
    reused is its own conversation, never another agent's prefix: the hit rate measures
    how many conversations the pools keep."""
    return LoadSpec(
        seed=seed,
        system_tokens=Dist("uniform", 2000, 500, 1),
        num_tools=Dist("uniform", 6, 2, 1, 12),
        tool_description_tokens=Dist("uniform", 250, 100, 1),
        turns=Dist("uniform", 10, 2, 1) if turns is None else fixed(turns),
        user_tokens=Dist("lognormal", 150, 0.6, 20, 600),
        output_tokens=fixed(48),
        tool_call_prob=0.8,
        tool_args_tokens=Dist("uniform", 30, 15, 1),
        tool_result_tokens=Dist("lognormal", 1500, 0.6, 500, 4000),
        think_time_s=Dist("exponential", think_s, 0.0, 0.0, 4 * think_s),
        max_context_tokens=36_000,
    )


def stack_spec(
    fmt: str,
    mode: str,
    *,
    kv_bytes: int,
    ttl_s: float,
    run_dir: Path | None,
    gpu_model: Path | None = None,
    weights: str = "auto",
    kv_layout: str = KVCacheConfig().layout,
) -> StackSpec:
    """The stack of one format and reuse mode: the built-in tiny model on CPU, or with
    ``gpu_model`` that directory's model (dummy weights) with both workers on GPU 0; ``weights``
    is ``model.weight_format`` (an FP8 format quantizes the weights at load), ``kv_layout`` the
    workers' ``kv_cache.layout``."""
    from kvserving.model_dir import tiny_model_dir

    dtype, budget = FORMATS[fmt]
    if gpu_model is None:
        model = ModelConfig(path=str(tiny_model_dir()), weight_format=weights)
        scheduler = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, chunk_size=512)
    else:
        model = ModelConfig(path=str(gpu_model), served_name="qwen3-8b-shape", load_format="dummy", weight_format=weights)
        scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, chunk_size=4096)
    config = ServingConfig(
        model=model,
        kv_cache=KVCacheConfig(
            dtype=dtype,
            bit_budget=budget,
            memory_bytes=kv_bytes,
            bit_budget_control="hold" if fmt in HELD else "fixed",
            layout=kv_layout,
        ),
        reuse=reuse_for_mode(mode, ttl_s=ttl_s),
        scheduler=scheduler,
    )
    gateway, prefill, decode = free_ports(3)
    return StackSpec(
        config=config,
        gateway_port=gateway,
        prefill_port=prefill,
        decode_port=decode,
        run_dir=run_dir,
        gpus=("0",) if gpu_model is not None else (),
    )


# ------------------------------------------------------------------------------------- client
@dataclass(slots=True)
class Record:
    """One chat request as the agent saw it."""

    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    local_tokens: int  # usage.kvserving: prefill worker's own prefix cache
    pulled_tokens: int  # usage.kvserving: read from the decode worker (D->P)
    computed_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    fallback: str | None


async def run_agent(
    client: Any, model: str, spec: AgentSpec, *, delay_s: float, out: list[Record], errors: list[str], stop_at: float = math.inf
) -> None:
    """One agent's turns in order; an error answer ends the agent (recorded in ``errors``); no turn
    starts after ``stop_at`` (a ``time.perf_counter()`` value)."""
    from openai import APIError

    try:
        await _turns(client, model, spec, delay_s=delay_s, out=out, stop_at=stop_at)
    except APIError as exc:
        errors.append(f"{spec.session_id}: {exc}")


async def _turns(client: Any, model: str, spec: AgentSpec, *, delay_s: float, out: list[Record], stop_at: float) -> None:
    conv = Conversation(spec)
    await asyncio.sleep(delay_s)
    for turn in spec.turns:
        await asyncio.sleep(turn.think_time_s)
        if time.perf_counter() > stop_at:
            return
        messages = conv.request(turn)
        start = time.perf_counter()
        ttft: float | None = None
        parts: list[str] = []
        usage: Any = None
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=conv.tools,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=turn.output_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-ID": spec.session_id},
        )
        async for chunk in stream:
            if chunk.choices and ttft is None:
                ttft = time.perf_counter() - start
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None or ttft is None:
            raise RuntimeError(f"{spec.session_id} turn {turn.index}: the stream ended without tokens or usage")
        ext = (getattr(usage, "model_extra", None) or {}).get("kvserving") or {}
        details = usage.prompt_tokens_details
        out.append(
            Record(
                agent=spec.agent_id,
                turn=turn.index,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=int(details.cached_tokens or 0) if details is not None else 0,
                local_tokens=int(ext.get("local_cached_tokens", 0)),
                pulled_tokens=int(ext.get("remote_pulled_tokens", 0)),
                computed_tokens=int(ext.get("computed_prompt_tokens", 0)),
                output_tokens=usage.completion_tokens,
                ttft_s=ttft,
                latency_s=time.perf_counter() - start,
                fallback=ext.get("reuse_fallback"),
            )
        )
        conv.reply(turn, "".join(parts))


async def run_point(
    base_url: str, model: str, load: LoadSpec, agents: range, *, timeout_s: float, window_s: float | None = None
) -> tuple[list[Record], list[str], float]:
    """Run every agent in ``agents`` at once (starts spread over one mean think time); records,
    errors and wall time. With ``window_s`` no turn starts after that many seconds (the turns in
    flight finish and count), as the seed's agent harness runs each point for a fixed time."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused-locally", timeout=timeout_s, max_retries=0)
    records: list[Record] = []
    errors: list[str] = []
    spread = load.think_time_s.mean
    start = time.perf_counter()
    stop_at = math.inf if window_s is None else start + window_s
    try:
        await asyncio.gather(
            *(
                run_agent(
                    client, model, agent(load, i), delay_s=spread * k / max(len(agents), 1), out=records, errors=errors, stop_at=stop_at
                )
                for k, i in enumerate(agents)
            )
        )
    finally:
        await client.close()
    return records, errors, time.perf_counter() - start


# ------------------------------------------------------------------------------------ workers
def _get(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback URL we built)
        return bytes(resp.read())


def worker_counters(url: str, headers: dict[str, str]) -> dict[str, float]:
    """Counters of one worker: evicted prefix-cache pages (from /metrics), preemptions, capacity."""
    stats = json.loads(_get(url + "/internal/kv/stats", headers=headers))
    text = _get(url + "/metrics").decode()

    def counter(name: str) -> float:
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else math.nan

    # recompute fallbacks of the worker's own pulls by reason (a decode worker's: P -> D READs)
    fallbacks = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^kvserving_worker_kv_reuse_fallbacks_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$', text, re.M)
    }
    xfer = stats.get("transfer") or {}
    return {
        **{f"fallback_{reason}": n for reason, n in fallbacks.items()},
        # the worker's own pulls: made, skipped by reason, the tokens each skip or fallback left to compute
        "pulls": float(xfer.get("pulls", 0)),
        "pulled_tokens": float(xfer.get("pulled_tokens", 0)),
        **{f"skip_{reason}": float(n) for reason, n in (xfer.get("skips") or {}).items()},
        **{f"missed_{reason}": float(n) for reason, n in (xfer.get("missed_tokens") or {}).items()},
        "page_waits": float(xfer.get("page_waits", 0)),
        # pulls whose allocation found no room, and what held the pool's pages each time (summed)
        "no_room": float(xfer.get("no_room", 0)),
        **{f"held_{key}": float(n) for key, n in (xfer.get("no_room_held_pages") or {}).items()},
        # a prefill worker's transfer leases by how they ended, and the seconds they held pages
        **{f"xfer_ended_{end}": float(n) for end, n in (xfer.get("transfer_leases_ended") or {}).items()},
        **{f"xfer_s_{end}": float(v) for end, v in (xfer.get("transfer_lease_seconds") or {}).items()},
        # tokens a pull had in place that its request no longer found at admission (computed instead)
        "lost_tokens": float((stats.get("prompt_tokens") or {}).get("lost_before_admission", 0)),
        "page_wait_s": float(xfer.get("page_wait_seconds", 0.0)),
        # requests that reached their first token and their time to it summed by phase (the pull's, the add, the
        # wait for the step, the step)
        "first_token_requests": float((stats.get("first_token") or {}).get("requests", 0)),
        **{f"first_token_s_{phase}": float(v) for phase, v in ((stats.get("first_token") or {}).get("seconds") or {}).items()},
        # bytes the worker's successful READs moved and their wall time: the transport's rate
        "pulled_bytes": float(xfer.get("pulled_bytes", 0)),
        "pulled_regions": float(xfer.get("pulled_regions", 0)),  # NIXL descriptors the READs moved (runs x layers)
        "transfer_s": float(xfer.get("transfer_seconds", 0.0)),
        "descriptor_s": float(xfer.get("descriptor_seconds", 0.0)),  # of transfer_s: the descriptor lists built in Python
        "post_s": float(xfer.get("post_seconds", 0.0)),  # of transfer_s: NIXL taking those lists and posting the READ
        "evicted_pages": counter("kvserving_worker_kv_evicted_pages_total"),
        # GPU kernels compiled inside served steps (each one stalled its step) and their seconds
        "compiles": counter('kvserving_worker_kernel_compiles_total\\{phase="serving"\\}'),
        "compile_s": counter('kvserving_worker_kernel_compile_seconds_total\\{phase="serving"\\}'),
        "reclaimed_leases": counter("kvserving_worker_kv_leases_reclaimed_total"),
        "preemptions": float(stats.get("preemptions", 0)),
        # admissions whose pulled pages' pin had expired or yielded first (lost_tokens with the pin alive: another cause)
        "admission_pins_gone": float(stats.get("admission_pins_gone", 0)),
        # pages those pins gave up from their tails to live requests (the pin stays with the rest)
        "admission_pages_trimmed": float(stats.get("admission_pages_trimmed", 0)),
        # admissions placed without the cached pages they matched, and the cached tokens admissions gave up
        # (lost_tokens with the pin alive: a placement that fit only without them)
        "admissions_from_scratch": float(stats.get("admissions_from_scratch", 0)),
        "admission_dropped_tokens": float(stats.get("admission_dropped_tokens", 0)),
        "age_down_skipped_pages": float(stats.get("age_down_skipped_pages", 0)),
        # prompt tokens the engine computed (on the decode worker: recompute after a preemption or a failed pull)
        "computed_tokens": counter("kvserving_worker_prompt_tokens_total"),
        **{f"{kind}_steps": float(v["count"]) for kind, v in stats.get("steps", {}).items()},
        **{f"{kind}_step_s": float(v["seconds"]) for kind, v in stats.get("steps", {}).items()},
        # live (owned + cached) pages stored at 2 bits: triaxial's density depends on it
        "int2_pages": float(
            sum(v for k, v in (stats.get("precisions", {}).get("int2") or {}).items() if k in ("owned_pages", "cached_pages"))
        ),
        "int4_pages": float(
            sum(
                v
                for name, p in stats.get("precisions", {}).items()
                if name != "int2"
                for k, v in p.items()
                if k in ("owned_pages", "cached_pages")
            )
        ),
        "capacity_tokens": float(stats.get("capacity_tokens", 0)),
        "page_size": float(stats.get("page_size", 0)),
        # bits per value over the pages held (owned + cached) and over the owned ones (NaN: none held)
        **{
            key: float(v) if isinstance(v := (stats.get("stored_bits") or {}).get(field), int | float) else math.nan
            for key, field in (("stored_bits", "excluded"), ("owned_stored_bits", "owned"))
        },
    }


def release_leases(url: str, headers: dict[str, str]) -> int:
    leases = json.loads(_get(url + "/internal/kv/leases", headers=headers))["leases"]
    for lease in leases:
        try:
            _get(f"{url}/internal/kv/leases/{lease['lease_id']}", method="DELETE", headers=headers)
        except OSError:
            pass  # expired meanwhile
    return len(leases)


# ------------------------------------------------------------------------------------ metrics
def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(records: list[Record], wall_s: float) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in records)
    later = [r for r in records if r.turn > 0]
    later_prompt = sum(r.prompt_tokens for r in later)
    ttfts = [r.ttft_s for r in records]
    tpots = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    fallbacks: dict[str, int] = {}
    for r in records:
        if r.fallback:
            fallbacks[r.fallback] = fallbacks.get(r.fallback, 0) + 1
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": sum(r.cached_tokens for r in records),
        "hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else math.nan,
        "hit_rate_later_turns": sum(r.cached_tokens for r in later) / later_prompt if later_prompt else math.nan,
        "local_share": sum(r.local_tokens for r in records) / prompt if prompt else math.nan,
        "pulled_share": sum(r.pulled_tokens for r in records) / prompt if prompt else math.nan,
        "computed_tokens": sum(r.computed_tokens for r in records),
        "output_tokens": sum(r.output_tokens for r in records),
        "wall_s": wall_s,
        "req_per_s": len(records) / wall_s,
        "output_tok_per_s": sum(r.output_tokens for r in records) / wall_s,
        "ttft_p50_ms": _pct(ttfts, 0.50) * 1e3,
        "ttft_p99_ms": _pct(ttfts, 0.99) * 1e3,
        "tpot_p50_ms": _pct(tpots, 0.50) * 1e3,
        "tpot_p99_ms": _pct(tpots, 0.99) * 1e3,
        "fallbacks": fallbacks,
    }


def crossing(points: list[dict[str, Any]], key: str = "hit_rate", level: float = 0.5) -> float | None:
    """Concurrency where ``key`` first drops below ``level``, linearly interpolated between the
    last point at or above it and the first below; None if it never drops below."""
    pts = sorted(points, key=lambda p: p["concurrency"])
    for a, b in zip(pts, pts[1:]):
        if a[key] >= level > b[key]:
            return float(a["concurrency"] + (a[key] - level) * (b["concurrency"] - a["concurrency"]) / (a[key] - b[key]))
    if pts and pts[0][key] < level:
        return float(pts[0]["concurrency"])
    return None


# ---------------------------------------------------------------------------------------- run
@contextlib.contextmanager
def _started_stack(fmt: str, mode: str, args: argparse.Namespace) -> Iterator[tuple[StackSpec, LocalStack]]:
    """A ready stack; a start that fails (a port taken between picking and binding it) is
    retried twice on fresh ports."""
    for attempt in range(3):
        run_dir = args.run_dir / f"{fmt}-{mode}-{attempt}" if args.run_dir else None
        spec = stack_spec(
            fmt,
            mode,
            kv_bytes=kv_bytes(args),
            ttl_s=args.ttl_s,
            run_dir=run_dir,
            gpu_model=args.gpu_model,
            weights=args.weights,
            kv_layout=args.kv_layout,
        )
        stack = LocalStack(spec)
        try:
            stack.start()
            stack.wait_ready(timeout_s=600 if args.gpu else 180)
        except StackError as exc:
            stack.close()
            if attempt == 2:
                raise
            print(f"  {fmt} {mode}: stack did not start ({str(exc).splitlines()[0]}); retrying", file=sys.stderr)
            continue
        with stack:
            yield spec, stack
        return


def point_agents(n: int) -> range:
    """The agents of the point with ``n`` concurrent agents: the same in every stack, disjoint across points."""
    return range(1000 * n, 1000 * n + n)


def kv_bytes(args: argparse.Namespace) -> int:
    return int(args.kv_gib * 2**30) if args.gpu else args.kv_kib * 1024


def run_stack(
    fmt: str, mode: str, concurrencies: list[int], load: LoadSpec, args: argparse.Namespace, *, on_point: Any = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every point of one stack; ``on_point(points, meta)`` after each (partial results survive a
    time limit); points stop once ``args.budget_s`` has passed since the bench started."""
    points: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with _started_stack(fmt, mode, args) as (spec, stack):
        workers, auth = stack.worker_urls, stack.internal_headers
        info = {role: worker_counters(url, auth) for role, url in workers.items()}
        meta = {
            "format": fmt,
            "mode": mode,
            "start_s": time.perf_counter() - t0,
            "capacity_tokens": {role: int(c["capacity_tokens"]) for role, c in info.items()},
            "page_size": int(info["prefill"]["page_size"]),
        }
        model = spec.config.model.served_name
        if args.warmup_agents:
            # a conversation outside every measured point (the gateway's and workers' first requests)
            warm_load = replace(load, turns=fixed(2))
            t_warm = time.perf_counter()
            _, warm_errors, _ = asyncio.run(
                run_point(stack.openai_base_url, model, warm_load, range(10**6, 10**6 + args.warmup_agents), timeout_s=args.request_timeout)
            )
            meta["warmup_s"] = time.perf_counter() - t_warm
            if warm_errors:
                raise RuntimeError(f"warm-up failed: {warm_errors[0]}")
        for n in concurrencies:
            if args.budget_s is not None and time.perf_counter() - args.t0 > args.budget_s:
                print(f"  {fmt} {mode}: --budget-s {args.budget_s:g} passed, points from N={n} not run", file=sys.stderr, flush=True)
                meta["skipped_points"] = [c for c in concurrencies if c >= n]
                break
            for url in workers.values():
                release_leases(url, auth)
            before = {role: worker_counters(url, auth) for role, url in workers.items()}
            records, errors, wall = asyncio.run(
                run_point(stack.openai_base_url, model, load, point_agents(n), timeout_s=args.request_timeout, window_s=args.point_s)
            )
            dead = stack.check()
            if dead is not None:
                raise RuntimeError(stack.describe_death(dead))
            after = {role: worker_counters(url, auth) for role, url in workers.items()}
            point = {"format": fmt, "mode": mode, "concurrency": n, **summarize(records, wall), "errors": errors, "window_s": args.point_s}
            for role in workers:
                for key in (
                    "evicted_pages",
                    "preemptions",
                    "reclaimed_leases",
                    "computed_tokens",
                    "pulls",
                    "pulled_tokens",
                    "page_waits",
                    "lost_tokens",
                    "admission_pins_gone",
                    "admission_pages_trimmed",
                    "admissions_from_scratch",
                    "admission_dropped_tokens",
                    "age_down_skipped_pages",
                    "compiles",
                ):
                    point[f"{role}_{key}"] = int(after[role][key] - before[role][key])
                point[f"{role}_compile_s"] = round(after[role]["compile_s"] - before[role]["compile_s"], 2)
                point[f"{role}_page_wait_s"] = round(after[role]["page_wait_s"] - before[role]["page_wait_s"], 3)
                read_bytes = after[role]["pulled_bytes"] - before[role]["pulled_bytes"]
                read_s = after[role]["transfer_s"] - before[role]["transfer_s"]
                point[f"{role}_read_gbs"] = round(read_bytes / read_s / 1e9, 2) if read_s > 0 else 0.0  # the READs that ended
                pulls = after[role]["pulls"] - before[role]["pulls"]
                regions = after[role]["pulled_regions"] - before[role]["pulled_regions"]
                point[f"{role}_regions_per_pull"] = round(regions / pulls, 1) if pulls else 0.0  # page runs x layers
                point[f"{role}_read_ms_per_pull"] = round(1e3 * read_s / pulls, 2) if pulls else 0.0  # a READ, its whole time
                for part in ("descriptor", "post"):  # of it: the lists built in Python, NIXL taking them and posting
                    seconds = after[role][f"{part}_s"] - before[role][f"{part}_s"]
                    point[f"{role}_{part}_ms_per_pull"] = round(1e3 * seconds / pulls, 2) if pulls else 0.0

                def grown(prefix: str) -> dict[str, float]:  # the counters named prefix + key, their growth by key
                    return {
                        key.removeprefix(prefix): v - before[role].get(key, 0.0) for key, v in after[role].items() if key.startswith(prefix)
                    }

                for prefix, name in (("fallback_", "fallbacks"), ("skip_", "skips"), ("missed_", "missed_tokens")):
                    point[f"{role}_{name}"] = {k: int(v) for k, v in grown(prefix).items() if v > 0}  # by reason, the ones that moved
                # pulls that found no room and the pool's pages held then, by holder (summed); transfer leases that
                # ended in the window, by how, and their seconds (summed): means_per_event divides them
                # where a request's time to its first token went on this worker, mean ms per request by phase
                firsts = after[role].get("first_token_requests", 0.0) - before[role].get("first_token_requests", 0.0)
                point[f"{role}_first_token_ms"] = (
                    {k: round(1e3 * v / firsts, 1) for k, v in grown("first_token_s_").items() if v > 0} if firsts > 0 else {}
                )
                point[f"{role}_no_room"] = int(after[role]["no_room"] - before[role]["no_room"])
                point[f"{role}_no_room_held"] = grown("held_")
                point[f"{role}_transfer_leases"] = {end: int(n) for end, n in grown("xfer_ended_").items()}
                point[f"{role}_transfer_lease_seconds"] = grown("xfer_s_")
                for kind in ("decode", "mixed"):  # the engine's steps in the window: how many, mean wall time
                    steps = after[role].get(f"{kind}_steps", 0.0) - before[role].get(f"{kind}_steps", 0.0)
                    seconds = after[role].get(f"{kind}_step_s", 0.0) - before[role].get(f"{kind}_step_s", 0.0)
                    point[f"{role}_{kind}_steps"] = int(steps)
                    point[f"{role}_{kind}_step_ms"] = round(1e3 * seconds / steps, 3) if steps else 0.0
            means_per_event(point)  # no-room pulls' held pages, transfer leases' seconds: as the replay reports them
            live = after["decode"]["int2_pages"] + after["decode"]["int4_pages"]
            point["decode_int2_page_share"] = after["decode"]["int2_pages"] / live if live else 0.0
            for role in workers:  # what each pool stores at the end of the point
                point[f"{role}_stored_bits"] = after[role]["stored_bits"]
                point[f"{role}_owned_stored_bits"] = after[role]["owned_stored_bits"]
            point["records"] = [asdict(r) for r in records] if args.records else []
            points.append(point)
            print(
                f"  {fmt:>8} {mode:>5} N={n:>3}: hit {point['hit_rate']:.2f} (later {point['hit_rate_later_turns']:.2f}) "
                f"{point['req_per_s']:.2f} req/s  TTFT p50 {point['ttft_p50_ms']:.0f} ms  "
                f"evicted P/D {point['prefill_evicted_pages']}/{point['decode_evicted_pages']}  "
                f"D steps decode {point['decode_decode_steps']} x {point['decode_decode_step_ms']:.1f} ms, "
                f"mixed {point['decode_mixed_steps']} x {point['decode_mixed_step_ms']:.1f} ms, "
                f"computed {point['decode_computed_tokens']}, pulls {point['decode_pulls']}, skips {point['decode_skips']}, "
                f"READ {point['decode_read_gbs']:.1f} GB/s, missed {point['decode_missed_tokens']}, lost {point['decode_lost_tokens']}, fallbacks {point['decode_fallbacks']}, "
                f"compiles P/D {point['prefill_compiles']}/{point['decode_compiles']}  errors {len(errors)}  {wall:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            if on_point is not None:
                on_point(points, meta)
    return points, meta


def format_table(points: list[dict[str, Any]]) -> str:
    head = (
        f"{'format':>8} {'mode':>5} {'N':>3} {'req':>4} {'hit':>5} {'hit2+':>5} {'local':>5} {'pulled':>6} "
        f"{'evict P':>7} {'evict D':>7} {'reclaim':>7} {'preempt':>7} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>8} {'p99 ms':>7} "
        f"{'TPOT p50':>8} {'p99 ms':>7} {'bits D':>6} {'owned':>5}"
    )
    lines = [head]
    for p in points:
        lines.append(
            f"{p['format']:>8} {p['mode']:>5} {p['concurrency']:>3} {p['requests']:>4} {p['hit_rate']:>5.2f} "
            f"{p['hit_rate_later_turns']:>5.2f} {p['local_share']:>5.2f} {p['pulled_share']:>6.2f} "
            f"{p['prefill_evicted_pages']:>7} {p['decode_evicted_pages']:>7} {p['decode_reclaimed_leases']:>7} "
            f"{p['prefill_preemptions'] + p['decode_preemptions']:>7} {p['req_per_s']:>6.2f} {p['output_tok_per_s']:>9.1f} "
            f"{p['ttft_p50_ms']:>8.0f} {p['ttft_p99_ms']:>7.0f} {p['tpot_p50_ms']:>8.1f} {p['tpot_p99_ms']:>7.1f} "
            f"{p.get('decode_stored_bits', math.nan):>6.2f} {p.get('decode_owned_stored_bits', math.nan):>5.2f}"
        )
    return "\n".join(lines)


SEED_FP8_CLIFF = 12  # the seed's multi-turn agent bench: fp8 throughput fell off above 12 concurrent agents


def plot(points: list[dict[str, Any]], path: Path, *, title: str, seed_cliff: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    for fmt in FORMATS:
        pts = sorted((p for p in points if p["format"] == fmt and p["mode"] == "lease"), key=lambda p: p["concurrency"])
        if not pts:
            continue
        xs = [p["concurrency"] for p in pts]
        left.plot(xs, [p["hit_rate"] for p in pts], marker="o", label=fmt)
        right.plot(xs, [p["output_tok_per_s"] for p in pts], marker="o", label=fmt)
    for mode, style in (("ttl", "--"), ("off", ":")):
        pts = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["concurrency"])
        if pts:
            xs = [p["concurrency"] for p in pts]
            label = f"{pts[0]['format']} {mode}"
            left.plot(xs, [p["hit_rate"] for p in pts], ls=style, color="black", marker=".", label=label)
            right.plot(xs, [p["output_tok_per_s"] for p in pts], ls=style, color="black", marker=".", label=label)
    left.axhline(0.5, color="grey", lw=0.8, ls="--")
    if seed_cliff:
        for ax in (left, right):
            ax.axvline(SEED_FP8_CLIFF, color="red", lw=0.8, ls=":", label=f"seed: fp8 cliff (>{SEED_FP8_CLIFF} agents)")
    for ax, ylabel in ((left, "prefix hit rate (cached / prompt tokens)"), (right, "output tokens / s")):
        ax.set_xlabel("concurrent agents")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # small: the lines past 12 agents run under it
    left.set_ylim(0, 1)
    fig.suptitle(textwrap.fill(title, 120), fontsize=10)  # a long title wraps instead of running off the figure
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _finite(obj: Any) -> Any:
    """``obj`` with non-finite floats (an unbounded ``Dist.high``, a hit rate of no request) as
    None: strict JSON, readable by any tool."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _csv_names(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected names from {list(choices)}, got {text!r}")
        return names

    return parse


def combine(files: list[Path], json_out: Path, png_out: Path) -> dict[str, Any]:
    """One result from runs of the same load and pool in parts (a sweep landed over several
    device calls): every point, a later file's point replacing an earlier one of the same
    format, mode and concurrency; the stacks that ran points; crossings recomputed."""
    parts = [json.loads(f.read_text()) for f in files]
    for key in ("load", "kv_per_worker", "think_s", "seed", "device", "kv_layout"):
        default = "layer_major" if key == "kv_layout" else None  # parts from before the layout was recorded
        if any(p.get(key, default) != parts[0].get(key, default) for p in parts):
            raise ValueError(f"--combine: the files differ in {key!r}; only parts of one sweep (one machine) combine")
    by_point: dict[tuple[str, str, int], dict[str, Any]] = {}
    stacks = []
    for f, part in zip(files, parts):
        for p in part["points"]:  # a combined file keeps its parts' names
            by_point[(p["format"], p["mode"], p["concurrency"])] = {**p, "part": p.get("part", f.name)}
        ran = {(p["format"], p["mode"]) for p in part["points"]}
        stacks += [{**s, "part": s.get("part", f.name)} for s in part["stacks"] if (s["format"], s["mode"]) in ran]
    points = [by_point[k] for k in sorted(by_point, key=lambda k: (list(FORMATS).index(k[0]), k[1], k[2]))]
    crossings = {
        f"{f}/{m}": crossing([p for p in points if (p["format"], p["mode"]) == (f, m)])
        for f, m in sorted({(p["format"], p["mode"]) for p in points})
    }
    runs = sum(len(p.get("parts", [None])) for p in parts)  # a combined file counts its own parts
    what = re.sub(r" \(combined from \d+ runs\)$", "", parts[0]["what"]) + f" (combined from {runs} runs)"
    result = {
        **parts[0],
        "what": what,
        "points": points,
        "stacks": stacks,
        "crossing_50pct": crossings,
        "total_s": sum(p["total_s"] for p in parts),
        "parts": [name for f, p in zip(files, parts) for name in p.get("parts", [f.name])],
    }
    json_out.write_text(jsonfmt.dumps(_finite(result), allow_nan=False))
    # "bench/agents.py: agent traffic on the local stack (WHERE) (combined from N runs)": WHERE may hold parentheses
    where = what.split(" (", 1)[-1].rsplit(") (combined", 1)[0]
    plot(points, png_out, title=_title(result, where), seed_cliff=True)
    return result


def _title(result: dict[str, Any], where: str) -> str:
    on = f" ({result['device']})" if result.get("device") not in (None, "CPU") else ""
    return f"{result['kv_per_worker']} KV per worker; {where}{on}"


def gpu_name() -> str:
    """GPU 0's name as nvidia-smi says it (the bench process never touches CUDA: the workers hold the GPU)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"agents.py: error: --gpu: nvidia-smi could not name GPU 0 ({exc})") from exc
    return out.stdout.strip().splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", type=_csv_names(tuple(FORMATS)), default=list(FORMATS))
    ap.add_argument(
        "--concurrency", type=_csv_ints, default=None, help="points (default: 1,2,4,6,8,11,16,22 on CPU; 1,4,8,12,16,24,32 with --gpu)"
    )
    ap.add_argument(
        "--modes", type=_csv_names(MODES), default=list(MODES), help="reuse modes; modes other than 'lease' run on --mode-format only"
    )
    ap.add_argument("--mode-format", choices=tuple(FORMATS), default="fp8")
    ap.add_argument("--mode-concurrency", type=_csv_ints, default=[4, 8, 11], help="points for the other modes")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="the Qwen3-8B-shaped model (dummy weights) with prefill and decode worker on GPU 0, coding-agent load",
    )
    ap.add_argument(
        "--kv-layout",
        choices=KV_LAYOUTS,
        default=KVCacheConfig().layout,
        help="the workers' kv_cache.layout (page_major: a run of pages is one NIXL region for every layer)",
    )
    ap.add_argument(
        "--weights",
        choices=("auto", "fp8", "fp8_block"),
        default="auto",
        help="the model's linear layers: as built (bf16), or FP8 per channel / per 128x128 block, quantized at load",
    )
    ap.add_argument("--kv-kib", type=int, default=3072, help="KV pool per worker, KiB (same for every format; CPU)")
    ap.add_argument("--kv-gib", type=float, default=8.0, help="KV pool per worker, GiB (same for every format; --gpu)")
    ap.add_argument("--ttl-s", type=float, default=3.0, help="retention of the 'ttl' mode, seconds")
    ap.add_argument("--think-s", type=float, default=None, help="mean think time between turns, seconds (default 0.5; 1.0 with --gpu)")
    ap.add_argument("--turns", type=int, default=None, help="every agent runs this many turns (default: the load's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup-agents",
        type=int,
        default=0,
        help="agents of a 2-turn conversation before each stack's first point, not recorded (default 0: the workers "
        "warm up before they say ready, and each point counts the kernels still compiled in it, {role}_compiles)",
    )
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=None, help="start no point after this many seconds (results so far are kept)")
    ap.add_argument(
        "--point-s",
        type=float,
        default=None,
        help="start no turn after this many seconds of a point (default: every agent runs all its turns)",
    )
    ap.add_argument("--records", action="store_true", help="keep every request's record in the JSON")
    ap.add_argument("--run-dir", type=Path, default=None, help="keep each stack's logs and config here")
    ap.add_argument(
        "--json", type=Path, default=None, help="default: bench/results/agents_cpu.json, bench/results/agents_gpu_h200.json with --gpu"
    )
    ap.add_argument("--png", type=Path, default=None, help="default: beside --json")
    ap.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        help="write one result (--json, --png) from the JSON files of a sweep run in parts, and exit",
    )
    add_quiet_argument(ap)
    args = ap.parse_args(argv)
    if args.combine:
        if args.json is None:
            ap.error("--combine needs --json")
        try:
            result = combine(args.combine, args.json, args.png or args.json.with_suffix(".png"))
        except ValueError as exc:
            ap.error(str(exc))
        print(format_table(result["points"]))
        return 0
    if args.kv_kib < 64:
        ap.error(f"--kv-kib must be >= 64, got {args.kv_kib}")
    if args.kv_gib <= 0:
        ap.error(f"--kv-gib must be > 0, got {args.kv_gib}")
    if args.point_s is not None and args.point_s <= 0:
        ap.error(f"--point-s must be > 0, got {args.point_s}")
    if args.turns is not None and args.turns < 1:
        ap.error(f"--turns must be >= 1, got {args.turns}")
    if args.warmup_agents < 0:
        ap.error(f"--warmup-agents must be >= 0, got {args.warmup_agents}")
    think_s = args.think_s if args.think_s is not None else (1.0 if args.gpu else 0.5)
    if think_s <= 0:
        ap.error(f"--think-s must be > 0, got {think_s}")
    if args.concurrency is not None and "lease" not in args.modes:  # its points would be silently the defaults
        ap.error(
            f"--concurrency sets mode lease's points and --modes {','.join(args.modes)} runs no lease; the other modes take --mode-concurrency"
        )
    args.concurrency = args.concurrency or ([1, 4, 8, 12, 16, 24, 32] if args.gpu else [1, 2, 4, 6, 8, 11, 16, 22])
    args.json = args.json or HERE / "results" / ("agents_gpu_h200.json" if args.gpu else "agents_cpu.json")
    args.png = args.png or args.json.with_suffix(".png")
    args.t0 = time.perf_counter()
    args.gpu_model = None
    if args.gpu:
        import tempfile

        from kvserving.tiny_model import build_tiny_model

        model_root = args.run_dir if args.run_dir is not None else Path(tempfile.mkdtemp(prefix="kvs-agents-gpu-"))
        args.gpu_model = build_tiny_model(model_root / "qwen3-8b-shape", shape="qwen3-8b")
    load = (gpu_load if args.gpu else cpu_load)(args.seed, think_s=think_s, turns=args.turns)
    runs: list[tuple[str, str, list[int]]] = [(f, "lease", args.concurrency) for f in args.formats if "lease" in args.modes]
    runs += [(args.mode_format, m, args.mode_concurrency) for m in args.modes if m != "lease"]
    points: list[dict[str, Any]] = []
    stacks: list[dict[str, Any]] = []
    weights = "bf16" if args.weights == "auto" else args.weights
    device = gpu_name() if args.gpu else "CPU"
    where = (
        f"Qwen3-8B shape (dummy {weights} weights, built-in tokenizer), prefill + decode worker on one GPU"
        if args.gpu
        else f"tiny model ({weights} weights), CPU"
    )
    pool = f"{args.kv_gib:g} GiB" if args.gpu else f"{args.kv_kib} KiB"

    def result() -> dict[str, Any]:
        crossings: dict[str, float | None] = {}
        for key in {f"{p['format']}/{p['mode']}" for p in points}:
            fmt, mode = key.split("/")
            crossings[key] = crossing([p for p in points if p["format"] == fmt and p["mode"] == mode])
        return {
            "what": f"bench/agents.py: agent traffic on the local stack ({where})",
            "kv_per_worker": pool,
            "device": device,
            "think_s": think_s,
            "seed": args.seed,
            "ttl_s": args.ttl_s,
            "kv_layout": args.kv_layout,
            "load": asdict(load),
            "stacks": stacks,
            "points": points,
            "crossing_50pct": crossings,
            "total_s": time.perf_counter() - args.t0,
        }

    def save(done_points: list[dict[str, Any]], meta: dict[str, Any]) -> None:
        current = result()
        current["points"] = points + done_points
        current["stacks"] = stacks + [meta]
        args.json.write_text(jsonfmt.dumps(_finite(current), allow_nan=False))

    for fmt, mode, conc in progress(runs, desc="stacks", quiet=args.quiet):
        pts, meta = run_stack(fmt, mode, conc, load, args, on_point=save)
        points += pts
        stacks.append(meta)
    print(format_table(points))
    final = result()
    print(
        "concurrency where the hit rate drops below 50%: "
        + ", ".join(
            f"{k} {'>' + str(max(args.concurrency)) if v is None else f'{v:.1f}'}" for k, v in sorted(final["crossing_50pct"].items())
        )
    )
    caps = {m["format"]: m["capacity_tokens"]["decode"] for m in stacks if m["mode"] == "lease"}
    print("pool capacity per worker, tokens: " + ", ".join(f"{k} {v}" for k, v in caps.items()))
    args.json.write_text(jsonfmt.dumps(_finite(final), allow_nan=False))
    on = f" ({device})" if args.gpu else ""
    plot(points, args.png, title=f"{pool} KV per worker, {where}{on}, {len(points)} points", seed_cliff=args.gpu)
    print(f"wrote {args.json} and {args.png} ({final['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
