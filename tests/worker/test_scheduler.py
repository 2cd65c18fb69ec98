"""The scheduler under page pressure, driven step by step against the real KV manager and pool:
the newest running sequence is preempted, a step that preempted admits no waiting sequence, and a
sequence is admitted only with pages for all its known tokens (admitted with less, the victim would
recompute a chunk the next growth preempts again)."""

from __future__ import annotations

import torch

from kvserving.config import SchedulerConfig
from kvserving.kernels.page_ids import page_id_bits
from kvserving.worker.kv.leases import pin_for_admission
from kvserving.worker.kv.manager import KVCacheManager
from kvserving.worker.kv.page_pool import PagePool
from kvserving.worker.sampling import SamplingParams
from kvserving.worker.scheduler import Scheduler
from kvserving.worker.sequence import Sequence, SeqStatus

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
    # admits nothing. b comes back only with pages for all it knows (60 prompt + 6 sampled tokens: 5
    # pages), which a's growth leaves it only when a samples its 20th token at step 20; b then recomputes
    # and ends at step 35. Admitted with its first chunk's pages alone, b was readmitted and preempted
    # again every other step (8 times, the same 35 steps); admitted in the preempting step as well, at
    # every step from 6 to 20 (15 times).
    steps = [i + 1 for i, p in enumerate(preempted) if p]
    assert all(preempted[i - 1] == ["b"] for i in steps)
    assert steps == [6] and len(preempted) == 35
    assert a.output_ids == b.output_ids == [1000 + i for i in range(20)]
    assert kv.pool.num_free == 9  # every page back (cached pages count as free: evictable)


def test_long_prompts_wait_for_their_pages_instead_of_preempting_each_other() -> None:
    """A prefill worker's load (one token each): three 150-token prompts, 10 pages each, in a pool of 12."""
    kv = KVCacheManager(PagePool(12, page_size=PAGE), page_size=PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, chunk_size=64), kv)
    seqs = [
        Sequence(name, list(range(k, k + 150)), SamplingParams(max_tokens=1), torch.Generator())
        for k, name in ((0, "a"), (200, "b"), (400, "c"))
    ]
    for seq in seqs:
        sched.add(seq)
    preempted: list[list[str]] = []
    while sched.has_work():
        preempted.append(_advance(sched, 1))
        assert len(preempted) < 100, "the prompts never finished"
    # Each prompt takes 3 steps of chunks (64, 64, 22 tokens) alone in the pool: a in steps 1-3, b in
    # 4-6, c in 7-9, none preempted. Admitted with its first chunk's pages, b came in beside a at step 1
    # and a's growth preempted it at step 2, then b's growth preempted c at step 5: 80 prompt tokens
    # computed twice (8 steps, some with two prompts' chunks).
    assert preempted == [[]] * 9
    assert [s.output_ids for s in seqs] == [[1000]] * 3
    assert kv.pool.num_free == 12


def _pulled(kv: KVCacheManager, sched: Scheduler, prompt: list[int]) -> tuple[Sequence, str]:
    """``prompt``'s full pages in the prefix cache, pinned for admission as a pull leaves them
    (``Puller._adopt``), and the request waiting for them."""
    seed = Sequence("seed", prompt, SamplingParams(max_tokens=1), torch.Generator())
    sched.add(seed)
    while sched.has_work():
        _advance(sched, 1)
    pages = [kv.pool.lookup(h) for h in kv.page_hashes(seed, [page_id_bits(0)] * (len(prompt) // PAGE))]
    assert None not in pages
    pin = pin_for_admission(kv.pool, [p for p in pages if p is not None], pulled=[p for p in pages if p is not None], ttl_s=60.0)
    return Sequence("pulled", prompt, SamplingParams(max_tokens=4), torch.Generator()), pin


def test_pages_pulled_for_a_waiting_request_never_yield_to_the_admission_ahead_of_it_while_a_sequence_runs() -> None:
    """10 pages; a request's 4 pulled pages pinned while it waits behind another prompt.

    A sequence running (32 + 30 tokens: 2 pages, growing to 4) leaves 2 free pages to a 5-page
    prompt ahead of the pulled request: the prompt waits for the running sequence's end (6 free)
    instead of taking the pulled pages (taken, the request behind computes its 64 tokens again),
    and the pulled request, admitted when the prompt ends, finds all 64."""
    kv = KVCacheManager(PagePool(10, page_size=PAGE), page_size=PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=128), kv)
    waiting, pin = _pulled(kv, sched, list(range(500, 565)))  # 65 tokens: 4 full pages
    sched.add(Sequence("run", list(range(32)), SamplingParams(max_tokens=30), torch.Generator()))
    _advance(sched, 30)
    head = Sequence("head", list(range(1000, 1080)), SamplingParams(max_tokens=4), torch.Generator())
    sched.add(head)
    sched.add(waiting)
    for _ in range(200):
        if waiting.status is not SeqStatus.WAITING:
            break
        _advance(sched, 30)
    assert head.num_cached_prompt == 0 and waiting.status is not SeqStatus.WAITING
    assert kv.pool.get_pin(pin) is not None  # never reclaimed: the running sequence's end made room
    assert waiting.num_cached_prompt == 64
