"""A mixed workload under a tight pool: chunked prefill, shared prefixes,
preemption and arrivals mid-run, each request's tokens equal to running it
alone, and every page back in the pool at the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.tags import encode_tag
from kvserving.worker.engine import LLMEngine
from kvserving.worker.sampling import SamplingParams


def engine(model_dir: Path, dtype: str, pages: int) -> LLMEngine:
    page = 32 if dtype == "triaxial" else 16
    probe = LLMEngine(ServingConfig(model=ModelConfig(path=str(model_dir)), kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=1 << 20)))
    per_page = probe.storage.layout.page_bytes * probe.args.num_layers
    return LLMEngine(
        ServingConfig(
            model=ModelConfig(path=str(model_dir)),
            kv_cache=KVCacheConfig(dtype=dtype, memory_bytes=pages * per_page),
            scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=4 * page, chunk_size=2 * page),
        )
    )


@pytest.mark.parametrize(("dtype", "pages"), [("bf16", 8), ("triaxial", 6)])  # triaxial: whole slabs of 3 INT4 pages
def test_tight_pool_mixed_workload_equals_isolated_runs(tiny_model_dir: Path, dtype: str, pages: int) -> None:
    rng = random.Random(11)
    shared = [rng.randrange(10, 4000) for _ in range(40)]
    old, now = encode_tag("older", "text", "obs"), encode_tag("current", "text", "user")
    requests = []
    for n in range(8):
        prompt = (shared if n % 2 else []) + [rng.randrange(10, 4000) for _ in range(rng.randrange(1, 60))]
        # earlier turns, then the current one: full pages of old tokens go INT2
        cut = max(0, len(prompt) - rng.randrange(1, 12))
        tags = [old] * cut + [now] * (len(prompt) - cut)
        requests.append((f"r{n}", prompt, tags, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True)))

    alone = {}
    for rid, prompt, tags, params in requests:
        solo = engine(tiny_model_dir, dtype, 64)
        alone[rid] = solo.generate([prompt], params, tags=[tags])[0]

    busy = engine(tiny_model_dir, dtype, pages)
    got: dict[str, list[int]] = {rid: [] for rid, _, _, _ in requests}
    pending = list(requests)
    steps = 0
    while pending or busy.has_unfinished():
        if pending and steps % 2 == 0:  # arrivals while others run
            rid, prompt, tags, params = pending.pop(0)
            busy.add_request(rid, prompt, params, tags=tags)
        for out in busy.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
        assert steps < 2000
    assert got == alone
    assert busy.stats.preemptions > 0  # the pool really was too small for the batch
    assert busy.pool.num_owned == 0  # every page was returned (only cached pages remain)
    if dtype == "triaxial":
        assert any(pid & INT2_PAGE_FLAG for pid in busy.pool.cached_page_ids())  # INT2 pages were in play
