"""``kvserving simulate``: capacity planning and validation on top of ``kvserving.sim.cluster``.

- Capacity: a GPU-scale agent population (``gpu_load``) on N GPUs split into prefill and
  decode workers; ``fewest_gpus`` searches the fewest GPUs whose TTFT p99 meets a target
  (short probe runs, the answer confirmed over the full duration); one format per process.
- Validation: ``validate_points`` re-runs the points of bench/agents.py's JSON (same agents,
  KV budget, scheduler, reuse mode, points in the order they ran) and pairs each with what
  the real stack measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from kvserving.agents.load import AgentSpec, LoadSpec, reuse_for_mode
from kvserving.config import KV_LAYOUTS, ReuseConfig, SchedulerConfig
from kvserving.sim.bench_results import bench_dtype, kv_bytes_per_worker, load_spec_from_dict, page_major
from kvserving.sim.costs import CostModel
from kvserving.sim import cluster as pure
from kvserving.sim.cluster import ClusterSpec, Population, Simulator, run_bench_point
from kvserving.sim.workers import PullRules


# ---------------------------------------------------------------------------------- capacity planning
def gpu_load(
    seed: int = 0, *, think_s: float = 30.0, output_tokens: int = 250, max_context: int = 32768, shared_system_prompt: bool = True
) -> LoadSpec:
    """Coding-agent traffic at GPU scale: a 2K-token shared system prompt with 8 tools, turns of
    tool results ~1.5K tokens, replies ~``output_tokens``, ``think_s`` mean think time (tool runs)."""
    from kvserving.agents.load import Dist

    return LoadSpec(
        seed=seed,
        system_tokens=Dist("uniform", 2000, 500, 1),
        num_tools=Dist("uniform", 8, 2, 1, 12),
        tool_description_tokens=Dist("uniform", 80, 40, 1),
        turns=Dist("uniform", 20, 10, 1),
        user_tokens=Dist("lognormal", 200, 0.6, 4, 2000),
        output_tokens=Dist("uniform", output_tokens, output_tokens // 2, 1),
        tool_call_prob=0.8,
        tool_args_tokens=Dist("uniform", 30, 15, 1),
        tool_result_tokens=Dist("lognormal", 1500, 0.8, 4, 8000),
        think_time_s=Dist("exponential", think_s, 0.0, 0.0, 10 * think_s),
        shared_system_prompt=shared_system_prompt,
        max_context_tokens=max_context,
    )


def split_gpus(gpus: int, prefill_share: float) -> tuple[int, int]:
    """(prefill, decode) workers, one GPU each, at least one of each."""
    if gpus < 2:
        raise ValueError(f"gpus must be >= 2 (one prefill and one decode worker), got {gpus}")
    prefill = min(gpus - 1, max(1, round(gpus * prefill_share)))
    return prefill, gpus - prefill


def simulate_point(
    dtype: str,
    gpus: int,
    *,
    costs: CostModel,
    load: LoadSpec,
    pop: Population,
    prefill_share: float,
    reuse: ReuseConfig | None = None,
    progress: Callable[[float], None] | None = None,
    shapes: dict[int, AgentSpec] | None = None,
    engine: ModuleType = pure,
    pull_waits: bool = True,
) -> dict[str, Any]:
    """One population run. ``engine``: ``kvserving.sim.cluster`` or its compiled build
    (``sim_native.load()``); ``pop`` must be that module's ``Population``. ``pull_waits``:
    ``PullRules.pull_waits``."""
    prefill, decode = split_gpus(gpus, prefill_share)
    cluster = engine.ClusterSpec(
        dtype,
        prefill,
        decode,
        costs,
        reuse=reuse or ReuseConfig(),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, chunk_size=2048),
        rules=engine.PullRules(pull_waits=pull_waits),
    )
    sweep_s = max(30.0, min(cluster.gateway.lease_heartbeat_s, cluster.reuse.lease_ttl_s) / 4)
    sim = engine.Simulator(cluster, load, sweep_s=sweep_s)
    point: dict[str, Any] = engine.run_population(sim, pop, progress=progress, shapes=shapes)
    point.update(
        {
            "dtype": dtype,
            "gpus": gpus,
            "prefill_workers": prefill,
            "decode_workers": decode,
            "pool_tokens": cluster.pages_per_worker * cluster.effective_page_size,
            "turns_simulated": len(sim.records),
        }
    )
    return point


def fewest_gpus(
    dtype: str, max_gpus: int, ttft_p99_ms: float, *, probe: Population | None = None, **kw: Any
) -> tuple[int | None, dict[str, Any]]:
    """Binary search of the fewest GPUs (2..max_gpus) whose TTFT p99 is within ``ttft_p99_ms``
    (more GPUs never make it worse, the search assumes); (None, the max_gpus point) if none.

    ``probe``: a shorter population run for the search steps; the answer is then confirmed
    with the full one (``kw['pop']``), searching upward with it if the confirmation fails."""
    full = kw.pop("pop")

    def meets(gpus: int, pop: Population) -> tuple[bool, dict[str, Any]]:
        point = simulate_point(dtype, gpus, pop=pop, **kw)
        return point["ttft_p99_ms"] <= ttft_p99_ms, point

    def search(lo: int, hi: int, pop: Population, best: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        while lo < hi:  # hi meets the target
            mid = (lo + hi) // 2
            ok, point = meets(mid, pop)
            if ok:
                hi, best = mid, point
            else:
                lo = mid + 1
        return hi, best

    step = probe or full
    ok, top = meets(max_gpus, step)
    if not ok:
        return None, simulate_point(dtype, max_gpus, pop=full, **kw) if step is not full else top
    need, best = search(2, max_gpus, step, top)
    if step is full:
        return need, best
    ok, point = meets(need, full)
    if ok:
        return need, point
    if need == max_gpus:
        return None, point
    ok, top = meets(max_gpus, full)
    if not ok:
        return None, top
    return search(need + 1, max_gpus, full, top)


def engine_for(native: bool) -> ModuleType:
    """The compiled simulator core when wanted and built for this source, else the pure-Python one."""
    if native:
        from kvserving.sim.native import load as load_native

        module = load_native()
        if module is not None:
            return module
    return pure


def plan(dtype: str, args: dict[str, Any], *, quiet: bool = False) -> dict[str, Any]:
    """One format's answer for ``kvserving simulate`` (a process-pool job: plain arguments)."""
    from kvserving.progress import Steps
    from kvserving.sim.costs import CostModel

    costs = CostModel.from_dict(args["costs"])
    load = gpu_load(
        args["seed"],
        think_s=args["think_s"],
        output_tokens=args["output_tokens"],
        max_context=args["max_context"],
        shared_system_prompt=args["shared"],
    )
    engine = engine_for(args["native"])
    pop = engine.Population(args["agents"], args["duration_s"], warmup_s=args["warmup_s"], ramp_s=args["ramp_s"], shapes=args["shapes"])
    duration = args["duration_s"]

    # simulated seconds; a search for the fewest GPUs runs the population again, from 0
    steps = Steps(round(duration), desc=dtype, quiet=quiet, unit="s simulated")

    def progress(t: float) -> None:
        steps.at(round(min(t, duration)))

    kw: dict[str, Any] = dict(
        costs=costs,
        load=load,
        pop=pop,
        prefill_share=args["prefill_share"],
        reuse=ReuseConfig(bidirectional=args["reuse"]),
        progress=progress,
        shapes={},
        engine=engine,
        pull_waits=args.get("pull_waits", True),
    )
    if args["ttft_p99_ms"] is None:
        point = simulate_point(dtype, args["gpus"], **kw)
    else:
        probe = None
        if args["probe_s"] < duration:
            probe = engine.Population(
                args["agents"],
                args["probe_s"],
                warmup_s=min(args["warmup_s"], args["probe_s"] / 2),
                ramp_s=args["ramp_s"],
                shapes=args["shapes"],
            )
        need, point = fewest_gpus(dtype, args["gpus"], args["ttft_p99_ms"], probe=probe, **kw)
        point["gpus"] = need
        point["max_gpus"] = args["gpus"]
    steps.close()
    return point


