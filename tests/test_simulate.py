"""The cluster simulator (kvserving.sim.cluster): its page cache, leases and event core by name,
routing against the real router, the cost model's input checks, and the hit rate against the
benchmark's measured numbers (bench/results/agents_cpu.json)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvserving.config import GatewayConfig, ReuseConfig
from kvserving.gateway.router import WorkerView, choose_decode, choose_prefill
from kvserving.sim.cache import PageCache
from kvserving.sim.costs import CostModel, canonical_dtype, load_costs
from kvserving.sim.plan import split_gpus, validate_points
from kvserving.sim.cluster import ClusterSpec, Population, Simulator

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "bench" / "results" / "agents_cpu.json"
# absolute hit rate, simulated vs measured: the worst point (a knee) and the mean over all points
HIT_RATE_TOLERANCE, HIT_RATE_MEAN_TOLERANCE = 0.15, 0.03


def tiny_costs(**kw: object) -> CostModel:
    base = dict(
        name="t",
        layers=1,
        kv_heads=1,
        head_dim=32,
        kv_bytes_per_worker=1 << 20,
        prefill_token_s=1e-4,
        prefill_attn_s=0.0,
        decode_step_s=1e-3,
        decode_ctx_s={"bf16": 0.0, "fp8_e4m3": 0.0, "nvfp4": 0.0},
    )
    base.update(kw)
    return CostModel(**base)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- page cache
def test_lru_evicts_least_recent_chain_first_and_its_tail_first() -> None:
    cache = PageCache(10)
    a, b = cache.new_hold(), cache.new_hold()
    segs_a, segs_b = [("a", 100)], [("b", 100)]
    assert cache.allocate(a, 4) and cache.allocate(b, 4)
    cache.publish(a, segs_a, 0, 4)
    cache.publish(b, segs_b, 0, 4)
    cache.release(a)  # a goes into the LRU first: least recently used
    cache.release(b)
    assert cache.lru_keys() == ["a", "b"] and cache.cached == 8 and cache.free == 10
    c = cache.new_hold()
    assert cache.allocate(c, 5)  # 2 free pages, then 3 evicted from a's tail
    assert cache.present("a") == 1 and cache.present("b") == 4 and cache.evicted == 3
    assert cache.match(segs_a, 10) == 1  # the head survives, a prefix match still finds it
    assert cache.allocate(c, 2)  # a's last page, then b's tail
    assert cache.present("a") == 0 and cache.present("b") == 3 and cache.lru_keys() == ["b"]


def test_holders_give_each_page_to_the_first_class_over_it() -> None:
    # PagePoolBase.page_holders: a request's ref first, then the least reclaimable pin; loose pages to their holder
    cache = PageCache(20)
    writer = cache.new_hold()
    assert cache.allocate(writer, 6)
    cache.publish(writer, [("x", 100)], 0, 6)
    request, hold, pulled, retained = (cache.new_hold() for _ in range(4))
    cache.ref(request, [("x", 100)], 2)
    cache.ref(hold, [("x", 100)], 4)
    cache.ref(pulled, [("x", 100)], 6)
    assert cache.allocate(retained, 3)  # unhashed pages of its own
    cache.release(writer)
    assert cache.holders([[request], [hold], [retained], [pulled]]) == [2, 2, 3, 2]
    assert cache.holders([[], [hold, pulled], [], [request]]) == [0, 6, 0, 0]  # the first class wins a page


def test_matching_a_chain_takes_its_pages_out_of_the_lru_and_release_moves_it_to_the_end() -> None:
    cache = PageCache(8)
    h = cache.new_hold()
    for key in ("a", "b"):
        assert cache.allocate(h, 3)
        cache.publish(h, [(key, 10)], 0, 3)
    cache.release(h)
    assert cache.lru_keys() == ["a", "b"]
    user = cache.new_hold()
    cache.ref(user, [("a", 10)], 3)
    assert cache.lru_keys() == ["b"] and cache.cached == 3
    cache.release(user)
    assert cache.lru_keys() == ["b", "a"]  # a was just used: b is evicted first now


def test_lease_pins_are_never_evicted_and_allocation_is_all_or_nothing() -> None:
    cache = PageCache(6)
    lease = cache.new_hold()
    assert cache.allocate(lease, 4)
    cache.publish(lease, [("conv", 50)], 0, 4)
    other = cache.new_hold()
    assert not cache.allocate(other, 3)  # 2 free, 4 pinned: nothing changes
    assert cache.used == 4 and cache.evicted == 0 and other.loose == 0
    assert cache.allocate(other, 2)
    cache.release(lease)  # the pin goes: its pages are cached, evictable
    assert cache.free == 4 and cache.allocate(other, 4) and cache.present("conv") == 0


def test_publish_keeps_the_first_copy_and_frees_duplicates_on_release() -> None:
    cache = PageCache(10)
    first, second = cache.new_hold(), cache.new_hold()
    assert cache.allocate(first, 3) and cache.allocate(second, 3)
    cache.publish(first, [("sys", 3)], 0, 3)
    cache.publish(second, [("sys", 3)], 0, 3)  # computed at the same time: stays loose
    assert cache.present("sys") == 3 and second.loose == 3 and cache.used == 6
    cache.release(second)
    assert cache.used == 3 and cache.owned("sys") == 3


def test_trim_lets_go_of_a_holds_last_chain_pages_first_then_earlier_chains_then_loose_pages() -> None:
    """``PagePoolBase.trim_pin``'s mirror: the tail of the last chain the hold took, then the chain before;
    trimmed pages are cached (evictable, the chain newest in the LRU) unless another holder keeps them."""
    cache = PageCache(12)
    pin, other = cache.new_hold(), cache.new_hold()
    assert cache.allocate(pin, 7)
    cache.publish(pin, [("sys", 2), ("c", 4)], 0, 6)  # sys[0, 2) then c[0, 4); one page stays loose
    assert (pin.extents, pin.loose, cache.held(pin)) == ({"sys": 2, "c": 4}, 1, 7)
    cache.ref(other, [("sys", 2), ("c", 4)], 3)  # another holder keeps sys and c[0, 1)
    assert cache.allocate(cache.new_hold(), 5) and cache.free == 0
    assert cache.trim(pin, 1) == 1 and pin.extents == {"sys": 2, "c": 3}
    assert (cache.owned("c"), cache.free, cache.lru_keys()) == (3, 1, ["c"])
    assert cache.trim(pin, 4) == 4 and pin.extents == {"sys": 1}  # c's other 3 (c[0, 1) kept by other), then sys's last
    assert (cache.owned("c"), cache.owned("sys"), cache.free) == (1, 2, 3)
    assert cache.trim(pin, 5) == 2 and (pin.extents, pin.loose, cache.free) == ({}, 0, 4)  # sys[0, 1) and the loose page


def test_could_fit_after_release_counts_only_pages_no_other_holder_keeps() -> None:
    """``PagePoolBase.could_fit_after_reclaim``'s mirror: what the yielding holds alone keep, and their
    loose pages, would be free; a chain page another holder also holds would not."""
    cache = PageCache(10)
    conv, running, lease = cache.new_hold(), cache.new_hold(), cache.new_hold()
    assert cache.allocate(conv, 4)
    cache.publish(conv, [("c", 10)], 0, 4)  # conv holds c[0, 4)
    cache.ref(running, [("c", 10)], 2)  # a running request shares c[0, 2)
    assert cache.allocate(lease, 3)  # 3 loose pages
    assert cache.allocate(cache.new_hold(), 2)  # 1 page free now
    assert cache.free == 1
    assert cache.could_fit_after_release([], 1) and not cache.could_fit_after_release([], 2)
    # conv letting go frees c[2, 4) only (running keeps c[0, 2)): 1 + 2 pages
    assert cache.could_fit_after_release([conv], 3) and not cache.could_fit_after_release([conv], 4)
    # both: 1 + 2 + 3 loose
    assert cache.could_fit_after_release([conv, lease], 6) and not cache.could_fit_after_release([conv, lease], 7)
    cache.release(conv)
    cache.release(lease)
    other = cache.new_hold()
    assert cache.allocate(other, 6) and not cache.allocate(cache.new_hold(), 1)  # the check was exact


def test_shared_prefix_segments_match_across_chains() -> None:
    cache = PageCache(20)
    h = cache.new_hold()
    segs = [("sys", 2), ("conv1", 100)]
    assert cache.allocate(h, 5)
    cache.publish(h, segs, 0, 5)
    cache.release(h)
    assert cache.match(segs, 100) == 5
    assert cache.match([("sys", 2), ("conv2", 100)], 100) == 2  # another agent: the shared pages only


# ----------------------------------------------------------------------------- workers and leases
def _sim(prefill: int = 2, **kw: object) -> Simulator:
    from kvserving.agents.load import LoadSpec

    cluster = ClusterSpec("bf16", prefill, 3, tiny_costs(), **kw)  # type: ignore[arg-type]
    return Simulator(cluster, LoadSpec())


def test_retained_lease_expires_at_retention_and_its_pages_become_cached() -> None:
    sim = _sim(reuse=ReuseConfig(retention_ttl_s=10.0, lease_ttl_s=5.0))
    w = sim.decode[0]
    hold = w.cache.new_hold()
    assert w.cache.allocate(hold, 4)
    w.cache.publish(hold, [("c", 50)], 0, 4)
    lease = w.pin(hold, ttl_s=10.0, now=0.0, conv="c", pages=4, stable=4, prefix="kv-")
    w.expire(9.99)
    assert lease.alive(9.99) and w.cache.owned("c") == 4
    w.expire(10.0)
    assert not lease.alive(10.0) and w.cache.owned("c") == 0 and w.cache.present("c") == 4
    assert w.stats.leases_expired == 1 and w.cache.lru_keys() == ["c"]


def test_renew_moves_the_expiry_but_an_expired_lease_cannot_come_back() -> None:
    sim = _sim()
    w = sim.decode[1]
    hold = w.cache.new_hold()
    lease = w.pin(hold, ttl_s=5.0, now=0.0, conv=None, pages=0, stable=0, prefix="kv-")
    assert w.renew(lease.lease_id, ttl_s=5.0, now=4.0) == 9.0
    w.expire(6.0)
    assert lease.alive(6.0)
    assert w.renew(lease.lease_id, ttl_s=5.0, now=9.5) is None


def test_event_core_runs_in_time_order_ties_in_schedule_order() -> None:
    sim = _sim()
    seen: list[str] = []
    sim.at(2.0, lambda t: seen.append("c"))
    sim.at(1.0, lambda t: seen.append("a"))
    sim.at(1.0, lambda t: (seen.append("b"), sim.at(1.5, lambda t2: seen.append("b2"))))
    sim.run()
    assert seen == ["a", "b", "b2", "c"] and sim.now == 2.0


@pytest.mark.parametrize("prefill", [2, 5])
def test_routing_equals_the_real_router_on_every_worker(prefill: int) -> None:
    # 5 prefill workers: the load bound makes the third and later workers in hash order matter
    rng = random.Random(7)
    sim = _sim(prefill, gateway=GatewayConfig(max_inflight_per_worker=5))
    for _ in range(300):
        for w in [*sim.prefill, *sim.decode]:
            w.inflight = rng.randrange(0, 8)
        held = {w.url: rng.randrange(0, 3) for w in sim.decode}
        sim.table.per_worker.clear()
        sim.table.per_worker.update({k: v for k, v in held.items() if v})
        key = bytes(rng.randrange(256) for _ in range(16))
        lease_url = rng.choice([None, *[w.url for w in sim.decode]])
        dec, pre = sim.route(key, lease_url)
        full_d = choose_decode([WorkerView(w.url, True, w.inflight, held[w.url]) for w in sim.decode], lease_url=lease_url, max_inflight=5)
        full_p = choose_prefill([WorkerView(w.url, True, w.inflight) for w in sim.prefill], key=key)
        assert full_d is not None and full_p is not None
        assert (dec.url, pre.url) == (full_d.url, full_p.url)


# ----------------------------------------------------------------------------- agent shapes
def test_agent_shape_draws_the_same_lengths_and_think_times_as_agent_load() -> None:
    from dataclasses import replace

    from kvserving.agents.load import LoadSpec, agent
    from kvserving.sim.bench_results import load_spec_from_dict
    from kvserving.sim.plan import gpu_load
    from kvserving.sim.shapes import agent_shape

    loads = [gpu_load(0), gpu_load(3, shared_system_prompt=False), LoadSpec(), replace(LoadSpec(seed=2), long_context=True)]
    if MEASURED.is_file():
        loads.append(load_spec_from_dict(json.loads(MEASURED.read_text())["load"]))
    for load in loads:
        for i in [*range(8), 1000, 22003]:
            a, b = agent(load, i), agent_shape(load, i)
            assert (a.agent_id, a.session_id, a.prefix_tokens, len(a.turns)) == (b.agent_id, b.session_id, b.prefix_tokens, len(b.turns))
            for x, y in zip(a.turns, b.turns):
                assert (x.index, x.output_tokens, x.think_time_s, x.new_tokens, x.history_tokens, x.call_tokens) == (
                    y.index,
                    y.output_tokens,
                    y.think_time_s,
                    y.new_tokens,
                    y.history_tokens,
                    y.call_tokens,
                )
                assert (x.user is None, x.tool_result is None) == (y.user is None, y.tool_result is None)
    with pytest.raises(ValueError, match="agent index"):
        agent_shape(LoadSpec(), -1)


# ----------------------------------------------------------------------------- compiled core
def test_native_copies_import_each_other_and_the_rest_of_kvserving() -> None:
    from kvserving.sim.native import rewrite, source_key

    text = "from kvserving.sim.cache import Hold\nfrom kvserving.sim.costs import CostModel\nimport kvserving.sim.cluster\n"
    assert rewrite(text) == (
        "from kvs_simnative.cache import Hold\nfrom kvserving.sim.costs import CostModel\nimport kvs_simnative.cluster\n"
    )
    assert len(source_key()) == 20 and source_key() == source_key()


def test_the_compiled_core_gives_the_pure_python_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    import sysconfig

    from kvserving.sim import cluster as pure
    from kvserving.sim.native import build, load
    from kvserving.sim.plan import gpu_load, simulate_point

    native = load()
    if native is None:  # build it here (C at -O0: the results, not the speed) rather than leave the core unchecked
        if shutil.which("cc") is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
            pytest.skip("no C compiler or Python headers: the compiled core cannot be built on this machine")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        build(log=False, opt_level=0)
        native = load()
    assert native is not None
    points = []
    for engine in (pure, native):
        pop = engine.Population(16, 80.0, warmup_s=10.0, ramp_s=5.0, shapes=4)
        points.append(
            simulate_point(
                "fp8_e4m3",
                3,
                costs=load_costs("h200-8b"),
                pop=pop,
                prefill_share=0.34,
                load=gpu_load(1, think_s=5.0, output_tokens=40, max_context=8192),
                engine=engine,
            )
        )
    assert points[0]["requests"] > 40 and points[0] == points[1]


# ----------------------------------------------------------------------------- inputs
def test_bad_inputs_are_one_line_value_errors() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        tiny_costs(kv_heads=0)
    with pytest.raises(ValueError, match="unknown keys"):
        CostModel.from_dict({**tiny_costs().to_dict(), "typo": 1})
    with pytest.raises(ValueError, match="no decode cost for triaxial"):
        ClusterSpec("triaxial", 1, 1, tiny_costs())
    with pytest.raises(ValueError, match="unknown KV dtype"):
        canonical_dtype("fp6")
    with pytest.raises(ValueError, match="gpus must be >= 2"):
        split_gpus(1, 0.25)
    with pytest.raises(ValueError, match="warmup_s"):
        Population(10, 100.0, warmup_s=100.0)
    with pytest.raises(ValueError, match="not a built-in profile"):
        load_costs("/nonexistent/costs.json")
    assert canonical_dtype("fp8") == "fp8_e4m3" and split_gpus(64, 0.25) == (16, 48)


def test_cost_model_round_trips_json_and_sizes_pools_from_the_format() -> None:
    costs = load_costs("h200-8b")
    assert CostModel.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    # 8B shape: 36 layers x 8 heads x 128 x 2 (K, V) = 73728 values per token; nvfp4 stores 9/16 of fp8
    assert costs.page_bytes("fp8_e4m3", 16) == 73728 * 16
    assert costs.page_bytes("nvfp4", 16) == 73728 * 16 * 9 / 16
    cpu = load_costs("cpu-tiny")
    assert cpu.page_bytes("bf16", 16) == 2 * cpu.page_bytes("fp8_e4m3", 16) * 2  # fp32 on the CPU engine


# ----------------------------------------------------------------------------- validation
@pytest.mark.skipif(not MEASURED.is_file(), reason="no measured benchmark points committed")
def test_hit_rate_agrees_with_the_benchmark_on_the_cpu_stack() -> None:
    measured = json.loads(MEASURED.read_text())
    rows = validate_points(measured, load_costs("cpu-tiny"))
    assert len(rows) == len(measured["points"]) >= 30  # 4 formats x 8 points + the ttl and off modes
    errors = [abs(row["sim"]["hit_rate"] - row["measured"]["hit_rate"]) for row in rows]
    for row, err in zip(rows, errors):
        assert err <= HIT_RATE_TOLERANCE, row
    assert sum(errors) / len(errors) <= HIT_RATE_MEAN_TOLERANCE


def test_a_small_population_runs_and_reuses_kv() -> None:
    from kvserving.sim.plan import gpu_load, simulate_point

    point = simulate_point(
        "nvfp4",
        4,
        costs=load_costs("h200-8b"),
        load=gpu_load(0, think_s=5.0, output_tokens=50, max_context=8192),
        pop=Population(8, 120.0, warmup_s=20.0, ramp_s=5.0, shapes=4),
        prefill_share=0.5,
    )
    assert point["requests"] > 20 and 0.5 < point["hit_rate"] < 1.0
    assert point["local_share"] + point["pulled_share"] == pytest.approx(point["hit_rate"])
    assert point["ttft_p50_ms"] <= point["ttft_p99_ms"]


def test_cli_prints_one_row_per_format_and_refuses_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserving.cli import main

    argv = [
        "simulate",
        "--agents",
        "6",
        "--gpus",
        "2",
        "--dtype",
        "nvfp4,fp8",
        "--duration-s",
        "90",
        "--warmup-s",
        "10",
        "--shapes",
        "3",
        "--jobs",
        "1",
        "--think-s",
        "5",
        "--output-tokens",
        "20",
        "--max-context",
        "6000",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("6 agents, 90 s simulated")
    assert [line.split()[0] for line in out[3:5]] == ["nvfp4", "fp8_e4m3"]
    assert main(["simulate", "--dtype", "fp6"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown KV dtype 'fp6'" in err


def test_the_kv_size_of_a_bench_result_is_read_in_both_of_its_spellings() -> None:
    from kvserving.sim.bench_results import kv_bytes_per_worker
    from kvserving.sim.gpu import is_gpu_result

    assert kv_bytes_per_worker({"kv_per_worker": "3072 KiB"}) == 3072 * 1024
    assert kv_bytes_per_worker({"kv_per_worker": "8 GiB"}) == 8 << 30
    assert kv_bytes_per_worker({"kv_kib_per_worker": 3072}) == 3072 * 1024  # results written before "kv_per_worker"
    # a CPU result ("KiB", in either spelling) is replayed on the CPU profile, a --gpu one ("GiB") on the shared GPU
    assert [is_gpu_result(m) for m in ({"kv_per_worker": "3072 KiB"}, {"kv_kib_per_worker": 3072}, {"kv_per_worker": "8 GiB"})] == [
        False,
        False,
        True,
    ]
    with pytest.raises(ValueError, match="unit must be one of"):
        kv_bytes_per_worker({"kv_per_worker": "3 TB"})
    measured = {k: v for k, v in json.loads(MEASURED.read_text()).items() if k != "kv_kib_per_worker"}
    with pytest.raises(ValueError, match="not a bench/agents.py result: kv_per_worker '3 parsecs'"):
        validate_points({**measured, "kv_per_worker": "3 parsecs"}, load_costs("cpu-tiny"))
