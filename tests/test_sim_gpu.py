"""The GPU cost profile and the replay of the measured GPU agent points (kvserving.sim.gpu),
with the two workers sharing one GPU (kvserving.sim.shared_gpu)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from kvserving.agents.load import LoadSpec, reuse_for_mode
from kvserving.sim.costs import load_costs
from kvserving.sim.bench_results import kv_bytes_per_worker
from kvserving.sim.gpu import GPU_SCHEDULER, HIT_TOL, TPUT_TOL, bench_load, format_rows, reproduce
from kvserving.sim.shared_gpu import SharedGpu, step_kind
from kvserving.sim.cluster import ClusterSpec, Simulator, run_bench_point

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _measured() -> dict:
    return json.loads((RESULTS / "agents_gpu_h200.json").read_text())


def _count_text(n: float | None) -> str:
    return "-" if n is None else str(round(n))


def _load() -> LoadSpec:
    return bench_load(_measured())


def test_gpu_cost_file_loads_and_its_pools_match_the_bench_stacks() -> None:
    costs = load_costs("gpu-h200")
    raw = json.loads((RESULTS / "sim_costs_gpu_h200.json").read_text())
    assert costs.name == "gpu-h200" and (costs.layers, costs.kv_heads, costs.head_dim) == (36, 8, 128)
    assert (
        costs.decode_step("nvfp4", 16, 16 * 32768)
        == raw["decode_step_s"] + 16 * raw["decode_seq_s"] + raw["decode_ctx_s"]["nvfp4"] * 16 * 32768
    )
    measured = _measured()
    kv = kv_bytes_per_worker(measured)
    assert kv == 8 * 2**30
    formats = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}
    for stack in measured["stacks"]:
        if stack["format"] in formats:  # triaxial's pool depends on its stored INT2 share
            pages = costs.pool_pages(formats[stack["format"]], stack["page_size"], kv_bytes=kv)
            assert pages * stack["page_size"] == stack["capacity_tokens"]["decode"]


def test_gpu_h100_profile_is_built_in_fitted_from_the_h100_and_names_what_it_borrows() -> None:
    costs = load_costs("gpu-h100")
    raw = json.loads((RESULTS / "sim_costs_gpu_h100.json").read_text())
    assert costs.name == "gpu-h100" and costs.to_dict() == {**costs.to_dict(), **raw}
    # engine_gpu_h100.json's decode rows and eager step, the H100 agent sweep's serving loop
    assert (costs.decode_step_s, costs.decode_seq_s, costs.prefill_step_s) == (0.00616, 4.7e-05, 0.0295)
    assert costs.decode_ctx_s == {"bf16": 5.12e-08, "fp8_e4m3": 2.55e-08, "nvfp4": 1.48e-08, "triaxial": 1.5e-08}
    # one-device NIXL READs on the H100, no fixed overhead told apart
    assert (costs.transfer_overhead_s, costs.transfer_region_s, costs.transfer_bytes_per_s) == (0.0, 6.86e-06, 986000000000.0)
    # what the H100 has no measurement of comes from the H200, and the notes say so
    h200 = load_costs("gpu-h200")
    assert costs.prefill_attn_dtype_s["bf16"] == h200.prefill_attn_dtype_s["bf16"] == 2.11e-09
    assert (costs.shared_gpu_prefill_share, costs.shared_gpu_decode_share, costs.decode_request_s) == (0.5, 0.45, 0.15)
    assert sorted(k for k in costs.notes if k.startswith("borrowed_")) == [
        "borrowed_gateway_s",
        "borrowed_prefill_attn_bf16",
        "borrowed_request_s",
        "borrowed_shared_gpu",
    ]
    measured = json.loads((RESULTS / "agents_gpu_h100.json").read_text())
    kv = kv_bytes_per_worker(measured)
    for stack in measured["stacks"]:
        if stack["format"] in ("fp8", "nvfp4"):
            pages = costs.pool_pages({"fp8": "fp8_e4m3"}.get(stack["format"], "nvfp4"), stack["page_size"], kv_bytes=kv)
            assert pages * stack["page_size"] == stack["capacity_tokens"]["decode"]


def test_shared_gpu_runs_each_step_at_its_measured_share_while_both_run_one() -> None:
    costs = load_costs("gpu-h200")
    # bench/results/sim_shared_gpu_h200.json: the prefill-shaped process kept 0.50, the decode-shaped 0.45
    assert (costs.shared_gpu_prefill_share, costs.shared_gpu_decode_share) == (0.5, 0.45)
    sim = Simulator(ClusterSpec("nvfp4", 1, 1, costs, scheduler=GPU_SCHEDULER), _load())
    pre, dec = sim.prefill[0], sim.decode[0]
    gpu = SharedGpu(sim, pre, dec)
    pre.busy = dec.busy = True
    gpu.start(pre, 0.0, 1.0, [])
    sim.at(0.5, lambda t: gpu.start(dec, t, 1.0, []))
    sim.run(until=10.0)
    busy = gpu.counters(10.0)
    # the prefill step: 0.5 s alone, then its remaining 0.5 GPU-seconds at 0.5 (ends at 1.5); the
    # decode step: 0.45 GPU-seconds by then, the other 0.55 alone (ends at 2.05)
    assert math.isclose(busy["prefill_only"], 0.5) and math.isclose(busy["both"], 1.0)
    assert math.isclose(busy["decode_only"], 0.55)
    assert not pre.busy and not dec.busy  # each step's end went back to its worker
    # each step's wall time, sharing included (an empty plan is a step of decodes alone)
    assert {k: (n, round(gpu.step_seconds[k], 9)) for k, n in gpu.step_counts.items()} == {
        ("prefill", "decode"): (1, 1.5),
        ("prefill", "mixed"): (0, 0.0),
        ("decode", "decode"): (1, 1.55),
        ("decode", "mixed"): (0, 0.0),
    }


def test_a_read_copy_waits_for_its_workers_step_and_shares_the_gpu_with_the_other_role() -> None:
    costs = load_costs("gpu-h200")
    assert (costs.shared_gpu_prefill_share, costs.shared_gpu_decode_share) == (0.5, 0.45)
    sim = Simulator(ClusterSpec("nvfp4", 1, 1, costs, scheduler=GPU_SCHEDULER), _load())
    pre, dec = sim.prefill[0], sim.decode[0]
    gpu = SharedGpu(sim, pre, dec)
    copied: list[tuple[str, float]] = []
    pre.busy = dec.busy = True
    gpu.start(dec, 0.0, 1.0, [])
    sim.at(0.5, lambda t: gpu.copy(dec, t, 0.2, lambda arg, t: copied.append((arg, t)), "first"))
    sim.at(1.1, lambda t: gpu.start(dec, t, 0.5, []))
    sim.at(2.0, lambda t: gpu.start(pre, t, 2.0, []))
    sim.at(2.0, lambda t: gpu.copy(dec, t, 0.45, lambda arg, t: copied.append((arg, t)), "second"))
    sim.run(until=10.0)
    # the first copy waits for the decode's step (ends 1.0) and runs alone to 1.2; the step asked at 1.1 waits
    # for it (1.2 .. 1.7). The second copy shares with the prefill's step: 0.45 GPU-seconds at 0.45 (2.0 .. 3.0),
    # the prefill's step 0.5 of its 2.0 by then, the rest alone (ends 4.5)
    assert [(arg, round(t, 9)) for arg, t in copied] == [("first", 1.2), ("second", 3.0)]
    busy = gpu.counters(10.0)
    assert {k: round(v, 9) for k, v in busy.items()} == {"prefill_only": 1.5, "decode_only": 1.7, "both": 1.0}
    # a step's wall time holds its wait for the copy before it (1.1 .. 1.7); copies are not steps
    assert {k: (n, round(gpu.step_seconds[k], 9)) for k, n in gpu.step_counts.items()} == {
        ("prefill", "decode"): (1, 2.5),
        ("prefill", "mixed"): (0, 0.0),
        ("decode", "decode"): (2, 1.6),
        ("decode", "mixed"): (0, 0.0),
    }


def test_reads_into_one_worker_go_one_at_a_time_each_its_post_then_its_copy() -> None:
    from kvserving.sim.workers import PullOutcome

    costs = replace(load_costs("gpu-h200"), transfer_overhead_s=0.1)
    # the copy is the READ's regions and bytes; the fixed part is its post
    assert costs.copy_s(8e9) == costs.regions_per_pull() * costs.transfer_region_s + 8e9 / costs.transfer_bytes_per_s
    assert costs.pull_s(8e9) == 0.1 + costs.copy_s(8e9)
    ends: dict[str, list[tuple[str, float]]] = {}
    for shared in (True, False):
        sim = Simulator(ClusterSpec("nvfp4", 1, 1, costs, scheduler=GPU_SCHEDULER), _load())
        dec = sim.decode[0]
        if shared:
            SharedGpu(sim, sim.prefill[0], dec)
        done = ends.setdefault("shared" if shared else "alone", [])
        out = PullOutcome(seconds=0.3, copy_s=0.2)
        for name in ("a", "b"):
            sim.at(0.0, lambda t, name=name: dec.read(out, lambda arg, t: done.append((arg, round(t, 9))), name, t))
        sim.run(until=10.0)
        if shared:  # a: post 0 .. 0.1, copy .. 0.3; b waits for it: post 0.3 .. 0.4, copy .. 0.6
            assert (round(dec.stats.read_s, 9), round(dec.stats.read_wait_s, 9)) == (0.6, 0.3)
    assert ends == {"shared": [("a", 0.3), ("b", 0.6)], "alone": [("a", 0.3), ("b", 0.3)]}


def test_a_step_with_a_prompt_chunk_is_mixed_and_one_of_decodes_alone_is_decode() -> None:
    from kvserving.sim.workers import Req, _Seq

    def chunk(computed: int, prompt: int, n: int) -> tuple[_Seq, int]:
        req = Req(0, "c", [], prompt, 16, 0, 0, 0.0)
        return _Seq(req, tokens=computed + n, computed=computed, pages=0, start=0), n

    assert step_kind([chunk(70, 64, 1), chunk(100, 64, 1)]) == "decode"
    assert step_kind([chunk(70, 64, 1), chunk(0, 64, 64)]) == "mixed"
    assert step_kind([chunk(63, 64, 1)]) == "mixed"  # the prompt's last token: a prompt chunk of one


def test_replay_of_one_measured_point_is_what_the_simulator_computes() -> None:
    measured = _measured()
    costs = load_costs("gpu-h200")
    rows = reproduce(measured, costs, only={("nvfp4", 16)})
    assert [(r["format"], r["mode"], r["concurrency"]) for r in rows] == [("nvfp4", "lease", 16)]
    row = rows[0]
    meas = next(p for p in measured["points"] if (p["format"], p["mode"], p["concurrency"]) == ("nvfp4", "lease", 16))
    assert row["measured"]["hit_rate"] == meas["hit_rate"] and row["measured"]["output_tok_per_s"] == meas["output_tok_per_s"]
    # the same point built by hand: one prefill and one decode worker on one shared GPU
    cluster = ClusterSpec(
        "nvfp4",
        1,
        1,
        replace(costs, kv_bytes_per_worker=8 * 2**30),
        reuse=reuse_for_mode("lease", ttl_s=measured["ttl_s"]),
        scheduler=GPU_SCHEDULER,
    )
    sim = Simulator(cluster, _load())
    SharedGpu(sim, sim.prefill[0], sim.decode[0])
    point = run_bench_point(sim, range(16000, 16016), window_s=meas.get("window_s"))
    assert point["requests"] == meas["requests"]  # the same agents and turns as the bench ran
    assert row["sim"]["hit_rate"] == point["hit_rate"]
    assert row["sim"]["output_tok_per_s"] == point["output_tok_per_s"]
    assert row["hit_ok"] == (abs(point["hit_rate"] - meas["hit_rate"]) <= HIT_TOL)
    assert row["tput_ok"] == (abs(point["output_tok_per_s"] - meas["output_tok_per_s"]) <= TPUT_TOL * meas["output_tok_per_s"])
    shares = row["sim_counters"]["gpu_busy_share"]
    assert set(shares) == {"prefill_only", "decode_only", "both"} and 0 < sum(shares.values()) <= 1 + 1e-9
    # NIXL regions a pull: what the replay prices (one run per layer) beside what the bench measured
    assert row["sim_counters"]["decode_pulls"] == point["decode_pulls"] > 0
    assert row["sim_counters"]["decode_regions_per_pull"] == costs.layers * costs.transfer_runs == 36
    assert row["measured_counters"]["decode_regions_per_pull"] == meas.get("decode_regions_per_pull")
    # prompt tokens a second of the prefill worker's steps: the replay's over its GPU time (alone or shared), the
    # stack's over its mixed steps
    wall = row["sim_counters"]["wall_s"]
    assert math.isclose(
        row["sim_counters"]["prefill_tok_s"], point["prefill_computed_tokens"] / ((shares["prefill_only"] + shares["both"]) * wall)
    )
    steps_s = meas["prefill_mixed_steps"] * meas["prefill_mixed_step_ms"] / 1e3
    assert math.isclose(row["measured_counters"]["prefill_tok_s"], meas["prefill_computed_tokens"] / steps_s)
    table = format_rows(rows).splitlines()
    col = table[0].index("P tok/s sim/meas")
    assert table[2][col:].split()[:3] == [
        str(round(row["sim_counters"]["prefill_tok_s"])),
        "/",
        str(round(row["measured_counters"]["prefill_tok_s"])),
    ]
    # pulled tokens the prefill lost before admission, replay / stack
    col = table[0].index("P lost sim/meas")
    assert table[2][col:].split()[:3] == [
        str(row["sim_counters"]["prefill_lost_tokens"]),
        "/",
        _count_text(meas.get("prefill_lost_tokens")),
    ]
    # the hit rate's parts, replay / stack: prompt tokens the prefill found in its own cache, and those it pulled
    for name in ("local", "pulled"):
        col = table[0].index(f"{name} sim/meas")
        assert table[2][col:].split()[:3] == [
            f"{point[f'{name}_share']:.2f}",
            "/",
            "-" if meas.get(f"{name}_share") is None else f"{meas[f'{name}_share']:.2f}",
        ]
    # pages the prefill's admission pins gave up from their tails, replay / stack (the stack's admission_pages_trimmed)
    assert row["sim_counters"]["prefill_pages_trimmed"] == point["prefill_pages_trimmed"]
    assert row["measured_counters"]["prefill_pages_trimmed"] == meas.get("prefill_admission_pages_trimmed")
    col = table[0].index("P trimmed pages sim/meas")
    assert table[2][col:].split()[:3] == [
        str(point["prefill_pages_trimmed"]),
        "/",
        _count_text(meas.get("prefill_admission_pages_trimmed")),
    ]
    col = table[0].index("D regions/pull sim/meas")
    assert table[2][col:].split()[:3] == [
        "36",
        "/",
        "-" if meas.get("decode_regions_per_pull") is None else str(round(meas["decode_regions_per_pull"])),
    ]
    # the decode's steps with prompt tokens, replay / stack: how many and their mean wall time
    sc = row["sim_counters"]
    col = table[0].index("D mixed steps x ms sim/meas")
    assert table[2][col:].split()[:7] == [
        str(sc["decode_mixed_steps"]),
        "x",
        f"{sc['decode_mixed_step_ms']:.0f}",
        "/",
        str(meas["decode_mixed_steps"]),
        "x",
        f"{meas['decode_mixed_step_ms']:.0f}",
    ]


def test_a_page_major_bench_is_replayed_with_a_region_per_run() -> None:
    """kv_cache.layout page_major: a pull's run of pages is one NIXL region for every layer; the replay prices it so
    when the measured file says the workers ran page-major (a file without the key ran layer-major)."""
    costs = load_costs("gpu-h200")
    pm = replace(costs, page_major=True)
    assert (costs.regions_per_pull(), pm.regions_per_pull()) == (36, 1)
    nbytes = 2**20
    assert math.isclose(costs.pull_s(nbytes) - pm.pull_s(nbytes), 35 * costs.transfer_region_s)
    measured = dict(_measured(), kv_layout="page_major")
    (row,) = reproduce(measured, costs, only={("nvfp4", 16)})
    assert row["sim_counters"]["decode_pulls"] > 0 and row["sim_counters"]["decode_regions_per_pull"] == 1
    with pytest.raises(ValueError, match="costs.page_major must be true or false"):
        replace(costs, page_major="yes")