_COLUMNS = (
    ("dtype", "dtype", "{}"),
    ("GPUs", "gpus", "{}"),
    ("P/D", "pd", "{}"),
    ("pool tok/GPU", "pool_tokens", "{:,}"),
    ("hit", "hit_rate", "{:.3f}"),
    ("local", "local_share", "{:.3f}"),
    ("pulled", "pulled_share", "{:.3f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("p99 ms", "ttft_p99_ms", "{:.0f}"),
    ("turn p99 s", "latency_p99_s", "{:.1f}"),
    ("req/s", "req_per_s", "{:.1f}"),
    ("out tok/s", "output_tok_per_s", "{:,.0f}"),
    ("evicted P/D", "evicted", "{}"),
    ("turns", "turns_simulated", "{:,}"),
)


def format_table(points: list[dict[str, Any]]) -> str:
    rows = [[title for title, _, _ in _COLUMNS]]
    for p in points:
        q = dict(
            p,
            pd=f"{p['prefill_workers']}/{p['decode_workers']}",
            latency_p99_s=p.get("latency_p99_ms", math.nan) / 1e3,
            evicted=f"{p['prefill_evicted_pages']:,}/{p['decode_evicted_pages']:,}",
        )
        if q.get("gpus") is None:
            q["gpus"] = f">{p['max_gpus']}"
        rows.append([fmt.format(q[key]) if not isinstance(q[key], str) else q[key] for _, key, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    from kvserving.argtypes import float_in, int_in

    parser.add_argument(
        "--agents", type=int_in(1, 10_000_000), default=10_000, help="concurrent agents (slots running agents back to back)"
    )
    parser.add_argument("--gpus", type=int_in(2, 100_000), default=64, help="GPUs (one worker each); with --ttft-p99-ms the most to try")
    parser.add_argument("--dtype", default="nvfp4,fp8", help="KV formats, comma-separated (bf16, fp8, nvfp4, triaxial)")
    parser.add_argument(
        "--ttft-p99-ms", type=float_in(0, 1e9, low_open=True), default=None, help="find the fewest GPUs whose TTFT p99 is within this"
    )
    parser.add_argument(
        "--costs", default="h200-8b", help="cost profile: h200-8b, cpu-tiny, gpu-h200, or a JSON file (kvserving.sim.costs)"
    )
    parser.add_argument(
        "--kv-gib", type=float_in(0, 1e6, low_open=True), default=None, help="KV memory per GPU, GiB (default: the profile's)"
    )
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default=None, help="the workers' kv_cache.layout (default: the profile's)")
    parser.add_argument("--prefill-share", type=float_in(0, 1, low_open=True), default=0.25, help="share of the GPUs that prefill")
    parser.add_argument("--duration-s", type=float_in(0, 1e7, low_open=True), default=3600.0, help="simulated seconds")
    parser.add_argument("--warmup-s", type=float_in(0, 1e7), default=300.0, help="metrics ignore turns sent before this")
    parser.add_argument("--ramp-s", type=float_in(0, 1e7), default=60.0, help="agents start spread over this")
    parser.add_argument("--think-s", type=float_in(0, 1e6, low_open=True), default=30.0, help="mean think time between turns")
    parser.add_argument("--output-tokens", type=int_in(1, 1_000_000), default=250, help="mean reply tokens")
    parser.add_argument("--max-context", type=int_in(64, 10_000_000), default=32768, help="tokens an agent's history may reach")
    parser.add_argument("--per-agent-system-prompt", action="store_true", help="every agent its own system prompt (default: shared)")
    parser.add_argument("--no-reuse", action="store_true", help="bidirectional reuse off (the prefill's own prefix cache only)")
    parser.add_argument("--shapes", type=int_in(1, 1_000_000), default=128, help="distinct agent shapes drawn (see Population)")
    parser.add_argument(
        "--probe-s",
        type=float_in(0, 1e7, low_open=True),
        default=900.0,
        help="with --ttft-p99-ms: simulated seconds of each search step; the answer is confirmed over --duration-s",
    )
    parser.add_argument("--jobs", type=int_in(1, 256), default=2, help="formats simulated at once, one process each")
    parser.add_argument("--seed", type=int, default=0, help="agent population seed")
    parser.add_argument("--json", default=None, help="write the points as JSON here")
    parser.add_argument(
        "--build-native",
        action="store_true",
        help="compile the simulator core with mypyc (kvserving.sim.native; once per source version), then run",
    )
    parser.add_argument("--pure-python", action="store_true", help="run the pure-Python core even when a compiled one is built")
    parser.add_argument(
        "--validate",
        default=None,
        metavar="BENCH_JSON",
        help="instead: re-run bench/agents.py's points (its JSON) and print simulated vs measured "
        "(costs: cpu-tiny, or gpu-h200 for a --gpu result, unless --costs names another profile)",
    )
    parser.add_argument(
        "--no-pull-wait",
        action="store_true",
        help="a KV pull that finds no free page skips at once (the worker before its pulls waited for pages: "
        "to replay points measured with it); the CPU sweep's replay always does",
    )
    parser.add_argument(
        "--pins-yield-always",
        action="store_true",
        help="pages pulled for a waiting request yield to any allocation, not only to a running sequence's growth "
        "(the worker before that rule: to replay points measured with it); the CPU sweep's replay always does",
    )
    parser.add_argument(
        "--no-idle-overtakes",
        action="store_true",
        help="with nothing running, the queue's head that fits only with pulled pages' pins takes them at once, instead of "
        "letting the waiting requests that fit without them run first (the worker before that rule)",
    )
    parser.add_argument(
        "--no-pull-pins-local",
        action="store_true",
        help="a KV pull that reads nothing leaves the local prefix it matched to the LRU instead of pinning it for the "
        "request's admission (the worker before that rule)",
    )
    parser.add_argument(
        "--no-pin-trim",
        action="store_true",
        help="pages pulled for a waiting request yield to a running sequence's growth whole, not only the pages it lacks "
        "from their tail (the worker before that rule)",
    )
    parser.add_argument(
        "--no-adopt-add",
        action="store_true",
        help="a prefill's pull that adopts pages adds its request in an engine call of its own after the adopt's, "
        "a step later on a busy prefill, instead of in the adopt's call (the worker before that rule)",
    )


def run(args: Any) -> int:
    from kvserving import jsonfmt
    from kvserving.argtypes import check_output_file, read_json_file
    from kvserving.sim.costs import canonical_dtype, load_costs

    if args.json:
        check_output_file(Path(args.json), "--json")  # before the simulation, not after
    if args.build_native:
        from kvserving.sim.native import build

        build()
    if args.validate is not None:
        example = "a bench/agents.py result, e.g. bench/results/agents_cpu.json"
        measured = read_json_file(args.validate, "--validate", missing=example)
        if not isinstance(measured, dict):
            raise ValueError(f"--validate {args.validate} holds a JSON {type(measured).__name__}, not {example}")
        from kvserving.sim.gpu import is_gpu_result

        if is_gpu_result(measured):  # bench/agents.py --gpu: one GPU shared by both workers (kvserving.sim.gpu)
            from kvserving.sim.gpu import format_rows, reproduce

            rows = reproduce(
                measured,
                load_costs(args.costs if args.costs != "h200-8b" else "gpu-h200"),
                rules=PullRules(
                    pull_waits=not args.no_pull_wait,
                    pins_yield_always=args.pins_yield_always,
                    idle_overtakes=not args.no_idle_overtakes,
                    pull_pins_local=not args.no_pull_pins_local,
                    pins_trim=not args.no_pin_trim,
                    adopt_adds=not args.no_adopt_add,
                ),
            )
            print(format_rows(rows))
            if args.json:
                Path(args.json).write_text(jsonfmt.dumps({"validate": args.validate, "rows": rows}))
            return 0
        costs_name = args.costs if args.costs != "h200-8b" else "cpu-tiny"
        print(format_validation(validate_points(measured, load_costs(costs_name))))
        return 0
    dtypes = [canonical_dtype(d.strip()) for d in str(args.dtype).split(",") if d.strip()]
    if not dtypes:
        raise ValueError("--dtype names no format")
    if args.warmup_s >= args.duration_s:
        raise ValueError(f"--warmup-s ({args.warmup_s}) must be < --duration-s ({args.duration_s})")
    costs = load_costs(args.costs)
    if args.kv_gib is not None:
        costs = replace(costs, kv_bytes_per_worker=int(args.kv_gib * 2**30))
    if args.kv_layout is not None:
        costs = replace(costs, page_major=args.kv_layout == "page_major")
    for dtype in dtypes:
        if not costs.supports(dtype):
            raise ValueError(f"cost profile {costs.name!r} has no decode cost for {dtype}")
    Population(args.agents, args.duration_s, warmup_s=args.warmup_s, ramp_s=args.ramp_s, shapes=args.shapes)
    job = {
        "costs": costs.to_dict(),
        "seed": args.seed,
        "think_s": args.think_s,
        "output_tokens": args.output_tokens,
        "max_context": args.max_context,
        "shared": not args.per_agent_system_prompt,
        "agents": args.agents,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "ramp_s": args.ramp_s,
        "shapes": args.shapes,
        "prefill_share": args.prefill_share,
        "reuse": not args.no_reuse,
        "gpus": args.gpus,
        "ttft_p99_ms": args.ttft_p99_ms,
        "probe_s": args.probe_s,
        "native": not args.pure_python,
        "pull_waits": not args.no_pull_wait,
    }
    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, len(dtypes)))
    if jobs == 1:
        points = [plan(d, job) for d in dtypes]
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs) as pool:  # one format per core
            futures = [pool.submit(plan, d, job, quiet=i > 0) for i, d in enumerate(dtypes)]  # the first format shows progress
            points = [f.result() for f in futures]
    target = f", TTFT p99 <= {args.ttft_p99_ms:g} ms" if args.ttft_p99_ms is not None else ""
    print(f"{args.agents:,} agents, {args.duration_s:g} s simulated (metrics after {args.warmup_s:g} s), costs {costs.name}{target}")
    print(format_table(points))
    core = "compiled core" if engine_for(job["native"]) is not pure else "pure Python; --build-native compiles the core"
    print(f"simulated in {time.perf_counter() - t0:.1f} s ({core})")
    if args.json:
        Path(args.json).write_text(
            jsonfmt.dumps(
                {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "costs": costs.to_dict(), "points": points},
                default=str,
            )
        )
    return 0


