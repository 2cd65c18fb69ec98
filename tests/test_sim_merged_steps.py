"""Runs of identical decode steps advanced in one event (``kvserving.sim.workers._Run``) give
the results of stepping every one: P/D populations with evictions and expiring leases, a decode
pool that preempts, and the measured GPU points replayed on one shared GPU; every turn record,
counter, pool and lease compared exactly (the run computes each step's time and each pool
operation as stepping does, in the same order, so no float may differ)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvserving.agents.load import Dist, LoadSpec, reuse_for_mode
from kvserving.config import ReuseConfig, SchedulerConfig
from kvserving.sim.cluster import ClusterSpec, Population, Simulator, run_bench_point, run_population
from kvserving.sim.costs import load_costs
from kvserving.sim.bench_results import kv_bytes_per_worker
from kvserving.sim.gpu import GPU_SCHEDULER, bench_dtype, bench_load
from kvserving.sim.shared_gpu import SharedGpu
from kvserving.sim.workers import PullRules, Req, Worker

from sim_costs import tiny_costs

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
LONG_REPLIES = LoadSpec(output_tokens=Dist("uniform", 160, 120, 1), think_time_s=Dist("exponential", 3.0, 0.0, 0.0, 20.0))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each path of a run was taken, and how many step events the decode workers had."""
    seen: Counter[str] = Counter()
    for name in ("_step_done", "_run_end", "_cut", "_run_pages", "hand_run_to_gpu"):
        original = getattr(Worker, name)

        def counted(self: Worker, *args: Any, _name: str = name, _original: Any = original) -> Any:
            if self in seen_workers:
                seen[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(Worker, name, counted)
    return seen


seen_workers: set[Worker] = set()  # the decode workers of the run being counted


def _state(sim: Simulator, gpu: SharedGpu | None) -> str:
    """Everything a run leaves: records, in-flight turns, each worker's counters, pool and leases."""
    workers = []
    for w in [*sim.prefill, *sim.decode]:
        cache = w.cache
        workers.append(
            {
                "stats": dataclasses.asdict(w.stats),
                "pool": [cache.used, cache.cached, cache.evicted, cache.lru_keys()],
                "leases": sorted((lease_id, lease.expires_at, lease.pages) for lease_id, lease in w.leases.items()),
                "running": [(s.req.turn_id, s.computed, s.tokens, s.pages, s.req.sampled) for s in w.running],
                "waiting": [r.turn_id for r in w.waiting],
                "inflight": w.inflight,
            }
        )
    return json.dumps(
        {
            "now": sim.now,
            "records": [dataclasses.astuple(r) for r in sim.records],
            "in_flight": [(r.turn_id, r.first_token_at, r.sampled) for r in sim.in_flight()],
            "workers": workers,
            "gpu": gpu.counters(sim.now) if gpu is not None else None,
        },
        default=str,
    )


def _population(
    merge: bool, *, cluster: ClusterSpec, load: LoadSpec, pop: Population, sweep_s: float | None = None
) -> tuple[str, dict[str, Any]]:
    sim = Simulator(cluster, load, merge_steps=merge, sweep_s=sweep_s)
    seen_workers.clear()
    seen_workers.update(sim.decode if merge else ())
    point = run_population(sim, pop)
    return _state(sim, None), point


def _both(run: Any) -> tuple[Any, Any]:
    """``run(merge)`` stepped, then merged (``calls`` counts the merged one's decode workers)."""
    return run(False), run(True)


def test_merged_decode_steps_leave_a_pd_population_with_evictions_and_expiring_leases_as_stepping_does(calls: Counter[str]) -> None:
    costs = load_costs("h200-8b")
    # retained conversations expire on the decode workers (12 s) long before the gateway's
    # heartbeat (every 40 s) would release them
    reuse = ReuseConfig(retention_ttl_s=12.0, lease_ttl_s=9.0)
    cluster = ClusterSpec("nvfp4", 2, 3, costs, reuse=reuse, kv_bytes_per_worker=6 * 2**30)
    pop = Population(120, 90.0, warmup_s=10.0, ramp_s=10.0, shapes=64)
    (s0, p0), (s1, p1) = _both(lambda merge: _population(merge, cluster=cluster, load=LONG_REPLIES, pop=pop, sweep_s=40.0))
    assert s1 == s0
    assert json.dumps(p1, default=str) == json.dumps(p0, default=str)
    assert p0["requests"] > 300 and p0["decode_evicted_pages"] > 0
    assert sum(json.loads(s0)["workers"][i]["stats"]["leases_expired"] for i in range(2, 5)) > 0
    # the merged run took every path of a run, in far fewer step events than stepping's tokens
    assert calls["_run_end"] > 100 and calls["_cut"] > 100 and calls["_run_pages"] > 100
    assert calls["_step_done"] < p0["output_tokens"] / 2


@pytest.mark.parametrize("pins_yield_always", [False, True])
def test_merged_decode_steps_leave_a_preempting_decode_pool_with_waiting_pulls_as_stepping_does(
    calls: Counter[str], pins_yield_always: bool
) -> None:
    costs = load_costs("h200-8b")
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, chunk_size=1024)
    # 1P/1D, a decode pool of ~14K tokens: replies of up to 280 tokens outgrow it and preempt, and
    # the decode's pulls find no free page: they wait (runs cut where pages come back) for 1 s at
    # most (a 2 s transfer timeout); some get pages, some give up. With admission pins that hold
    # against admissions while sequences run, fewer sequences run at once and fewer are preempted
    # (8 against 18) while more pulls give up (68 of 161 against 8 of 204).
    reuse = ReuseConfig(transfer_timeout_s=2.0)
    cluster = ClusterSpec(
        "fp8_e4m3",
        1,
        1,
        costs,
        scheduler=sched,
        reuse=reuse,
        kv_bytes_per_worker=2 * 2**30,
        rules=PullRules(pins_yield_always=pins_yield_always),
    )
    pop = Population(48, 60.0, warmup_s=5.0, ramp_s=5.0, shapes=40)
    (s0, p0), (s1, p1) = _both(lambda merge: _population(merge, cluster=cluster, load=LONG_REPLIES, pop=pop))
    assert s1 == s0
    assert json.dumps(p1, default=str) == json.dumps(p0, default=str)
    stats = json.loads(s0)["workers"][1]["stats"]
    assert stats["preemptions"] > (10 if pins_yield_always else 3)
    assert stats["page_waits"] > 100 and 5 < stats["skipped"]["no_free_pages"] < stats["page_waits"] / 2
    assert calls["_run_end"] > 10 and calls["_cut"] > 10


