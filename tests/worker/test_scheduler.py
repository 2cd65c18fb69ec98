"""The scheduler under page pressure, driven step by step against the real KV manager and pool:
the newest running sequence is preempted, a step that preempted admits no waiting sequence, and a
sequence is admitted only with pages for all its known tokens (admitted with less, the victim would
recompute a chunk the next growth preempts again)."""

from __future__ import annotations

import torch
from engine_steps import step

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


def _pulled_request(kv: KVCacheManager, sched: Scheduler, name: str, prefix: list[int], rest: list[int]) -> Sequence:
    """A request ``prefix`` (64 tokens) + ``rest`` whose first 4 pages were pulled: the prefix computed
    here (a seed of 65 tokens), its 4 full pages pinned for the request's admission (``Puller._adopt``)."""
    seed = Sequence(f"seed-{name}", [*prefix, 0], SamplingParams(max_tokens=1), torch.Generator())
    sched.add(seed)
    while sched.has_work():
        _advance(sched, 1)
    pages = [kv.pool.lookup(h) for h in kv.page_hashes(seed, [page_id_bits(0)] * 4)]
    held = [p for p in pages if p is not None]
    assert len(held) == 4
    seq = Sequence(name, [*prefix, *rest], SamplingParams(max_tokens=2), torch.Generator())
    seq.admission_pin = pin_for_admission(kv.pool, held, pulled=held, ttl_s=60.0)
    return seq


def _idle_queue(num_pages: int, pulled: list[tuple[str, int, int]]) -> tuple[KVCacheManager, Scheduler, dict[str, Sequence]]:
    """A pool of ``num_pages`` with nothing running; per ``(name, first token, new tokens)`` a request of
    64 pulled tokens (4 pages pinned for its admission, in the order given) + that many new ones."""
    kv = KVCacheManager(PagePool(num_pages, page_size=PAGE), page_size=PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=256), kv)
    reqs = {name: _pulled_request(kv, sched, name, list(range(k, k + 64)), list(range(k + 5000, k + 5000 + r))) for name, k, r in pulled}
    return kv, sched, reqs


def _prompt(n: int) -> Sequence:
    return Sequence("head", list(range(3000, 3000 + n)), SamplingParams(max_tokens=1), torch.Generator())


def test_an_idle_queue_runs_a_pulled_request_that_fits_before_the_head_that_would_take_its_pages() -> None:
    """10 pages, nothing running: a request's 4 pulled pages (0-3) pinned, 6 free, and ahead of it a
    100-token prompt (7 pages) that fits only by taking them. The pulled request (65 tokens: one new
    page) runs first, with all 64 of its pulled tokens; it ends a step later (2 tokens) and the head
    takes its pages, cached now. Before, the head took the pin at step 1 (nothing ran to free pages)
    and the pulled request computed its 64 tokens again."""
    kv, sched, reqs = _idle_queue(10, [("a", 500, 1)])
    a = reqs["a"]
    assert kv.pool.num_free == 6 and [pin.page_ids for pin in kv.pool.pins()] == [(0, 1, 2, 3)]
    head = _prompt(100)
    sched.add(head)
    sched.add(a)
    steps = []
    while sched.has_work():
        steps.append(step(sched))
        assert len(steps) < 20
    assert steps == [[("a", [0, 1, 2, 3, 4])], [], [("head", [0, 1, 2, 3, 4, 5, 6])]]
    assert (a.num_cached_prompt, a.num_pulled_prompt) == (64, 64)
    assert kv.pool.pins() == [] and kv.pool.num_free == 10


def test_an_idle_queue_that_nothing_else_moves_takes_the_pins_and_runs_to_the_end() -> None:
    """12 pages, nothing running: b's pulled pages 0-3 and c's 4-7 pinned, 4 free (8-11); b and c
    (64 pulled + 80 new tokens: 9 pages, 5 new each) wait behind a 100-token prompt (7 pages). None
    fits without someone's pins and nothing runs that would free pages, so the head takes the 3 pages
    it lacks from the tail of the earliest pin (b's: pages 3, 2, 1) and runs (no deadlock); b keeps
    page 0 pinned and c's pin survives. At step 2 nothing runs again and b, now the head, would fit
    only with c's pages: c (5 new pages, its own 4 pulled) runs ahead of it with all 64 pulled tokens,
    and b computes at step 4 all but the pulled page its pin kept. Before, b took c's pin at step 2
    as well (c computed its 64 tokens again), and the head took b's whole pin (b computed all 64)."""
    kv, sched, reqs = _idle_queue(12, [("b", 500, 80), ("c", 700, 80)])
    b, c = reqs["b"], reqs["c"]
    assert kv.pool.num_free == 4 and [pin.page_ids for pin in kv.pool.pins()] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    head = _prompt(100)
    for seq in (head, b, c):
        sched.add(seq)
    steps = []
    while sched.has_work():
        steps.append(step(sched))
        assert len(steps) < 20, "the queue never drained"
    assert steps == [
        [("head", [8, 9, 10, 11, 1, 2, 3])],
        [("c", [4, 5, 6, 7, 1, 2, 3, 9, 10])],
        [],
        [("b", [0, 1, 2, 3, 6, 7, 8, 9, 10])],
        [],
    ]
    assert (c.num_cached_prompt, c.num_pulled_prompt) == (64, 64)
    assert (b.num_cached_prompt, b.num_pulled_prompt) == (16, 16)
    assert (kv.pool.trimmed_pages, kv.pool.reclaimed_pins) == (3, 0)
    assert kv.pool.pins() == [] and kv.pool.num_free == 12


