"""Asynchronous decode (``LLMEngine.step``): a decode step on the graphs is launched before the previous
step's sampled ids are back. On CPU the graphs' static-buffer path runs without capture (``capture=False``),
so these tests run the same host logic as a GPU: the streams (tokens, order, finish reasons, counts, retained
leases) must equal the synchronous engine's and the eager engine's, through stops in the middle of a batch,
max_tokens, aborts, new requests, preemption and triaxial pages; and the one extra KV write of a sequence
that stopped while its next step was in flight lands in a page nobody else can hold until it is done."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.worker import engine as engine_mod
from kvserving.worker.cuda_graphs import DecodeGraphs, pad_pages_needed
from kvserving.worker.engine import LLMEngine, RequestOutput
from kvserving.worker.kv.leases import RetainSpec
from kvserving.worker.sampling import SamplingParams

MODES = ("eager", "sync", "async")


def make(model_dir: Path, mode: str, *, dtype: str = "bf16", kv_bytes: int = 32 << 20, max_seqs: int = 8) -> LLMEngine:
    """``eager``: no graphs; ``sync``: the graphs' static buffers (not captured), async decode off; ``async``: on."""
    config = ServingConfig(
        model=ModelConfig(path=str(model_dir)),
        kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=kv_bytes),
        scheduler=SchedulerConfig(chunk_size=64, max_num_seqs=max_seqs),
    )
    engine = LLMEngine(config, device="cpu", async_decode=mode == "async")
    if mode != "eager":
        pad = engine.pool.allocate([4] * pad_pages_needed(max_seqs, engine.storage.page_size))
        assert pad is not None
        engine.runner.graphs = DecodeGraphs(
            engine.model, engine.attention, device=torch.device("cpu"), max_batch=max_seqs,
            max_pages=engine.runner.max_pages, pad_pages=pad, capture=False,
        )  # fmt: skip
    return engine


Request = tuple[str, list[int], SamplingParams]
Hook = Callable[[LLMEngine, RequestOutput], None]


def record(out: RequestOutput) -> tuple[Any, ...]:
    kept = None if out.retained is None else (out.retained.page_hashes, out.retained.num_tokens)
    return (out.request_id, tuple(out.new_token_ids), out.finished, out.finish_reason, out.num_output_tokens,
            out.num_prompt_tokens, out.num_cached_tokens, kept)  # fmt: skip


def drive(engine: LLMEngine, requests: list[Request], hook: Hook | None = None, *, retain: bool = False) -> list[tuple[Any, ...]]:
    """Every output of every step, in order (``hook`` sees each one as it comes: abort, add, inspect)."""
    for rid, prompt, params in requests:
        spec = RetainSpec(lease_id=f"lease-{rid}", ttl_s=600.0) if retain else None
        engine.add_request(rid, prompt, params, retain=spec)
    stream: list[tuple[Any, ...]] = []
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            stream.append(record(out))
            if hook is not None:
                hook(engine, out)
    assert not engine.has_unfinished() and not engine.step_in_flight
    return stream


