"""Age-down: a cached 4-bit triaxial page that a later request's tags want at 2 bits is
re-stored as a new INT2 page (kv_manager docstring). Exact page ids, ref counts and free
lists after each step; the bytes against the reference codec; the engine on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.kernels.intquant import dequantize_groups, dequantize_int2_keys, quantize_groups, quantize_int2_keys
from kvserving.kernels.page_ids import INT2_PAGE_FLAG as F
from kvserving.tags import NUM_TAGS, encode_tag
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.cache import KVCache, build_kv_cache
from kvserving.worker.kv_stats import collect
from kvserving.worker.metrics import WorkerMetrics
from kvserving.worker.kv.page_pool import RECLAIM_FIRST
from kvserving.worker.kv.storage import KVShape
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import Sequence
from kvserving.worker.triaxial_pool import TriaxialPagePool

OLD = encode_tag("turn_m2", "text", "obs")  # an older tool result: 2 bits in TABLE
NOW = encode_tag("current", "text", "obs")  # the same tool result in its own turn: 4 bits
TABLE = tuple(2 if t == OLD else 4 for t in range(NUM_TAGS))
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=64)
P = 32
TOKENS = list(range(100, 197))  # three full pages and one token


def build(*, age_down: bool = True, budget_bytes: int = 1 << 20) -> KVCache:
    cfg = KVCacheConfig(dtype="triaxial", age_down=age_down)
    return build_kv_cache(cfg, SHAPE, budget_bytes=budget_bytes, device="cpu", model_dtype=torch.float32, bits_table=TABLE)


def seq(rid: str, tags: list[int], tokens: list[int] = TOKENS) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), make_generator(0), tags=tags)


def token_kv(token: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V of one token [H, D]: keys with a per-channel offset (outlier channels)."""
    g = torch.Generator().manual_seed(token * 16 + layer)
    k = torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=g) + torch.linspace(-4, 4, SHAPE.head_dim)
    v = torch.randn(SHAPE.num_kv_heads, SHAPE.head_dim, generator=g)
    return k, v


