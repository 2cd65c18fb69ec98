"""The scheduler under page pressure, driven step by step against the real KV manager and pool:
the newest running sequence is preempted, and a step that preempted admits no waiting sequence
(admitted at once, the victim would recompute a chunk the next step's growth preempts again)."""

from __future__ import annotations

import torch

from kvserving.config import SchedulerConfig
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.page_pool import PagePool
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.scheduler import Scheduler
from kvserving.worker.sequence import Sequence

PAGE = 16


def _advance(sched: Scheduler, max_tokens: int) -> list[str]:
    """One engine step without a model (``LLMEngine``'s postprocessing): each chunk computed, its
    full pages published, a token sampled where a chunk reaches the sequence's end; returns the ids
    of the sequences the step preempted."""
    out = sched.schedule()
    for c in out.chunks:
        seq = c.seq
        seq.num_computed = c.start + c.num_tokens
        sched.kv.publish_full_pages(seq)
        if c.samples:
            seq.output_ids.append(1000 + len(seq.output_ids))
            if len(seq.output_ids) == max_tokens:
                sched.finish(seq, "length")
    return [s.request_id for s in out.preempted]


def test_a_step_that_preempts_admits_nothing_and_the_victim_waits_for_pages() -> None:
    kv = KVCacheManager(PagePool(9, page_size=PAGE), page_size=PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=64), kv)
    a = Sequence("a", list(range(60)), SamplingParams(max_tokens=20), torch.Generator())
    b = Sequence("b", list(range(100, 160)), SamplingParams(max_tokens=20), torch.Generator())
    sched.add(a)
    sched.add(b)
    preempted: list[list[str]] = []
    while sched.has_work():
        preempted.append(_advance(sched, 20))
        assert len(preempted) < 100, "the two sequences never finished"
    # Step 1 computes both prompts (4 pages each) and samples; a reaches 64 tokens first and takes the
    # ninth page at step 5; at step 6 b needs a fifth page, finds none and is preempted, and that step
    # admits nothing. Readmitted, b is placed from scratch for a 64-token chunk (its cached prefix
    # leaves no page for the rest) and preempted again when it needs its fifth page: every other step
    # until a samples its 20th token at step 20 and frees its pages; b ends at step 35. Admitting in
    # the preempting step as well preempted b at every step from 6 to 20 (15 times, the same 35 steps).
    steps = [i + 1 for i, p in enumerate(preempted) if p]
    assert all(preempted[i - 1] == ["b"] for i in steps)
    assert steps == [6, 8, 10, 12, 14, 16, 18, 20] and len(preempted) == 35
    assert a.output_ids == b.output_ids == [1000 + i for i in range(20)]
    assert kv.pool.num_free == 9  # every page back (cached pages count as free: evictable)
