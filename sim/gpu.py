"""``kvserving simulate --validate bench/results/agents_gpu_h200.json``: the measured GPU agent
points (``bench/agents.py --gpu``) re-run in the simulator with the GPU cost profile, each
prediction beside its measurement.

The simulated stack is the measured one: one prefill and one decode worker sharing one GPU
(``shared_gpu.SharedGpu``), the bench's KV bytes per worker, its GPU scheduler, reuse mode,
load spec and agents (point N runs agents 1000 N .. 1000 N + N - 1), one simulator per stack
the bench started (points in the order they ran). No per-point setting: the cost profile is
fitted once from the engine, extend, NIXL and P/D measurements (bench/sim_costs_gpu.py).

Targets: hit rate within ``HIT_TOL`` (absolute), output tokens/s within ``TPUT_TOL`` (relative).
The summary counts them over every point and again without the points marked ``*``: a long TTFT
p99 without a preemption (``long_ttft_p99``). The mark once stood for a first-use kernel compile;
the stacks now capture every decode graph at start, and such a tail comes from requests queued
behind the decode worker's prompt computation, which the simulator does not reproduce either.

``PullRules(pull_waits=False)`` replays the worker before its pulls waited for pages (points measured
before it): a pull that finds no free page skips at once and the request recomputes.
``PullRules(pins_yield_always=True)`` replays the worker before pulled pages' admission pins held against
admissions while sequences run (every point of bench/results/agents_gpu_h200.json and of
docs/performance-log/data/agents_gpu/ ran it, and skipped pulls at once): the queue's head that
fails to fit, or a pull, takes the pulled pages of the requests waiting behind it.
``PullRules(pins_trim=False)`` (``--no-pin-trim``) replays the worker whose admission pins yielded whole
(every point of bench/results/agents_gpu_h200.json and agents_gpu_h100.json ran it); the current
worker's give up only the pages an allocation lacks, from their tails.
``PullRules(adopt_adds=False)`` (``--no-adopt-add``) replays the worker whose prefill added a pulled request
in an engine call of its own after the adopt's (every point of bench/results/ and docs/performance-log/data/
ran it); the current worker adds it in the adopt's call.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kvserving.agents.load import LoadSpec, reuse_for_mode
from kvserving.config import SchedulerConfig
from kvserving.sim.costs import CostModel
from kvserving.sim.bench_results import bench_dtype, kv_bytes_per_worker, load_spec_from_dict, page_major
from kvserving.sim.shared_gpu import SharedGpu
from kvserving.sim.cluster import ClusterSpec, Simulator, percentile, run_bench_point
from kvserving.sim.workers import PullRules

# bench/agents.py stack_spec with a GPU model
GPU_SCHEDULER = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, chunk_size=4096)
HIT_TOL = 0.05
TPUT_TOL = 0.15
# A measured TTFT p99 at or past this with no preemption marks a point (``long_ttft_p99``)
LONG_TTFT_P99_MS = 4000.0
# Simulator.pull_counters
PULL_COUNTERS = (
    "computed_tokens",
    "pulls",
    "lost_tokens",  # pulled tokens in place that the request's admission no longer found
    "pages_trimmed",  # pages admission pins gave up from their tails (the way pulled pages leave before admission)
    "pull_fallbacks",
    "pull_skipped",
    "pull_skipped_tokens",
    "page_waits",
    "page_wait_s",
    "no_room",
    "no_room_held_pages",
    "transfer_leases",
    "transfer_lease_s",
)
COMPARED = (
    "hit_rate",
    "local_share",  # the hit rate's two parts: prompt tokens the prefill found in its own cache, and those it pulled
    "pulled_share",
    "output_tok_per_s",
    "req_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "requests",
    "prefill_evicted_pages",
    "decode_evicted_pages",
    "decode_computed_tokens",
)


def is_gpu_result(measured: dict[str, Any]) -> bool:
    """A ``bench/agents.py --gpu`` result (KV per worker in GiB: ``--kv-gib``) rather than a CPU one
    (``--kv-kib``: "3072 KiB", or ``kv_kib_per_worker`` in results written before)."""
    return str(measured.get("kv_per_worker", "")).endswith("GiB")


def long_ttft_p99(point: dict[str, Any]) -> bool:
    """Whether a measured point has a long TTFT p99 (``LONG_TTFT_P99_MS``) that no preemption explains."""
    preempted = point.get("prefill_preemptions", 0) + point.get("decode_preemptions", 0)
    return not preempted and float(point.get("ttft_p99_ms", 0.0)) >= LONG_TTFT_P99_MS


def marked(row: dict[str, Any]) -> bool:
    """A row's ``long_ttft_p99`` mark (rows written before the rename carry it as ``first_use_compile``)."""
    return bool(row.get("long_ttft_p99", row.get("first_use_compile", False)))


