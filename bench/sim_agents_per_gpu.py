"""Agents per GPU at a TTFT p99 target on a 64-GPU cluster, per KV format, from the simulator
with the H200 cost profile (``gpu-h200``, bench/sim_costs_gpu.py) and the agent load the GPU
bench measured (bench/results/agents_gpu_h200.json ``load``; its replay: ``kvserving simulate
--validate bench/results/agents_gpu_h200.json``). Writes its section of bench/results/sim_agents_per_gpu_h200.json,
one per KV pool size (``kv_90gib``, ``kv_8gib``; bench/results_file.py), keeping the others.

    PYTHONSAFEPATH=1 .venv/bin/python bench/sim_agents_per_gpu.py [--ttft-p99-ms 2000] [--gpus 64]
        [--kv-gib 90] [--prefill-shares 0.125,0.25,0.375] [--formats fp8,nvfp4,triaxial]
    PYTHONSAFEPATH=1 .venv/bin/python bench/sim_agents_per_gpu.py --combine A.json B.json [--json OUT]

Per format and P/D split (one GPU per worker, ``sim_plan.split_gpus``): a population of A agents
(each slot runs agents back to back; each agent runs its 8-12 turns) for ``--duration-s``, the
metrics over turns sent after ``--warmup-s`` (turns still waiting at the end count in the TTFT);
the largest A whose TTFT p99 meets the target and whose whole turns (48-token replies) stay
within ``--turn-p99-ms`` at p99 (agents wait for their replies, so a saturated decode pool slows
them instead of queueing prompts: the TTFT alone would not see it), by doubling then bisection
to ``--tolerance``.
More agents never lower the TTFT p99, the search assumes. The answer per format is its best split;
a best split at the edge of ``--prefill-shares`` extends the search past that edge by
``--share-step`` until the best split is inside what was searched.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_file import combine, write_section  # noqa: E402

WHAT = "bench/sim_agents_per_gpu.py: agents per H200 at a TTFT p99 target, simulated; one section per KV pool size"
FORMATS = {"bf16": "bf16", "fp8": "fp8_e4m3", "nvfp4": "nvfp4", "triaxial": "triaxial"}


def _load() -> Any:
    from kvserving.sim.gpu import bench_load

    return bench_load(json.loads((HERE / "results" / "agents_gpu_h200.json").read_text()))


def search(fmt: str, share: float, args: dict[str, Any]) -> dict[str, Any]:
    """The most agents whose TTFT p99 meets the target at one format and split."""
    from dataclasses import replace

    from kvserving.sim.costs import load_costs
    from kvserving.sim.plan import engine_for, simulate_point

    engine = engine_for(args["native"])  # the compiled core where built for this source (same results), else pure Python
    costs = replace(load_costs("gpu-h200"), kv_bytes_per_worker=int(args["kv_gib"] * 2**30))
    load = _load()
    shapes: dict[int, Any] = {}
    runs: list[dict[str, Any]] = []

    def point(agents: int) -> dict[str, Any]:
        pop = engine.Population(agents, args["duration_s"], warmup_s=args["warmup_s"], ramp_s=args["ramp_s"], shapes=256)
        p = simulate_point(FORMATS[fmt], args["gpus"], costs=costs, load=load, pop=pop, prefill_share=share, shapes=shapes, engine=engine)
        row = {
            "agents": agents,
            **{
                k: p[k]
                for k in (
                    "hit_rate",
                    "ttft_p50_ms",
                    "ttft_p99_ms",
                    "latency_p99_ms",
                    "output_tok_per_s",
                    "req_per_s",
                    "prefill_evicted_pages",
                    "decode_evicted_pages",
                    "unfinished",
                    "turns_simulated",
                    "prefill_workers",
                    "decode_workers",
                    "pool_tokens",
                )
            },
        }
        runs.append(row)
        return row

    def meets(row: dict[str, Any]) -> bool:
        return bool(row["ttft_p99_ms"] <= args["ttft_p99_ms"] and row["latency_p99_ms"] <= args["turn_p99_ms"])

    lo, hi = 0, args["start_agents"]
    best: dict[str, Any] | None = None
    while True:  # doubling until the target fails
        row = point(hi)
        if not meets(row):
            break
        lo, best, hi = hi, row, hi * 2
    while hi - lo > max(1, int(lo * args["tolerance"])):
        mid = (lo + hi) // 2
        row = point(mid)
        if meets(row):
            lo, best = mid, row
        else:
            hi = mid
    return {
        "format": fmt,
        "prefill_share": share,
        "agents": lo,
        "agents_per_gpu": lo / args["gpus"],
        "at_answer": best,
        "first_failing_agents": hi,
        "runs": runs,
    }


def edge_shares(results: list[dict[str, Any]], formats: list[str], *, step: float, gpus: int) -> list[tuple[str, float]]:
    """(format, share) searches still to run: a format whose best split is at the edge of the
    shares searched so far gets the next share past that edge (by ``step``), while that share
    still leaves a worker of each role and splits the GPUs differently; an answer at an edge
    would otherwise be the search's limit, not the cluster's."""
    from kvserving.sim.plan import split_gpus

    more = []
    for fmt in formats:
        rows = [r for r in results if r["format"] == fmt]
        best = max(rows, key=lambda r: r["agents"])
        if best["agents"] == 0:
            continue
        tried = sorted(r["prefill_share"] for r in rows)
        splits = {split_gpus(gpus, s) for s in tried}
        for edge, nxt in ((tried[-1], tried[-1] + step), (tried[0], tried[0] - step)):
            if best["prefill_share"] == edge and 0 < nxt < 1 and split_gpus(gpus, nxt) not in splits:
                more.append((fmt, round(nxt, 6)))
    return more


def section_name(run: dict[str, Any]) -> str:
    """A run's section: its KV pool per GPU (``kv_90gib``)."""
    return f"kv_{run['args']['kv_gib']:g}gib"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft-p99-ms", type=float, default=2000.0)
    ap.add_argument(
        "--turn-p99-ms", type=float, default=7000.0, help="and whole turns (48-token replies) within this at p99: TTFT + ~100 ms per token"
    )
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=90.0, help="KV pool per GPU (default: the engine benchmark's 90 GiB)")
    ap.add_argument("--prefill-shares", default="0.25,0.375,0.5")
    ap.add_argument("--share-step", type=float, default=0.125, help="a best split at the edge of the shares searched extends them by this")
    ap.add_argument("--formats", default="fp8,nvfp4,triaxial")
    ap.add_argument("--duration-s", type=float, default=240.0)
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--ramp-s", type=float, default=30.0)
    ap.add_argument("--start-agents", type=int, default=512)
    ap.add_argument("--tolerance", type=float, default=0.03, help="bisection stops within this share of the answer")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--pure-python",
        action="store_true",
        help="run the pure-Python simulator even where its compiled core is built (`kvserving simulate --build-native`)",
    )
    ap.add_argument("--json", type=Path, default=HERE / "results" / "sim_agents_per_gpu_h200.json", help="this run writes its section")
    ap.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="join the sections of these result files into --json, and exit",
    )
    args = ap.parse_args()
    if args.combine:
        doc = combine(args.combine, args.json, what=WHAT, name_of=section_name)
        print(f"wrote {args.json}: sections {', '.join(doc['sections'])}")
        return
    job = {
        k: getattr(args, k)
        for k in ("ttft_p99_ms", "turn_p99_ms", "gpus", "kv_gib", "duration_s", "warmup_s", "ramp_s", "start_agents", "tolerance")
    }
    job["native"] = not args.pure_python
    formats = [f for f in args.formats.split(",") if f]
    shares = [float(s) for s in args.prefill_shares.split(",") if s]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = [fut.result() for fut in [pool.submit(search, f, s, job) for f in formats for s in shares]]
        while more := edge_shares(results, formats, step=args.share_step, gpus=args.gpus):
            results += [fut.result() for fut in [pool.submit(search, f, s, job) for f, s in more]]
    results.sort(key=lambda r: (formats.index(r["format"]), r["prefill_share"]))
    best = {f: max((r for r in results if r["format"] == f), key=lambda r: r["agents"]) for f in formats}
    print(
        f"{args.gpus} H200s, KV {args.kv_gib:g} GiB per GPU, TTFT p99 <= {args.ttft_p99_ms:g} ms, turn p99 <= {args.turn_p99_ms:g} ms, "
        f"load of bench/results/agents_gpu_h200.json, costs gpu-h200"
    )
    head = f"{'format':>9} {'P/D':>6} {'agents':>7} {'per GPU':>8} {'hit':>5} {'TTFT p50':>8} {'p99 ms':>7} {'turn p99':>8} {'out tok/s':>9} {'evicted P/D':>15}"
    print(head)
    for r in results:
        a = r["at_answer"] or {}
        mark = " *" if r is best[r["format"]] else ""
        pd = f"{a.get('prefill_workers', '-')}/{a.get('decode_workers', '-')}"
        print(
            f"{r['format']:>9} {pd:>6} {r['agents']:>7} {r['agents_per_gpu']:>8.1f} {a.get('hit_rate', math.nan):>5.2f} "
            f"{a.get('ttft_p50_ms', math.nan):>8.0f} {a.get('ttft_p99_ms', math.nan):>7.0f} {a.get('latency_p99_ms', math.nan):>8.0f} {a.get('output_tok_per_s', math.nan):>9.0f} "
            f"{a.get('prefill_evicted_pages', 0):>7}/{a.get('decode_evicted_pages', 0):<7}{mark}"
        )
    print(f"* the format's answer; simulated in {time.perf_counter() - t0:.0f} s")
    run = {
        "question": f"agents per GPU at TTFT p99 <= {args.ttft_p99_ms:g} ms (turn p99 <= {args.turn_p99_ms:g} ms) on {args.gpus} GPUs",
        "args": job,
        "answer": {
            f: {"agents_per_gpu": r["agents_per_gpu"], "agents": r["agents"], "prefill_share": r["prefill_share"]} for f, r in best.items()
        },
        "results": results,
    }
    write_section(args.json, section_name(run), run, what=WHAT, name_of=section_name)
    print(f"wrote section {section_name(run)} of {args.json}")


if __name__ == "__main__":
    main()