# ---------------------------------------------------------------------------------- validation
VALIDATED = (
    "hit_rate",
    "hit_rate_later_turns",
    "local_share",
    "pulled_share",
    "req_per_s",
    "output_tok_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "prefill_evicted_pages",
    "decode_evicted_pages",
    "prefill_computed_tokens",
    "decode_computed_tokens",
)
# each role's pull counters, under bench/agents.py's names (rows' "counters")
ROLE_COUNTERS = (
    "computed_tokens",
    "lost_tokens",
    "pulls",
    "pulled_tokens",
    "skips",
    "missed_tokens",
    "fallbacks",
    "page_waits",
    "reclaimed_leases",
    "no_room",
    "no_room_held_pages",
)


def role_counters(point: dict[str, Any], *, simulated: bool) -> dict[str, Any]:
    """A point's per-role counters under bench/agents.py's names, and each role's prompt seconds
    per computed prompt token (its mixed steps' time: the time axis the hit rate past a cliff
    depends on, the pages a waiting prompt loses while earlier ones run). Counts of zero left out."""
    out: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        alias = {"skips": "pull_skipped", "fallbacks": "pull_fallbacks"} if simulated else {}
        for k in ROLE_COUNTERS:
            v = point.get(f"{role}_{alias.get(k, k)}")
            out[f"{role}_{k}"] = {r: n for r, n in v.items() if n} if isinstance(v, dict) else v
        steps_s = (
            point.get(f"{role}_mixed_step_s")
            if simulated
            else (point.get(f"{role}_mixed_steps") or 0) * (point.get(f"{role}_mixed_step_ms") or 0.0) / 1e3
        )
        computed = point.get(f"{role}_computed_tokens") or 0
        out[f"{role}_ms_per_prompt_token"] = 1e3 * steps_s / computed if steps_s is not None and computed else None
    return out