def prompts(vocab: int, lengths: tuple[int, ...] = (40, 70, 9, 17, 31)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


def tokens_of(stream: list[tuple[Any, ...]], rid: str) -> list[int]:
    return [t for r in stream if r[0] == rid for t in r[1]]


def first_new(tokens: list[int], at_least: int) -> int:
    """A token of ``tokens`` whose first occurrence is at index >= ``at_least`` (a stop id that stops there)."""
    for i, t in enumerate(tokens):
        if i >= at_least and t not in tokens[:i]:
            return t
    raise AssertionError("no fresh token to stop at")


def held_pages_checked(engine: LLMEngine, seen: list[int]) -> Hook:
    """Wrap ``_InFlight.drop``: each page it holds for a dropped row's in-flight write is private to that
    row: unpublished (no hash), not leased, referenced only by the hold, in no running sequence. Returns the
    hook that checks this after each finished output."""
    pool = engine.pool
    original = engine_mod._InFlight.drop

    def drop(self: Any, seq: Any, pool_: Any, page_size: int) -> None:
        i = self.row_of[id(seq)]
        start = self.chunks[i].start
        page = seq.page_ids[start // page_size]
        # the write is at the sequence's last position: past every page it published (or will retain)
        assert start // page_size >= seq.num_registered_pages and start >= len(seq.prompt_ids)
        original(self, seq, pool_, page_size)
        seen.append(page)

    def check_after_finish(engine: LLMEngine, out: RequestOutput) -> None:
        inflight = engine._inflight
        if not out.finished:
            return
        for page in inflight.held if inflight is not None else []:
            assert pool.page(page) is not None and pool.page(page).hash is None  # type: ignore[union-attr]
            assert pool.ref_count(page) == 1  # the hold only: the sequence's own ref is gone
            assert all(page not in pool.pin_pages(lease) for lease in pool.pin_ids())
            assert all(page not in s.page_ids for s in engine.scheduler.running)
            if out.retained is not None:
                assert page not in out.retained.page_ids

    engine_mod._InFlight.drop = drop  # type: ignore[method-assign]
    _restore.append((engine_mod._InFlight, original))
    return check_after_finish


_restore: list[tuple[Any, Any]] = []


@pytest.fixture(autouse=True)
def _unpatch() -> Any:
    yield
    while _restore:
        cls, fn = _restore.pop()
        cls.drop = fn


@pytest.mark.parametrize("dtype", ["bf16", "triaxial"])
def test_streams_equal_with_stops_lengths_and_sampling(tiny_model_dir: Path, dtype: str) -> None:
    """Greedy and seeded top-k/top-p sampling, max_tokens ending rows at different steps, stop ids ending rows
    in the middle of a batch (their next step already launched), and pages opened at page boundaries."""
    probe = make(tiny_model_dir, "eager", dtype=dtype)
    ps = prompts(probe.vocab_size)
    base = [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=41, temperature=0.8, top_k=40, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=36, temperature=1.1, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=33, ignore_eos=True),
    ]
    ref = drive(probe, [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, base))])
    # r0 and r4 stop on a token they produce mid-stream (not at a max_tokens step), r3 on its sampled one
    stops = {0: first_new(tokens_of(ref, "r0"), 9), 4: first_new(tokens_of(ref, "r4"), 17), 3: first_new(tokens_of(ref, "r3"), 5)}
    params = [
        SamplingParams(**{**{f: getattr(sp, f) for f in ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")},
                          "stop_token_ids": (stops[i],) if i in stops else ()})
        for i, sp in enumerate(base)
    ]  # fmt: skip
    requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]
    streams = {}
    for mode in MODES:
        engine = make(tiny_model_dir, mode, dtype=dtype)
        held: list[int] = []
        streams[mode] = drive(engine, requests, held_pages_checked(engine, held) if mode == "async" else None)
        assert engine.pool.num_owned == (0 if mode == "eager" else pad_pages_needed(8, 16))  # nothing leaked
        if mode == "async":
            assert engine.stats.overlapped_steps > 20
            assert len(held) == 3  # each stop id landed while the next step was in flight
    assert streams["sync"] == streams["eager"]
    assert streams["async"] == streams["eager"]
    finished = {r[0]: r[3] for r in streams["async"] if r[2]}
    assert finished == {"r0": "stop", "r1": "length", "r2": "length", "r3": "stop", "r4": "stop"}


def test_retained_leases_and_prefix_cache_equal(tiny_model_dir: Path) -> None:
    """Requests that keep their pages under a lease when they finish (stop mid-batch, max_tokens): the
    leases hold the same pages (by hash) and the prefix cache the same hashes with async decode on or off;
    the extra write of a stopped row is never in a leased, published or shared page."""
    probe = make(tiny_model_dir, "eager")
    ps = prompts(probe.vocab_size, (47, 16, 80))
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = drive(probe, [(f"r{i}", p, greedy) for i, p in enumerate(ps)])
    stop0 = first_new(tokens_of(ref, "r0"), 16)  # r0 stops at its 17th+ token: positions 63..64 straddle a page
    requests = [("r0", ps[0], SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop0,))),
                ("r1", ps[1], SamplingParams(max_tokens=33, ignore_eos=True)),
                ("r2", ps[2], greedy)]  # fmt: skip
    results = {}
    for mode in ("sync", "async"):
        engine = make(tiny_model_dir, mode)
        held: list[int] = []
        stream = drive(engine, requests, held_pages_checked(engine, held) if mode == "async" else None, retain=True)
        pool = engine.pool
        leases = {lid: sorted(pool.page(pid).hash for pid in pool.pin_pages(lid)) for lid in pool.pin_ids()}  # type: ignore[union-attr]
        cached = sorted(h for pid in pool.live_page_ids() if (h := pool.page(pid).hash) is not None)  # type: ignore[union-attr]
        results[mode] = (stream, leases, cached)
        if mode == "async":
            assert len(held) == 1 and all(pool.page(pid) is None or pool.page(pid).hash is None for pid in held)  # type: ignore[union-attr]
    assert results["async"] == results["sync"]
    stream, leases, _ = results["async"]
    assert set(leases) == {"lease-r0", "lease-r1", "lease-r2"}
    assert {r[0]: r[3] for r in stream if r[2]} == {"r0": "stop", "r1": "length", "r2": "length"}


def per_request(stream: list[tuple[Any, ...]]) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for r in stream:
        out.setdefault(r[0], []).append(r)
    return out