def test_only_requests_queued_before_the_head_was_held_up_overtake_it() -> None:
    """12 pages, nothing running: b's pulled pages 0-3 and c's 4-7 pinned, 4 free. At step 1 a
    140-token prompt (9 pages) is held up and b (64 pulled + 40 new tokens: 3 new pages), queued
    before that, runs ahead of it. c (64 + 20: 2 new pages) is queued only after step 1: when b ends
    (step 2) and nothing runs, c would fit without pins but may not overtake the head, which takes
    the one page it lacks (8 pages free or cached, 9 needed) from the tail of c's pin at step 3; c
    then finds the 3 pulled pages its pin kept. Without the bound a stream of late requests that fit
    could hold the head up forever."""
    kv, sched, reqs = _idle_queue(12, [("b", 500, 40), ("c", 700, 20)])
    b, c = reqs["b"], reqs["c"]
    head = _prompt(140)
    sched.add(head)
    sched.add(b)
    steps = [step(sched)]
    sched.add(c)
    while sched.has_work():
        steps.append(step(sched))
        assert len(steps) < 20
    assert steps == [
        [("b", [0, 1, 2, 3, 8, 9, 10])],
        [],
        [("head", [7, 8, 9, 10, 11, 0, 1, 2, 3])],
        [("c", [4, 5, 6, 0, 1, 2])],
        [],
    ]
    assert (b.num_cached_prompt, b.num_pulled_prompt) == (64, 64)
    assert (c.num_cached_prompt, c.num_pulled_prompt) == (48, 48)
    assert kv.pool.pins() == [] and kv.pool.num_free == 12


def test_a_running_sequence_takes_only_the_last_page_of_an_admission_pin_and_the_request_keeps_the_rest() -> None:
    """12 pages: a request's 8 pulled pages (0-7) pinned for its admission; it needs one new page and waits
    while a running sequence (49 + 20 tokens) holds the other 4 (8-11). When that sequence grows past
    64 tokens the pool is full: it takes the pin's last page (7) only, the pin keeps pages 0-6, and the
    request, admitted when the sequence ends, finds all 7 (112 tokens) pulled. Before, the whole pin
    yielded, every later allocation could evict its pages, and the request computed what it lost."""
    kv = KVCacheManager(PagePool(12, page_size=PAGE), page_size=PAGE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, chunk_size=256), kv)
    seed = Sequence("seed", list(range(500, 629)), SamplingParams(max_tokens=1), torch.Generator())
    sched.add(seed)
    while sched.has_work():
        step(sched)
    pages = [kv.pool.lookup(h) for h in kv.page_hashes(seed, [page_id_bits(0)] * 8)]
    assert pages == list(range(8))
    waiting = Sequence("pulled", list(range(500, 629)), SamplingParams(max_tokens=2), torch.Generator())
    waiting.admission_pin = pin = pin_for_admission(kv.pool, list(range(8)), pulled=list(range(8)), ttl_s=60.0)
    run = Sequence("run", list(range(49)), SamplingParams(max_tokens=20), torch.Generator())
    sched.add(run)
    sched.add(waiting)
    steps = []
    trimmed_at = None
    while sched.has_work():
        steps.append(step(sched))
        if trimmed_at is None and len(run.page_ids) == 5:
            trimmed_at = len(steps)
            assert run.page_ids == [8, 9, 10, 11, 7]
            assert kv.pool.pin_pages(pin) == [0, 1, 2, 3, 4, 5, 6] and kv.pool.pin_ids() == [pin]
        assert len(steps) < 50
    assert trimmed_at == 17  # the step whose token is run's 65th
    assert [i for i, s in enumerate(steps) if s] == [0, 20]
    assert steps[20] == [("pulled", [0, 1, 2, 3, 4, 5, 6, 7, 10])]  # page 7 free again when run ended
    assert (waiting.num_cached_prompt, waiting.num_pulled_prompt) == (112, 112)
    assert (kv.pool.trimmed_pages, kv.pool.reclaimed_pins) == (1, 0)
    assert kv.pool.pins() == [] and kv.pool.num_free == 12