# bench/results/agents_cpu.json was measured on the worker before a KV pull reclaimed retained
# conversations (commit eb82190): its pulls were refused on a pool full of them, at once (a pull
# waits for pages only since later still), and pulled pages' admission pins did not yet hold
# against admissions while sequences ran (a310ad2), and a pull's adopt and its request's add were two engine calls
CPU_SWEEP_RULES = PullRules(pull_reclaims=False, pull_waits=False, pins_yield_always=True, adopt_adds=False)


def validate_points(
    measured: dict[str, Any],
    costs: CostModel,
    *,
    rules: PullRules = CPU_SWEEP_RULES,
) -> list[dict[str, Any]]:
    """Re-run bench/agents.py's points (same agents, KV budget, scheduler, reuse mode, one
    stack per format and mode, points in the order they ran) in the simulator; one row per
    point with the simulated and the measured metrics. ``rules``: the workers' pull and pin rules,
    by default those of the worker that measured bench/results/agents_cpu.json."""
    try:
        load = load_spec_from_dict(measured["load"])
        points = list(measured["points"])
        kv_bytes = kv_bytes_per_worker(measured)
        ttl_s = float(measured.get("ttl_s", 3.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a bench/agents.py result: {exc}") from exc
    sched = SchedulerConfig(**measured.get("scheduler", {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "chunk_size": 512}))
    costs = replace(costs, kv_bytes_per_worker=kv_bytes, page_major=page_major(measured))
    scheme = measured.get("agent_index", "1000n")
    if scheme not in ("1000n", "sequential"):
        raise ValueError(f"agent_index must be '1000n' or 'sequential', got {scheme!r}")
    sims: dict[tuple[str, str], Simulator] = {}
    rows: list[dict[str, Any]] = []
    first = 0
    for p in points:
        fmt, mode, n = p["format"], p["mode"], int(p["concurrency"])
        key = (fmt, mode)
        if key not in sims:
            cluster = ClusterSpec(
                bench_dtype(fmt),
                1,
                1,
                costs,
                reuse=reuse_for_mode(mode, ttl_s=ttl_s),
                scheduler=sched,
                rules=rules,
            )
            sims[key] = Simulator(cluster, load)
        # which agents the point ran: bench/agents.py's point_agents (1000 N .. 1000 N + N - 1),
        # or (its first cut) indices in run order
        agents = range(1000 * n, 1000 * n + n) if scheme == "1000n" else range(first, first + n)
        first += n
        seen = {int(r["agent"]) for r in p.get("records") or []}
        if seen and not seen <= set(agents):
            raise ValueError(
                f"point {fmt}/{mode} N={n} ran agents {min(seen)}..{max(seen)}, not {agents} "
                f"(set agent_index in the JSON: '1000n' or 'sequential')"
            )
        sim_point = run_bench_point(sims[key], agents)
        rows.append(
            {
                "format": fmt,
                "mode": mode,
                "concurrency": n,
                "sim": {k: sim_point.get(k) for k in VALIDATED},
                "measured": {k: p.get(k) for k in VALIDATED},
                "counters": {"sim": role_counters(sim_point, simulated=True), "measured": role_counters(p, simulated=False)},
            }
        )
    return rows


def format_validation(rows: list[dict[str, Any]]) -> str:
    cols = (
        ("hit", "hit_rate", "{:.2f}"),
        ("hit2+", "hit_rate_later_turns", "{:.2f}"),
        ("pulled", "pulled_share", "{:.2f}"),
        ("req/s", "req_per_s", "{:.2f}"),
        ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
        ("p99", "ttft_p99_ms", "{:.0f}"),
        ("evict P", "prefill_evicted_pages", "{}"),
        ("evict D", "decode_evicted_pages", "{}"),
    )
    head = ["format", "mode", "N"] + [f"{t} sim/meas" for t, _, _ in cols]
    table = [head]
    for r in rows:
        cells = [r["format"], r["mode"], str(r["concurrency"])]
        for _, key, fmt in cols:
            s, m = r["sim"].get(key), r["measured"].get(key)
            cells.append(f"{fmt.format(s) if s is not None else '-'} / {fmt.format(m) if m is not None else '-'}")
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