@pytest.mark.parametrize("late", [False, True])
def test_abort_and_new_request_mid_stream(tiny_model_dir: Path, late: bool) -> None:
    """An abort while the aborted request's next step is in flight gives it no more tokens (the same stream
    as the synchronous engine's). A request added mid-stream runs after the step in flight (which was
    launched without it): every request's own stream is the same, the interleaving one step later."""
    probe = make(tiny_model_dir, "eager")
    ps = prompts(probe.vocab_size)
    greedy = SamplingParams(max_tokens=28, ignore_eos=True)
    requests = [(f"r{i}", p, greedy) for i, p in enumerate(ps[:4])]

    def hook(engine: LLMEngine, out: RequestOutput) -> None:
        if out.request_id == "r1" and out.num_output_tokens == 6:
            engine.abort("r1")
        if late and out.request_id == "r2" and out.num_output_tokens == 9:
            engine.add_request("late", ps[4], SamplingParams(max_tokens=14, ignore_eos=True))
        if out.request_id == "r3" and out.num_output_tokens == 20:
            engine.abort("r0")

    streams = {}
    for mode in MODES:
        engine = make(tiny_model_dir, mode)
        streams[mode] = drive(engine, requests, hook)
        assert engine.pool.num_owned == (0 if mode == "eager" else pad_pages_needed(8, 16))
        if mode == "async":
            assert engine.stats.overlapped_steps > 10
    assert streams["sync"] == streams["eager"]
    if late:
        assert per_request(streams["async"]) == per_request(streams["sync"])
        assert len(tokens_of(streams["async"], "late")) == 14
    else:
        assert streams["async"] == streams["sync"]
    assert len(tokens_of(streams["async"], "r1")) == 6 and len(tokens_of(streams["async"], "r0")) == 20


def test_preemption_falls_back_to_synchronous_steps(tiny_model_dir: Path) -> None:
    """A pool too small for every sequence's decode pages (6 pages): steps that would preempt run
    synchronously, and the streams equal the synchronous engine's."""
    probe = make(tiny_model_dir, "eager")
    ps = prompts(probe.vocab_size, (20, 28, 18, 25))
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    requests = [(f"r{i}", p, greedy) for i, p in enumerate(ps)]
    streams = {}
    for mode in ("sync", "async"):
        engine = make(tiny_model_dir, mode, kv_bytes=384 << 10)
        streams[mode] = drive(engine, requests)
        assert engine.stats.preemptions > 0
        if mode == "async":
            assert engine.stats.overlapped_steps > 10
    assert streams["async"] == streams["sync"]
    assert all(len(tokens_of(streams["async"], f"r{i}")) == 30 for i in range(4))


def test_flush_returns_the_step_in_flight(tiny_model_dir: Path) -> None:
    """The first decode step of a run is launched and returns nothing; ``flush`` waits for it."""
    engine = make(tiny_model_dir, "async")
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=5, ignore_eos=True))
    first = engine.step()  # the prompt: synchronous
    assert [o.num_output_tokens for o in first] == [1] and not engine.step_in_flight
    assert engine.step() == [] and engine.step_in_flight
    out = engine.flush()
    assert [o.num_output_tokens for o in out] == [2] and not engine.step_in_flight
    rest = [o for _ in range(10) if engine.has_unfinished() for o in engine.step()]
    assert [o.num_output_tokens for o in rest] == [3, 4, 5] and rest[-1].finish_reason == "length"
    assert engine.generate([[9, 10, 11]], SamplingParams(max_tokens=7, ignore_eos=True))[0] == \
        make(tiny_model_dir, "eager").generate([[9, 10, 11]], SamplingParams(max_tokens=7, ignore_eos=True))[0]  # fmt: skip


def test_async_engine_streams_over_async_decode(tiny_model_dir: Path) -> None:
    """The serving loop (AsyncEngine) on an engine with asynchronous decode: each stream gets its tokens in
    order, equal to the offline outputs, one output per token, the last one finished."""
    import asyncio

    from kvserving.worker.async_engine import AsyncEngine

    engine = make(tiny_model_dir, "async")
    ps = prompts(engine.vocab_size, (12, 30, 7))
    params = SamplingParams(max_tokens=18, ignore_eos=True)
    want = make(tiny_model_dir, "eager").generate(ps, params)

    async def main() -> list[list[RequestOutput]]:
        served = AsyncEngine(engine)
        try:

            async def collect(rid: str, prompt: list[int]) -> list[RequestOutput]:
                return [o async for o in served.generate(rid, prompt, params)]

            tasks = [asyncio.create_task(collect(f"a{i}", p)) for i, p in enumerate(ps)]
            return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=120))
        finally:
            await served.close()

    results = asyncio.run(main())
    assert [[t for o in outs for t in o.new_token_ids] for outs in results] == want
    assert all([o.num_output_tokens for o in outs] == list(range(1, 19)) and outs[-1].finished for outs in results)
    assert engine.stats.overlapped_steps > 5