def compute(kv: KVCache, s: Sequence) -> None:
    """What the model runner does for a whole prompt: write K/V of the uncached tokens, publish."""
    assert kv.manager.allocate_until(s, s.num_tokens)
    for layer in range(SHAPE.num_layers):
        rows = [token_kv(t, layer) for t in s.prompt_ids]
        k, v = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # [T, H, D]
        for i in range(s.num_computed // P, len(s.page_ids)):
            pid, lo, hi = s.page_ids[i], i * P, min((i + 1) * P, s.num_tokens)
            if pid & F:
                kv.storage.write_int2_pages(layer, k[None, lo:hi], v[None, lo:hi], torch.tensor([pid], dtype=torch.int32))
            else:
                n = hi - lo
                ids = torch.full((n,), pid, dtype=torch.int32)
                kv.storage.write(layer, k[lo:hi], v[lo:hi], ids, torch.arange(n, dtype=torch.int32))
    s.num_computed = s.num_tokens
    kv.manager.publish_full_pages(s)


def page_kv(kv: KVCache, pid: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.empty(P, SHAPE.num_kv_heads, SHAPE.head_dim)
    v = torch.empty_like(k)
    kv.storage.gather(layer, torch.tensor([pid], dtype=torch.int32), P, k, v)
    return k, v


def page_bytes(kv: KVCache, pid: int) -> torch.Tensor:
    off, n = kv.pool.byte_offset(pid), kv.pool.page_bytes(bits=4 if pid < F else 2)
    return kv.storage.buffers[:, off : off + n].clone()


def int2_of(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, H, D] through the INT2 page rules (keys per channel over the page, values per token groups)."""
    kq = dequantize_int2_keys(*quantize_int2_keys(k.transpose(0, 1)), dtype=torch.float32).transpose(0, 1)
    vq = dequantize_groups(*quantize_groups(v, 2), 2, dtype=torch.float32)
    return kq, vq


def turn(kv: KVCache, rid: str, tags: list[int]) -> Sequence:
    s = seq(rid, tags)
    kv.manager.match_prefix(s)
    return s


def test_pages_of_an_older_tool_result_are_aged_on_the_next_request() -> None:
    kv = build()
    pool, mgr = kv.pool, kv.manager
    assert isinstance(pool, TriaxialPagePool) and mgr.age_down
    first = seq("t1", [NOW] * 97)
    mgr.match_prefix(first)
    compute(kv, first)
    assert first.page_ids == [0, 1, 2, 3]
    int4 = [[page_kv(kv, pid, layer) for layer in range(2)] for pid in (0, 1, 2)]
    mgr.free(first)
    assert sorted(pool.cached_page_ids()) == [0, 1, 2] and pool.page(3) is None  # page 3 was partial

    # two turns later the first two pages are an old tool result, the third still current
    later = turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    assert later.num_computed == 96
    assert later.page_ids == [F | 0, F | 1, 2]
    assert mgr.aged_pages == 2
    assert [pool.ref_count(p) for p in later.page_ids] == [1, 1, 1]
    assert pool.page(0) is None and pool.page(1) is None  # the INT4 originals: straight back to the free list
    assert pool.held_pages(bits=4) == 1 and pool.held_pages(bits=2) == 2  # INT4 slots 0 and 1 are free again
    # hashes: the 2-bit chain a fresh computation would give, the INT4 page 2 aliased under it
    assert later.page_hashes == mgr.page_hashes(later, [2, 2, 4])
    assert [pool.lookup(h) for h in later.page_hashes] == [F | 0, F | 1, 2]
    fresh = build()
    direct = seq("fresh", [OLD] * 64 + [NOW] * 33)
    compute(fresh, direct)
    assert direct.page_ids[:3] == [F | 0, F | 1, 0] and direct.page_hashes == later.page_hashes
    # bytes: the INT2 page rules applied to the INT4 page's values (the reference codec)
    for i in (0, 1):
        for layer in range(2):
            want_k, want_v = int2_of(*int4[i][layer])
            got_k, got_v = page_kv(kv, F | i, layer)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    mgr.free(later)

    # the next request with the same tags reuses the aged pages and ages nothing
    again = turn(kv, "t4", [OLD] * 64 + [NOW] * 33)
    assert again.page_ids == [F | 0, F | 1, 2] and mgr.aged_pages == 2
    assert [pool.ref_count(p) for p in again.page_ids] == [1, 1, 1]


def test_a_page_after_an_aged_one_keeps_its_hash() -> None:
    """A page's hash is its token chain and its own precision: aging page 1 changes
    neither page 0's nor page 2's, so both keep matching."""
    kv = build()
    pool, mgr = kv.pool, kv.manager
    first = seq("t1", [NOW] * 97)
    mgr.match_prefix(first)
    compute(kv, first)
    hashes = list(first.page_hashes)
    mgr.free(first)
    mid = turn(kv, "t2", [NOW] * 32 + [OLD] * 32 + [NOW] * 33)  # only page 1 ages
    assert mid.page_ids == [0, F | 0, 2] and mgr.aged_pages == 1
    assert mid.page_hashes[0] == hashes[0] and mid.page_hashes[2] == hashes[2] and mid.page_hashes[1] != hashes[1]
    assert [pool.lookup(h) for h in mid.page_hashes] == [0, F | 0, 2] and pool.lookup(hashes[1]) is None
    assert mid.page_hashes == mgr.page_hashes(mid, [4, 2, 4])
    # the pages computed after the matched ones chain on as usual
    assert mgr.allocate_until(mid, 97) and mid.page_ids == [0, F | 0, 2, 1]
    mgr.free(mid)


def test_a_page_shared_with_a_running_sequence_is_not_touched() -> None:
    kv = build()
    pool, mgr = kv.pool, kv.manager
    running = seq("run", [NOW] * 97)
    mgr.match_prefix(running)
    compute(kv, running)  # still running: holds pages 0..3
    before = [page_bytes(kv, p) for p in (0, 1)]
    hashes = list(running.page_hashes)
    later = turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    assert later.page_ids == [F | 0, F | 1, 2] and mgr.aged_pages == 2
    assert running.page_ids == [0, 1, 2, 3] and running.page_hashes == hashes
    assert [pool.ref_count(p) for p in (0, 1, 2, 3)] == [1, 1, 2, 1]
    assert all(torch.equal(page_bytes(kv, p), b) for p, b in zip((0, 1), before))
    assert pool.lookup(hashes[0]) is None  # no new request matches the superseded INT4 pages ...
    mgr.free(running)
    assert pool.page(0) is None and pool.page(1) is None  # ... and they are freed, not cached, when it ends
    assert pool.cached_page_ids() == [] and pool.ref_count(2) == 1


def test_a_leased_page_is_copied_not_changed() -> None:
    kv = build()
    pool, mgr = kv.pool, kv.manager
    first = seq("t1", [NOW] * 97)
    mgr.match_prefix(first)
    compute(kv, first)
    pool.pin("conv", first.page_ids[:3], ttl_s=60, reclaim=RECLAIM_FIRST)  # the retained conversation
    mgr.free(first)
    before = page_bytes(kv, 0)
    later = turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    assert later.page_ids == [F | 0, F | 1, 2]
    assert pool.pin_pages("conv") == [0, 1, 2] and [pool.ref_count(p) for p in (0, 1, 2)] == [1, 1, 2]
    assert torch.equal(page_bytes(kv, 0), before)
    pool.release("conv")
    assert pool.page(0) is None and pool.page(1) is None and pool.ref_count(2) == 1


def test_no_int2_room_skips_age_down_and_partial_room_ages_in_prefix_order() -> None:
    kv = build()
    pool, mgr = kv.pool, kv.manager
    first = seq("t1", [NOW] * 97)
    mgr.match_prefix(first)
    compute(kv, first)
    mgr.free(first)
    # the rest of the buffer held by others: every other slab full of INT4 pages. INT2 pages could
    # take slab 0 (cached pages only), but not while a request holds its pages
    filler4 = pool.allocate([4] * (pool.num_free_pages(bits=4) - 3))  # 3: the cached pages 0..2
    assert filler4 is not None and pool.num_free_pages(bits=2) == pool.slabs.int2_per_slab
    hashes = mgr.page_hashes(seq("x", [NOW] * 97), [4, 4, 4])
    full = turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    assert full.page_ids == [0, 1, 2] and mgr.aged_pages == 0 and full.page_hashes == hashes
    mgr.free(full)
    pool.free(filler4[-pool.slabs.int4_per_slab :])  # the top INT4 slab goes: room for INT2 pages, all but one taken
    extra = pool.allocate([2] * (pool.slabs.int2_per_slab - 1))
    assert extra is not None
    part = turn(kv, "t4", [OLD] * 64 + [NOW] * 33)
    assert part.page_ids == [F | len(extra), 1, 2] and mgr.aged_pages == 1
    assert part.page_hashes == mgr.page_hashes(part, [2, 4, 4])
    assert pool.page(0) is None


def test_a_pulling_worker_ages_its_own_4_bit_pages_instead_of_pulling_int2_copies() -> None:
    """Puller._plan: the sender stores pages 0 and 1 at 2 bits, this worker holds them at 4."""
    kv = build()
    pool, mgr = kv.pool, kv.manager
    first = seq("t1", [NOW] * 97)
    mgr.match_prefix(first)
    compute(kv, first)
    pool.pin("conv", first.page_ids[:3], ttl_s=60, reclaim=RECLAIM_FIRST)  # this worker's retained conversation
    mgr.free(first)
    int4 = [page_kv(kv, 0, layer) for layer in range(2)]
    remote = mgr.page_hashes(seq("x", [OLD] * 64 + [NOW] * 33), [2, 2, 4])
    assert mgr.age_cached([remote[0], remote[1]]) == 2 and mgr.aged_pages == 2
    assert [pool.lookup(h) for h in remote] == [F | 0, F | 1, 2]
    assert sorted(pool.cached_page_ids()) == [F | 0, F | 1]  # ref 0 until the request matches them
    assert [pool.ref_count(p) for p in (0, 1, 2)] == [1, 1, 1]  # the lease still reads the INT4 pages
    want_k, want_v = int2_of(*int4[0])
    assert torch.equal(page_kv(kv, F | 0, 0)[0], want_k) and torch.equal(page_kv(kv, F | 0, 0)[1], want_v)
    assert mgr.age_cached([remote[0], remote[1]]) == 0  # already there
    pool.release("conv")
    assert pool.page(0) is None and pool.page(1) is None
    later = turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    assert later.page_ids == [F | 0, F | 1, 2] and mgr.aged_pages == 2


def test_age_down_off_keeps_the_4_bit_pages() -> None:
    kv = build(age_down=False)
    assert not kv.manager.age_down
    first = seq("t1", [NOW] * 97)
    kv.manager.match_prefix(first)
    compute(kv, first)
    kv.manager.free(first)
    later = turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    assert later.page_ids == [0, 1, 2] and kv.manager.aged_pages == 0


def test_an_aged_page_stays_within_the_bound_of_int4_then_int2() -> None:
    """Per value: |x - aged| <= e4 + (R + 2 e4) / 6 (+ fp16/fp32 slack), with e4 the largest
    INT4 error and R the range of x over the INT2 group (the INT4 values' range is at most
    R + 2 e4; INT2 rounds to half a step of range/3). Direct INT2 has R / 6."""
    kv = build()
    first = seq("t1", [NOW] * 97)
    kv.manager.match_prefix(first)
    compute(kv, first)
    kv.manager.free(first)
    turn(kv, "t3", [OLD] * 64 + [NOW] * 33)
    for layer in range(2):
        rows = [token_kv(t, layer) for t in TOKENS[:P]]
        k, v = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])  # [P, H, D]
        got_k, got_v = page_kv(kv, F | 0, layer)
        for x, got, keys in ((k, got_k, True), (v, got_v, False)):
            e4 = (dequantize_groups(*quantize_groups(x, 4), 4, dtype=torch.float32) - x).abs().max()
            # INT2 groups: keys per (head, channel) over the page's tokens; values per token, 32 channels
            xs = x if keys else x.reshape(P, SHAPE.num_kv_heads, SHAPE.head_dim // 32, 32)
            rng = (xs.amax(dim=0 if keys else -1) - xs.amin(dim=0 if keys else -1)).max()
            err = (got - x).abs().max()
            assert err <= e4 + (rng + 2 * e4) / 6 + 1e-2, (layer, keys, float(err), float(e4), float(rng))


# ---------------------------------------------------------------- the engine on the tiny model


def engine(model_dir: Path, *, age_down: bool, layout: str = "layer_major") -> LLMEngine:
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model_dir)),
            kv_cache=KVCacheConfig(dtype="triaxial", memory_bytes=8 << 20, age_down=age_down, layout=layout),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=1024, chunk_size=512),
        ),
        device="cpu",
        bits_table=TABLE,
    )


def test_engine_greedy_tokens_after_aging_equal_a_non_aged_run(tiny_model_dir: Path) -> None:
    g = torch.Generator().manual_seed(3)
    history = torch.randint(5, 200, (160,), generator=g).tolist()  # five pages: a tool result
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = {}
    for age_down in (False, True):
        eng = engine(tiny_model_dir, age_down=age_down)
        eng.generate([history + [7]], params, tags=[[NOW] * 161])  # turn 1: all current, 4 bits
        follow = history + [7, 8, 9, 10]
        outs[age_down] = eng.generate([follow], params, tags=[[OLD] * 160 + [NOW] * 4])[0]
        assert eng.kv.aged_pages == (5 if age_down else 0)
        assert sum(1 for p in eng.pool.cached_page_ids() if p & F) == (5 if age_down else 0)
        # counted in /internal/kv/stats's snapshot and the worker metric
        stats = collect(eng)
        assert stats.aged_pages == stats.to_dict()["aged_pages"] == eng.kv.aged_pages
        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, role="both")
        metrics.observe(stats)
        metrics.observe(stats)  # moved by the growth only
        assert registry.get_sample_value("kvserving_worker_kv_pages_aged_total") == eng.kv.aged_pages
        # room for everything: every matched page placed and aged, none dropped
        assert (stats.age_down_skipped_pages, stats.admissions_from_scratch, stats.admission_dropped_tokens) == (0, 0, 0)
    # measured: equal greedy tokens on the tiny model (12 of 12)
    assert outs[True] == outs[False]


def test_admission_and_age_down_counters_reach_the_stats_and_the_metrics(tiny_model_dir: Path) -> None:
    """Plumbing: the scheduler's and the manager's counters (set here; their paths are
    tests/worker/test_scheduler_triaxial.py's) in /internal/kv/stats's snapshot and the worker metrics."""
    eng = engine(tiny_model_dir, age_down=True)
    eng.scheduler.from_scratch_admissions, eng.scheduler.dropped_cached_tokens = 2, 160
    eng.kv.age_down_skipped_pages = 3
    stats = collect(eng)
    got = stats.to_dict()
    assert [got[k] for k in ("admissions_from_scratch", "admission_dropped_tokens", "age_down_skipped_pages")] == [2, 160, 3]
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, role="prefill")
    metrics.observe(stats)
    metrics.observe(stats)  # moved by the growth only
    assert [
        registry.get_sample_value(f"kvserving_worker_kv_{name}_total")
        for name in ("admissions_from_scratch", "admission_dropped_tokens", "age_down_skipped_pages")
    ] == [2.0, 160.0, 3.0]


@pytest.mark.parametrize("layer", [0, 1])
def test_aged_attention_error_is_close_to_direct_int2_on_real_kv(tiny_model_dir: Path, layer: int) -> None:
    """Attention-output MSE over the tiny model's real q/k/v with the first pages stored
    INT2 directly from fp32 vs INT4 -> INT2 (age-down): within 1.25x (measured in
    docs/performance-log/age-down.md)."""
    from kvserving.calibrate.codecs import head_mse
    from kvserving.calibrate.measure import capture_qkv
    from kvserving.worker.attention import causal_attention
    from kvserving.worker.model import load_model

    _, model = load_model(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(5, 200, (256,), generator=torch.Generator().manual_seed(5)).tolist()
    cap = capture_qkv(model, ids, device=torch.device("cpu"))
    q, k, v = cap.q[layer], cap.k[layer], cap.v[layer]
    n = 192  # six pages of old tokens, the rest kept exact

    def stored(k4_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kq, vq = k.clone(), v.clone()
        for s in range(0, n, P):
            kp, vp = k[s : s + P], v[s : s + P]
            if k4_first:
                kp = dequantize_groups(*quantize_groups(kp, 4), 4, dtype=torch.float32)
                vp = dequantize_groups(*quantize_groups(vp, 4), 4, dtype=torch.float32)
            kq[s : s + P], vq[s : s + P] = int2_of(kp, vp)
        return kq, vq

    scale = 1.0 / q.shape[-1] ** 0.5
    ref = causal_attention(q, k, v, q_offset=0, sm_scale=scale)
    direct = float(head_mse(causal_attention(q, *stored(False), q_offset=0, sm_scale=scale), ref).mean())
    aged = float(head_mse(causal_attention(q, *stored(True), q_offset=0, sm_scale=scale), ref).mean())
    assert 0 < direct and aged <= 1.25 * direct, (aged, direct)


@pytest.mark.gpu
def test_requantize_on_gpu_writes_the_bytes_of_the_reference() -> None:
    """The same storage op on CUDA tensors (Triton gather to fp32, Triton INT2 writer) gives
    the bytes the CPU reference gives."""
    stores = {}
    for device in ("cpu", "cuda"):
        cfg = KVCacheConfig(dtype="triaxial")
        kv = build_kv_cache(cfg, SHAPE, budget_bytes=1 << 20, device=device, model_dtype=torch.float32, bits_table=TABLE)
        for layer in range(SHAPE.num_layers):
            rows = [token_kv(t, layer) for t in TOKENS[:64]]
            k = torch.stack([r[0] for r in rows]).to(device)
            v = torch.stack([r[1] for r in rows]).to(device)
            ids = torch.tensor([0] * 32 + [1] * 32, dtype=torch.int32, device=device)
            kv.storage.write(layer, k, v, ids, torch.arange(64, dtype=torch.int32, device=device) % 32)
        kv.storage.requantize_to_int2([0, 1], [F | 0, F | 1])
        stores[device] = kv
    for pid in (F | 0, F | 1):
        assert torch.equal(page_bytes(stores["cuda"], pid).cpu(), page_bytes(stores["cpu"], pid))


def test_age_down_on_page_major_kv_writes_the_layer_major_bytes(tiny_model_dir: Path) -> None:
    """kv_cache.layout page_major: the aged INT2 pages of every layer hold the bytes they hold layer-major (the
    requantize reads and writes through each layer's strided view), and the tokens are the same."""
    g = torch.Generator().manual_seed(4)
    history = torch.randint(5, 200, (160,), generator=g).tolist()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    runs = {}
    for layout in ("layer_major", "page_major"):
        eng = engine(tiny_model_dir, age_down=True, layout=layout)
        eng.generate([history + [7]], params, tags=[[NOW] * 161])
        out = eng.generate([history + [7, 8, 9, 10]], params, tags=[[OLD] * 160 + [NOW] * 4])[0]
        st = eng.storage
        aged = sorted(p for p in eng.pool.cached_page_ids() if p & F)
        two = st.int2_layout.page_bytes
        pages = [st.layer(i).buffer[(o := st.layer(i).page_offset(p)) : o + two].clone() for p in aged for i in range(st.shape.num_layers)]
        runs[layout] = (out, aged, pages, eng.kv.aged_pages)
    (lm_out, lm_aged, lm_pages, lm_n), (pm_out, pm_aged, pm_pages, pm_n) = runs["layer_major"], runs["page_major"]
    assert lm_n == pm_n == 5 and lm_aged == pm_aged and pm_out == lm_out
    assert all(torch.equal(a, b) for a, b in zip(lm_pages, pm_pages))


def test_a_chunks_int2_pages_are_written_without_a_host_copy_in_any_layer(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk of whole 2-bit pages is written as INT2 pages from index tensors the step builds once: the
    attention op makes no tensor from a Python list in any layer (on a GPU each such tensor is a copy the host
    waits for, once per layer)."""
    from kvserving.worker import attention

    eng = engine(tiny_model_dir, age_down=False)
    made = torch.tensor
    in_attention = [False]

    def tensor(*args: object, **kwargs: object) -> torch.Tensor:
        assert not in_attention[0], "torch.tensor inside the attention op"
        return made(*args, **kwargs)  # type: ignore[arg-type]

    call = attention.PagedAttention.__call__

    def watched(self: attention.PagedAttention, *args: torch.Tensor) -> torch.Tensor:
        in_attention[0] = True
        try:
            return call(self, *args)  # type: ignore[arg-type]
        finally:
            in_attention[0] = False

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(attention.PagedAttention, "__call__", watched)
    history = torch.randint(5, 200, (160,), generator=torch.Generator().manual_seed(4)).tolist()
    eng.generate([history + [7]], SamplingParams(max_tokens=2, temperature=0.0), tags=[[OLD] * 160 + [NOW]])
    assert sum(1 for p in eng.pool.cached_page_ids() if p & F) == 5  # the five 2-bit pages stored INT2 at prefill