def _replay(merge: bool, fmt: str, n: int) -> str:
    measured = json.loads((RESULTS / "agents_gpu_h200.json").read_text())
    point = next(p for p in measured["points"] if (p["format"], p["mode"], int(p["concurrency"])) == (fmt, "lease", n))
    costs = replace(load_costs("gpu-h200"), kv_bytes_per_worker=kv_bytes_per_worker(measured))
    reuse = reuse_for_mode("lease", ttl_s=float(measured.get("ttl_s", 3.0)))
    cluster = ClusterSpec(bench_dtype(fmt), 1, 1, costs, reuse=reuse, scheduler=GPU_SCHEDULER)
    sim = Simulator(cluster, bench_load(measured), merge_steps=merge)
    gpu = SharedGpu(sim, sim.prefill[0], sim.decode[0])
    seen_workers.clear()
    seen_workers.update(sim.decode if merge else ())
    summary = run_bench_point(sim, range(1000 * n, 1000 * n + n), window_s=point.get("window_s"))
    return _state(sim, gpu) + json.dumps(summary, default=str)


# below the cliff, and past it (preemptions, the decode's queue waiting for pages: few runs)
@pytest.mark.parametrize(("fmt", "n", "runs", "handed"), [("nvfp4", 16, 90, 20), ("nvfp4", 32, 5, 1)])
def test_merged_decode_steps_replay_measured_points_on_a_shared_gpu_as_stepping_does(
    calls: Counter[str], fmt: str, n: int, runs: int, handed: int
) -> None:
    stepped, merged = _both(lambda merge: _replay(merge, fmt, n))
    assert merged == stepped
    # runs went on while the prefill was idle and handed their step to the GPU when it started one
    assert calls["_run_end"] >= runs and calls["hand_run_to_gpu"] >= handed