def bench_load(measured: dict[str, Any]) -> LoadSpec:
    """The ``LoadSpec`` of a bench/agents.py result."""
    return load_spec_from_dict(measured["load"])


def reproduce(
    measured: dict[str, Any],
    costs: CostModel,
    *,
    only: set[tuple[str, int]] | None = None,
    rules: PullRules = PullRules(),
) -> list[dict[str, Any]]:
    """One row per measured point (``only``: the (format, N) pairs to run): the simulated and
    the measured metrics, whether each meets its target, and the simulator's counters.
    ``rules``: the workers' pull and pin rules (the worker before a rule, to replay its points)."""
    try:
        load = bench_load(measured)
        points = list(measured["points"])
        ttl_s = float(measured.get("ttl_s", 3.0))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a bench/agents.py --gpu result: {exc}") from exc
    costs = replace(costs, kv_bytes_per_worker=kv_bytes_per_worker(measured), page_major=page_major(measured))
    stacks: dict[tuple[str, str, str], tuple[Simulator, SharedGpu]] = {}
    rows = []
    for p in points:
        fmt, mode, n = p["format"], p["mode"], int(p["concurrency"])
        if only is not None and (fmt, n) not in only:
            continue
        key = (fmt, mode, str(p.get("part", "")))
        if key not in stacks:
            cluster = ClusterSpec(
                bench_dtype(fmt),
                1,
                1,
                costs,
                reuse=reuse_for_mode(mode, ttl_s=ttl_s),
                scheduler=GPU_SCHEDULER,
                rules=rules,
            )
            sim = Simulator(cluster, load)
            stacks[key] = (sim, SharedGpu(sim, sim.prefill[0], sim.decode[0]))
        sim, gpu = stacks[key]
        first = len(sim.records)
        start = sim.now
        before = gpu.counters(sim.now)
        counts_before, seconds_before = dict(gpu.step_counts), dict(gpu.step_seconds)
        point = run_bench_point(sim, range(1000 * n, 1000 * n + n), window_s=p.get("window_s"))
        recs = sim.records[first:]
        point["tpot_p50_ms"] = (
            percentile([(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in recs if r.output_tokens > 1], 0.5) * 1e3
        )
        after = gpu.counters(sim.now)
        steps = step_times({k: (count - counts_before[k], gpu.step_seconds[k] - seconds_before[k]) for k, count in gpu.step_counts.items()})
        wall = max(point["wall_s"], 1e-9)
        busy = {k: (after[k] - before[k]) / wall for k in after}
        # prompt tokens a second of the prefill worker's steps computed, sharing included: the stack's steps are wall
        # time beside the decode worker's too (its mixed steps: a prefill worker runs no other kind)
        prefill_busy_s = (busy["prefill_only"] + busy["both"]) * wall
        measured_steps_s = p.get("prefill_mixed_steps", 0) * p.get("prefill_mixed_step_ms", 0.0) / 1e3
        sim_hit, meas_hit = point["hit_rate"], p["hit_rate"]
        sim_tp, meas_tp = point["output_tok_per_s"], p["output_tok_per_s"]
        rows.append(
            {
                "format": fmt,
                "mode": mode,
                "concurrency": n,
                "part": p.get("part"),
                "sim": {k: point.get(k) for k in COMPARED},
                "measured": {k: p.get(k) for k in COMPARED},
                "long_ttft_p99": long_ttft_p99(p),
                "hit_ok": abs(sim_hit - meas_hit) <= HIT_TOL,
                "tput_ok": abs(sim_tp - meas_tp) <= TPUT_TOL * meas_tp,
                "tput_err": (sim_tp - meas_tp) / meas_tp if meas_tp else math.nan,
                "sim_counters": {
                    "gpu_busy_share": busy,
                    "prefill_tok_s": point["prefill_computed_tokens"] / prefill_busy_s if prefill_busy_s > 0 else None,
                    "fallbacks": point["fallbacks"],
                    "decode_reclaimed_leases": point["decode_reclaimed_leases"],
                    "preemptions": point["prefill_preemptions"] + point["decode_preemptions"],
                    "prefill_preemptions": point["prefill_preemptions"],
                    "decode_preemptions": point["decode_preemptions"],
                    "wall_s": point["wall_s"],
                    "requests": point["requests"],
                    "start_s": start,
                    **steps,
                    **{f"{role}_{k}": point[f"{role}_{k}"] for role in ("prefill", "decode") for k in PULL_COUNTERS},
                    # a READ's own time on the shared GPU, post and copy (the stack's ``read_ms_per_pull``), and its wait
                    # for the READs into the same worker before it (``Worker.read``)
                    **{
                        f"{role}_{name}_ms_per_pull": round(1e3 * point[f"{role}_{name}_s"] / pulls, 2) if pulls else 0.0
                        for role in ("prefill", "decode")
                        for pulls in (point[f"{role}_pulls"],)
                        for name in ("read", "read_wait")
                    },
                    # NIXL regions the replay prices a pull at (costs.pull_s)
                    **{
                        f"{role}_regions_per_pull": costs.regions_per_pull() if point[f"{role}_pulls"] else 0
                        for role in ("prefill", "decode")
                    },  # fmt: skip
                },
                "measured_counters": {
                    "preemptions": p.get("prefill_preemptions", 0) + p.get("decode_preemptions", 0),
                    "fallbacks": p.get("fallbacks", {}),
                    "decode_fallbacks": p.get("decode_fallbacks"),  # the decode worker's own pulls (newer benches)
                    # pulls that found no room and the pool's pages by holder then (newer benches)
                    **{
                        f"{role}_{k}": p.get(f"{role}_{k}")
                        for role in ("prefill", "decode")
                        for k in (
                            "no_room",
                            "no_room_held_pages",
                            "transfer_leases",
                            "transfer_lease_s",
                            "lost_tokens",
                            "pulls",
                            "regions_per_pull",
                            "read_gbs",
                            "read_ms_per_pull",
                            "post_ms_per_pull",
                        )  # fmt: skip
                    },
                    # the stack's name for the pages its admission pins gave up (``pages_trimmed`` in the replay)
                    **{f"{role}_pages_trimmed": p.get(f"{role}_admission_pages_trimmed") for role in ("prefill", "decode")},
                    "wall_s": p.get("wall_s"),
                    "requests": p.get("requests"),
                    **{k: p.get(k) for k in steps},
                    "prefill_tok_s": p["prefill_computed_tokens"] / measured_steps_s
                    if measured_steps_s > 0 and "prefill_computed_tokens" in p
                    else None,
                },
            }
        )
    return rows


def step_times(steps: dict[tuple[str, str], tuple[int, float]]) -> dict[str, float]:
    """(role, kind) -> (steps, wall seconds) (``SharedGpu.step_counts``, ``step_seconds``) under bench/agents.py's names:
    ``{role}_{kind}_steps`` and ``{role}_{kind}_step_ms`` (the mean step, sharing included)."""
    out: dict[str, float] = {}
    for (role, kind), (n, wall) in steps.items():
        out[f"{role}_{kind}_steps"] = n
        out[f"{role}_{kind}_step_ms"] = round(1e3 * wall / n, 3) if n else 0.0
    return out


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = [
        "format",
        "mode",
        "N",
        "req sim/meas",
        "hit sim/meas",
        "ok",
        "local sim/meas",
        "pulled sim/meas",
        "out tok/s sim/meas",
        "err",
        "ok",
        "TTFT p50 sim/meas",
        "p99 sim/meas",
        "TPOT p50 sim/meas",
        "evict P+D sim/meas",
        "D computed sim/meas",
        "D lost sim/meas",
        "P lost sim/meas",
        "P trimmed pages sim/meas",
        "D regions/pull sim/meas",
        "P tok/s sim/meas",
        "P step ms sim/meas",
        "D decode step ms sim/meas",
        "D mixed steps x ms sim/meas",
        "GPU P/D/both",
        "preempt sim/meas",
    ]
    table = [head]
    for r in rows:
        s, m, c = r["sim"], r["measured"], r["sim_counters"]["gpu_busy_share"]
        table.append(
            [
                r["format"],
                r["mode"],
                str(r["concurrency"]) + ("*" if marked(r) else ""),
                f"{s['requests']} / {m['requests']}",
                f"{s['hit_rate']:.2f} / {m['hit_rate']:.2f}",
                "yes" if r["hit_ok"] else "NO",
                f"{_share(s.get('local_share'))} / {_share(m.get('local_share'))}",
                f"{_share(s.get('pulled_share'))} / {_share(m.get('pulled_share'))}",
                f"{s['output_tok_per_s']:.0f} / {m['output_tok_per_s']:.0f}",
                f"{r['tput_err']:+.0%}",
                "yes" if r["tput_ok"] else "NO",
                f"{s['ttft_p50_ms']:.0f} / {m['ttft_p50_ms']:.0f}",
                f"{s['ttft_p99_ms']:.0f} / {m['ttft_p99_ms']:.0f}",
                f"{s['tpot_p50_ms']:.1f} / {m['tpot_p50_ms']:.1f}",
                f"{s['prefill_evicted_pages'] + s['decode_evicted_pages']} / {m['prefill_evicted_pages'] + m['decode_evicted_pages']}",
                f"{_count(s.get('decode_computed_tokens'))} / {_count(m.get('decode_computed_tokens'))}",
                f"{_count(r['sim_counters'].get('decode_lost_tokens'))} / {_count(r['measured_counters'].get('decode_lost_tokens'))}",
                f"{_count(r['sim_counters'].get('prefill_lost_tokens'))} / {_count(r['measured_counters'].get('prefill_lost_tokens'))}",
                f"{_count(r['sim_counters'].get('prefill_pages_trimmed'))} / {_count(r['measured_counters'].get('prefill_pages_trimmed'))}",
                f"{_count(r['sim_counters'].get('decode_regions_per_pull'))} / {_count(r['measured_counters'].get('decode_regions_per_pull'))}",
                f"{_count(r['sim_counters'].get('prefill_tok_s'))} / {_count(r['measured_counters'].get('prefill_tok_s'))}",
                _pair(r, "prefill_mixed_step_ms"),
                _pair(r, "decode_decode_step_ms"),
                f"{_steps(r['sim_counters'], 'decode_mixed')} / {_steps(r['measured_counters'], 'decode_mixed')}",
                f"{c['prefill_only']:.2f}/{c['decode_only']:.2f}/{c['both']:.2f}",
                f"{r['sim_counters']['preemptions']} / {r['measured_counters']['preemptions']}",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(summary(rows))
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """The two targets met, over every point and over the points without a long TTFT p99 (*)."""
    clean = [r for r in rows if not marked(r)]

    def count(subset: list[dict[str, Any]]) -> str:
        hit = sum(r["hit_ok"] for r in subset)
        tput = sum(r["tput_ok"] for r in subset)
        return f"hit rate within {HIT_TOL}: {hit}/{len(subset)}; output tok/s within {TPUT_TOL:.0%}: {tput}/{len(subset)}"

    rule = f"a long TTFT p99: measured >= {LONG_TTFT_P99_MS / 1e3:.0f} s with no preemption"
    return f"all points: {count(rows)}\nwithout the * points ({rule}): {count(clean)}"


def _count(n: Any) -> str:
    return "-" if n is None else str(round(n))


def _pair(row: dict[str, Any], key: str) -> str:
    """``sim / measured`` of a counter both sides may lack (rows and benches written before it)."""
    s, m = row["sim_counters"].get(key), row["measured_counters"].get(key)
    return f"{'-' if s is None else f'{s:.1f}'} / {'-' if m is None else f'{m:.1f}'}"


def _steps(counters: dict[str, Any], key: str) -> str:
    """``N x ms`` of one role's steps of one kind (``{key}_steps``, ``{key}_step_ms``): the decode's steps with
    prompt tokens run synchronously and hold up every running reply's next token."""
    n, ms = counters.get(f"{key}_steps"), counters.get(f"{key}_step_ms")
    return "-" if n is None or ms is None else f"{round(n)} x {ms:.0f}"


def _share(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"