def _release_during_a_run(merge: bool) -> tuple[int, int, int]:
    """A decode pool of 9 pages: chain X (4 pages, the first 2 held by a retained lease, the last
    2 cached at the LRU's front), chain Y (2 cached pages) and one request whose 3 pages fill it.
    Its 8th decode step (from 11.1 ms) needs a 4th page: stepping evicts X's last page there;
    the lease goes at 13 ms, moving X behind Y, while the merged run (to the reply's end) has
    not counted that page in the pool yet: settled first, the run evicts as stepping did. The
    24th step's 5th page then comes from Y, now at the front."""
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(9)), LoadSpec(), merge_steps=merge)
    dec = sim.decode[0]
    seen_workers.clear()
    seen_workers.update(sim.decode if merge else ())
    cache = dec.cache
    big = 1 << 40
    hx, hy, lease_hold = cache.new_hold(), cache.new_hold(), cache.new_hold()
    assert cache.allocate(hx, 4) and cache.allocate(hy, 2)
    cache.publish(hx, [("X", big)], 0, 4)
    cache.publish(hy, [("Y", big)], 0, 2)
    cache.ref(lease_hold, [("X", big)], 2)
    cache.release(hx)
    cache.release(hy)
    assert cache.lru_keys() == ["X", "Y"] and cache.free == 4 + 3
    lease = dec.pin(lease_hold, ttl_s=100.0, now=0.0, conv=None, pages=2, stable=2, prefix="kv-")
    done: list[float] = []
    dec.on_done = lambda req, now: done.append(now)
    # 40 prompt tokens and the prefill's token: one 4.1 ms chunk in 3 pages, then 1 ms decode steps
    dec.arrive(Req(1, "c1", [(1, big)], 40, 30, 2, 4, 0.0), 0.0)
    sim.at(13e-3, lambda now: dec.release(lease.lease_id, now))
    sim.run()
    assert len(done) == 1
    return cache.present("X"), cache.present("Y"), cache.evicted


def test_a_lease_released_during_a_merged_run_comes_after_the_pages_the_run_allocated_before_it(calls: Counter[str]) -> None:
    assert _release_during_a_run(False) == (3, 1, 2)
    assert _release_during_a_run(True) == (3, 1, 2)
    assert calls["_run_pages"] >= 1 and calls["_step_done"] < 10


def _pull_waiting_through_a_run(merge: bool) -> tuple[str, float]:
    """A decode pool of 9 pages: a lease holds 2 until 20 ms; request A (64-token prompt, 30-token
    reply, 3 pages pulled) runs in 5 pages, 6 from 16.7 ms; B's pull (3 pages) finds 2 free at 5 ms
    and waits. The lease's release at 20 ms, inside A's run, frees what B needs: the run ends after
    the step in progress, B's pull tries again at the first step end 20 ms after its last try
    (25.7 ms) and gets its pages; B is admitted when A's reply ends (29.7 ms) and its lease is reclaimed."""
    reuse = ReuseConfig(recompute_threshold_tokens=32)
    sim = Simulator(ClusterSpec("fp8_e4m3", 1, 1, tiny_costs(9), reuse=reuse), LoadSpec(), merge_steps=merge)
    pre, dec = sim.prefill[0], sim.decode[0]
    seen_workers.clear()
    seen_workers.update(sim.decode if merge else ())
    big = 1 << 40
    lease_hold = dec.cache.new_hold()
    assert dec.cache.allocate(lease_hold, 2)
    lease = dec.pin(lease_hold, ttl_s=100.0, now=0.0, conv=None, pages=2, stable=0, prefix="kv-")
    dec.on_done = lambda req, now: None
    reqs = [Req(i, f"c{i}", [(i, big)], 64, out, 4, 4, 0.0) for i, out in ((1, 30), (2, 10))]
    for r in reqs:
        hold = pre.cache.new_hold()
        assert pre.cache.allocate(hold, 3)
        pre.cache.publish(hold, r.segs, 0, 3)
        r.transfer_offer = pre.pin(hold, ttl_s=reuse.transfer_timeout_s, now=0.0, conv=None, pages=3, stable=3, prefix="xfer-")
        r.decode_url = dec.url
    sim.call_at(0.0, sim._at_decode, (reqs[0], dec))
    sim.call_at(5e-3, sim._at_decode, (reqs[1], dec))
    sim.at(20e-3, lambda now: dec.release(lease.lease_id, now))
    sim.run()
    assert all(r.sampled == r.output for r in reqs)
    return _state(sim, None), dec.stats.page_wait_s


def test_a_pull_waiting_for_pages_cuts_a_run_where_a_release_frees_them(calls: Counter[str]) -> None:
    stepped, merged = _pull_waiting_through_a_run(False), _pull_waiting_through_a_run(True)
    assert merged == stepped
    stats = json.loads(stepped[0])["workers"][1]["stats"]
    assert (stats["pulled_pages"], stats["page_waits"], stats["skipped"]["no_free_pages"]) == (6, 1, 0)
    assert abs(stepped[1] - (25.7e-3 - 5e-3)) < 0.01e-3
    assert calls["_cut"] >= 2 and calls["_run_end"] >= 2
